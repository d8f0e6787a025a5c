"""Sequence parallelism and ``DTensor`` activations across cuts with ``tensor_parallel``.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=4ranks torchrun --standalone --nproc-per-node 4 tests/test_tp_sequence.py

The tiny Llama of tests/test_tensor_parallel.py on pp2 x tp2 (4 ranks, Gloo) with
torchtitan's whole TP + SP plan (``sp_plan``): RMSNorms ``SequenceParallel``, the
attention's and feed-forward's inputs gathered by ``PrepareModuleInput``, wo/w2 and the
embedding reduce-scattered to ``Shard(1)``, the head gathering its input. Between blocks
the activation is then a plain local shard ``[b, s/tp, d]``; with a cut after the final
norm, a ``DTensor`` (``Shard(1)``) crosses as its local shard and arrives as a
``DTensor``. Each trains like the unsplit model (loss of every step, every step-0
gradient, every weight after 3 AdamW steps, 1e-4 relative) on 1f1b, zb-h1 and zbv. A
plan whose placements disagree across a cut fails every rank with one message; a
``DTensor`` that cannot cross fails its rank by name and its peers name it.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from test_tensor_parallel import DIM, batch, check_training, llama, lm_loss, mesh_of

HERE = os.path.abspath(__file__)


def sp_plan() -> Dict[str, Any]:
    """torchtitan's Llama TP + SP plan, in llama()'s module names (0 the embedding,
    1..2 the blocks, 3 the final norm, 4 the head)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    def gathered() -> PrepareModuleInput:
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    return {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "*.attn_norm": SequenceParallel(), "*.attn": gathered(),
            "*.attn.wq": ColwiseParallel(), "*.attn.wk": ColwiseParallel(),
            "*.attn.wv": ColwiseParallel(), "*.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "*.ffn_norm": SequenceParallel(), "*.ffn": gathered(),
            "*.ffn.w1": ColwiseParallel(), "*.ffn.w3": ColwiseParallel(),
            "*.ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            "3": SequenceParallel(),
            "4": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def check_mismatch() -> None:
    """The head declares a replicated input (PrepareModuleInput) where the final norm,
    ending stage 0, gives Shard(1): every rank raises the receiver's message after the
    step (training and forward_only), no optimizer step is taken."""
    from test_bad_input import ROWS as BAD
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    import pipedream_ext as pd

    bad = {**sp_plan(), "4": PrepareModuleInput(input_layouts=(Replicate(),),
                                                 desired_input_layouts=(Replicate(),),
                                                 use_local_output=True)}
    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                        balance=[4, 1], timeout=30, tensor_parallel=bad)
    x, y = batch(0)
    row = next(r[2] for r in BAD if r[0] == "tp-cut-placement")
    for call in (lambda: pipe.step(x, y), lambda: pipe.forward_only(x)):
        with pytest.raises(ValueError, match=row) as info:
            call()
        text = str(info.value)
        assert "stage 1 receives output 0 of stage 0 as a DTensor with Shard(dim=1)" in text, text
        assert "'4' has PrepareModuleInput with input_layouts Replicate()" in text, text
        assert "input_layouts=Shard(dim=1) for '4'" in text, text
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()


class Uneven(nn.Module):
    """Ends stage 0 with a DTensor sharded on a dim of odd size (dim 2 of [b, s, 7])."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def check_cannot_cross() -> None:
    """A DTensor that cannot be rebuilt from its shard (7 columns over tp=2) is refused
    on the ranks that return it, naming stage, output, shape and fix; the ranks waiting
    for it fail after the timeout naming that first failure."""
    from test_bad_input import ROWS as BAD
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    import pipedream_ext as pd

    model = nn.Sequential(nn.Embedding(32, DIM), Uneven(), nn.Linear(7, 32))
    pipe = pd.PipeDream(model, lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                        balance=[2, 1], timeout=5, tensor_parallel={
                            "1.proj": ColwiseParallel(output_layouts=Shard(2), use_local_output=False)})
    x, y = batch(0)
    with pytest.raises(Exception) as info:
        pipe.step(x, y)
    text = str(info.value)
    row = next(r[2] for r in BAD if r[0] == "tp-cut-dtensor")
    if pipe.is_first:
        assert re.search(row, text), text
        assert "shape (4, 6, 7)): dim 2 (7) does not split evenly over tp=2" in text, text
    else:
        assert "does not split evenly over tp=2" in text, text  # the first failure, named


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_training, "1f1b", tensor_parallel=lambda: sp_plan(), name="sp-1f1b")
    c.add(check_training, "zb-h1", tensor_parallel=lambda: sp_plan(), name="sp-zb-h1")
    c.add(check_training, "zbv", chunks=2, tensor_parallel=lambda: sp_plan(), name="sp-zbv")
    # Cut after the final norm: its DTensor (Shard(1)) crosses to the head.
    c.add(check_training, "1f1b", balance=[4, 1], tensor_parallel=lambda: sp_plan(),
          name="dtensor-at-cut-1f1b")
    c.add(check_training, "zbv", chunks=2, balance=[1, 1, 2, 1], tensor_parallel=lambda: sp_plan(),
          name="dtensor-at-cut-zbv")
    c.add(check_mismatch)
    c.add(check_cannot_cross)
    return c


LAUNCH = Launch(HERE, 4, cases, timeout=300)


@parametrize_cases(LAUNCH)
def test_sequence_parallel_across_cuts(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH])
