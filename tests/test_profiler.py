"""Profiler: per-layer timing and sizes on stock PyTorch, graph.txt, CLI."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import pipedream_ext as pe
from pipedream_ext.__main__ import main


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_profile_measures_every_layer(tmp_path: Path) -> None:
    model = _mlp()
    x = torch.randn(16, 1, 8, 8)
    g = pe.profile(model, x, steps=3, warmup=1, output=tmp_path / "graph.txt")
    nodes = g.nodes()
    assert [n["id"] for n in nodes] == ["node1", "node2", "node3", "node4", "node5"]
    assert nodes[0]["description"] == "Input" and nodes[0]["activation_bytes"] == 16 * 64 * 4
    assert g.is_chain()
    assert [n["activation_bytes"] for n in nodes[1:]] == [16 * 64 * 4, 16 * 32 * 4, 16 * 32 * 4, 16 * 10 * 4]
    assert [n["parameter_bytes"] for n in nodes[1:]] == [0, (64 * 32 + 32) * 4, 0, (32 * 10 + 10) * 4]
    for n in nodes[1:]:
        assert n["forward_ms"] > 0 and n["backward_ms"] > 0
    # Written in PipeDream's format and read back identically.
    back = pe.load_profile(tmp_path / "graph.txt")
    assert back.to_string() == g.to_string()
    assert "forward_compute_time=" in (tmp_path / "graph.txt").read_text()
    # Profiling leaves the model as it was.
    assert model.training and all(p.grad is None for p in model.parameters())
    p = pe.plan(back, workers=2, bandwidth=1e9)
    assert p.layers is not None and p.layers[0][0] == 0 and p.layers[-1][1] == 4


def test_profile_with_loss_and_integer_inputs() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 6, 5))
    x = torch.randint(0, 50, (4, 6))
    target = torch.randint(0, 5, (4,))
    g = pe.profile(model, x, loss_fn=nn.functional.cross_entropy, target=target, steps=2, warmup=0)
    emb = g.nodes()[1]
    assert emb["parameter_bytes"] == 50 * 8 * 4
    assert emb["backward_ms"] > 0  # the embedding's weight gradient is timed
    model.eval()
    pe.profile(model, x, steps=1, warmup=0)
    assert not model.training


def test_profile_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="only apply to traced models"):
        pe.profile(_mlp(), torch.randn(1, 64), depth=1)
    with pytest.raises(ValueError, match="empty"):
        pe.profile(nn.Sequential(), torch.randn(1, 2))
    with pytest.raises(ValueError, match="steps"):
        pe.profile(_mlp(), torch.randn(1, 64), steps=0)


def test_cli_profile_then_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "tiny_models.py").write_text(textwrap.dedent("""
        from torch import nn
        def make():
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
        class Untraceable(nn.Module):
            def forward(self, x):
                return x if x.sum() > 0 else -x
        def untraceable():
            return Untraceable()
        def not_a_module():
            return 3
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["profile", "--model", "tiny_models:make", "--input-shape", "8,1,8,8", "--steps", "2",
               "--warmup", "0", "-o", "graph.txt"])
    assert rc == 0 and (tmp_path / "graph.txt").exists()
    assert len(pe.load_profile(tmp_path / "graph.txt")) == 5
    rc = main(["plan", "--profile", "graph.txt", "--workers", "2", "--bandwidth", "1e9", "-o", "plan.json"])
    assert rc == 0 and pe.Plan.load(tmp_path / "plan.json").layers is not None
    capsys.readouterr()
    assert main(["profile", "--model", "tiny_models:untraceable", "--input-shape", "1,2"]) == 2
    assert "Untraceable cannot be traced with torch.fx" in capsys.readouterr().err
    assert main(["profile", "--model", "tiny_models:not_a_module", "--input-shape", "1,2"]) == 2
    assert "must return an nn.Module" in capsys.readouterr().err
    assert main(["profile", "--model", "tiny_models", "--input-shape", "1,2"]) == 2
    sys.modules.pop("tiny_models", None)


def test_cli_profile_of_a_traced_model_writes_its_edges_then_plans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A factory returning any nn.Module: its traced graph, one node per group of
    operations, with the skip connection as an edge; `plan` partitions that DAG."""
    (tmp_path / "skip_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        class Skip(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            def forward(self, x):
                h = torch.relu(self.a(x))
                return self.c(self.b(h)) + h  # h skips b and c
        def make():
            return Skip()
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["profile", "--model", "skip_models:make", "--input-shape", "4,8", "--steps", "2",
               "--warmup", "0", "-o", "graph.txt"])
    assert rc == 0
    assert "profiled 3 groups of the traced graph, 4 edges" in capsys.readouterr().out
    graph = pe.load_profile(tmp_path / "graph.txt")
    assert [n["description"] for n in graph.nodes()] == [
        "Input0 x", "a [a, relu]", "b (Linear)", "c [c, add]"]
    assert sorted(graph.edges()) == [("node1", "node2"), ("node2", "node3"),
                                     ("node2", "node4"), ("node3", "node4")]  # the skip: 2 -> 4
    rc = main(["plan", "--profile", "graph.txt", "--workers", "2", "--bandwidth", "1e9",
               "--straight", "-o", "plan.json"])
    assert rc == 0
    plan = pe.Plan.load(tmp_path / "plan.json")
    assert len(plan.stages) == 2 and not plan.chain
    assert sorted(n for s in plan.stages for n in s.nodes) == ["node1", "node2", "node3", "node4"]
    sys.modules.pop("skip_models", None)
