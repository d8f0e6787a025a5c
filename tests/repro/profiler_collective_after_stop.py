"""Minimal repro (torch only, 2 CPU ranks, Gloo): a collective that ``torch.profiler``
recorded and that completes after the profiler stopped corrupts the heap.

Rank 0 starts an asynchronous all-reduce under ``torch.profiler.profile(profile_memory=
True)`` and leaves the profiler; rank 1 joins the all-reduce only then (it waits for
rank 0's signal through the store; with ``--wait-inside``, rank 0 signals and waits
inside the profiler). The all-reduce then completes on Gloo's thread, which
ends the profiler's record of it (c10d ``Work::recordFunctionEndCallback_`` under
``at::wrapPropagateTLSState``) after the profiler stopped and collected its events.
``--rounds`` repeats it, keeping each round's profile until the end (then collected).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 MALLOC_CHECK_=3 \\
        python tests/repro/profiler_collective_after_stop.py [--rounds 20] [--wait-inside]

Seen with torch 2.13.0+cpu (benchmarks/README.md, "heap"): each round's record of the
all-reduce is missing from ``prof.events()`` or has a wrong, often negative, duration,
and rank 0 aborts with ``free(): invalid pointer``. ``--wait-inside`` (waiting for the
all-reduce before leaving the profiler, pipedream_ext's workaround) is the control.
Not run by the test suite (it aborts; it documents a torch bug).
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from typing import List

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def rank0(store: dist.Store, rounds: int, wait_inside: bool) -> None:
    """The profiled rank: one all-reduce per round, left running past the profiler."""
    kept: List[profile] = []
    for r in range(rounds):
        t = torch.ones(1 << 12)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for _ in range(20):  # some op and memory events beside the collective's
                torch.randn(32, 32).mm(torch.randn(32, 32))
            work = dist.all_reduce(t, async_op=True)
            if wait_inside:
                store.set(f"go-{r}", "1")
                work.wait()
        if not wait_inside:
            store.set(f"go-{r}", "1")  # rank 1 joins the all-reduce only now
        work.wait()
        record = [(e.name, e.cpu_time_total) for e in prof.events() if e.name == "gloo:all_reduce"]
        print(f"round {r}: the all-reduce's record (us): {record}", flush=True)
        kept.append(prof)
        _ = [torch.ones(i % 64 + 1) for i in range(2000)]  # reuse freed memory
    del kept
    gc.collect()


def main() -> int:
    """Launches both ranks (no ``--rank``), or runs one."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--wait-inside", action="store_true", help="wait for the all-reduce inside the profiler")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is None:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r)] + sys.argv[1:]) for r in (0, 1)]
        codes = [proc.wait() for proc in procs]
        print("exit codes:", codes)
        return 1 if any(codes) else 0
    store = dist.TCPStore("127.0.0.1", args.port, 2, args.rank == 0)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2)
    if args.rank == 0:
        rank0(store, args.rounds, args.wait_inside)
    else:
        for r in range(args.rounds):
            store.wait([f"go-{r}"])
            time.sleep(0.05)
            dist.all_reduce(torch.ones(1 << 12))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
