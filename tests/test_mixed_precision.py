"""Mixed precision and non-finite detection (CPU, Gloo, 2 ranks).

Runs under pytest (which starts the worker side with torchrun) or directly:

    torchrun --standalone --nproc-per-node 2 tests/test_mixed_precision.py

References are the unsplit model computed microbatch by microbatch under the
same autocast, so the pipeline must reproduce them (same ops on the same data).
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main

MICROBATCHES = 4


class PoisonAt(nn.Module):
    """Identity, except that it returns NaN when ``armed`` is set (on the step chosen)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.armed else x


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), PoisonAt(),
                         nn.Linear(32, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def reference_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype,
                   scale: float = 1.0) -> float:
    """Microbatch by microbatch under autocast, losses scaled by their batch share."""
    total = 0.0
    for cx, cy in zip(torch.tensor_split(x, MICROBATCHES), torch.tensor_split(y, MICROBATCHES)):
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(cx), cy).float() * (cx.shape[0] / x.shape[0])
        (loss * scale).backward()
        total += loss.item()
    return total


def check_bfloat16() -> None:
    """bf16: loss and gradients equal the reference; boundary tensors are bf16."""
    import pipedream_ext as pd

    ref = make_model()
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=MICROBATCHES,
                        balance=[3, 4], autocast=torch.bfloat16, timeout=60)
    seen: List[torch.dtype] = []
    first = next(iter(pipe.module.children()))
    first.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    params: Dict[str, nn.Parameter] = dict(ref.named_parameters())
    for step in range(3):
        x, y = batch(step)
        expected = reference_step(ref, x, y, torch.bfloat16)
        loss = pipe.step(x, y)
        assert abs(loss - expected) <= 1e-4 * max(1.0, abs(expected)), (step, loss, expected)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"bf16 grad of {name}: {m}")
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    # Stage 1 receives bf16 activations: half the bytes of float32.
    if pipe.stage_index == 1:
        assert seen and all(d == torch.bfloat16 for d in seen), seen
    else:
        assert all(d == torch.float32 for d in seen), seen  # the model's own inputs
    # Evaluation without autocast on the same executor: float32 crosses the same
    # boundary (the dtype changes; headers carry it).
    pipe.autocast = None
    x, _ = batch(99)
    out = pipe.forward_only(x)
    if pipe.is_last:
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref(x).detach(), rtol=1e-5, atol=1e-6)


def check_float16_with_scaler() -> None:
    """fp16 + the pipeline's scaler: equal to torch.amp.GradScaler on the unsplit model;
    an overflowing step is skipped on every rank together."""
    import pipedream_ext as pd

    ref = make_model()
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="gpipe", microbatches=MICROBATCHES,
                        balance=[3, 4], autocast=torch.float16, timeout=60)
    # 2**40 overflows fp16 gradients on the first step: both sides must skip it.
    scaler = pipe.grad_scaler(init_scale=2.0 ** 40, growth_interval=1000)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)
    ref_scaler.scale(torch.ones(()))  # creates its scale (reference_step scales by hand)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    scales = []
    for step in range(6):
        x, y = batch(10 + step)
        expected = reference_step(ref, x, y, torch.float16, scale=ref_scaler.get_scale())
        loss = pipe.step(x, y)
        assert abs(loss - expected) <= 1e-3 * max(1.0, abs(expected)), (step, loss, expected)
        scaler.step(opt); scaler.update(); opt.zero_grad()
        ref_scaler.step(ref_opt); ref_scaler.update(); ref_opt.zero_grad()
        scales.append(scaler.get_scale())
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(),
                                                               ref_scaler.get_scale())
        if step == 0:  # skipped everywhere: the weights did not move
            for n, p in pipe.named_parameters():
                torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
    assert scales[0] < 2.0 ** 40, scales
    params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), params[n].detach(), rtol=1e-3, atol=1e-4,
                                   msg=lambda m: f"fp16 weight {n}: {m}")


def check_nonfinite() -> None:
    """A NaN is reported with its step and stage; "skip" leaves the weights alone."""
    import pipedream_ext as pd

    for mode in ("raise", "skip"):
        pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b",
                            microbatches=MICROBATCHES, balance=[3, 4], check_finite=mode,
                            timeout=60)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
        poison = [m for m in pipe.module.children() if isinstance(m, PoisonAt)]
        for step in range(4):
            x, y = batch(20 + step)
            for m in poison:
                m.armed = step == 2
            if step == 2 and mode == "raise":
                with pytest.raises(pd.NonFiniteError,
                                   match=r"step 2: NaN or inf first appeared in the forward "
                                         r"output of stage 0 \(layers 0-2\)"):
                    pipe.step(x, y)
                break
            before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
            loss = pipe.step(x, y)
            opt.step(); opt.zero_grad()
            if step == 2:  # skipped on every rank: nan returned, no weight moved
                assert loss != loss
                for n, p in pipe.named_parameters():
                    torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
            else:
                assert loss == loss and all(bool(torch.isfinite(p).all()) for p in pipe.parameters())


def check_bfloat16_async() -> None:
    """pipedream-2bw under bf16 trains (finite, decreasing loss) with check_finite on."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="pipedream-2bw",
                        microbatches=MICROBATCHES, balance=[3, 4], autocast=torch.bfloat16,
                        check_finite="raise", timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = batch(5, n=32)
    losses = [pipe.step(x, y, optimizer=opt) for _ in range(20)]
    pipe.flush()
    if pipe.is_last:
        seen = [l for l in losses if l is not None]
        assert seen[-1] < seen[0], seen


def mixed_precision_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(check_bfloat16)
    cases.add(check_float16_with_scaler)
    cases.add(check_nonfinite)
    cases.add(check_bfloat16_async)
    return cases


LAUNCH = Launch(os.path.abspath(__file__), 2, mixed_precision_cases, timeout=300)


@parametrize_cases(LAUNCH)
def test_mixed_precision_and_nonfinite_detection(case: CaseRef) -> None:
    case.check()


def test_bad_autocast_arguments_are_rejected_before_any_communication() -> None:
    import pipedream_ext as pd

    model = make_model()
    for kwargs, match in ((dict(autocast=torch.float64), "not a reduced-precision dtype"),
                          (dict(autocast=torch.float16, schedule="pipedream"), "needs loss scaling"),
                          (dict(check_finite="warn"), "check_finite='warn'"),
                          (dict(check_finite="skip", schedule="pipedream"), "needs a flush schedule")):
        with pytest.raises(ValueError, match=match):
            pd.PipeDream(model, F.cross_entropy, **kwargs)


if __name__ == "__main__":
    worker_main([LAUNCH])
