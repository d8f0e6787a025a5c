"""A profile as the chain ``plan --auto`` cuts (``_planning.profile_chain``): topological
order, the bytes crossing each cut, merging a large DAG where few bytes cross, and
``plan --auto`` on the shipped branching profiles (one process, exact equality)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

import pipedream_ext as pe
from pipedream_ext.__main__ import main as cli_main
from pipedream_ext._planning.profile_chain import chain_of_profile
from pipedream_ext.configuration import Configuration

DATA = Path(__file__).resolve().parent / "data" / "profiles"
MB = 1e6


def _diamond() -> "pe.ProfileGraph":
    """in -> a -> (b, c) -> d, file order a, c, b, d: ties go to the file's order."""
    g = pe.ProfileGraph()
    g.add_node("n0", "Input", 0.0, 0.0, 8 * MB, 0.0)
    for name, fwd, act, params in (("a", 1.0, 1 * MB, 10.0), ("c", 2.0, 3 * MB, 20.0),
                                   ("b", 3.0, 2 * MB, 30.0), ("d", 4.0, 4 * MB, 40.0)):
        g.add_node(name, name.upper(), fwd, 2 * fwd, act, params)
    for a, b in (("n0", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")):
        g.add_edge(a, b)
    return g


def test_a_branching_profile_is_cut_in_topological_order_with_the_bytes_crossing() -> None:
    # The planner's rule for an input source, as the nodes report it.
    assert [n["is_input"] for n in _diamond().nodes()] == [True, False, False, False, False]
    chain = chain_of_profile(_diamond(), batch_size=4)
    assert chain.nodes == [["n0", "a"], ["c"], ["b"], ["d"]]
    layers = chain.costs.layers
    per_sample = [round(x * 4 / MB, 9) for x in
                  (layer.output_bytes_per_sample for layer in layers)]
    # after a: a (used by c, b); after c: a (b still needs it) + c; after b: c + b;
    # the last layer's output goes to the loss: its own bytes.
    assert per_sample == [1, 1 + 3, 3 + 2, 4]
    assert [round(x.input_bytes_per_sample * 4 / MB, 9) for x in layers] == [8, 1, 4, 5]
    assert [round(x.forward_per_sample * 4e3, 9) for x in layers] == [1, 2, 3, 4]
    assert [round(x.backward_per_sample * 4e3, 9) for x in layers] == [2, 4, 6, 8]
    assert [x.parameter_bytes for x in layers] == [10, 20, 30, 40]
    assert [round(x.stash_bytes_per_sample * 4 / MB, 9) for x in layers] == [1, 3, 2, 4]
    assert chain.stage_nodes([2, 2]) == [["n0", "a", "c"], ["b", "d"]]


def test_a_chain_profile_keeps_one_layer_per_node() -> None:
    g = pe.ProfileGraph()
    g.add_node("in", "Input", 0.0, 0.0, 2 * MB, 0.0)
    for i in range(5):
        g.add_node(f"l{i}", f"L{i}", 1.0 + i, 2.0, (i + 1) * MB, 100.0 * i)
        g.add_edge("in" if i == 0 else f"l{i - 1}", f"l{i}")
    chain = chain_of_profile(g, batch_size=2, max_layers=2)  # a chain is never merged
    assert chain.nodes is None and chain.costs.group_of is None
    assert [x.output_bytes_per_sample for x in chain.costs.layers] == [(i + 1) * MB / 2 for i in range(5)]
    assert [x.input_bytes_per_sample for x in chain.costs.layers] == [MB] + [(i + 1) * MB / 2 for i in range(4)]
    assert chain.costs.names == [f"L{i}" for i in range(5)]


def _residual_blocks(blocks: int) -> "pe.ProfileGraph":
    """Blocks of 3 nodes, x -> (conv1 -> conv2) + x -> add; 10 MB inside a block,
    1 MB between blocks."""
    g = pe.ProfileGraph()
    g.add_node("in", "Input", 0.0, 0.0, MB, 0.0)
    last = "in"
    for k in range(blocks):
        names = [f"c1_{k}", f"c2_{k}", f"add_{k}"]
        for n, act in zip(names, (10 * MB, 10 * MB, MB)):
            g.add_node(n, n, 1.0, 2.0, act, 1.0)
        for a, b in ((last, names[0]), (names[0], names[1]), (names[1], names[2]), (last, names[2])):
            g.add_edge(a, b)
        last = names[2]
    return g


def test_a_large_profile_is_merged_where_few_bytes_cross() -> None:
    g = _residual_blocks(24)
    chain = chain_of_profile(g, batch_size=1, max_layers=6)
    assert len(chain.costs.layers) == 6
    nodes = [n for layer in chain.nodes for n in layer]
    assert sorted(nodes) == sorted(n["id"] for n in g.nodes())
    # Every merged layer ends at a block's end (1 MB crossing, never 11 or 20 inside).
    assert all(layer[-1].startswith("add_") for layer in chain.nodes), chain.nodes
    assert [x.output_bytes_per_sample for x in chain.costs.layers] == [MB] * 6
    assert sum(x.forward_per_sample for x in chain.costs.layers) == pytest.approx(72 * 1e-3)


def test_bad_profiles_are_refused_by_name() -> None:
    g = pe.ProfileGraph()
    g.add_node("in", "Input", 0.0, 0.0, MB, 0.0)
    for n in ("x", "y"):
        g.add_node(n, n, 1.0, 1.0, MB, 0.0)
    for a, b in (("in", "x"), ("x", "y"), ("y", "x")):
        g.add_edge(a, b)
    with pytest.raises(ValueError, match=r"cycle through \['x', 'y'\]"):
        chain_of_profile(g, batch_size=1)
    only = pe.ProfileGraph()
    only.add_node("in", "Input", 0.0, 0.0, MB, 0.0)
    with pytest.raises(ValueError, match="no computing node"):
        chain_of_profile(only, batch_size=1)
    with pytest.raises(ValueError, match="max_layers=0"):
        chain_of_profile(_diamond(), batch_size=1, max_layers=0)


def _stage_of(plan: "pe.Plan") -> Dict[str, int]:
    return {n: j for j, s in enumerate(plan.stages) for n in s.nodes}


@pytest.mark.parametrize("name", ["gnmt", "resnet18", "inception_v3"])
def test_plan_auto_plans_a_branching_profile(name: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """Every node in exactly one stage, every edge forward (a cut never sends
    backwards), the configuration's balance over the merged chain."""
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "--auto", "--profile", str(DATA / f"{name}.txt"), "--workers", "2",
                   "--bandwidth", "1e10", "--batch-size", "32", "--max-layers", "12",
                   "--schedule", "1f1b", "-o", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    plan, graph = pe.Plan.load(out), pe.load_profile(DATA / f"{name}.txt")
    # The table's balance counts merged layers, and says so.
    assert f"of the 12 layers the profile's {len(graph)} nodes (inputs included) were merged into" \
        in printed, printed
    stage = _stage_of(plan)
    ids: List[str] = [n["id"] for n in graph.nodes()]
    assert sorted(stage) == sorted(ids) and len(stage) == len(ids)
    assert all(stage[a] <= stage[b] for a, b in graph.edges())
    chosen = Configuration.from_dict(plan.configuration)
    assert len(plan.stages) == 2 and sum(chosen.balance) <= 12 and not plan.chain
