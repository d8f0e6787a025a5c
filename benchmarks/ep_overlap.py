"""dualpipev with its F&B pairs overlapped (``overlap=True``) against plain dualpipev.

Run under ``torchrun --standalone --nproc-per-node 4 benchmarks/ep_overlap.py`` (pp 2 x ep
2; with 2 processes pp 1 x ep 2): a transformers Qwen3-MoE (``--hidden``, ``--experts``
top-2, 4 layers cut into dualpipev's 2 pp stages, so that both halves of every F&B pair
exchange) with ``expert_parallel="auto"``
(``RoutedExpertParallel``, which yields its turn at each all_to_all), replicas over ep,
each ep rank stepping on its ``--rows`` rows with Adam (a barrier before each step). The two
pipelines train from the same weights on the same batches, alternating by repeat.

Rank 0 prints one markdown row per run and pipeline: the median step (after
``--warmup``), the time ranks were blocked in all_to_all waits per step (rank mean: what no
other work hid), the exchanges per step during which the pair's other half ran, and the
last loss (the same for both: the result does not change). The hidden fraction is
``1 - blocked(overlap) / blocked(plain)``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import pipedream_ext as pd


def model(args: argparse.Namespace) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.hidden, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=args.experts, num_experts_per_tok=2,
                            max_position_embeddings=args.seq)
    return Qwen3MoeForCausalLM(config).train()


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def run(args: argparse.Namespace, overlap: bool) -> Dict[str, float]:
    """One pipeline's median step (ms), blocked all_to_all ms per step, yielded
    exchanges per step and last loss."""
    pp = dist.get_world_size() // 2
    mesh = init_device_mesh("cpu", (pp, 2), mesh_dim_names=("pp", "ep"))
    g = torch.Generator().manual_seed(1 + mesh["ep"].get_local_rank())
    batches = [(torch.randint(0, args.vocab, (args.rows, args.seq), generator=g),
                torch.randint(0, args.vocab, (args.rows, args.seq), generator=g))
               for _ in range(args.warmup + args.steps)]
    pipe = pd.PipeDream(model(args), loss_fn, schedule="dualpipev", chunks=2, microbatches=args.microbatches,
                        mesh=mesh, expert_parallel="auto", data_parallel="replicate", overlap=overlap,
                        split_points=[f"model.layers.{i}" for i in range(4 // (2 * pp), 4, 4 // (2 * pp))],
                        sample=batches[0], concrete_args={"use_cache": False}, timeout=120)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    times: List[float] = []
    for step, (x, y) in enumerate(batches):
        if step == args.warmup:
            pd.RoutedExpertParallel.exchanges.reset()
        dist.barrier()
        start = time.perf_counter()
        loss = float(pipe.step(x, y))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    pipe.close()
    exchanges = pd.RoutedExpertParallel.exchanges
    blocked = torch.tensor([exchanges.wait_seconds, exchanges.yielded], dtype=torch.float64)
    dist.all_reduce(blocked)
    world = dist.get_world_size()
    return {"step_ms": statistics.median(times[args.warmup:]) * 1e3,
            "blocked_ms": float(blocked[0]) / world / args.steps * 1e3,
            "yielded": float(blocked[1]) / world / args.steps, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="rows per ep rank and step")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        print("| repeat | dualpipev | step ms | blocked in all_to_all ms/step | yielded exchanges/step | "
              "last loss |")
        print("|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        results = {name: run(args, name == "overlap") for name in ("plain", "overlap")}
        if dist.get_rank() == 0:
            for name, r in results.items():
                print(f"| {repeat} | {name} | {r['step_ms']:.1f} | {r['blocked_ms']:.1f} | "
                      f"{r['yielded']:.1f} | {r['loss']:.6f} |", flush=True)
            plain, overlap = results["plain"], results["overlap"]
            print(f"| {repeat} | overlap / plain | {overlap['step_ms'] / plain['step_ms']:.2f} | hidden "
                  f"{1 - overlap['blocked_ms'] / plain['blocked_ms']:.0%} | | |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
