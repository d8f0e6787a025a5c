"""``pd.clip_grad_norm_``: the pipeline's total gradient norm equals torch's on the unsplit model.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=full-3ranks torchrun --standalone --nproc-per-node 3 tests/test_clip.py

Every check trains the pipeline and the unsplit model side by side on the same
batches, clipping both (``pd.clip_grad_norm_`` / ``torch.nn.utils.clip_grad_norm_``):
the returned norm (every step, every rank), the clipped gradients of the first step
and every weight after 3 AdamW or SGD-momentum steps must agree, so a stage, replica
or tied copy counted twice or not at all shows up. ``max_norm`` small enough that
every step clips, and large enough that none does. The asynchronous option
(``clip_grad_norm=``) is checked against test_async.py's sequential simulation.
"""
from __future__ import annotations

import math
import os
import re
import sys
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from test_shared_params import batch as lm_batch
from test_shared_params import lm_loss, tied_lm

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
STEPS = 3
SMALL, LARGE = 0.05, 100.0  # every step clips / no step clips (checked on the reference)
INF = float("inf")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(),
                         nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))


def mlp_batch(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


MODELS = {"mlp": (mlp, F.cross_entropy, mlp_batch), "tied": (tied_lm, lm_loss, lm_batch)}
OPTIMIZERS: Dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_flush(schedule: str, model: str, max_norm: float, norm_type: float, opt_name: str,
                balance: Optional[List[int]] = None, replicas: Optional[List[int]] = None,
                microbatches: int = 4) -> None:
    """STEPS clipped steps of the pipeline and of the unsplit model agree."""
    import pipedream_ext as pd

    make, loss_fn, data = MODELS[model]
    chunks = pd.schedules.traits(schedule).fixed_chunks or \
        (2 if pd.schedules.traits(schedule).multi_chunk else 1)
    what = f"{schedule} {model} balance={balance} replicas={replicas} max_norm={max_norm} p={norm_type}"
    ref = make()
    pipe = pd.PipeDream(make(), loss_fn, schedule=schedule, microbatches=microbatches,
                        balance=balance, chunks=chunks, replicas=replicas, timeout=60)
    params = list(pipe.parameters())
    opt = OPTIMIZERS[opt_name](params) if params else None
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(STEPS):
        x, y = data(100 + step)
        loss_fn(ref(x), y).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        assert (expected > max_norm) == (max_norm == SMALL), f"{what}: reference norm {expected}"
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        norm = pd.clip_grad_norm_(pipe, max_norm, norm_type)
        assert isinstance(norm, torch.Tensor) and norm.dtype == expected.dtype and norm.dim() == 0, \
            (what, norm)
        assert_close(norm, expected, f"{what} step {step} norm")
        if step == 0:
            for name, p in pipe.named_parameters():
                assert_close(p.grad, ref_params[name].grad, f"{what} clipped gradient of {name}")
        ref_opt.step(); ref_opt.zero_grad()
        if opt is not None:
            opt.step(); opt.zero_grad()
    for name, p in pipe.named_parameters():
        assert_close(p.detach(), ref_params[name].detach(), f"{what} {opt_name}: weight {name}")


def check_nonfinite() -> None:
    """A NaN gradient on one stage: the norm is NaN on every rank; with
    error_if_nonfinite every rank raises torch's error and nothing is scaled."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=2, timeout=60)
    x, y = mlp_batch(7)
    for norm_type in (2.0, INF):
        pipe.step(x, y)
        if pipe.rank == 0:
            next(pipe.parameters()).grad[0, 0] = math.nan
        before = [p.grad.clone() for p in pipe.parameters()]
        with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
            pd.clip_grad_norm_(pipe, 1.0, norm_type, error_if_nonfinite=True)
        for p, g in zip(pipe.parameters(), before):
            torch.testing.assert_close(p.grad, g, equal_nan=True)
        assert math.isnan(float(pd.clip_grad_norm_(pipe, 1.0, norm_type))), norm_type
        for p in pipe.parameters():
            p.grad = None


def check_bad_input() -> None:
    """docs/bad_input.md rows clip-max-norm, clip-norm-type and clip-async-call."""
    from test_bad_input import ROWS

    import pipedream_ext as pd

    def expect(row_id: str, fn: Callable[[], object]) -> None:
        with pytest.raises(ValueError) as info:
            fn()
        assert re.search(next(r[2] for r in ROWS if r[0] == row_id), str(info.value)), str(info.value)

    pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=2, timeout=60)
    pipe.step(*mlp_batch(1))
    expect("clip-max-norm", lambda: pd.clip_grad_norm_(pipe, 0))
    for bad in (-1.0, math.nan, "1.0", None, True):
        with pytest.raises(ValueError, match=r"must be a number > 0"):
            pd.clip_grad_norm_(pipe, bad)
    expect("clip-norm-type", lambda: pd.clip_grad_norm_(pipe, 1.0, norm_type=0))
    for bad in (-1, -INF, math.nan, "two", None):
        with pytest.raises(ValueError, match=r"use a p-norm with p > 0"):
            pd.clip_grad_norm_(pipe, 1.0, norm_type=bad)
    with pytest.raises(ValueError, match=r"takes the PipeDream pipeline"):
        pd.clip_grad_norm_(mlp(), 1.0)
    asynchronous = pd.PipeDream(mlp(), F.cross_entropy, schedule="pipedream-2bw", microbatches=2,
                                timeout=60)
    expect("clip-async-call", lambda: pd.clip_grad_norm_(asynchronous, 1.0))
    expect("clip-option-steps", lambda: pd.PipeDream(mlp(), F.cross_entropy, schedule="pipedream",
                                                     microbatches=2, clip_grad_norm=1.0, timeout=60))


def check_dtensor_gradients() -> None:
    """The DTensor branch (FSDP2's gradients): a gradient sharded over every rank, and one
    replicated on every rank, each count once in the norm; shards are scaled in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from pipedream_ext._runtime.grad_clip import GradientClipper

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    full_sharded, full_replicated = torch.randn(2 * world, 3), torch.randn(4)
    module = nn.Module()
    module.a = nn.Parameter(distribute_tensor(torch.zeros(2 * world, 3), mesh, [Shard(0)]))
    module.b = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    # Clones: distribute_tensor may keep the given tensor as the local one, which clipping scales.
    module.a.grad = distribute_tensor(full_sharded.clone(), mesh, [Shard(0)])
    module.b.grad = distribute_tensor(full_replicated.clone(), mesh, [Replicate()])

    class Stages:  # LocalStages' surface the clipper reads: no plain parameters here
        def __init__(self) -> None:
            self.module = module

        def __iter__(self):
            return iter(())

    clipper = GradientClipper(Stages(), [], dist.get_rank(), dist.group.WORLD, torch.device("cpu"), 60)
    for norm_type in (2.0, INF):
        expected = torch.nn.utils.get_total_norm([full_sharded, full_replicated], norm_type)
        total = clipper.clip(INF, norm_type)  # measures only: coefficient 1
        assert_close(total, expected, f"DTensor norm p={norm_type}")
    total = clipper.clip(0.5, 2.0)
    coef = 0.5 / (total + 1e-6)
    assert_close(module.a.grad.full_tensor(), full_sharded * coef, "clipped DTensor shard")
    assert_close(module.b.grad.to_local(), full_replicated * coef, "clipped DTensor replica")


def fast_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(check_flush, "1f1b", "mlp", SMALL, 2.0, "sgd")
    cases.add(check_flush, "1f1b", "mlp", LARGE, INF, "adamw")
    cases.add(check_flush, "1f1b", "tied", SMALL, 2.0, "adamw", balance=[2, 4])
    cases.add(check_nonfinite)
    cases.add(check_bad_input)
    cases.add(check_dtensor_gradients)
    return cases


def full_cases(world: int) -> Cases:
    cases = Cases()
    if world == 2:
        for schedule in ("gpipe", "interleaved-1f1b", "zb-h1", "zbv", "interleaved-zb"):
            cases.add(check_flush, schedule, "mlp", SMALL, 2.0, "adamw")
            cases.add(check_flush, schedule, "mlp", SMALL, INF, "sgd")
        cases.add(check_flush, "dualpipev", "mlp", SMALL, 2.0, "sgd")
        cases.add(check_flush, "zb-h1", "mlp", LARGE, 2.0, "adamw")
        cases.add(check_flush, "interleaved-1f1b", "tied", SMALL, 2.0, "adamw", balance=[1, 2, 2, 1])
        cases.add(check_flush, "interleaved-1f1b", "tied", SMALL, 2.0, "sgd", balance=[1, 2, 1, 2])
        cases.add(check_flush, "zbv", "tied", SMALL, INF, "adamw", balance=[1, 1, 1, 3])
    elif world == 3:
        cases.add(check_flush, "1f1b", "mlp", SMALL, 1.0, "adamw")  # another p
        cases.add(check_flush, "gpipe", "mlp", SMALL, 3.0, "sgd")
        for replicas in ([2, 1], [1, 2]):
            cases.add(check_flush, "1f1b", "mlp", SMALL, 2.0, "adamw", replicas=replicas)
            cases.add(check_flush, "zb-h1", "mlp", SMALL, INF, "sgd", replicas=replicas)
            cases.add(check_flush, "gpipe", "tied", SMALL, 2.0, "adamw", balance=[3, 3], replicas=replicas)
        cases.add(check_flush, "1f1b", "tied", SMALL, 2.0, "sgd", balance=[1, 3, 2])
    elif world == 4:
        cases.add(check_flush, "1f1b", "mlp", SMALL, 2.0, "adamw")
        cases.add(check_flush, "gpipe", "mlp", SMALL, INF, "sgd", replicas=[2, 1, 1])
        cases.add(check_flush, "1f1b", "tied", SMALL, 2.0, "adamw", balance=[1, 2, 3], replicas=[1, 1, 2])
        cases.add(check_flush, "interleaved-1f1b", "mlp", LARGE, 2.0, "sgd")
    return cases


FAST = Launch(HERE, 2, fast_cases)
FULL = [Launch(HERE, world, full_cases, name=f"full-{world}ranks") for world in (2, 3, 4)]


# --------------------------------------------------------------------------- pytest side
@parametrize_cases(FAST)
def test_clip_grad_norm_matches_torch_on_the_unsplit_model(case: CaseRef) -> None:
    case.check()


@pytest.mark.slow
@parametrize_cases(*FULL)
def test_clip_grad_norm_on_more_schedules_and_ranks(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([FAST, *FULL])
