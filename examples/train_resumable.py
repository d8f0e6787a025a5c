"""Checkpoint every K steps, resume after a crash: the pattern for `torchrun --max-restarts`.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 3 \\
        --max-restarts 1 --monitor-interval 0.5 \\
        examples/train_resumable.py --checkpoint /tmp/ckpt --steps 60 --every 10 --simulate-crash 1:25

An MLP on scikit-learn's digits, pipelined over the ranks. At start-up every
rank loads the newest complete checkpoint in --checkpoint if there is one
(weights, optimizer, LR schedule and the step to go on from), then trains to
--steps, saving a checkpoint every --every steps and at the end. The batch of
step t is a function of (seed, t), so a resumed run sees exactly the batches
the lost one would have.

When a rank dies, torchrun stops the others and, with --max-restarts N, starts
the job again (TORCHELASTIC_RESTART_COUNT goes up by one): the new processes
resume from the last checkpoint, and the run ends with the same weights as one
that never failed (flush schedules and, since saving flushes them, the
asynchronous ones too). Work since that checkpoint is done again.
--simulate-crash RANK:STEP kills RANK with SIGKILL when it reaches STEP, on the
first attempt only, to watch that happen.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13, Gloo workers restarted on
torchrun's shared store can read the failed attempt's addresses and fail
("Gloo connectFullMesh failed ... Connection refused") or hang; this makes every
attempt use a fresh store (docs/runtime.md, "Faults and restarts").

The final weights: `python -m pipedream_ext consolidate /tmp/ckpt -o model.pt`.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pipedream_ext as pd

log = logging.getLogger("train_resumable")


def make_model(seed: int) -> nn.Sequential:
    """7 layers, each stage of up to 4 ranks gets weights; identical on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def load_digits() -> Tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    return (torch.tensor(data.data, dtype=torch.float32) / 16.0,
            torch.tensor(data.target, dtype=torch.long))


def batch_of_step(x: torch.Tensor, y: torch.Tensor, step: int, batch_size: int,
                  seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The batch of a step: a pure function of (seed, step), so resuming needs no loader state."""
    per_epoch = len(x) // batch_size
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    chosen = order[index * batch_size:(index + 1) * batch_size]
    return x[chosen], y[chosen]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (resumed from if complete)")
    p.add_argument("--steps", type=int, default=60, help="train until this step")
    p.add_argument("--every", type=int, default=10, help="save a checkpoint every this many steps")
    p.add_argument("--schedule", default="1f1b",
                   choices=pd.schedules.synchronous_names() + pd.schedules.asynchronous_names())
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any wait on another rank may take (default 60)")
    p.add_argument("--simulate-crash", default=None, metavar="RANK:STEP",
                   help="kill RANK with SIGKILL when it reaches STEP, on the first attempt only")
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < 1:
        p.error("--steps and --every must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash = tuple(int(v) for v in args.simulate_crash.split(":")) if args.simulate_crash else None
    x_all, y_all = load_digits()

    pipe = pd.PipeDream(make_model(args.seed), loss_fn=F.cross_entropy, schedule=args.schedule,
                        microbatches=args.microbatches if args.schedule != "pipedream" else 1,
                        timeout=args.timeout)
    rank = dist.get_rank()
    has_weights = any(True for _ in pipe.parameters())
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr) if has_weights else None
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps) if opt else None
    if pipe.asynchronous:
        # The runtime updates inside the pipeline: while it fills, the scheduler
        # steps before the stage's first optimizer step. That is intended here.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")

    start = 0
    if os.path.exists(os.path.join(args.checkpoint, "manifest.json")):
        info = pd.load_checkpoint(args.checkpoint, pipe, opt)  # every rank; raises if broken
        start = int(info.step)
        if sched is not None:
            sched.load_state_dict(info.extra["scheduler"])
        if rank == 0:
            log.info("attempt %d: resumed from %s at step %d", attempt, args.checkpoint, start)
    elif rank == 0:
        log.info("attempt %d: no checkpoint in %s, starting at step 0", attempt, args.checkpoint)

    for step in range(start, args.steps):
        if crash is not None and attempt == 0 and (rank, step) == crash:
            log.warning("rank %d: simulated crash at step %d (SIGKILL)", rank, step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_of_step(x_all, y_all, step, args.batch_size, args.seed)
        if pipe.asynchronous:
            loss = pipe.step(x, y, optimizer=opt)  # the runtime steps the optimizer
        else:
            loss = pipe.step(x, y)
            if opt is not None:
                opt.step()
                opt.zero_grad()
        if sched is not None:
            sched.step()
        done = step + 1
        if done % args.every == 0 or done == args.steps:
            # extra is rank 0's: every rank's scheduler is in the same state here
            # (one parameter group each, the same lr and step count).
            pd.save_checkpoint(args.checkpoint, pipe, opt, step=done,
                               extra={"scheduler": sched.state_dict() if sched else None})
            if rank == 0:
                log.info("step %d: checkpoint saved%s", done,
                         f" (loss {loss:.4f})" if loss is not None and not pipe.asynchronous else "")
    pipe.flush()
    if rank == 0:
        log.info("attempt %d: finished at step %d", attempt, args.steps)
        print(f"FINISHED {args.steps} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
