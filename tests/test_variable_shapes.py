"""Boundary tensors whose shapes change from step to step (2 ranks, CPU, Gloo).

A tiny language model whose sequence length changes every step (with a batch that
does not divide into the microbatches, so the last microbatch is smaller) and a
tiny CNN whose image size changes, under every flush schedule against the unsplit
model (loss of every step, weights after SGD with momentum), and under
``pipedream`` / ``pipedream-2bw`` against a sequential simulation of their
weight-version rules (zb-h1 also with recompute; 1f1b then evaluates yet another
shape). The last step repeats the shapes of the one before it: its receives are
all pre-posted and no send redirects. Then two one-sided bad peers (a
wrong number of tensors, a gradient of the wrong shape): both ranks fail with an
error, none hangs.

Runs under pytest (which launches torchrun) or directly:

    torchrun --standalone --nproc-per-node 2 tests/test_variable_shapes.py
"""
from __future__ import annotations

import collections
import copy
import os
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import (
    CaseRef,
    Cases,
    launch_raw,
    parametrize_cases,
    strict_and_gloo,
    worker_main,
)
from torch import nn
from torch.func import functional_call

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
FLUSH_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
VOCAB, HIDDEN = 11, 8
MICROBATCHES = 3
# (batch, sequence length) per step: 8 and 7 rows split into 3 microbatches leave a
# smaller last one; the last step repeats the one before (a steady step).
LM_STEPS = ((8, 16), (8, 12), (7, 7), (8, 16), (8, 3), (8, 3))
# (batch, image side) per step for the CNN.
CNN_STEPS = ((8, 8), (8, 6), (7, 11), (8, 5), (8, 5))


# --------------------------------------------------------------------------- models
class CausalBlock(nn.Module):
    """Keeps [B, T, H]; mixes along T (a running mean), so T matters to the result."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return x + torch.tanh(self.linear(x.cumsum(1) / steps))


def make_lm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), CausalBlock(HIDDEN), CausalBlock(HIDDEN),
                         CausalBlock(HIDDEN), nn.Linear(HIDDEN, VOCAB))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def lm_batch(step: int, rows: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # next-token targets [B, T]


def make_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3))


def cnn_batch(step: int, rows: int, side: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(rows, 1, side, side, generator=g), torch.randint(0, 3, (rows,), generator=g)


CASES: Dict[str, Tuple[Callable[[], nn.Sequential], Callable, Callable, Sequence[Tuple[int, int]]]] = {
    "lm": (make_lm, lm_loss, lm_batch, LM_STEPS),
    "cnn": (make_cnn, F.cross_entropy, cnn_batch, CNN_STEPS),
}


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_loss(loss: float, expected: float, what: str) -> None:
    assert abs(loss - expected) <= RTOL * max(1.0, abs(expected)), f"{what}: loss {loss} != {expected}"


# --------------------------------------------------------------------------- flush schedules
def check_flush(case: str, schedule: str, recompute: bool = False, evaluate: bool = False) -> None:
    """Every step's loss and the final weights equal the unsplit model's; the steady
    last step pre-posts every receive and redirects no send. ``evaluate``: then
    ``forward_only`` on yet another shape equals the unsplit model's output."""
    import pipedream_ext as pd

    make, loss_fn, make_batch, steps = CASES[case]
    ref = make()
    ref_opt = sgd(ref.parameters())
    pipe = pd.PipeDream(make(), loss_fn, schedule=schedule, microbatches=MICROBATCHES,
                        chunks=2 if schedule == "interleaved-1f1b" else 1, timeout=60,
                        recompute=recompute)
    opt = sgd(pipe.parameters())
    # fused (Gloo): a slot too small for a new shape sends its payload on the side
    # channel once; split (NCCL-like backends): the metadata says the shape every time.
    fused = pipe._runner.executor.protocol == "fused"
    for step, (rows, size) in enumerate(steps):
        if step == len(steps) - 1:
            changed = pipe.stats()
            assert (changed["redirected_sends"] > 0) == fused, (case, schedule, changed)
            pipe.reset_stats()
        x, y = make_batch(step, rows, size)
        expected = loss_fn(ref(x), y)
        expected.backward()
        ref_opt.step(); ref_opt.zero_grad()
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        assert_loss(loss, expected.item(), f"{case} {schedule} step {step} {x.shape}")
        opt.step(); opt.zero_grad()
    steady = pipe.stats()
    assert steady["redirected_sends"] == 0, (case, schedule, steady)
    if fused:
        assert steady["preposted_receives"] == steady["receives"] > 0, (case, schedule, steady)
    else:
        assert steady["messages_sent"] == 2 * steady["sends"] > 0, (case, schedule, steady)
    expected_weights = dict(ref.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.detach(), expected_weights[name].detach(), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"{case} {schedule} weight {name}: {m}")
    if evaluate:
        x, _ = make_batch(99, 5, 9)
        pipe.eval()
        out = pipe.forward_only(x)
        if pipe.is_last:
            torch.testing.assert_close(out, ref(x).detach(), rtol=RTOL, atol=ATOL)
        else:
            assert out is None


# --------------------------------------------------------------------------- asynchronous
RULES = {  # the version stage s of p reads for step b (of its stream): docs/runtime.md
    "pipedream": lambda s, b, p: max(0, b - (p - 1 - s)),
    "pipedream-2bw": lambda s, b, p: max(0, b - 1),
}


def simulate(schedule: str, p: int, streams: Sequence[int]) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """Sequential reference: every weight version of every stage kept, each step run
    through the stages with the version the rule names, one update per step."""
    model = copy.deepcopy(make_lm())
    children = list(model.named_children())
    bounds = [0, 3, 5]  # the even balance of 5 layers over 2 stages
    stages = [nn.Sequential(collections.OrderedDict(children[bounds[j]:bounds[j + 1]])) for j in range(p)]
    opts = [sgd(st.parameters()) for st in stages]
    losses, step = [], 0
    for length in streams:
        history = [[{n: t.detach().clone() for n, t in st.named_parameters()}] for st in stages]
        for b in range(length):
            x, y = lm_batch(step, *LM_STEPS[step])
            versions, h = [], x
            for s, st in enumerate(stages):
                params = {n: t.clone().requires_grad_() for n, t in history[s][RULES[schedule](s, b, p)].items()}
                versions.append(params)
                h = functional_call(st, params, (h,))
            loss = lm_loss(h, y)
            loss.backward()
            losses.append(loss.item())
            for s, st in enumerate(stages):
                for n, t in st.named_parameters():
                    t.grad = versions[s][n].grad.clone()
                opts[s].step(); opts[s].zero_grad()
                history[s].append({n: t.detach().clone() for n, t in st.named_parameters()})
            step += 1
    return {n: t.detach() for n, t in model.named_parameters()}, losses


def check_async(schedule: str, streams: Sequence[int] = (4, 2)) -> None:
    """pipedream / pipedream-2bw with the LM's changing shapes equal the simulation of
    their version rule, loss for loss and weight for weight (a flush in between)."""
    import pipedream_ext as pd

    assert sum(streams) == len(LM_STEPS)
    expected_weights, expected_losses = simulate(schedule, dist.get_world_size(), streams)
    pipe = pd.PipeDream(make_lm(), lm_loss, schedule=schedule, microbatches=MICROBATCHES, timeout=60)
    opt = sgd(pipe.parameters())
    step = 0
    for length in streams:
        for _ in range(length):
            x, y = lm_batch(step, *LM_STEPS[step])
            loss = pipe.step(x, y, optimizer=opt)
            if pipe.is_last:
                assert_loss(loss, expected_losses[step], f"{schedule} step {step} {tuple(x.shape)}")
            else:
                assert loss is None
            step += 1
        pipe.flush()
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.detach(), expected_weights[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{schedule} weight {name}: {m}")


def variable_shapes_cases(world: int) -> Cases:
    cases = Cases()
    for schedule in FLUSH_SCHEDULES:
        cases.add(check_flush, "lm", schedule, evaluate=schedule == "1f1b")
    cases.add(check_flush, "lm", "zb-h1", recompute=True)
    for schedule in ("1f1b", "zb-h1"):
        cases.add(check_flush, "cnn", schedule)
    for schedule in ("pipedream", "pipedream-2bw"):
        cases.add(check_async, schedule)
    return cases


# Written for 2 ranks; `make test` runs them under NCCL's rules, `make test-all` on Gloo too.
LAUNCHES = strict_and_gloo(HERE, 2, variable_shapes_cases)


# --------------------------------------------------------------------------- bad peers
class Pair(nn.Module):
    """Passes two tensors where the pipeline passed one: a wrong number of tensors."""

    def forward(self, x: torch.Tensor):
        return x, x * 2


class ShrinkInput(nn.Module):
    """Drops the last position of its input leaf in place (and pads the output back), so
    the gradient it sends back no longer has the activation's shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.data = x.data[:, :-1].contiguous()
        return F.pad(x, (0, 0, 0, 1))


def fault_case(case: str) -> None:
    """One good step, then rank 0 (``count``) or rank 1 (``gradient``) misbehaves."""
    import pipedream_ext as pd

    rank = dist.get_rank()
    pipe = pd.PipeDream(make_lm(), lm_loss, schedule="1f1b", microbatches=2, timeout=5)
    pipe.step(*lm_batch(0, 4, 16))
    stages = pipe._stages
    if case == "count" and 0 in pipe.local_stages:
        stages[0][-1] = nn.Sequential(stages[0][-1], Pair())
    if case == "gradient" and 1 in pipe.local_stages:
        stages[1][0] = nn.Sequential(ShrinkInput(), stages[1][0])
    start = time.time()
    try:
        pipe.step(*lm_batch(1, 4, 12))
    except Exception as exc:  # noqa: BLE001 - report any failure type
        print(f"RANK{rank} ERROR after {time.time() - start:.1f}s: {type(exc).__name__}: {exc}",
              flush=True)
        if rank == 0:
            # Rank 0 hosts the job's store in a plain launch; under torchrun the agent's
            # store outlives a failed worker. Keep it up past the peer's timeout, so a
            # peer that finished its part of the step (its sends were all received)
            # learns from it which rank failed first.
            time.sleep(8)
        os._exit(3)
    print(f"RANK{rank} NO ERROR", flush=True)
    os._exit(0)


# --------------------------------------------------------------------------- pytest side
@parametrize_cases(*LAUNCHES)
def test_shapes_that_change_every_step_match_the_references(case: CaseRef) -> None:
    case.check()


@pytest.mark.parametrize("case, bad_rank, needle", [
    ("count", 1, "rank 1: RECV_F of microbatch 0 for stage 1: rank 0 sent 2 tensors "
                 "(Float[2, 12, 8], Float[2, 12, 8]) but stage 1 was first given 1 tensor "
                 "(Float[2, 16, 8])"),
    ("gradient", 0, "rank 0: RECV_B of microbatch 0 for stage 0: rank 1 sent a gradient "
                    "Float[2, 11, 8] for output 0 of Float[2, 12, 8]"),
])
def test_a_peer_sending_what_the_stage_cannot_use_fails_both_ranks(case: str, bad_rank: int,
                                                                   needle: str) -> None:
    results = launch_raw(HERE, 2, case)
    for rank, result in enumerate(results):
        assert result.returncode == 3, \
            f"rank {rank} in {case!r} did not fail:\n{result.stdout[-3000:]}"
    outputs = [result.stdout for result in results]
    assert needle in outputs[bad_rank], outputs[bad_rank][-3000:]
    assert f"rank {bad_rank}" in outputs[1 - bad_rank], outputs[1 - bad_rank][-3000:]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--fault":
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        fault_case(sys.argv[2])
        return
    worker_main(LAUNCHES)


if __name__ == "__main__":
    main()
