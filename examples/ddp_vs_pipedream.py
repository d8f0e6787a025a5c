"""The same training run with DistributedDataParallel or with a pipeline.

One model (an MLP on scikit-learn's 8x8 digits), one seed, one global batch, one
optimizer and LR schedule; only the way the work is split over the ranks changes:

    torchrun --standalone --nproc-per-node 2 examples/ddp_vs_pipedream.py --parallel ddp
    torchrun --standalone --nproc-per-node 2 examples/ddp_vs_pipedream.py --parallel 1f1b

DDP: every rank holds the whole model and computes 1/N of each batch; the
gradients are averaged across ranks in ``backward()``. Pipeline: every rank holds
one stage (a slice of the layers) and all ranks work on every batch, split into
microbatches that flow from stage to stage. The update is the same: the mean
gradient over the global batch (for the flush schedules gpipe, 1f1b, zb-h1,
interleaved-1f1b; ``pipedream`` and ``pipedream-2bw`` are asynchronous and use
slightly stale weights). With the same data order both runs follow nearly the
same loss curve.

Every line where the two paths differ is marked ``# DDP`` or ``# PIPELINE``.
docs/guide/ddp.md ("Moving from DDP") shows them as a diff; a test keeps it honest.
The script exits with status 1 if the test accuracy is below --min-accuracy.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import pipedream_ext as pd

log = logging.getLogger("ddp_vs_pipedream")

SYNCHRONOUS = tuple(pd.schedules.synchronous_names())    # gpipe, 1f1b, interleaved-1f1b, zb-h1
ASYNCHRONOUS = tuple(pd.schedules.asynchronous_names())  # pipedream, pipedream-2bw
CHOICES = ("ddp",) + SYNCHRONOUS + ASYNCHRONOUS


def make_model(seed: int) -> nn.Sequential:
    """An 8-layer MLP; identical on every rank for a given seed.

    A pipeline needs an ``nn.Sequential``: it is cut into contiguous stages
    (2 ranks: layers 0-3 and 4-7). Every stage of an even cut over 1, 2 or 4
    stages holds a Linear, so every rank has parameters to optimize.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def load_digits(seed: int) -> Tuple[TensorDataset, TensorDataset]:
    """The 1797 digits (shipped with scikit-learn), scaled to [0, 1], split 80/20."""
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
    p.add_argument("--parallel", default="ddp", choices=CHOICES,
                   help="ddp, or the pipeline schedule to train with (default ddp)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline: microbatches per batch")
    p.add_argument("--chunks", type=int, default=1, help="interleaved-1f1b: stages per rank")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks together)")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.95,
                   help="exit with status 1 below this test accuracy (default 0.95)")
    p.add_argument("--save", default=None,
                   help="save the trained model's whole state_dict here (torch.save), as "
                        "make_model() loads it; a pipeline also leaves its checkpoint at SAVE.ckpt")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asynchronous = args.parallel in ASYNCHRONOUS

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    world = dist.get_world_size()
    # Progress and loss on the last rank: it holds the pipeline's last stage, the
    # only one that sees the loss of an asynchronous schedule.
    show = dist.get_rank() == world - 1
    if args.parallel == "ddp" and args.batch_size % world:  # DDP
        if show:
            log.error("--batch-size %d must be a multiple of the %d ranks", args.batch_size, world)
        dist.destroy_process_group()
        return 2
    train_set, test_set = load_digits(args.seed)
    model = make_model(args.seed)  # same init on every rank

    if args.parallel == "ddp":
        # DDP: the whole model on every rank; backward() all-reduces the gradients.
        model = DDP(model)  # DDP
        # Each rank loads its 1/world share of every global batch.
        sampler = DistributedSampler(train_set, seed=args.seed)  # DDP
        loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler)  # DDP
    else:
        # PIPELINE: this rank keeps one stage of the model (layers split evenly).
        model = pd.PipeDream(model, loss_fn=F.cross_entropy, schedule=args.parallel,  # PIPELINE
                             microbatches=args.microbatches, chunks=args.chunks)  # PIPELINE
        # Every rank loads the whole global batch, in the same order: stage 0 takes
        # its inputs, the last stage its targets, and the ranks in between ignore
        # it (they may pass None). A sampler with one replica yields the same
        # shuffled order as DDP's; each global batch holds the same samples as the
        # union of the DDP ranks' batches.
        sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)  # PIPELINE
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # PIPELINE
    samples_per_x = world if args.parallel == "ddp" else 1  # DDP: x is 1/world of the batch

    # PIPELINE: model.parameters() are this rank's stage only: each rank optimizes its own.
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    lr_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if show:
        log.info("%s on %d ranks: global batch %d, %d train / %d test images", args.parallel, world,
                 args.batch_size, len(train_set), len(test_set))

    start = time.time()
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, count, seen, t0 = 0.0, 0, 0, time.time()
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not show, leave=False,
                   file=sys.stdout)
        for x, y in bar:
            if args.parallel == "ddp":
                loss = F.cross_entropy(model(x), y)  # DDP
                loss.backward()  # DDP
                loss = loss.item()  # DDP: this rank's share of the batch
            elif asynchronous:
                # PIPELINE, asynchronous: the runtime steps opt at each weight update;
                # the loss is known on the last stage, and None while the pipeline fills.
                loss = model.step(x, y, optimizer=opt)  # PIPELINE
            else:
                loss = model.step(x, y)  # PIPELINE: forward + backward of the whole batch
            if not asynchronous:
                opt.step()
                opt.zero_grad()
            seen += len(y) * samples_per_x
            if loss is not None:
                total += loss * len(y)
                count += len(y)
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{seen / (time.time() - t0):.0f}",
                                refresh=False)
        if asynchronous:
            model.flush()  # PIPELINE, asynchronous: drain the pipeline before the epoch ends
        lr_schedule.step()
        stats = torch.tensor([total, count], dtype=torch.float64)
        if args.parallel == "ddp":
            dist.all_reduce(stats)  # DDP: every rank saw part of each batch
        if show:
            log.info("epoch %d: train loss %.4f, %.0f samples/s", epoch + 1,
                     stats[0].item() / max(stats[1].item(), 1), seen / (time.time() - t0))

    model.eval()
    x_test, y_test = test_set.tensors
    if args.parallel == "ddp":
        with torch.no_grad():  # DDP
            out = model(x_test)  # DDP: every rank runs the whole model
        accuracy = (out.argmax(dim=1) == y_test).double().mean().reshape(1)  # DDP: on every rank
    else:
        out = model.forward_only(x_test)  # PIPELINE: outputs on the last stage's rank, None elsewhere
        accuracy = torch.zeros(1, dtype=torch.float64)  # PIPELINE: `out` is None on the other ranks
        if out is not None:  # PIPELINE
            accuracy += (out.argmax(dim=1) == y_test).double().mean()  # PIPELINE
        dist.broadcast(accuracy, src=model.last_rank)  # PIPELINE: from the rank that has `out`
    if args.save and args.parallel == "ddp":
        if dist.get_rank() == 0:  # DDP
            torch.save(model.module.state_dict(), args.save)  # DDP: rank 0 holds the whole model
    elif args.save:
        # model.module would be this rank's stage only: every rank saves its own stage.
        pd.save_checkpoint(args.save + ".ckpt", model, opt)  # PIPELINE: every rank saves its stage
        if dist.get_rank() == 0:  # PIPELINE
            torch.save(pd.consolidate(args.save + ".ckpt"), args.save)  # PIPELINE: the whole model
    if show:
        log.info("test accuracy %.2f%% after %d epochs in %.1f s", 100 * accuracy.item(), args.epochs,
                 time.time() - start)
        print(f"TEST ACCURACY {accuracy.item():.4f}", flush=True)
        print(f"FINAL TRAIN LOSS {stats[0].item() / max(stats[1].item(), 1):.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if accuracy.item() < args.min_accuracy:
        if show:
            log.error("test accuracy %.4f is below --min-accuracy %.4f", accuracy.item(), args.min_accuracy)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
