"""Parameters shared by stages (a language model's head tied to its embedding).

Runs under pytest, which launches the worker side with torchrun, or standalone:

    torchrun --standalone --nproc-per-node 3 tests/test_shared_params.py

Every check trains the pipeline and the unsplit tied model side by side and
compares every step's loss and every weight after SGD-momentum and Adam steps,
so a missing or double-counted contribution to the tied gradient (a replica, a
stage on the same rank) shows up as a mismatch. One launch per world size.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, strict_and_gloo, worker_main

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
VOCAB, WIDTH, TOKENS = 11, 8, 5
STEPS = 3


# --------------------------------------------------------------------------- the model
class Flatten(nn.Module):
    """Logits of every token as rows: ``[batch, tokens, vocab] -> [batch * tokens, vocab]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, VOCAB)


def tied_lm(seed: int = 0) -> nn.Sequential:
    """6 layers: 0 Embedding, 1-2 blocks, 3 LayerNorm, 4 head (weight = 0.weight), 5 Flatten."""
    torch.manual_seed(seed)
    emb = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                         nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), nn.LayerNorm(WIDTH),
                         head, Flatten())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(seed: int, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, TOKENS), generator=g),
            torch.randint(0, VOCAB, (n, TOKENS), generator=g))


OPTIMIZERS: Dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def train_both(pipe, ref: nn.Sequential, opt, ref_opt, steps: int, first_seed: int,
               what: str) -> None:
    """``steps`` steps of the pipeline and the unsplit model; losses (and the first
    step's gradients) must agree."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(steps):
        x, y = batch(first_seed + step)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        assert abs(loss - ref_loss.item()) <= RTOL * max(1.0, abs(ref_loss.item())), \
            f"{what} step {step}: loss {loss} != {ref_loss.item()}"
        if step == 0:
            for name, p in pipe.named_parameters():
                assert_close(p.grad, ref_params[name].grad, f"{what} step 0 gradient of {name}")
        ref_opt.step(); ref_opt.zero_grad()
        opt.step(); opt.zero_grad()


def assert_weights_equal(pipe, ref: nn.Sequential, what: str) -> None:
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert_close(p.detach(), ref_params[name].detach(), f"{what}: weight {name}")


# --------------------------------------------------------------------------- worker checks
def check_matches_unsplit(schedule: str, balance: List[int], replicas: Optional[List[int]] = None,
                          microbatches: int = 4) -> None:
    """Losses and weights after STEPS SGD-momentum and STEPS Adam steps equal the unsplit model's."""
    import pipedream_ext as pd

    chunks = 2 if pd.schedules.traits(schedule).multi_chunk else 1
    what = f"{schedule} balance={balance} replicas={replicas}"
    for opt_name, make_opt in OPTIMIZERS.items():
        ref = tied_lm()
        pipe = pd.PipeDream(tied_lm(), lm_loss, schedule=schedule, microbatches=microbatches,
                            balance=balance, chunks=chunks, replicas=replicas, timeout=60)
        ends = torch.tensor(balance).cumsum(0).tolist()
        head_stage = next(j for j, end in enumerate(ends) if end > 4)
        assert [(sp.names, sp.stages) for sp in pipe.shared_parameters] == \
            [(("0.weight", "4.weight"), (0, head_stage))], what
        # Every rank holding the embedding or the head steps the tied weight itself.
        local_layers = {i for start, stop in pipe.stage_layers.values() for i in range(start, stop)}
        tied = [n for n, _ in pipe.named_parameters() if n in ("0.weight", "4.weight")]
        assert len(tied) == (1 if local_layers & {0, 4} else 0), (what, tied)
        opt, ref_opt = make_opt(pipe.parameters()), make_opt(ref.parameters())
        train_both(pipe, ref, opt, ref_opt, STEPS, 100, f"{what} {opt_name}")
        assert_weights_equal(pipe, ref, f"{what} after {STEPS} {opt_name} steps")
        # A rank holding one copy waits in the all-reduce summing the copies' gradients:
        # a wait in stats(); a rank holding both uses (or neither) runs none.
        stats = pipe.stats()
        waited = stats["seconds_by_kind"].get("TIED_ALLREDUCE")
        assert (waited is not None) == (len(local_layers & {0, 4}) == 1), (what, stats)
        assert waited is None or 0 < waited <= stats["wait_s"] <= stats["busy_s"], (what, stats)
        assert stats["bubble_fraction"] == pytest.approx(1 - stats["compute_s"] / stats["busy_s"]), stats


def check_meta_built(schedule: str, balance: List[int],
                     replicas: Optional[List[int]] = None) -> None:
    """A tied model built on the meta device: every copy of the tied weight starts
    from its first use's initialisation (pd.materialize's rule), then trains equal to
    the unsplit model materialised the same way."""
    import pipedream_ext as pd

    what = f"meta-built {schedule} balance={balance} replicas={replicas}"
    with torch.device("meta"):
        model, reference = tied_lm(), tied_lm()
    ref = pd.materialize(reference)
    pipe = pd.PipeDream(model, lm_loss, schedule=schedule, microbatches=4, balance=balance,
                        replicas=replicas, timeout=60)
    assert_weights_equal(pipe, ref, f"{what}: right after construction")
    opt, ref_opt = OPTIMIZERS["adam"](pipe.parameters()), OPTIMIZERS["adam"](ref.parameters())
    train_both(pipe, ref, opt, ref_opt, STEPS, 300, what)
    assert_weights_equal(pipe, ref, f"{what} after {STEPS} adam steps")


def check_asynchronous_refused() -> None:
    """docs/bad_input.md row ``shared-async``: refused at construction, naming the parameter."""
    from test_bad_input import ROWS

    import pipedream_ext as pd

    expected = next(r[2] for r in ROWS if r[0] == "shared-async")
    for schedule in ("pipedream", "pipedream-2bw"):
        with pytest.raises(ValueError) as info:
            pd.PipeDream(tied_lm(), lm_loss, schedule=schedule, microbatches=2, timeout=60)
        assert re.search(expected, str(info.value)), str(info.value)


def check_checkpoint(save_kwargs: dict, load_kwargs: dict, directory: str) -> None:
    """Save after 2 Adam steps, load into another layout, 2 more steps = 4 unsplit steps;
    consolidate loads into the unsplit tied model and leaves it tied."""
    import pipedream_ext as pd

    what = f"save {save_kwargs} -> load {load_kwargs}"
    ref = tied_lm()
    ref_opt = OPTIMIZERS["adam"](ref.parameters())
    pipe = pd.PipeDream(tied_lm(), lm_loss, microbatches=4, timeout=60, **save_kwargs)
    opt = OPTIMIZERS["adam"](pipe.parameters())
    train_both(pipe, ref, opt, ref_opt, 2, 200, what)
    pd.save_checkpoint(directory, pipe, opt, step=2)
    saved = {k: v.clone() for k, v in ref.state_dict().items()}

    resumed = pd.PipeDream(tied_lm(seed=7), lm_loss, microbatches=4, timeout=60, **load_kwargs)
    resumed_opt = OPTIMIZERS["adam"](resumed.parameters())
    pd.load_checkpoint(directory, resumed, resumed_opt)
    assert_weights_equal(resumed, ref, f"{what}: right after loading")
    train_both(resumed, ref, resumed_opt, ref_opt, 2, 202, f"{what} resumed")
    assert_weights_equal(resumed, ref, f"{what}: after 2 more steps")

    if dist.get_rank() == 0:
        state = pd.consolidate(directory)
        assert list(state) == list(saved), (list(state), list(saved))
        assert state["4.weight"] is state["0.weight"], "the tied tensor is held twice"
        model = tied_lm(seed=9)
        model.load_state_dict(state)
        assert model[4].weight is model[0].weight, "loading untied the model"
        for key, value in model.state_dict().items():
            assert_close(value, saved[key], f"{what}: consolidated {key}")
    dist.barrier()


def tied_lm_cases(world: int) -> Cases:
    cases = Cases()
    directory = os.environ.get("SHARED_PARAMS_DIR") or tempfile.gettempdir()  # the ranks': see the launches
    if world == 2:
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            cases.add(check_matches_unsplit, schedule, [2, 4])
        # Embedding and head on the same rank (stages 0 and 2), then on both ranks.
        cases.add(check_matches_unsplit, "interleaved-1f1b", [1, 2, 2, 1])
        cases.add(check_matches_unsplit, "interleaved-1f1b", [1, 2, 1, 2])
        cases.add(check_matches_unsplit, "zbv", [1, 1, 1, 3])  # the V: stages 0 and 3 on rank 0
        cases.add(check_asynchronous_refused)
        cases.add(check_meta_built, "1f1b", [2, 4])
        cases.add(check_checkpoint, dict(schedule="interleaved-1f1b", chunks=2, balance=[1, 2, 2, 1]),
                  dict(schedule="1f1b", balance=[3, 3]), os.path.join(directory, "ckpt2"),
                  name="checkpoint")
    elif world == 3:
        cases.add(check_matches_unsplit, "1f1b", [1, 3, 2])  # a middle stage between embedding and head
        cases.add(check_matches_unsplit, "gpipe", [1, 3, 2])
        for replicas in ([2, 1], [1, 2]):
            cases.add(check_matches_unsplit, "1f1b", [3, 3], replicas=replicas)
            cases.add(check_matches_unsplit, "gpipe", [3, 3], replicas=replicas)
        cases.add(check_meta_built, "gpipe", [3, 3], replicas=[1, 2])
        cases.add(check_checkpoint, dict(schedule="1f1b", balance=[3, 3], replicas=[2, 1]),
                  dict(schedule="zb-h1", balance=[1, 2, 3]), os.path.join(directory, "ckpt3"),
                  name="checkpoint")
    elif world == 4:
        cases.add(check_matches_unsplit, "1f1b", [1, 1, 2, 2])
        cases.add(check_matches_unsplit, "zb-h1", [1, 1, 2, 2])
        cases.add(check_matches_unsplit, "1f1b", [1, 2, 3], replicas=[1, 1, 2])
        cases.add(check_matches_unsplit, "gpipe", [1, 2, 3], replicas=[2, 1, 1])
    return cases


# --------------------------------------------------------------------------- pytest side
# `make test` runs the 3-rank case (a middle stage, replicas [2, 1] and [1, 2]) on the
# nccl_rules backend; `make test-all` on Gloo too, and 4 ranks (middle stages and
# replicas again, another size).
LAUNCHES = [Launch(HERE, 2, tied_lm_cases, dirs=("SHARED_PARAMS_DIR",)),
            *strict_and_gloo(HERE, 3, tied_lm_cases, dirs=("SHARED_PARAMS_DIR",)),
            Launch(HERE, 4, tied_lm_cases, dirs=("SHARED_PARAMS_DIR",), marks=(pytest.mark.slow,))]


@parametrize_cases(*LAUNCHES)
def test_tied_lm_matches_the_unsplit_model(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main(LAUNCHES)
