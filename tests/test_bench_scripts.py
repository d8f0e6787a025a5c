"""The benchmark scripts' pure helpers (benchmarks/plan_accuracy.py, memory.py, soak.py,
deferred_init.py, traced.py, zero_bubble.py, split_backward.py, fsdp_2d.py,
schedule_build.py, vs_torch.py, vs_torch_tp.py, vs_torch_ep.py) and the harness they stand on (benchmarks/_harness.py).

Fast: the scripts import torch only inside functions, so loading them imports no torch;
only the smoke runs (traced.py, about 25 s; zero_bubble.py, split_backward.py and
schedule_build.py with ``--smoke``: tiny sizes, 2 ranks, a few seconds each) start
processes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


plan_accuracy = _load("plan_accuracy")
memory = _load("memory")
soak = _load("soak")
deferred_init = _load("deferred_init")
traced = _load("traced")
zero_bubble = _load("zero_bubble")
vs_torch = _load("vs_torch")
vs_torch_tp = _load("vs_torch_tp")
split_backward = _load("split_backward")
agreement = _load("agreement")
fsdp_2d = _load("fsdp_2d")
schedule_build = _load("schedule_build")
util = _load("_harness")
message_load = _load("message_load")
torchtitan_tp = _load("torchtitan_tp")
vs_torch_ep = _load("vs_torch_ep")


def test_scripts_do_not_import_torch_at_module_level():
    for script in (plan_accuracy, memory, soak, deferred_init, traced, zero_bubble, vs_torch, split_backward,
                   agreement, fsdp_2d, schedule_build, vs_torch_tp, message_load, torchtitan_tp, vs_torch_ep):
        assert "torch" not in vars(script), script.__name__


# ----------------------------------------------------------------------------- memory
def test_cumulative_peak_orders_events_by_time():
    # Recorded out of order: at t=2 and t=3 two 4-byte blocks coexist with the 10 bytes of t=1.
    events = [(3, 4), (1, 10), (5, -10), (2, 4), (4, -4), (6, -4)]
    assert memory.cumulative_peak(events) == (18, 0)


def test_cumulative_peak_keeps_recorded_order_for_equal_times_and_ignores_earlier_frees():
    # A free of memory allocated before the window (t=0) lowers the running sum;
    # at t=1 the recorded free comes before the allocation, so the peak is 2, not 5.
    events = [(0, -3), (1, -8), (1, 8), (2, 5), (3, -5)]
    assert memory.cumulative_peak(events) == (2, -3)
    assert memory.cumulative_peak([]) == (0, 0)
    assert memory.cumulative_peak([(0, 1 << 20), (1, -(1 << 20)), (2, 3 << 18)]) == (1 << 20, 3 << 18)


def test_expected_in_flight_per_schedule():
    assert [memory.expected_in_flight("1f1b", 4, j, 8) for j in range(4)] == [4, 3, 2, 1]
    assert [memory.expected_in_flight("1f1b", 4, j, 2) for j in range(4)] == [2, 2, 2, 1]
    assert [memory.expected_in_flight("gpipe", 4, j, 8) for j in range(4)] == [8] * 4
    assert [memory.expected_in_flight("pipedream", 3, j, 8) for j in range(3)] == [3, 2, 1]
    with pytest.raises(ValueError):
        memory.expected_in_flight("1f1b", 2, 2, 4)
    with pytest.raises(ValueError):
        memory.expected_in_flight("interleaved-1f1b", 2, 0, 4)


def test_expected_peak_with_and_without_recompute():
    assert memory.expected_peak(3, 100.0, 10.0, 7.0, recompute=False) == 307.0
    assert memory.expected_peak(3, 100.0, 10.0, 7.0, recompute=True) == 137.0
    assert memory.expected_peak(2, 100.0, 10.0, 7.0, recompute=False, extra_weights=14.0) == 221.0


def test_block_balance_splits_blocks_and_puts_the_classifier_last():
    assert memory.block_balance(8, 2) == [16, 17]
    assert memory.block_balance(8, 4) == [8, 8, 8, 9]
    assert memory.block_balance(5, 2) == [12, 9]
    assert memory.block_balance(3, 2, per_block=2) == [4, 3]
    with pytest.raises(ValueError):
        memory.block_balance(2, 3)


def test_slope_is_least_squares():
    assert memory.slope([2, 4, 8, 16], [1.0, 2.0, 4.0, 8.0]) == pytest.approx(0.5)
    assert memory.slope([1, 2, 3], [5.0, 5.0, 5.0]) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        memory.slope([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError):
        memory.slope([1], [1.0])


def test_recompute_table_reports_the_saving():
    rows = [{"ranks": 2, "schedule": "gpipe", "stage": 0, "recompute": False, "peak_mib": 4.0},
            {"ranks": 2, "schedule": "gpipe", "stage": 0, "recompute": True, "peak_mib": 1.0}]
    lines = memory.recompute_table(rows)
    assert lines[-1] == "| 2 | gpipe | 0 | 4.00 | 1.00 | 75% |"


# ----------------------------------------------------------------------------- plan accuracy
def test_balance_for_even_and_skewed():
    assert plan_accuracy.balance_for("even", 10, 4) == [3, 3, 2, 2]
    assert plan_accuracy.balance_for("skewed", 10, 4) == [4, 3, 2, 1]
    assert plan_accuracy.balance_for("skewed", 10, 2) == [6, 4]
    assert plan_accuracy.balance_for("skewed", 8, 8) is None  # one layer per stage: nothing to move
    assert plan_accuracy.balance_for("skewed", 9, 8) is None  # only stage 0 has two
    with pytest.raises(ValueError):
        plan_accuracy.balance_for("even", 3, 4)
    with pytest.raises(ValueError):
        plan_accuracy.balance_for("random", 10, 2)


def test_draw_grid_is_a_seeded_subset_of_the_valid_points_in_grid_order():
    def draw(count, seed):
        return plan_accuracy.draw_grid(["gpipe", "1f1b"], [2, 4], ["even", "skewed"], [False, True], count, seed,
                                       lambda p: not (p["schedule"] == "gpipe" and p["microbatches"] == 2))
    everything = draw(100, 0)
    assert len(everything) == 12 and all(not (p["schedule"] == "gpipe" and p["microbatches"] == 2)
                                         for p in everything)
    five = draw(5, 3)
    assert len(five) == 5 and five == draw(5, 3)
    assert five == [p for p in everything if p in five]  # grid order kept
    assert any(draw(5, s) != five for s in range(4, 10))


def test_spearman_rank_correlation():
    assert plan_accuracy.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert plan_accuracy.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks 1,2,3,4 against 1,3,2,4: 1 - 6 * 2 / (4 * 15) = 0.8
    assert plan_accuracy.spearman([1, 2, 3, 4], [1.0, 5.0, 2.0, 9.0]) == pytest.approx(0.8)
    # ties take average ranks: (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
    assert plan_accuracy.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)
    assert plan_accuracy.spearman([1, 2], [2, 1]) is None
    assert plan_accuracy.spearman([1, 1, 1], [1, 2, 3]) is None
    with pytest.raises(ValueError):
        plan_accuracy.spearman([1, 2, 3], [1, 2])


def test_error_stats_and_relative_error():
    s = plan_accuracy.error_stats([0.1, -0.3, None, 0.05])
    assert s == {"median_abs": pytest.approx(0.1), "worst_abs": pytest.approx(0.3), "median": pytest.approx(0.05),
                 "n": 3}
    assert plan_accuracy.error_stats([None])["median_abs"] is None
    assert plan_accuracy.relative_error(2.0, 3.0) == pytest.approx(0.5)
    assert plan_accuracy.relative_error(0.0, 3.0) is None
    assert plan_accuracy.relative_error(None, 3.0) is None
    assert util.pct(0.5) == "+50%" and util.pct(-0.25) == "-25%" and util.pct(None) == "n/a"


def test_measured_step_is_the_median_of_the_slowest_rank_per_step():
    assert plan_accuracy.measured_step([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        plan_accuracy.measured_step([[1.0, 2.0], [1.0]])


def test_measured_and_predicted_terms():
    rank = {"steps": 2, "seconds_by_kind": {"F": 1.0, "B": 2.0, "W": 1.0, "RECV_F": 0.5, "RECV_B": 0.5,
                                            "SEND_F": 0.2, "RECV_POST": 0.2, "ALLREDUCE": 1.0,
                                            "TIED_ALLREDUCE": 0.4}}
    assert plan_accuracy.measured_terms(rank, 5.0) == pytest.approx(
        {"compute": 2.0, "waits": 0.7, "transfers": 0.2, "all-reduce": 0.5, "overhead": 1.6})
    pred = {"step_seconds": 3.0, "pipeline_seconds": 2.5, "compute_seconds": [1.0, 2.0],
            "wait_seconds": [0.5, 0.25], "transfer_seconds": [0.1, 0.0], "overhead_seconds": 0.3,
            "all_reduce_seconds": 0.2, "peak_bytes": [1.0, 1.0], "bubble_fraction": 0.1, "fits": True}
    assert plan_accuracy.predicted_terms(pred, 1) == pytest.approx(
        {"compute": 2.0, "waits": 0.25, "transfers": 0.0, "all-reduce": 0.2, "overhead": 0.3})
    # The study and the run's own check (pipe.stats(), the warning) count the same terms.
    assert list(plan_accuracy.measured_terms(rank, 5.0)) == list(plan_accuracy.predicted_terms(pred, 0))
    assert tuple(plan_accuracy.measured_terms(rank, 5.0)) == plan_accuracy.TERMS


def test_overhead_parts_split_what_no_span_covers():
    rank = {"steps": 2, "busy_s": 8.0, "optimizer_s": [0.5, 1.5],
            "seconds_by_kind": {"F": 1.0, "B": 2.0, "RECV_F": 1.0, "SEND_F": 1.0}}
    # spans 2.5 per step, runtime 4 - 2.5 = 1.5, optimizer 1.0, the rest of a 6 s step 1.0
    assert plan_accuracy.overhead_parts(rank, 6.0) == pytest.approx({"optimizer": 1.0, "runtime": 1.5,
                                                                     "outside": 1.0})
    assert plan_accuracy.overhead_parts({**rank, "optimizer_s": []}, 6.0)["optimizer"] == 0.0


def test_optimizer_of_sums_each_ranks_layers():
    from types import SimpleNamespace as NS

    layers = [NS(optimizer_seconds=t, parameter_bytes=100.0, parameter_tensors=2.0) for t in (1.0, 2.0, 4.0, 8.0)]
    machine = NS(optimizer_seconds_per_byte=0.01, optimizer_seconds_per_tensor=0.5)
    # Interleaved: stages 0 and 2 on rank 0 (layers 0 and 2), 1 and 3 on rank 1; each layer adds 1 + 1.
    assert plan_accuracy.optimizer_of(layers, machine, {"balance": [1, 1, 1, 1]}, 2) == [9.0, 14.0]
    assert plan_accuracy.optimizer_of(layers, machine, {"balance": [3, 1]}, 2) == [13.0, 10.0]


def _row(key, step, pred_step, peaks, pred_peaks, auto=False):
    pred = {"step_seconds": pred_step, "peak_bytes": pred_peaks, "compute_seconds": [step / 2] * len(peaks),
            "wait_seconds": [0.0] * len(peaks), "transfer_seconds": [0.0] * len(peaks), "overhead_seconds": 0.0,
            "all_reduce_seconds": 0.0, "pipeline_seconds": pred_step, "bubble_fraction": 0.0, "fits": True}
    terms = [{"compute": step / 2, "waits": step / 4, "transfers": 0.0, "all-reduce": 0.0,
              "overhead": step / 4}] * len(peaks)
    return {"key": key, "step_s": step, "prediction": pred, "peak_bytes": peaks, "terms": terms, "auto": auto}


def test_accuracy_summary_of_runs():
    rows = [_row("a", 1.1, 1.0, [100.0, 50.0], [100.0, 40.0]),
            _row("b", 2.0, 2.5, [10.0, 10.0], [10.0, 10.0]),
            _row("c", 3.0, 3.0, [1.0, 1.0], [1.0, 1.0]),
            _row("auto", 1.21, 0.9, [1.0, 1.0], [1.0, 1.0], auto=True),
            {"key": "broken", "error": "boom"}]
    s = plan_accuracy.accuracy_summary(rows)
    assert s["runs"] == 4
    assert s["step"]["median_abs"] == pytest.approx((0.1 + 0.2) / 2)
    assert s["step"]["worst_abs"] == pytest.approx(1.21 / 0.9 - 1)
    assert s["memory"]["worst_abs"] == pytest.approx(0.25)
    assert s["spearman"] == pytest.approx(0.8)  # predicted order a, auto swapped
    assert (s["best"], s["auto"], s["picked"]) == ("a", "auto", "a")
    assert s["auto_vs_best"] == pytest.approx(0.1)
    assert s["picked_vs_best"] == pytest.approx(0.0)
    assert "best" not in plan_accuracy.accuracy_summary(rows, choice=False)  # several models: no best
    b = plan_accuracy.time_breakdown(rows[:4])
    assert b["compute"]["difference"] == pytest.approx(0.0)
    assert b["waits"]["measured"] == pytest.approx(statistics.median([0.275, 0.5, 0.75, 0.3025]))


def test_rounds_of_a_configuration_give_the_median_round_and_their_spread():
    def run(key, steps):  # two ranks, the slowest rank's median step is max(steps)
        return {"key": key, "ranks": [{"step_s": [steps[0]] * 3}, {"step_s": [steps[1]] * 3}]}
    repeats = [{"runs": [run("a", (1.0, 2.0)), run("b", (5.0, 1.0))]},
               {"runs": [run("a", (3.0, 1.0)), {"key": "b", "error": "boom"}]},
               {"runs": [run("a", (2.5, 0.5))]}]
    rounds = plan_accuracy._rounds_of(repeats[0], repeats, "a")
    assert len(rounds) == 3
    median, step, steps = plan_accuracy._median_round(rounds)
    assert (step, steps) == (2.5, [2.0, 3.0, 2.5]) and median is rounds[2]
    assert plan_accuracy._rounds_of(repeats[0], repeats, "b") == [repeats[0]["runs"][1]]  # failed rounds left out
    assert plan_accuracy._median_round(plan_accuracy._rounds_of(repeats[0], repeats[:2], "a"))[1] == 2.0  # lower
    assert plan_accuracy._rounds_of(repeats[0], [], "a") == [repeats[0]["runs"][0]]  # a study without rounds
    assert plan_accuracy.round_spread([2.0, 3.0, 2.5]) == pytest.approx(0.4)
    rows = [{**_row("a", 1.0, 1.0, [1.0], [1.0]), "step_s_rounds": [1.0, 1.2, 1.1]},
            {**_row("b", 2.0, 2.0, [1.0], [1.0]), "step_s_rounds": [2.0]}]
    assert plan_accuracy.accuracy_summary(rows)["round_spread"] == pytest.approx(0.2 / 1.1)
    assert plan_accuracy.accuracy_summary(rows[1:])["round_spread"] is None  # one round: no spread
    assert plan_accuracy.quiet_text({"others_cpu_share": 0.034, "steal_share": 0.0}) == " (others 3%, steal 0%)"
    assert plan_accuracy.quiet_text(None) == ""


def test_cpu_watch_counts_what_others_took_of_the_cpus(monkeypatch):
    node = iter([(100.0, 5.0), (103.0, 5.5)])  # busy and stolen seconds of all CPUs
    ours = iter([10.0, 11.5])  # this process and its waited-for children
    clock = iter([50.0, 52.0])
    monkeypatch.setattr(util.CpuWatch, "_node", staticmethod(lambda: next(node)))
    monkeypatch.setattr(util.CpuWatch, "_ours", staticmethod(lambda: next(ours)))
    monkeypatch.setattr(util.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(util.os, "cpu_count", lambda: 2)
    with util.CpuWatch() as watch:
        pass
    assert watch.others_share == pytest.approx((3.0 - 1.5) / 4.0)
    assert watch.steal_share == pytest.approx(0.5 / 4.0)
    monkeypatch.setattr(util.CpuWatch, "_node", staticmethod(lambda: None))  # no /proc/stat
    with util.CpuWatch() as off:
        pass
    assert off.others_share is None and off.steal_share is None


def test_message_load_reports_quiet_and_loaded_side_by_side():
    def cases(scale):
        return [{"compute_ms": ms, "mode": mode, "us": scale * (1e3 * ms + extra)}
                for ms, extra in ((0.0, 200.0), (1.0, 400.0)) for mode in ("both", "sender")]
    results = {"quiet": {"cases": cases(1.0), "launch_s": 8.0, "others_cpu_share": 0.01},
               "loaded": {"cases": cases(2.0), "launch_s": 11.0, "others_cpu_share": 0.47}}
    info = {"cpu_count": "2", "cpu_model": "x", "torch": "2.13.0", "python": "3.11", "platform": "p",
            "cuda": "none", "loadavg_at_start": "0.1 0.1 0.1"}
    text = message_load.report(results, info, "python3 benchmarks/message_load.py", 20.0)
    assert "| 1.0 | sender | 1400 | 400 | 2800 | 1800 |" in text
    assert "quiet: others 1% of the CPUs, loaded: others 47% of the CPUs" in text
    args = message_load.parse_args(["--compute-ms", "0,0.5"])
    assert args.compute == [0.0, 0.5]
    with pytest.raises(SystemExit):
        message_load.parse_args(["--compute-ms", "fast"])


def test_config_key_names_the_choices():
    cfg = {"schedule": "interleaved-1f1b", "chunks": 2, "microbatches": 4, "balance_kind": "even",
           "recompute": True}
    assert plan_accuracy.config_key(cfg) == "interleaved-1f1b c2 M4 even rc"
    assert plan_accuracy.config_key({**cfg, "chunks": 1, "schedule": "1f1b", "recompute": False}) == "1f1b M4 even -"
    assert plan_accuracy.config_key({**cfg, "balance_kind": "auto", "recompute": [True, False]}).endswith(
        "auto rc10")


def test_failure_lines_pick_the_error_out_of_torchrun_output():
    text = ("USDT: profiler_start\n[rank1]: step 3\nterminate called after throwing an instance of 'c10::Error'\n"
            "  what():  boom\n  error_file: <N/A>\n  traceback : To enable traceback see ...\n"
            "Signal 6 (SIGABRT) received by PID 7\n")
    assert util.failure_lines(text) == ["terminate called after throwing an instance of 'c10::Error'",
                                        "what():  boom", "Signal 6 (SIGABRT) received by PID 7"]
    assert util.failure_lines("a\nb\nc", limit=2) == ["b", "c"]


# ----------------------------------------------------------------------------- soak
def _samples(rss, rates=None, start=0, every=100, **queues):
    """Synthetic samples: rss in MiB per sample, constant 100 steps/s unless rates given."""
    out, t = [], 0.0
    for k, r in enumerate(rss):
        step = start + k * every
        if k:
            t += every / (rates[k] if rates else 100.0)
        s = {"step": step, "t": t, "rss": int(r * soak.MIB)}
        for q, values in queues.items():
            s[q] = values[k]
        out.append(s)
    return out


def test_rss_bytes_reads_statm():
    assert soak.rss_bytes("1000 250 30 1 0 200 0\n", page_size=4096) == 250 * 4096
    assert soak.rss_bytes() > 0


def test_soak_passes_a_flat_steady_run():
    flat = _samples([300.0] * 3 + [301.0] * 18, pending_targets=[11] * 21)
    problems, figures = soak.assess([flat, flat], warmup_step=200, rss_threshold=5 * soak.MIB, max_drop=0.3)
    assert problems == []
    assert figures["rss"][0]["max_growth"] == pytest.approx(soak.MIB)
    assert figures["throughput"]["first"] == pytest.approx(100.0)
    assert figures["queues"]["pending_targets"] == {"first": 11, "last": 11}


def test_soak_flags_rss_growth_after_warmup_only():
    # Growth inside the warm-up (steps < 200) does not count; 10.8 MiB after it does.
    early = _samples([100.0, 200.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0])
    assert soak.assess([early], 200, 5 * soak.MIB, 0.3)[0] == []
    leak = _samples([300.0 + 0.6 * k for k in range(21)])
    problems, figures = soak.assess([leak], 200, 5 * soak.MIB, 0.3)
    assert len(problems) == 1 and "RSS grew" in problems[0]
    assert figures["rss"][0]["max_growth"] == pytest.approx(0.6 * 18 * soak.MIB, rel=1e-3)


def test_soak_flags_a_throughput_drop_of_more_than_max_drop():
    rates = [100.0] * 11 + [60.0] * 10  # last quarter at 60% of the first
    problems, figures = soak.assess([_samples([300.0] * 21, rates)], 200, 5 * soak.MIB, 0.3)
    assert any("throughput fell" in p for p in problems)
    assert figures["throughput"]["last"] == pytest.approx(60.0)
    mild = [100.0] * 11 + [80.0] * 10
    assert soak.assess([_samples([300.0] * 21, mild)], 200, 5 * soak.MIB, 0.3)[0] == []


def test_soak_flags_growing_queues_but_not_periodic_ones():
    periodic = [200 + (k % 4) * 20 for k in range(21)]
    assert soak.assess([_samples([300.0] * 21, executor_size=periodic)], 200, 5 * soak.MIB, 0.3)[0] == []
    growing = [10 + 2 * k for k in range(21)]
    problems, _ = soak.assess([_samples([300.0] * 21, pending_targets=growing)], 200, 5 * soak.MIB, 0.3)
    assert problems == ["rank 0: pending_targets grew from at most 22 to 50"]
    assert soak.queue_growing([4, 4], [7])  # small queues: more than 2 above
    assert not soak.queue_growing([4, 4], [6])


def test_cpu_per_step_and_load_by_quarter():
    samples = [{"step": 100 * k, "t": float(k), "rss": 1, "cpu_s": 0.5 * k + (0.5 * (k - 10) if k > 10 else 0.0),
                "loadavg": 2.0 if k < 10 else 6.0} for k in range(21)]
    c = soak.cpu_per_step(samples, 200)
    assert c["cpu_ms_per_step_first"] == pytest.approx(5.0)
    assert c["cpu_ms_per_step_last"] == pytest.approx(10.0)
    assert (c["loadavg_first"], c["loadavg_last"]) == (2.0, 6.0)


def test_a_launch_that_fails_after_reporting_is_assessed_and_fails():
    args = soak.parse_args(["--steps", "2000"])
    flat = _samples([300.0] * 21)
    ok = {"steps": 2000, "ranks": [{"rank": 0, "wall_s": 20.0, "samples": flat}]}
    assert soak.evaluate("1f1b", ok, args, 200) is False and ok["problems"] == []
    crashed = {"steps": 2000, "error": "exit -6: Signal 6 (SIGABRT)",
               "ranks": [{"rank": 0, "wall_s": 20.0, "samples": flat}]}
    assert soak.evaluate("zb-h1", crashed, args, 200) is True
    assert crashed["problems"] == ["the launch failed after the samples were in: exit -6: Signal 6 (SIGABRT)"]
    assert crashed["figures"]["rss"][0]["max_growth"] == 0.0
    assert soak.evaluate("gpipe", {"steps": 2000, "error": "timed out"}, args, 200) is True


def test_quarters_and_rate():
    s = _samples([1.0] * 9)  # steps 0..800
    first, last = soak.quarters(s)
    assert [x["step"] for x in first] == [0, 100, 200]
    assert [x["step"] for x in last] == [600, 700, 800]
    assert soak.rate(first) == pytest.approx(100.0)
    assert soak.rate(s[:1]) is None
    two = _samples([1.0, 1.0])
    assert soak.quarters(two) == (two, two)


# ----------------------------------------------------------------------------- harness
def test_table_rows_and_rule():
    assert util.table(["a", "b"], [["x", 1], ["", 2.5]]) == ["| a | b |", "|---|---|", "| x | 1 |", "| | 2.5 |"]
    assert util.table_row(["ok", "exit 1: a | b"]) == "| ok | exit 1: a \\| b |"


def test_fmt_and_pct():
    assert util.fmt(1.23456) == "1.23" and util.fmt(2.0, 0) == "2" and util.fmt(None) == "n/a"
    assert util.fmt(None, 1, "-") == "-"


def test_machine_info_keys_and_line():
    info = util.machine_info()
    assert set(info) == {"cpu_count", "cpu_model", "torch", "python", "platform", "cuda", "loadavg_at_start"}
    assert all(isinstance(v, str) and v for v in info.values())
    line = util.machine_line(info)
    assert line.startswith("Machine: ") and info["torch"] in line and info["cpu_count"] in line


FAILING = ("import sys; print('step 1'); print('RuntimeError: boom on rank 1', file=sys.stderr); "
           "print('noise', file=sys.stderr); sys.exit(3)")


def test_a_failed_command_keeps_its_output_and_names_the_error():
    with pytest.raises(util.CommandFailed) as info:
        util.run_command([sys.executable, "-c", FAILING], timeout=60)
    exc = info.value
    try:
        assert exc.returncode == 3 and exc.reason == "exit 3"
        assert exc.lines == ["RuntimeError: boom on rank 1"]
        assert "RuntimeError: boom on rank 1" in str(exc) and exc.log in str(exc)
        kept = Path(exc.log).read_text()
        assert "step 1" in kept and "noise" in kept and FAILING in kept
    finally:
        os.unlink(exc.log)


def test_a_command_that_times_out_or_prints_no_result_fails():
    with pytest.raises(util.CommandFailed, match="timed out after 1 s") as info:
        util.run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"],
                         timeout=1)
    os.unlink(info.value.log)
    with pytest.raises(util.CommandFailed, match="exit 0 but no result") as info:
        util.run_command([sys.executable, "-c", "print('no tag')"], timeout=60, ok=lambda out: "TAG" in out)
    os.unlink(info.value.log)
    assert util.run_command([sys.executable, "-c", "print('TAG')"], timeout=60).stdout == "TAG\n"


def test_mlp_layers():
    model = util.mlp([4, 8, 8, 3], seed=0)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [(m.in_features, m.out_features) for m in model if hasattr(m, "in_features")] == [(4, 8), (8, 8), (8, 3)]
    again = util.mlp([4, 8, 8, 3], seed=0)
    assert all((a == b).all() for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(ValueError):
        util.mlp([4])


def test_a_failed_launch_keeps_what_rank_0_reported(monkeypatch, tmp_path):
    log = tmp_path / "launch.log"

    def crash(cmd, timeout, env=None, ok=None):
        raise util.CommandFailed(cmd, -6, 'TAG {"ranks": [1]}\n', "Signal 6 (SIGABRT) received by PID 7\n",
                                 str(log), "exit -6")

    monkeypatch.setattr(util, "run_command", crash)
    r = util.launch_torchrun(Path("bench.py"), 2, ["--worker"], "TAG ", timeout=5)
    assert r["ranks"] == [1] and r["log"] == str(log) and util.launch_failed(r)
    assert r["error"] == "exit -6: Signal 6 (SIGABRT) received by PID 7"
    with pytest.raises(util.CommandFailed):
        util.launch_torchrun(Path("bench.py"), 2, [], "TAG ", timeout=5, check=True)
    assert not util.launch_failed({"error": "rank 1: ValueError: reported as data", "launch_s": 1.0})


# ----------------------------------------------------------------------------- deferred_init
def test_deferred_init_report_puts_whole_and_meta_side_by_side():
    mib = 1 << 20

    def rank(r, scale):
        return dict(rank=r, params=67.1e6, baseline=225 * mib, built=scale * 1251 * mib,
                    pipeline=scale * 1253 * mib, stepped=scale * 1584 * mib,
                    peak_built=scale * 1253 * mib, peak_stepped=scale * 1650 * mib,
                    build_s=1.0, pipeline_s=0.5, step_s=0.1)

    results = {"whole": {"model_params": 268e6, "ranks": [rank(0, 1.0), rank(1, 1.0)], "launch_s": 9},
               "meta": {"model_params": 268e6, "ranks": [rank(0, 0.5), rank(1, 0.5)], "launch_s": 8}}
    info = dict(cpu_count="2", cpu_model="x", torch="2.13.0", python="3.11", platform="Linux",
                cuda="none", loadavg_at_start="0 0 0")
    text = deferred_init.report(results, info, "python3 benchmarks/deferred_init.py", 17.0)
    assert "| 0 | 67.1M | 1,251 / 626 | 1,253 / 626 | 1,253 / 626 | 1,584 / 792 | 1,650 / 825 | 1.50 / 1.50 |" in text
    assert "Largest peak of a rank: 1,650 MiB built whole, 825 MiB built on meta (2.0x less)" in text
    assert "torchrun launches: whole 9 s, meta 8 s" in text
    assert deferred_init.rss_bytes() > 0 and deferred_init.peak_rss_bytes() >= deferred_init.rss_bytes() // 2


# ----------------------------------------------------------------------------- traced
def test_traced_rounds_alternate_the_order_and_ratios_are_per_round():
    assert traced.config_order(0) == list(traced.CONFIGS)
    assert traced.config_order(1) == list(reversed(traced.CONFIGS))
    assert traced.config_order(2, ["a", "b"]) == ["a", "b"]
    stats = traced.ratio_stats([10.0, 9.0, None, 12.0], [10.0, 10.0, 5.0, 0.0])
    assert stats == {"median": 0.95, "min": 0.9, "max": 1.0, "n": 2, "at_least_1": 1}
    assert traced.ratio_stats([None], [1.0]) is None
    assert traced.fmt_ratio(stats) == "0.95 [0.90-1.00], 1/2 >= 1" and traced.fmt_ratio(None) == "n/a"


def test_traced_report_names_failed_launches():
    info = dict(cpu_count="2", cpu_model="x", torch="2.13.0", python="3.11", platform="Linux", cuda="none",
                loadavg_at_start="1.00 1.00 1.00")
    args = traced.parse_args(["--smoke"])
    data = {"args": vars(args), "total_s": 3.0, "trace": [], "stage_calls": [],
            "throughput": {"unet": {"error": "exit 1: RuntimeError: boom", "log": "/tmp/x.log", "launch_s": 1.0}},
            "probe2": {"error": "exit 1: RuntimeError: boom"}}
    text = traced.report(data, info, "python3 benchmarks/traced.py --smoke")
    assert "Failed: exit 1: RuntimeError: boom (log: /tmp/x.log)" in text
    assert "| 2 | | | | failed: exit 1: RuntimeError: boom | | | |" in text
    assert "load average at start 1.00 1.00 1.00" in text


@pytest.mark.slow  # a whole benchmark launch: `make test-all`
def test_traced_smoke_run(tmp_path):
    """benchmarks/traced.py --smoke end to end (tiny models, one 2-rank launch): every part
    reports, and pipedream_ext's first steps equal the unsplit model's."""
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(BENCH / "traced.py"), "--smoke", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = (tmp_path / "traced.md").read_text()
    for heading in ("## Trace and split", "## Stage calls", "## Throughput, 2 ranks",
                    "## A skip connection across several cuts"):
        assert heading in text
    data = json.loads((tmp_path / "traced.json").read_text())
    assert {r["model"] for r in data["trace"]} == {"resnet", "unet", "gpt"}
    assert all(r["nodes"] > 0 and r["total_s"] > 0 for r in data["trace"])
    configs = data["throughput"]["unet"]["configs"]
    assert set(configs) == set(traced.CONFIGS)
    for cfg, c in configs.items():
        assert len(c["samples_per_s"]) == 1, cfg
        if cfg.startswith("pd-"):
            assert c["loss_diff"] < 1e-5 and c["grad_max_diff"] < 1e-6, (cfg, c)
    split = data["probe2"]["splits"]["fan-out"]
    assert split["pipedream_ext"]["loss_diff"] < 1e-5 and split["pipedream_ext"]["grad_max_diff"] < 1e-6
    assert len(split["torch"]["ScheduleInterleaved1F1B"]) == 2  # both ranks' outcome recorded


# ----------------------------------------------------------------------------- zero_bubble
def test_zero_bubble_balance_and_placement():
    assert zero_bubble.balance(8, 2) == [8, 9]
    assert zero_bubble.balance(8, 4) == [4, 4, 4, 5]
    with pytest.raises(ValueError):
        zero_bubble.balance(6, 4)
    # V (zbv, dualpipev): rank r holds r and 2p-1-r; round robin: r and r+p.
    assert [zero_bubble.placement("zbv", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [zero_bubble.placement("torch-dualpipev", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [zero_bubble.placement("torch-interleaved-zb", r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert zero_bubble.placement("zb-h1", 1, 2, 1) == [1]


def test_zero_bubble_placement_is_the_schedules():
    from pipedream_ext import schedules

    for name in ("zbv", "dualpipev", "interleaved-zb"):
        s = schedules.build(name, stages=2, microbatches=8, chunks=2)
        assert [s.stages_of_rank(r) for r in range(2)] == [zero_bubble.placement(name, r, 2, 2) for r in range(2)]


def test_zero_bubble_pairs_ratio_candidate_over_baseline():
    rounds = [{"pair": 0, "config": "torch-zbv", "samples_per_s": 100.0},
              {"pair": 0, "config": "zbv", "samples_per_s": 120.0},
              {"pair": 1, "config": "torch-zbv", "samples_per_s": 200.0},
              {"pair": 1, "config": "zbv", "samples_per_s": 180.0},
              {"pair": 2, "config": "torch-zbv", "samples_per_s": 100.0},
              {"pair": 2, "config": "zbv", "samples_per_s": 110.0}]
    s = zero_bubble.comparison_summary(rounds, "torch-zbv", "zbv")
    assert s["ratios"] == pytest.approx([1.2, 0.9, 1.1])
    assert s["ratio"] == pytest.approx({"median": 1.1, "min": 0.9, "max": 1.2})
    assert s["baseline"]["median"] == 100.0 and s["candidate"]["max"] == 180.0
    assert s["candidate_ahead"] == 2
    assert zero_bubble.ratio_stats([]) == {}


def test_zero_bubble_stage_costs_from_a_trace():
    events = [{"name": "0F0", "cat": "compute", "ph": "X", "dur": 1000},
              {"name": "0F1", "cat": "compute", "ph": "X", "dur": 3000},
              {"name": "0F2", "cat": "compute", "ph": "X", "dur": 2000},
              {"name": "3I1", "cat": "compute", "ph": "X", "dur": 500},
              {"name": "3W1", "cat": "compute", "ph": "X", "dur": 700},
              {"name": "1RECV_F0", "cat": "wait", "ph": "X", "dur": 9000},
              {"name": "process_name", "ph": "M"}]
    assert zero_bubble.stage_costs_from_trace(events) == {
        "F": {0: pytest.approx(0.002)}, "I": {3: pytest.approx(0.0005)}, "W": {3: pytest.approx(0.0007)}}


def test_zero_bubble_simulated_bubbles():
    # Unit times F = I = W = 1 on 2 ranks, m = 8: 1f1b (p-1)/(m+p-1), zb-h1 and the V lower.
    assert zero_bubble.simulate("1f1b", 2, 8, 1) == pytest.approx(1 / 9)
    assert zero_bubble.simulate("zb-h1", 2, 8, 1) == pytest.approx(0.04, abs=1e-3)
    assert zero_bubble.simulate("zbv", 2, 8, 2) == pytest.approx(0.02, abs=1e-3)
    # Measured costs: the same numbers per stage give the same bubble; a missing kind: None.
    unit = {"F": {j: 1.0 for j in range(4)}, "I": {j: 1.0 for j in range(4)}, "W": {j: 1.0 for j in range(4)}}
    assert zero_bubble.simulate("zbv", 2, 8, 2, unit) == pytest.approx(zero_bubble.simulate("zbv", 2, 8, 2))
    assert zero_bubble.simulate("zbv", 2, 8, 2, {"F": unit["F"]}) is None
    assert zero_bubble.simulate("1f1b", 2, 8, 1, {"F": {0: 1.0, 1: 1.0}, "B": {0: 2.0}}) == pytest.approx(1 / 9)


def test_zero_bubble_rank_figures_are_medians_over_rounds():
    def rnd(wall, f, w, recv, busy=None):
        seconds = {"F": f, "W": w, "RECV_B": recv}
        if busy is not None:
            seconds.update(compute_s=f + w, busy_s=busy)
        return {"wall_s": wall, "cpu_s": wall / 2, "steps": 2, "seconds": seconds}

    # Three rounds, the last one slowed down by other work: the medians ignore it.
    rank = {"rounds": [rnd(1.0, 0.3, 0.5, 0.1, busy=0.9), rnd(1.2, 0.4, 0.6, 0.1, busy=1.1),
                       rnd(9.0, 3.0, 3.0, 2.0, busy=8.0)]}
    f = zero_bubble.rank_figures(rank)
    assert f["ms"] == pytest.approx({"F": 200.0, "W": 300.0, "RECV_B": 50.0})
    assert f["compute"] == pytest.approx(500.0) and f["wall"] == pytest.approx(600.0)
    assert f["idle"] == pytest.approx(1 - 0.8 / 1.0) and f["cpu_wall"] == pytest.approx(0.5)
    assert f["bubble_fraction"] == pytest.approx(1 - 0.8 / 0.9)
    # The quieter half (walls 1.0 and 1.2 of 1.0, 1.2, 9.0), summed: wall = compute + comm + rest.
    assert f["quiet"] == pytest.approx({"wall": 550.0, "compute": 450.0, "comm": 50.0, "rest": 50.0, "rounds": 2})
    rank["rounds"][0]["seconds"].pop("busy_s")
    assert zero_bubble.rank_figures(rank)["bubble_fraction"] is None


def test_zero_bubble_action_counts():
    assert zero_bubble.action_counts("zbv", 2, 8, 2) == {k: {j: 8 for j in range(4)} for k in ("F", "I", "W")}
    assert zero_bubble.action_counts("1f1b", 2, 8, 1) == {"F": {0: 8, 1: 8}, "B": {0: 8, 1: 8}}
    # dualpipev runs most backwards whole and splits a few; every microbatch's backward once.
    c = zero_bubble.action_counts("dualpipev", 2, 8, 2)
    assert c["F"] == {j: 8 for j in range(4)}
    assert all(c["B"][j] + c["I"][j] == 8 and c["I"][j] == c["W"][j] >= 1 for j in range(4))


def test_zero_bubble_stage_costs_scale_the_trace_to_the_timed_rounds():
    def rnd(f):
        return {"wall_s": 1.0, "cpu_s": 1.0, "steps": 1, "seconds": {"F": f, "I": f / 2}}

    # Rank 0 holds stages 0 and 3 (a V); the trace says stage 3's F costs 3x stage 0's,
    # the timed rounds that rank 0's F takes 0.8 s per step (median): 8 actions each.
    counts = {"F": {j: 8 for j in range(4)}, "I": {j: 8 for j in range(4)}}
    entry = {"stage_costs": {"F": {"0": 0.001, "1": 0.002, "2": 0.002, "3": 0.003},
                             "I": {"0": 0.001, "1": 0.001, "2": 0.001, "3": 0.001}},
             "ranks": [{"stages": [0, 3], "rounds": [rnd(0.8), rnd(0.8), rnd(5.0)]},
                       {"stages": [1, 2], "rounds": [rnd(0.4)]}]}
    costs = zero_bubble.stage_costs(entry, counts)
    assert costs["F"] == pytest.approx({0: 0.025, 3: 0.075, 1: 0.025, 2: 0.025})
    assert costs["I"] == pytest.approx({0: 0.025, 3: 0.025, 1: 0.0125, 2: 0.0125})
    # Fewer actions of a kind (dualpipev's I): the same seconds over fewer actions.
    few = dict(counts, I={0: 2, 3: 1, 1: 1, 2: 1})
    assert zero_bubble.stage_costs(entry, few)["I"] == pytest.approx({0: 0.4 / 3, 3: 0.4 / 3, 1: 0.1, 2: 0.1})
    # Torch: each rank reports its own stages' means.
    torch_entry = {"ranks": [
        {"stages": [0, 2], "rounds": [rnd(0.8)], "stage_costs": {"0": {"F": 1.0}, "2": {"F": 1.0}}},
        {"stages": [1, 3], "rounds": [rnd(0.8)], "stage_costs": {"1": {"F": 1.0}, "3": {"F": 3.0}}}]}
    assert zero_bubble.stage_costs(torch_entry, counts)["F"] == pytest.approx({0: 0.05, 2: 0.05, 1: 0.025, 3: 0.075})


def test_zero_bubble_smoke_mode_and_argument_checks():
    args = zero_bubble.parse_args(["--smoke"])
    assert (args.hidden, args.pairs, args.steps) == (32, 1, 1)
    assert zero_bubble.parse_args(["--comparisons", "zbv"]).comparisons == ["zbv"]
    for bad in (["--comparisons", "1f1b"], ["--layers", "6"], ["--batch", "10"], ["--warmup", "0"]):
        with pytest.raises(SystemExit):
            zero_bubble.parse_args(bad)


# ----------------------------------------------------------------------------- schedule_build
def test_schedule_build_fits_the_growth_exponent():
    assert schedule_build.fit_exponent([128, 256, 512], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert schedule_build.fit_exponent([1, 2, 4], [3.0, 12.0, 48.0]) == pytest.approx(2.0)
    assert schedule_build.fit_exponent([64], [1.0]) is None
    with pytest.raises(ValueError):
        schedule_build.fit_exponent([1, 2], [1.0])
    with pytest.raises(ValueError):
        schedule_build.fit_exponent([1, 2], [0.0, 1.0])


def test_schedule_build_report_fills_skipped_cells_from_the_other_sweep():
    cell = {"stages": 64, "microbatches": 1024, "seconds": 2.0, "cpu_seconds": 1.0, "actions": 1000}
    data = {"by_microbatches": {"1f1b": [{"stages": 64, "microbatches": 1024, "skipped": True}]},
            "by_stages": {"1f1b": [cell]}}
    assert schedule_build.measured_cells(data) == {("1f1b", 64, 1024): cell}
    args = schedule_build.parse_args(["--smoke"])
    assert (args.stages, args.microbatches, args.stage_counts, args.construct) == (4, [8, 16, 32], [2, 4, 8], [8, 16])


def test_schedule_build_smoke_run(tmp_path):
    """benchmarks/schedule_build.py --smoke: every schedule built at every size, and
    PipeDream(...) and torch's stage + schedule constructed on both ranks."""
    proc = _smoke("schedule_build.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "schedule_build.json").read_text())
    from pipedream_ext import schedules

    for part in ("by_microbatches", "by_stages"):
        assert set(data[part]) == set(schedules.names())
        for name, rows in data[part].items():
            assert len(rows) == 3 and all(r["seconds"] > 0 and r["actions"] > 0 for r in rows), (name, rows)
    ranks = data["construction"]["ranks"]
    assert len(ranks) == 2 and all(set(r["ours"]) == set(r["torch"]) == {"8", "16"} for r in ranks)
    text = (tmp_path / "schedule_build.md").read_text()
    assert "## Over the microbatches, p = 4" in text and "| 1f1b | 1 |" in text
    assert "## PipeDream(...) construction, 2 ranks, 1f1b" in text


# ----------------------------------------------------------------------------- vs_torch
def test_vs_torch_balance_puts_embedding_first_and_head_last():
    # gpt_sequential(8): embedding, 8 blocks, LayerNorm, head, flatten (12 layers).
    assert vs_torch.balance(8, 2) == [5, 7]
    assert vs_torch.balance(8, 4) == [3, 2, 2, 5]
    with pytest.raises(ValueError, match="multiple of 4"):
        vs_torch.balance(6, 4)


def test_vs_torch_every_flush_schedule_has_a_counterpart():
    from pipedream_ext import schedules

    assert {ours for ours, _, _ in vs_torch.COMPARISONS} == set(schedules.synchronous_names())
    assert all(chunks == (2 if schedules.traits(ours).multi_chunk else 1) for ours, chunks, _ in vs_torch.COMPARISONS)


def test_vs_torch_pairs_ratio_ours_over_torch():
    rounds = [{"pair": k, "config": f"{side} zbv", "samples_per_s": v, "seconds": 2.0 / v, "steps": 2}
              for k, (a, b) in enumerate([(10.0, 12.0), (10.0, 9.0), (8.0, 10.0)])
              for side, v in (("torch", a), ("ours", b))]
    s = vs_torch.summarise(rounds, "zbv")
    assert s["ratios"] == pytest.approx([1.2, 0.9, 1.25]) and s["ours_ahead"] == 2
    assert s["ratio"]["median"] == pytest.approx(1.2)
    assert s["ms_per_step"]["torch"]["median"] == pytest.approx(100.0)
    assert s["ours"] == {"median": 10.0, "min": 9.0, "max": 12.0}


def test_vs_torch_smoke_mode_and_argument_checks():
    args = vs_torch.parse_args(["--smoke"])
    assert (args.width, args.pairs, args.steps) == (16, 1, 1) and args.protocol is None
    assert vs_torch.parse_args(["--schedules", "zbv,1f1b", "--protocol", "split"]).schedules == ["zbv", "1f1b"]
    for bad in (["--schedules", "pipedream"], ["--blocks", "6"], ["--batch", "10"], ["--warmup", "0"],
                ["--protocol", "tagged"]):
        with pytest.raises(SystemExit):
            vs_torch.parse_args(bad)


# ----------------------------------------------------------------------------- smoke runs
def _smoke(script: str, out_dir: Path) -> "subprocess.CompletedProcess[str]":
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--out-dir", str(out_dir)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow  # a whole benchmark launch: `make test-all`
def test_zero_bubble_smoke_run(tmp_path):
    proc = _smoke("zero_bubble.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "zero_bubble.json").read_text())
    configs = data["result"]["configs"]
    assert set(configs) == {"1f1b", "zb-h1", "zbv", "torch-zbv", "dualpipev", "torch-dualpipev",
                            "interleaved-zb", "torch-interleaved-zb"}
    for name, entry in configs.items():
        assert "error" not in entry, (name, entry["error"])
        # The same work: every configuration's first loss and gradients are the unsplit model's.
        assert entry["same_work"]["loss_diff"] < 1e-5, name
        assert entry["same_work"]["grad_max_abs_diff"] < 1e-5, name
        assert entry["same_work"]["grad_tensors"] == entry["same_work"]["ref_tensors"], name
        assert len(entry["ranks"]) == 2 and all(r["wall_s"] > 0 for r in entry["ranks"]), name
    assert set(data["summary"]["comparisons"]) == {"zb-h1", "zbv", "dualpipev", "interleaved-zb"}
    text = (tmp_path / "zero_bubble.md").read_text()
    assert "| ours zbv / torch ScheduleZBVZeroBubble |" in text and "Load average (1 min)" in text


@pytest.mark.slow  # a whole benchmark launch, 14 configurations (about 40 s on 2 cores): `make test-all`
def test_vs_torch_smoke_run(tmp_path):
    proc = _smoke("vs_torch.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "vs_torch.json").read_text())
    configs = data["result"]["configs"]
    assert set(configs) == {f"{side} {ours}" for ours, _, _ in vs_torch.COMPARISONS for side in ("ours", "torch")}
    for name, entry in configs.items():
        assert "error" not in entry, (name, entry["error"])
        # The same work: every configuration's first loss and gradients are the unsplit model's.
        same = entry["same_work"]
        assert same["loss_diff"] < 1e-5 and same["grad_max_abs_diff"] < 1e-5, (name, same)
        assert same["params_compared"] == same["params"], (name, same)
        assert ("late_waits" in entry) == ("recv_wait_ms_per_step" in entry) == name.startswith("ours"), name
    assert set(data["summary"]["comparisons"]) == {ours for ours, _, _ in vs_torch.COMPARISONS}
    text = (tmp_path / "vs_torch.md").read_text()
    assert "| zbv | ScheduleZBVZeroBubble |" in text and "Load average (1 min)" in text


def test_vs_torch_ep_arguments():
    args = vs_torch_ep.parse_args(["--smoke"])
    assert (args.layers, args.experts, args.pairs) == (2, 4, 1)
    for bad in (["--layers", "3"], ["--experts", "5"], ["--batch", "6"], ["--schedules", "zbv"]):
        with pytest.raises(SystemExit):
            vs_torch_ep.parse_args(bad)


@pytest.mark.slow
def test_vs_torch_ep_smoke_run(tmp_path):
    """benchmarks/vs_torch_ep.py --smoke (one 4-rank launch, about 20 s): every
    configuration equals the unsplit model on its first step and the report has its tables."""
    proc = _smoke("vs_torch_ep.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "vs_torch_ep.md").read_text()
    for comparison in ("| 1f1b | Schedule1F1B |", "| gpipe | ScheduleGPipe |",
                       "| zb-h1 | ScheduleInterleavedZeroBubble |"):
        assert comparison in text, text
    same = [line for line in text.splitlines() if line.startswith(("| ours 1f1b", "| ours gpipe", "| ours zb-h1",
                                                                  "| torch 1f1b", "| torch gpipe", "| torch zb-h1"))]
    assert len(same) == 6 and all("| 19 of 19 |" in line for line in same), same


def test_vs_torch_tp_balance_and_collective_counts():
    assert vs_torch_tp.balance(4, 2) == [3, 4]  # embedding + 2 blocks | 2 blocks, norm, head
    assert vs_torch_tp.balance(4, 4) == [2, 1, 1, 3]
    with pytest.raises(ValueError, match="multiple of 4"):
        vs_torch_tp.balance(6, 4)
    names = ["c10d::allreduce_", "aten::mm", "c10d::send", "c10d::allreduce_", "[memory]"]
    assert vs_torch_tp.collective_counts(names) == {"c10d::allreduce_": 2, "c10d::send": 1}
    with pytest.raises(SystemExit):
        vs_torch_tp.parse_args(["--kv-heads", "3"])
    rounds = [{"config": "ours zbv", "cpu_s": 3.0, "steps": 2}, {"config": "torch zbv", "cpu_s": 1.0, "steps": 1},
              {"config": "ours zbv", "cpu_s": 1.0, "steps": 1}, {"config": "ours zbv", "cpu_s": 9.0, "steps": 1}]
    assert vs_torch_tp.cpu_ms_per_step(rounds, "zbv") == {"ours": 1500.0, "torch": 1000.0}
    assert vs_torch_tp.cpu_ms_per_step(rounds, "1f1b") == {}


@pytest.mark.slow  # a 4-rank launch building 6 configurations (about 35 s on 2 cores): `make test-all`
def test_vs_torch_tp_smoke_run(tmp_path):
    """benchmarks/vs_torch_tp.py --smoke: ours and torch's pieces on pp2 x tp2 both do the
    unsplit model's first step, are timed in the same rounds, and hold the same bytes."""
    proc = _smoke("vs_torch_tp.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "vs_torch_tp.json").read_text())
    configs = data["result"]["configs"]
    assert set(configs) == {f"{side} {ours}" for ours, _, _ in vs_torch_tp.COMPARISONS for side in ("ours", "torch")}
    for name, entry in configs.items():
        assert "error" not in entry, (name, entry["error"])
        same = entry["same_work"]
        assert same["loss_diff"] < 1e-5 and same["grad_max_abs_diff"] < 1e-5, (name, same)
        assert same["params_compared"] == same["params"], (name, same)
        assert len(entry["ranks"]) == 4 and all(r["step_peak"] > 0 for r in entry["ranks"]), name
        assert all(r["collectives"].get("c10d::allreduce_", 0) > 0 for r in entry["ranks"]), name  # TP's
        assert ("recv_wait_ms_per_step" in entry) == name.startswith("ours"), name
    for ours, _, _ in vs_torch_tp.COMPARISONS:  # TP shards alike on both sides: the same bytes
        held = [[r["params"] + r["grads"] + r["optim"] for r in configs[f"{side} {ours}"]["ranks"]]
                for side in ("ours", "torch")]
        assert held[0] == held[1], (ours, held)
    rounds = data["result"]["rounds"]
    assert {r["config"] for r in rounds} == set(configs) and all(r["cpu_s"] > 0 for r in rounds)
    text = (tmp_path / "vs_torch_tp.md").read_text()
    assert "| zbv | ScheduleZBVZeroBubble |" in text and "Load average (1 min)" in text


def test_split_backward_smoke_run(tmp_path):
    proc = _smoke("split_backward.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "split_backward.json").read_text())
    models = data["result"]["models"]
    assert set(models) == {"mlp", "gpt"}
    for part in models.values():
        assert len(part["ms_per_microbatch"]) == 2 and len(part["per_step"]) == 2
        assert set(part["step_ms"]) == {"1f1b", "zb-h1"}
    assert set(models["gpt"]["single"]) == {"first stage", "middle stage", "last stage"}
    for row in models["gpt"]["single"].values():
        assert row["B"] > 0 and row["ours ratio"] > 0 and row["torch ratio"] > 0
    order = models["gpt"]["order"]
    assert order["1f1b"]["B"] > 0 and order["1f1b"]["I"] == 0 and order["zb-h1"]["B"] == 0
    assert order["zb-h1"]["I"] > 0 and order["zb-h1"]["W"] > 0 and order["ratio"] > 0
    text = (tmp_path / "split_backward.md").read_text()
    assert text.count("Median ratio zb-h1 / 1f1b") == 2 and "torch (I + W) / B" in text


@pytest.mark.slow  # four 4-rank launches (about 80 s on 2 cores): `make test-all`
def test_fsdp_2d_smoke_run(tmp_path):
    """benchmarks/fsdp_2d.py --smoke: ours (fsdp, replicate) and torch's pipelining + FSDP2
    each train on pp 2 x dp 2; the sharded modes hold half of replicate's bytes."""
    proc = _smoke("fsdp_2d.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "fsdp_2d.json").read_text())["results"]
    assert set(results) == {"fsdp", "replicate", "torch", "interleaved"}
    modes = ("fsdp", "replicate", "torch")
    held = {mode: [r["params"] + r["grads"] + r["optim"] for r in results[mode]["ranks"]] for mode in modes}
    assert all(len(v) == 4 for v in held.values()), held
    # AdamW's step counters (one scalar per parameter) are not sharded: close to half, not exactly.
    assert all(0.45 < f / r < 0.55 for f, r in zip(held["fsdp"], held["replicate"])), held
    assert held["fsdp"] == held["torch"], held
    # The interleaved launch timed every mode on every rank.
    assert all(r[mode] > 0 for r in results["interleaved"]["ranks"] for mode in modes), results
    assert "| mode | samples/s (interleaved launch) | / fsdp | samples/s (its own launch) |" in \
        (tmp_path / "fsdp_2d.md").read_text()


def test_fsdp_2d_tensor_bytes_counts_local_shards():
    class Shard:  # a DTensor's duck type: its local tensor is what this rank holds
        def __init__(self, local):
            self.local = local

        element_size = None

        def to_local(self):
            return self.local

    class Plain:
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def element_size(self):
            return 4

    assert fsdp_2d.tensor_bytes([Plain(3), None, Shard(Plain(5))]) == 32
    with pytest.raises(SystemExit):
        fsdp_2d.parse_args(["--layers", "3"])


# ----------------------------------------------------------------------------- agreement
def test_agreement_report_lists_every_measurement():
    args = agreement.parse_args(["--reps", "5", "--batches", "64,256", "--rows", "32"])
    result = {"mlp_fingerprint_ms": 0.2, "gpt2_fingerprint_ms": 8.0, "gpt2_nodes": 282,
              "construction_exchange_ms": 0.9, "gpt2_exchange_ms": 1.4, "mlp_pipeline_ms": 48.0,
              "gpt2_split_ms": 5800.0, "check_ms": {"64": 2.2, "256": 9.8},
              "step_ms": {"checked": 48.5, "unchecked": 46.5, "check alone": 1.5},
              "open_allreduce_ms": 0.44, "flag_allreduce_ms": 0.4, "forward_only_ms": 18.8}
    info = {"cpu_count": "2", "cpu_model": "x", "torch": "2.13.0", "python": "3.11", "platform": "p",
            "cuda": "none", "loadavg_at_start": "1.00 1.00 1.00"}
    text = agreement.report(result, args, info, "python benchmarks/agreement.py")
    assert "| fingerprint of GPT-2 exported and cut in 2 (282 graph nodes; graph_fingerprint) " \
           "| 8.00 |" in text
    assert "| StepAgreement.check, batch of 256 x 3x32x32 float32 (3.0 MiB) + targets | 9.80 |" \
        in text
    assert "| difference | 2.00 |" in text
    assert "| forward_only's opening all-reduce: stage 0's batch size and a failure flag (every call) " \
           "| 0.44 |" in text
    assert "both included) | 18.80 |" in text
    assert "medians of 5 repetitions" in text


@pytest.mark.slow  # the whole GPU check on the CPU (about 40 s on 2 cores): `make test-all`
def test_gpu_check_runs_every_step_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.sh (`make gpu-check`) with DEVICE=cpu and smoke-sized benchmark
    rounds: every step passes and the summary holds the steps, the tests, the main job's
    accuracy and both vs_torch tables (so the script is ready when a GPU is lent)."""
    env = dict(os.environ, OUT=str(tmp_path), DEVICE="cpu", VS_TORCH_ARGS="--smoke")
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=600, env=env)
    summary = (tmp_path / "gpu_check.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + summary[-3000:]
    assert summary.count("| ok |") == 5 and "FAILED" not in summary and "TIMED OUT" not in summary, summary
    assert re.search(r"Tests: \d+ passed", summary) and "TEST ACCURACY 0.9" in summary, summary
    for world, title in ((1, "cpu, 1 rank"), (2, "cpu, 2 ranks")):
        assert f"on a GPT ({title}" in summary, summary
        assert (tmp_path / f"vs_torch_world{world}.json").exists()
    assert "| zbv | ScheduleZBVZeroBubble |" in summary and "| gpipe | ScheduleGPipe |" in summary
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back from $OUT


@pytest.mark.slow  # a 2-rank launch building 4 pipelines (about 15 s on 2 cores): `make test-all`
def test_mesh_choice_smoke_run():
    """benchmarks/mesh_choice.py: mesh="auto" chooses on 2 ranks, then every candidate it
    names is built on its own mesh and measured: one row per candidate, best first."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(BENCH / "mesh_choice.py"), "mlp", "--steps", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines() if re.match(r"(best|#\d+) ", line)]
    rows = re.findall(r"^\| mlp, 2 \| (\d+x\d+x\d+) ?(\w*) \| ([\d.]+) \| ([\d.]+) \|$", proc.stdout, re.M)
    assert table and len(rows) == len(table), proc.stdout
    # The table's meshes, in its order (best first), are the rows measured.
    assert [r[0] for r in rows] == [t[4] for t in table], proc.stdout
    # Each row's prediction is the table's step time of its candidate (ms, third column from the end).
    assert all(abs(float(r[2]) - float(t[-3])) < 0.006 for r, t in zip(rows, table)), proc.stdout
    assert all(float(pred) > 0 and float(meas) > 0 for _, _, pred, meas in rows), rows
    assert {r[0] for r in rows} >= {"1x2x1", "2x1x1"}, rows


def test_torchtitan_tp_needs_a_checkout_and_reports_every_configuration(tmp_path):
    with pytest.raises(SystemExit):
        torchtitan_tp.parse_args(["--torchtitan", str(tmp_path)])  # no torchtitan/models/llama3 there
    (tmp_path / "torchtitan" / "models" / "llama3").mkdir(parents=True)
    assert torchtitan_tp.parse_args(["--torchtitan", str(tmp_path)]).torchtitan == str(tmp_path)
    configs = [{"schedule": s, "sequence_parallel": sp, "tracer": "fx", "loss_rel": 1e-7, "weight_rel": 2e-5}
               for sp in (True, False) for s in torchtitan_tp.SCHEDULES]
    info = {"cpu_count": "2", "cpu_model": "x", "torch": "2.13.0", "python": "3.11", "platform": "p",
            "cuda": "none", "loadavg_at_start": "0 0 0"}
    text = torchtitan_tp.report({"configs": configs, "launch_s": 30.0}, info, "cmd", 31.0)
    assert text.count("| fx | 1.0e-07 | 2.0e-05 |") == 6, text
    assert "| zbv | linear layers only | fx |" in text and "| 1f1b | apply_tp (sequence parallel) | fx |" in text
