"""pipe.stats(), the merged execution trace and PIPEDREAM_LOG=debug (CPU, Gloo, 2 ranks).

    torchrun --standalone --nproc-per-node 2 tests/test_observability.py
"""
from __future__ import annotations

import collections
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import ROOT, CaseRef, Cases, Launch, parametrize_cases, worker_main

M, STEPS, WIDTH, BATCH = 4, 3, 12, 8


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3))


def check_stats_and_trace() -> None:
    import pipedream_ext as pd

    rank = dist.get_rank()
    path = os.path.join(os.environ["OBS_DIR"], "run.json")
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=M,
                        balance=[2, 2], trace=path, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        pipe.step(x, y)
        opt.step(); opt.zero_grad()

    stats = pipe.stats()
    # Exact bytes: every microbatch's activation (rank 0) or gradient (rank 1), each
    # (BATCH / M) x WIDTH float32, every step (headers and padding not counted).
    assert stats["bytes_sent"] == STEPS * M * (BATCH // M) * WIDTH * 4, stats
    assert stats["sends"] == stats["receives"] == STEPS * M, stats
    # One message per transfer (csrc/runtime/comm_engine.h, fused protocol), but in the
    # first step, which learns each slot's size: a header, then the payload on the side
    # channel. Every receive is posted at its RECV action, ahead of its consumer.
    assert stats["messages_sent"] == STEPS * M + M and stats["redirected_sends"] == M, stats
    assert stats["preposted_receives"] == STEPS * M and stats["padding_bytes"] == 0, stats
    assert stats["host_syncs"] == 0, stats
    assert stats["steps"] == STEPS and stats["peak_activations"] == (2 if rank == 0 else 1), stats
    assert 0 < stats["compute_s"] <= stats["busy_s"] and 0 <= stats["bubble_fraction"] < 1, stats
    # Posting receives is a span of its own ("RECV_POST"), not time outside every span.
    assert set(stats["seconds_by_kind"]) >= {"F", "B", "RECV_POST"}, stats
    # A send is released once the schedule proves it received (csrc/core/receipt.h):
    # rank 1's gradient of microbatch i when rank 0's forward of i + 2 arrives, so 1F1B
    # on 2 ranks holds 2 sends at most, not one per microbatch (M = 4).
    assert stats["peak_sends_in_flight"] == 2, stats
    # A flushed step runs every action; the last stage keeps the step's M targets (only
    # it computes a loss) until the next step replaces them.
    assert stats["held_targets"] == (M if rank == 1 else 0), stats
    assert 0 < stats["executor_actions"] == stats["executor_position"], stats

    written = pipe.write_trace()
    assert (written == path) == (rank == 0), written
    if rank == 0:
        with open(path) as f:
            trace = json.load(f)
        spans = collections.defaultdict(collections.Counter)
        for e in trace["traceEvents"]:
            if e["ph"] == "X":
                assert e["dur"] >= 1 and e["ts"] >= 0, e
                spans[e["pid"]][e["name"]] += 1
        # One track per rank with exactly its schedule's F, B and SEND actions, every step.
        schedule = pd.schedules.build("1f1b", stages=2, microbatches=M)
        for r in (0, 1):
            # (U is the caller's optimizer step in flush schedules: not run by the runtime.)
            expected = collections.Counter(
                str(a) for a in schedule.actions(r, comm=True)
                if a.kind not in (pd.schedules.ActionKind.RECV_F, pd.schedules.ActionKind.RECV_B,
                                  pd.schedules.ActionKind.UPDATE))
            actual = collections.Counter({n: c for n, c in spans[r].items()
                                          if "RECV" not in n and "wait" not in n})
            assert actual == collections.Counter({n: c * STEPS for n, c in expected.items()}), \
                (r, actual, expected)
        # Waits on receives are on the receiving rank only.
        assert any("RECV_F" in n for n in spans[1]) and not any("RECV_F" in n for n in spans[0])
        # Every receive posted, every step, as "post <action>" (the wait keeps the
        # action's own name, which a trace pairs with its send).
        for r in (0, 1):
            posted = collections.Counter(f"post {a}" for a in schedule.actions(r, comm=True)
                                         if a.kind in (pd.schedules.ActionKind.RECV_F,
                                                       pd.schedules.ActionKind.RECV_B))
            actual = collections.Counter({n: c for n, c in spans[r].items() if n.startswith("post ")})
            assert posted and actual == collections.Counter({n: c * STEPS for n, c in posted.items()}), \
                (r, actual, posted)
        assert {e["cat"] for e in trace["traceEvents"] if e["name"].startswith("post ")} == {"post"}
        names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert names == {"rank 0: stages [0]", "rank 1: stages [1]"}, names
    pipe.close()  # writes the trace again with what ran since: nothing, so the file stays
    if rank == 0:
        with open(path) as f:
            assert json.load(f) == trace, "close() replaced the trace write_trace() wrote"

    # Only the user's references keep a pipeline (its executor, its process group) alive.
    ref = weakref.ref(pipe)
    del pipe, opt
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


STATS_KEYS = {"compute_s", "wait_s", "busy_s", "actions", "steps", "seconds_by_kind", "bytes_sent",
              "bytes_received", "sends", "receives", "messages_sent", "preposted_receives",
              "redirected_sends", "padding_bytes", "host_syncs",
              "peak_activations", "peak_sends_in_flight", "peak_weight_versions",
              "weight_bytes_copied", "overlap_yields", "bubble_fraction"}


def check_reset_stats(rank: int) -> None:
    """reset_stats() zeroes everything stats() counts: the communication engine's bytes and
    transfers and the weight stores' copies too (an asynchronous pipeline has both)."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="pipedream", balance=[2, 2],
                        timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
            pipe.step(x, y, optimizer=opt)

    steps(6)
    before = pipe.stats()
    assert set(before) == STATS_KEYS | {"rank", "stages", "held_targets", "executor_actions",
                                       "executor_position"}, sorted(before)
    assert before["bytes_sent"] > 0 and before["bytes_received"] > 0, before
    assert before["sends"] > 0 and before["receives"] > 0 and before["steps"] == 6, before
    if rank == 0:  # stage 0 of 2 keeps 2 versions: updating a needed one copies it
        assert before["weight_bytes_copied"] > 0, before
    pipe.reset_stats()
    after = pipe.stats()
    for key in STATS_KEYS - {"seconds_by_kind", "peak_weight_versions"}:
        assert after[key] == 0, (key, after)
    assert after["seconds_by_kind"] == {}, after
    steps(2)
    again = pipe.stats()
    assert again["steps"] == 2 and 0 < again["sends"] < before["sends"], (again, before)
    assert 0 < again["bytes_sent"] < before["bytes_sent"], (again, before)
    pipe.flush()
    pipe = opt = None  # (not del: the closure steps() uses them)
    gc.collect()


def _first_file(paths: Sequence[str], seconds: float = 60.0) -> Optional[str]:
    """The first of ``paths`` that exists (polled, in order), or ``None`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in paths:
            if os.path.exists(path):
                return path
        time.sleep(0.01)
    return None


class _SignallingWork:
    """An all-reduce's handle that creates ``path`` when something starts waiting for it."""

    def __init__(self, work: Any, path: str) -> None:
        self.work, self.path = work, path

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        open(self.path, "a").close()
        return self.work.wait(*args, **kwargs)


def check_step_under_torch_profiler(rank: int) -> None:
    """Under torch.profiler, step() returns with its loss all-reduce finished; without it,
    before. torch ends its record of a collective on the backend's thread when the
    collective completes: one still running when the profiler stopped corrupts the heap
    (benchmarks/README.md, "heap"; tests/repro/profiler_collective_after_stop.py).
    Rank 1 starts its all-reduce only once rank 0 has either left the profiler (or
    step()) or started waiting for the all-reduce, whichever comes first."""
    from torch.profiler import ProfilerActivity, profile

    import pipedream_ext as pd
    from pipedream_ext._dist import collectives

    folder = os.environ["OBS_DIR"]
    # check_agreement=0: no step waits for its loss to check the ranks' arguments.
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=M,
                        balance=[2, 2], timeout=60, check_agreement=0)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    start = collectives.all_reduce_start
    for profiled, left in ((True, "profiler-stopped"), (False, "step-returned")):
        left, waiting = os.path.join(folder, left), os.path.join(folder, f"waiting-{profiled}")
        first: List[Optional[str]] = []
        works: List[Any] = []

        def patched(value: Any, group: Any) -> Any:
            if rank == 0:
                total, work = start(value, group)
                works.append(work)
                return total, _SignallingWork(work, waiting)
            first.append(_first_file([left, waiting]))
            return start(value, group)

        collectives.all_reduce_start = patched
        try:
            if profiled and rank == 0:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    loss = pipe.step(x, y)
                    running = [w for w in works if not w.is_completed()]
            else:
                loss = pipe.step(x, y)
            if rank == 0:
                open(left, "w").close()
        finally:
            collectives.all_reduce_start = start
        assert math.isfinite(float(loss)), loss
        if rank == 0 and profiled:
            assert works and not running, f"{len(running)} of {len(works)} all-reduces running as the profiler stopped"
            assert "gloo:all_reduce" in {e.name for e in prof.events()}  # which the profiler recorded
        if rank == 1:  # without the profiler, rank 0's step() returned before the all-reduce finished
            assert first == [waiting if profiled else left], (profiled, first)
    pipe.close()


def observability_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(check_stats_and_trace)
    cases.add(lambda: check_reset_stats(dist.get_rank()), name="reset_stats")
    cases.add(lambda: check_step_under_torch_profiler(dist.get_rank()), name="step_under_torch_profiler")
    return cases


LAUNCH = Launch(os.path.abspath(__file__), 2, observability_cases, timeout=300, dirs=("OBS_DIR",))


@parametrize_cases(LAUNCH)
def test_stats_and_merged_trace(case: CaseRef) -> None:
    case.check()


def test_pipedream_log_debug_shows_every_action() -> None:
    script = (
        "import torch, torch.nn.functional as F, torch.distributed as dist\n"
        "import pipedream_ext as pd\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "pipe = pd.PipeDream(m, F.cross_entropy, schedule='gpipe', microbatches=2, timeout=60)\n"
        "pipe.step(torch.randn(4, 4), torch.randint(0, 2, (4,)))\n"
        "dist.destroy_process_group()\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        env = dict(os.environ, PIPEDREAM_LOG="debug", OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", f.name], capture_output=True, text=True,
                                timeout=300, env=env)
    finally:
        os.remove(f.name)
    assert result.returncode == 0, result.stderr[-3000:]
    for action in ("0F0", "0F1", "0SEND_F0", "0B0", "1F0", "1B1", "1SEND_B0", "1RECV_F0"):
        assert f"step 0: {action} " in result.stderr, (action, result.stderr[-3000:])


def test_runtime_stats_schema_and_merge() -> None:
    from pipedream_ext import _C

    empty = _C.RuntimeStats()
    d = empty.as_dict()
    assert set(d) == STATS_KEYS, sorted(d)
    assert d["bubble_fraction"] == 0 and d["seconds_by_kind"] == {} and d["peak_weight_versions"] == {}
    merged = empty.merge(_C.RuntimeStats())
    assert merged is not empty and merged.as_dict() == d
    assert all(getattr(empty, key) == value for key, value in d.items())


def test_bad_pipedream_log_level_is_a_clear_error() -> None:
    env = dict(os.environ, PIPEDREAM_LOG="chatty",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", "import pipedream_ext"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode != 0 and "PIPEDREAM_LOG='chatty' is not a logging level" in result.stderr


if __name__ == "__main__":
    worker_main([LAUNCH])
