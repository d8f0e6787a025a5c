"""Four ways to lay a MoE model over 4 ranks, side by side: data parallelism only, experts
over ep, experts over ep with the attention over tp (a ``("pp", "ep", "tp")`` mesh), and
experts over the tp ranks (tp2ep).

Run under ``torchrun --standalone --nproc-per-node 4 benchmarks/ep_tp_layouts.py``: a
transformers Mixtral (``--hidden``, ``--experts`` top-2, ``--layers`` layers cut into
zbv's 2 stages, both on each rank: pp 1) trains ``--steps`` Adam steps on the same global
batches (``--rows`` rows, each copy its share; the tp ranks of a copy the same rows) with
replicas, from the same weights, in each layout:

* ``dp4``: ``("pp", "dp")`` (1, 4), every rank the whole model;
* ``ep4``: ``("pp", "ep")`` (1, 4), ``expert_parallel="auto"``: a quarter of the experts
  per rank, the attention whole;
* ``ep2 x tp2``: ``("pp", "ep", "tp")`` (1, 2, 2), Megatron-style attention over tp, the
  experts over ep (half per rank, the same on both tp ranks);
* ``tp2ep``: ``("pp", "dp", "tp")`` (1, 2, 2), attention and experts in one
  ``tensor_parallel=`` plan (``RoutedExpertParallel``: half the experts per tp rank).

Rank 0 prints one markdown row per layout and repeat: the median step (ms, after
``--warmup``; a barrier before each step), the parameter bytes per rank (mean over
ranks, local shards), the copies (``data_parallel_size``) and the last loss: the same in
every layout (they train one model on one batch).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import pipedream_ext as pd

#: Each layout: its mesh shape and dimension names.
LAYOUTS: Dict[str, Tuple[Tuple[int, ...], Tuple[str, ...]]] = {
    "dp4": ((1, 4), ("pp", "dp")),
    "ep4": ((1, 4), ("pp", "ep")),
    "ep2 x tp2": ((1, 2, 2), ("pp", "ep", "tp")),
    "tp2ep": ((1, 2, 2), ("pp", "dp", "tp")),
}


def model(args: argparse.Namespace) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=2,
                           max_position_embeddings=args.seq)
    return MixtralForCausalLM(config).train()


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def plans(layout: str) -> Dict[str, Any]:
    """The ``PipeDream`` plan options of ``layout``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    attention = {"model.layers.*.self_attn": PrepareModuleInput(),
                 **{f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
                 "model.layers.*.self_attn.o_proj": RowwiseParallel()}
    experts = {"model.layers.*.mlp.experts": pd.RoutedExpertParallel()}
    return {"dp4": {}, "ep4": {"expert_parallel": experts},
            "ep2 x tp2": {"tensor_parallel": attention, "expert_parallel": experts},
            "tp2ep": {"tensor_parallel": {**attention, **experts}}}[layout]


def run(args: argparse.Namespace, layout: str) -> Dict[str, float]:
    """One layout's median step (ms), parameter bytes per rank, copies and last loss."""
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.rows, args.seq), generator=g),
                torch.randint(0, args.vocab, (args.rows, args.seq), generator=g))
               for _ in range(args.warmup + args.steps)]
    tp = shape[names.index("tp")] if "tp" in names else 1
    rows = args.rows * tp // dist.get_world_size()  # each copy's
    sample = (batches[0][0][:rows], batches[0][1][:rows])
    pipe = pd.PipeDream(model(args), loss_fn, schedule="zbv", chunks=2, microbatches=args.microbatches,
                        mesh=mesh, data_parallel="replicate", split_points=[f"model.layers.{args.layers // 2}"],
                        sample=sample, concrete_args={"use_cache": False}, timeout=120, **plans(layout))
    copies, mine = pipe.data_parallel_size, pipe.data_parallel_rank
    part = slice(mine * rows, (mine + 1) * rows)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    times: List[float] = []
    for x, y in batches:
        dist.barrier()
        start = time.perf_counter()
        loss = float(pipe.step(x[part], y[part]))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in pipe.parameters())
    pipe.close()
    total = torch.tensor([float(local)], dtype=torch.float64)
    dist.all_reduce(total)
    return {"step_ms": statistics.median(times[args.warmup:]) * 1e3,
            "mib": float(total[0]) / dist.get_world_size() / 2**20, "copies": copies, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=16, help="rows of the global batch")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit(f"run it on 4 processes (torchrun --nproc-per-node 4), not {dist.get_world_size()}")
    if dist.get_rank() == 0:
        print("| repeat | layout | copies | step ms | vs dp4 | parameter MiB per rank | last loss |")
        print("|---|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        results = {layout: run(args, layout) for layout in LAYOUTS}
        if dist.get_rank() == 0:
            base = results["dp4"]["step_ms"]
            for layout, r in results.items():
                print(f"| {repeat} | {layout} | {r['copies']} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f} | "
                      f"{r['mib']:.2f} | {r['loss']:.6f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
