"""Python API and CLI of the schedule engine (the C++ side has its own GoogleTest suite)."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from pipedream_ext import schedules


def test_build_exposes_actions_grid_and_figures():
    s = schedules.build("1f1b", stages=4, microbatches=8)
    assert s.num_ranks == 4 and s.num_stages == 4 and s.replicas == [1, 1, 1, 1]
    assert [str(a) for a in s.actions(3, comm=False)] == [
        "3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3",
        "3F4", "3B4", "3F5", "3B5", "3F6", "3B6", "3F7", "3B7", "3U1"]
    # Receives are posted ahead, as far as the pair's transfer order allows:
    # rank 1 sends B0 to rank 0 only after rank 0's F3 arrived.
    assert [str(a) for a in s.actions(1)[:6]] == ["1RECV_F0", "1RECV_F1", "1RECV_F2", "1RECV_F3", "1F0", "1SEND_F0"]
    pairs = dict(line.split(": ", 1) for line in s.channels().splitlines())
    assert pairs["rank 0 -> 1"].split()[:6] == [
        "0SEND_F0", "0SEND_F1", "0SEND_F2", "0SEND_F3", "0RECV_B0", "0SEND_F4"]
    assert pairs["rank 1 -> 0"].split()[:6] == [
        "1RECV_F0", "1RECV_F1", "1RECV_F2", "1RECV_F3", "1SEND_B0", "1RECV_F4"]
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
        for a in s.actions(stage, comm=False):
            if a.kind in (schedules.ActionKind.F, schedules.ActionKind.B):
                assert a.version == max(0, a.microbatch - (p - 1 - stage)), a
    assert s.simulate().peak_weight_versions == [4, 3, 2, 1]
    two = schedules.build("pipedream-2bw", stages=p, microbatches=4, batches=4)
    assert max(two.simulate().peak_weight_versions) == 2


def test_replicas_round_robin():
    s = schedules.build("pipedream", stages=3, microbatches=8, replicas=[2, 1, 1])
    assert s.num_ranks == 4
    assert s.stage_ranks(0) == [0, 1]
    assert [str(a) for a in s.actions(1, comm=False)[:3]] == ["0F1", "0F3", "0B1"]
    assert schedules.Action.parse("0ALLREDUCE1") in s.actions(0)


def test_text_and_csv_round_trip(tmp_path):
    s = schedules.build("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    again = s.with_actions(s.to_text())
    assert all(again.actions(r) == s.actions(r) for r in range(s.num_ranks))
    path = tmp_path / "s.csv"
    s.to_csv(path)
    from_csv = s.with_actions(path.read_text(), fmt="csv")
    assert all(from_csv.actions(r) == s.actions(r) for r in range(s.num_ranks))


def test_actions_are_typed_and_print_as_their_text():
    s = schedules.build("1f1b", stages=2, microbatches=2)
    a = s.actions(1, comm=False)[1]
    assert (a.stage, a.kind, a.microbatch, a.version) == (1, schedules.ActionKind.B, 0, 0)
    assert (str(a), repr(a), repr(s.actions(0)[:2])) == ("1B0", "1B0", "[0F0, 0SEND_F0]")
    assert (a.is_compute, a.is_backward_like, a.is_comm) == (True, True, False)
    assert a == schedules.Action.parse("1B0") and a != schedules.Action.parse("1B1") and a != 1
    assert len({schedules.Action.parse(t) for t in ("1B0", "1B0", "1B3v2")}) == 2
    assert pickle.loads(pickle.dumps(a)) == a
    # Both ends of a transfer share its key, whichever rank runs them.
    send, recv = schedules.Action.parse("0SEND_F1"), schedules.Action.parse("1RECV_F1")
    assert send.transfer == recv.transfer and hash(send.transfer) == hash(recv.transfer)
    assert (repr(send.transfer), send.transfer.forward, send.transfer.boundary) == ("F0:1", True, 0)
    assert schedules.Action.parse("1SEND_B1").transfer == schedules.Action.parse("0RECV_B1").transfer
    update = schedules.Action.parse("0U3")
    assert (update.kind, update.microbatch, update.version) == (schedules.ActionKind.UPDATE, -1, 3)
    with pytest.raises(ValueError, match="is not a SEND or RECV action"):
        _ = a.transfer
    with pytest.raises(ValueError, match="cannot parse action '1X0'"):
        schedules.Action.parse("1X0")


def test_the_dict_and_text_forms_of_an_action_warn_and_still_work():
    """parse_action returned a dict and actions() returned strings: both spellings warn
    naming the new one and give the old answers."""
    a = schedules.parse_action("1B3v2")
    with pytest.warns(DeprecationWarning, match=r'action\["kind"\] is deprecated: use action.kind'):
        assert a["kind"] == "B"
    with pytest.warns(DeprecationWarning, match=r'action\["(stage|microbatch|version)"\] is deprecated: '
                                                r"use action\.\1$"):
        assert (a["stage"], a["microbatch"], a["version"]) == (1, 3, 2)
    with pytest.raises(KeyError, match="stage, kind, microbatch and version"):
        a["peer"]
    s = schedules.build("1f1b", stages=2, microbatches=2)
    with pytest.warns(DeprecationWarning, match=r"compare with Action\.parse\('0(F0|SEND_F0)'\), or compare "):
        assert s.actions(0)[0] == "0F0" and "0SEND_F0" in s.actions(0) and "0F0" == s.actions(0)[0]
    with pytest.warns(DeprecationWarning, match=r"compare with Action\.parse\('0(F1|SEND_F0)'\)"):
        assert "0SEND_F0" in set(s.actions(0)) and s.actions(0)[0] != "0F1"


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


def test_cli_channels_print_the_mirrored_transfer_order():
    out = _cli("schedule", "--name", "zbv", "--stages", "2", "--microbatches", "4", "--chunks", "2",
               "--channels")
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if " -> " in line)
    mine, theirs = lines["rank 0 -> 1"].split(), lines["rank 1 -> 0"].split()
    assert len(mine) == len(theirs) == 16  # 4 microbatches x 2 boundaries x 2 directions
    for a, b in zip(mine, theirs):  # the k-th send of one end is the k-th receive of the other
        assert ("SEND" in a) != ("SEND" in b), (a, b)


def test_cli_pairs_print_dualpipev_f_and_b():
    """``--pairs``: each rank's F&B pairs, as the generator pairs them (rank r of p: 2(m-2p+r+1)
    + (p-r-1); tests/cpp/test_pairs.cpp); none for 1f1b."""
    out = _cli("schedule", "--name", "dualpipev", "--stages", "2", "--microbatches", "4", "--pairs")
    assert out.returncode == 0, out.stderr
    pairs = out.stdout.split("F&B pairs")[1]
    lines = dict(line.split(": ", 1) for line in pairs.splitlines() if line.startswith("rank "))
    assert lines == {"rank 0": "0F3&3B1 3F2&0B0 3F3&0B1", "rank 1": "1F2&2B0 2F2&1B0 1F3&2B1 2F3&1B1"}, lines
    assert schedules.build("1f1b", 2, 4).pairs() == [[], []]


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


# --------------------------------------------------------------------------- zero bubble, chunks
ZB_CHUNKED = ("zbv", "dualpipev", "interleaved-zb")


def _torch_reference_order(name: str, p: int, m: int, v: int) -> list:
    """Rank-by-rank compute order from torch.distributed.pipelining's own generator (private
    API of torch 2.13), empty slots dropped; an OVERLAP_F_B stays one entry (a tuple)."""
    import types

    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    classes = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
               "interleaved-zb": "ScheduleInterleavedZeroBubble"}
    cls = getattr(ts, classes[name], None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this torch has no {classes[name]}._calculate_single_rank_operations")
    rounds = max(1, m // p)
    fake = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=p * v,
                                 _num_stages=p * v, n_local_stages=v,
                                 microbatches_per_round=m // rounds)
    order = []
    for r in range(p):
        ops = []
        for a in cls._calculate_single_rank_operations(fake, r):
            if a is None:
                continue
            subs = getattr(a, "sub_actions", None)
            ops.append(tuple(str(s) for s in subs) if subs else str(a))
        order.append(ops)
    return order


def _flat(ops: list) -> list:
    return [x for op in ops for x in (op if isinstance(op, tuple) else (op,))]


def test_zero_bubble_orders_are_torchs_action_for_action():
    """zbv, dualpipev and interleaved-zb equal torch's generators for every p <= 6, m <= 24
    that both accept (an overlapped F&B of dualpipev is its F then its B)."""
    compared = 0
    for name in ZB_CHUNKED:
        for p in range(1, 7):
            for m in range(1, 25):
                for v in ((2,) if name != "interleaved-zb" else (1, 2, 3)):
                    try:
                        s = schedules.build(name, stages=p, microbatches=m, chunks=v)
                    except ValueError:
                        continue  # dualpipev m < 2p, interleaved-zb unequal rounds: torch refuses too
                    ours = [[str(a) for a in s.actions(r, comm=False) if a.kind != schedules.ActionKind.UPDATE]
                            for r in range(p)]
                    reference = _torch_reference_order(name, p, m, v)
                    assert ours == [_flat(ops) for ops in reference], (name, p, m, v)
                    compared += 1
    assert compared > 500


def _busy_and_makespan_with_overlapped_pairs(order: list, stages: int) -> tuple:
    """Unit-time simulation (F = I = W = 1, B = 2) where an overlapped F&B pair is one action
    of time F + B = 3 that needs both inputs before it starts and delivers both outputs at its
    end: the model of DeepSeek's formula. Returns (makespan, busy time per rank)."""
    import re

    cost = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    done: dict = {}

    def parse(text: str) -> tuple:
        stage, kind, i = re.fullmatch(r"(\d+)([FIWB])(\d+)", text).groups()
        return int(stage), kind, int(i)

    def needs(stage: int, kind: str, i: int):
        if kind == "F":
            return (stage - 1, "F", i) if stage > 0 else None
        if kind == "W":
            return (stage, "G", i)
        return (stage + 1, "G", i) if stage < stages - 1 else (stage, "F", i)

    nxt, free, busy = [0] * len(order), [0.0] * len(order), [0.0] * len(order)
    while any(nxt[r] < len(order[r]) for r in range(len(order))):
        progress = False
        for r, ops in enumerate(order):
            while nxt[r] < len(ops):
                group = [parse(t) for t in (ops[nxt[r]] if isinstance(ops[nxt[r]], tuple)
                                            else (ops[nxt[r]],))]
                deps = [d for d in (needs(*a) for a in group) if d is not None]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                work = sum(cost[k] for _, k, _ in group)
                for stage, kind, i in group:
                    done[(stage, "F" if kind == "F" else "G" if kind in "IB" else "W", i)] = start + work
                free[r], busy[r] = start + work, busy[r] + work
                nxt[r] += 1
                progress = True
        assert progress, "deadlock"
    return max(free), busy


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_dualpipev_has_deepseeks_bubble_when_pairs_are_one_action(p):
    """DualPipe README: (PP/2 - 1)(F&B + B - 3W) per rank with PP = 2p stages. Treating each
    F&B pair as one action (F&B = F + B = 3, no overlap gain) the order gives exactly that,
    2(p-1) at unit times; our executor runs the pair's F and B separately and gets p - 1
    (tests/cpp/test_simulate.cpp)."""
    m = 4 * p
    order = _torch_reference_order("dualpipev", p, m, 2)
    makespan, busy = _busy_and_makespan_with_overlapped_pairs(order, 2 * p)
    assert all(makespan - b == pytest.approx((p - 1) * (3 + 2 - 3 * 1)) for b in busy)
    ours = schedules.build("dualpipev", stages=p, microbatches=m, chunks=2)
    result = ours.simulate(t_f=1, t_b=1, t_w=1)
    assert result.makespan - 6 * m == pytest.approx(p - 1)


def test_v_layout_from_python():
    s = schedules.build("zbv", stages=3, microbatches=5, chunks=2)
    assert (s.num_ranks, s.num_stages) == (3, 6)
    assert [s.stage_ranks(j) for j in range(6)] == [[0], [1], [2], [2], [1], [0]]
    assert [s.stages_of_rank(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    # The turn (2 -> 3 on rank 2) and stage 5 -> the loss on rank 0 exchange nothing.
    assert not any(a.kind == schedules.ActionKind.SEND_F for a in s.actions(2) if a.stage == 2)
    assert schedules.Action.parse("3RECV_F0") not in s.actions(2)
    t = schedules.traits("zbv")
    assert (t.fixed_chunks, t.chunk_placement, t.split_backward, t.multi_chunk) == (2, "v", True, True)
    assert schedules.traits("interleaved-zb").chunk_placement == "round_robin"
    assert [s.stages_of_rank(r) for r in range(2)] != \
        [schedules.build("interleaved-zb", stages=2, microbatches=2, chunks=2).stages_of_rank(r)
         for r in range(2)]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(name="zbv", stages=2, microbatches=4), "exactly 2 chunks per rank in a V"),
    (dict(name="dualpipev", stages=2, microbatches=3, chunks=2), "(2p = 4 for p=2 ranks, got m=3); use m=4"),
    (dict(name="interleaved-zb", stages=3, microbatches=7, chunks=2), "use m=8"),
])
def test_zero_bubble_bad_parameters(kwargs, needle):
    with pytest.raises(ValueError) as info:
        schedules.build(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize("name", ZB_CHUNKED)
def test_cli_prints_and_plots_the_zero_bubble_schedules(name, tmp_path):
    """Default chunks: 2 for the V schedules (their only choice), 1 otherwise; --plot
    writes the chart (a PNG of 1200 x (116 + 40 * ranks) pixels)."""
    pytest.importorskip("matplotlib")
    import struct

    plot = tmp_path / f"{name}.png"
    chunks = () if name != "interleaved-zb" else ("--chunks", "2")
    out = _cli("schedule", "--name", name, "--stages", "4", "--microbatches", "8", *chunks,
               "--t-f", "1", "--t-b", "1", "--t-w", "1", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    assert "stages=8, ranks=4" in out.stdout and "bubble fraction" in out.stdout
    assert "rank 3" in out.stdout and "I0" in out.stdout and "W0" in out.stdout
    assert "makespan                        51" in out.stdout  # 6m + p - 1 at unit times
    with open(plot, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (1200, 116 + 40 * 4)
