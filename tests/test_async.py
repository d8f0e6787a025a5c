"""Asynchronous schedules (pipedream, vertical sync, pipedream-2bw) against a
sequential single-process simulation of the same weight-version rule.

The simulation below is written independently of the runtime: it keeps every
weight version of every stage, runs each minibatch through the stages with the
version the rule names, and applies each stage's optimizer in minibatch order.

Runs under pytest (which launches torchrun) or directly:

    torchrun --standalone --nproc-per-node 3 tests/test_async.py
"""
from __future__ import annotations

import collections
import copy
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import BACKEND_ENV, CaseRef, Cases, Launch, parametrize_cases, strict_and_gloo, worker_main
from torch import nn
from torch.func import functional_call

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(),
                         nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))


def minibatch(b: int, n: int = 8):
    g = torch.Generator().manual_seed(100 + b)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def even_balance(layers: int, stages: int) -> List[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if j < extra else 0) for j in range(stages)]


def split_stages(model: nn.Sequential, balance: Sequence[int]) -> List[nn.Sequential]:
    children = list(model.named_children())
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(collections.OrderedDict(children[start:start + count])))
        start += count
    return stages


def simulate(rule: Callable[[int, int, int], int], p: int, streams: Sequence[int],
             make_opt: Callable, microbatches_per_step: int = 1, replicas: Sequence[int] = (),
             clip: Optional[Tuple[float, float]] = None,
             ) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """Sequential reference. ``rule(stage, b, p)`` is the version stage reads for step b
    (of its stream); every step's gradient produces the next version of every stage, or,
    for a stage with r replicas, every r steps the average of their r gradients (replica
    b mod r runs step b; all replicas apply the same averaged update). ``clip=(max_norm,
    norm_type)``: before the updates, torch's ``clip_grad_norm_`` over every updating
    stage's gradients (every stage updates together: clipping needs equal replica counts).

    Returns the final weights (original names) and the loss of every step.
    """
    model = copy.deepcopy(make_model())
    replicas = list(replicas) or [1] * p
    stages = split_stages(model, even_balance(len(model), p))
    opts = [make_opt(st.parameters()) for st in stages]
    losses: List[float] = []
    step = clipped = 0
    for length in streams:
        history = [[{n: t.detach().clone() for n, t in st.named_parameters()}] for st in stages]
        for b in range(length):
            x, y = minibatch(step, 8 * microbatches_per_step)
            versions = []
            h = x
            for s, st in enumerate(stages):
                params = {n: t.clone().requires_grad_() for n, t in history[s][rule(s, b, p)].items()}
                versions.append(params)
                h = functional_call(st, params, (h,))
            loss = F.cross_entropy(h, y)
            loss.backward()
            losses.append(loss.item())
            for s, st in enumerate(stages):
                for n, t in st.named_parameters():
                    g = versions[s][n].grad / replicas[s]
                    t.grad = g.clone() if t.grad is None else t.grad + g
            updating = [s for s in range(p) if (b + 1) % replicas[s] == 0]  # rounds complete
            if clip is not None and updating:
                assert len(updating) == p, "clipping needs every stage to update together"
                clipped += bool(torch.nn.utils.clip_grad_norm_(model.parameters(), *clip) > clip[0])
            for s, st in enumerate(stages):
                if s in updating:
                    opts[s].step()
                    opts[s].zero_grad()
                    history[s].append({n: t.detach().clone() for n, t in st.named_parameters()})
            step += 1
    assert clip is None or clipped >= step // 2, f"max_norm {clip} clipped only {clipped} of {step} updates"
    return {n: t.detach() for n, t in model.named_parameters()}, losses


def replicated_rule(replicas: Sequence[int]) -> Callable[[int, int, int], int]:
    """pipedream with replicas: replica b mod r of stage s runs minibatch b as its local
    position b // r, after max(0, b // r - NOAM_s + 1) updates (NOAM_s = ceil(ranks in
    stages s.. / r_s))."""
    def rule(s: int, b: int, p: int) -> int:
        noam = -(-sum(replicas[s:]) // replicas[s])
        return max(0, b // replicas[s] - noam + 1)
    return rule


RULES = {
    "pipedream": lambda s, b, p: max(0, b - (p - 1 - s)),
    "vertical": lambda s, b, p: max(0, b - (p - 1)),
    "pipedream-2bw": lambda s, t, p: max(0, t - 1),
}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def check(kind: str, opt_name: str, streams: Sequence[int] = (10, 4), recompute: bool = False,
          replicas: Sequence[int] = (), clip: Optional[Tuple[float, float]] = None) -> None:
    import pipedream_ext as pd

    p = len(replicas) if replicas else dist.get_world_size()
    m = 4 if kind == "pipedream-2bw" else 1
    schedule = "pipedream-2bw" if kind == "pipedream-2bw" else "pipedream"
    # 2bw: batches of m = 4 microbatches of 8; pipedream: microbatches only split forward_only.
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule=schedule, microbatches=max(m, 2),
                        vertical_sync=kind == "vertical", timeout=60, recompute=recompute,
                        replicas=list(replicas) or None, clip_grad_norm=clip)
    opt = OPTIMIZERS[opt_name](pipe.parameters())
    rule = replicated_rule(replicas) if replicas and kind == "pipedream" else RULES[kind]
    expected, expected_losses = simulate(rule, p, streams, OPTIMIZERS[opt_name],
                                         microbatches_per_step=m, replicas=replicas if kind == "pipedream" else (),
                                         clip=clip)
    step = 0
    for length in streams:
        for _ in range(length):
            x, y = minibatch(step, 8 * m)
            loss = pipe.step(x, y, optimizer=opt)
            runs_it = pipe.is_last and (
                not replicas or kind == "pipedream-2bw"
                or step % replicas[-1] == pipe._schedule.stage_ranks(p - 1).index(pipe.rank))
            if runs_it:
                assert loss == pytest.approx(expected_losses[step], rel=1e-5), \
                    f"{kind} {opt_name} p={p} step {step}: loss {loss} != {expected_losses[step]}"
            else:
                assert loss is None
            step += 1
        pipe.flush()
        # Peak weight versions measured in the runtime = the schedule engine's prediction
        # (p - s for a long enough pipedream stream, 2 for 2bw).
        stage = pipe.stage_index
        predicted = pd.schedules.build(schedule, stages=p, microbatches=m if m > 1 else length,
                                       batches=length if m > 1 else 1, replicas=list(replicas) or None,
                                       vertical_sync=kind == "vertical").simulate()
        assert pipe.peak_weight_versions[stage] == predicted.peak_weight_versions[stage], \
            (kind, length, pipe.peak_weight_versions, predicted.peak_weight_versions)
        if kind == "pipedream" and not replicas and length >= 2 * p:
            assert pipe.peak_weight_versions[stage] == p - stage
        if kind == "pipedream-2bw" and length >= 2:
            assert pipe.peak_weight_versions[stage] == 2
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda msg: f"{kind} {opt_name} p={p} {name}: {msg}")
    # Evaluation after the flush runs on the final weights (on the stage leaders).
    x, _ = minibatch(999, 8)
    out = pipe.forward_only(x)
    if pipe.is_last and pipe.rank == pipe.last_rank:
        reference = make_model()
        reference.load_state_dict(expected)
        torch.testing.assert_close(out, reference(x).detach(), rtol=RTOL, atol=ATOL)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_long_run(steps: int = 1000) -> None:
    """1000 minibatches: memory held per rank does not grow (stash, versions, RSS)."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="pipedream", timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = minibatch(0)
    rss = {}
    for step in range(steps):
        pipe.step(x, y, optimizer=opt)
        if step + 1 in (200, steps):
            rss[step + 1] = _rss_bytes()
    pipe.flush()
    p, stage = dist.get_world_size(), pipe.stage_index
    assert pipe.peak_weight_versions[stage] == p - stage
    assert len(pipe._runner.targets) == 0
    # Copy on update: the last stage runs F and B back to back, so its weights are
    # never copied; other stages copy at most once per update.
    stats = pipe.stats()
    stage_bytes = sum(q.numel() * q.element_size() for q in pipe.parameters())
    if stage == p - 1:
        assert stats["weight_bytes_copied"] == 0, stats
    else:
        assert 0 < stats["weight_bytes_copied"] <= steps * stage_bytes, (stats, stage_bytes)
    assert 0 < stats["compute_s"] <= stats["busy_s"] and 0 <= stats["bubble_fraction"] < 1, stats
    growth = rss[steps] - rss[200]
    # Anything that grew per step (stashes, handles, targets, snapshots) would show up
    # as hundreds of KB over 800 steps; allow 2 MiB of allocator noise.
    assert growth < 2 * 1024 * 1024, f"RSS grew by {growth / 1024:.0f} KiB from step 200 to {steps}"


def check_clipping() -> None:
    """clip_grad_norm= (pipedream-2bw): every update's gradients clipped by the whole
    model's norm (every update clips). `make test` runs 2 ranks on Gloo and one layout
    each on 3 and 4 ranks under nccl_rules (the norm's all-reduce inside the update,
    between in-order pair streams); `make test-all` every layout on Gloo."""
    world = dist.get_world_size()
    strict = os.environ.get(BACKEND_ENV, "gloo") == "nccl_rules"
    if world == 2:
        check("pipedream-2bw", "sgd", clip=(0.05, 2.0))
        check("pipedream-2bw", "adam", clip=(0.02, float("inf")), recompute=True)
        return
    layouts = {3: [[2, 1], [1, 2]], 4: [[2, 1, 1], [1, 1, 2], [2, 2]]}[world]
    for layout in layouts[:1] if strict else layouts:
        check("pipedream-2bw", "adam", replicas=layout, clip=(0.05, 2.0))
    if not strict:
        check("pipedream-2bw", "sgd", clip=(0.05, 3.0))


def async_cases(world: int) -> Cases:
    cases = Cases()
    if world == 2:
        cases.add(check_long_run)
    for kind in ("pipedream", "vertical", "pipedream-2bw"):
        for opt_name in ("sgd", "adam"):
            cases.add(check, kind, opt_name)
    cases.add(check_clipping)
    # Recomputed activations give the same weights as stashed ones.
    cases.add(check, "pipedream", "adam", recompute=True)
    cases.add(check, "pipedream-2bw", "sgd", recompute=True)
    # Replicated stages (hybrid pipeline and data parallelism).
    for layout in {3: [[2, 1], [1, 2]], 4: [[2, 1, 1], [1, 1, 2], [2, 2]]}.get(world, []):
        cases.add(check, "pipedream", "sgd", replicas=layout)
        cases.add(check, "pipedream", "adam", replicas=layout)
        cases.add(check, "pipedream-2bw", "sgd", replicas=layout)
    return cases


# `make test` runs 3 and 4 ranks on the stricter nccl_rules backend (streams use the split
# protocol on every backend); `make test-all` on Gloo too.
LAUNCHES = [Launch(HERE, 2, async_cases), *strict_and_gloo(HERE, 3, async_cases),
            *strict_and_gloo(HERE, 4, async_cases)]


@parametrize_cases(*LAUNCHES)
def test_asynchronous_schedules_match_the_sequential_simulation(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main(LAUNCHES)
