"""Packed sequences through a traced Llama and Qwen2: exact against the unsplit model.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    torchrun --standalone --nproc-per-node 2 tests/test_packed_sequences.py

Each row of a batch holds several documents one after another, as transformers'
``DataCollatorWithFlattening`` makes them: ``input_ids`` concatenated, ``position_ids``
restarting at 0 at each document, no ``attention_mask``, and the first token of each
document a ``-100`` label. Without an ``attention_mask``, transformers derives from
such ``position_ids`` a block-diagonal causal mask (``masking_utils``: a token attends
to the earlier tokens of its own document only; docs/guide/language_models.md).
The zoo's Llama (sdpa attention) and Qwen2 (eager attention, tied embedding and head)
are traced on a sample whose documents end elsewhere than in any training batch
(torch.export: the traced graph computes the mask from each batch's ``position_ids``),
then trained on 2 ranks with ``loss_reduction="tokens"`` next to the unsplit model on
the whole batch: every step's loss and every weight after 3 SGD-momentum steps. And
packing matters: the unsplit model's loss on a packed batch differs from its loss on
the same tokens with plain ``position_ids`` (one document per row), so a pipeline that
attended across documents would fail here.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main  # noqa: E402
from _zoo import VOCAB, ZOO  # noqa: E402

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-5, 1e-6
ROWS, LENGTH, STEPS = 8, 12, 3
#: (zoo model, its attention implementation, schedule).
MODELS = {"llama": ("sdpa", "1f1b"), "qwen2": ("eager", "zb-h1")}


def packed_row(lengths: List[int], g: torch.Generator) -> Dict[str, torch.Tensor]:
    """One row of documents of ``lengths`` tokens, flattened by transformers' collator."""
    from transformers import DataCollatorWithFlattening

    docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_position_ids=True)(docs)


def packed_batch(seed: int, boundaries: Any = None) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """``ROWS`` rows of ``LENGTH`` tokens, each 2-4 documents (``boundaries``: the same
    document lengths in every row instead), and next-token targets: the collator's
    labels shifted by one, so that no row predicts a document's first token from the
    one before."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(ROWS):
        if boundaries is None:
            cuts = sorted((torch.randperm(LENGTH - 1, generator=g)[:int(torch.randint(1, 4, (1,),
                                                                                     generator=g))]
                           + 1).tolist())
            lengths = [b - a for a, b in zip([0] + cuts, cuts + [LENGTH])]
        else:
            lengths = list(boundaries)
        rows.append(packed_row(lengths, g))
    ids = torch.cat([r["input_ids"] for r in rows])
    positions = torch.cat([r["position_ids"] for r in rows])
    labels = torch.cat([r["labels"] for r in rows])
    y = torch.cat([labels[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    return {"input_ids": ids, "position_ids": positions}, y


def token_loss(out: Any, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (F.cross_entropy(out.logits.flatten(0, -2).float(), y.flatten(), reduction="sum"),
            (y != -100).sum())


def build(name: str, attention: str) -> nn.Module:
    model = ZOO[name].build()
    model.set_attn_implementation(attention)
    return model


def reference_loss(model: nn.Module, inputs: Dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    loss_sum, tokens = token_loss(model(**inputs, use_cache=False), y)
    return loss_sum / tokens


def check_packing_matters(name: str) -> None:
    """The unsplit model attends within documents only: plain positions (one document
    per row) give another loss on the same tokens."""
    attention, _ = MODELS[name]
    model = build(name, attention)
    inputs, y = packed_batch(7)
    plain = {"input_ids": inputs["input_ids"],
             "position_ids": torch.arange(LENGTH).expand(ROWS, -1).contiguous()}
    with torch.no_grad():
        packed_loss, plain_loss = reference_loss(model, inputs, y), reference_loss(model, plain, y)
    assert abs(float(packed_loss) - float(plain_loss)) > 1e-3 * abs(float(plain_loss)), \
        f"{name}: packed {float(packed_loss)} and plain {float(plain_loss)} position_ids give " \
        "the same loss: the batch does not test packing"


def check_packed(name: str) -> None:
    """Traced on fixed document boundaries, trained on others: the unsplit model's losses
    and weights."""
    import pipedream_ext as pd

    attention, schedule = MODELS[name]
    sample = packed_batch(0, boundaries=[5, 7])
    model = build(name, attention)
    pipe = pd.PipeDream(model, token_loss, schedule=schedule, microbatches=4, timeout=120,
                        split_points=ZOO[name].splits[2], sample=sample,
                        concrete_args={"use_cache": False}, loss_reduction="tokens")
    ref = build(name, attention)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        inputs, y = packed_batch(10 + step)
        expected = reference_loss(ref, inputs, y)
        expected.backward()
        loss = float(pipe.step(inputs, y))
        assert abs(loss - expected.item()) <= RTOL * max(1.0, abs(expected.item())), \
            f"{name} step {step}: loss {loss} != {expected.item()}"
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    expected_state = ref.state_dict()
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(value, expected_state[key], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} after {STEPS} steps: {key}: {m}")


def packed_cases(world: int) -> Cases:
    del world
    cases = Cases()
    for name in MODELS:
        cases.add(check_packing_matters, name)
        cases.add(check_packed, name)
    return cases


LAUNCH = Launch(HERE, 2, packed_cases, timeout=600)


@parametrize_cases(LAUNCH)
def test_packed_sequences_match_the_unsplit_model(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH])
