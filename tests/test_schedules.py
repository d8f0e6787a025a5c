"""Python API and CLI of the schedule engine (the C++ side has its own GoogleTest suite)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipedream_ext import schedules


def test_build_exposes_actions_grid_and_figures():
    s = schedules.build("1f1b", stages=4, microbatches=8)
    assert s.num_ranks == 4 and s.num_stages == 4 and s.replicas == [1, 1, 1, 1]
    assert s.actions(3, comm=False) == [
        "3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3",
        "3F4", "3B4", "3F5", "3B5", "3F6", "3B6", "3F7", "3B7", "3U1"]
    assert s.actions(1)[:4] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1"]
    grid = s.grid()
    assert grid.splitlines()[1].split()[:4] == ["rank", "0", "0F0", "0F1"]
    result = s.simulate(t_f=1.0, t_b=2.0)
    assert result.bubble_fraction == pytest.approx(3 / 11, abs=1e-12)
    assert result.makespan == pytest.approx(33.0)
    assert result.peak_activations == [4, 3, 2, 1]
    assert result.peak_weight_versions == [1, 1, 1, 1]


def test_per_stage_costs_make_the_slowest_stage_the_bottleneck():
    s = schedules.build("pipedream", stages=3, microbatches=30)
    balanced = s.simulate(t_f=1.0, t_b=2.0)
    slow_middle = s.simulate(t_f=[1.0, 2.0, 1.0], t_b=[2.0, 4.0, 2.0])
    # Steady state runs at the pace of the slowest stage: 6 per minibatch instead of 3.
    assert slow_middle.makespan > 1.9 * balanced.makespan
    assert slow_middle.bubble_fraction_per_rank[1] < slow_middle.bubble_fraction_per_rank[0]


def test_split_backward_costs():
    s = schedules.build("zb-h1", stages=4, microbatches=8)
    # t_w given: I costs t_b, W costs t_w.
    assert s.simulate(t_f=1, t_b=1, t_w=1).makespan == pytest.approx(3 * 8 + 3)
    # t_w=None: I and W split t_b evenly.
    assert s.simulate(t_f=1, t_b=2).makespan == pytest.approx(3 * 8 + 3)


def test_asynchronous_versions_follow_the_pipedream_rule():
    p, m = 4, 12
    s = schedules.build("pipedream", stages=p, microbatches=m)
    for stage in range(p):
        for text in s.actions(stage, comm=False):
            a = schedules.parse_action(text)
            if a["kind"] in ("F", "B"):
                assert a["version"] == max(0, a["microbatch"] - (p - 1 - stage)), text
    assert s.simulate().peak_weight_versions == [4, 3, 2, 1]
    two = schedules.build("pipedream-2bw", stages=p, microbatches=4, batches=4)
    assert max(two.simulate().peak_weight_versions) == 2


def test_replicas_round_robin():
    s = schedules.build("pipedream", stages=3, microbatches=8, replicas=[2, 1, 1])
    assert s.num_ranks == 4
    assert s.stage_ranks(0) == [0, 1]
    assert s.actions(1, comm=False)[:3] == ["0F1", "0F3", "0B1"]
    assert "0ALLREDUCE1" in s.actions(0)


def test_text_and_csv_round_trip(tmp_path):
    s = schedules.build("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    again = s.with_actions(s.to_text())
    assert all(again.actions(r) == s.actions(r) for r in range(s.num_ranks))
    path = tmp_path / "s.csv"
    s.to_csv(path)
    from_csv = s.with_actions(path.read_text(), fmt="csv")
    assert all(from_csv.actions(r) == s.actions(r) for r in range(s.num_ranks))


def test_validator_error_shows_marked_grid():
    s = schedules.build("1f1b", stages=2, microbatches=2)
    with pytest.raises(ValueError) as info:
        s.with_actions("rank 0: 0F0 0B0 0F1 0B1 0U1\nrank 1: 1F1 1B1 1F0 1B0 1U1\n")
    message = str(info.value)
    assert "deadlock" in message and ">>0B0<<" in message and "rank 1" in message


@pytest.mark.parametrize("kwargs, needle", [
    (dict(name="1f1c", stages=4, microbatches=8), "unknown schedule '1f1c'"),
    (dict(name="1f1b", stages=0, microbatches=8), "stages must be >= 1 (got 0)"),
    (dict(name="interleaved-1f1b", stages=3, microbatches=7, chunks=2), "use m=8"),
    (dict(name="pipedream-2bw", stages=4, microbatches=2), "needs at least 3 microbatches"),
    (dict(name="pipedream", stages=2, microbatches=3, replicas=[2, 1]), "multiple of 2"),
    (dict(name="gpipe", stages=2.5, microbatches=3), "stages must be an integer"),
])
def test_bad_parameters_raise_clear_errors(kwargs, needle):
    with pytest.raises(ValueError, match=None) as info:
        schedules.build(**kwargs)
    assert needle in str(info.value)


def test_bad_costs_raise():
    s = schedules.build("1f1b", stages=3, microbatches=4)
    with pytest.raises(ValueError, match="t_f lists 2 costs but 3 are needed"):
        s.simulate(t_f=[1.0, 2.0])
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        s.simulate(t_comm=-1.0)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipedream_ext", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_reports_the_1f1b_bubble():
    out = _cli("schedule", "--name", "1f1b", "--stages", "4", "--microbatches", "8", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["bubble_fraction"] == pytest.approx(3 / 11)
    assert data["makespan"] == pytest.approx(33.0)
    assert data["peak_activations"] == [4, 3, 2, 1]
    assert data["peak_weight_versions"] == [1, 1, 1, 1]


def test_cli_grid_trace_and_csv(tmp_path):
    trace, csv = tmp_path / "t.json", tmp_path / "s.csv"
    out = _cli("schedule", "--name", "pipedream", "--stages", "3", "--microbatches", "6",
               "--replicas", "2,1,1", "--trace", str(trace), "--csv", str(csv), "--comm")
    assert out.returncode == 0, out.stderr
    assert "bubble fraction" in out.stdout and "0ALLREDUCE1" in out.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 3 * 6 * 2 + 3 * 2  # F and B, plus ALLREDUCEs
    assert len(csv.read_text().splitlines()) == 4


def test_cli_errors_exit_nonzero_with_the_value():
    out = _cli("schedule", "--name", "interleaved-1f1b", "--stages", "3", "--microbatches", "7",
               "--chunks", "2")
    assert out.returncode != 0
    assert "got m=7, p=3" in out.stderr and "Traceback" not in out.stderr
    out = _cli("schedule", "--name", "nope", "--stages", "4", "--microbatches", "6")
    assert out.returncode != 0 and "unknown schedule 'nope'" in out.stderr


def test_schedule_traits_binding():
    from pipedream_ext import _C

    table = _C.all_schedule_traits()
    assert [t.name for t in table] == schedules.names()
    pd_, two = _C.schedule_traits("pipedream"), _C.schedule_traits("pipedream-2bw")
    assert (pd_.asynchronous, pd_.update_rule, pd_.replica_reduction) == (True, "per_minibatch", "mean")
    assert (two.update_rule, two.replica_reduction, two.planner_two_versions) == ("per_batch", "sum", True)
    assert pd_.microbatches_per_step(4) == 1 and two.microbatches_per_step(4) == 4
    assert pd_.stash_weights and pd_.streaming and pd_.supports_vertical_sync
    flush = _C.schedule_traits("1f1b")
    assert (flush.asynchronous, flush.update_rule, flush.supports_replicas) == (False, "caller_per_batch", True)
    assert _C.schedule_traits("interleaved-1f1b").multi_chunk
    assert _C.schedule_traits("zb-h1").split_backward and _C.schedule_traits("zb-h1").planner_straight
    assert "name='pipedream'" in repr(pd_)
    with pytest.raises(ValueError, match="unknown schedule '1f1c'; choose one of: gpipe, 1f1b"):
        _C.schedule_traits("1f1c")
