"""A transformers mixture-of-experts model (Qwen3-MoE) on pipeline x expert parallelism.

``Qwen3MoeForCausalLM`` built from a small ``Qwen3MoeConfig`` (random init, a vocabulary
of 256 bytes; no download), given to PipeDream as it is, on a ``("pp", "ep")`` mesh:

    torchrun --standalone --nproc-per-node 4 examples/train_hf_moe.py   # pp 2 x ep 2, ~1 min on 2 cores

``expert_parallel="auto"`` reads the model's own ``ep_plan`` (its ``mlp.experts``) and
shards every such module's experts over ``mesh["ep"]`` (``pd.RoutedExpertParallel``: each
ep rank keeps ``experts / ep`` of them; tokens go to their experts' rank and back by
``all_to_all``). The ep ranks are data ranks for the rest of the model: each ``(ep)``
coordinate runs its own copy of the pipeline on its part of the batch
(``pipe.data_parallel_rank`` of ``pipe.data_parallel_size``), dense gradients averaged over
them. The text is the standard library's own source (as in examples/train_gpt.py).

The last stage prints the validation loss next to the unigram baseline (the entropy of
the training bytes); the script exits non-zero unless the validation loss is below the
baseline by ``--goal-margin`` (default 10%). With ``--save DIR``, ``pd.save_pretrained``
writes the model (every expert gathered over ep, under its own name) and rank 0 loads it
into a plain ``Qwen3MoeForCausalLM.from_pretrained(DIR)``, whose validation loss it prints.
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
from torch.distributed.device_mesh import init_device_mesh

import pipedream_ext as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import (
    VOCAB,
    goal_exit_status,
    learning_rate,
    split_by_file,
    stdlib_sources,
    train_batch,
    unigram_entropy,
    validation_batches,
)
from train_hf_gpt2 import NO_CACHE, evaluate, evaluate_unsplit, lm_loss

log = logging.getLogger("train_hf_moe")


def make_model(layers: int, width: int, experts: int, top_k: int, seed: int) -> Any:
    """``Qwen3MoeForCausalLM`` over bytes, the same weights on every rank (seeded)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                            moe_intermediate_size=width, num_experts=experts,
                            num_experts_per_tok=top_k, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4,
                            max_position_embeddings=256, use_cache=False)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def evaluate_pretrained(directory: str, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The validation loss of ``from_pretrained(directory)``: plain transformers, no pipeline."""
    from transformers import Qwen3MoeForCausalLM

    return evaluate_unsplit(Qwen3MoeForCausalLM.from_pretrained(directory), batches)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks per stage (default 2)")
    p.add_argument("--schedule", default="1f1b", choices=pd.schedules.synchronous_names())
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--width", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--length", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--data-bytes", type=int, default=1_000_000)
    p.add_argument("--val-bytes", type=int, default=16_384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goal-margin", type=float, default=0.10)
    p.add_argument("--no-goal", action="store_true", help="do not check the goal (quick runs)")
    p.add_argument("--save", default=None, help="save_pretrained here; rank 0 then evaluates "
                   "the directory in a plain Qwen3MoeForCausalLM")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.ep or world // args.ep < 2:
        p.error(f"{world} ranks cannot be pp x ep {args.ep} with pp >= 2; launch 2 x --ep ranks")
    if args.layers < world // args.ep:
        p.error(f"--layers {args.layers} < pp {world // args.ep}: a stage needs a layer")
    if args.batch_size % (args.ep * args.microbatches):
        p.error(f"--batch-size {args.batch_size} is not a multiple of ep x microbatches")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    train_data, val_data, _ = split_by_file(stdlib_sources(args.data_bytes), every=10,
                                            max_val_bytes=args.val_bytes)
    baseline = unigram_entropy(train_data)
    val_set = validation_batches(val_data, args.length, args.batch_size, args.ep * args.microbatches)

    pp = int(os.environ["WORLD_SIZE"]) // args.ep
    mesh = init_device_mesh("cpu", (pp, args.ep), mesh_dim_names=("pp", "ep"))
    model = make_model(args.layers, args.width, args.experts, args.top_k, args.seed)
    lengths = [args.length]
    x0, y0 = train_batch(train_data, 0, args.batch_size // args.ep, lengths, args.seed)
    split = [f"model.layers.{round(k * args.layers / pp)}" for k in range(1, pp)]
    pipe = pd.PipeDream(model, loss_fn=lm_loss, schedule=args.schedule, microbatches=args.microbatches,
                        mesh=mesh, expert_parallel="auto", split_points=split,
                        sample=({"input_ids": x0}, y0), concrete_args=NO_CACHE)
    copy, copies = pipe.data_parallel_rank, pipe.data_parallel_size
    show = pipe.is_last and copy == 0  # a last stage knows the losses; one rank speaks
    if show:
        experts = [(n, tuple(p.to_local().shape)) for n, p in pipe.named_parameters() if ".experts." in n]
        log.info("pp %d x ep %d, schedule %s, split points %s; Qwen3-MoE of %d layers, %d experts "
                 "(top-%d), %.2fM parameters; this rank's expert shards: %s", pp, args.ep,
                 args.schedule, split, args.layers, args.experts, args.top_k,
                 sum(p.numel() for p in model.parameters()) / 1e6, experts)
        print(f"UNIGRAM BASELINE {baseline:.4f} nats", flush=True)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    start, total, count = time.time(), 0.0, 0
    for step in range(args.steps):
        x, y = train_batch(train_data, step, args.batch_size, lengths, args.seed)
        part = slice(copy * len(x) // copies, (copy + 1) * len(x) // copies)  # this copy's rows
        loss = pipe.step({"input_ids": x[part]}, y[part])  # the global batch's loss
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        opt.step()
        opt.zero_grad()
        total, count = total + loss, count + 1
        if show and ((step + 1) % 25 == 0 or step + 1 == args.steps):
            log.info("step %d: train loss %.4f, %.0f s", step + 1, total / count, time.time() - start)
            total, count = 0.0, 0
    val_loss = evaluate(pipe, val_set)
    if show:
        print(f"VALIDATION LOSS {val_loss:.4f} PERPLEXITY {math.exp(val_loss):.2f} (unigram baseline "
              f"{baseline:.4f}) after {args.steps} steps, {time.time() - start:.1f} s", flush=True)
    if args.save:
        pd.save_pretrained(pipe, args.save)
        if dist.get_rank() == 0:
            print(f"FROM_PRETRAINED VALIDATION LOSS {evaluate_pretrained(args.save, val_set):.4f} "
                  f"(a plain Qwen3MoeForCausalLM from {args.save})", flush=True)
    pipe.close()
    dist.destroy_process_group()
    return goal_exit_status(val_loss, baseline, args, show, log)


if __name__ == "__main__":
    sys.exit(main())
