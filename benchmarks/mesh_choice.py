"""mesh="auto" / data_parallel="auto": each candidate mesh's predicted step against its
measured one (the table of benchmarks/results/mesh_choice.md; one launch per row group).

Run under ``torchrun --nproc_per_node N benchmarks/mesh_choice.py MODEL`` (MODEL ``mlp``:
8 ``Linear(32, 32)`` + ``Linear(32, 4)``; ``tp``: 4 blocks ``Linear(64, 128), ReLU,
Linear(128, 64)`` + ``Linear(64, 4)`` with a Colwise/Rowwise plan). ``PipeDream(...,
sample=(x, y), mesh="auto", data_parallel="auto", schedule="gpipe", microbatches=1)`` on a
32-row global batch chooses; then every candidate of its configuration (the best and the
runners-up) is built on its own mesh and stepped ``--steps`` times with Adam (the
optimizer the cost model prices; a barrier before each step): rank 0 prints one line
per candidate, predicted and measured (the median after ``--warmup``) milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import pipedream_ext as pd

ROWS = 32


def build(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)], nn.Linear(32, 4))
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
                           for _ in range(4)], nn.Linear(64, 4))


def plan_of(kind: str) -> Optional[Dict[str, Any]]:
    if kind != "tp":
        return None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}


def measure(kind: str, chosen: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
            warmup: int) -> float:
    """Median step milliseconds of ``chosen`` built on its own mesh."""
    pp, dp, tp = chosen.mesh
    kwargs: Dict[str, Any] = {}
    if dp * tp > 1:
        shape, names = ((pp, dp), ("pp", "dp")) if tp == 1 else ((pp, dp, tp), ("pp", "dp", "tp"))
        kwargs = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=names),
                  "data_parallel": chosen.data_parallel or "replicate"}
        if tp > 1:
            kwargs["tensor_parallel"] = plan_of(kind)
    pipe = pd.PipeDream(build(kind), F.cross_entropy, schedule=chosen.schedule,
                        microbatches=chosen.microbatches, balance=list(chosen.balance),
                        chunks=chosen.chunks, timeout=60, **kwargs)
    part = ROWS // dp
    first = pipe.data_parallel_rank * part
    xb, yb = x[first:first + part], y[first:first + part]
    opt = torch.optim.Adam(pipe.parameters(), lr=0.001)
    times: List[float] = []
    for _ in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(xb, yb)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    pipe.close()
    return statistics.median(times[warmup:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["mlp", "tp"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    width = 32 if args.model == "mlp" else 64
    x, y = torch.randn(ROWS, width), torch.randint(0, 4, (ROWS,))
    plan = plan_of(args.model)
    pipe = pd.PipeDream(build(args.model), F.cross_entropy, sample=(x, y), mesh="auto",
                        data_parallel="auto", schedule="gpipe", microbatches=1, timeout=60,
                        **({"tensor_parallel": plan} if plan else {}))
    chosen = pipe.configuration
    pipe.close()
    if dist.get_rank() == 0:
        print(chosen.table(), flush=True)
    for candidate in [chosen] + list(chosen.candidates):
        ms = measure(args.model, candidate, x, y, args.steps, args.warmup)
        if dist.get_rank() == 0:
            pp, dp, tp = candidate.mesh
            print(f"| {args.model}, {dist.get_world_size()} | {pp}x{dp}x{tp} "
                  f"{candidate.data_parallel or ''} | "
                  f"{candidate.predicted_step_seconds * 1e3:.2f} | {ms:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
