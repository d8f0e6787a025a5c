"""Checkpoints of pipelines with tensor parallelism (``PipeDream(tensor_parallel=...)``).

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=4ranks PDTP_DIR=/tmp/x torchrun --standalone --nproc-per-node 4 \\
        tests/test_tp_checkpoint.py

test_tensor_parallel.py's Llama on 4 ranks (Gloo), AdamW:

* ``resume-across-shapes``: pp2 x tp2 trains 2 steps and saves (``format="dcp"``,
  asynchronously) while it trains 2 more; the checkpoint loads into a fresh pp2 x tp2
  (bit-identical weights, then losses and weights equal to the uninterrupted run bit for
  bit), into pp2 x dp2 with FSDP and no tp, and into pp1 x dp2 x tp2 with FSDP over TP
  (2-D DTensors) and with replicate (bit-identical weights, then equal to the unsplit
  model trained the same steps, to 1e-4 as tp changes the summation order); each of
  these three saves in turn, and its checkpoint loads back into pp2 x tp2 and trains on
  equal to the unsplit model; ``pd.consolidate`` of each checkpoint gives the saved
  weights; a save left pending is finished by ``close()``; ``format="pipedream"`` is
  refused both ways, naming ``format='dcp'``.
* ``load-state-dict``: ``pipe.load_state_dict(model.state_dict())`` into pp2 x tp2, pp1 x
  dp2 x tp2 (FSDP over TP) and pp2 x dp2 (FSDP): each rank takes its shards, the gathered
  weights equal the state dict's bit for bit, and training on equals the unsplit model.
* ``load-differing-copies``: a state dict that would leave copies of one tensor different
  (a replicated norm weight per tp rank, plain or a ``Replicate()`` DTensor; the two names
  of a tied weight) fails on every rank and loads nothing.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, FromEnv, Launch, parametrize_cases, worker_main
from test_tensor_parallel import BALANCE, ROWS, batch, full, llama, lm_loss, mesh_of, plan

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-4, 1e-5
SAVED_AT = 2  # AdamW steps before the save
Weights = Dict[str, torch.Tensor]
Shape = Tuple[int, int, int]  # (pp, dp, tp)


def build(shape: Shape, data_parallel: str, seed: int) -> Tuple[Any, torch.optim.Optimizer, int, int]:
    """test_tensor_parallel.py's Llama on a (pp, dp, tp) mesh (tp 1: a ("pp", "dp") mesh
    without tensor_parallel), with AdamW; returns the pipeline, its optimizer, this rank's
    dp rank and the dp size."""
    import pipedream_ext as pd

    pp, dp, tp = shape
    mesh = mesh_of(shape) if tp > 1 else mesh_of((pp, dp), ("pp", "dp"))
    pipe = pd.PipeDream(llama(seed), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh,
                        data_parallel=data_parallel, timeout=60,
                        balance=BALANCE if pp > 1 else None,
                        tensor_parallel=plan() if tp > 1 else None)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, eps=1e-4)
    return pipe, opt, mesh["dp"].get_local_rank(), dp


def train(built: Tuple[Any, torch.optim.Optimizer, int, int], steps: range) -> List[float]:
    """Each dp rank trains on its rows of the global batches ``batch(100 + t)``."""
    pipe, opt, dp_rank, dp = built
    rows, losses = ROWS // dp, []
    for t in steps:
        x, y = batch(100 + t)
        part = slice(dp_rank * rows, (dp_rank + 1) * rows)
        losses.append(float(pipe.step(x[part], y[part])))
        opt.step()
        opt.zero_grad()
    return losses


def unsplit(steps: int) -> Tuple[List[Weights], List[float]]:
    """The unsplit model trained ``steps`` steps on the same batches: its weights before
    each step and after the last, and each step's loss."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-4)
    weights, losses = [], []
    for t in range(steps):
        weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
        x, y = batch(100 + t)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return weights, losses


def weights(pipe: Any) -> Weights:
    """Every parameter of the whole model, gathered (collective over the world)."""
    mine = {name: full(p.detach()).clone() for name, p in pipe.named_parameters()}
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def same(actual: Weights, expected: Weights, what: str, exact: bool = False) -> None:
    assert set(actual) == set(expected), (what, sorted(actual), sorted(expected))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0 if exact else RTOL,
                                   atol=0 if exact else ATOL, msg=lambda m, key=key: f"{what}: {key}: {m}")


def same_losses(actual: List[float], expected: List[float], what: str, exact: bool = False) -> None:
    torch.testing.assert_close(actual, expected, rtol=0 if exact else RTOL, atol=0 if exact else ATOL,
                               msg=lambda m: f"{what} losses: {m}")


def check_resume_across_shapes(root: str) -> None:
    """pp2 x tp2 saved (async, while training on) -> pp2 x tp2, pp2 x dp2 (FSDP), pp1 x dp2
    x tp2 (FSDP over TP, and replicate); each of their checkpoints (FSDP over TP: 2-D
    DTensors; replicate: dp rank 0's tp ranks write) back into pp2 x tp2; each
    checkpoint consolidated; the pipedream format refused both ways."""
    from test_bad_input import ROWS as BAD_ROWS

    import pipedream_ext as pd

    ref, ref_losses = unsplit(2 * SAVED_AT + 1)
    path = os.path.join(root, "pp2-tp2")
    saving = build((2, 1, 2), "replicate", seed=0)
    train(saving, range(SAVED_AT))
    at_save = weights(saving[0])
    same(at_save, ref[SAVED_AT], "pp2 x tp2 before the save")
    with pytest.raises(ValueError, match=next(r[2] for r in BAD_ROWS if r[0] == "tp-checkpoint")):
        pd.save_checkpoint(path + "-pipedream", saving[0], saving[1])
    plain = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, balance=[2, 1, 1, 1],
                         timeout=60)  # no mesh: 4 stages
    pd.save_checkpoint(path + "-plain", plain)
    plain.close()
    with pytest.raises(ValueError, match=r"load_checkpoint\(\) of a format='pipedream' checkpoint .* "
                                         r"each tp rank holds shards of its stage .*format='dcp'"):
        pd.load_checkpoint(path + "-plain", saving[0])
    pending = pd.save_checkpoint(path, saving[0], saving[1], step=SAVED_AT, format="dcp",
                                 async_save=True)
    losses = train(saving, range(SAVED_AT, 2 * SAVED_AT))
    assert pending.result().step == SAVED_AT
    after = weights(saving[0])
    saving[0].close()
    if dist.get_rank() == 0:
        same(dict(pd.consolidate(path)), at_save, "consolidate", exact=True)
    later, back = range(SAVED_AT, 2 * SAVED_AT), {}
    for shape, mode in (((2, 1, 2), "replicate"), ((2, 2, 1), "fsdp"), ((1, 2, 2), "fsdp"),
                        ((1, 2, 2), "replicate")):
        what = f"pp2 x tp2 -> {'x'.join(map(str, shape))} {mode}"
        fresh = build(shape, mode, seed=7)
        info = pd.load_checkpoint(path, fresh[0], fresh[1])
        assert info.step == SAVED_AT, info
        same(weights(fresh[0]), at_save, f"{what} loaded", exact=True)
        resumed = train(fresh, later)
        exact = shape == (2, 1, 2)  # the same layout: the uninterrupted run, bit for bit
        same_losses(resumed, losses if exact else ref_losses[SAVED_AT:2 * SAVED_AT], what, exact)
        same(weights(fresh[0]), after if exact else ref[2 * SAVED_AT], f"{what} resumed", exact)
        if shape != (2, 1, 2):  # each saves in turn, and goes back into pp2 x tp2
            where = f"{path}-{'x'.join(map(str, shape))}"
            pd.save_checkpoint(where, fresh[0], fresh[1], step=2 * SAVED_AT, format="dcp")
            back[what] = (where, weights(fresh[0]))
        fresh[0].close()
    built = build((2, 1, 2), "replicate", seed=9)  # one pipeline: each load replaces everything
    for what, (where, saved) in back.items():  # and back into pp2 x tp2
        what = f"{what} -> pp2 x tp2"
        pd.load_checkpoint(where, built[0], built[1])
        same(weights(built[0]), saved, f"{what} loaded", exact=True)
        if dist.get_rank() == 0:
            same(dict(pd.consolidate(where)), saved, f"{what}: consolidate", exact=True)
        resumed = train(built, range(2 * SAVED_AT, 2 * SAVED_AT + 1))
        same_losses(resumed, ref_losses[2 * SAVED_AT:], what)
        same(weights(built[0]), ref[-1], f"{what} resumed")
    built_after = weights(built[0])
    pd.save_checkpoint(path + "-closed", built[0], built[1], format="dcp", async_save=True)
    built[0].close()  # finishes the pending save: its manifest
    if dist.get_rank() == 0:
        same(dict(pd.consolidate(path + "-closed")), built_after, "saved by close()", exact=True)


def check_load_state_dict() -> None:
    """A full state dict into pp2 x tp2, pp1 x dp2 x tp2 (FSDP over TP) and pp2 x dp2
    (FSDP): bit-identical gathered weights, then training equal to the unsplit model."""
    model = llama(0)
    ref, ref_losses = unsplit(SAVED_AT)
    for shape, mode in (((2, 1, 2), "replicate"), ((1, 2, 2), "fsdp"), ((2, 2, 1), "fsdp")):
        what = f"load_state_dict into {'x'.join(map(str, shape))} {mode}"
        built = build(shape, mode, seed=7)
        result = built[0].load_state_dict(model.state_dict())
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == [], result
        same(weights(built[0]), dict(model.named_parameters()), what, exact=True)
        same_losses(train(built, range(SAVED_AT)), ref_losses, what)
        same(weights(built[0]), ref[SAVED_AT], f"{what}, trained")
        built[0].close()


def check_load_refuses_differing_copies() -> None:
    """A load that would leave copies of one tensor different fails on every rank before
    anything changes: a state dict whose replicated norm weight differs on one tp rank (a
    plain tensor with plan(), a Replicate() DTensor with sequence parallelism), or whose
    two names of the tied embedding/head weight hold different values."""
    from test_bad_input import ROWS
    from test_tp_compose import tied, tied_plan
    from test_tp_sequence import sp_plan

    import pipedream_ext as pd

    row = next(r[2] for r in ROWS if r[0] == "load-copies")
    tp_rank = dist.get_rank() % 2  # pp2 x tp2: ranks 1 and 3 are tp rank 1
    for make, tp_plan, name, what in (
            (llama, plan, "1.attn_norm.weight", "replicated over tp"),
            (llama, sp_plan, "3.weight", "a Replicate() DTensor (SequenceParallel)"),
            (lambda seed=0: tied(llama(seed)), tied_plan, "4.weight", "tied")):
        pipe = pd.PipeDream(make(), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                            balance=BALANCE, timeout=60, tensor_parallel=tp_plan())
        before = weights(pipe)
        state = dict(make(3).state_dict())
        if what == "tied" or tp_rank == 1:
            state[name] = state[name] + 1.0
        with pytest.raises(ValueError, match=row) as info:
            pipe.load_state_dict(state)
        text = str(info.value)
        assert f"'{'0.weight' if what == 'tied' else name}'" in text and f"'{name}' on rank" in text, \
            (what, text)
        same(weights(pipe), before, f"{what}: nothing loaded", exact=True)
        expected = make(3).state_dict()
        pipe.load_state_dict(dict(expected))  # equal copies: loads
        loaded = weights(pipe)
        same(loaded, {k: expected[k] for k in loaded}, f"{what}: loaded", exact=True)
        pipe.close()


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_resume_across_shapes, FromEnv("PDTP_DIR"), name="resume-across-shapes")
    c.add(check_load_state_dict, name="load-state-dict")
    c.add(check_load_refuses_differing_copies, name="load-differing-copies")
    return c


LAUNCH = Launch(HERE, 4, cases, timeout=300, dirs=("PDTP_DIR",))


@parametrize_cases(LAUNCH)
def test_tensor_parallel_checkpoints(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH])
