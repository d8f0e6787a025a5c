"""Zero-bubble schedules with several chunks per rank (zbv, dualpipev, interleaved-zb)
run by the runtime: equal to the unsplit model, and checkpoints re-shard between
their layouts and straight ones (CPU, processes on localhost).

One launch per world size runs every case (under NCCL's rules; `make test-all` also on Gloo):

* 2 ranks: every schedule against the unsplit model (loss of every step, gradients
  of the first, every weight after SGD-momentum and Adam steps), evaluation with
  ``forward_only``; then a ``zbv`` run that saves a checkpoint after N steps and goes
  on for M (the reference), and a ``1f1b`` pipeline (straight, 2 stages, another
  balance) that loads the ``zbv`` checkpoint and must end where the reference did;
* 4 ranks: every schedule against the unsplit model; the 2-rank ``zbv`` checkpoint
  loaded into ``1f1b`` on 4 straight stages and into ``zbv`` on 4 ranks (8 stages in
  a V), trained M steps, compared with the 2-rank reference.

The model passes a tuple between the stages at the turn of the V (stage p-1 -> p,
both on rank p-1: handed over in memory) and, for interleaved-zb, between ranks.
Standalone: ``PDZB_DIR=/tmp/zb torchrun --standalone --nproc-per-node 2
tests/test_zero_bubble.py`` (then ``--nproc-per-node 4``).
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, strict_and_gloo, worker_main
from torch import nn

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-5, 1e-6
STEPS = 4  # per optimizer
N, M = 2, 3  # checkpoint: steps before saving, steps after


# --------------------------------------------------------------------------- model
class Dense(nn.Module):
    """Linear + tanh; with ``fork`` it returns ``(h, tanh(h))``: a tuple activation."""

    def __init__(self, width_in: int, width: int, fork: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width)
        self.fork = fork

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.linear(x))
        return (h, torch.tanh(h)) if self.fork else h


class Join(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, pair):
        x, y = pair
        return torch.relu(self.a(x) + self.b(y))


def make_model(seed: int = 0) -> nn.Sequential:
    """9 layers, each with parameters (every stage of 8 has some); layer 3 returns a tuple."""
    torch.manual_seed(seed)
    return nn.Sequential(Dense(6, 12), Dense(12, 12), Dense(12, 12), Dense(12, 12, fork=True),
                         Join(12), Dense(12, 12), Dense(12, 12), Dense(12, 12), nn.Linear(12, 3))


def balance_for(stages: int) -> List[int]:
    """Layers per stage with the tuple (layer 3 -> 4) crossing the middle boundary
    (stage stages/2 - 1 -> stages/2: the turn of the V)."""
    return {4: [2, 2, 2, 3], 8: [1, 1, 1, 1, 1, 1, 1, 2]}[stages]


def batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def build(schedule: str, microbatches: int, chunks: int, seed: int = 0):  # type: ignore[no-untyped-def]
    import pipedream_ext as pd

    stages = dist.get_world_size() * chunks
    return pd.PipeDream(make_model(seed), F.cross_entropy, schedule=schedule,
                        microbatches=microbatches, chunks=chunks, balance=balance_for(stages),
                        timeout=60)


# --------------------------------------------------------------------------- equality
def check_matches_unsplit_model(schedule: str, microbatches: int) -> None:
    """Every step's loss, the first step's gradients and every weight after STEPS steps of
    SGD with momentum and of Adam equal the unsplit model's; forward_only its outputs."""
    world = dist.get_world_size()
    what = f"{schedule} p={world} m={microbatches}"
    for opt_name in ("sgd", "adam"):
        ref = make_model()
        pipe = build(schedule, microbatches, chunks=2)
        r = dist.get_rank()
        v_shape = schedule in ("zbv", "dualpipev")  # rank r: stages r and 2p-1-r; else r, r+p
        assert list(pipe.local_stages) == sorted({r, 2 * world - 1 - r} if v_shape else {r, r + world}), \
            (what, pipe.local_stages)
        ref_opt = make_optimizer(opt_name, ref.parameters())
        opt = make_optimizer(opt_name, pipe.parameters())
        ref_params: Dict[str, nn.Parameter] = dict(ref.named_parameters())
        for step in range(STEPS):
            # Batch sizes change between steps (and the last microbatch may be smaller).
            x, y = batch(n=2 * microbatches + step % 3, seed=10 + step)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            loss = pipe.step(x, y)
            assert abs(loss - ref_loss.item()) <= RTOL * max(1.0, abs(ref_loss.item())), \
                f"{what} {opt_name} step {step}: loss {loss} != {ref_loss.item()}"
            if step == 0:
                for name, p in pipe.named_parameters():
                    assert_close(p.grad, ref_params[name].grad, f"{what} grad of {name}")
            ref_opt.step(); ref_opt.zero_grad()
            opt.step(); opt.zero_grad()
        for name, p in pipe.named_parameters():
            assert_close(p.detach(), ref_params[name].detach(),
                         f"{what} {opt_name}: weight {name} after {STEPS} steps")
        pipe.eval()
        x, _ = batch(n=2 * microbatches + 1, seed=99)
        out = pipe.forward_only(x)
        if pipe.is_last:
            assert_close(out, ref(x).detach(), f"{what} forward_only")
        else:
            assert out is None
        pipe.close()


# --------------------------------------------------------------------------- torch.compile
def check_compiled_split_backward(schedule: str, microbatches: int) -> None:
    """A model compiled with ``torch.compile`` before ``PipeDream``: the split backward
    (I, then W from the same graph) runs each stage's compiled backward with the graph
    kept, which torch refuses for a backward compiled with donated buffers (a stage whose
    first backward is a full one compiles it so). Losses and weights after SGD-momentum
    steps equal the uncompiled unsplit model's; every stage ran compiled."""
    from test_user_code import counting_backend

    import pipedream_ext as pd

    calls: List[int] = []
    chunks = 1 if schedule == "zb-h1" else 2
    stages = dist.get_world_size() * chunks
    ref = make_model()
    pipe = pd.PipeDream(torch.compile(make_model(), backend=counting_backend(calls)),
                        F.cross_entropy, schedule=schedule, microbatches=microbatches,
                        chunks=chunks, balance=balance_for(stages) if chunks == 2 else None,
                        timeout=60)
    opt = make_optimizer("sgd", pipe.parameters())
    ref_opt = make_optimizer("sgd", ref.parameters())
    try:
        for step in range(3):
            # Other batch sizes each step: recompiled graphs (dynamic shapes), whose first
            # backward can be a full one (compiled with donated buffers before the fix).
            x, y = batch(n=8 + step, seed=10 + step)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            loss = float(pipe.step(x, y))
            assert abs(loss - ref_loss.item()) <= RTOL * max(1.0, abs(ref_loss.item())), \
                f"compiled {schedule} step {step}: loss {loss} != {ref_loss.item()}"
            ref_opt.step(); ref_opt.zero_grad()
            opt.step(); opt.zero_grad()
    finally:
        pipe.close()
        torch._dynamo.reset()
    assert len(calls) >= 3 * microbatches * chunks, f"{len(calls)} compiled calls"
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.detach(), ref_params[name].detach(), f"compiled {schedule}: weight {name}")


# --------------------------------------------------------------------------- checkpoints
def train(pipe, opt, steps: range) -> None:  # type: ignore[no-untyped-def]
    for t in steps:
        x, y = batch(n=8, seed=1000 + t)
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()


def save_state(pipe, path: str) -> None:  # type: ignore[no-untyped-def]
    """This rank's parameters, into a per-rank file (merged by the loading side)."""
    torch.save({k: v.detach().clone() for k, v in pipe.named_parameters()},
               f"{path}-rank{dist.get_rank()}.pt")


def merged(prefix: str) -> Dict[str, torch.Tensor]:
    state: Dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(f"{prefix}-rank*.pt")):
        state.update(torch.load(path, weights_only=True))
    assert state, f"no {prefix}-rank*.pt"
    return state


def save_zbv_checkpoint(root: str) -> None:
    """2 ranks: zbv, N steps, checkpoint, M more steps: the reference at N and N + M."""
    import pipedream_ext as pd

    pipe = build("zbv", microbatches=4, chunks=2)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    train(pipe, opt, range(N))
    pd.save_checkpoint(os.path.join(root, "ckpt"), pipe, opt, step=N)
    save_state(pipe, os.path.join(root, "at-n"))
    train(pipe, opt, range(N, N + M))
    save_state(pipe, os.path.join(root, "at-n-plus-m"))
    pipe.close()
    dist.barrier()


def check_resume(root: str, schedule: str, chunks: int, balance: Optional[List[int]]) -> None:
    """Another layout loads the zbv checkpoint (weights and Adam state by name) and,
    after M steps, holds the weights of the uninterrupted zbv run."""
    import pipedream_ext as pd

    what = f"zbv checkpoint -> {schedule} p={dist.get_world_size()} chunks={chunks}"
    pipe = pd.PipeDream(make_model(seed=7), F.cross_entropy, schedule=schedule, microbatches=4,
                        chunks=chunks, balance=balance, timeout=60)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    info = pd.load_checkpoint(os.path.join(root, "ckpt"), pipe, opt)
    assert info.step == N, what
    at_n = merged(os.path.join(root, "at-n"))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), at_n[name], rtol=0, atol=0,
                                   msg=lambda m: f"{what}: loaded {name}: {m}")
    train(pipe, opt, range(N, N + M))
    final = merged(os.path.join(root, "at-n-plus-m"))
    for name, p in pipe.named_parameters():
        assert_close(p.detach(), final[name], f"{what}: {name} after {M} more steps")
    pipe.close()


# --------------------------------------------------------------------------- worker
CASES: Dict[int, List[tuple]] = {
    # (schedule, microbatches): zbv also with m < 2p - 1 (and m < p), dualpipev from m = 2p.
    2: [("zbv", 4), ("zbv", 1), ("dualpipev", 4), ("dualpipev", 5), ("interleaved-zb", 2),
        ("interleaved-zb", 4)],
    4: [("zbv", 8), ("zbv", 3), ("dualpipev", 8), ("interleaved-zb", 4), ("interleaved-zb", 8)],
}


def zero_bubble_cases(world: int) -> Cases:
    cases = Cases()
    for schedule, m in CASES[world]:
        cases.add(check_matches_unsplit_model, schedule, m)
    root = os.environ.get("PDZB_DIR", "")  # the ranks'
    if world == 2:
        # Each compiled case is ~20 s of compiling on 2 cores: `make test` keeps one schedule
        # with one chunk per rank and one V schedule; `make test-all` adds the other two.
        compiled = [("zb-h1", 2), ("zbv", 4)]
        if os.environ.get("PIPEDREAM_TEST_ALL") == "1":
            compiled += [("interleaved-zb", 2), ("dualpipev", 4)]
        for schedule, m in compiled:
            cases.add(check_compiled_split_backward, schedule, m)
        cases.add(save_zbv_checkpoint, root, name="save_zbv_checkpoint")
        cases.add(check_resume, root, "1f1b", chunks=1, balance=[3, 6], name="resume-1f1b-[3,6]")
    else:
        cases.add(check_resume, root, "1f1b", chunks=1, balance=None, name="resume-1f1b")
        cases.add(check_resume, root, "zbv", chunks=2, balance=balance_for(8), name="resume-zbv")
    return cases


# --------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("zero_bubble"))


# `make test` runs both world sizes under NCCL's rules, `make test-all` on Gloo too; each
# backend's 4 ranks load the checkpoint its 2 ranks saved (a folder per backend).
TWO, TWO_GLOO = strict_and_gloo(HERE, 2, zero_bubble_cases)
FOUR, FOUR_GLOO = strict_and_gloo(HERE, 4, zero_bubble_cases)
SAVER = {FOUR.name: TWO, FOUR_GLOO.name: TWO_GLOO}


def _folder(root: str, launch: Launch) -> Dict[str, str]:
    folder = os.path.join(root, launch.backend)
    os.makedirs(folder, exist_ok=True)
    return {"PDZB_DIR": folder}


@parametrize_cases(TWO, TWO_GLOO)
def test_two_ranks_match_the_unsplit_model_and_save_a_v_checkpoint(case: CaseRef, checkpoint_dir: str) -> None:
    case.check(env=_folder(checkpoint_dir, case.launch))


@parametrize_cases(FOUR, FOUR_GLOO)
def test_four_ranks_match_the_unsplit_model_and_reshard_the_v_checkpoint(case: CaseRef,
                                                                         checkpoint_dir: str) -> None:
    saver = SAVER[case.launch.name]
    saver.result(env=_folder(checkpoint_dir, saver))  # the checkpoint first (run alone: pytest -k four)
    case.check(env=_folder(checkpoint_dir, case.launch))

if __name__ == "__main__":
    worker_main([TWO, TWO_GLOO, FOUR, FOUR_GLOO])
