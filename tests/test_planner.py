"""Planner: Python API, plan.json, CLI, and every shipped profile."""
from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import List

import pytest

import pipedream_ext as pe
from pipedream_ext.__main__ import main
from pipedream_ext._planning import startup

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "profiles"
SHIPPED_PROFILES = sorted(DATA.glob("*.txt"))


def _two_layer_profile(path: Path) -> Path:
    path.write_text(
        "node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, "
        "activation_size=1000000.0, parameter_size=0.000\n"
        "node2 -- a -- forward_compute_time=10.000, backward_compute_time=20.000, "
        "activation_size=1000000.0, parameter_size=1000000000.000\n"
        "node3 -- b -- forward_compute_time=10.000, backward_compute_time=20.000, "
        "activation_size=1000000.0, parameter_size=1000000000.000\n"
        "\tnode1 -- node2\n\tnode2 -- node3"
    )
    return path


def test_golden_two_heavy_layers(tmp_path: Path) -> None:
    p = pe.plan(_two_layer_profile(tmp_path / "g.txt"), workers=2, bandwidth=1e9, cost_model="pipedream")
    assert [s.nodes for s in p.stages] == [["node1", "node2"], ["node3"]]
    assert p.layers == [(0, 1), (1, 2)]
    assert [s.ranks for s in p.stages] == [[0], [1]]
    assert p.time_per_stage == pytest.approx(0.03)
    assert p.data_parallel_time == pytest.approx(2.03)
    assert p.speedup_over_dp == pytest.approx(2.03 / 0.03)


def test_plan_json_round_trip(tmp_path: Path) -> None:
    p = pe.plan(DATA / "gnmt.txt", workers=[4, 2], bandwidth=[16e9, 1.25e9], memory=64e9)
    assert pe.Plan.from_json(p.to_json()) == p
    p.save(tmp_path / "plan.json")
    back = pe.Plan.load(tmp_path / "plan.json")
    assert back == p
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["num_workers"] == 8 and raw["topology"]["workers"] == [4, 2]
    assert raw["ranks"] == [s.ranks for s in p.stages]
    assert "layers" not in raw  # gnmt is a branching graph
    assert sorted(r for s in p.stages for r in s.ranks) == list(range(8))
    with pytest.raises(ValueError, match="not a pipedream_ext.plan"):
        pe.Plan.from_dict({"format": "other"})
    with pytest.raises(ValueError, match="malformed"):
        pe.Plan.from_json("{")


def test_plan_json_errors_name_the_file_and_field(tmp_path: Path) -> None:
    """Found by the plan_json fuzz target: KeyError, AttributeError, IndexError,
    TypeError, OverflowError and RecursionError escaped Plan.load."""
    d = pe.plan(DATA / "alexnet.txt", workers=4, bandwidth=16e9).to_dict()
    cases = {
        "lacks the field 'stages'": {k: v for k, v in d.items() if k != "stages"},
        "stage 0 must be a JSON object": dict(d, stages=[5]),
        "stage 0 field 'layers'": dict(d, stages=[dict(d["stages"][0], layers=[1])]),
        "stage 0 field 'replicas' is 'two'": dict(d, stages=[dict(d["stages"][0], replicas="two")]),
        "topology lacks the field 'bandwidth'": dict(d, topology={"workers": [4]}),
        "field 'time_per_stage'": dict(d, time_per_stage=10 ** 400),
        "field 'options'": dict(d, options="ab"),
    }
    path = tmp_path / "plan.json"
    for message, obj in cases.items():
        path.write_text(json.dumps(obj))
        with pytest.raises(ValueError, match=message) as info:
            pe.Plan.load(path)
        assert str(path) in str(info.value)
    path.write_text("[" * 100000)
    with pytest.raises(ValueError, match="malformed"):
        pe.Plan.load(path)
    path.write_bytes(b'{"format": "\xff"}')
    with pytest.raises(ValueError, match="plan.json"):
        pe.Plan.load(path)


# plan.json's key order is part of the file format: readers diff plans as text.
PLAN_JSON_KEYS = ["format", "version", "cost_model", "topology", "num_workers", "used_workers",
                  "time_per_stage", "data_parallel_time", "speedup_over_dp", "single_worker_time",
                  "state_kind", "num_states", "coarsened", "chain", "options", "data_parallel",
                  "sharding", "tensor_parallel", "sequence_parallel", "stages", "configuration", "ranks"]
STAGE_JSON_KEYS = ["nodes", "replicas", "ranks", "time", "compute_seconds", "parameter_bytes",
                   "activation_bytes", "memory_bytes", "model_state_bytes",
                   "stashed_activation_bytes", "tensor_parallel_seconds", "layers"]


def _chain_graph() -> "pe.ProfileGraph":
    graph = pe.ProfileGraph()
    graph.add_node("node1", "Input", 0.0, 0.0, 4e6, 0.0)
    for i in range(12):
        graph.add_node(f"node{i + 2}", f"Layer{i}", 1.0 + i % 4, 2.0 + i % 3, 1e6 * (1 + i % 5), 1e6 * (i % 3))
        graph.add_edge(f"node{i + 1}", f"node{i + 2}")
    return graph


def _schema_plans() -> List["pe.Plan"]:
    """A chain plan (stages carry layers), a branching one (layers None), a
    data-parallel one (data_parallel and sharding set) and a (pp, dp, tp) one."""
    return [pe.plan(_chain_graph(), workers=8, bandwidth=1.25e9, cost_model="pipedream",
                    activation_compression_ratio=1.0),
            pe.plan(DATA / "gnmt.txt", workers=[4, 2], bandwidth=[16e9, 1.25e9], two_bw=True),
            pe.plan(_chain_graph(), workers=4, bandwidth=[16e9, 1.25e9], data_parallel=2,
                    sharding="fsdp"),
            pe.plan(_chain_graph(), workers=2, bandwidth=[16e9, 1.25e9], data_parallel=2,
                    tensor_parallel=2, sequence_parallel=True)]


def test_plan_schema_round_trip_covers_every_field() -> None:
    """to_dict/from_dict/JSON agree, and every dataclass field is in plan.json."""
    for p in _schema_plans():
        d = p.to_dict()
        assert list(d) == PLAN_JSON_KEYS + (["layers"] if p.chain else []) + \
            (["mesh"] if p.data_parallel is not None else [])
        fields = {f.name for f in dataclasses.fields(pe.Plan)}
        assert fields == set(PLAN_JSON_KEYS) - {"format", "version", "ranks"}
        assert [list(s) for s in d["stages"]] == [STAGE_JSON_KEYS] * len(p.stages)
        assert [f.name for f in dataclasses.fields(pe.Stage)] == STAGE_JSON_KEYS
        assert list(d["topology"]) == [f.name for f in dataclasses.fields(pe.Topology)]
        back = pe.Plan.from_dict(json.loads(json.dumps(d)))
        assert back == p
        assert back.to_dict() == d and back.to_json() == p.to_json()
        for s in back.stages:
            assert pe.Stage.from_dict(s.to_dict()) == s
            assert s.layers is None or isinstance(s.layers, tuple)
        assert pe.Topology.from_dict(p.topology.to_dict()) == p.topology
        # to_dict hands out copies: editing them leaves the plan alone.
        d["stages"][0]["nodes"].append("x")
        d["options"]["straight"] = "x"
        d["topology"]["workers"].append(9)
        assert p.to_dict() == back.to_dict()


def test_plan_schema_from_the_planner_matches_from_dict() -> None:
    """plan() builds the dataclasses from the C++ dict with the same converters."""
    chain, branching, _, _ = _schema_plans()
    for p in (chain, branching):
        loaded = pe.Plan.from_json(p.to_json())
        for f in dataclasses.fields(pe.Plan):
            assert type(getattr(p, f.name)) is type(getattr(loaded, f.name)), f.name
        for s in p.stages:
            assert isinstance(s.replicas, int) and all(isinstance(r, int) for r in s.ranks)
            assert isinstance(s.time, float)
    assert chain.layers is not None and all(isinstance(x, tuple) for x in chain.layers)
    assert branching.layers is None and all(s.layers is None for s in branching.stages)


def test_plan_schema_names_missing_and_malformed_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _schema_plans()[0].to_dict()
    for cls, obj, where in ((pe.Plan, d, "plan"), (pe.Stage, d["stages"][1], "plan stage 1"),
                            (pe.Topology, d["topology"], "plan topology")):
        for f in dataclasses.fields(cls):
            def load(changed: dict) -> "pe.Plan":
                if cls is pe.Plan:
                    return pe.Plan.from_dict(changed)
                stages = [dict(x) for x in d["stages"]]
                if cls is pe.Stage:
                    stages[1] = changed
                    return pe.Plan.from_dict(dict(d, stages=stages))
                return pe.Plan.from_dict(dict(d, topology=changed))

            missing = {k: v for k, v in obj.items() if k != f.name}
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                with pytest.raises(ValueError, match=f"^{where} lacks the field '{f.name}'; write plans"):
                    load(missing)
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                loaded = load(missing)
                holder = {pe.Plan: loaded, pe.Stage: loaded.stages[1], pe.Topology: loaded.topology}[cls]
                assert getattr(holder, f.name) == default
            # True is no valid value for any non-bool field; "yes" none for a bool one.
            bad = "yes" if f.type in ("bool", bool) else True
            with pytest.raises(ValueError, match=f"^{where} field '{f.name}' is {bad!r}: expected"):
                load(dict(obj, **{f.name: bad}))
    with pytest.raises(ValueError, match="^plan stage 0 must be a JSON object, not list"):
        pe.Plan.from_dict(dict(d, stages=[[]]))
    with pytest.raises(ValueError, match=r"^plan topology: worker counts \[0\] must all be >= 1"):
        pe.Plan.from_dict(dict(d, topology=dict(d["topology"], workers=[0])))

    # The planner's dict goes through the same schema: a field it lacks is named.
    from pipedream_ext import planner
    real = planner._C.plan_graph

    def drop_time(*args: object, **kwargs: object) -> dict:
        raw = real(*args, **kwargs)
        del raw["stages"][0]["time"]
        return raw

    monkeypatch.setattr(planner._C, "plan_graph", drop_time)
    with pytest.raises(ValueError, match=r"^the C\+\+ planner's result stage 0 lacks the field 'time'$"):
        pe.plan(_chain_graph(), workers=2, bandwidth=1e9)


def test_chain_plans_carry_contiguous_layer_ranges() -> None:
    graph = pe.ProfileGraph()
    graph.add_node("node1", "Input", 0.0, 0.0, 4e6, 0.0)
    for i in range(12):
        graph.add_node(f"node{i + 2}", f"Layer{i}", 1.0 + i % 4, 2.0 + i % 3, 1e6 * (1 + i % 5), 1e6 * (i % 3))
        graph.add_edge(f"node{i + 1}", f"node{i + 2}")
    assert graph.is_chain()
    p = pe.plan(graph, workers=8, bandwidth=1.25e9, cost_model="pipedream",
                activation_compression_ratio=1.0)
    assert p.chain and p.layers is not None
    assert p.layers[0][0] == 0 and p.layers[-1][1] == len(graph) - 1
    for (_, end), (start, _) in zip(p.layers, p.layers[1:]):
        assert end == start
    assert sum(p.replicas) == 8
    assert json.loads(p.to_json())["layers"] == [list(x) for x in p.layers]


def test_options_straight_fewer_and_memory(tmp_path: Path) -> None:
    prof = DATA / "resnet18.txt"
    straight = pe.plan(prof, workers=4, bandwidth=1.25e9, straight=True)
    assert straight.replicas == [1, 1, 1, 1]
    profile = _two_layer_profile(tmp_path / "g.txt")
    with pytest.raises(ValueError, match=r"a straight plan on 5 workers needs 5 stages .* at most 2"):
        pe.plan(profile, workers=5, bandwidth=1e9, straight=True)
    fewer = pe.plan(profile, workers=5, bandwidth=1e9, straight=True, fewer_workers=True)
    assert fewer.used_workers == 2 and fewer.num_workers == 5
    with pytest.raises(ValueError, match="memory limit"):
        pe.plan(prof, workers=4, bandwidth=1.25e9, memory=1e6)
    with pytest.raises(ValueError, match="bandwidth"):
        pe.plan(prof, workers=[4, 4], bandwidth=[1e9])
    with pytest.raises(ValueError, match="cost model"):
        pe.plan(prof, workers=4, bandwidth=1e9, cost_model="fast")


def _chain(layers: int, forward_ms: float, backward_ms: float, weight_bytes: float,
           first: int = 0) -> "pe.ProfileGraph":
    """An input ``node{first}`` then ``layers`` equal layers with 1 MB of output each."""
    graph = pe.ProfileGraph()
    graph.add_node(f"node{first}", "Input", 0.0, 0.0, 1e6, 0.0)
    for i in range(first, first + layers):
        graph.add_node(f"node{i + 1}", f"Layer{i - first}", forward_ms, backward_ms, 1e6, weight_bytes)
        graph.add_edge(f"node{i}", f"node{i + 1}")
    return graph


def _uniform_chain(layers: int) -> "pe.ProfileGraph":
    """Input then ``layers`` equal layers (1 ms forward, 2 ms backward, 1 MB out and weights)."""
    return _chain(layers, 1.0, 2.0, 1e6)


def test_straight_plans_keep_a_state_per_worker() -> None:
    """The work budget thins a long chain's cuts, never below the stages a straight plan
    needs (issue 29: 5000 layers on 1024 straight workers blamed a memory limit of 0)."""
    chain = _uniform_chain(5000)
    p = pe.plan(chain, workers=1024, bandwidth=1e9, straight=True)
    assert p.coarsened and len(p.stages) == 1024 and p.replicas == [1] * 1024
    assert p.layers[0][0] == 0 and p.layers[-1][1] == 5000
    assert all(start < end for start, end in p.layers)
    assert all(end == start for (_, end), (start, _) in zip(p.layers, p.layers[1:]))
    # 5000 equal layers: no stage can be faster than 5000 / 1024 of them.
    assert p.time_per_stage >= 0.003 * 5000 / 1024 - 1e-12


def test_straight_plans_need_a_state_per_worker() -> None:
    """Fewer layers than straight stages names that cause and its fixes, not a memory limit;
    each fix plans."""
    chain = _uniform_chain(100)
    expected = (r"^a straight plan on 128 workers needs 128 stages \(one per worker, each at least "
                r"one layer\), but the profile splits into at most 100 \(100 planning states, 100 "
                r"layers\); plan on at most 100 workers, pass fewer_workers=True, or allow "
                r"replicated stages \(straight=False\)$")
    with pytest.raises(ValueError, match=expected):
        pe.plan(chain, workers=128, bandwidth=1e9, straight=True)
    assert len(pe.plan(chain, workers=128, bandwidth=1e9, straight=True, fewer_workers=True).stages) == 100
    assert len(pe.plan(chain, workers=100, bandwidth=1e9, straight=True).stages) == 100
    assert sum(pe.plan(chain, workers=128, bandwidth=1e9).replicas) == 128
    with pytest.raises(ValueError, match=r"^a straight plan on 128 pipeline workers needs 128 stages "
                                         r".*pass fewer_workers=True$"):
        pe.plan(chain, workers=128, bandwidth=[1e10, 1e9], data_parallel=2)


def test_parse_errors_name_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text(
        "node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, "
        "activation_size=1.0, parameter_size=0.000\n"
        "node2 -- a -- forward_compute_time=x, backward_compute_time=0.000, "
        "activation_size=1.0, parameter_size=0.000\n"
    )
    with pytest.raises(ValueError, match=r"bad.txt:2: field 'forward_compute_time'"):
        pe.load_profile(bad)
    with pytest.raises(FileNotFoundError):
        pe.load_profile(tmp_path / "missing.txt")


def _cli(capsys: pytest.CaptureFixture, args: List[str]) -> "tuple[int, str, str]":
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_plan_json_table_and_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prof = str(DATA / "resnet18.txt")
    rc, out, _ = _cli(capsys, ["plan", "--profile", prof, "--workers", "4,4", "--bandwidth",
                               "16e9,1.25e9", "--cost-model", "pipedream", "--json",
                               "-o", str(tmp_path / "plan.json")])
    assert rc == 0
    obj = json.loads(out)
    api = pe.plan(prof, workers=[4, 4], bandwidth=[16e9, 1.25e9], cost_model="pipedream")
    assert obj["time_per_stage"] == pytest.approx(api.time_per_stage)
    assert obj["speedup_over_dp"] == pytest.approx(api.speedup_over_dp)
    assert [s["replicas"] for s in obj["stages"]] == api.replicas
    assert all({"nodes", "replicas", "time"} <= set(s) for s in obj["stages"])
    assert pe.Plan.load(tmp_path / "plan.json") == pe.Plan.from_dict(obj)

    rc, out, _ = _cli(capsys, ["plan", "--profile", prof, "--workers", "8", "--bandwidth", "1.25e9",
                               "--straight", "--memory", "64e9", "--activation-compression-ratio", "2"])
    assert rc == 0
    assert "speedup over data parallelism" in out and "replicas" in out

    rc, out, _ = _cli(capsys, ["plan", "--profile", prof, "--workers", "4", "--bandwidth", "1e9",
                               "--max-states", "2", "--json"])
    assert rc == 0 and json.loads(out)["state_kind"] == "topological_cut"


def test_cli_plan_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    rc, _, err = _cli(capsys, ["plan", "--profile", str(tmp_path / "none.txt"), "--workers", "4",
                               "--bandwidth", "1e9"])
    assert rc == 2 and "error:" in err and "none.txt" in err
    rc, _, err = _cli(capsys, ["plan", "--profile", str(DATA / "alexnet.txt"), "--workers", "4,4",
                               "--bandwidth", "1e9"])
    assert rc == 2 and "bandwidth" in err


def test_cli_plan_auto_chooses_the_whole_configuration(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """plan --auto on a chain profile: a table of the best configurations, first the one
    the plan file records (stages over the layers it balances); a memory limit nothing
    fits and a missing --batch-size are refused (branching profiles:
    tests/test_profile_chain.py)."""
    import torch
    from torch import nn

    from pipedream_ext.configuration import Configuration

    torch.manual_seed(0)
    graph = tmp_path / "graph.txt"
    pe.profile(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]), torch.randn(16, 32),
               steps=2, warmup=1, output=str(graph))
    common = ["plan", "--auto", "--profile", str(graph), "--workers", "2", "--bandwidth", "1e9"]
    rc, out, _ = _cli(capsys, common + ["--batch-size", "16", "-o", str(tmp_path / "plan.json")])
    assert rc == 0
    plan = pe.Plan.load(tmp_path / "plan.json")
    chosen = Configuration.from_dict(plan.configuration)
    best = out.splitlines()[1].split()
    assert best[:2] == ["best", chosen.schedule] and int(best[3]) == chosen.microbatches, out
    assert len(out.splitlines()) == 2 + len(chosen.candidates) + 1  # the header, "wrote ..."
    assert sum(chosen.balance) == 6 and chosen.mesh == (2, 1, 1)
    assert chosen.predicted_step_seconds > 0 and chosen.microbatches in range(1, 17)
    starts = [sum(chosen.balance[:j]) for j in range(len(chosen.balance))]
    assert plan.cost_model == "configuration" and \
        [s.layers for s in plan.stages] == [(a, a + n) for a, n in zip(starts, chosen.balance)]
    rc, _, err = _cli(capsys, common + ["--batch-size", "16", "--memory", "1"])
    assert rc == 2 and "no configuration fits memory=1 bytes per rank" in err, err
    rc, _, err = _cli(capsys, common + ["--batch-size", "0"])
    assert rc == 2 and "--batch-size 0" in err, err
    rc, _, err = _cli(capsys, common)
    assert rc == 2 and "--auto needs --batch-size" in err, err


@pytest.mark.parametrize("path", SHIPPED_PROFILES, ids=lambda p: p.stem)
def test_every_shipped_profile_plans_flat_and_hierarchical(path: Path) -> None:
    graph = pe.load_profile(path)
    for workers, bandwidth in (([16], [1.25e9]), ([4, 4], [16e9, 1.25e9])):
        for model in ("pipedream", "default"):
            p = pe.plan(graph, workers=workers, bandwidth=bandwidth, cost_model=model)
            nodes = [n for s in p.stages for n in s.nodes]
            assert sorted(nodes) == sorted(n["id"] for n in graph.nodes())
            assert sorted(r for s in p.stages for r in s.ranks) == list(range(16))
            assert 0 < p.time_per_stage <= p.single_worker_time
            assert p.speedup_over_dp >= 1.0 - 1e-9  # plain DP is one candidate plan


# -- data parallelism and sharding inside stages (docs/planner.md) -------------------------
def _heavy_chain(layers: int = 4) -> "pe.ProfileGraph":
    """Layers of 30 ms (10 forward + 20 backward), 1 GB of weights, 1 MB of output."""
    return _chain(layers, 10.0, 20.0, 1e9, first=1)


def test_data_parallel_time_is_compute_and_sync_over_dp() -> None:
    """Per stage: (compute + 2 (dp-1)/dp weight bytes / dp bandwidth) / dp, both shardings."""
    dp_bw, pp_bw = 1e10, 1e12  # boundaries (2 MB at 1e12 B/s) never bind
    for sharding in ("fsdp", "replicate"):
        p = pe.plan(_heavy_chain(), workers=2, bandwidth=[dp_bw, pp_bw], data_parallel=2,
                    sharding=sharding)
        assert p.data_parallel == 2 and p.sharding == sharding and p.world_size == 4
        assert p.layers == [(0, 2), (2, 4)] and p.replicas == [1, 1]
        assert [s.ranks for s in p.stages] == [[0], [1]]
        for s in p.stages:
            assert s.compute_seconds == pytest.approx(0.06, rel=1e-12)
            assert s.parameter_bytes == 2e9
            # (0.06 + 2 * 1/2 * 2e9 / 1e10) / 2 = 0.13 s per minibatch
            assert s.time == pytest.approx((0.06 + 2 * (2 - 1) / 2 * 2e9 / dp_bw) / 2, rel=1e-12)
            assert s.time == pytest.approx(0.13, rel=1e-12)
        assert p.time_per_stage == pytest.approx(0.13, rel=1e-12)
        assert p.options["data_parallel_bandwidth"] == dp_bw
        # Plain data parallelism on all 4 ranks (dp level innermost, then the pipeline's):
        # level 1: max(0.12, 2 * 1 * 4e9 / (2 * 1e10)) / 2 = 0.2; level 2: max(0.2, 2 * 1 *
        # 4e9 / (2 * 1e12 * 2)) / 2 = 0.1.
        assert p.data_parallel_time == pytest.approx(0.1, rel=1e-12)
    # Four data-parallel ranks: (0.06 + 2 * 3/4 * 2e9 / 1e10) / 4 = 0.09.
    p4 = pe.plan(_heavy_chain(), workers=2, bandwidth=[dp_bw, pp_bw], data_parallel=4,
                 sharding="fsdp")
    assert p4.time_per_stage == pytest.approx(0.09, rel=1e-12)
    # Boundary transfers: each dp rank's own link carries its minibatches, so the
    # d links share them: 2 * 1e6 / (1e6 B/s * 2) = 1 s binds the stage a split added.
    slow = pe.plan(_heavy_chain(), workers=2, bandwidth=[dp_bw, 1e6], data_parallel=2)
    assert slow.stages[1].time == pytest.approx(1.0, rel=1e-12)
    assert slow.time_per_stage == pytest.approx(1.0, rel=1e-12)


def test_data_parallel_memory_per_rank_and_a_limit_only_fsdp_fits() -> None:
    """memory/rank = (weights + gradients + optimizer state) [/ dp under fsdp] + stashed
    activations of the minibatches in flight (pp - j at stage j, as without dp)."""
    fsdp = pe.plan(_heavy_chain(), workers=2, bandwidth=[1e10, 1e12], data_parallel=2,
                   sharding="fsdp")
    replicate = pe.plan(_heavy_chain(), workers=2, bandwidth=[1e10, 1e12], data_parallel=2)
    assert replicate.sharding == "replicate"  # the default: the conservative memory model
    for j, (f, r) in enumerate(zip(fsdp.stages, replicate.stages)):
        in_flight = 2 - j
        assert f.stashed_activation_bytes == r.stashed_activation_bytes == in_flight * 2e6
        # AdamW (optimizer_state=2): weights + gradients + 2 moments = 4 x 2e9 bytes.
        assert r.model_state_bytes == 4 * 2e9
        assert f.model_state_bytes == 4 * 2e9 / 2
        assert f.memory_bytes == f.model_state_bytes + f.stashed_activation_bytes
        assert r.memory_bytes == r.model_state_bytes + r.stashed_activation_bytes
    sgd = pe.plan(_heavy_chain(), workers=2, bandwidth=[1e10, 1e12], data_parallel=2,
                  sharding="fsdp", optimizer_state=0.0)
    assert sgd.stages[0].model_state_bytes == 2 * 2e9 / 2
    assert sgd.options["optimizer_state"] == 0.0
    # 5e9 bytes per rank: fsdp holds 4e9 + 4e6 on stage 0; replicate (and one rank per
    # stage, dp=1) would need 8e9 + 4e6, and every other split more on one stage.
    limited = pe.plan(_heavy_chain(), workers=2, bandwidth=[1e10, 1e12], memory=5e9,
                      data_parallel=2, sharding="fsdp")
    assert limited.layers == [(0, 2), (2, 4)]
    assert max(s.memory_bytes for s in limited.stages) == 4e9 + 4e6 <= 5e9
    with pytest.raises(ValueError, match=r"^no partition fits the memory limit of 5000000000\.0+ "
                                         r"bytes per worker \(2 workers x 2 data-parallel ranks, "
                                         r"sharding 'replicate'\); .* or use sharding 'fsdp' "
                                         r"\(divides weights, gradients and optimizer state by 2\)$"):
        pe.plan(_heavy_chain(), workers=2, bandwidth=[1e10, 1e12], memory=5e9, data_parallel=2,
                sharding="replicate")
    with pytest.raises(ValueError, match="no partition fits the memory limit of 5000000000"):
        pe.plan(_heavy_chain(), workers=2, bandwidth=1e12, memory=5e9, data_parallel=1)


@pytest.mark.parametrize("name,workers,bandwidth", [
    ("resnet18", [4], [1.25e9]), ("gnmt", [4, 2], [16e9, 1.25e9]), ("vgg16", [8], [1e10])])
def test_data_parallel_one_equals_the_straight_plan(name: str, workers: List[int],
                                                    bandwidth: List[float]) -> None:
    """dp=1 plans exactly today's straight plan (times, stages, ranks); only the memory
    model differs (weights, gradients and optimizer state instead of weight versions)."""
    straight = pe.plan(DATA / f"{name}.txt", workers=workers, bandwidth=bandwidth, straight=True)
    for sharding in ("fsdp", "replicate"):
        for bws in (bandwidth, [7e9] + bandwidth):  # the dp level's bandwidth may be given
            one = pe.plan(DATA / f"{name}.txt", workers=workers, bandwidth=bws, data_parallel=1,
                          sharding=sharding)
            assert one.time_per_stage == straight.time_per_stage
            assert one.data_parallel_time == straight.data_parallel_time
            assert one.topology == straight.topology and one.options["straight"] is True
            for a, b in zip(one.stages, straight.stages):
                assert (a.nodes, a.replicas, a.ranks, a.time, a.layers) == \
                    (b.nodes, b.replicas, b.ranks, b.time, b.layers)
                assert a.stashed_activation_bytes == b.stashed_activation_bytes
                assert a.model_state_bytes == 4 * a.parameter_bytes
            assert len(one.stages) == len(straight.stages)


def test_data_parallel_bad_input_names_the_value_and_the_fix() -> None:
    g = _heavy_chain()
    cases = [
        (dict(data_parallel=0), r"data_parallel=0 must be an integer >= 1"),
        (dict(data_parallel=True), r"data_parallel=True must be an integer >= 1"),
        (dict(data_parallel=2.0), r"data_parallel=2.0 must be an integer >= 1"),
        (dict(data_parallel=2, sharding="zero"), r"sharding='zero' is unknown; use 'fsdp'"),
        (dict(sharding="fsdp"), r"sharding='fsdp' applies to data-parallel ranks inside stages; "
                                r"pass data_parallel=N"),
        (dict(data_parallel=2, straight=False), r"replaces PipeDream's replicas.*drop "
                                                r"straight=False"),
        (dict(data_parallel=2, cost_model="pipedream"), r"default cost model, not 'pipedream'"),
        (dict(data_parallel=2, two_bw=True), r"drop two_bw"),
        (dict(data_parallel=2, optimizer_state=-1.0), r"optimizer state -1\.0+ bytes per weight "
                                                      r"byte is invalid; use 2 for AdamW"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            pe.plan(g, workers=2, bandwidth=[1e10, 1e9], **kwargs)
    with pytest.raises(ValueError, match=r"data_parallel=2 with pipeline workers \[2\] needs 2 "
                                         r"bandwidths, got 1 \(\[1000000000\.0\]\): first the "
                                         r"bytes/s among a stage's data-parallel ranks"):
        pe.plan(g, workers=2, bandwidth=1e9, data_parallel=2)
    with pytest.raises(ValueError, match="give one bandwidth per level"):
        pe.plan(g, workers=2, bandwidth=[1e10, 1e9])  # no data_parallel: one per level


def test_data_parallel_plans_round_trip_and_show_memory_per_rank(tmp_path: Path) -> None:
    p = pe.plan(_heavy_chain(), workers=2, bandwidth=[1e10, 1e12], data_parallel=2,
                sharding="fsdp")
    p.save(tmp_path / "plan.json")
    assert pe.Plan.load(tmp_path / "plan.json") == p
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["data_parallel"] == 2 and raw["sharding"] == "fsdp"
    assert raw["stages"][0]["model_state_bytes"] == 4e9
    table = p.table()
    assert "x 2 data-parallel ranks per stage (fsdp), 4 ranks in all" in table
    assert "memory/rank (MB)" in table and "state (MB)" in table
    assert "4004.0      4000.0               4.0" in table  # stage 0: total, state, activations
    # A plan without data parallelism keeps data_parallel and sharding None.
    classic = pe.plan(_heavy_chain(), workers=2, bandwidth=1e12)
    assert classic.data_parallel is None and classic.sharding is None and classic.world_size == 2
    assert "data-parallel ranks" not in classic.table()


def test_cli_plan_with_data_parallel_and_sharding(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    prof = tmp_path / "graph.txt"
    _heavy_chain().save(str(prof))
    args = ["plan", "--profile", str(prof), "--workers", "2", "--bandwidth", "1e10,1e12",
            "--data-parallel", "2", "--sharding", "fsdp", "--memory", "5e9"]
    rc, out, _ = _cli(capsys, args + ["-o", str(tmp_path / "plan.json")])
    assert rc == 0
    assert "2 stage(s) on 2/2 workers (levels 2) x 2 data-parallel ranks per stage (fsdp)" in out
    assert "4004.0" in out and f"wrote {tmp_path / 'plan.json'}" in out
    api = pe.plan(prof, workers=2, bandwidth=[1e10, 1e12], memory=5e9, data_parallel=2,
                  sharding="fsdp")
    assert pe.Plan.load(tmp_path / "plan.json") == api
    rc, out, _ = _cli(capsys, args[:-6] + ["--data-parallel", "2", "--json",
                                           "--optimizer-state", "1"])
    assert rc == 0 and json.loads(out)["sharding"] == "replicate"
    assert json.loads(out)["stages"][0]["model_state_bytes"] == 3 * 2e9
    rc, _, err = _cli(capsys, args[:-4] + ["--memory", "5e9"])  # replicate does not fit
    assert rc == 2 and "no partition fits the memory limit" in err and "sharding 'fsdp'" in err
    rc, _, err = _cli(capsys, ["plan", "--profile", str(prof), "--workers", "2", "--bandwidth",
                               "1e9", "--data-parallel", "0"])
    assert rc == 2 and "data_parallel=0 must be an integer >= 1" in err
    with pytest.raises(SystemExit) as info:  # argparse's own choices
        main(["plan", "--profile", str(prof), "--workers", "2", "--bandwidth", "1e9",
              "--data-parallel", "2", "--sharding", "zero"])
    assert info.value.code == 2 and "invalid choice: 'zero'" in capsys.readouterr().err


def test_mesh_planning_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto_plan passes data_parallel and sharding to plan (pp = world / dp) and the
    mesh checks refuse plans that do not fit it; without them nothing changes."""
    assert startup.mesh_shape(8, 2, per_node=4) == [2, 2]  # 2 stages x 2 dp ranks per node
    assert startup.mesh_shape(8, 2, per_node=8) == [4]
    assert startup.mesh_shape(8, 4, per_node=2) == [2]  # dp spans nodes: one level
    with pytest.raises(ValueError, match=r"data_parallel=3 must be a positive divisor of the "
                                         r"world size 8"):
        startup.mesh_shape(8, 3)
    graph = _heavy_chain()
    world = types.SimpleNamespace(get_world_size=lambda group: 4, get_rank=lambda group: 0)
    monkeypatch.setattr(startup, "dist", world)
    monkeypatch.setattr(startup.collectives, "dist", world)  # from_rank_zero asks it the rank
    monkeypatch.setattr(startup.collectives, "broadcast_bytes", lambda payload, src, group: payload)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    def auto(**kwargs: object) -> "pe.Plan":
        return startup.auto_plan(None, None, (None, None), kwargs.pop("bandwidth"),
                                 pe.schedules.traits("1f1b"), None, lambda: graph, **kwargs)

    made = auto(bandwidth=[1e10, 1e12], data_parallel=2, sharding="fsdp")
    assert made == pe.plan(graph, workers=2, bandwidth=[1e10, 1e12], data_parallel=2,
                           sharding="fsdp")
    assert auto(bandwidth=[1e12]) == pe.plan(graph, workers=4, bandwidth=1e12)  # unchanged
    with pytest.raises(ValueError, match=r"bandwidth lists 1 levels but a mesh of 2 data-parallel "
                                         r"ranks per stage and pipeline levels \[2\] needs 2: the "
                                         r"dp ranks' bytes/s first"):
        auto(bandwidth=[1e12], data_parallel=2, sharding="fsdp")

    assert startup.partition_from_plan(made, 4, 2, data_parallel=2, sharding="fsdp") == ([2, 2], None)
    assert startup.check_plan_world(made, 2, 2, "fsdp") is None
    with pytest.raises(ValueError, match=r"the plan was made for 2 data-parallel ranks per stage "
                                         r"with sharding 'fsdp', but the mesh has 2 with "
                                         r"'replicate'.*--data-parallel 2 --sharding replicate"):
        startup.check_plan_world(made, 2, 2, "replicate")
    with pytest.raises(ValueError, match=r"made for 2 data-parallel ranks .* the mesh has 4"):
        startup.check_plan_world(made, 2, 4, "fsdp")
    replicated = pe.plan(_chain_graph(), workers=4, bandwidth=1e12)
    assert any(r > 1 for r in replicated.replicas)
    with pytest.raises(ValueError, match=r"the plan replicates stages PipeDream's way .* re-plan "
                                         r"with data_parallel"):
        startup.check_plan_world(replicated, 4, 2, "fsdp")


# -- tensor (and sequence) parallelism inside stages: a (pp, dp, tp) mesh ------------------
def _exact_blocks(layers: int = 4) -> "pe.ProfileGraph":
    """Layers of 1 s (250 ms forward, 750 ms backward), 2^20 output bytes and 2^30 weight
    bytes: every number of their plans is exact in binary."""
    graph = pe.ProfileGraph()
    graph.add_node("node1", "Input", 0.0, 0.0, 2.0 ** 20, 0.0)
    for i in range(layers):
        graph.add_node(f"node{i + 2}", f"Block{i}", 250.0, 750.0, 2.0 ** 20, 2.0 ** 30)
        graph.add_edge(f"node{i + 1}", f"node{i + 2}")
    return graph


def test_tensor_parallel_time_memory_and_mesh_layout() -> None:
    """Per stage: compute / tp + 4 all-reduces of each layer's output (2 (tp-1)/tp of it per
    rank at the tp bandwidth); state / tp; activations / tp only with SP."""
    for sp in (False, True):
        p = pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, tensor_parallel=2,
                    sequence_parallel=sp)
        # data_parallel defaults to 1: a (pp, 1, tp) mesh.
        assert (p.data_parallel, p.sharding, p.tensor_parallel, p.sequence_parallel) == \
            (1, "replicate", 2, sp)
        assert p.world_size == 4 and p.mesh_shape == (2, 1, 2)
        assert p.mesh_ranks == [[0, 1], [2, 3]]
        assert p.options["tensor_parallel_bandwidth"] == 2.0 ** 30  # the fastest level
        assert p.options["tensor_parallel_all_reduces"] == 4.0
        expected = 2.0 / 2 + 2 * 4 * (2 * (2 - 1) / 2) * 2.0 ** 20 / 2.0 ** 30
        assert expected == 1.0078125 and p.time_per_stage == expected
        for j, s in enumerate(p.stages):
            assert s.time == expected and s.tensor_parallel_seconds == 2.0 ** -7
            assert s.compute_seconds == 2.0 and s.parameter_bytes == 2.0 ** 31  # unsharded
            assert s.model_state_bytes == 4 * 2.0 ** 31 / 2  # weights, grads, AdamW moments
            per_rank = 2.0 ** 21 / (2 if sp else 1)
            assert s.stashed_activation_bytes == (2 - j) * per_rank
        assert p.data_parallel_time == 1.0  # plain dp on all 4 GPUs, tp's level innermost
    # Degree 4, 8 all-reduces per layer, a slower tp link: 2 s / 4 + 2 x 8 x 3/2 x 2^20 / 2^29.
    p = pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, tensor_parallel=4,
                tensor_parallel_bandwidth=2.0 ** 29, tensor_parallel_all_reduces=8)
    assert p.time_per_stage == 0.5 + 2 * 8 * 1.5 / 512


def test_tensor_parallel_fits_a_model_that_did_not_fit() -> None:
    """4 x 2^31 B of state per 2-layer stage does not fit 2^32 + 2^23 B per rank; tp 2
    halves it; a tighter limit needs SP for stage 0's two stashed minibatches."""
    limit = 2.0 ** 32 + 2.0 ** 23
    with pytest.raises(ValueError, match="no partition fits the memory limit"):
        pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, memory=limit, data_parallel=1)
    p = pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, memory=limit, tensor_parallel=2)
    assert p.stages[0].memory_bytes == 2.0 ** 32 + 2.0 ** 22 <= limit
    tight = 2.0 ** 32 + 2.0 ** 21 + 2.0 ** 20
    with pytest.raises(ValueError, match=r"\(2 workers x 1 data-parallel ranks x 2 tensor-parallel "
                                         r"ranks, sharding 'replicate'\); .* or use sequence "
                                         r"parallelism \(divides stashed activations by 2\)$"):
        pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, memory=tight, tensor_parallel=2)
    sp = pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, memory=tight, tensor_parallel=2,
                 sequence_parallel=True)
    assert sp.stages[0].memory_bytes == 2.0 ** 32 + 2.0 ** 21


def _without_tp(p: "pe.Plan") -> str:
    """``p``'s plan.json as a plan made without tensor_parallel would write it."""
    d = p.to_dict()
    d["tensor_parallel"], d["sequence_parallel"] = None, False
    for key in ("tensor_parallel_bandwidth", "tensor_parallel_all_reduces"):
        d["options"].pop(key)
    return json.dumps(d, indent=2)


@pytest.mark.parametrize("path", SHIPPED_PROFILES, ids=lambda p: p.stem)
def test_tensor_parallel_one_is_byte_identical(path: Path) -> None:
    """tensor_parallel=1 (whatever the other tp options) writes, but for the recorded tp
    fields, the very plan.json of the same mesh plan without it."""
    graph = pe.load_profile(path)
    for kwargs in (dict(data_parallel=1), dict(data_parallel=2, sharding="fsdp", memory=64e9)):
        before = pe.plan(graph, workers=[4], bandwidth=[16e9, 1.25e9], **kwargs)
        one = pe.plan(graph, workers=[4], bandwidth=[16e9, 1.25e9], tensor_parallel=1,
                      sequence_parallel=True, tensor_parallel_bandwidth=1e6,
                      tensor_parallel_all_reduces=7, **kwargs)
        assert one.tensor_parallel == 1 and one.world_size == before.world_size
        assert _without_tp(one) == before.to_json()
        assert all(s.tensor_parallel_seconds == 0.0 for s in one.stages)


def test_tensor_parallel_plans_round_trip_and_old_plan_json_loads(tmp_path: Path) -> None:
    p = pe.plan(_exact_blocks(), workers=2, bandwidth=[2.0 ** 33, 2.0 ** 30], data_parallel=2,
                sharding="fsdp", tensor_parallel=2, sequence_parallel=True)
    p.save(tmp_path / "plan.json")
    assert pe.Plan.load(tmp_path / "plan.json") == p
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["tensor_parallel"] == 2 and raw["sequence_parallel"] is True
    assert raw["mesh"] == {"dims": ["pp", "dp", "tp"], "shape": [2, 2, 2],
                           "stage_ranks": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    # The tp bandwidth defaults to the fastest given, the dp ranks' 2^33 B/s:
    # 2 layers x 4 x 1 x 2^20 B / 2^33 B/s.
    assert raw["options"]["tensor_parallel_bandwidth"] == 2.0 ** 33
    assert raw["stages"][0]["tensor_parallel_seconds"] == 2.0 ** -10
    # A plan.json written before tensor parallelism (no tp keys, no mesh view) loads
    # with tensor_parallel None, sequence_parallel False and no TP seconds.
    old = pe.plan(_exact_blocks(), workers=2, bandwidth=[2.0 ** 33, 2.0 ** 30], data_parallel=2)
    d = old.to_dict()
    for key in ("tensor_parallel", "sequence_parallel", "mesh"):
        del d[key]
    for stage in d["stages"]:
        del stage["tensor_parallel_seconds"]
    assert pe.Plan.from_dict(d) == old and old.tensor_parallel is None


def test_tensor_parallel_bad_input_names_the_value_and_the_fix() -> None:
    g = _exact_blocks()
    cases = [
        (dict(tensor_parallel=0), r"^tensor_parallel=0 must be an integer >= 1 \(tensor-parallel "
                                  r"ranks per data-parallel rank of a stage"),
        (dict(tensor_parallel=True), r"^tensor_parallel=True must be an integer >= 1"),
        (dict(tensor_parallel=2.0), r"^tensor_parallel=2\.0 must be an integer >= 1"),
        (dict(sequence_parallel=True), r"^sequence_parallel=True applies to tensor-parallel ranks "
                                       r"inside stages; pass tensor_parallel=T"),
        (dict(tensor_parallel_bandwidth=1e11), r"^tensor_parallel_bandwidth=100000000000\.0 "
                                               r"applies to tensor-parallel"),
        (dict(tensor_parallel_all_reduces=2), r"^tensor_parallel_all_reduces=2 applies"),
        (dict(tensor_parallel=2, tensor_parallel_bandwidth=0), r"^tensor_parallel_bandwidth=0 "
                                                               r"must be a positive number"),
        (dict(tensor_parallel=2, tensor_parallel_all_reduces=-1),
         r"^tensor_parallel_all_reduces=-1 must be a number >= 0"),
        (dict(tensor_parallel=2, straight=False), r"^tensor_parallel=2 with straight=False: "
                                                  r"stages are straight .* drop straight=False"),
        (dict(tensor_parallel=2, cost_model="pipedream"),
         r"^tensor_parallel=2 with cost_model='pipedream': .* use cost_model='default'"),
        (dict(tensor_parallel=2, two_bw=True), r"^tensor_parallel=2 with two_bw=True: .* drop "
                                               r"two_bw"),
        (dict(tensor_parallel=2, data_parallel=2), r"^data_parallel=2 with pipeline workers \[2\] "
                                                   r"needs 2 bandwidths"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            pe.plan(g, workers=2, bandwidth=2.0 ** 30, **kwargs)


def test_cli_plan_prints_the_three_dimensional_mesh(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    prof = tmp_path / "graph.txt"
    _exact_blocks().save(str(prof))
    args = ["plan", "--profile", str(prof), "--workers", "2", "--bandwidth", "8e9,1e9",
            "--data-parallel", "2", "--sharding", "fsdp", "--tensor-parallel", "2",
            "--sequence-parallel", "--tp-bandwidth", "1073741824"]
    rc, out, _ = _cli(capsys, args + ["-o", str(tmp_path / "plan.json")])
    assert rc == 0
    assert ("2 stage(s) on 2/2 workers (levels 2) x 2 data-parallel ranks per stage (fsdp) x 2 "
            "tensor-parallel ranks (sequence parallel), 8 ranks in all") in out
    assert "mesh (pp 2, dp 2, tp 2), dims ('pp', 'dp', 'tp'): rank = (pp * 2 + dp) * 2 + tp" in out
    assert "  stage 0: ranks 0-3 (dp 2 x tp 2); tensor-parallel all-reduces 7.812 ms" in out
    assert "  stage 1: ranks 4-7 (dp 2 x tp 2)" in out
    api = pe.plan(prof, workers=2, bandwidth=[8e9, 1e9], data_parallel=2, sharding="fsdp",
                  tensor_parallel=2, sequence_parallel=True, tensor_parallel_bandwidth=2.0 ** 30)
    assert pe.Plan.load(tmp_path / "plan.json") == api
    rc, out, _ = _cli(capsys, ["plan", "--profile", str(prof), "--workers", "2", "--bandwidth",
                               "1e9", "--tensor-parallel", "4", "--tp-all-reduces", "0", "--json"])
    obj = json.loads(out)
    assert rc == 0 and obj["tensor_parallel"] == 4 and obj["data_parallel"] == 1
    assert obj["mesh"]["shape"] == [2, 1, 4] and obj["time_per_stage"] == 0.5
    rc, _, err = _cli(capsys, ["plan", "--profile", str(prof), "--workers", "2", "--bandwidth",
                               "1e9", "--sequence-parallel"])
    assert rc == 2 and "sequence_parallel=True applies to tensor-parallel ranks" in err
    rc, _, err = _cli(capsys, ["plan", "--profile", str(prof), "--workers", "2", "--bandwidth",
                               "1e9", "--tensor-parallel", "0"])
    assert rc == 2 and "tensor_parallel=0 must be an integer >= 1" in err


def test_a_saved_plan_must_be_made_for_the_meshs_tensor_parallel_size() -> None:
    """A mesh plan's tp size is the mesh's (a missing 'tp' dimension has size 1): a tp 2
    plan on a pp2 x dp2 mesh would run its stages on ranks with twice the memory and
    compute it counted per rank; refused naming both sizes and the fix."""
    made = pe.plan(_exact_blocks(), workers=2, bandwidth=[2.0 ** 33, 2.0 ** 30], data_parallel=2,
                   tensor_parallel=2)
    assert startup.check_plan_world(made, 2, 2, "replicate", tensor_parallel=2) is None
    assert startup.partition_from_plan(made, 4, 2, data_parallel=2, sharding="replicate",
                                       tensor_parallel=2) == ([2, 2], None)
    on_pp_dp = (r"^the plan was made for 2 tensor-parallel ranks per data-parallel rank \(a \(2, "
                r"2, 2\) \(pp, dp, tp\) mesh, stage 0 on ranks \[0, 1, 2, 3\]\), but the mesh "
                r"has tp size 1 \(no 'tp' dimension\), so its memory and time per rank do not "
                r"hold; re-plan with --data-parallel 2 --sharding replicate \(no "
                r"--tensor-parallel\), or run it on a \(pp, dp, tp\) = \(2, 2, 2\) mesh with a "
                r"tensor_parallel= plan$")
    with pytest.raises(ValueError, match=on_pp_dp):
        startup.check_plan_world(made, 2, 2, "replicate")
    with pytest.raises(ValueError, match=on_pp_dp):
        startup.partition_from_plan(made, 4, 2, data_parallel=2, sharding="replicate")
    with pytest.raises(ValueError, match=r"made for 2 tensor-parallel ranks .* the mesh has tp "
                                         r"size 4, .* re-plan with --data-parallel 2 --sharding "
                                         r"fsdp --tensor-parallel 4, or run it"):
        startup.check_plan_world(made, 2, 2, "fsdp", tensor_parallel=4)
    # A mesh plan without tp on a tp mesh counts tp times the state per rank: refused too.
    no_tp = pe.plan(_exact_blocks(), workers=2, bandwidth=[2.0 ** 33, 2.0 ** 30], data_parallel=2)
    with pytest.raises(ValueError, match=r"made for 1 tensor-parallel ranks .* \(a \(2, 2, 1\) "
                                         r".* tp size 2, .* --tensor-parallel 2, or run it"):
        startup.check_plan_world(no_tp, 2, 2, "replicate", tensor_parallel=2)
    # tp 1 is no tp; a plan made without data_parallel (no mesh) runs on any mesh, as before.
    one = pe.plan(_exact_blocks(), workers=2, bandwidth=[2.0 ** 33, 2.0 ** 30], data_parallel=2,
                  tensor_parallel=1)
    assert startup.check_plan_world(one, 2, 2, "replicate") is None
    assert startup.check_plan_world(no_tp, 2, 2, "replicate", tensor_parallel=1) is None
    plain = pe.plan(_exact_blocks(), workers=2, bandwidth=2.0 ** 30, straight=True)
    assert startup.check_plan_world(plain, 2, 2, "replicate", tensor_parallel=2) is None
    # Both sizes wrong: the tp message first, its fix naming both.
    with pytest.raises(ValueError, match=r"tp size 4, .* re-plan with --data-parallel 1 "
                                         r"--sharding replicate --tensor-parallel 4"):
        startup.check_plan_world(made, 2, 1, "replicate", tensor_parallel=4)


def test_balance_auto_plans_for_the_meshs_tensor_parallel_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto_plan on a (pp, dp, tp) mesh plans pp = world / (dp * tp) workers with the tp
    size (and SP) it is given; measuring, rank 0 probes its tp neighbour (rank 1, the tp
    bandwidth), its dp neighbour (rank tp) and the next node's first stage (rank
    stages per node x dp x tp)."""
    assert startup.mesh_shape(8, 1, per_node=4, tensor_parallel=2) == [2, 2]
    assert startup.mesh_shape(8, 2, per_node=4, tensor_parallel=2) == [1, 2]
    assert startup.mesh_shape(8, 2, per_node=8, tensor_parallel=2) == [2]
    with pytest.raises(ValueError, match=r"data_parallel=3 must be a positive divisor of the world "
                                         r"size 16 / tensor_parallel 2 \(the mesh is pp x dp x tp"):
        startup.mesh_shape(16, 3, tensor_parallel=2)
    graph = _exact_blocks()
    world = types.SimpleNamespace(get_world_size=lambda group: 8, get_rank=lambda group: 0)
    monkeypatch.setattr(startup, "dist", world)
    monkeypatch.setattr(startup.collectives, "dist", world)  # from_rank_zero asks it the rank
    monkeypatch.setattr(startup.collectives, "broadcast_bytes", lambda payload, src, group: payload)
    probes: List["tuple[int, int]"] = []

    def measure(group: object, a: int, b: int) -> float:
        probes.append((a, b))
        return {1: 2.0 ** 36, 2: 2.0 ** 33, 4: 2.0 ** 30}[b]

    monkeypatch.setattr(startup.collectives, "measure_bandwidth", measure)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    def auto(bandwidth: object, **kwargs: object) -> "pe.Plan":
        return startup.auto_plan(None, None, (None, None), bandwidth, pe.schedules.traits("1f1b"),
                                 None, lambda: graph, **kwargs)

    for sp in (False, True):
        made = auto(None, data_parallel=2, sharding="fsdp", tensor_parallel=2, sequence_parallel=sp)
        assert sorted(probes) == [(0, 1), (0, 2), (0, 4)]
        probes.clear()
        # One stage per node of 4 ranks (dp 2 x tp 2): levels [1, 2], the first unmeasured.
        assert made == pe.plan(graph, workers=[1, 2], bandwidth=[2.0 ** 33, 1e10, 2.0 ** 30],
                               data_parallel=2, sharding="fsdp", tensor_parallel=2,
                               sequence_parallel=sp, tensor_parallel_bandwidth=2.0 ** 36)
        assert made.mesh_shape == (2, 2, 2) and made.sequence_parallel is sp
    # Given bandwidths: the tp bandwidth is the planner's default (the fastest given).
    monkeypatch.setattr(world, "get_world_size", lambda group: 4)
    made = auto([2.0 ** 30], data_parallel=1, sharding="replicate", tensor_parallel=2)
    assert not probes
    assert made == pe.plan(graph, workers=2, bandwidth=2.0 ** 30, data_parallel=1,
                           tensor_parallel=2)


@pytest.mark.parametrize("name", ["resnet18", "gnmt"])
def test_tensor_parallel_in_degenerate_hierarchies_equals_the_flat_plan(name: str) -> None:
    """TP is charged once, at the lowest level: pipeline levels [4, 1] and [1, 4] plan as
    the flat [4] does."""
    graph = pe.load_profile(DATA / f"{name}.txt")
    tp = dict(data_parallel=2, sharding="fsdp", tensor_parallel=2, sequence_parallel=True,
              tensor_parallel_bandwidth=5e10, memory=8e9)
    flat = pe.plan(graph, workers=[4], bandwidth=[16e9, 1.25e9], **tp)
    assert 0 < flat.time_per_stage and all(s.tensor_parallel_seconds > 0 for s in flat.stages)
    for workers, bandwidth in (([4, 1], [16e9, 1.25e9, 1e9]), ([1, 4], [16e9, 1e9, 1.25e9])):
        p = pe.plan(graph, workers=workers, bandwidth=bandwidth, **tp)
        assert p.time_per_stage == pytest.approx(flat.time_per_stage, rel=1e-12)
        assert [s.nodes for s in p.stages] == [s.nodes for s in flat.stages]
        assert [s.tensor_parallel_seconds for s in p.stages] == \
            [s.tensor_parallel_seconds for s in flat.stages]
