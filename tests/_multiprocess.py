"""Shared launcher for the multi-process test files (they run under pytest, which
starts them with torchrun, or directly under torchrun)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import pytest
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


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_raw(script: str, world: int, case: str, timeout: float = 120,
               rank_env: Optional[Sequence[Dict[str, str]]] = None
               ) -> List[subprocess.CompletedProcess]:
    """Runs ``script --fault case`` on ``world`` plain rank processes (no torchrun, which
    would kill the survivors of a failing rank); fails the test if a rank hangs.

    Args:
        rank_env: environment variables per rank (e.g. another ``PYTHONHASHSEED`` each).

    Returns:
        One result per rank (stdout and stderr together in ``stdout``).
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.update(rank_env[rank] if rank_env else {})
        procs.append(subprocess.Popen([sys.executable, script, "--fault", case], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    deadline = time.time() + timeout
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} hung in fault case {case!r}")
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


def assert_every_rank_passed(result: subprocess.CompletedProcess, world: int, marker: str) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert result.stdout.count(marker) == world, result.stdout[-4000:]


# The backend the worker side runs on: "gloo" (default), or "nccl_rules" to run a
# suite under NCCL's point-to-point rules on the CPU (tests/test_nccl_rules.py).
BACKEND_ENV = "PIPEDREAM_TEST_BACKEND"


def init_test_group() -> None:
    """The default group of a test worker, on the backend ``PIPEDREAM_TEST_BACKEND`` names."""
    backend = os.environ.get(BACKEND_ENV, "gloo")
    if backend == "nccl_rules":
        import pipedream_ext.testing as pdt

        pdt.register_nccl_rules_backend()
    elif backend != "gloo":
        raise ValueError(f"{BACKEND_ENV}={backend!r}: use 'gloo' or 'nccl_rules'")
    dist.init_process_group(backend)


def worker_main(run_checks: Callable[[], None], marker: str) -> None:
    """The torchrun side: the test group, the checks, then ``marker`` printed by every rank."""
    torch.set_num_threads(1)
    init_test_group()
    run_checks()
    print(f"rank {dist.get_rank()}: {marker}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
