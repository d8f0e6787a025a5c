"""Pipeline-parallel training of a small GPT-style byte-level language model.

Real text that ships with Python itself (no download): the standard library's own
source files, read as bytes. Run on 2 CPU processes:

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

The model is an ``nn.Sequential`` of a token + position embedding, --layers pre-norm
transformer blocks with causal self-attention, a final LayerNorm and a head whose
weight is the token embedding's (GPT-2 style tied weights, kept by both the first
and the last stage, their gradients summed). It is built on the meta device and
each rank materialises only its own layers (``init_seed``). Every rank builds the
same batches from (seed, step); the sequence length changes from batch to batch.

After each epoch the last stage's rank logs the training loss and the validation
loss and perplexity (``forward_only``), next to the unigram baseline: the entropy
of the training bytes' unigram distribution, the loss of the best model that
ignores context. At the end a few lines of text are generated (every rank runs
``forward_only`` once per byte; the last stage's rank samples and broadcasts the
bytes). The script exits non-zero unless the validation loss is below the baseline
by --goal-margin (default 10%).

Checkpoints: --checkpoint DIR saves one after every epoch (pd.save_checkpoint);
--resume continues from it (weights, optimizer, epoch; the learning rate and the
batches are functions of the step, so the resumed run sees the same ones).
"""
from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import pipedream_ext as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import VOCAB, gpt_sequential

log = logging.getLogger("train_gpt")

# Prompts for the generated text at the end: the model has seen how Python files go on.
PROMPTS = (b"def ", b"import ", b"class ", b"    return ", b"# ", b"    if ", b"for ", b"    self.")


# -- data ------------------------------------------------------------------------------------

def stdlib_sources(max_bytes: int) -> List[Tuple[str, bytes]]:
    """The standard library's top-level ``*.py`` files in sorted order, as bytes, up to
    ``max_bytes`` in total: a deterministic subset, the same on every rank and run."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    chosen: List[Tuple[str, bytes]] = []
    total = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        if total + len(data) > max_bytes and chosen:
            break
        chosen.append((os.path.basename(path), data))
        total += len(data)
    return chosen


def split_by_file(sources: Sequence[Tuple[str, bytes]], every: int,
                  max_val_bytes: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Every ``every``-th file goes to validation (capped at ``max_val_bytes`` to keep
    evaluation short), the rest to training. Files are joined with a blank line.

    Returns:
        (train bytes, validation bytes) as uint8 tensors and the number of validation files.
    """
    if len(sources) < 2:
        raise ValueError(f"{len(sources)} source file(s): need 2 or more to split; raise --data-bytes")
    # Fewer than ``every`` files (a tiny --data-bytes): the last one validates.
    chosen = set(range(every - 1, len(sources), every)) or {len(sources) - 1}
    train = [data for i, (_, data) in enumerate(sources) if i not in chosen]
    val = [data for i, (_, data) in enumerate(sources) if i in chosen]
    val_bytes = b"\n\n".join(val)[:max_val_bytes]

    def as_tensor(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()

    return as_tensor(b"\n\n".join(train)), as_tensor(val_bytes), len(val)


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy in nats of the bytes' unigram distribution: the cross entropy of the best
    context-free model on these bytes."""
    counts = torch.bincount(data.long(), minlength=VOCAB).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def train_batch(data: torch.Tensor, step: int, batch_size: int, lengths: Sequence[int],
                seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The batch of a global step: ``batch_size`` random windows of one length drawn
    from ``lengths``, inputs and next-byte targets. A pure function of (seed, step), so
    every rank builds the same batch and a resumed run the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    length = lengths[int(torch.randint(len(lengths), (1,), generator=g))]
    starts = torch.randint(len(data) - length - 1, (batch_size, 1), generator=g)
    index = starts + torch.arange(length + 1)
    window = data[index].long()
    return window[:, :-1], window[:, 1:]


def validation_batches(data: torch.Tensor, length: int, batch_size: int,
                       min_batch: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The validation bytes cut into consecutive windows of ``length``, in batches of
    ``batch_size``; the last batch is smaller (joined to the one before if it would be
    smaller than ``min_batch``, since the pipeline needs a row per microbatch)."""
    count = (len(data) - 1) // length
    window = data[:count * length + 1].long()
    x = window[:-1].view(count, length)
    y = window[1:].view(count, length)
    cuts = list(range(0, count, batch_size)) + [count]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < min_batch:
        del cuts[-2]
    return [(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


# -- model -----------------------------------------------------------------------------------

def make_model(layers: int, width: int, heads: int, context: int) -> nn.Sequential:
    """Embed, ``layers`` blocks, LayerNorm, tied head, flatten: ``layers + 4`` layers."""
    return gpt_sequential(layers, width, heads, context, VOCAB)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy; logits arrive flattened, targets as (batch, time)."""
    return F.cross_entropy(logits, targets.reshape(-1))


def block_balance(layers: int, stages: int) -> Optional[List[int]]:
    """Layers per stage with the blocks spread evenly (earlier stages take the extra
    ones) and the embedding on the first stage, LayerNorm, head and flatten on the
    last, so the blocks, which hold the compute, are shared out evenly. ``None`` (the
    library's even split) when there are fewer blocks than stages."""
    if layers < stages:
        return None
    balance = [layers // stages + (1 if j < layers % stages else 0) for j in range(stages)]
    balance[0] += 1
    balance[-1] += 3
    return balance


# -- training --------------------------------------------------------------------------------

def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak: a function of the step only."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(pipe: pd.PipeDream, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-byte cross entropy over the validation batches, on every rank."""
    pipe.eval()
    total = torch.zeros(2, dtype=torch.float64)  # summed loss, tokens
    with torch.no_grad():
        for x, y in batches:
            logits = pipe.forward_only(x)
            if logits is not None:  # the last stage's rank
                total[0] += F.cross_entropy(logits, y.reshape(-1), reduction="sum").item()
                total[1] += y.numel()
    dist.broadcast(total, src=pipe.last_rank)
    pipe.train()
    return float(total[0] / total[1])


def generate(pipe: pd.PipeDream, prompts: Sequence[bytes], new_bytes: int, context: int,
             temperature: float, seed: int) -> List[bytes]:
    """Continues each prompt by ``new_bytes`` bytes, all prompts side by side in one batch.

    Every rank calls ``forward_only`` once per byte; the last stage's rank samples the
    next byte of every row and broadcasts them, so all ranks extend the same batch.
    Prompts are left-padded with newlines to one length; the context is cropped to the
    model's ``context`` positions."""
    width = max(len(p) for p in prompts)
    rows = torch.tensor([list(b"\n" * (width - len(p)) + p) for p in prompts], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    pipe.eval()
    with torch.no_grad():
        for _ in range(new_bytes):
            window = rows[:, -context:]
            logits = pipe.forward_only(window)
            nxt = torch.zeros(len(prompts), dtype=torch.long)
            if logits is not None:
                last = logits.view(len(prompts), window.shape[1], VOCAB)[:, -1]
                if temperature > 0:
                    nxt = torch.multinomial(F.softmax(last / temperature, dim=-1), 1,
                                            generator=g).squeeze(1)
                else:
                    nxt = last.argmax(dim=-1)
            dist.broadcast(nxt, src=pipe.last_rank)
            rows = torch.cat([rows, nxt.unsqueeze(1)], dim=1)
    return [bytes(r[width - len(p):].tolist()) for r, p in zip(rows, prompts)]


def goal_exit_status(val_loss: float, baseline: float, args: argparse.Namespace, show: bool,
                     logger: logging.Logger) -> int:
    """The script's exit status: 0 when ``val_loss`` is below the unigram ``baseline`` by
    ``args.goal_margin`` (or ``args.no_goal``), else 1, the miss logged where ``show``."""
    goal = (1 - args.goal_margin) * baseline
    if args.no_goal or val_loss < goal:
        return 0
    if show:
        logger.error("validation loss %.4f is not below %.4f (unigram baseline %.4f - %d%%)",
                     val_loss, goal, baseline, round(100 * args.goal_margin))
    return 1


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b", choices=pd.schedules.synchronous_names(),
                   help="a flush schedule (default 1f1b); the asynchronous pipedream and "
                        "pipedream-2bw refuse the tied embedding/head weight")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=1, help="chunks per rank (interleaved-1f1b)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--width", type=int, default=192, help="model width (default 192)")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: width // 32, heads of 32 dimensions)")
    p.add_argument("--context", type=int, default=128,
                   help="longest sequence (positions of the model; default 128)")
    p.add_argument("--lengths", default="64,96,128",
                   help="sequence lengths a training batch draws from (default 64,96,128)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch, sequences")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps-per-epoch", type=int, default=80)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW; default 2e-3)")
    p.add_argument("--warmup", type=int, default=30, help="warm-up steps (default 30)")
    p.add_argument("--data-bytes", type=int, default=2_000_000,
                   help="bytes of standard-library source to read (default 2 MB)")
    p.add_argument("--val-bytes", type=int, default=65_536,
                   help="cap on the validation bytes (default 64 KiB)")
    p.add_argument("--generate", type=int, default=200, help="bytes to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="save a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--goal-margin", type=float, default=0.10,
                   help="exit with status 1 unless validation loss < (1 - margin) * unigram "
                        "baseline (default 0.10)")
    p.add_argument("--no-goal", action="store_true", help="do not check the goal (quick runs)")
    args = p.parse_args(argv)
    args.lengths = [int(v) for v in args.lengths.split(",")]
    if args.heads is None:
        args.heads = max(1, args.width // 32)
    if args.width % args.heads:
        p.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if max(args.lengths) > args.context or min(args.lengths) < 1:
        p.error(f"--lengths {args.lengths} must lie in 1..--context {args.context}")
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint DIR")
    if args.batch_size < args.microbatches:
        p.error(f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    sources = stdlib_sources(args.data_bytes)
    train_data, val_data, val_files = split_by_file(sources, every=10, max_val_bytes=args.val_bytes)
    baseline = unigram_entropy(train_data)
    val_set = validation_batches(val_data, args.context, args.batch_size, args.microbatches)

    with torch.device("meta"):  # shapes only: each rank materialises its own layers
        model = make_model(args.layers, args.width, args.heads, args.context)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipe = pd.PipeDream(model, loss_fn=lm_loss, schedule=args.schedule,
                        microbatches=args.microbatches, chunks=args.chunks,
                        balance=block_balance(args.layers, world * args.chunks),
                        init_seed=args.seed)
    rank = dist.get_rank()
    show = rank == pipe.last_rank  # it knows the losses; one rank speaks
    # torch's optimizers refuse an empty parameter list (a stage of only FlattenLogits).
    has_weights = any(True for _ in pipe.parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01) if has_weights else None

    total_steps = args.epochs * args.steps_per_epoch
    start_epoch = 0
    if args.resume:
        info = pd.load_checkpoint(args.checkpoint, pipe, opt)  # every rank; raises if broken
        start_epoch = int(info.extra["epoch"])
        if show:
            log.info("resumed from %s after epoch %d (step %d)", args.checkpoint, start_epoch, info.step)
    if show:
        params = sum(p.numel() for p in model.parameters())  # meta: counts, no memory
        log.info("%d ranks, schedule %s, %d microbatches, balance %s; %d layers of width %d, "
                 "%.2fM parameters", pipe.world_size, args.schedule, args.microbatches,
                 pipe.balance, args.layers, args.width, params / 1e6)
        log.info("data: %d stdlib files, %d train bytes, %d validation bytes (%d files, %d "
                 "batches), sequence lengths %s", len(sources), len(train_data), len(val_data),
                 val_files, len(val_set), args.lengths)
        log.info("unigram baseline %.4f nats (perplexity %.2f)", baseline, math.exp(baseline))
        print(f"UNIGRAM BASELINE {baseline:.4f} nats", flush=True)

    start = time.time()
    val_loss = float("nan")
    for epoch in range(start_epoch, args.epochs):
        pipe.train()
        total, count = 0.0, 0
        steps = range(epoch * args.steps_per_epoch, (epoch + 1) * args.steps_per_epoch)
        bar = tqdm(steps, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not show,
                   leave=False, file=sys.stdout)
        for step in bar:
            x, y = train_batch(train_data, step, args.batch_size, args.lengths, args.seed)
            loss = pipe.step(x, y)  # flush schedules: the batch's loss on every rank
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = learning_rate(step, total_steps, args.lr, args.warmup)
                opt.step()
                opt.zero_grad()
            total += loss * y.numel()
            count += y.numel()
            bar.set_postfix(loss=f"{loss:.3f}", T=x.shape[1], refresh=False)
        val_loss = evaluate(pipe, val_set)
        if show:
            log.info("epoch %d: train loss %.4f, validation loss %.4f (perplexity %.2f), "
                     "unigram baseline %.4f, %.0f s", epoch + 1, total / count, val_loss,
                     math.exp(val_loss), baseline, time.time() - start)
        if args.checkpoint:
            pd.save_checkpoint(args.checkpoint, pipe, opt, step=(epoch + 1) * args.steps_per_epoch,
                               extra={"epoch": epoch + 1})
    train_time = time.time() - start
    if start_epoch >= args.epochs:  # resumed a finished run: evaluate what it left
        val_loss = evaluate(pipe, val_set)

    # forward_only splits its batch into microbatches: at least one prompt per microbatch.
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(args.microbatches, 4))]
    samples = generate(pipe, prompts, args.generate, args.context, args.temperature, args.seed)
    if show:
        print(f"VALIDATION LOSS {val_loss:.4f} PERPLEXITY {math.exp(val_loss):.2f} "
              f"(unigram baseline {baseline:.4f}) after {train_time:.1f} s of training", flush=True)
        print("GENERATED TEXT", flush=True)
        for text in samples:
            print("----", flush=True)
            print(text.decode("utf-8", errors="replace"), flush=True)
        print("----", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return goal_exit_status(val_loss, baseline, args, show, log)


if __name__ == "__main__":
    sys.exit(main())
