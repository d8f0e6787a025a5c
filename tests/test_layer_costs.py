"""Per-layer costs and the machine's costs for the configuration search, in one process:
``_planning.layer_costs`` and ``_planning.calibration.calibrate_local`` (the collective
``calibrate`` runs as a case of tests/test_runtime.py's launches).

Times are never compared with the wall clock: the fit is checked on given numbers,
measured times for structure (finite, >= 0); bytes are checked exactly.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipedream_ext._planning import layer_costs as lc
from pipedream_ext._planning.graph_profile import trace_groups
from pipedream_ext.configuration import LayerCost, MachineCosts

FLOAT = 4  # bytes


class Skip(nn.Module):
    """a -> b (+ the input: a skip connection over both) -> c."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)).relu() + x)


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 32), nn.ReLU(),
                         nn.BatchNorm1d(32), nn.Linear(32, 4))


def sample(n: int = 32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def test_fit_recovers_an_affine_cost_and_keeps_both_terms_non_negative() -> None:
    assert lc._fit([2, 8], [3.0, 9.0]) == pytest.approx((1.0, 1.0))
    assert lc._fit([1, 4, 16], [1.5, 3.0, 9.0]) == pytest.approx((1.0, 0.5))
    assert lc._fit([2, 8], [5.0, 4.0]) == pytest.approx((4.5, 0.0))  # shrinking: no per-sample part
    fixed, per_sample = lc._fit([2, 8], [1.0, 8.0])  # through the origin instead of below it
    assert fixed == 0.0 and per_sample == pytest.approx((2 + 64) / 68)
    assert lc._fit([4], [2.0]) == pytest.approx((0.0, 0.5))  # one size: all per sample


def test_sequential_bytes_are_exact_and_times_well_formed() -> None:
    model = chain()
    costs = lc.measure_layer_costs(model, sample(), F.mse_loss, microbatch_sizes=[4, 16], steps=2,
                                   warmup=1)
    assert costs.group_of is None and costs.microbatch_sizes == [4, 16]
    assert costs.names[1] == "1 (Linear)" and len(costs.layers) == 5
    by = {f.name: [getattr(layer, f.name) for layer in costs.layers]
          for f in dataclasses.fields(LayerCost)}
    assert by["input_bytes_per_sample"] == [8 * FLOAT, 16 * FLOAT, 32 * FLOAT, 32 * FLOAT, 32 * FLOAT]
    assert by["output_bytes_per_sample"] == [16 * FLOAT, 32 * FLOAT, 32 * FLOAT, 32 * FLOAT, 4 * FLOAT]
    assert by["parameter_bytes"] == [(8 * 16 + 16) * FLOAT, (16 * 32 + 32) * FLOAT, 0.0, 64 * FLOAT,
                                     (32 * 4 + 4) * FLOAT]
    assert by["parameter_tensors"] == [2.0, 2.0, 0.0, 2.0, 2.0]  # weights and biases
    assert by["largest_parameter_bytes"] == [8 * 16 * FLOAT, 16 * 32 * FLOAT, 0.0, 32 * FLOAT,
                                             32 * 4 * FLOAT]
    # Kept bytes, each storage once for the layer that made it. Layer 0 (Linear + ReLU):
    # autograd saves the input (the sample's: no layer's) and ReLU's result. Layer 1's
    # output is saved by nobody (ReLU keeps its own result), layer 2's result is saved by
    # ReLU and BatchNorm; BatchNorm makes its output (saved by the last Linear) and its
    # batch mean and inverse std (32 floats each per microbatch); the loss keeps the last
    # output and the target.
    per_sample_stats = 2 * 32 * FLOAT / 16
    assert by["stash_bytes_per_sample"] == pytest.approx(
        [16 * FLOAT, 0.0, 32 * FLOAT, 32 * FLOAT + per_sample_stats, 2 * 4 * FLOAT])
    for key in ("forward_fixed", "forward_per_sample", "backward_fixed", "backward_per_sample"):
        assert all(math.isfinite(v) and v >= 0 for v in by[key]), (key, by[key])
    assert all(f + p > 0 for f, p in zip(by["forward_fixed"], by["forward_per_sample"]))
    assert by["weight_share"][2] == 0.0 and all(0 <= w <= 1 for w in by["weight_share"])
    # On stage 0 the batch carries no gradient: the first layer's backward is all weight
    # gradient; the next Linear also computes its input's.
    assert by["weight_share"][0] == 1.0 and by["weight_share"][1] < 1.0
    # Adam's step over each layer's parameters beyond its per-step part: none without any.
    assert by["optimizer_seconds"][2] == 0.0 and sum(by["optimizer_seconds"]) > 0, by["optimizer_seconds"]
    assert all(0 <= v < 1 for v in by["optimizer_seconds"]), by["optimizer_seconds"]


def test_layers_fed_only_by_data_compute_no_input_gradient() -> None:
    """What only the batch made carries no gradient on stage 0: a Linear after a ReLU of the
    data computes its weights' gradient alone (the profile must not count an input gradient
    the pipeline never computes), a Linear after it both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.Linear(8, 16), nn.Linear(16, 4))
    costs = lc.measure_layer_costs(model, sample(), F.mse_loss, steps=1, warmup=0)
    shares = [layer.weight_share for layer in costs.layers]
    assert shares[0] == 0.0 and shares[1] == 1.0 and shares[2] < 1.0


def test_the_model_is_left_as_it_was() -> None:
    model = chain().eval()
    bn = model[3]
    running = bn.running_mean.clone()
    model[1].weight.grad = torch.ones_like(model[1].weight)
    state = torch.get_rng_state()
    lc.measure_layer_costs(model, sample(), F.mse_loss, steps=1, warmup=0)
    assert not model.training and not bn.training
    assert torch.equal(bn.running_mean, running) and int(bn.num_batches_tracked) == 0
    assert torch.equal(model[1].weight.grad, torch.ones_like(model[1].weight))
    assert model[0][0].weight.grad is None
    assert torch.equal(torch.get_rng_state(), state)


def test_traced_chain_sends_the_live_set_of_each_cut() -> None:
    torch.manual_seed(0)
    model = Skip()
    x, y = sample()
    grouped = trace_groups(model, (x,))
    costs = lc.measure_layer_costs(model, (x, y), F.mse_loss, steps=1, warmup=0, grouped=grouped)
    assert costs.group_of == [g.id for g in grouped.groups] and len(costs.layers) == 3
    out = [c.output_bytes_per_sample for c in costs.layers]
    inputs = [c.input_bytes_per_sample for c in costs.layers]
    # After a: its output and the skipped input; after b's group (b, relu, add): the sum.
    assert out == [2 * 8 * FLOAT, 8 * FLOAT, 4 * FLOAT]
    assert inputs == [8 * FLOAT, 2 * 8 * FLOAT, 8 * FLOAT]
    # a's output is kept by b (made by a); b's group makes relu's result and the sum (kept
    # by relu and c); the loss keeps c's output and the target.
    assert [c.stash_bytes_per_sample for c in costs.layers] == [8 * FLOAT, 2 * 8 * FLOAT, 2 * 4 * FLOAT]
    assert [c.parameter_bytes for c in costs.layers] == [72 * FLOAT, 72 * FLOAT, 36 * FLOAT]
    assert [c.parameter_tensors for c in costs.layers] == [2.0, 2.0, 2.0]
    assert [c.largest_parameter_bytes for c in costs.layers] == [64 * FLOAT, 64 * FLOAT, 32 * FLOAT]
    assert costs.stage_nodes([2, 1]) == [costs.group_of[:2], costs.group_of[2:]]
    stage_of = lc.traced_stage_of(grouped, costs, [1, 2])
    assert {n: stage_of[n] for n in ("a", "b", "c")} == {"a": 0, "b": 1, "c": 1}
    with pytest.raises(ValueError, match=r"balance=\[1, 1\] must be positive layer counts summing "
                                         r"to the 3 layers"):
        costs.stage_nodes([1, 1])


def test_costs_round_trip_and_bad_input_is_refused() -> None:
    costs = lc.measure_layer_costs(chain(), sample(), F.mse_loss, steps=1, warmup=0)
    assert lc.LayerCosts.from_dict(costs.to_dict()) == costs
    bad = costs.to_dict()
    bad["layers"][0]["weight_fraction"] = 0.5
    with pytest.raises(ValueError, match=r"layer cost: unknown key\(s\) \['weight_fraction'\]"):
        lc.LayerCosts.from_dict(bad)
    with pytest.raises(ValueError, match=r"microbatch_sizes=\[0\] must be sample counts between 1 "
                                         r"and the sample's batch of 32"):
        lc.measure_layer_costs(chain(), sample(), F.mse_loss, microbatch_sizes=[0])
    with pytest.raises(ValueError, match="sample must be"):
        lc.measure_layer_costs(chain(), sample()[0], F.mse_loss)
    with pytest.raises(ValueError, match="stage_nodes is for a traced model"):
        costs.stage_nodes([5])


def test_calibrate_local_measures_the_runtime_and_the_optimizer() -> None:
    import pipedream_ext as pd
    from pipedream_ext._planning.calibration import calibrate_local

    assert not dist.is_initialized()
    costs = calibrate_local(torch.device("cpu"), pipeline=pd.PipeDream)
    assert not dist.is_initialized()  # its one-process group is gone
    assert isinstance(costs, MachineCosts)
    # The step holds Adam's per-step cost; the layers hold their parameters' share.
    assert 0 < costs.step_seconds < 1 and 0 < costs.action_seconds < 1, costs
    assert costs.optimizer_seconds_per_byte == 0 and costs.optimizer_seconds_per_tensor == 0, costs
    assert costs.cores >= 1 and costs.ranks_per_node >= 1
    assert costs.latency_seconds == 0.0 and costs.bandwidth == MachineCosts().bandwidth  # no peer
    # Cached per process and device; recalibrate measures again (and replaces the entry).
    assert calibrate_local(torch.device("cpu"), pipeline=pd.PipeDream) is costs
    again = calibrate_local(torch.device("cpu"), pipeline=pd.PipeDream, recalibrate=True)
    assert again is not costs and calibrate_local(torch.device("cpu"), pipeline=pd.PipeDream) is again


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_step_overhead_recovers_the_cost_models_step_seconds(ranks: int) -> None:
    """Steps the cost model predicts for a known per-step cost give that cost back."""
    from pipedream_ext._planning.calibration import _probe_seconds, step_overhead

    counts = (2, 8)
    for step, action in ((3e-3, 50e-6), (0.0, 200e-6), (1e-3, 0.0)):
        machine = MachineCosts(send_seconds=20e-6, send_seconds_per_byte=1e-9, latency_seconds=150e-6,
                               bandwidth=1e9, action_seconds=action)
        measured = [step + _probe_seconds(machine, ranks, m) for m in counts]
        assert step_overhead(machine, ranks, counts, measured) == pytest.approx(step, rel=1e-6, abs=1e-9)
    # Steps faster than the model's own prediction (noise): no negative cost.
    assert step_overhead(MachineCosts(action_seconds=1e-3), ranks, counts, [1e-6, 1e-6]) == 0.0


@pytest.mark.parametrize("ranks", [2, 4])
def test_shared_core_action_seconds_recovers_the_growth_per_action(ranks: int) -> None:
    """More ranks than cores: the per-action cost that makes the probe's predicted step
    grow with the microbatches as measured comes back; never below the spans' floor."""
    from pipedream_ext._planning.calibration import _probe_seconds, shared_core_action_seconds

    counts = (2, 6)
    base = MachineCosts(send_seconds=20e-6, latency_seconds=150e-6, bandwidth=1e9, cores=2,
                        ranks_per_node=2 * ranks)
    for floor, true in ((50e-6, 400e-6), (100e-6, 100e-6), (0.0, 1e-3)):
        truth = dataclasses.replace(base, action_seconds=true)
        measured = [2e-3 + _probe_seconds(truth, ranks, m) for m in counts]
        found = shared_core_action_seconds(dataclasses.replace(base, action_seconds=floor), ranks,
                                           counts, measured)
        assert found == pytest.approx(true, rel=1e-4, abs=1e-9)
    # A growth below what the floor predicts (noise) keeps the floor.
    floor = dataclasses.replace(base, action_seconds=300e-6)
    assert shared_core_action_seconds(floor, ranks, counts, [5e-3, 5e-3]) == 300e-6
