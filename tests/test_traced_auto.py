"""``balance="auto"`` and plans for traced models: profile the fx graph, plan, run the plan.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PDTRACE_DIR=/tmp/t torchrun --standalone --nproc-per-node 3 tests/test_traced_auto.py

The models are test_traced.py's: a ResNet-style CNN (BatchNorm in train mode, residual
adds, ``torch.flatten``) and a U-Net whose skip connection crosses several stages. Rank
0 profiles the traced graph (groups of fx nodes, real edges), plans, and every rank
runs the plan's stages. Whatever plan the (timing-dependent) planner chooses, every
step's loss and every parameter after SGD-momentum and Adam steps equal the unsplit
model's, and each rank's stage holds exactly the modules and parameters of the plan's
nodes for it. ``gpipe`` and ``1f1b`` may be planned as replicated stages (on this
tiny model the planner often picks data parallelism), so a straight plan of the same
profile is also run (``balance=Plan`` and a ``plan.json``), and a U-Net plan of a
profile with equal times per node (deterministic) whose skip crosses two cuts. A
planned pipeline's checkpoint consolidates into the unmodified model.
``interleaved-1f1b`` needs ``world x chunks`` stages, which the planner does not plan
(it plans one stage per worker or replicated stages): a plan with chunks is refused.
"""
from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Set, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, FromEnv, Launch, parametrize_cases, worker_main
from test_traced import (
    MICROBATCHES,
    MODELS,
    make_batch,
    make_model,
    optimizers,
    reference_step,
)

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
BANDWIDTH = [1e9]  # fixed bytes/s, so plans differ only by the measured times


def expected_stages(kind: str, plan: Any) -> List[Tuple[Set[str], Set[str]]]:
    """For each plan stage: the called modules and the parameter names of its nodes,
    from a fresh trace of the model (what the plan's profile nodes are)."""
    from pipedream_ext._planning.graph_profile import trace_groups

    sample, _ = make_batch(kind, 8, 99)
    grouped = trace_groups(make_model(kind), sample if isinstance(sample, tuple) else (sample,))
    by_id = {g.id: g for g in grouped.groups}
    out = []
    for stage in plan.stages:
        groups = [by_id[n] for n in stage.nodes if n in by_id]
        out.append(({str(n.target) for g in groups for n in g.nodes if n.op == "call_module"},
                    {p for g in groups for p in g.parameters}))
    return out


def check_plan_runs(pipe: Any, kind: str) -> None:
    """The plan is the same on every rank and this rank runs exactly its stage's nodes."""
    plan = pipe.plan
    assert plan is not None
    texts: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, plan.to_json(indent=None))
    assert len(set(texts)) == 1, "ranks got different plans"
    assert pipe.num_stages == len(plan.stages) and pipe.replicas == plan.replicas, \
        (pipe.num_stages, pipe.replicas, plan.replicas)
    assert dist.get_rank() in plan.stages[pipe.stage_index].ranks
    modules, params = expected_stages(kind, plan)[pipe.stage_index]
    stage = pipe.traced.stages[pipe.stage_index]
    running = {str(n.target) for n in stage.graph.nodes if n.op == "call_module"}
    assert running == modules, (pipe.stage_index, sorted(running ^ modules))
    names = {n for n, _ in pipe.named_parameters()}
    assert names == params, (pipe.stage_index, sorted(names ^ params))


def assert_same_as_reference(pipe: Any, ref: nn.Module, what: str) -> None:
    """Every parameter; buffers (BatchNorm statistics) too unless this rank's stage is
    replicated (each replica updates them with its own microbatches only)."""
    expected = ref.state_dict()
    params = {n for n, _ in pipe.named_parameters()}
    replicated = pipe.replicas[pipe.stage_index] > 1
    state = pipe.state_dict()
    assert state, what
    for name, value in state.items():
        if replicated and name not in params:
            continue
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


def run_and_compare(kind: str, schedule: str, balance: Any, **kwargs: Any) -> Tuple[Any, nn.Module]:
    """Two SGD-momentum then two Adam steps of the pipeline and the unsplit model
    (both returned)."""
    import pipedream_ext as pd

    loss_fn = MODELS[kind][1]
    pipe = pd.PipeDream(make_model(kind), loss_fn, schedule=schedule, microbatches=MICROBATCHES,
                        timeout=60, balance=balance, sample=make_batch(kind, 8, 99), **kwargs)
    check_plan_runs(pipe, kind)
    ref = make_model(kind)
    step = 0
    for ref_opt, opt in zip(optimizers(list(ref.parameters())),
                            optimizers(list(pipe.parameters()))):
        for _ in range(2):
            x, y = make_batch(kind, 8 + step % 2, 10 + step)
            expected = reference_step(kind, ref, x, y)
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            assert abs(loss - expected) <= RTOL * max(1.0, abs(expected)), \
                f"{kind} {schedule} step {step}: loss {loss} != {expected} (plan {pipe.plan.table()})"
            ref_opt.step(); ref_opt.zero_grad()
            opt.step(); opt.zero_grad()
            step += 1
    assert_same_as_reference(pipe, ref, f"{kind} {schedule} after {step} steps")
    return pipe, ref


def broadcast_plan(make: Any) -> Any:
    """``make()`` on rank 0 (profiling and planning), the same Plan on every rank."""
    import pipedream_ext as pd

    box = [make().to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return pd.Plan.from_json(box[0])


def straight_plan(kind: str) -> Any:
    """A plan with one stage per rank from the model's measured graph profile."""
    import pipedream_ext as pd

    x, y = make_batch(kind, 8, 99)
    return pd.plan(pd.profile(make_model(kind), x, loss_fn=MODELS[kind][1], target=y,
                              steps=3, warmup=1),
                   workers=dist.get_world_size(), bandwidth=BANDWIDTH, straight=True)


def uniform_plan(kind: str) -> Any:
    """A straight plan of the model's graph profile with 1 ms per node (deterministic)."""
    import pipedream_ext as pd

    x, y = make_batch(kind, 8, 99)
    measured = pd.profile(make_model(kind), x, loss_fn=MODELS[kind][1], target=y, steps=1,
                          warmup=0)
    graph = pd.ProfileGraph()
    for n in measured.nodes():
        timed = 0.0 if n["description"].startswith("Input") else 1.0
        graph.add_node(n["id"], n["description"], timed, timed, n["activation_bytes"],
                       n["parameter_bytes"])
    for a, b in measured.edges():
        graph.add_edge(a, b)
    return pd.plan(graph, workers=dist.get_world_size(), bandwidth=BANDWIDTH, straight=True)


def check_auto_balance(schedule: str) -> None:
    """balance="auto": rank 0 profiles the traced ResNet and plans for the schedule."""
    world = dist.get_world_size()
    pipe, _ = run_and_compare("resnet", schedule, "auto", bandwidth=None if schedule == "1f1b" else BANDWIDTH)
    if schedule == "zb-h1":  # straight (the schedule's planner assumption)
        assert pipe.num_stages == world and pipe.replicas == [1] * world, pipe.plan.table()


def check_straight_plan_and_its_checkpoint(root: str) -> None:
    """A straight plan of the same kind of profile, as a Plan and as a plan.json file."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    os.makedirs(root, exist_ok=True)
    plan = broadcast_plan(lambda: straight_plan("resnet"))
    assert len(plan.stages) == world and not plan.chain
    path = os.path.join(root, f"resnet-plan-{world}.json")
    if dist.get_rank() == 0:
        plan.save(path)
    dist.barrier()
    pipe, ref = run_and_compare("resnet", "1f1b", plan)
    run_and_compare("resnet", "gpipe", path)
    # Its checkpoint holds the whole model under the original names.
    ckpt = os.path.join(root, f"resnet-ckpt-{world}")
    pd.save_checkpoint(ckpt, pipe, step=4)
    if dist.get_rank() == 0:
        whole = make_model("resnet")
        whole.load_state_dict(pd.consolidate(ckpt), strict=True)
        for name, value in whole.state_dict().items():
            torch.testing.assert_close(value, ref.state_dict()[name], rtol=RTOL, atol=ATOL)


def check_unet_plans() -> None:
    """U-Net: the planner's own choice, then a deterministic plan whose skip crosses two cuts."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    run_and_compare("unet", "1f1b", "auto", bandwidth=BANDWIDTH)
    plan = broadcast_plan(lambda: uniform_plan("unet"))
    pipe, _ = run_and_compare("unet", "1f1b", plan)
    crossings = sum("enc1_2" in live for live in pipe.traced.live)  # enc1's output, cat's input
    assert crossings == min(2, world - 1), (crossings, pipe.traced.live, plan.table())
    # A plan sets the stages itself: interleaved chunks are refused on every rank.
    with pytest.raises(ValueError, match="a plan sets balance and replicas itself"):
        pd.PipeDream(make_model("resnet"), F.cross_entropy, schedule="interleaved-1f1b",
                     chunks=2, balance=plan, sample=make_batch("resnet", 8, 99))


def traced_auto_cases(world: int) -> Cases:
    cases = Cases()
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        cases.add(check_auto_balance, schedule)
    cases.add(check_straight_plan_and_its_checkpoint,
              FromEnv("PDTRACE_DIR", f"/tmp/pdtrace-auto-{os.environ.get('MASTER_PORT', 'x')}"))
    cases.add(check_unet_plans)
    return cases


# The same cases on every world size; 3 ranks adds none 2 and 4 lack: `make test-all` runs it.
LAUNCHES = [Launch(HERE, world, traced_auto_cases, dirs=("PDTRACE_DIR",),
                   marks=(pytest.mark.slow,) if world == 3 else ()) for world in (2, 3, 4)]


# --------------------------------------------------------------------------- pytest side
@parametrize_cases(*LAUNCHES)
def test_auto_balance_of_traced_models_matches_the_unsplit_model(case: CaseRef) -> None:
    """balance="auto" and graph-profile plans on the traced ResNet and U-Net: every
    flush schedule exact, the plan's stages are what runs."""
    case.check()

if __name__ == "__main__":
    worker_main(LAUNCHES)
