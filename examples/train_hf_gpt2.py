"""Pipeline-parallel training of a Hugging Face GPT-2 (``transformers``), any split.

The same text and batches as examples/train_gpt.py (the standard library's own
source files, as bytes; no download), but the model is ``transformers``'
``GPT2LMHeadModel`` built from a small ``GPT2Config`` (random init, vocabulary of
256 bytes, head tied to the token embedding), given to PipeDream as it is:

    torchrun --standalone --nproc-per-node 2 examples/train_hf_gpt2.py   # ~1 min on 2 cores

torch.fx cannot trace GPT-2, so ``split_points`` exports it with ``torch.export``
(non-strict, dynamic batch and sequence length) and cuts it where the named blocks
start. Inputs go by name, ``{"input_ids": x}``; ``use_cache=False`` is fixed through
``concrete_args``; ``loss_fn`` gets the model's own ``CausalLMOutputWithCrossAttentions``
(the same function would train the unsplit model). The tied embedding/head weight is
kept by the first and the last stage, its gradients summed (flush schedules only).

At the end the last stage's rank prints the validation loss next to the unigram
baseline (the entropy of the training bytes: the best loss without context) and a
few generated lines (``forward_only`` once per byte: the sequence grows by one each
time; sampled at ``--temperature``). With ``--checkpoint DIR`` the weights are saved and rank 0 loads
``pd.consolidate(DIR)`` into an unmodified ``GPT2LMHeadModel`` and evaluates it with
plain ``transformers``: the same validation loss. The script exits non-zero unless
the validation loss is below the baseline by ``--goal-margin`` (default 10%).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipedream_ext as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import (
    PROMPTS,
    VOCAB,
    goal_exit_status,
    learning_rate,
    split_by_file,
    stdlib_sources,
    train_batch,
    unigram_entropy,
    validation_batches,
)

log = logging.getLogger("train_hf_gpt2")
NO_CACHE = {"use_cache": False}


def make_model(layers: int, width: int, heads: int, context: int, dropout: float, seed: int) -> Any:
    """``GPT2LMHeadModel`` over bytes, the same weights on every rank (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no warnings about the byte vocabulary's special ids
    config = GPT2Config(vocab_size=VOCAB, n_positions=context, n_embd=width, n_layer=layers,
                        n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, use_cache=False, bos_token_id=10, eos_token_id=10)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy of a transformers causal LM's output (``.logits``)."""
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def block_split_points(layers: int, stages: int) -> List[str]:
    """Stage ``k`` starts at block ``round(k * layers / stages)``: the blocks, which hold
    the compute, shared out evenly (the embeddings go with the first, the final
    LayerNorm and the head with the last)."""
    if stages > layers:
        raise ValueError(f"{stages} stages need at least {stages} blocks (--layers {layers})")
    return [f"transformer.h.{round(k * layers / stages)}" for k in range(1, stages)]


def evaluate(pipe: pd.PipeDream, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-byte cross entropy over the validation batches (on a mesh each copy its
    part of every batch), on every rank."""
    pipe.eval()
    copy, copies = pipe.data_parallel_rank, pipe.data_parallel_size
    total = torch.zeros(2, dtype=torch.float64)  # summed loss, tokens
    for x, y in batches:
        part = slice(copy * len(x) // copies, (copy + 1) * len(x) // copies)
        out = pipe.forward_only({"input_ids": x[part]})
        if out is not None:  # a last stage's rank: the model's own output structure
            total[0] += F.cross_entropy(out.logits.flatten(0, 1), y[part].flatten(), reduction="sum").item()
            total[1] += y[part].numel()
    dist.all_reduce(total)  # every copy's last stage: the whole batches
    pipe.train()
    return float(total[0] / total[1])


def evaluate_unsplit(model: Any, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The same validation loss with the plain, unsplit ``transformers`` model."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            logits = model(input_ids=x, **NO_CACHE).logits
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count


def generate(pipe: pd.PipeDream, prompts: Sequence[bytes], new_bytes: int, context: int,
             temperature: float, seed: int) -> List[bytes]:
    """Continues every prompt, side by side in one batch: every rank runs ``forward_only``
    once per byte (one position longer each time); the last stage's rank samples the
    bytes (temperature 0: greedy) and broadcasts them."""
    width = max(len(p) for p in prompts)
    rows = torch.tensor([list(b"\n" * (width - len(p)) + p) for p in prompts], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    pipe.eval()
    for _ in range(new_bytes):
        out = pipe.forward_only({"input_ids": rows[:, -context:]})
        nxt = torch.zeros(len(prompts), dtype=torch.long)
        if out is not None:
            last = out.logits[:, -1]
            nxt = (torch.multinomial(F.softmax(last / temperature, dim=-1), 1, generator=g)
                   .squeeze(1) if temperature > 0 else last.argmax(dim=-1))
        dist.broadcast(nxt, src=pipe.last_rank)
        rows = torch.cat([rows, nxt.unsqueeze(1)], dim=1)
    pipe.train()
    return [bytes(r[width - len(p):].tolist()) for r, p in zip(rows, prompts)]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b", choices=pd.schedules.synchronous_names(),
                   help="a flush schedule (default 1f1b); the asynchronous ones refuse the tied "
                        "embedding/head weight")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=1, help="chunks per rank (interleaved-1f1b)")
    p.add_argument("--layers", type=int, default=4, help="GPT-2 blocks (default 4)")
    p.add_argument("--width", type=int, default=128, help="n_embd (default 128)")
    p.add_argument("--heads", type=int, default=4, help="n_head (default 4)")
    p.add_argument("--context", type=int, default=128, help="n_positions (default 128)")
    p.add_argument("--lengths", default="64,96,128",
                   help="sequence lengths a training batch draws from (default 64,96,128)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="GPT-2's three dropouts (default 0; off in evaluation either way)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; default 1e-3)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    p.add_argument("--data-bytes", type=int, default=2_000_000,
                   help="bytes of standard-library source to read (default 2 MB)")
    p.add_argument("--val-bytes", type=int, default=32_768,
                   help="cap on the validation bytes (default 32 KiB)")
    p.add_argument("--generate", type=int, default=60, help="bytes to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None,
                   help="save here at the end; rank 0 then evaluates pd.consolidate(DIR) in "
                        "an unmodified GPT2LMHeadModel")
    p.add_argument("--goal-margin", type=float, default=0.10,
                   help="exit with status 1 unless validation loss < (1 - margin) * unigram "
                        "baseline (default 0.10)")
    p.add_argument("--no-goal", action="store_true", help="do not check the goal (quick runs)")
    args = p.parse_args(argv)
    args.lengths = [int(v) for v in args.lengths.split(",")]
    if args.width % args.heads:
        p.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if max(args.lengths) > args.context or min(args.lengths) < 1:
        p.error(f"--lengths {args.lengths} must lie in 1..--context {args.context}")
    if args.batch_size < args.microbatches:
        p.error(f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    sources = stdlib_sources(args.data_bytes)
    train_data, val_data, _ = split_by_file(sources, every=10, max_val_bytes=args.val_bytes)
    baseline = unigram_entropy(train_data)
    val_set = validation_batches(val_data, args.context, args.batch_size, args.microbatches)

    model = make_model(args.layers, args.width, args.heads, args.context, args.dropout, args.seed)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    x0, y0 = train_batch(train_data, 0, args.batch_size, args.lengths, args.seed)
    start = time.time()
    pipe = pd.PipeDream(model, loss_fn=lm_loss, schedule=args.schedule,
                        microbatches=args.microbatches, chunks=args.chunks,
                        split_points=block_split_points(args.layers, world * args.chunks),
                        sample=({"input_ids": x0}, y0), concrete_args=NO_CACHE)
    rank = dist.get_rank()
    show = rank == pipe.last_rank  # it knows the losses; one rank speaks
    if show:
        log.info("%d ranks, schedule %s, split points %s (traced with %s in %.1f s); GPT-2 of "
                 "%d blocks, width %d, %.2fM parameters; tied: %s", pipe.world_size,
                 args.schedule, pipe.split_points, pipe.traced.tracer, time.time() - start,
                 args.layers, args.width, sum(p.numel() for p in model.parameters()) / 1e6,
                 [sp.names for sp in pipe.shared_parameters])
        log.info("unigram baseline %.4f nats (perplexity %.2f)", baseline, math.exp(baseline))
        print(f"UNIGRAM BASELINE {baseline:.4f} nats", flush=True)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)

    start = time.time()
    total, count = 0.0, 0
    for step in range(args.steps):
        x, y = train_batch(train_data, step, args.batch_size, args.lengths, args.seed)
        loss = pipe.step({"input_ids": x}, y)  # the batch's loss, on every rank
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        opt.step()
        opt.zero_grad()
        total += loss * y.numel()
        count += y.numel()
        if show and (step + 1) % 25 == 0:
            log.info("step %d: train loss %.4f (last 25 steps), %.0f s", step + 1, total / count,
                     time.time() - start)
            total, count = 0.0, 0
    train_time = time.time() - start
    val_loss = evaluate(pipe, val_set)
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
    if args.checkpoint:
        pd.save_checkpoint(args.checkpoint, pipe, opt, step=args.steps)
        if rank == 0:  # plain transformers, no pipeline: the same model
            plain = make_model(args.layers, args.width, args.heads, args.context, args.dropout,
                               args.seed + 1)
            plain.load_state_dict(pd.consolidate(args.checkpoint))
            print(f"CONSOLIDATED VALIDATION LOSS {evaluate_unsplit(plain, val_set):.4f} "
                  f"(unmodified GPT2LMHeadModel from {args.checkpoint})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return goal_exit_status(val_loss, baseline, args, show, log)


if __name__ == "__main__":
    sys.exit(main())
