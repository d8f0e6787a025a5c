"""Pipeline-parallel training of a small CNN on scikit-learn's digits (8x8 images).

Real data, shipped inside scikit-learn (no download). Run on 4 CPU processes:

    torchrun --standalone --nproc-per-node 4 examples/train_digits.py

Every rank builds the same model and the same data order (seeded); pipedream_ext
keeps each rank's stage, and the optimizer only sees that stage's parameters.
The script exits non-zero if the test accuracy is below --min-accuracy.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import pipedream_ext as pd

log = logging.getLogger("train_digits")


def make_model(seed: int) -> nn.Sequential:
    """A 10-layer CNN for 1x8x8 digits; identical on every rank for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(64, 10),
    )


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


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b",
                   choices=pd.schedules.synchronous_names() + pd.schedules.asynchronous_names())
    p.add_argument("--vertical-sync", action="store_true", help="pipedream: vertical sync")
    p.add_argument("--recompute", action="store_true", help="recompute activations in the backward")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=1,
                   help="chunks per rank (interleaved-1f1b, interleaved-zb; 2 for zbv, dualpipev)")
    p.add_argument("--balance", default=None,
                   help="layers per stage, e.g. 3,3,2,2 (default: even); 'auto' to profile and plan "
                        "on rank 0; or a plan.json")
    p.add_argument("--replicas", default=None, help="replicas per stage, e.g. 2,1,1 (4 ranks)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.95,
                   help="exit with status 1 below this test accuracy (default 0.95)")
    p.add_argument("--device", default=None,
                   help="where the stages live, e.g. cpu or cuda:0 (default: cuda:LOCAL_RANK if "
                        "CUDA is available, else cpu)")
    p.add_argument("--backend", default=None,
                   help="process group backend, e.g. gloo (default: gloo on CPU, "
                        "cpu:gloo,cuda:nccl on GPU; NCCL needs one GPU per rank)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    train_set, test_set = load_digits(args.seed)
    balance = args.balance
    if balance and balance != "auto" and not balance.endswith(".json"):
        balance = [int(b) for b in balance.split(",")]
    replicas = [int(r) for r in args.replicas.split(",")] if args.replicas else None
    sample = (train_set.tensors[0][:args.batch_size], train_set.tensors[1][:args.batch_size])
    if args.backend:  # else PipeDream creates the default group for its device
        dist.init_process_group(args.backend)
    pipe = pd.PipeDream(make_model(args.seed), loss_fn=F.cross_entropy, schedule=args.schedule,
                        microbatches=args.microbatches, chunks=args.chunks, balance=balance,
                        vertical_sync=args.vertical_sync, recompute=args.recompute,
                        replicas=replicas, sample=sample if balance == "auto" else None,
                        device=args.device)
    rank = dist.get_rank()
    show = rank == 0
    # Asynchronous replicated stages take minibatches in rounds (lcm of the replica
    # counts) and flush after whole rounds: drop the ragged end of the epoch there.
    rounds = 1
    if pipe.asynchronous:
        for r in pipe.replicas:
            rounds = rounds * r // math.gcd(rounds, r)
    steps = len(train_set) // args.batch_size // rounds * rounds if rounds > 1 else None
    loader = DataLoader(train_set if steps is None else
                        torch.utils.data.Subset(train_set, range(steps * args.batch_size)),
                        batch_size=args.batch_size, shuffle=True, drop_last=False,
                        generator=torch.Generator().manual_seed(args.seed))
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr) if any(True for _ in pipe.parameters()) else None
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs) if opt else None
    if show:
        log.info("%d ranks, schedule %s, %d microbatches, balance %s, replicas %s, "
                 "%d train / %d test images", pipe.world_size, args.schedule, args.microbatches,
                 pipe.balance, pipe.replicas, len(train_set), len(test_set))
    start = time.time()
    for epoch in range(args.epochs):
        pipe.train()
        total, count = 0.0, 0
        for x, y in tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not show,
                         leave=False, file=sys.stdout):
            if pipe.asynchronous:
                # The runtime steps the optimizer at every weight update; the loss
                # (of the minibatch finishing its forward) is known on the last stage.
                loss = pipe.step(x, y, optimizer=opt)
            else:
                loss = pipe.step(x, y)
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
            if loss is not None:
                total += loss * len(y)
                count += len(y)
        pipe.flush()  # asynchronous schedules: drain before the epoch ends (no-op otherwise)
        if sched is not None:
            sched.step()
        # The last stage knows the loss; one broadcast per epoch brings it to rank 0.
        epoch_loss = torch.tensor([total / max(count, 1)], dtype=torch.float64)
        dist.broadcast(epoch_loss, src=pipe.last_rank)
        if show:
            log.info("epoch %d: train loss %.4f", epoch + 1, epoch_loss.item())

    pipe.eval()
    x_test, y_test = test_set.tensors
    out = pipe.forward_only(x_test)
    correct = torch.zeros(1)
    if out is not None:  # the last stage (its first replica when replicated)
        correct += (out.argmax(dim=1).cpu() == y_test).sum()
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
