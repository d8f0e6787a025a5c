"""The Markdown report of benchmarks/traced.py, one section per part."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import _harness as h

from .common import CONFIGS, LABELS, fmt_ratio, median, ratio_stats
from .skips import PROBE_SIZE
from .split import SHOWN_PHASES

__all__ = ["report"]


def _phase_ms(row: Dict[str, Any], *names: str) -> str:
    return h.fmt(sum(row["phases_s"].get(n, 0.0) for n in names) * 1e3, 1)


def _trace_section(data: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Part 1: trace and split, and split_model against the sample's batch size."""
    lines: List[str] = []
    lines += ["## Trace and split", "",
              f"`split_model(model, [point], (x,))` with a sample batch of {a['trace_batch']} (median of "
              f"{a['trace_reps']}); `symbolic_trace`, cut (`stage_starts` + `live_sets`), value check "
              "(`_value_kinds`: the sample run through the graph once, in eval mode), build (one "
              "`GraphModule` per stage), ownership check, other (the rest of `split_model`). 'forward' is "
              "the model's own forward on the same sample (no grad, eval), for scale. torch's "
              "`pipeline()` (torch.export) gets one microbatch of "
              f"{max(1, a['trace_batch'] // a['microbatches'])} as `mb_args`.", ""]
    rows = []
    for r in data["trace"]:
        per_node = r["total_s"] / r["nodes"] * 1e6 if r["nodes"] else None
        no_check = ((r["total_s"] - r["phases_s"].get("value_check", 0.0)) / r["nodes"] * 1e6
                    if r["nodes"] else None)
        torch_cell = h.fmt(r["torch_s"], 3) if r["torch_s"] is not None else f"failed: {r['torch_error']}"
        ratio = h.fmt(r["torch_s"] / r["total_s"], 1) if r["torch_s"] else "n/a"
        rows.append([r["model"], r["size"], r["nodes"], "/".join(map(str, r["stage_nodes"])),
                     "/".join(map(str, r["live"])), h.fmt(r["total_s"], 3),
                     *(_phase_ms(r, phase) for phase in SHOWN_PHASES), h.fmt(r["other_s"] * 1e3, 1),
                     h.fmt(r["forward_s"] * 1e3, 1), h.fmt(per_node, 0), h.fmt(no_check, 0), torch_cell, ratio])
    lines += h.table(["model", "size", "graph nodes", "stage nodes", "live values", "split_model (s)",
                      "symbolic_trace (ms)", "cut (ms)", "value check (ms)", "build (ms)", "ownership (ms)",
                      "other (ms)", "forward (ms)", "us per node", "us per node without value check",
                      "torch pipeline() (s)", "torch / ours"], rows)
    if data.get("sample_batches"):
        lines += ["", "`split_model` against the sample's batch size (the value check runs the whole sample "
                  "through the model once; `PipeDream(sample=(x, y))` passes the batch it is given):", ""]
        lines += h.table(["model", "size", "sample batch", "split_model (s)", "value check (s)", "forward (s)"],
                         [[r["model"], r["size"], r["batch"], h.fmt(r["total_s"], 3), h.fmt(r["value_check_s"], 3),
                           h.fmt(r["forward_s"], 3)] for r in data["sample_batches"]])
    return lines


def _stage_call_section(data: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Part 2: each stage alone, traced against nn.Sequential."""
    lines: List[str] = []
    lines += ["", "## Stage calls: traced GraphModule against nn.Sequential stage", "",
              "Each stage alone on one microbatch (no communication): forward under no_grad, and "
              f"forward+backward, {a['call_reps']} interleaved pairs each, median ms; ratio = traced / "
              "nn.Sequential per pair (median [min-max], pairs where the traced stage was slower or equal). "
              "'extra per call' = (traced - nn.Sequential forward) / module calls, at the tiny sizes: they have "
              "almost no compute, so they show the Python cost of a call (at the throughput sizes that "
              "difference is below the noise).", ""]
    rows = []
    for r in data["stage_calls"]:
        extra = ((r["fwd_traced_ms"] - r["fwd_sequential_ms"]) * 1e3 / r["traced_calls"]
                 if r["traced_calls"] and r["case"].startswith("tiny") else None)
        rows.append([r["case"], r["model"], f"{r['size']}, microbatch {r['microbatch']}", r["stage"],
                     r["traced_nodes"], r["traced_calls"],
                     f"{r['fwd_traced_ms']:.3f} / {r['fwd_sequential_ms']:.3f}", fmt_ratio(r["fwd_ratio"]),
                     h.fmt(extra, 1, ""), f"{r['fwd_bwd_traced_ms']:.3f} / {r['fwd_bwd_sequential_ms']:.3f}",
                     fmt_ratio(r["fwd_bwd_ratio"])])
    lines += h.table(["case", "model", "size", "stage", "GraphModule nodes", "module calls",
                      "forward ms (traced / nn.Sequential)", "forward ratio", "extra per call (us)",
                      "forward+backward ms (traced / nn.Sequential)", "forward+backward ratio"], rows)
    return lines


def _throughput_model(model: str, res: Dict[str, Any]) -> List[str]:
    """Part 3, one model's launch: a row per configuration, then the ratios per round."""
    lines: List[str] = []
    load = res.get("loadavg") or []
    load_text = (f"load average (1 min) {load[0][0]:.2f} at the start of the rounds, "
                 f"{max(x[0] for x in load):.2f} at most") if load else "load n/a"
    lines += [f"### {model}: {res.get('size', '')}, split at `{res.get('split_point', '')}` ({load_text})", ""]
    if "error" in res and not res.get("configs"):
        return lines + [f"Failed: {res['error']} (log: {res.get('log', 'n/a')})", ""]
    rows = []
    for cfg in CONFIGS:
        c = res.get("configs", {}).get(cfg, {})
        sps = c.get("samples_per_s") or []
        if "error" in c or not sps:
            rows.append([LABELS[cfg], f"n/a ({c.get('error', res.get('error', 'no result'))})"] + [""] * 5)
            continue
        check = (f"loss {c['loss_diff']:.1e}, grads {c['grad_max_diff']:.1e} [{c['grad_max']:.1e}]"
                 + (f", {c['params_without_grad']} params without grad" if c["params_without_grad"] else ""))
        rows.append([LABELS[cfg], f"{median(sps):.1f} [{min(sps):.1f}-{max(sps):.1f}]",
                     h.fmt(median(c.get("cpu_us_per_sample") or []), 0),
                     h.fmt(median(c["compute_ms_per_step"]), 1) if c.get("compute_ms_per_step") else "",
                     h.fmt(c.get("build_s"), 2), check])
    lines += h.table(["configuration", "samples/s", "CPU us/sample (both ranks)", "compute ms/step",
                      "construction (s)", "first step vs unsplit"], rows)
    cfgs = res.get("configs", {})

    def sps_of(cfg: str) -> List[Optional[float]]:
        return list(cfgs.get(cfg, {}).get("samples_per_s") or [])

    def cmp_of(cfg: str) -> List[Optional[float]]:
        return list(cfgs.get(cfg, {}).get("compute_ms_per_step") or [])

    def inv(values: List[Optional[float]]) -> List[Optional[float]]:
        return [1.0 / v if v else None for v in values]

    def cpu_of(cfg: str) -> List[Optional[float]]:
        return list(cfgs.get(cfg, {}).get("cpu_us_per_sample") or [])

    ratio_rows = [
        ("samples/s, traced / nn.Sequential", sps_of, "pd-traced", "pd-sequential", False),
        ("CPU time per sample, nn.Sequential / traced", cpu_of, "pd-traced", "pd-sequential", True),
        ("compute time per step, nn.Sequential / traced", cmp_of, "pd-traced", "pd-sequential", True),
        ("samples/s, pipedream_ext traced / torch", sps_of, "pd-traced", "torch", False),
        ("CPU time per sample, torch / pipedream_ext traced", cpu_of, "pd-traced", "torch", True)]
    rows = []
    for title, get, a_cfg, b_cfg, invert in ratio_rows:
        cells = []
        for sched in ("1f1b", "gpipe"):
            x_, y_ = get(f"{a_cfg}-{sched}"), get(f"{b_cfg}-{sched}")
            cells.append(fmt_ratio(ratio_stats(inv(x_), inv(y_)) if invert else ratio_stats(x_, y_)))
        rows.append([title] + cells)
    lines += [""] + h.table(["ratio per round (> 1: the first named is faster)", "1f1b", "gpipe"], rows) + [""]
    return lines


def _throughput_section(data: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Part 3: throughput on 2 ranks, per model."""
    lines: List[str] = []
    lines += ["", "## Throughput, 2 ranks", "",
              f"Global batch {a['batch']}, {a['microbatches']} microbatches, SGD; {a['reps']} rounds of {a['steps']} "
              f"steps per configuration after {a['warmup']} warm-up steps, interleaved step by step (the six "
              "configurations in turn, the order reversed every other step, each step between two barriers); "
              "samples/s from the slower rank (median [min-max] over rounds). 'first step' compares the first "
              "step's loss and every gradient with the unsplit model on the same microbatches (max abs "
              "difference; max |gradient| in brackets). 'compute' is pipedream_ext's F and B time per step on "
              "the busier rank (`stats()`).", ""]
    for model, res in data["throughput"].items():
        lines += _throughput_model(model, res)
    return lines


def _skip_section(data: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Part 4: a skip connection across several cuts, on 2 and 3 ranks."""
    lines: List[str] = []
    lines += ["## A skip connection across several cuts", "",
              f"The U-Net ({PROBE_SIZE['label']}) cut so that the first level's skip connection crosses "
              "more than one cut, two ways: **fan-out** (the stage making the skip also feeds it to the "
              "next stage, so two later stages use one value) and **jump** (the skip goes only to the "
              "stage using it, over the stages between). 2 ranks: 4 stages, two per rank (pipedream_ext "
              "interleaved-1f1b, chunks=2; torch ScheduleInterleaved1F1B and ScheduleLoopedBFS); 3 ranks: "
              "3 stages (pipedream_ext 1f1b; torch Schedule1F1B and ScheduleGPipe). One step of 4 "
              "microbatches from the initial weights against the unsplit model. The torch schedules run "
              f"on a group with a {a['probe_timeout']:.0f} s timeout, so that ranks blocked on a failing "
              "peer give up instead of hanging.", ""]
    rows = []
    for key in ("probe2", "probe3"):
        probe = data.get(key)
        if not probe:
            continue
        if "splits" not in probe:
            rows.append([key[-1], "", "", "", f"failed: {probe.get('error', 'no result')}", "", "", ""])
            continue
        ref = probe["reference_loss"]
        for label, out in probe["splits"].items():
            p = out["pipedream_ext"]
            rows.append([probe["world"], f"{label} ({out['stages']} stages)", f"`{out['split_points']}`",
                         f"pipedream_ext {probe['pd_schedule']}", "runs", f"{p['loss_diff']:.1e}",
                         f"{p['grad_max_diff']:.1e} [{p['grad_max']:.1e}]",
                         "live sets " + ", ".join(f"cut {k + 1}: {v}" for k, v in enumerate(p["live"]))])
            for name, ranks in (out.get("torch") or {}).items():
                errors = [f"rank {r['rank']} ({r['seconds']:.0f} s): {r['error']}" for r in ranks if "error" in r]
                if errors:
                    rows.append(["", "", "", f"torch {name}", "fails", "", "", "; ".join(errors)])
                    continue
                loss = next((r["loss"] for r in ranks if "loss" in r), None)
                diff = max(r.get("grad_max_diff", 0.0) for r in ranks)
                scale = max(r.get("grad_max", 0.0) for r in ranks)
                rows.append(["", "", "", f"torch {name}", "runs",
                             f"{abs(loss - ref):.1e}" if loss is not None else "n/a", f"{diff:.1e} [{scale:.1e}]",
                             ""])
    lines += h.table(["ranks", "split", "split points", "runtime", "result", "loss difference",
                      "max gradient difference [max gradient]", "notes"], rows)
    return lines


def report(data: Dict[str, Any], info: Dict[str, str], command: str) -> str:
    """The Markdown report of a run (``data``: the JSON written beside it)."""
    a = data["args"]
    lines = ["# Traced models", "", f"Command: `{command}` (total {data['total_s']:.0f} s).", "",
             h.machine_line(info) + " One thread per process (torch.set_num_threads(1), OMP_NUM_THREADS=1); "
             "the machine is shared, so compare within a run: every comparison below is interleaved.", ""]
    for section in (_trace_section, _stage_call_section, _throughput_section, _skip_section):
        lines += section(data, a)
    lines.append("")
    return "\n".join(lines)
