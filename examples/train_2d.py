"""Pipeline + FSDP (2D) training of the GPT-style byte-level model of train_gpt.py.

Four CPU processes as a 2 x 2 mesh: a pipeline of 2 stages (``mesh["pp"]``), each
stage sharded with FSDP2 over 2 data-parallel ranks (``mesh["dp"]``)::

    torchrun --standalone --nproc-per-node 4 examples/train_2d.py --dp 2

The model is train_gpt.py's ``nn.Sequential`` (embedding, --layers transformer
blocks, LayerNorm, head) built on the meta device, with one difference: the head has
its own weight (UNTIED from the token embedding), because a mesh refuses parameters
tied across stages (the embedding sits on the first stage, the head on the last).
Each dp rank reads its own shard of every global batch: a ``DistributedSampler`` over
the dp dimension (``num_replicas=dp``, ``rank=`` the dp coordinate) of fixed-length
windows of the standard library's source bytes; the two stages of one pipeline read
the same shard. AdamW, ``pd.clip_grad_norm_(pipe, 1.0)`` (the norm over every shard
of every stage), and the global batch's loss logged every --log-every steps. The
script exits non-zero unless the mean loss of the last 10 steps is below the
training bytes' unigram entropy (the best context-free model), unless --no-goal.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import pipedream_ext as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import block_balance, lm_loss, make_model, stdlib_sources, unigram_entropy

log = logging.getLogger("train_2d")


class Windows(Dataset):
    """``count`` windows of ``length + 1`` bytes at seeded random offsets of ``data``:
    (input bytes, next-byte targets). The same on every rank."""

    def __init__(self, data: torch.Tensor, length: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data, self.length = data, length
        self.starts = torch.randint(len(data) - length - 1, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        window = self.data[self.starts[i]:self.starts[i] + self.length + 1].long()
        return window[:-1], window[1:]


def untied_model(layers: int, width: int, heads: int, context: int) -> nn.Sequential:
    """train_gpt's model with a head of its own (meta device when called under it):
    a mesh refuses a weight tied across stages."""
    model = make_model(layers, width, heads, context)
    head = model[-2]
    head.weight = nn.Parameter(torch.empty_like(head.weight))
    return model


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP) ranks per stage (default 2)")
    p.add_argument("--data-parallel", default="fsdp", choices=("fsdp", "replicate"))
    p.add_argument("--schedule", default="1f1b", choices=pd.schedules.synchronous_names())
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--length", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch, sequences")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-bytes", type=int, default=1_000_000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-goal", action="store_true", help="do not check the goal (quick runs)")
    args = p.parse_args(argv)
    if args.batch_size % (args.dp * args.microbatches):
        p.error(f"--batch-size {args.batch_size} must split into --dp {args.dp} x "
                f"--microbatches {args.microbatches}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"{world} ranks do not split into --dp {args.dp}")
    pp = world // args.dp
    mesh = init_device_mesh("cpu", (pp, args.dp), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh["dp"].get_local_rank()

    train_data = torch.cat([torch.frombuffer(bytearray(b), dtype=torch.uint8)
                            for _, b in stdlib_sources(args.data_bytes)])
    baseline = unigram_entropy(train_data)
    dataset = Windows(train_data, args.length, args.steps * args.batch_size, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=args.dp, rank=dp_rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size // args.dp, sampler=sampler, drop_last=True)

    with torch.device("meta"):  # shapes only: each rank materialises (and shards) its own layers
        model = untied_model(args.layers, args.width, max(1, args.width // 32), args.length)
    pipe = pd.PipeDream(model, loss_fn=lm_loss, schedule=args.schedule, microbatches=args.microbatches,
                        balance=block_balance(args.layers, pp), init_seed=args.seed, mesh=mesh,
                        data_parallel=args.data_parallel)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    show = dist.get_rank() == 0  # every rank gets the global batch's loss; one speaks
    if show:
        log.info("pp %d x dp %d (%s), schedule %s, balance %s, %.2fM parameters, head UNTIED "
                 "from the embedding (a mesh refuses weights tied across stages); unigram "
                 "baseline %.4f nats", pp, args.dp, args.data_parallel, args.schedule, pipe.balance,
                 sum(p.numel() for p in model.parameters()) / 1e6, baseline)
    losses: List[float] = []
    start = time.time()
    for step, (x, y) in enumerate(loader):
        loss = pipe.step(x, y)  # this dp rank's shard; returns the global batch's mean loss
        norm = pd.clip_grad_norm_(pipe, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if show and (step + 1) % args.log_every == 0:
            log.info("step %d: loss %.4f, grad norm %.3f, %.1f s", step + 1, loss, float(norm),
                     time.time() - start)
    final = sum(losses[-10:]) / len(losses[-10:])
    if show:
        print(f"FINAL TRAIN LOSS {final:.4f} (unigram baseline {baseline:.4f}, first step "
              f"{losses[0]:.4f}) after {len(losses)} steps, {time.time() - start:.1f} s", flush=True)
    pipe.close()
    dist.destroy_process_group()
    if not args.no_goal and not (math.isfinite(final) and final < baseline):
        if show:
            log.error("final loss %.4f is not below the unigram baseline %.4f", final, baseline)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
