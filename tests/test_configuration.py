"""pipedream_ext.configuration: the whole-configuration search and its predictions, in
process (the exhaustive comparison is GoogleTest's, tests/cpp/test_configure.cpp); and the
frontend's search over meshes and data parallelism (``mesh="auto"``, ``data_parallel="auto"``:
``_planning.choose.best_of``, ``_parallel.auto_mesh``)."""
from __future__ import annotations

import dataclasses
import doctest
import json
from typing import List

import pytest
from torch import nn

from pipedream_ext import configuration
from pipedream_ext._extension import _C
from pipedream_ext.configuration import (
    Configuration,
    LayerCost,
    MachineCosts,
    Prediction,
    _binding_dict,
    flush_schedules,
    microbatch_candidates,
    predict,
    search,
)


def _layers(count: int = 4, stash: float = 10.0) -> List[LayerCost]:
    """Equal layers: F = 1, B = 2 seconds per sample, 100 parameter bytes."""
    return [LayerCost(forward_per_sample=1.0, backward_per_sample=2.0,
                      stash_bytes_per_sample=stash, input_bytes_per_sample=1.0,
                      parameter_bytes=100.0)] * count


def _two_stages(schedule: str = "1f1b", microbatches: int = 4) -> Configuration:
    return Configuration(schedule=schedule, microbatches=microbatches, balance=[2, 2],
                         mesh=(2, 1, 1))


def test_predict_matches_the_binding_and_the_hand_count() -> None:
    machine = MachineCosts(step_seconds=1.0, optimizer_seconds_per_byte=0.01)
    p = predict(_layers(), machine, _two_stages(), batch_size=4)
    raw = _C.predict_configuration([layer.to_dict() for layer in _layers()], 4,
                                   machine.to_dict(), _binding_dict(_two_stages()))
    assert p == Prediction.from_dict(raw)
    # 1F1B, p = 2, m = 4, F = 2 and B = 4 per stage: (m + p - 1)(F + B), plus the step
    # (1 s) and the optimizer over 200 bytes per rank (2 s).
    assert p.pipeline_seconds == pytest.approx(30.0)
    assert p.step_seconds == pytest.approx(33.0)
    # The state, the stashes (20 bytes) and received inputs (1) in flight and a backward's
    # input gradient (1).
    assert p.peak_bytes == pytest.approx([800 + 2 * 21 + 1, 800 + 21 + 1])
    for rank in range(2):
        assert sum(p.breakdown(rank).values()) == pytest.approx(p.step_seconds)
    with pytest.raises(ValueError, match="rank 2"):
        p.breakdown(2)


def test_configuration_round_trips_through_json() -> None:
    best = search(_layers(), MachineCosts(), world_size=2, batch_size=8,
                  schedules=["gpipe", "1f1b"], microbatches=[2, 4, 8], recompute="search",
                  memory=900.0, candidates=2)
    text = json.dumps(best.to_dict())
    again = Configuration.from_dict(json.loads(text))
    assert again == best
    assert len(again.candidates) == 2 and again.candidates[0].prediction is not None
    assert again.predicted_step_seconds == best.prediction.step_seconds
    assert again.predicted_peak_bytes == best.prediction.peak_bytes
    with pytest.raises(ValueError, match="unknown key.*'schedul'"):
        Configuration.from_dict({"schedul": "1f1b", "microbatches": 2, "balance": [4]})
    with pytest.raises(ValueError, match="mesh"):
        Configuration.from_dict({"schedule": "1f1b", "microbatches": 2, "balance": [4],
                                 "mesh": [1, 1]})


def test_data_parallel_round_trips_and_older_files_read() -> None:
    chosen = Configuration(schedule="1f1b", microbatches=4, balance=[2, 2], mesh=(2, 2, 1),
                           data_parallel="fsdp")
    assert Configuration.from_dict(json.loads(json.dumps(chosen.to_dict()))) == chosen
    assert "2x2x1 fsdp" in chosen.table() and "(fsdp)" in chosen.summary()
    older = chosen.to_dict()
    del older["data_parallel"]  # a plan file written before the field
    assert Configuration.from_dict(older).data_parallel is None
    with pytest.raises(ValueError, match="data_parallel must be 'fsdp', 'replicate' or null "
                                         r"\(got 'ddp'\)"):
        Configuration.from_dict({**older, "data_parallel": "ddp"})


def test_search_picks_the_schedule_that_fits_and_recomputes_only_where_needed() -> None:
    # 1F1B keeps 2 stashes of 20 bytes and inputs of 1 on rank 0 (843 bytes with the state
    # and a backward's input gradient), GPipe all 8 (969): under 835 bytes 1F1B recomputes
    # on rank 0 only, GPipe on both ranks.
    best = search(_layers(), MachineCosts(), world_size=2, batch_size=8,
                  schedules=["gpipe", "1f1b"], microbatches=[8], recompute="search",
                  memory=835.0)
    assert (best.schedule, best.balance, best.recompute) == ("1f1b", [2, 2], [True, False])
    assert best.candidates[0].schedule == "gpipe"
    assert best.candidates[0].recompute == [True, True]
    assert best.prediction.fits and max(best.predicted_peak_bytes) <= 835.0
    unlimited = search(_layers(), MachineCosts(), world_size=2, batch_size=8,
                       schedules=["gpipe", "1f1b"], microbatches=[8], recompute="search")
    assert unlimited.recompute == [False, False]
    assert unlimited.predicted_step_seconds < best.predicted_step_seconds


def test_search_equals_the_enumeration_with_a_mesh_and_every_flush_schedule() -> None:
    layers = [LayerCost(forward_per_sample=f, backward_per_sample=2 * f, parameter_bytes=1e4,
                        stash_bytes_per_sample=100.0, output_bytes_per_sample=10.0)
              for f in (1.0, 3.0, 2.0, 0.5, 1.5, 2.5)]
    machine = MachineCosts(action_seconds=0.01, latency_seconds=0.05, bandwidth=1e3,
                           all_reduce_bandwidth=1e5, step_seconds=0.2, cores=2)
    space = {"world_size": 4, "batch_size": 8, "schedules": flush_schedules(),
             "microbatches": [2, 4, 8], "meshes": [[4, 1, 1], [2, 2, 1]],
             "recompute": "search", "memory_bytes": 1e5, "candidates": 3}
    dicts = [layer.to_dict() for layer in layers]
    found = _C.search_configurations(dicts, machine.to_dict(), space)
    every = _C.enumerate_configurations(dicts, machine.to_dict(), space)
    assert found["feasible"] and every["feasible"]
    assert found["best"]["prediction"]["step_seconds"] == pytest.approx(
        every["best"]["prediction"]["step_seconds"], rel=1e-9)
    assert found["evaluated"] < every["evaluated"]


def test_nothing_fits_names_the_limit_and_the_smallest_peak() -> None:
    with pytest.raises(ValueError, match=r"memory=700 bytes per rank: the smallest peak found "
                                         r"is \d+ bytes"):
        search(_layers(), MachineCosts(), world_size=2, batch_size=8,
               schedules=["1f1b"], microbatches=[8], recompute="search", memory=700.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"schedules": ["nope"]}, "unknown schedule 'nope'"),
    ({"microbatches": [9]}, "microbatches .*9"),
    ({"meshes": [(4, 1, 1)]}, r"mesh \(4, 1, 1\)"),
    ({"recompute": "sometimes"}, "recompute must be"),
    ({"memory": -1.0}, "memory must be a positive number"),
    ({"balance": [1, 2]}, r"balance \[1, 2\]"),
])
def test_bad_space_names_the_value(kwargs: dict, message: str) -> None:
    arguments = dict(world_size=2, batch_size=8, schedules=["1f1b"], microbatches=[4])
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        search(_layers(), MachineCosts(), **arguments)


def test_bad_configuration_and_dict_keys_name_the_value() -> None:
    bad = _two_stages()
    bad.balance = [3, 2]
    with pytest.raises(ValueError, match=r"balance \[3, 2\]"):
        predict(_layers(), MachineCosts(), bad, batch_size=4)
    with pytest.raises(ValueError, match="unknown machine key 'cpus'"):
        _C.predict_configuration([], 4, {"cpus": 2}, {})
    with pytest.raises(ValueError, match="unknown key"):
        LayerCost.from_dict({"forward": 1.0})
    assert MachineCosts.from_dict(MachineCosts(cores=2).to_dict()) == MachineCosts(cores=2)


def test_fixed_recompute_list_and_asynchronous_schedules_are_scored() -> None:
    fixed = search(_layers(), MachineCosts(), world_size=2, batch_size=8, schedules=["1f1b"],
                   microbatches=[8], recompute=[True, False], balance=[2, 2])
    assert fixed.recompute == [True, False]
    assert fixed.candidates == []
    # PipeDream never flushes: its steady state beats every flush schedule here, and it
    # is chosen only because it is named.
    best = search(_layers(), MachineCosts(), world_size=2, batch_size=8,
                  schedules=["1f1b", "pipedream"], microbatches=[8])
    assert best.schedule == "pipedream"
    assert "pipedream" not in flush_schedules()


def test_microbatch_candidates() -> None:
    assert microbatch_candidates(1) == [1]
    assert microbatch_candidates(24) == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    assert microbatch_candidates(7) == [1, 2, 4, 7]
    many = microbatch_candidates(720, limit=12)
    assert len(many) == 12 and {1, 2, 4, 512, 720} <= set(many)
    with pytest.raises(ValueError, match="batch_size"):
        microbatch_candidates(0)


def test_table_and_summary_name_the_choice() -> None:
    best = search(_layers(), MachineCosts(), world_size=2, batch_size=8,
                  schedules=["gpipe", "1f1b"], microbatches=[4, 8], candidates=2)
    lines = best.table().splitlines()
    assert len(lines) == 1 + 1 + 2
    assert lines[1].split()[:2] == ["best", best.schedule]
    summary = best.summary()
    assert best.schedule in summary and "predicted step" in summary


def test_module_example_runs() -> None:
    failures, _ = doctest.testmod(configuration)
    assert failures == 0


# -- mesh="auto" and data_parallel="auto" (the frontend's searches) ---------------------------
def _request(meshes, fsdp=(False, True), global_batch=False, memory=None, microbatches=None):
    from pipedream_ext._parallel.auto_mesh import runs_on_device_mesh
    from pipedream_ext._planning.choose import Request

    return Request(schedules=["1f1b"], microbatches=microbatches, chunks=(2,), balance=None,
                   recompute="never", memory=memory, meshes=meshes, fsdp=fsdp,
                   global_batch=global_batch,
                   on_mesh=[m for m in meshes if runs_on_device_mesh(m)])


def test_data_parallel_auto_takes_what_the_cost_model_prefers_and_what_fits() -> None:
    from pipedream_ext._planning.choose import best_of

    # Costly collective calls: FSDP's two per stage lose to one all-reduce.
    calls = MachineCosts(all_reduce_latency_seconds=1.0)
    best, batch = best_of(_layers(), calls, _request([(2, 2, 1)]).searches(8))
    assert (best.mesh, best.data_parallel, batch) == ((2, 2, 1), "replicate", 8)
    assert "fsdp" in {c.data_parallel for c in best.candidates}
    # A costly optimizer step: FSDP's ranks each step 1/dp of the weights.
    optimizer = MachineCosts(optimizer_seconds_per_byte=1.0)
    assert best_of(_layers(), optimizer, _request([(2, 2, 1)]).searches(8))[0].data_parallel == "fsdp"
    # A memory limit only FSDP's shards fit, whatever the costs.
    peaks = {fsdp: max(predict(_layers(), calls, dataclasses.replace(best, data_parallel=None),
                               8, fsdp=fsdp).peak_bytes) for fsdp in (False, True)}
    assert peaks[True] < peaks[False], peaks
    limit = (peaks[True] + peaks[False]) / 2
    fitted, _ = best_of(_layers(), calls, _request([(2, 2, 1)], memory=limit).searches(8))
    assert fitted.data_parallel == "fsdp" and max(fitted.predicted_peak_bytes) <= limit
    with pytest.raises(ValueError, match="no configuration fits on any mesh or data parallelism"):
        best_of(_layers(), calls, _request([(2, 2, 1)], memory=peaks[True] / 100).searches(8))
    # With dp = 1 there is nothing to choose.
    alone, _ = best_of(_layers(), calls, _request([(2, 1, 1)]).searches(8))
    assert alone.data_parallel is None and all(c.data_parallel is None for c in alone.candidates)


def test_mesh_auto_compares_every_factorisation_on_one_global_batch() -> None:
    from pipedream_ext._parallel.auto_mesh import mesh_candidates
    from pipedream_ext._planning.choose import best_of

    assert mesh_candidates(4, 8, 4, [1]) == [(4, 1, 1), (2, 2, 1), (1, 4, 1)]
    assert mesh_candidates(4, 6, 4, [1]) == [(4, 1, 1), (2, 2, 1)]  # dp 4 does not divide 6 rows
    assert mesh_candidates(4, 8, 2, [1, 2]) == [(2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)]
    meshes = mesh_candidates(4, 8, 4, [1])
    request = _request(meshes, fsdp=(False,), global_batch=True)
    # The pipeline of dp copies gets 8 / dp rows, split into counts that divide them.
    assert [(batch, a["microbatches"]) for batch, _, a in request.searches(8)] == \
        [(8, [1, 2, 4, 8]), (4, [1, 2, 4]), (2, [1, 2])]
    # Communication free, a fixed cost per step: more copies leave each less to do.
    machine = MachineCosts(step_seconds=1.0)
    best, batch = best_of(_layers(), machine, request.searches(8))
    assert best.mesh == (1, 4, 1) and batch == 2, best.table()
    every = [best] + best.candidates
    assert {c.mesh for c in every} == set(meshes)
    assert best.predicted_step_seconds == min(c.predicted_step_seconds for c in every)
    # Costly collectives: the pipeline over the world wins.
    slow = MachineCosts(all_reduce_latency_seconds=1e3)
    assert best_of(_layers(), slow, request.searches(8))[0].mesh == (4, 1, 1)
    # 3 microbatches: only the pipeline without a mesh may split 8 rows unevenly.
    three = _request(meshes, global_batch=True, microbatches=[3])
    assert best_of(_layers(), machine, three.searches(8))[0].mesh == (4, 1, 1)
    with pytest.raises(ValueError, match=r"microbatches=\[3\] fits no pipeline's batch of the "
                                         r"candidate meshes \[\[2, 2, 1\]\]"):
        best_of(_layers(), machine, _request([(2, 2, 1)], global_batch=True, microbatches=[3]).searches(8))


def test_tensor_parallel_sizes_are_those_the_plan_splits_evenly() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipedream_ext._parallel.auto_mesh import tp_sizes

    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    assert tp_sizes(4, None, model, None) == [1]
    assert tp_sizes(4, plan, model, None) == [1, 2]  # 6 outputs do not split over 4
    assert tp_sizes(4, lambda stage, mesh: None, model, None) == [1, 2, 4]  # unseen: the runtime checks


def test_fsdp_pays_its_measured_call_per_unit_and_loses_where_calls_are_costly() -> None:
    from pipedream_ext._planning.choose import best_of

    # 4 layers with parameters on the one stage of (1, 2, 1): 4 units, an all-gather and
    # a reduce-scatter each per step (the runtime's calls, _parallel/fsdp.py).
    config = Configuration(schedule="gpipe", microbatches=1, balance=[4], mesh=(1, 2, 1))
    free = predict(_layers(), MachineCosts(), config, 4, fsdp=True).all_reduce_seconds
    measured = MachineCosts(fsdp_call_seconds=0.5)
    paid = predict(_layers(), measured, config, 4, fsdp=True).all_reduce_seconds
    assert paid == pytest.approx(free + 4 * 2 * 0.5)
    # Replicate pays one all-reduce per stage, whatever FSDP's calls cost, at its own
    # measured call.
    assert predict(_layers(), measured, config, 4).all_reduce_seconds == pytest.approx(
        predict(_layers(), MachineCosts(), config, 4).all_reduce_seconds)
    replicated = dataclasses.replace(measured, replicate_call_seconds=0.25)
    assert predict(_layers(), replicated, config, 4).all_reduce_seconds == pytest.approx(
        predict(_layers(), MachineCosts(), config, 4).all_reduce_seconds + 0.25)
    # A costly optimizer alone favours FSDP (1/dp of it per rank); FSDP's measured calls
    # (8 of them) outweigh the optimizer it saves: replicate is chosen.
    costly = MachineCosts(optimizer_seconds_per_byte=0.01)
    assert best_of(_layers(), costly, _request([(2, 2, 1)]).searches(8))[0].data_parallel == "fsdp"
    calls = dataclasses.replace(costly, fsdp_call_seconds=1.0, replicate_call_seconds=1.0)
    assert best_of(_layers(), calls, _request([(2, 2, 1)]).searches(8))[0].data_parallel == "replicate"
    assert MachineCosts.from_dict(calls.to_dict()) == calls


def test_tensor_parallel_collectives_are_priced_from_a_dict_plan() -> None:
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipedream_ext._parallel.tp_costs import plan_traffic
    from pipedream_ext._planning.choose import best_of, with_tp_traffic

    block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = nn.Sequential(nn.Linear(4, 8), block, nn.Sequential(nn.ReLU()), nn.Linear(8, 2))
    plan = {"1.0": ColwiseParallel(), "1.2": RowwiseParallel(),
            "3": RowwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))}
    x = torch.randn(5, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    traffic = plan_traffic(plan, model, x)
    # Layer 1 (Megatron's pair): the column-parallel input gradient (8 floats) in
    # backward, the row-parallel output (8 floats) in forward; layer 3's sequence-sharded
    # output: a reduce-scatter and an all-gather of its 2 floats; the rest: nothing.
    assert traffic == [(0.0, 0.0), (2.0, 64.0), (0.0, 0.0), (2.0, 8.0)]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert plan_traffic(lambda stage, mesh: None, model, x) is None  # a callable: unseen
    # The search sees them: tp 2 with its all-reduces loses to dp 2 on costly calls.
    layers = with_tp_traffic(_layers(), [(2.0, 64.0)] * 4)
    assert layers[0].tp_collectives == 2.0 and with_tp_traffic(_layers(), []) == _layers()
    slow = MachineCosts(all_reduce_latency_seconds=10.0)
    free, _ = best_of(_layers(), slow, _request([(1, 1, 2), (1, 2, 1)]).searches(8))
    assert free.mesh == (1, 1, 2), free.table()  # unpriced: tp halves the compute
    priced, _ = best_of(layers, slow, _request([(1, 1, 2), (1, 2, 1)]).searches(8))
    assert priced.mesh == (1, 2, 1), priced.table()
