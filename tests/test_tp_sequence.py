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
gradient, every weight after 3 AdamW steps, 1e-4 relative) on 1f1b, zb-h1 and zbv (and
1f1b clipped by ``pd.clip_grad_norm_``: the norm and the update equal torch's on the
unsplit model), and what crossed each cut is checked. A sequence length tp does not
divide is refused on every rank. Each placement's round trip is checked on its own. A
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
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from test_tensor_parallel import DIM, ROWS, SEQ, batch, check_training, llama, lm_loss, mesh_of

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


def check_sp_training(schedule: str, crossing: Dict[int, str], **kwargs: Any) -> None:
    """check_training with sp_plan(), and what crossed each cut this rank sent over:
    stage j's output a local sequence shard [microbatch rows, SEQ / 2, DIM], as a plain
    tensor or (``crossing[j]`` "Shard(dim=1)") a DTensor with that placement."""
    from pipedream_ext._parallel.tensor_parallel import CutLayouts

    sent = set()
    send = CutLayouts.send

    def recording(self: Any, stage: int, values: Any) -> Any:
        out = send(self, stage, values)
        sent.update((stage, repr(getattr(v, "placements", ("plain",))[0]), tuple(t.shape))
                    for v, t in zip(values, out))
        return out

    CutLayouts.send = recording
    try:
        check_training(schedule, tensor_parallel=sp_plan, **kwargs)
    finally:
        CutLayouts.send = send
    shard = (ROWS // 2, SEQ // 2, DIM)  # 2 microbatches
    assert sent == {(j, crossing[j], shard) for j in {j for j, _, _ in sent}}, sent
    assert sent or dist.get_rank() >= 2, "a rank of pp 0 sent nothing"


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


def check_sequence_length() -> None:
    """A sequence length tp does not divide is refused on every rank before the forward,
    by step() and forward_only() (Gloo's all-gather of the unequal sequence shards
    aborted the process); the pipeline then trains on a divisible length."""
    from test_bad_input import ROWS as BAD

    import pipedream_ext as pd

    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                        balance=[2, 3], timeout=30, tensor_parallel=sp_plan())
    x, y = batch(0)
    row = next(r[2] for r in BAD if r[0] == "tp-sequence-length")
    with pytest.raises(ValueError, match=row):
        pipe.step(x[:, :5], y[:, :5])
    with pytest.raises(ValueError, match=row):
        pipe.forward_only(x[:, :5])
    assert all(p.grad is None for p in pipe.parameters())
    assert float(pipe.step(x[:, :4], y[:, :4])) > 0
    pipe.close()


class Uneven(nn.Module):
    """Ends stage 0 with a DTensor sharded on a dim of odd size (dim 2 of [b, s, 7]: 4
    and 3 columns), built from each tp rank's columns (a plan that shards a weight
    unevenly is refused at construction, so only a forward can make one)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 7)
        self.tp_mesh: Any = None

    def forward(self, x: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        y = self.proj(x)
        mine = y[..., :4] if self.tp_mesh.get_local_rank() == 0 else y[..., 4:]
        return DTensor.from_local(mine.contiguous(), self.tp_mesh, (Shard(2),), run_check=False,
                                  shape=y.shape, stride=y.stride())


def give_mesh(stage: nn.Module, tp_mesh: Any) -> None:
    """A callable plan: the Uneven layer gets the tp mesh."""
    for module in stage.modules():
        if isinstance(module, Uneven):
            module.tp_mesh = tp_mesh


def check_cannot_cross() -> None:
    """A DTensor that cannot be rebuilt from its shard (7 columns over tp=2) is refused
    on the ranks that return it, naming stage, output, shape and fix; the ranks waiting
    for it fail after the timeout naming that first failure."""
    from test_bad_input import ROWS as BAD

    import pipedream_ext as pd

    model = nn.Sequential(nn.Embedding(32, DIM), Uneven(), nn.Linear(7, 32))
    pipe = pd.PipeDream(model, lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                        balance=[2, 1], timeout=5, tensor_parallel=give_mesh)
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


def check_layouts() -> None:
    """What crosses a cut, piece by piece: each placement (and a plain tensor next to
    it) arrives as it left, local shard and global shape; a stage whose placements
    change, a DTensor over another mesh, or one returned by the last stage is refused
    naming it."""
    from test_bad_input import ROWS as BAD
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from pipedream_ext._parallel.tensor_parallel import CutLayouts, LayoutExchange

    tp = mesh_of((2, 1, 2))["tp"]
    exchange = LayoutExchange(dist.HashStore(), "cuts", timeout=5)
    cuts = CutLayouts(tp, {}, {}, exchange)
    local, ids = torch.randn(2, 3, 4), torch.arange(6)
    for stage, placement in enumerate((Replicate(), Shard(1), Shard(2), Partial("avg"))):
        sent = cuts.send(stage, [DTensor.from_local(local, tp, (placement,), run_check=False), ids])
        # Only the tensors cross: the layout went to the exchange, as metadata.
        assert len(sent) == 2 and not any(isinstance(t, DTensor) for t in sent), sent
        assert exchange.store.num_keys() == 1, "one layout published, once per stage"
        (value, plain), problem = cuts.receive(stage + 1, sent)
        assert exchange.store.num_keys() == 0, "the receiver took it"
        assert problem is None and plain is ids, (problem, plain)
        assert isinstance(value, DTensor) and value.placements == (placement,), value
        assert torch.equal(value.to_local(), local) and value.device_mesh is tp
        grown = [2 * n if isinstance(placement, Shard) and d == placement.dim else n
                 for d, n in enumerate(local.shape)]
        assert list(value.shape) == grown, (placement, value.shape)
    again, _ = cuts.receive(2, cuts.send(1, [DTensor.from_local(local, tp, (Shard(1),),
                                                                run_check=False), ids]))
    assert again[0].placements == (Shard(1),) and exchange.store.num_keys() == 0, "read once"
    with pytest.raises(ValueError, match=r"stage 2 received 1 tensors and a layout of 2"):
        cuts.receive(2, [local])
    with pytest.raises(ValueError, match=r"stage 1 returned output 0 as Replicate\(\), but as "
                                         r"Shard\(dim=1\) in its first forward; what a stage returns "
                                         "at a cut must keep its placements"):
        cuts.send(1, [DTensor.from_local(local, tp, (Replicate(),), run_check=False), ids])
    world = init_device_mesh("cpu", (4,))
    with pytest.raises(ValueError, match=r"stage 0 returns a DTensor \(output 0, placements "
                                         r"\(Replicate\(\),\), mesh .*\) over another mesh than "
                                         r"mesh\['tp'\] \(ranks \[\d, \d\]\)"):
        cuts.send(0, [DTensor.from_local(local, world, (Replicate(),), run_check=False)])
    with pytest.raises(ValueError, match=next(r[2] for r in BAD if r[0] == "tp-dtensor-end")):
        cuts.refuse_at_end(3, DTensor.from_local(local, tp, (Shard(2),), run_check=False))


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_layouts)
    plain = {j: "'plain'" for j in range(3)}
    c.add(check_sp_training, "1f1b", plain, name="sp-1f1b")
    c.add(check_sp_training, "zb-h1", plain, name="sp-zb-h1")
    c.add(check_sp_training, "zbv", plain, chunks=2, name="sp-zbv")
    # pd.clip_grad_norm_ reduces the SP norms' Partial gradients: torch's norm and update.
    c.add(check_sp_training, "1f1b", plain, clip=0.05, name="sp-clip-1f1b")
    # Cut after the final norm: its DTensor (Shard(1)) crosses to the head.
    c.add(check_sp_training, "1f1b", {0: "Shard(dim=1)"}, balance=[4, 1], name="dtensor-at-cut-1f1b")
    c.add(check_sp_training, "zbv", {**plain, 2: "Shard(dim=1)"}, chunks=2, balance=[1, 1, 2, 1],
          name="dtensor-at-cut-zbv")
    # The launch's first failing pipeline: its waiting ranks name the job's first failure,
    # which must be this case's own (a failure recorded by an earlier case stays the
    # job's first for timeout + 30 s, and a rank does not name its own).
    c.add(check_cannot_cross)
    c.add(check_sequence_length)
    c.add(check_mismatch)
    return c


LAUNCH = Launch(HERE, 4, cases, timeout=300)


@parametrize_cases(LAUNCH)
def test_sequence_parallel_across_cuts(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH])
