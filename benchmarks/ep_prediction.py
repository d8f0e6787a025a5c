"""The planner's prediction of an expert-parallel pipeline against its measured step.

Run under ``torchrun --standalone --nproc-per-node 4 benchmarks/ep_prediction.py``: the
torchtitan-style MoE of tests/moe_model.py as an ``nn.Sequential`` (embedding, ``--layers``
MoE blocks, norm, head) on pp 2 x ep 2, ``balance="auto"``, ``--schedule``, ``--microbatches``,
each ep rank stepping on its half of a ``--rows``-row batch with Adam (the optimizer the cost
model prices; a barrier before each step). For FSDP and replicas, two plans:

* **dict**: ``{"*.moe.experts": ExpertParallel()}``, which the cost model sees
  (``_parallel/ep_costs.py``: experts held 1 / ep, their all_to_all per microbatch);
* **callable**: the same style applied by a function, which it cannot see: the model is
  priced as dense (the experts whole on every rank, no all_to_all).

Rank 0 prints one markdown row per run: predicted and measured (median after ``--warmup``)
milliseconds and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from moe_model import VOCAB, ExpertParallel, lm_loss, sequential

import pipedream_ext as pd


def callable_plan(stage: nn.Module, ep_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(stage, ep_mesh, {"*.moe.experts": ExpertParallel()})


def run(args: argparse.Namespace, data_parallel: str, plan: Any) -> List[float]:
    """(predicted ms, measured ms) of one pipeline."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (args.rows, args.seq), generator=g)
    y = torch.randint(0, VOCAB, (args.rows, args.seq), generator=g)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    half = args.rows // 2
    mine = slice(mesh["ep"].get_local_rank() * half, (mesh["ep"].get_local_rank() + 1) * half)
    pipe = pd.PipeDream(sequential(args.layers), lm_loss, schedule=args.schedule,
                        microbatches=args.microbatches, balance="auto", sample=(x[mine], y[mine]),
                        mesh=mesh, expert_parallel=plan, data_parallel=data_parallel, timeout=120)
    predicted = pipe.configuration.predicted_step_seconds * 1e3
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        float(pipe.step(x[mine], y[mine]))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    pipe.close()
    return [predicted, statistics.median(times[args.warmup:]) * 1e3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="global batch rows (each ep rank half)")
    p.add_argument("--seq", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        print("| data parallel | plan | predicted ms | measured ms | measured / predicted |")
        print("|---|---|---|---|---|")
    for _ in range(args.repeats):
        for data_parallel in ("fsdp", "replicate"):
            for name, plan in (("dict (priced)", {"*.moe.experts": ExpertParallel()}),
                               ("callable (dense)", callable_plan)):
                predicted, measured = run(args, data_parallel, plan)
                if dist.get_rank() == 0:
                    print(f"| {data_parallel} | {name} | {predicted:.1f} | {measured:.1f} | "
                          f"{measured / predicted:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
