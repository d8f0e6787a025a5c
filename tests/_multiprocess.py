"""Shared launcher for the multi-process test files (they run under pytest, which
starts them with torchrun, or directly under torchrun)."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_torchrun(script: str, world: int, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``script`` on ``world`` local ranks (one thread each) and returns the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", script]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_every_rank_passed(result: subprocess.CompletedProcess, world: int, marker: str) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert result.stdout.count(marker) == world, result.stdout[-4000:]


def worker_main(run_checks: Callable[[], None], marker: str) -> None:
    """The torchrun side: Gloo group, the checks, then ``marker`` printed by every rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run_checks()
    print(f"rank {dist.get_rank()}: {marker}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
