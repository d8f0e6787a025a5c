"""Graph profiles of traced models (``_graph_profile``) and plans mapped back to fx nodes.

One process, no process group: grouping (depth, functional operations following a
module call, non-tensor values and modules with state kept in one group), the edges
of graph.txt (skip connections), what the profiler measures and leaves alone, and a
plan's stages as a stage per fx node (runnable or refused with a clear error).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipedream_ext as pd
from pipedream_ext._frontend.fx_graph import value_kinds
from pipedream_ext._frontend.graph_split import split_model
from pipedream_ext._planning.graph_profile import plan_stage_of, trace_groups

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_traced import ResNet, UNet


def _resnet():
    torch.manual_seed(0)
    return ResNet(), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))


def _descriptions(grouped) -> List[str]:
    return [g.description for g in grouped.groups]


def test_resnet_groups_are_leaf_module_calls_with_the_operations_after_them() -> None:
    model, x, _ = _resnet()
    grouped = trace_groups(model, (x,))
    assert grouped.depth is None  # 19 groups fit the default bound: leaf modules
    d = _descriptions(grouped)
    assert len(d) == 19 and grouped.input_ids == ["node1"]
    assert d[:6] == ["stem [stem, relu]", "layer1.0.conv1 (Conv2d)",
                     "layer1.0.bn1 [layer1_0_bn1, relu_1]", "layer1.0.conv2 (Conv2d)",
                     "layer1.0.bn2 [layer1_0_bn2, add, relu_2]", "layer1.1.conv1 (Conv2d)"]
    assert d[-2:] == ["layer2.1.bn2 [layer2_1_bn2 .. flatten: 5 ops]", "fc (Linear)"]
    edges = set(grouped.edges)
    # Residual skips are edges: the stem's output into layer1.0's add, and layer2.0's
    # downsampling convolution as a branch beside conv1 -> bn1 -> conv2 -> bn2.
    ids = {desc.split(" ")[0]: g.id for desc, g in zip(d, grouped.groups)}
    assert (ids["stem"], ids["layer1.0.bn2"]) in edges
    assert (ids["layer1.1.bn2"], ids["layer2.0.down"]) in edges
    assert (ids["layer2.0.down"], ids["layer2.0.bn2"]) in edges
    assert (ids["layer2.0.down"], ids["layer2.0.conv1"]) not in edges
    assert ("node1", ids["stem"]) in edges
    # Every parameter of the model is in exactly one group.
    names = [p for g in grouped.groups for p in g.parameters]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert sum(g.parameter_bytes for g in grouped.groups) == \
        sum(p.numel() * p.element_size() for p in model.parameters())


def test_coarser_groups_when_the_leaves_exceed_max_groups() -> None:
    model, x, _ = _resnet()
    blocks = trace_groups(model, (x,), max_groups=6)  # the residual blocks: depth 2
    assert blocks.depth == 2 and len(blocks.groups) == 6
    assert [sorted({str(n.target).rsplit(".", 1)[0] for n in g.nodes if n.op == "call_module"})
            for g in blocks.groups] == [["stem"], ["layer1.0"], ["layer1.1"], ["layer2.0"],
                                        ["layer2.1"], ["fc"]]
    assert blocks.edges == [("node1", "node2"), ("node2", "node3"), ("node3", "node4"),
                            ("node4", "node5"), ("node5", "node6"), ("node6", "node7")]
    top = trace_groups(model, (x,), max_groups=2)  # nothing fits: the model's children
    assert top.depth == 1 and _descriptions(top)[0] == "stem [stem, relu]" and len(top.groups) == 4
    assert trace_groups(model, (x,), depth=1).edges == top.edges
    with pytest.raises(ValueError, match="must be >= 1"):
        trace_groups(model, (x,), max_groups=0)


class _Shapes(nn.Module):
    """A size taken first and used last, and a tuple (chunk) unpacked later."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        h = self.a(x)
        h1, h2 = self.b(h).chunk(2, dim=1)
        h = self.c(torch.cat([h2, h1], dim=1))
        return self.d(h).view(n, 2, 2)


class _Reuse(nn.Module):
    """A stateless module called everywhere, and a Linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.a, self.b, self.c, self.e = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.e(x))
        h = self.act(self.a(h))
        h = self.act(self.b(h))
        h = self.act(self.a(h))  # a again: its weight needs one stage
        return self.c(h)


def _crossing_kinds(model: nn.Module, x: torch.Tensor) -> Dict[str, str]:
    grouped = trace_groups(model, (x,))
    kinds = value_kinds(grouped.gm, (x,))
    out = {}
    for g in grouped.groups:
        for n in g.nodes:
            if any(grouped.group_of.get(u, -1) != grouped.group_of[n] for u in n.users):
                out[n.name] = kinds[n]
    return out


def test_non_tensor_values_and_modules_with_state_stay_in_one_group() -> None:
    x = torch.randn(3, 4)
    grouped = trace_groups(_Shapes(), (x,))
    # size (an int) is used by the last view: everything between is one group; chunk's
    # tuple stays with its getitems.
    assert [[n.name for n in g.nodes] for g in grouped.groups] == [
        ["size", "a", "b", "chunk", "getitem", "getitem_1", "cat", "c", "d", "view"]]
    assert set(_crossing_kinds(_Shapes(), x).values()) <= {"Tensor"}
    grouped = trace_groups(_Reuse(), (x,))
    # Each leaf module call is a group (act too), but a's two calls and what is between them
    # are one.
    assert [[n.name for n in g.nodes] for g in grouped.groups] == [
        ["e"], ["act"], ["a", "act_1", "b", "act_2", "a_1"], ["act_3"], ["c"]]
    assert grouped.groups[2].parameters == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert all(kind == "Tensor" for kind in _crossing_kinds(_Reuse(), x).values())


def test_profile_of_a_traced_model_measures_groups_and_leaves_the_model_alone() -> None:
    model, x, y = _resnet()
    model.layer1.eval()  # mixed modes are restored per module
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    graph = pd.profile(model, x, loss_fn=F.cross_entropy, target=y, steps=2, warmup=1)
    nodes = graph.nodes()
    assert nodes[0]["description"] == "Input0 x" and nodes[0]["activation_bytes"] == x.numel() * 4
    assert len(nodes) == 20 and not graph.is_chain()
    assert all(n["forward_ms"] > 0 and n["backward_ms"] > 0 for n in nodes[1:])
    assert nodes[1]["activation_bytes"] == 4 * 4 * 8 * 8 * 4  # stem + relu: (4, 4, 8, 8) floats
    assert nodes[-1]["activation_bytes"] == 4 * 5 * 4 and nodes[-1]["parameter_bytes"] == (24 * 5 + 5) * 4
    assert sorted(graph.edges()) == sorted(trace_groups(model, (x,)).edges)
    # BatchNorm statistics, modes, gradients and the RNG are as before.
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert model.training and not model.layer1.training and model.layer2.training
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    # The nn.Sequential profiler leaves BatchNorm statistics alone too.
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 5))
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    pd.profile(seq, x, steps=1, warmup=1)
    assert all(torch.equal(v, before[k]) for k, v in seq.state_dict().items())


def _uniform_plan(model: nn.Module, x: torch.Tensor, workers: int) -> pd.Plan:
    """A straight plan of ``model``'s graph profile with 1 ms per node."""
    measured = pd.profile(model, x, steps=1, warmup=0)
    graph = pd.ProfileGraph()
    for n in measured.nodes():
        t = 0.0 if n["description"].startswith("Input") else 1.0
        graph.add_node(n["id"], n["description"], t, t, n["activation_bytes"], n["parameter_bytes"])
    for a, b in measured.edges():
        graph.add_edge(a, b)
    return pd.plan(graph, workers=workers, bandwidth=1e9, straight=True)


def _chain(stages, x):
    value = x
    for stage in stages:
        value = stage(value)
    return value


def test_a_plan_becomes_a_stage_per_fx_node_and_runs() -> None:
    model, x, _ = _resnet()
    model.eval()
    plan = _uniform_plan(model, x, 3)
    grouped = trace_groups(model, (x,))
    stage_of = plan_stage_of(grouped, plan)
    split = split_model(model, ["ignored"], (x,), stage_of=stage_of)
    assert len(split.stages) == 3
    torch.testing.assert_close(_chain(split.stages, x), model(x))
    by_id = {g.id: g for g in grouped.groups}
    for stage, planned in zip(split.stages, plan.stages):
        expected = {str(n.target) for i in planned.nodes if i in by_id
                    for n in by_id[i].nodes if n.op == "call_module"}
        assert {str(n.target) for n in stage.graph.nodes if n.op == "call_module"} == expected
    # Any assignment that follows the data flow runs, also one that is not contiguous in
    # the graph's order: layer2.0's downsampling branch after its conv1 -> bn2 path.
    order = [n.name for n in grouped.gm.graph.nodes if n.name in stage_of]
    late = {name: (1 if order.index(name) >= order.index("layer2_0_down") else 0) for name in order}
    late["layer2_0_down"] = 1
    late.update({name: 0 for name in ("layer2_0_conv1", "layer2_0_bn1", "relu_5", "layer2_0_conv2")})
    split = split_model(model, ["layer2.0.bn2"], (x,), stage_of=late)
    assert split.live == [["relu_4", "layer2_0_conv2"]]  # the block input crosses for down
    torch.testing.assert_close(_chain(split.stages, x), model(x))


def test_plans_that_cannot_run_are_refused() -> None:
    model, x, _ = _resnet()
    grouped = trace_groups(model, (x,))
    plan = _uniform_plan(model, x, 2)

    def edited(*moves):
        p = pd.Plan.from_json(plan.to_json())
        for j, add, remove in moves:
            p.stages[j].nodes = [n for n in p.stages[j].nodes if n not in remove] + list(add)
        return p

    with pytest.raises(ValueError, match="plan stage 1 lists node 'node99', which this model"):
        plan_stage_of(grouped, edited((1, ["node99"], [])))
    with pytest.raises(ValueError, match=r"plan puts nodes \['node20'\] .* in no stage"):
        plan_stage_of(grouped, edited((1, [], ["node20"])))
    with pytest.raises(ValueError, match="plan lists node 'node2' in stages 0 and 1"):
        plan_stage_of(grouped, edited((1, ["node2"], [])))
    with pytest.raises(ValueError, match="plan stage 0 has .* parameter bytes but this model"):
        plan_stage_of(grouped, edited((0, [], ["node3"]), (1, ["node3"], [])))
    # The first group in the last stage: the data would flow backwards.
    moved = edited((0, [], ["node2"]), (1, ["node2"], []))
    for s in moved.stages:
        s.parameter_bytes = 0.0  # a hand-written plan without sizes skips that check
    with pytest.raises(ValueError, match=re.escape("operation 'layer1_0_conv1' (stage 0) uses "
                                                   "'relu', which stage 1 computes later")):
        split_model(model, [], (x,), stage_of=plan_stage_of(grouped, moved))
    everything = {n: 0 for n in plan_stage_of(grouped, plan)}
    with pytest.raises(ValueError, match="stage 1 has no operations"):
        split_model(model, [], (x,), stage_of=dict(everything, fc=2))
    with pytest.raises(ValueError, match="have no stage"):
        split_model(model, [], (x,), stage_of={"stem": 0})
    # A stage assignment that cuts between a size and its use (the grouping never does).
    shapes = _Shapes()
    names = [n.name for g in trace_groups(shapes, (torch.randn(3, 4),)).groups for n in g.nodes]
    with pytest.raises(ValueError, match="value 'size' .* is a int.*only tensors can cross"):
        split_model(shapes, [], (torch.randn(3, 4),),
                    stage_of={n: int(n in ("d", "view")) for n in names})


def test_pipedream_refuses_auto_balance_of_a_traced_model_without_a_usable_sample() -> None:
    with pytest.raises(ValueError, match=r"pass sample=\(inputs, targets\)"):
        pd.PipeDream(UNet(), F.cross_entropy, balance="auto")
    with torch.device("meta"):
        meta = UNet()
    with pytest.raises(ValueError, match="meta device cannot"):
        pd.PipeDream(meta, F.cross_entropy, balance="auto", sample=(torch.randn(2, 2, 8, 8), None))
    with pytest.raises(ValueError, match="balance='auto' and sample"):
        pd.PipeDream(UNet(), F.cross_entropy, balance=[1, 1])
