"""``loss_reduction="tokens"``: the global token mean of a batch with uneven padding.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    torchrun --standalone --nproc-per-node 4 tests/test_token_loss.py

A small token model (an embedding, blocks, a head over the vocabulary) trains on rows
whose targets end in a different number of ``-100`` each, so every microbatch (and
with ``dp`` every dp rank) holds another number of tokens; one step's first rows are
all padding (a microbatch, with ``dp`` a whole dp rank, without any token). Next to it
the unsplit model trains on the whole batch with ``cross_entropy(reduction="sum")``
divided by the batch's tokens: the loss of every step and every weight after 3
SGD-momentum and 3 Adam steps must agree, on pp 2 (every flush schedule, recompute,
gradients accumulated over two ``step()`` calls, fp16 with the pipeline's scaler) and
on pp 2 x dp 2 (``"fsdp"`` and ``"replicate"``), pp 2 x tp 2 and pp 2 with
``replicas=[2, 2]``. A per-microbatch or
per-dp-rank mean would weight the short rows' tokens more, and a wrong dp reduction
would halve or double the gradients: both fail here. Bad input (a ``loss_fn`` returning
a plain tensor or a mean as its ``loss_sum``, a batch without tokens, a ``tokens_fn``
that counts otherwise than ``loss_fn``, tuple targets without ``tokens_fn``) raises on
every rank.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-5, 1e-6
VOCAB, DIM, SEQ, BATCH, STEPS = 11, 8, 5, 16, 3
FLUSH = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-zb"]
OPTIMIZERS: Dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


class Block(nn.Module):
    """``x + w2(tanh(w1(x)))``: w1 column-wise, w2 row-wise under tensor parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), *[Block() for _ in range(6)],
                         nn.Linear(DIM, VOCAB))


def token_loss(out: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten(), reduction="sum"), (y != -100).sum()


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets; row ``r`` ends in ``(r * 3 + step) % SEQ`` padding targets (-100),
    and step 1's first 8 rows are all padding (a dp rank's whole half on dp 2)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for r in range(BATCH):
        pad = (r * 3 + step) % SEQ
        if pad:
            y[r, SEQ - pad:] = -100
    if step == 1:
        y[:BATCH // 2] = -100
    return x, y


def reference_loss(ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The unsplit model's token mean over the whole batch."""
    loss_sum, tokens = token_loss(ref(x), y)
    return loss_sum / tokens


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded weight gathered (DTensor), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(pipe: Any, ref: nn.Module, optimizer: str, part: slice, what: str,
          accumulate: int = 1, rtol: float = RTOL, atol: float = ATOL,
          step_fn: Optional[Callable[..., Any]] = None) -> None:
    """STEPS optimizer steps of ``pipe`` (this dp rank's rows ``part``) and of ``ref`` (the
    whole batch); every loss and then every weight compared. ``accumulate`` ``step()``
    calls (batches) per optimizer step, as ``accumulate`` backwards of the unsplit model."""
    params = list(pipe.parameters())
    opt = OPTIMIZERS[optimizer](params)
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    for step in range(STEPS):
        for k in range(accumulate):
            x, y = batch(step * accumulate + k)
            expected = reference_loss(ref, x, y)
            expected.backward()
            loss = float(pipe.step(x[part] if pipe.is_first else None,
                                   y[part] if pipe.is_last else None)) if step_fn is None \
                else step_fn(x[part], y[part])
            assert abs(loss - expected.item()) <= rtol * max(1.0, abs(expected.item())), \
                f"{what} step {step}.{k}: loss {loss} != {expected.item()}"
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full(p.detach()).float(), ref_params[name].detach(), rtol=rtol,
                                   atol=atol, msg=lambda m: f"{what} weight {name}: {m}")


def pipeline(schedule: str, **options: Any) -> Any:
    import pipedream_ext as pd

    traits = pd.schedules.traits(schedule)
    chunks = 2 if traits.multi_chunk else 1
    world = dist.get_world_size() // (2 if "mesh" in options else 1)
    microbatches = 2 * world if schedule == "dualpipev" else 4
    options.setdefault("timeout", 60)
    return pd.PipeDream(model(), token_loss, schedule=schedule, microbatches=microbatches,
                        chunks=chunks, loss_reduction="tokens", **options)


# --------------------------------------------------------------------------- pp 2
def check_pipeline(schedule: str, optimizer: str, recompute: bool = False) -> None:
    """pp 2: loss and weights of the global token mean, as the unsplit model's."""
    pipe = pipeline(schedule, recompute=recompute)
    train(pipe, model(), optimizer, slice(None), f"{schedule} {optimizer}")


def check_accumulated(schedule: str) -> None:
    """Two step() calls per optimizer step: each batch's own token mean, added up (as two
    backwards of the unsplit model)."""
    pipe = pipeline(schedule)
    train(pipe, model(), "adam", slice(None), f"{schedule} accumulated", accumulate=2)


def check_float16_with_scaler() -> None:
    """autocast fp16 and the pipeline's scaler: the scaled token-mean loss, unscaled in
    scaler.step, trains as the unsplit model under autocast with torch's GradScaler."""
    pipe = pipeline("1f1b", autocast=torch.float16)
    scaler = pipe.grad_scaler(init_scale=2.0 ** 8)
    ref = model()
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        total = 0.0
        tokens = (y != -100).sum()
        for cx, cy in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = token_loss(ref(cx), cy)[0].float() / tokens
            ref_scaler.scale(loss).backward()
            total += loss.item()
        got = float(pipe.step(x, y))
        assert abs(got - total) <= 1e-3 * max(1.0, abs(total)), (step, got, total)
        scaler.step(opt); scaler.update(); opt.zero_grad()
        ref_scaler.step(ref_opt); ref_scaler.update(); ref_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale())
    params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), params[n].detach(), rtol=1e-3, atol=1e-4,
                                   msg=lambda m: f"fp16 weight {n}: {m}")


def _expect_on_every_rank(pattern: str, fn: Callable[[], Any]) -> None:
    with pytest.raises((ValueError, RuntimeError)) as info:
        fn()
    assert re.search(pattern, str(info.value)), str(info.value)


def check_bad_input(mesh_shape: Optional[Tuple[int, int]] = None) -> None:
    """What loss_reduction="tokens" refuses, on every rank, in the first step."""
    mesh = _mesh(*mesh_shape) if mesh_shape else None
    options = {"mesh": mesh} if mesh is not None else {}
    rows = slice(None) if mesh is None else slice(0, BATCH // 2) \
        if mesh["dp"].get_local_rank() == 0 else slice(BATCH // 2, BATCH)
    x, y = batch(0)

    def step(pipe: Any, targets: Any = None) -> Any:
        given = y[rows] if targets is None else targets
        return pipe.step(x[rows] if pipe.is_first else None, given if pipe.is_last else None)

    import pipedream_ext as pd

    plain = pd.PipeDream(model(), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()),
                         schedule="1f1b", microbatches=4, loss_reduction="tokens", timeout=60, **options)
    _expect_on_every_rank(r"loss_reduction='tokens' needs loss_fn to return \(loss_sum, n_tokens\)"
                          r".*it returned a Tensor of shape \(\)", lambda: step(plain))
    empty = pipeline("1f1b", **options)
    _expect_on_every_rank(r"the batch holds no tokens: tokens_fn counted 0",
                          lambda: step(empty, torch.full_like(y[rows], -100)))

    def shifted(out: torch.Tensor, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return token_loss(out[:, :-1], t[:, 1:])

    mismatch = pd.PipeDream(model(), shifted, schedule="1f1b", microbatches=4,
                            loss_reduction="tokens", timeout=60, **options)
    _expect_on_every_rank(r"loss_fn returned n_tokens=\d+ for microbatch \d, but tokens_fn counted "
                          r"\d+ tokens.*tokens_fn=lambda t: \(t\[:, 1:\] != -100\)\.sum\(\)",
                          lambda: step(mismatch))
    averaged = pd.PipeDream(model(), lambda out, t: (F.cross_entropy(out.flatten(0, 1), t.flatten()),
                                                     (t != -100).sum()),
                            schedule="1f1b", microbatches=4, loss_reduction="tokens", timeout=60,
                            **options)
    _expect_on_every_rank(r"loss_fn's loss_sum averages over the batch.*sum over the tokens "
                          r"\(reduction='sum'\)", lambda: step(averaged))
    tupled = pd.PipeDream(model(), lambda out, t: token_loss(out, t[0]), schedule="1f1b",
                          microbatches=4, loss_reduction="tokens", timeout=60, **options)
    _expect_on_every_rank(r"loss_reduction='tokens' counts the tokens of a target tensor.*the "
                          r"targets are a tuple; pass tokens_fn=",
                          lambda: step(tupled, (y[rows], y[rows])))
    # A tokens_fn giving inf / NaN / a negative or fractional count, after the first
    # steps' agreement check (check_agreement=0): refused on every rank, naming the value;
    # the pipeline then trains on the next batch.
    given: Dict[str, Any] = {}
    odd = pipeline("1f1b", check_agreement=0, timeout=20,
                   tokens_fn=lambda t: given.get("count", (t != -100).sum()), **options)
    for count, shown in ((torch.tensor(float("inf")), "inf"), (float("nan"), "nan"),
                         (torch.tensor(-3), "-3"), (2.5, "2.5")):
        given["count"] = count
        _expect_on_every_rank(rf"step\(\) number 0 failed on .*tokens_fn counted {shown} tokens in "
                              r"microbatch 0; a token count is a whole number >= 0",
                              lambda: step(odd))
    given.clear()
    assert float(step(odd)) > 0
    # The fix of each: the same pipelines train.
    counted = pd.PipeDream(model(), shifted, schedule="1f1b", microbatches=4, loss_reduction="tokens",
                           tokens_fn=lambda t: (t[:, 1:] != -100).sum(), timeout=60, **options)
    assert float(step(counted)) > 0


def check_batch_without_tokens(mesh_shape: Optional[Tuple[int, int]] = None) -> None:
    """A batch of 0 tokens late in training (step() number 4, after the first steps'
    agreement check), right after a batch whose gradients are not yet applied: every rank
    raises the same error naming the step, nothing runs (the gradients stay the last
    batch's), and training goes on as the unsplit model that skipped that batch."""
    mesh = _mesh(*mesh_shape) if mesh_shape else None
    options = {"mesh": mesh} if mesh is not None else {}
    half = BATCH // 2
    rows = slice(None) if mesh is None else slice(mesh["dp"].get_local_rank() * half,
                                                  (mesh["dp"].get_local_rank() + 1) * half)
    pipe, ref = pipeline("zb-h1", **options), model()
    opt, ref_opt = OPTIMIZERS["adam"](pipe.parameters()), OPTIMIZERS["adam"](ref.parameters())
    for step in range(6):
        x, y = batch(step)
        if step != 4:
            expected = reference_loss(ref, x, y)
            expected.backward()
            loss = float(pipe.step(x[rows] if pipe.is_first else None,
                                   y[rows] if pipe.is_last else None))
            assert abs(loss - expected.item()) <= RTOL * max(1.0, abs(expected.item())), \
                f"step {step}: loss {loss} != {expected.item()}"
        if step == 3:  # the 0-token batch comes before this batch's optimizer step
            grads = {n: full(p.grad).clone() for n, p in pipe.named_parameters()}
            empty = torch.full_like(y, -100)
            _expect_on_every_rank(r"^step\(\) number 4: the batch holds no tokens: tokens_fn "
                                  r"counted 0 in every microbatch.*nothing ran on any rank",
                                  lambda: pipe.step(x[rows] if pipe.is_first else None,
                                                    empty[rows] if pipe.is_last else None))
            for n, p in pipe.named_parameters():
                assert torch.equal(full(p.grad), grads[n]), f"the 0-token step changed {n}.grad"
        if step != 4:
            opt.step(); opt.zero_grad()
            ref_opt.step(); ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full(p.detach()), ref_params[name].detach(), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"after the skipped batch {name}: {m}")


# --------------------------------------------------------------------------- pp 2 x dp 2, pp 2 x tp 2
def _mesh(pp: int, dp: int, names: Tuple[str, str] = ("pp", "dp")) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pp, dp), mesh_dim_names=names)


def check_mesh(schedule: str, optimizer: str, data_parallel: str) -> None:
    """pp 2 x dp 2: each dp rank its half of the batch (other token counts, step 1 none on
    dp rank 0); loss and weights of the whole batch's token mean."""
    mesh = _mesh(2, 2)
    pipe = pipeline(schedule, mesh=mesh, data_parallel=data_parallel)
    half = BATCH // 2
    dp = mesh["dp"].get_local_rank()
    train(pipe, model(), optimizer, slice(dp * half, (dp + 1) * half),
          f"{schedule} {optimizer} {data_parallel}")


def check_replicas(schedule: str) -> None:
    """replicas=[2, 2] (no mesh): each replica of the last stage runs every other
    microbatch but counts the whole batch's tokens; their gradients and losses add up."""
    pipe = pipeline(schedule, replicas=[2, 2])
    train(pipe, model(), "adam", slice(None), f"{schedule} replicas")


def check_tensor_parallel(schedule: str) -> None:
    """pp 2 x tp 2 (every tp rank the same batch): the loss counted once, the weights as
    the unsplit model's (tensor parallelism sums in another order: 1e-4)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = _mesh(2, 2, ("pp", "tp"))
    pipe = pipeline(schedule, mesh=mesh,
                    tensor_parallel={"*.w1": ColwiseParallel(), "*.w2": RowwiseParallel()})
    train(pipe, model(), "adam", slice(None), f"{schedule} tp", rtol=1e-4, atol=1e-5)


def token_cases(world: int) -> Cases:
    cases = Cases()
    if world == 2:
        for schedule in FLUSH:
            for optimizer in OPTIMIZERS:
                cases.add(check_pipeline, schedule, optimizer)
        cases.add(check_pipeline, "zb-h1", "adam", recompute=True)
        cases.add(check_accumulated, "1f1b")
        cases.add(check_float16_with_scaler)
        cases.add(check_bad_input)
        cases.add(check_batch_without_tokens)
        return cases
    for data_parallel in ("fsdp", "replicate"):
        for optimizer in OPTIMIZERS:
            cases.add(check_mesh, "1f1b", optimizer, data_parallel)
    cases.add(check_mesh, "zb-h1", "adam", "fsdp")
    cases.add(check_mesh, "interleaved-1f1b", "sgd", "replicate")
    cases.add(check_tensor_parallel, "1f1b")
    cases.add(check_replicas, "1f1b")
    cases.add(check_bad_input, (2, 2))
    cases.add(check_batch_without_tokens, (2, 2))
    return cases


LAUNCHES = [Launch(HERE, world, token_cases, timeout=600) for world in (2, 4)]


@parametrize_cases(*LAUNCHES)
def test_token_mean_matches_the_unsplit_model(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main(LAUNCHES)
