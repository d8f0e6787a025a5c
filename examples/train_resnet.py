"""A ResNet-style CNN on scikit-learn's digits, split by the planner (``balance="auto"``).

The model is a plain ``nn.Module`` (residual blocks with BatchNorm, skip connections,
``torch.flatten``), not an ``nn.Sequential``: pipedream_ext traces it with torch.fx,
rank 0 profiles the traced graph (one node per module call and the operations after
it, an edge for every value passed on, skip connections included) and plans it with
PipeDream's antichain DP, and every rank runs the plan's stages. Run on 2 CPU processes:

    torchrun --standalone --nproc-per-node 2 examples/train_resnet.py

The default schedule, ``zb-h1``, is planned as a straight pipeline (one stage per
rank). With ``--schedule 1f1b`` or ``gpipe`` the planner may also replicate stages;
on this small model it often prefers plain data parallelism (one stage on both
ranks), which the plan table then shows. The script exits non-zero if the test
accuracy is below --min-accuracy.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import pipedream_ext as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import ResNet

log = logging.getLogger("train_resnet")


def make_model(seed: int, width: int) -> ResNet:
    """1x8x8 digits -> 10 classes: a stem, two stages of two residual blocks, a linear head;
    identical on every rank for a given seed."""
    torch.manual_seed(seed)
    return ResNet((2, 2), (width, 2 * width), in_channels=1, classes=10, stem="conv_bn", projection="conv_bn",
                  pool=2)


def load_digits(seed: int) -> Tuple[TensorDataset, TensorDataset]:
    """The 1797 digits, scaled to [0, 1], split 80/20 with a fixed permutation."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def describe_stages(pipe: pd.PipeDream) -> List[str]:
    """What each stage runs: its module calls, shortened to the residual blocks."""
    lines = []
    for j, stage in enumerate(pipe.traced.stages):
        calls = [str(n.target) for n in stage.graph.nodes if n.op == "call_module"]
        blocks = list(dict.fromkeys(".".join(c.split(".")[:2 if c.startswith("layer") else 1])
                                    for c in calls))
        lines.append(f"stage {j} (ranks {pipe.plan.stages[j].ranks}): {', '.join(blocks)}")
    return lines


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="zb-h1",
                   choices=[s for s in pd.schedules.synchronous_names() if s != "interleaved-1f1b"],
                   help="a flush schedule (interleaving needs chunks, which a plan does not set)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--width", type=int, default=32, help="channels of the first stage")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9,
                   help="exit with status 1 below this test accuracy (default 0.9)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    train_set, test_set = load_digits(args.seed)
    sample = (train_set.tensors[0][:args.batch_size], train_set.tensors[1][:args.batch_size])
    started = time.time()
    # Rank 0 traces, profiles and plans; every rank gets the plan and keeps its stage.
    pipe = pd.PipeDream(make_model(args.seed, args.width), loss_fn=F.cross_entropy,
                        schedule=args.schedule, microbatches=args.microbatches,
                        balance="auto", sample=sample)
    show = dist.get_rank() == 0
    if show:  # the plan's table is logged by PipeDream; which blocks each stage runs:
        print("\n".join(describe_stages(pipe)), flush=True)
        log.info("traced, profiled and planned in %.1f s", time.time() - started)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    params = list(pipe.parameters())
    opt = torch.optim.Adam(params, lr=args.lr) if params else None
    start = time.time()
    for epoch in range(args.epochs):
        pipe.train()
        total, count = 0.0, 0
        for x, y in loader:
            loss = pipe.step(x, y)  # the batch's mean loss, on every rank
            if opt is not None:
                opt.step()
                opt.zero_grad()
            total += loss * len(y)
            count += len(y)
        if show:
            log.info("epoch %d: train loss %.4f", epoch + 1, total / count)

    pipe.eval()  # BatchNorm uses its running statistics
    x_test, y_test = test_set.tensors
    out = pipe.forward_only(x_test)
    correct = torch.zeros(1)
    if out is not None:  # the last stage's (first) rank
        correct += (out.argmax(dim=1) == y_test).sum()
    dist.broadcast(correct, src=pipe.last_rank)
    accuracy = correct.item() / len(y_test)
    if show:
        log.info("test accuracy %.2f%% (%d/%d) after %d epochs in %.1f s", 100 * accuracy,
                 int(correct.item()), len(y_test), args.epochs, time.time() - start)
        print(f"TEST ACCURACY {accuracy:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if accuracy < args.min_accuracy:
        if show:
            log.error("test accuracy %.4f is below --min-accuracy %.4f", accuracy, args.min_accuracy)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
