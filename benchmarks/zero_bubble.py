"""Zero-bubble schedules on 2 ranks (CPU, Gloo), side by side in one run:
our zb-h1 against our 1f1b, and our zbv, dualpipev and interleaved-zb against
torch.distributed.pipelining's ScheduleZBVZeroBubble, ScheduleDualPipeV and
ScheduleInterleavedZeroBubble.

One model for every configuration: ``--layers`` x [Linear(H, H), ReLU] +
Linear(H, 10), H = ``--hidden``, built from the same seed, the same batch of
``--batch`` samples in ``--microbatches`` microbatches, ``F.cross_entropy``, SGD.
The 1-chunk schedules (zb-h1, 1f1b) cut it in 2 stages, the chunked ones in 4
(2 ranks x 2 chunks) at the same Linear+ReLU boundaries, the classifier with the
last stage. Torch's stages are built by hand: one ``PipelineStage`` per chunk on
the rank its placement gives it (a V for ZBV and DualPipeV: rank r holds stages r
and 3-r; round robin for interleaved ZB: r and r+2), as ours places them.

Every configuration runs on its own process group. Before timing, the first step
of each checks that it does the same work: its loss and every gradient against
the unsplit model's (``F.cross_entropy(model(x), y).backward()`` in one process).
Then, per comparison, ``--pairs`` interleaved rounds A B A B ... (A: the baseline,
torch's or our 1f1b; B: ours), each round ``--steps`` steps between two barriers
(samples/s of the slower rank), with the load average of each round.

Per configuration it reports each rank's seconds by kind (ours: the executor's
``stats()["seconds_by_kind"]``; torch: wrappers around each stage's
``forward_one_chunk``, ``backward_one_chunk`` (B, or I when split) and
``backward_weight_one_chunk``; its ``_batch_p2p`` / ``_wait_batch_p2p`` for the
waits), the measured idle fraction (1 - compute / wall: the median over the
rounds, the mean over the ranks), our executor's own
``bubble_fraction``, and beside it the simulated bubble of the same schedule
(``pipedream_ext.schedules``: at unit times F = I = W = 1, and with the measured
per-stage, per-kind costs; t_comm = 0). Torch's orders are the same as ours
(tests/test_schedules.py), so its simulated rows use our generator with torch's
measured costs. A rank's measured seconds of a kind are divided among its two
stages as a second, traced pipeline of ours (``PipeDream(trace=...)``, a few
steps after the timed rounds) or torch's wrappers divide them.

Writes ``<out-dir>/zero_bubble.md`` and ``zero_bubble.json``. Command, from the
repository root (1-2 minutes on 2 cores; ``--smoke``: a tiny model, one pair,
a few seconds of work):

    python3 benchmarks/zero_bubble.py [--pairs 16] [--steps 4] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["COMPARISONS", "KINDS", "TORCH_CLASSES", "action_counts", "balance", "comparison_summary", "main",
           "parse_args", "placement", "rank_figures", "ratio_stats", "report", "run_driver", "run_worker", "simulate",
           "stage_costs", "stage_costs_from_trace"]

JSON_TAG = "ZERO_BUBBLE_JSON "
LOG = logging.getLogger("zero_bubble")
KINDS = ("F", "I", "W", "B")
# (baseline A, candidate B, chunks per rank): every pair runs A then B.
COMPARISONS: Tuple[Tuple[str, str, int], ...] = (
    ("1f1b", "zb-h1", 1),
    ("torch-zbv", "zbv", 2),
    ("torch-dualpipev", "dualpipev", 2),
    ("torch-interleaved-zb", "interleaved-zb", 2),
)
TORCH_CLASSES = {"torch-zbv": "ScheduleZBVZeroBubble", "torch-dualpipev": "ScheduleDualPipeV",
                 "torch-interleaved-zb": "ScheduleInterleavedZeroBubble"}
# The schedule of ours whose order a torch configuration runs (for the simulation).
SAME_ORDER = {"torch-zbv": "zbv", "torch-dualpipev": "dualpipev", "torch-interleaved-zb": "interleaved-zb"}
SMOKE = {"hidden": 32, "layers": 4, "batch": 16, "pairs": 1, "steps": 1, "warmup": 1, "trace_steps": 1}


def label(config: str) -> str:
    """``ours zbv`` or ``torch ScheduleZBVZeroBubble``."""
    return f"torch {TORCH_CLASSES[config]}" if config in TORCH_CLASSES else f"ours {config}"


# ----------------------------------------------------------------------------- pure helpers
def balance(layers: int, stages: int) -> List[int]:
    """Modules per stage of ``layers`` x [Linear, ReLU] + Linear split in ``stages``
    stages at Linear+ReLU boundaries, the classifier with the last.

    Raises:
        ValueError: ``layers`` is not a multiple of ``stages``.
    """
    if layers % stages:
        raise ValueError(f"--layers must be a multiple of {stages} (the stages), got {layers}")
    per = 2 * layers // stages
    return [per] * (stages - 1) + [per + 1]


def placement(config: str, rank: int, world: int, chunks: int) -> List[int]:
    """The stages ``rank`` holds: a V for zbv and dualpipev (r and 2p-1-r), round
    robin for the others (r, r+p, ...), ascending."""
    if chunks == 1:
        return [rank]
    if config.replace("torch-", "") in ("zbv", "dualpipev"):
        return sorted({rank, 2 * world - 1 - rank})
    return [rank + k * world for k in range(chunks)]


def ratio_stats(values: Sequence[float]) -> Dict[str, float]:
    """Median, min and max of ``values`` (empty: an empty dict)."""
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def stage_costs_from_trace(events: Sequence[Dict[str, Any]]) -> Dict[str, Dict[int, float]]:
    """Median seconds of each compute kind per stage from a merged Chrome trace's
    events (names such as ``2F0``, ``0I3``, category ``compute``).

    Returns:
        ``{kind: {stage: seconds}}`` for the kinds in :data:`KINDS` that occur.
    """
    from pipedream_ext import schedules

    durations: Dict[str, Dict[int, List[float]]] = {}
    for e in events:
        if e.get("cat") != "compute" or e.get("ph") != "X":
            continue
        a = schedules.Action.parse(e["name"])
        durations.setdefault(a.kind.name, {}).setdefault(a.stage, []).append(e["dur"] / 1e6)
    return {k: {s: statistics.median(v) for s, v in per.items()} for k, per in durations.items()}


def simulate(schedule: str, ranks: int, microbatches: int, chunks: int,
             costs: Optional[Dict[str, Dict[int, float]]] = None) -> Optional[float]:
    """The simulated bubble fraction of ``schedule`` (pipedream_ext.schedules), t_comm = 0.

    Args:
        costs: ``{kind: {stage: seconds per action}}``; None: unit times F = I = W = 1
            (B = 2). A schedule that splits the backward takes I and W (its B actions,
            dualpipev's, cost I + W); one that does not takes B. A stage missing a kind
            takes the mean of the others.

    Returns:
        ``bubble_fraction`` (1 - compute / (ranks x makespan)), or None when the
        measured costs lack a kind the schedule needs.
    """
    from pipedream_ext import schedules

    s = schedules.build(schedule, stages=ranks, microbatches=microbatches, chunks=chunks)
    if costs is None:
        return s.simulate(t_f=1.0, t_b=1.0, t_w=1.0).bubble_fraction
    n = s.num_stages

    def per_stage(kind: str) -> Optional[List[float]]:
        got = costs.get(kind, {})
        if not got:
            return None
        mean = statistics.mean(got.values())
        return [got.get(j, mean) for j in range(n)]

    t_f = per_stage("F")
    if schedules.traits(schedule).split_backward:
        t_i, t_w = per_stage("I"), per_stage("W")
        if t_f is None or t_i is None or t_w is None:
            return None
        return s.simulate(t_f=t_f, t_b=t_i, t_w=t_w).bubble_fraction
    t_b = per_stage("B")
    if t_f is None or t_b is None:
        return None
    return s.simulate(t_f=t_f, t_b=t_b).bubble_fraction


def comparison_summary(rounds: Sequence[Dict[str, Any]], base: str, cand: str) -> Dict[str, Any]:
    """Samples/s of both sides and the per-pair ratio candidate / baseline.

    Args:
        rounds: ``{"pair": k, "config": name, "samples_per_s": v, ...}`` in run order.
    """
    a = [r["samples_per_s"] for r in rounds if r["config"] == base]
    b = [r["samples_per_s"] for r in rounds if r["config"] == cand]
    ratios = [y / x for x, y in zip(a, b) if x > 0]
    return {"baseline": ratio_stats(a), "candidate": ratio_stats(b), "ratio": ratio_stats(ratios),
            "ratios": ratios, "candidate_ahead": sum(r > 1 for r in ratios)}


# ----------------------------------------------------------------------------- worker
def _model(args: argparse.Namespace) -> Any:
    return h.mlp([args.hidden] * (args.layers + 1) + [10], seed=0)


def _batch(args: argparse.Namespace) -> Tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return (torch.randn(args.batch, args.hidden, generator=g),
            torch.randint(0, 10, (args.batch,), generator=g))


class _Runner:
    """One configuration on this rank: ``step()`` (a batch and the optimizer step),
    ``first_step()`` (the loss on every rank and this rank's gradients by name),
    ``kinds()`` (seconds by kind since ``reset()``) and ``stats()`` (ours only)."""

    name: str
    step: Callable[[], None]


def _ours(args: argparse.Namespace, name: str, chunks: int, group: Any, x: Any, y: Any,
          trace: Optional[str] = None) -> _Runner:
    import torch
    import torch.nn.functional as F

    import pipedream_ext as pd

    world = 2
    pipe = pd.PipeDream(_model(args), F.cross_entropy, schedule=name, microbatches=args.microbatches,
                        chunks=chunks, balance=balance(args.layers, world * chunks), process_group=group,
                        timeout=args.pipe_timeout, trace=trace)
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    r = _Runner()
    r.name, r.pipe = name, pipe

    def step() -> None:
        pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def first_step() -> Tuple[float, Dict[str, Any]]:
        loss = pipe.step(x, y)
        grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss), grads

    r.step, r.first_step = step, first_step
    r.reset = pipe.reset_stats
    r.kinds = lambda: dict(pipe.stats()["seconds_by_kind"])
    r.stats = pipe.stats
    r.stages = list(pipe.local_stages)
    return r


def _torch(args: argparse.Namespace, name: str, group: Any, x: Any, y: Any) -> _Runner:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    world, chunks = 2, 2
    rank = dist.get_rank()
    stages_n = world * chunks
    model = _model(args)
    mods = list(model.children())
    bounds = [0]
    for b in balance(args.layers, stages_n):
        bounds.append(bounds[-1] + b)
    chunk_mods = [torch.nn.Sequential(*mods[bounds[j]:bounds[j + 1]]) for j in range(stages_n)]
    mine = placement(name, rank, world, chunks)
    seconds_by_stage: Dict[int, Dict[str, float]] = {j: {} for j in mine}
    calls_by_stage: Dict[int, Dict[str, int]] = {j: {} for j in mine}
    stages = []
    for j in mine:
        stage = pipelining.PipelineStage(chunk_mods[j], j, stages_n, torch.device("cpu"), group=group)
        _time_stage(stage, seconds_by_stage[j], calls_by_stage[j])
        stages.append(stage)
    cls = getattr(pipelining, TORCH_CLASSES[name])
    sched = cls(stages, args.microbatches, loss_fn=F.cross_entropy)
    params = [p for j in mine for p in chunk_mods[j].parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.SGD(params, lr=args.lr)
    last = stages_n - 1
    r = _Runner()
    r.name = name

    _time_torch_p2p()
    p2p: Dict[str, float] = {}

    def run() -> List[Any]:
        losses: List[Any] = []
        _TORCH_P2P["into"] = p2p
        try:
            sched.step(x, target=y, losses=losses, return_outputs=False)
        finally:
            _TORCH_P2P["into"] = None
        return losses

    def step() -> None:
        run()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def first_step() -> Tuple[float, Dict[str, Any]]:
        losses = run()
        # The microbatch losses are on the last stage's rank; every microbatch has
        # batch / microbatches rows, so their mean is the batch's mean loss.
        value = torch.tensor([float(torch.stack([l.detach() for l in losses]).mean()) if last in mine else 0.0],
                             dtype=torch.float64)
        dist.all_reduce(value, group=group)
        grads = {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(value.item()), grads

    def reset() -> None:
        for d in (*seconds_by_stage.values(), *calls_by_stage.values(), p2p):
            d.clear()

    def kinds() -> Dict[str, float]:
        out: Dict[str, float] = dict(p2p)
        for per in seconds_by_stage.values():
            for k, v in per.items():
                out[k] = out.get(k, 0.0) + v
        return out

    r.step, r.first_step, r.reset, r.kinds = step, first_step, reset, kinds
    r.stats = None
    r.stages = mine
    r.stage_costs = lambda: {str(j): {k: seconds_by_stage[j][k] / calls_by_stage[j][k]
                                      for k in seconds_by_stage[j]} for j in mine}
    return r


def _time_stage(stage: Any, seconds: Dict[str, float], calls: Dict[str, int]) -> None:
    """Wraps a torch PipelineStage's compute entry points to sum their seconds by kind."""
    def add(kind: str, t0: float) -> None:
        seconds[kind] = seconds.get(kind, 0.0) + time.perf_counter() - t0
        calls[kind] = calls.get(kind, 0) + 1

    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(*a, **k)
        finally:
            add("F", t0)

    def backward_one_chunk(*a: Any, full_backward: bool = True, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return backward(*a, full_backward=full_backward, **k)
        finally:
            add("B" if full_backward else "I", t0)

    def backward_weight_one_chunk(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return weight(*a, **k)
        finally:
            add("W", t0)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


# Torch's point-to-point calls, timed into the running configuration's dict.
_TORCH_P2P: Dict[str, Any] = {"into": None}


def _time_torch_p2p() -> None:
    """Wraps torch.distributed.pipelining.schedules' ``_batch_p2p`` (posting sends and
    receives: ``P2P_POST``) and ``_wait_batch_p2p`` (waiting for them: ``P2P_WAIT``),
    once per process; the seconds go to ``_TORCH_P2P["into"]``."""
    from torch.distributed.pipelining import schedules as ts

    if getattr(ts, "_zero_bubble_timed", False):
        return

    def timed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into = _TORCH_P2P["into"]
                if into is not None:
                    into[kind] = into.get(kind, 0.0) + time.perf_counter() - t0
        return wrapper

    ts._batch_p2p = timed(ts._batch_p2p, "P2P_POST")  # noqa: SLF001 - torch internal, timed on purpose
    ts._wait_batch_p2p = timed(ts._wait_batch_p2p, "P2P_WAIT")  # noqa: SLF001 - torch internal, timed on purpose
    ts._zero_bubble_timed = True  # noqa: SLF001 - our mark on torch's module: wrapped once


def _snapshot(runner: _Runner) -> Dict[str, float]:
    """The runner's cumulative seconds by kind; ours also ``compute_s`` and ``busy_s``
    (the executor's compute and time inside the runtime)."""
    out = dict(runner.kinds())
    if runner.stats is not None:
        stats = runner.stats()
        out.update(compute_s=stats["compute_s"], busy_s=stats["busy_s"])
    return out


def _same_work(runner: _Runner, ref_loss: float, ref_grads: Dict[str, Any], group: Any) -> Dict[str, Any]:
    """The first step's loss and gradients against the unsplit model's (max over ranks)."""
    import torch
    import torch.distributed as dist

    loss, grads = runner.first_step()
    diff = max((float((g - ref_grads[n]).abs().max()) for n, g in grads.items()), default=float("inf"))
    scale = max((float(ref_grads[n].abs().max()) for n in grads), default=0.0)
    t = torch.tensor([diff, -float(len(grads)), scale], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    count = torch.tensor([float(len(grads))], dtype=torch.float64)
    dist.all_reduce(count, group=group)
    return {"loss": loss, "unsplit_loss": ref_loss, "loss_diff": abs(loss - ref_loss),
            "grad_max_abs_diff": float(t[0]), "grad_max_abs": float(t[2]),
            "grad_tensors": int(count.item()), "ref_tensors": len(ref_grads)}


def run_worker(args: argparse.Namespace) -> int:
    """Both ranks: every comparison in interleaved rounds; stats gathered on rank 0."""
    def body(result: Dict[str, Any]) -> None:
        import datetime

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        if dist.get_world_size() != 2:
            raise ValueError("zero_bubble.py runs on exactly 2 ranks")
        rank = dist.get_rank()
        x, y = _batch(args)
        ref = _model(args)
        ref_loss_t = F.cross_entropy(ref(x), y)
        ref_loss_t.backward()
        ref_loss = float(ref_loss_t)
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        del ref
        timeout = datetime.timedelta(seconds=args.pipe_timeout)
        wanted = set(args.comparisons)
        result.update(rounds=[], configs={}, loadavg_start=list(os.getloadavg()))
        keep: List[_Runner] = []  # torn down at exit, not between comparisons
        for base, cand, chunks in COMPARISONS:
            if cand not in wanted:
                continue
            runners: Dict[str, _Runner] = {}
            for name in (base, cand):
                group = dist.new_group([0, 1], timeout=timeout)
                entry: Dict[str, Any] = {"chunks": chunks}
                result["configs"][name] = entry
                try:
                    runner = (_torch(args, name, group, x, y) if name in TORCH_CLASSES
                              else _ours(args, name, chunks, group, x, y))
                    runner.group = group
                    entry["same_work"] = _same_work(runner, ref_loss, ref_grads, group)
                    for _ in range(args.warmup - 1):
                        runner.step()
                    runner.reset()
                    runners[name] = runner
                    keep.append(runner)
                except Exception as exc:  # a failing schedule is a result
                    # The peer, if it is waiting in this configuration's group, times
                    # out there (--pipe-timeout) and records its own error.
                    entry["error"] = f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
                    LOG.exception("%s failed on rank %d", name, rank)
                # Both ranks agree on whether it runs (on the default group).
                ok = torch.tensor([float(name in runners)])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                if not ok.item() and name in runners:
                    del runners[name]
                    entry["error"] = "the peer rank failed (its error is in its log)"
            live = [name for name in (base, cand) if name in runners]
            per_round: Dict[str, List[Dict[str, Any]]] = {name: [] for name in live}
            for pair in range(args.pairs):
                for name in live:
                    runner = runners[name]
                    before = _snapshot(runner)
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.steps):
                        runner.step()
                    dist.barrier()
                    local = time.perf_counter() - t0
                    cpu = time.process_time() - c0
                    after = _snapshot(runner)
                    per_round[name].append({"wall_s": local, "cpu_s": cpu, "steps": args.steps,
                                            "seconds": {k: v - before.get(k, 0.0) for k, v in after.items()}})
                    t = torch.tensor([local], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    result["rounds"].append({"pair": pair, "config": name, "seconds": float(t.item()),
                                             "samples_per_s": args.steps * args.batch / float(t.item()),
                                             "loadavg_1min": os.getloadavg()[0]})
            for name in live:
                runner = runners[name]
                rounds = per_round[name]
                mine = {"rank": rank, "stages": runner.stages, "rounds": rounds,
                        "wall_s": sum(r["wall_s"] for r in rounds), "cpu_s": sum(r["cpu_s"] for r in rounds),
                        "steps": sum(r["steps"] for r in rounds), "seconds_by_kind": runner.kinds()}
                if runner.stats is not None:
                    stats = runner.stats()
                    mine.update({k: stats[k] for k in ("compute_s", "wait_s", "busy_s", "bubble_fraction")})
                else:
                    mine["stage_costs"] = runner.stage_costs()
                result["configs"][name]["ranks"] = h.all_gather_json(mine)
            # Per-stage costs of ours: a second, traced pipeline, after the timing.
            for name in live:
                if name in TORCH_CLASSES or args.trace_steps <= 0:
                    continue
                path = os.path.join(args.trace_dir, f"{name}.json")
                group = dist.new_group([0, 1], timeout=timeout)
                traced = _ours(args, name, chunks, group, x, y, trace=path)
                for _ in range(args.trace_steps + 1):
                    traced.step()
                traced.pipe.close()
                if rank == 0:
                    with open(path, encoding="utf-8") as fh:
                        events = json.load(fh)["traceEvents"]
                    costs = stage_costs_from_trace(events)
                    result["configs"][name]["stage_costs"] = {
                        k: {str(s): v for s, v in per.items()} for k, per in costs.items()}
                keep.append(traced)
        result["loadavg_end"] = list(os.getloadavg())

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- report
def action_counts(schedule: str, ranks: int, microbatches: int, chunks: int) -> Dict[str, Dict[int, int]]:
    """How many actions of each compute kind every stage runs per step (``{kind:
    {stage: count}}``): M of each for most schedules; dualpipev runs most backwards
    whole (B) and splits only a few into I and W."""
    from pipedream_ext import schedules

    s = schedules.build(schedule, stages=ranks, microbatches=microbatches, chunks=chunks)
    counts: Dict[str, Dict[int, int]] = {}
    for rank in range(ranks):
        for a in s.actions(rank, comm=False):
            if a.is_compute:
                per = counts.setdefault(a.kind.name, {})
                per[a.stage] = per.get(a.stage, 0) + 1
    return counts


def stage_costs(entry: Dict[str, Any], counts: Dict[str, Dict[int, int]]) -> Optional[Dict[str, Dict[int, float]]]:
    """``{kind: {stage: seconds per action}}`` of one configuration.

    Each rank's median ms per step of a kind over the timed rounds
    (:func:`rank_figures`) is divided among the actions of that kind its stages run
    per step (``counts``, :func:`action_counts`), in the proportions of their
    per-action costs (ours: the traced pipeline's medians; torch: its wrappers'
    means). A short trace taken during a burst of other work would skew the costs;
    its proportions between two stages of one rank hardly move.
    """
    shares: Dict[str, Dict[int, float]] = {}
    if "stage_costs" in entry:  # ours: from the trace, every stage
        shares = {k: {int(j): v for j, v in per.items()} for k, per in entry["stage_costs"].items()}
    for r in entry.get("ranks", []):  # torch: each rank its own stages
        for j, per in r.get("stage_costs", {}).items():
            for k, v in per.items():
                shares.setdefault(k, {})[int(j)] = v
    out: Dict[str, Dict[int, float]] = {}
    for r in entry.get("ranks", []):
        ms = rank_figures(r)["ms"]
        for k in KINDS:
            stages = [j for j in r["stages"] if counts.get(k, {}).get(j)]
            mine = {j: shares.get(k, {}).get(j) for j in stages}
            if k not in ms or not stages or any(v is None for v in mine.values()):
                continue
            weighted = sum(counts[k][j] * mine[j] for j in stages)  # the trace's seconds per step
            for j in stages:
                share = mine[j] / weighted if weighted > 0 else 1 / sum(counts[k][i] for i in stages)
                out.setdefault(k, {})[j] = ms[k] / 1e3 * share
    return out or None


def rank_figures(rank: Dict[str, Any]) -> Dict[str, Any]:
    """One rank's figures of one configuration, each the median over its rounds.

    Returns:
        ``ms``: ms per step of every kind (F, I, W, B and the waits and sends);
        ``compute`` and ``wall`` (ms per step); ``cpu_wall`` (CPU / wall); ``idle``
        (1 - compute / wall); ``bubble_fraction`` (ours: 1 - the executor's compute
        over its time inside the runtime, else None); ``quiet``: ms per step over
        the rounds at or below the median wall time, ``wall`` = ``compute`` +
        ``comm`` (waits and sends) + ``rest``.
    """
    rounds = rank["rounds"]
    kinds = sorted({k for r in rounds for k in r["seconds"]} - {"compute_s", "busy_s"})

    def med(fn: Callable[[Dict[str, Any]], float]) -> float:
        return statistics.median(fn(r) for r in rounds)

    def compute(r: Dict[str, Any]) -> float:
        return sum(v for k, v in r["seconds"].items() if k in KINDS)

    # The quieter half (rounds at or below the median wall time), summed so that
    # wall = compute + communication + rest holds exactly.
    middle = statistics.median(r["wall_s"] for r in rounds)
    quiet = [r for r in rounds if r["wall_s"] <= middle]
    steps = sum(r["steps"] for r in quiet)
    q_wall = 1e3 * sum(r["wall_s"] for r in quiet) / steps
    q_compute = 1e3 * sum(compute(r) for r in quiet) / steps
    q_comm = 1e3 * sum(v for r in quiet for k, v in r["seconds"].items()
                       if k not in KINDS and k not in ("compute_s", "busy_s")) / steps
    bubble = None
    if all("busy_s" in r["seconds"] for r in rounds):
        bubble = med(lambda r: 1 - r["seconds"]["compute_s"] / r["seconds"]["busy_s"])
    return {"ms": {k: med(lambda r, k=k: 1e3 * r["seconds"].get(k, 0.0) / r["steps"]) for k in kinds},
            "compute": med(lambda r: 1e3 * compute(r) / r["steps"]),
            "wall": med(lambda r: 1e3 * r["wall_s"] / r["steps"]),
            "cpu_wall": med(lambda r: r["cpu_s"] / r["wall_s"]),
            "idle": med(lambda r: 1 - compute(r) / r["wall_s"]),
            "bubble_fraction": bubble,
            "quiet": {"wall": q_wall, "compute": q_compute, "comm": q_comm,
                      "rest": q_wall - q_compute - q_comm, "rounds": len(quiet)}}


def _waits(ms: Dict[str, float]) -> str:
    """The kinds other than compute (waits on receives, sends), ms per step, largest first."""
    other = sorted(((v, k) for k, v in ms.items() if k not in KINDS), reverse=True)
    return ", ".join(f"{k} {v:.1f}" for v, k in other if v >= 0.05) or "-"


def _fmt_range(s: Dict[str, float], digits: int = 0) -> str:
    if not s:
        return "n/a"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> Tuple[str, Dict[str, Any]]:
    """The Markdown report and the summary figures of one run."""
    mb = args.batch // args.microbatches
    lines = ["# Zero-bubble schedules against 1f1b and torch.distributed.pipelining (CPU, 2 ranks)", "",
             f"Model: {args.layers} x [Linear({args.hidden}, {args.hidden}), ReLU] + Linear({args.hidden}, 10), "
             f"the same weights everywhere; batch {args.batch} in {args.microbatches} microbatches of {mb}, "
             f"cross-entropy, SGD lr={args.lr}. zb-h1 and 1f1b: 2 stages {balance(args.layers, 2)} (modules); "
             f"the chunked schedules: 4 stages {balance(args.layers, 4)} (2 ranks x 2 chunks; V: rank 0 holds "
             "stages 0 and 3; round robin: 0 and 2). Each configuration on its own Gloo group, one thread per "
             f"rank. {args.pairs} interleaved pairs per comparison (baseline then ours), each round "
             f"{args.steps} steps between barriers (samples/s of the slower rank), after {args.warmup} "
             "warm-up steps (the first one checks the loss and gradients).", ""]
    summaries: Dict[str, Any] = {}
    rows = []
    for base, cand, _chunks in COMPARISONS:
        rounds = [r for r in result["rounds"] if r["config"] in (base, cand)]
        if cand not in result["configs"]:
            continue
        s = comparison_summary(rounds, base, cand)
        summaries[cand] = s
        errors = [result["configs"][n].get("error") for n in (base, cand) if result["configs"][n].get("error")]
        rows.append([f"{label(cand)} / {label(base)}", _fmt_range(s["candidate"]), _fmt_range(s["baseline"]),
                     _fmt_range(s["ratio"], 2), f"{s['candidate_ahead']} of {len(s['ratios'])}",
                     "; ".join(errors)])
    lines += ["## Samples/s and per-pair ratio", ""]
    lines += h.table(["comparison", "ours samples/s, median [min-max]", "baseline samples/s, median [min-max]",
                      "ratio ours / baseline per pair, median [min-max]", "pairs ours ahead", "errors"], rows)
    loads = [r["loadavg_1min"] for r in result["rounds"]]
    lines += ["", f"Load average (1 min) over the rounds: {min(loads):.2f}-{max(loads):.2f} "
              f"(start {' '.join(f'{v:.2f}' for v in result['loadavg_start'])}, end "
              f"{' '.join(f'{v:.2f}' for v in result['loadavg_end'])})." if loads else ""]

    lines += ["", "## Same work: first step against the unsplit model", ""]
    rows = []
    for name, entry in result["configs"].items():
        sw = entry.get("same_work")
        if sw is None:
            rows.append([label(name), "n/a", "", "", "", entry.get("error", "")])
            continue
        rows.append([label(name), f"{sw['loss']:.6f}", f"{sw['unsplit_loss']:.6f}", f"{sw['loss_diff']:.1e}",
                     f"{sw['grad_max_abs_diff']:.1e} (of {sw['grad_max_abs']:.1e})",
                     f"{sw['grad_tensors']} of {sw['ref_tensors']}"])
    lines += h.table(["configuration", "first-step loss", "unsplit loss", "|difference|",
                      "max abs gradient difference (largest gradient)", "gradient tensors compared"], rows)

    lines += ["", "## Where the time goes", "",
              "Per rank, ms per step, each figure the median over the timed rounds (a burst of "
              "other work on the machine moves a few rounds, not the median): seconds by kind (ours: the executor's "
              "`seconds_by_kind`; torch: the stage's forward / backward / weight-backward calls); CPU / wall: "
              "the process's CPU time (all its threads, Gloo's included) over the wall time; idle = "
              "1 - compute / wall; ours also the executor's own `bubble_fraction` (1 - compute / time "
              "inside the runtime). Simulated: `pipedream_ext.schedules` on the same schedule at unit "
              "times (F = I = W = 1) and with the measured per-stage costs (each rank's median per kind, "
              "divided among its stages as a traced pipeline after the timing (ours) or the wrappers "
              "(torch) divide it), t_comm = 0; the measured idle is the mean over "
              "ranks, as the simulator's bubble fraction is. Waits and sends, ms per step: ours "
              "RECV_F / RECV_B (blocked on a receive), SEND_F / SEND_B (posting a send; Gloo writes "
              "the data on the caller's thread once the peer has posted its receive) and SEND_WAIT; "
              "torch P2P_POST (its `_batch_p2p`: posting sends and receives) and P2P_WAIT "
              "(`_wait_batch_p2p`).", ""]
    rows = []
    figures: Dict[str, Any] = {}
    for name, entry in result["configs"].items():
        if "ranks" not in entry:
            continue
        chunks = entry["chunks"]
        schedule = SAME_ORDER.get(name, name)
        unit = simulate(schedule, 2, args.microbatches, chunks)
        costs = stage_costs(entry, action_counts(schedule, 2, args.microbatches, chunks))
        measured_sim = simulate(schedule, 2, args.microbatches, chunks, costs) if costs else None
        ranks = [rank_figures(r) for r in entry["ranks"]]
        idle = statistics.mean(f["idle"] for f in ranks)
        figures[name] = {"idle": idle, "simulated_unit": unit, "simulated_measured": measured_sim,
                         "stage_costs": costs, "ranks": ranks}
        for r, f in zip(entry["ranks"], ranks):
            rows.append([label(name), r["rank"], ",".join(map(str, r["stages"]))]
                        + [h.fmt(f["ms"][k], 1) if k in f["ms"] else "-" for k in KINDS]
                        + [h.fmt(f["compute"], 1), h.fmt(f["wall"], 1), h.fmt(f["cpu_wall"], 2),
                           h.fmt(f["idle"], 3), h.fmt(f["bubble_fraction"], 3, "-"),
                           h.fmt(idle, 3), h.fmt(unit, 3), h.fmt(measured_sim, 3), _waits(f["ms"])])
    lines += h.table(["configuration", "rank", "stages", "F", "I", "W", "B", "compute", "wall",
                      "CPU / wall", "idle", "executor bubble_fraction", "idle, mean of ranks", "simulated, unit times",
                      "simulated, measured costs", "waits and sends by kind"], rows)
    lines += ["", "Where a step's wall time goes, ms per step over each rank's quieter half of the "
              "rounds (at or below its median wall time; sums, so wall = compute + waits and sends + "
              "rest, where rest is everything else: the optimizer step, the framework's own work "
              "between actions, our loss all-reduce), both ranks added:", ""]
    rows = []
    for base, cand, _chunks in COMPARISONS:
        pair = [n for n in (base, cand) if n in figures]
        if len(pair) < 2:
            continue
        tot = {n: {k: sum(f["quiet"][k] for f in figures[n]["ranks"]) for k in ("wall", "compute", "comm", "rest")}
               for n in pair}
        for n in pair:
            t = tot[n]
            rows.append([label(n)] + [h.fmt(t[k], 1) for k in ("wall", "compute", "comm", "rest")]
                        + ([h.fmt(t[k] / tot[base][k], 2) if tot[base][k] > 0 else "n/a"
                            for k in ("wall", "compute", "comm")] if n == cand else ["", "", ""]))
    lines += h.table(["configuration", "wall", "compute", "waits and sends", "rest", "wall, ours / baseline",
                      "compute, ours / baseline", "waits and sends, ours / baseline"], rows)
    lines += ["", "Per-stage costs used for the measured simulation (ms per action):", ""]
    rows = []
    for name, fig in figures.items():
        costs = fig["stage_costs"] or {}
        stages = sorted({s for per in costs.values() for s in per})
        for s in stages:
            rows.append([label(name), s] + [h.fmt(1e3 * costs[k][s], 2) if s in costs.get(k, {}) else "-"
                                             for k in KINDS])
    lines += h.table(["configuration", "stage", "F", "I", "W", "B"], rows)
    lines += ["", "Rounds (samples/s, load average at the end of the round):", ""]
    rows = []
    for base, cand, _chunks in COMPARISONS:
        a = [r for r in result["rounds"] if r["config"] == base]
        b = [r for r in result["rounds"] if r["config"] == cand]
        for ra, rb in zip(a, b):
            rows.append([f"{label(cand)} / {label(base)}", ra["pair"], f"{ra['samples_per_s']:.0f}",
                         f"{rb['samples_per_s']:.0f}", f"{rb['samples_per_s'] / ra['samples_per_s']:.3f}",
                         f"{ra['loadavg_1min']:.2f} / {rb['loadavg_1min']:.2f}"])
    lines += h.table(["comparison", "pair", "baseline", "ours", "ratio", "load average"], rows)
    lines += ["", h.machine_line(info), "", h.command_sentence(command, total_s, {2: result["launch_s"]}), ""]
    return "\n".join(lines), {"comparisons": summaries, "figures": figures}


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(LOG)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zero_bubble-") as trace_dir:
        worker_args = (["--worker", "--trace-dir", trace_dir]
                       + h.forward(args, "pairs", "steps", "warmup", "trace_steps", "batch", "hidden", "layers",
                                   "microbatches", "lr", "pipe_timeout", "comparisons"))
        result = h.launch_torchrun(Path(__file__).resolve(), 2, worker_args, JSON_TAG, timeout=args.timeout)
    if h.launch_failed(result) or "rounds" not in result:
        LOG.error("the launch failed: %s", result.get("error"))
        return 1
    text, summary = report(result, info, command, args, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), "zero_bubble", text,
                    {"machine": info, "command": command,
                     "args": h.run_options(args, "trace_dir"),
                     "result": result, "summary": summary})
    errors = [n for n, e in result["configs"].items() if "error" in e]
    if "error" in result:
        LOG.error("%s", result["error"])
    return 1 if "error" in result and not errors else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--pairs", type=int, default=16, help="interleaved A/B pairs per comparison")
    p.add_argument("--steps", type=int, default=4, help="steps per round")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (the first checks the same work)")
    p.add_argument("--trace-steps", type=int, default=3, help="steps of the traced pipeline (per-stage costs)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs (a multiple of 4)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--comparisons", type=lambda s: s.split(","), default=[c for _, c, _ in COMPARISONS],
                   help="ours of each comparison to run (comma-separated; default: all)")
    p.add_argument("--pipe-timeout", type=float, default=120.0, help="seconds any wait on the peer may take")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole launch")
    p.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, one pair of one step: checks that everything runs")
    args = p.parse_args(argv)
    h.apply_smoke(args, SMOKE)
    unknown = set(args.comparisons) - {c for _, c, _ in COMPARISONS}
    if unknown:
        p.error(f"unknown comparisons {sorted(unknown)}; known: {[c for _, c, _ in COMPARISONS]}")
    h.check_step_args(p, args)
    if args.layers % 4:
        p.error("--layers must be a multiple of 4 (4 stages at Linear+ReLU boundaries)")
    return args


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
