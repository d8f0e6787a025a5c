"""The planner into a tensor-parallel pipeline: ``balance="auto"`` and saved plans on a
``("pp", "dp", "tp")`` mesh.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=4ranks torchrun --standalone --nproc-per-node 4 tests/test_tp_planning.py

On pp2 x tp2 (4 ranks, Gloo) the tiny Llama of tests/test_tensor_parallel.py trains
exactly like the unsplit model (loss of every step, every step-0 gradient, every weight
after 3 AdamW steps, 1e-4 relative) with ``balance="auto"`` (rank 0 profiles and plans
with ``tensor_parallel=2``; on a ``("pp", "dp", "tp")`` and a ``("pp", "tp")`` mesh) and
with a plan.json written by ``python -m pipedream_ext plan --tensor-parallel 2`` (whose
balance, [1, 4], is neither the tests' [2, 3] nor an even split). A plan made for
another tp size than the mesh's is refused by name on every rank.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, parametrize_cases, strict_and_gloo, worker_main
from test_tensor_parallel import BALANCE, batch, check_training, llama, lm_loss, mesh_of, plan

HERE = os.path.abspath(__file__)


def _profile() -> "object":
    """A profile of llama()'s 5 layers whose best tp-2 split over 2 stages is [1, 4]: the
    embedding costs as much as the other four layers together (3 s forward + backward)."""
    import pipedream_ext as pd

    graph = pd.ProfileGraph()
    graph.add_node("node0", "Input", 0.0, 0.0, 2.0 ** 20, 0.0)
    costs = [(1000.0, 2000.0)] + [(250.0, 500.0)] * 4
    for i, (forward_ms, backward_ms) in enumerate(costs):
        graph.add_node(f"node{i + 1}", f"Layer{i}", forward_ms, backward_ms, 2.0 ** 20, 2.0 ** 20)
        graph.add_edge(f"node{i}", f"node{i + 1}")
    return graph


def _shared_dir() -> str:
    """A fresh directory made by rank 0, its path given to every rank."""
    path = [tempfile.mkdtemp(prefix="tp-plan-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, 0)
    return str(path[0])


def check_auto(shape=(2, 1, 2), names=("pp", "dp", "tp")) -> None:
    """``balance="auto"``: the plan is for the mesh (pp2 x dp1 x tp2), its balance runs,
    and training is exact."""
    import pipedream_ext as pd

    pipe = check_training("1f1b", shape=shape, names=names, balance="auto", sample=batch(0))
    made = pipe.plan
    assert isinstance(made, pd.Plan), made
    assert (made.mesh_shape, made.tensor_parallel, made.sequence_parallel) == ((2, 1, 2), 2, False)
    assert made.mesh_ranks == [[0, 1], [2, 3]], made.mesh_ranks
    assert pipe.balance == [end - start for start, end in made.layers], (pipe.balance, made.layers)
    assert all(s.tensor_parallel_seconds > 0 for s in made.stages), made.stages


def check_auto_sequence_parallel() -> None:
    """A dict plan with torch's ``SequenceParallel`` is planned with SP (activations per
    rank divided by tp); construction only (SP across cuts is not this file's)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    import pipedream_ext as pd

    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                        balance="auto", sample=batch(0), timeout=60,
                        tensor_parallel={**plan(), "*.attn_norm": SequenceParallel()})
    assert pipe.plan.sequence_parallel is True and pipe.plan.tensor_parallel == 2
    pipe.close()


def check_saved_plan() -> None:
    """plan.json from ``python -m pipedream_ext plan --tensor-parallel 2`` cuts the model
    as it says ([1, 4]) and trains exactly (zb-h1)."""
    import pipedream_ext as pd
    from pipedream_ext.__main__ import main

    folder = _shared_dir()
    path = os.path.join(folder, "plan.json")
    if dist.get_rank() == 0:
        _profile().save(os.path.join(folder, "graph.txt"))
        assert main(["plan", "--profile", os.path.join(folder, "graph.txt"), "--workers", "2",
                     "--bandwidth", "1e9", "--tensor-parallel", "2", "-o", path]) == 0
    dist.barrier()
    saved = pd.Plan.load(path)
    assert (saved.mesh_shape, saved.layers) == ((2, 1, 2), [(0, 1), (1, 5)])
    assert [1, 4] != BALANCE
    pipe = check_training("zb-h1", balance=path)
    assert pipe.balance == [1, 4] and pipe.plan == saved, (pipe.balance, pipe.plan)


def check_mismatch() -> None:
    """A plan made for another tp size than the mesh's is refused on every rank, naming
    both sizes and the fix: a tp-2 plan on a pp2 x dp2 mesh (it would pass silently
    otherwise: its dp and pipeline workers match), a plan made without tp on pp2 x tp2."""
    from test_bad_input import ROWS

    import pipedream_ext as pd

    row = next(r[2] for r in ROWS if r[0] == "tp-plan-mesh")
    graph = _profile()
    tp_plan = pd.plan(graph, workers=2, bandwidth=[1e9, 1e9], data_parallel=2, tensor_parallel=2)
    with pytest.raises(ValueError, match=row) as info:
        pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, timeout=60,
                     mesh=mesh_of((2, 2), ("pp", "dp")), balance=tp_plan)
    assert re.search(r"made for 2 tensor-parallel ranks .* but the mesh has tp size 1 \(no 'tp' "
                     r"dimension\).* re-plan with --data-parallel 2 --sharding fsdp \(no "
                     r"--tensor-parallel\), or run it on a \(pp, dp, tp\) = \(2, 2, 2\) mesh",
                     str(info.value)), str(info.value)
    no_tp = pd.plan(graph, workers=2, bandwidth=1e9, data_parallel=1)
    with pytest.raises(ValueError, match=row) as info:
        pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, timeout=60,
                     mesh=mesh_of((2, 1, 2)), tensor_parallel=plan(), balance=no_tp)
    assert "made for 1 tensor-parallel ranks" in str(info.value) and \
        "--data-parallel 1 --sharding fsdp --tensor-parallel 2" in str(info.value), str(info.value)


def check_groups_keep_the_default_backend() -> None:
    """Every group a pp2 x tp2 pipeline communicates on (the mesh's, its pipeline's, the
    tp mesh its DTensors use) is on the default group's backend: under
    ``PIPEDREAM_TEST_BACKEND=nccl_rules`` (tests/test_nccl_rules.py) each keeps NCCL's rules,
    as each would be an NCCL communicator on GPUs."""
    import pipedream_ext as pd

    mesh = mesh_of((2, 1, 2))
    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh,
                        tensor_parallel=plan(), balance=BALANCE, timeout=60)
    pipe.step(*batch(0))
    default = dist.get_backend()
    groups = {"mesh['pp']": mesh["pp"].get_group(), "mesh['dp']": mesh["dp"].get_group(),
              "mesh['tp']": mesh["tp"].get_group(), "the pipeline's group": pipe.group}
    groups.update({f"{name}'s tp mesh": p.device_mesh.get_group()
                   for name, p in pipe.named_parameters() if hasattr(p, "device_mesh")})
    assert len(groups) > 4, groups
    for what, group in groups.items():
        assert dist.get_backend(group) == default, (what, dist.get_backend(group), default)
    pipe.close()


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_auto, name="auto-pp2-tp2")
    c.add(check_auto, shape=(2, 2), names=("pp", "tp"), name="auto-pp-tp-mesh")
    c.add(check_auto_sequence_parallel, name="auto-sequence-parallel")
    c.add(check_saved_plan, name="saved-plan")
    c.add(check_mismatch, name="plan-tp-mismatch")
    c.add(check_groups_keep_the_default_backend, name="groups-keep-the-default-backend")
    return c


# `make test` runs them under NCCL's rules, `make test-all` on Gloo too.
LAUNCHES = strict_and_gloo(HERE, 4, cases, timeout=300)


@parametrize_cases(*LAUNCHES)
def test_tp_planning_matches_the_unsplit_model(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main(LAUNCHES)
