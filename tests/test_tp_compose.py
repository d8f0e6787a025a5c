"""``tensor_parallel=`` composed with the rest: meta-device models, recompute, bf16
autocast, FSDP's ``reshard_after_forward`` and ``mp_policy``, parameters tied across stages.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    torchrun --standalone --nproc-per-node 4 tests/test_tp_compose.py

The model, plan and helpers are tests/test_tensor_parallel.py's (a tiny Llama-like
``nn.Sequential`` on pp2 x tp2, or pp1 x dp2 x tp2 for FSDP, 4 ranks, Gloo). Every case
trains side by side with the unsplit model on the same batches: the loss of every step,
every gradient of step 0 and every weight after 3 AdamW steps agree to 1e-4 relative,
except under bf16 (autocast or ``mp_policy``), where tensor parallelism rounds its
partial sums to bf16 before adding them (a row-wise layer's all-reduce), so they agree
to 2e-2 (test_fsdp.py's mixed-precision tolerance) with the unsplit model under the same
autocast; each case also checks that what it composes really ran (DTensor shards of a
meta model, forwards run twice, bf16 inside, FSDP's dtype and resharding). A meta-device
model's reference is ``pd.materialize`` of the unsplit model; a wide meta model checks
the bytes a rank holds while it is built. A tied embedding/head is split by neither or
by both ends (clipped); a tie split differently is refused by name. A slow launch
(``make test-all``, 8 ranks) runs the tie over pp2 x dp2 x tp2 with FSDP (one built on
meta, with ``reshard_after_forward=True``).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from test_tensor_parallel import ATOL, BALANCE, RTOL, STEPS, batch, full, llama, lm_loss, mesh_of, plan

HERE = os.path.abspath(__file__)
MICROBATCHES = 2
BF16_TOL = (2e-2, 2e-2)  # test_fsdp.py's mixed-precision tolerance
WIDTH = 256


def close(actual: torch.Tensor, expected: torch.Tensor, what: str,
          tol: Tuple[float, float] = (RTOL, ATOL)) -> None:
    torch.testing.assert_close(full(actual).detach().float(), expected.detach().float(),
                               rtol=tol[0], atol=tol[1], msg=lambda m: f"{what}: {m}")


def reference_step(ref: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   autocast: Optional[torch.dtype]) -> torch.Tensor:
    """The unsplit model's step: microbatch by microbatch under ``autocast`` (as the
    pipeline computes it), else on the whole batch; returns the batch's loss."""
    if autocast is None:
        loss = lm_loss(ref(x), y)
        loss.backward()
        return loss.detach()
    total = torch.zeros(())
    for cx, cy in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        with torch.autocast("cpu", dtype=autocast):
            loss = lm_loss(ref(cx), cy).float() / MICROBATCHES
        loss.backward()
        total += loss.detach()
    return total


def check_compose(name: str, make: Callable[[], Tuple[nn.Module, nn.Module]] = lambda: (llama(), llama()),
                  shape=(2, 1, 2), schedule: str = "1f1b", tensor_parallel: Callable[[], Any] = plan,
                  tol: Tuple[float, float] = (RTOL, ATOL), autocast: Optional[torch.dtype] = None,
                  after_build: Optional[Callable[[Any], Optional[Callable[[], None]]]] = None,
                  clip: Optional[float] = None,
                  **options: Any) -> None:
    """STEPS AdamW steps of the pipeline and of the unsplit model agree (see the module
    docstring); ``make`` gives (the pipeline's model, the reference), ``options`` go to
    ``PipeDream``, ``after_build(pipe)`` checks the built pipeline (and may return a
    check to run after training); with ``clip``,
    ``pd.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` every step."""
    import pipedream_ext as pd

    model, ref = make()
    mesh = mesh_of(shape)
    dp = shape[1]
    options.setdefault("balance", BALANCE if shape[0] == 2 else None)
    pipe = pd.PipeDream(model, lm_loss, schedule=schedule, microbatches=MICROBATCHES, mesh=mesh,
                        timeout=60, autocast=autocast, tensor_parallel=tensor_parallel(), **options)
    after_training = after_build(pipe) if after_build is not None else None
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, eps=1e-4)  # eps: test_tensor_parallel.py
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-4)
    refs = dict(ref.named_parameters(remove_duplicate=False))  # a tie: every name
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(STEPS):
        x, y = batch(step, 8 * dp)
        part = slice(dp_rank * 8, (dp_rank + 1) * 8)
        loss = pipe.step(x[part], y[part])
        ref_opt.zero_grad()
        ref_loss = reference_step(ref, x, y, autocast)
        close(torch.as_tensor(float(loss)), ref_loss, f"{name}: loss of step {step}", tol)
        if clip is not None:
            norm = pd.clip_grad_norm_(pipe, clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert ref_norm > clip, (name, ref_norm)
            close(norm, ref_norm, f"{name}: gradient norm of step {step}", tol)
        for pname, p in pipe.named_parameters():
            if step == 0:
                close(p.grad, refs[pname].grad, f"{name}: step-0 gradient of {pname}", tol)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        for pname, p in pipe.named_parameters():
            close(p, refs[pname], f"{name}: weight {pname} after step {step}", tol)
    if after_training is not None:
        after_training()
    pipe.close()


def meta_llama() -> Tuple[nn.Module, nn.Module]:
    """llama() built on the meta device, and the same model materialised whole by
    deferred initialisation's rule (``pd.materialize``): the unsplit reference."""
    import pipedream_ext as pd

    with torch.device("meta"):
        model, ref = llama(), llama()
    return model, pd.materialize(ref)


def tp_weights_are_dtensors(pipe: Any) -> None:
    """The plan's weights are DTensors over tp, with real (not meta) local shards."""
    from torch.distributed.tensor import DTensor

    tp = [n for n, p in pipe.named_parameters() if isinstance(p, DTensor)]
    assert len(tp) == 7, tp  # this rank's block
    assert not any(p.is_meta for p in pipe.parameters())


class Wide(nn.Module):
    """A feed-forward layer of WIDTH: up column-wise, down row-wise (1 MiB in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def check_meta_memory() -> None:
    """A meta-device model with tensor parallelism: no rank ever holds a whole stage.
    The CPU allocator's bytes (torch.profiler's memory events) held at the peak of
    PipeDream's construction stay below one whole stage, within this rank's shards of
    the stage plus one whole layer (the layer being initialised); every shard equals
    ``pd.materialize``'s values of the unsplit model, split by the plan."""
    import itertools

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import pipedream_ext as pd

    with torch.device("meta"):
        model, ref = nn.Sequential(*(Wide() for _ in range(8))), nn.Sequential(*(Wide() for _ in range(8)))
    pd.materialize(ref)
    layer_bytes = sum(p.numel() * p.element_size() for p in ref[0].parameters())
    stage_bytes = 4 * layer_bytes
    mesh = mesh_of((2, 1, 2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        pipe = pd.PipeDream(model, nn.functional.mse_loss, schedule="1f1b", microbatches=2,
                            mesh=mesh, timeout=60,
                            tensor_parallel={"*.up": ColwiseParallel(), "*.down": RowwiseParallel()})
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    peak = max(itertools.accumulate(e.nbytes() for e in events))
    print(f"rank {torch.distributed.get_rank()}: peak {peak} B, stage {stage_bytes} B, "
          f"layer {layer_bytes} B")
    assert peak < stage_bytes, (peak, stage_bytes)
    assert peak <= stage_bytes // 2 + layer_bytes + layer_bytes // 8, (peak, stage_bytes, layer_bytes)
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert not p.is_meta and p.to_local().numel() * 2 == p.numel(), name
        torch.testing.assert_close(p.full_tensor(), refs[name], rtol=0, atol=0)
    pipe.close()


def tied(model: nn.Sequential) -> nn.Sequential:
    """The head tied to the embedding (both ``[VOCAB, DIM]``: layers 0 and 4, stages 0 and 1)."""
    model[-1].weight = model[0].weight
    return model


def tied_llama() -> Tuple[nn.Module, nn.Module]:
    return tied(llama()), tied(llama())


def tied_meta_llama() -> Tuple[nn.Module, nn.Module]:
    import pipedream_ext as pd

    with torch.device("meta"):
        model, ref = tied(llama()), tied(llama())
    return model, pd.materialize(ref)


def tied_plan() -> Dict[str, Any]:
    """The blocks' plan, the embedding row-wise and the head column-wise (torchtitan's):
    both split the tied ``[VOCAB, DIM]`` weight on dim 0."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**plan(), "0": RowwiseParallel(input_layouts=Replicate()),
            "4": ColwiseParallel(output_layouts=Replicate())}


def tied_is_split(pipe: Any) -> None:
    """The tied weight is a DTensor split on dim 0 over tp on both stages (one tensor
    where one rank holds both)."""
    from torch.distributed.tensor import DTensor, Shard

    named = dict(pipe._stages.module.named_parameters(remove_duplicate=False))
    uses = [named[n] for n in ("0.weight", "4.weight") if n in named]
    assert len({id(p) for p in uses}) <= 1, "the tie is broken on this rank"
    for weight in uses:
        assert isinstance(weight, DTensor) and weight.placements[-1] == Shard(0), weight.placements


def check_refusals() -> None:
    """What still cannot compose is refused, naming it and the fix."""
    from test_bad_input import ROWS
    from torch.distributed.tensor.parallel import ColwiseParallel

    import pipedream_ext as pd

    def row(row_id: str) -> str:
        return next(r[2] for r in ROWS if r[0] == row_id)

    refused = [  # (what the message names, the plan, the options)
        ("0.weight (stage 0) not split, 4.weight (stage 1) (Shard(dim=0),) over mesh ('tp',)",
         {**plan(), "4": ColwiseParallel()}, dict(balance=BALANCE)),
        ("by separate tensors on one rank", {**plan(), "4": ColwiseParallel()},
         dict(schedule="zbv", chunks=2, balance=[1, 1, 1, 2], data_parallel="replicate")),
    ]
    for names, tp_plan, kwargs in refused:
        options = dict(schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)), timeout=60,
                       tensor_parallel=tp_plan)
        options.update(kwargs)
        with pytest.raises(ValueError, match=row("tp-tied")) as info:
            pd.PipeDream(tied(llama()), lm_loss, **options)
        assert names in str(info.value), (names, str(info.value))


def forwards_run_twice(pipe: Any) -> Callable[[], None]:
    """recompute=True: each training forward runs twice (without autograd, then again
    before its backward)."""
    calls = []
    next(iter(pipe.module.children())).register_forward_hook(lambda *_: calls.append(1))
    return lambda: _equal(len(calls), 2 * MICROBATCHES * STEPS, "forwards of the first layer")


def bf16_inside(pipe: Any) -> Callable[[], None]:
    """autocast: a block's column-wise wq returns bf16 (its local shard)."""
    seen: list = []
    block = next(m for m in pipe.module.children() if hasattr(m, "attn"))
    block.attn.wq.register_forward_hook(lambda _m, _args, out: seen.append(out.dtype))
    return lambda: _equal(set(seen), {torch.bfloat16}, "dtypes wq returns")


def fsdp_gathers(param_dtype: torch.dtype, resharded: bool) -> Callable[[Any], Callable[[], None]]:
    """FSDP over TP: a block's wq runs in ``param_dtype`` (mp_policy) and, with
    reshard_after_forward=True, is sharded over ("dp", "tp") again after the forward."""
    def attach(pipe: Any) -> Callable[[], None]:
        seen: list = []
        block = next(m for m in pipe.module.children() if hasattr(m, "attn"))
        block.attn.wq.register_forward_hook(lambda m, *_: seen.append(m.weight.dtype))
        block.register_forward_hook(
            lambda m, *_: seen.append(m.attn.wq.weight.device_mesh.mesh_dim_names))
        after = ("dp", "tp") if resharded else ("tp",)
        return lambda: _equal(set(seen), {param_dtype, after}, "wq's dtype and mesh after forward")
    return attach


def _equal(actual: Any, expected: Any, what: str) -> None:
    assert actual == expected, f"{what}: {actual}, expected {expected}"


def cases(world: int) -> Cases:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    c = Cases()
    c.add(check_meta_memory)
    c.add(check_compose, "meta", make=meta_llama, after_build=tp_weights_are_dtensors, name="meta")
    c.add(check_compose, "meta-fsdp", make=meta_llama, shape=(1, 2, 2), data_parallel="fsdp",
          name="meta-fsdp")
    c.add(check_compose, "tied-unsplit", make=tied_llama, clip=0.05, name="tied-not-split")
    c.add(check_compose, "tied-split", make=tied_llama, tensor_parallel=tied_plan, clip=0.05,
          after_build=tied_is_split, name="tied-split-on-both-stages")
    c.add(check_compose, "tied-split-meta", make=tied_meta_llama, tensor_parallel=tied_plan,
          after_build=tied_is_split, name="tied-split-meta")
    c.add(check_compose, "tied-split-zbv", make=tied_llama, tensor_parallel=tied_plan,
          schedule="zbv", chunks=2, balance=[1, 1, 1, 2], data_parallel="replicate", clip=0.05,
          after_build=tied_is_split, name="tied-split-on-one-rank-zbv")
    c.add(check_refusals)
    c.add(check_compose, "recompute", recompute=True, after_build=forwards_run_twice,
          name="recompute")
    c.add(check_compose, "recompute-zb-h1", schedule="zb-h1", recompute=True,
          after_build=forwards_run_twice, name="recompute-zb-h1")
    c.add(check_compose, "autocast", autocast=torch.bfloat16, tol=BF16_TOL,
          after_build=bf16_inside, name="autocast-bf16")
    c.add(check_compose, "fsdp-reshard", shape=(1, 2, 2), data_parallel="fsdp",
          reshard_after_forward=True, after_build=fsdp_gathers(torch.float32, True),
          name="fsdp-reshard-after-forward")
    c.add(check_compose, "fsdp-mp", shape=(1, 2, 2), data_parallel="fsdp", tol=BF16_TOL,
          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          after_build=fsdp_gathers(torch.bfloat16, False), name="fsdp-mp-policy")
    c.add(check_compose, "fsdp-mp-reshard", shape=(1, 2, 2), data_parallel="fsdp",
          reshard_after_forward=True, tol=BF16_TOL, schedule="zb-h1",
          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          after_build=fsdp_gathers(torch.bfloat16, True), name="fsdp-mp-policy-reshard-zb-h1")
    return c


def mesh_3d_cases(world: int) -> Cases:
    """pp2 x dp2 x tp2: the tie summed shard by shard over FSDP's 2-D shards."""
    c = Cases()
    c.add(check_compose, "tied-fsdp-3d", make=tied_llama, shape=(2, 2, 2),
          tensor_parallel=tied_plan, data_parallel="fsdp", clip=0.05, after_build=tied_is_split,
          name="tied-split-fsdp-pp2-dp2-tp2")
    c.add(check_compose, "tied-meta-fsdp-3d", make=tied_meta_llama, shape=(2, 2, 2),
          tensor_parallel=tied_plan, data_parallel="fsdp", reshard_after_forward=True,
          after_build=tied_is_split, name="tied-split-meta-fsdp-reshard-pp2-dp2-tp2")
    return c


LAUNCH = Launch(HERE, 4, cases, timeout=300)
MESH_3D = Launch(HERE, 8, mesh_3d_cases, name="8ranks", timeout=300, marks=(pytest.mark.slow,))


@parametrize_cases(LAUNCH)
def test_tensor_parallel_composes(case: CaseRef) -> None:
    case.check()


@pytest.mark.slow
@parametrize_cases(MESH_3D)
def test_tensor_parallel_composes_on_a_pp2_dp2_tp2_mesh(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH, MESH_3D])
