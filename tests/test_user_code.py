"""What users' own training scripts do with a pipeline (nanoGPT's train.py migrated from DDP):
a model wrapped by ``torch.compile`` first, an optimizer built from the model before
``PipeDream``, and ``pipe(x, y)``. In this process, on a 1-rank Gloo group: 2 stages on
one rank (``interleaved-1f1b``, 2 chunks) run the executor as on several ranks. The
case of layers trained by another rank is in tests/test_bad_input.py's 2-rank job.
"""
from __future__ import annotations

from typing import Any, Callable, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_traced import NanoGPT, assert_same_state
from torch import nn

import pipedream_ext as pd

STEPS, MICROBATCHES = 3, 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def counting_backend(calls: List[int]) -> Callable[..., Any]:
    """torch.compile's ``aot_eager`` backend (AOTAutograd, eager kernels: fast on a CPU,
    exact), counting every call of a compiled graph: proof that the stages run compiled."""
    def backend(gm: torch.fx.GraphModule, example_inputs: List[torch.Tensor]) -> Callable[..., Any]:
        compiled = torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: Any) -> Any:
            calls.append(1)
            return compiled(*args)
        return run
    return backend


def batch(kind: str, step: int) -> Any:
    g = torch.Generator().manual_seed(10 + step)
    if kind == "sequential":
        return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    idx, targets = torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 11, (8, 6), generator=g)
    return (idx, targets), targets


@pytest.mark.parametrize("kind", ["sequential", "nanogpt"])
def test_a_compiled_model_runs_every_stage_compiled_and_trains_like_the_unsplit_model(
        group: dist.ProcessGroup, kind: str) -> None:
    """``PipeDream(torch.compile(model), ...)`` (nanoGPT's ``compile=True``): every stage's
    forward runs as a compiled graph, losses and weights equal the uncompiled unsplit
    model's after SGD steps, names (state_dict, split points) are the model's own."""
    calls: List[int] = []
    make = mlp if kind == "sequential" else lambda: NanoGPT(export_only=False, blocks=2)
    ref = make()
    wrapped = torch.compile(make(), backend=counting_backend(calls))
    if kind == "sequential":
        pipe = pd.PipeDream(wrapped, F.cross_entropy, schedule="interleaved-1f1b", chunks=2,
                            microbatches=MICROBATCHES, timeout=60)
    else:  # a split point as the wrapper names it is the model's own module
        z = torch.zeros(8, 6, dtype=torch.long)
        pipe = pd.PipeDream(wrapped, lambda out, y: out[1], schedule="interleaved-1f1b", chunks=2,
                            microbatches=MICROBATCHES, timeout=60,
                            split_points=["_orig_mod.transformer.h.1"], sample=((z, z), z))
        assert pipe.split_points == ["transformer.h.1"]
    assert list(pipe.state_dict()) == list(ref.state_dict())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    try:
        for step in range(STEPS):
            x, y = batch(kind, step)
            out = ref(*x) if kind == "nanogpt" else ref(x)
            expected = out[1] if kind == "nanogpt" else F.cross_entropy(out, y)
            expected.backward()
            loss = float(pipe.step(x, y))
            assert abs(loss - expected.item()) <= 1e-5, (kind, step, loss, expected.item())
            ref_opt.step(); ref_opt.zero_grad()
            opt.step(); opt.zero_grad()
    finally:
        torch._dynamo.reset()
    assert len(calls) >= STEPS * MICROBATCHES * 2, f"{len(calls)} compiled calls"
    assert_same_state(pipe.state_dict(), ref, f"compiled {kind}")


def test_an_asynchronous_schedule_runs_a_compiled_model_as_the_uncompiled_one(
        group: dist.ProcessGroup) -> None:
    """``pipedream-2bw`` (weight stashing: stages run on stashed versions through
    ``functional_call``) and recompute: the same losses compiled or not."""
    calls: List[int] = []
    runs = []
    for model in (mlp(), torch.compile(mlp(), backend=counting_backend(calls))):
        pipe = pd.PipeDream(model, F.cross_entropy, schedule="pipedream-2bw", microbatches=2,
                            timeout=60, recompute=True)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        runs.append([pipe.step(*batch("sequential", step), optimizer=opt) for step in range(STEPS)])
        pipe.flush()
    torch._dynamo.reset()
    assert runs[0] == runs[1] and len(calls) >= STEPS * 2, (runs, len(calls))


def test_an_optimizer_built_before_the_pipeline_is_refused_at_its_first_step(
        group: dist.ProcessGroup) -> None:
    """nanoGPT's order (the optimizer from the model, then PipeDream): on a meta-device
    model the optimizer holds tensors the pipeline replaced, and opt.step() changed
    nothing; it is refused at once, naming a parameter and the fix."""
    with torch.device("meta"):
        model = mlp()
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    pipe = pd.PipeDream(model, F.cross_entropy, schedule="interleaved-1f1b", chunks=2,
                        microbatches=2, timeout=60)
    x, y = batch("sequential", 0)
    pipe.step(x, y)
    message = (r"rank 0: the optimizer holds 6 of its 6 parameters from the model given to PipeDream "
               r"that this rank's pipeline does not train, e\.g\. '0\.weight' \(a meta-device tensor, "
               r"which the pipeline replaced.*opt = torch\.optim\.AdamW\(pipe\.parameters\(\), \.\.\.\)")
    with pytest.raises(ValueError, match=message):
        early.step()
    with pytest.raises(ValueError, match=message):  # refused again, never passed
        early.step()
    before = [p.detach().clone() for p in pipe.parameters()]
    right = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    right.step()  # the fix: built from the pipeline
    assert any(not torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
    torch.optim.SGD(mlp().parameters(), lr=0.1).step()  # another model's optimizer: none of ours
    # Asynchronous schedules step it inside the pipeline: refused before anything runs.
    with torch.device("meta"):
        model = mlp()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = pd.PipeDream(model, F.cross_entropy, schedule="pipedream", microbatches=2, timeout=60)
    with pytest.raises(ValueError, match=r"e\.g\. '0\.weight' \(a meta-device tensor"):
        pipe.step(x, y, optimizer=early)


def test_calling_the_pipeline_names_step_and_forward_only(group: dist.ProcessGroup) -> None:
    pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=2, timeout=60)
    x, y = batch("sequential", 0)
    with pytest.raises(TypeError, match=r"a PipeDream pipeline is not called like a module \(pipe\(x, y\)\): "
                                        r"train on a batch with loss = pipe\.step\(x, y\).*"
                                        r"pipe\.forward_only\(x\)"):
        pipe(x, y)
    assert pipe.forward_only(x).shape == (8, 3)
