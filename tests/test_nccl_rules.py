"""The runtime under NCCL's point-to-point rules, proven on the CPU.

NCCL has no message tags (the k-th send from rank a to rank b meets the k-th
receive at b from a) and runs each pair's operations one at a time in issue
order. One GPU cannot host two NCCL ranks, so no lent GPU can show a protocol
that breaks those rules; the ``nccl_rules`` backend (``pipedream_ext.testing``,
``csrc/runtime/nccl_rules_backend.h``) keeps them on the CPU, and:

* it bites: the tag-matched exchange of the engine before this one (headers on
  tag 32T, data on 32T+k, receives pre-posted in another order than the sends)
  and a crossing send/send order both run on Gloo and fail on it within the
  timeout, with an error that names the operations (not a hang, not an abort);
  the same crossing issued as a coalesced group (``batch_isend_irecv``) passes;
* creating its groups is safe however the backend's worker threads interleave with
  its constructor (an LD_PRELOAD shim forces the interleaving that crashed it);
* the pipeline speaks the split protocol on it (metadata on the side group, the
  tensors alone on the data channel) and the fused one when forced, with exact
  message counts;
* the runtime's own suites pass on it, unchanged, as on Gloo: every schedule,
  replicas, tied weights, variable shapes, forward_only, checkpoints, recompute,
  tensor parallelism on pp2 x tp2, 2-4 ranks (their files' ``nccl_rules`` launches;
  here, slow, the fused protocol forced and pp2 x dp2 x tp2 on 8 ranks, each suite
  re-run in a pytest subprocess with ``PIPEDREAM_TEST_BACKEND=nccl_rules``).

    torchrun --standalone --nproc-per-node 2 tests/test_nccl_rules.py --case tagged --backend nccl_rules
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import BACKEND_ENV, ROOT, launch_raw
from torch import nn

HERE = os.path.abspath(__file__)
RACE_SHIM = os.path.join(os.path.dirname(HERE), "data", "race_after_thread_start.c")
WAIT = datetime.timedelta(seconds=3)


# --------------------------------------------------------------------------- exchanges
def old_tagged_exchange(rank: int) -> None:
    """The engine before this one: per transfer a 656-byte header on tag 32T and the data
    on tag 32T+1; the receiver pre-posted every header first, then the data."""
    header = torch.zeros(82, dtype=torch.int64)
    data = torch.zeros(2, 48)  # 384 bytes
    if rank == 0:
        for t in (1, 2):
            dist.send(header, 1, tag=32 * t)
            dist.send(data, 1, tag=32 * t + 1)
    else:
        works = [dist.irecv(torch.zeros(82, dtype=torch.int64), 0, tag=32 * t) for t in (1, 2)]
        works += [dist.irecv(torch.zeros(2, 48), 0, tag=32 * t + 1) for t in (1, 2)]
        for work in works:
            work.wait(timeout=WAIT)


def crossing(rank: int, coalesced: bool) -> None:
    """Both ranks send first, then receive: fine where sends are buffered, a deadlock on
    one in-order stream per pair unless issued as one group."""
    mine, theirs = torch.full((4,), float(rank)), torch.zeros(4)
    peer = 1 - rank
    if coalesced:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, theirs, peer)])
    else:
        works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]
    for work in works:
        work.wait(timeout=WAIT)
    assert theirs.tolist() == [float(peer)] * 4, theirs


def pipeline_messages(protocol: str) -> None:
    """A 2-rank 1F1B pipeline on the current group: its protocol and message counts."""
    import pipedream_ext as pd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = pd.PipeDream(model, F.cross_entropy, schedule="1f1b", microbatches=4, timeout=30)
    assert pipe._runner.executor.protocol == protocol, pipe._runner.executor.protocol
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        pipe.step(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        if step == 0:
            pipe.reset_stats()
    stats = pipe.stats()
    transfers = 2 * 4  # two steps of 4 microbatches, one transfer each way per microbatch
    assert stats["sends"] == stats["receives"] == transfers, stats
    # split: the metadata on the side group, then the tensor; fused: the packed message.
    per_transfer = 2 if protocol == "split" else 1
    assert stats["messages_sent"] == per_transfer * transfers, stats
    assert stats["redirected_sends"] == 0 and stats["host_syncs"] == 0, stats


def create_groups(count: int) -> None:
    """``count`` ``nccl_rules`` groups over every rank, each used once and destroyed."""
    import pipedream_ext.testing as pdt

    pdt.register_nccl_rules_backend()
    for _ in range(count):
        group = dist.new_group(backend="nccl_rules")
        value = torch.ones(2)
        dist.all_reduce(value, group=group)
        assert value.tolist() == [2.0, 2.0], value
        dist.destroy_process_group(group)


def run_case(case: str, backend: str) -> None:
    if backend == "nccl_rules":
        import pipedream_ext.testing as pdt

        pdt.register_nccl_rules_backend()
    dist.init_process_group(backend)
    rank = dist.get_rank()
    start = time.time()
    try:
        if case == "groups":
            create_groups(5)
        elif case == "tagged":
            old_tagged_exchange(rank)
        elif case in ("crossing", "coalesced"):
            crossing(rank, coalesced=case == "coalesced")
        else:
            pipeline_messages(case)
    except Exception as exc:  # noqa: BLE001 - report any failure type
        print(f"RANK{rank} ERROR after {time.time() - start:.1f}s: {type(exc).__name__}: {exc}",
              flush=True)
        os._exit(3)
    print(f"RANK{rank} PASSED", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- it bites
@pytest.mark.parametrize("case", ["tagged", "crossing", "coalesced"])
def test_gloo_runs_every_exchange(case: str) -> None:
    results = launch_raw(HERE, 2, f"{case}:gloo", timeout=120)
    assert all(r.returncode == 0 and "PASSED" in r.stdout for r in results), [r.stdout for r in results]


def test_the_old_tagged_exchange_fails_under_nccl_rules_naming_both_sizes() -> None:
    start = time.time()
    results = launch_raw(HERE, 2, "tagged:nccl_rules", timeout=120)
    receiver = results[1].stdout
    # The second receive (a header, 656 bytes) met the second send (data, 384 bytes):
    # with tags gone, the k-th receive takes the k-th send, whatever it is.
    assert results[1].returncode == 3, receiver
    assert ("receive #1 from rank 0 (656 bytes of Long) met rank 0's send #1 of 384 bytes of Float"
            in receiver), receiver
    assert time.time() - start < 90


def test_a_crossing_send_send_order_times_out_under_nccl_rules_naming_the_head() -> None:
    results = launch_raw(HERE, 2, "crossing:nccl_rules", timeout=120)
    for rank, result in enumerate(results):
        assert result.returncode == 3, result.stdout
        assert (f"send #0 to rank {1 - rank} (16 bytes of Float) did not complete within 3000 ms"
                in result.stdout), result.stdout
        assert "is at this operation: the peer has not issued the matching receive" in result.stdout
        assert "ERROR after 3." in result.stdout or "ERROR after 4." in result.stdout, result.stdout


def test_the_same_crossing_as_a_coalesced_group_passes_under_nccl_rules() -> None:
    results = launch_raw(HERE, 2, "coalesced:nccl_rules", timeout=120)
    assert all(r.returncode == 0 and "PASSED" in r.stdout for r in results), [r.stdout for r in results]


def test_new_groups_survive_a_worker_that_starts_while_its_backend_is_built(tmp_path) -> None:
    """Creating ``nccl_rules`` groups is safe however the threads interleave: the backend
    starts a worker per peer, which reads the peers' vector at once; with the threads
    started before the vector was full, a ``push_back`` that reallocated freed it under a
    worker (a SIGSEGV in about 1 launch in 20). The shim (tests/data/race_after_thread_start.c,
    LD_PRELOAD) makes the creator sleep at its first ``free`` after starting a thread, so
    that interleaving happens every time: 2 ranks create and destroy 5 groups each."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the LD_PRELOAD shim (the extension's build needs one)")
    shim = tmp_path / "race.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(RACE_SHIM), "-ldl"], check=True)
    results = launch_raw(HERE, 2, "groups:gloo", timeout=120, rank_env=[{"LD_PRELOAD": str(shim)}] * 2)
    assert all(r.returncode == 0 and "PASSED" in r.stdout for r in results), \
        [(r.returncode, r.stdout[-2000:]) for r in results]


@pytest.mark.parametrize("backend, protocol, forced", [
    ("nccl_rules", "split", None),   # the default on an NCCL-like data channel
    ("nccl_rules", "fused", "fused"),
    ("gloo", "fused", None),         # the default on Gloo
    ("gloo", "split", "split"),
])
def test_the_pipeline_speaks_the_protocol_of_its_backend(backend: str, protocol: str,
                                                         forced: str, monkeypatch) -> None:
    if forced:
        monkeypatch.setenv("PIPEDREAM_P2P_PROTOCOL", forced)
    else:
        monkeypatch.delenv("PIPEDREAM_P2P_PROTOCOL", raising=False)
    results = launch_raw(HERE, 2, f"{protocol}:{backend}", timeout=120)
    assert all(r.returncode == 0 and "PASSED" in r.stdout for r in results), [r.stdout for r in results]


# --------------------------------------------------------------------------- the suites
# The runtime's own suites run under nccl_rules as launches of their files
# (``strict_and_gloo`` in tests/_multiprocess.py): test_runtime on 4 ranks, test_zero_bubble,
# test_async on 3 and 4 ranks, test_shared_params on 3, test_variable_shapes,
# test_checkpoint, test_tensor_parallel and test_tp_planning; `make test-all` runs their
# Gloo twins too, and the two slow checks below (a pytest of their own with
# PIPEDREAM_TEST_BACKEND, which overrides every launch's backend).
def run_suite(targets: list, protocol: str = "") -> subprocess.CompletedProcess:
    # Explicit targets run even where `make test` leaves them to `make test-all` on Gloo.
    env = dict(os.environ, **{BACKEND_ENV: "nccl_rules", "PIPEDREAM_TEST_ALL": "1"})
    env.pop("PIPEDREAM_P2P_PROTOCOL", None)
    if protocol:
        env["PIPEDREAM_P2P_PROTOCOL"] = protocol
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)


@pytest.mark.slow
def test_the_fused_protocol_keeps_nccl_rules_too() -> None:
    # One packed message per transfer at the slot's agreed capacity: sizes known to
    # both ends in advance, so it is NCCL-safe as well (3 ranks: replicas, chunks).
    result = run_suite(["tests/test_runtime.py::test_flush_schedules_match_the_unsplit_model", "-k", "3ranks"],
                       protocol="fused")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_the_pp2_dp2_tp2_mesh_keeps_nccl_rules_too() -> None:
    # 8 ranks: 4 pipelines (one per (dp, tp) coordinate) side by side, tp and FSDP's dp
    # collectives between them, replicate and FSDP (tests/test_tensor_parallel.py's 8-rank launch).
    result = run_suite(["tests/test_tensor_parallel.py::test_tensor_parallel_on_a_pp2_dp2_tp2_mesh"])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default=None, help="CASE:BACKEND (launch_raw's argument)")
    parser.add_argument("--case", default=None)
    parser.add_argument("--backend", default="nccl_rules")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fault:
        case, _, backend = args.fault.partition(":")
        run_case(case, backend)
    else:
        run_case(args.case, args.backend)


if __name__ == "__main__":
    main()
