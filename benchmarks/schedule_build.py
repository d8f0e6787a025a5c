"""How building a schedule grows with the microbatches and the stages.

``pipedream_ext.schedules.build`` generates a schedule, lowers it, orders its
transfers and validates it (both forms, the mirrored transfer order and its channel
simulation): what every rank runs when it constructs a flush pipeline. Per schedule
this script times it

* over the microbatches m at ``--stages`` stages (default p = 64; m = 128 ... 1024),
* over the stages p at ``--microbatches-at`` microbatches (default m = 1024; p = 16, 64,
  256; the schedules with several chunks per rank run 2 chunks, so their stage count is
  2p),

and fits the growth exponent: the least-squares slope of log(time) against log(m)
(against log(p)); 1 is linear, 2 quadratic. Each cell is the fastest of up to 3 builds
within ``--budget`` seconds, in CPU seconds of this process (the wall time, which on a
shared machine depends on the other processes, is kept in the JSON record). A cell
whose time, extrapolated from the smaller sizes, exceeds ``--cap`` seconds is not run
(shown as ``> cap (est. N)``). With ``--before FILE`` (default
``results/schedule_build_before.json``: this script run on the code before the linear
rewrite, commit 4e2ad70) the tables put those times beside these.

A 2-rank launch (Gloo, CPU) then times ``PipeDream(...)`` (1f1b, an MLP cut in 2) at
``--construct`` microbatches (default 256, 1024, 4096) beside torch.distributed.
pipelining's ``PipelineStage`` + ``Schedule1F1B`` construction, medians of ``--reps``.

Writes ``<out-dir>/schedule_build.md`` (and ``.json``). About 3 minutes on 2 cores;
``--smoke`` runs tiny sizes in seconds. Command, from the repository root:

    python3 benchmarks/schedule_build.py [--smoke] [--out-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["build_seconds", "cell_seconds", "chunks_of", "fit_exponent", "main", "measured_cells", "parse_args",
           "report", "run_driver", "run_worker", "sweep"]

LOG = logging.getLogger("schedule_build")
JSON_TAG = "SCHEDULE_BUILD_JSON "
BEFORE = h.RESULTS / "schedule_build_before.json"


def chunks_of(name: str) -> int:
    """Chunks per rank the sweep builds ``name`` with: its fixed count, 2 for the other
    multi-chunk schedules, else 1."""
    from pipedream_ext import schedules

    traits = schedules.traits(name)
    return (traits.fixed_chunks or 2) if traits.multi_chunk else 1


def build_seconds(name: str, stages: int, microbatches: int, budget: float) -> Dict[str, float]:
    """The fastest of up to 3 ``schedules.build`` calls that start within ``budget`` seconds.

    Returns:
        ``seconds`` (wall) and ``cpu_seconds`` (this process's CPU time, what the build
        costs on a shared machine) of the fastest, and ``actions`` (of the lowered
        schedule, all ranks).
    """
    from pipedream_ext import schedules

    chunks = chunks_of(name)
    times: List[Tuple[float, float]] = []
    built = None
    start = time.perf_counter()
    while len(times) < 3 and (not times or time.perf_counter() - start < budget):
        t0, c0 = time.perf_counter(), time.process_time()
        built = schedules.build(name, stages=stages, microbatches=microbatches, chunks=chunks)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    assert built is not None
    csv = built.to_csv()
    actions = csv.count(",") + sum(1 for line in csv.splitlines() if line)
    wall, cpu = min(times)
    return {"seconds": wall, "cpu_seconds": cpu, "actions": actions}


def fit_exponent(sizes: Sequence[float], seconds: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(seconds) against log(sizes); None with fewer than 2 points.

    Raises:
        ValueError: sizes and seconds differ in length, or a value is not positive.
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times")
    if any(v <= 0 for v in list(sizes) + list(seconds)):
        raise ValueError(f"sizes and times must be positive (got {list(sizes)}, {list(seconds)})")
    if len(set(sizes)) < 2:
        return None
    xs = [math.log(s) for s in sizes]
    ys = [math.log(t) for t in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def cell_seconds(row: Dict[str, Any]) -> Optional[float]:
    """A timed cell's CPU seconds (its wall seconds in a record without them); None if not timed."""
    return row.get("cpu_seconds", row.get("seconds"))


def _predicted(rows: Sequence[Dict[str, Any]], key: str, size: int) -> Optional[float]:
    """The time of ``size`` extrapolated from the timed rows' fitted exponent (None: too few)."""
    timed = [r for r in rows if "seconds" in r]
    if len(timed) < 2:
        return None
    slope = fit_exponent([r[key] for r in timed], [cell_seconds(r) for r in timed])
    if slope is None:
        return None
    return cell_seconds(timed[-1]) * (size / timed[-1][key]) ** max(slope, 1.0)


def sweep(names: Sequence[str], cells: Sequence[Dict[str, int]], key: str, cap: float, budget: float,
          cache: Dict[Any, Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Times every schedule on ``cells`` (``{"stages", "microbatches"}``, ascending in ``key``).

    A cell whose time, extrapolated from the smaller ones (at least linearly), exceeds
    ``cap`` seconds, and every cell after one that took longer, is skipped (recorded with
    ``skipped`` and the estimate). A build that raises is recorded with ``error``.
    ``cache`` keeps every measured cell by (name, stages, microbatches) across sweeps.
    """
    out: Dict[str, List[Dict[str, Any]]] = {}
    for name in names:
        rows: List[Dict[str, Any]] = []
        for cell in cells:
            row: Dict[str, Any] = dict(cell)
            ident = (name, cell["stages"], cell["microbatches"])
            estimate = _predicted(rows, key, cell[key])
            slow = any((cell_seconds(r) or 0.0) > cap or r.get("skipped") for r in rows)
            if ident in cache:
                row = dict(cache[ident])
            elif slow or (estimate is not None and estimate > cap):
                row.update(skipped=True, estimate=estimate)
            else:
                try:
                    row.update(build_seconds(name, cell["stages"], cell["microbatches"], budget))
                    cache[ident] = row
                except ValueError as exc:
                    row["error"] = str(exc).splitlines()[0]
            LOG.info("%s p=%d m=%d: %s", name, cell["stages"], cell["microbatches"],
                     h.fmt(cell_seconds(row), 3, row.get("error", "skipped")))
            rows.append(row)
        out[name] = rows
    return out


# ----------------------------------------------------------------------------- construction
def run_worker(args: argparse.Namespace) -> int:
    """One rank: ``PipeDream(...)`` and torch's stage + Schedule1F1B at each M."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        import pipedream_ext as pd

        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = [args.width] * (args.layers + 1)
        ours: Dict[str, float] = {}
        theirs: Dict[str, float] = {}
        pd.PipeDream(h.mlp(sizes), F.cross_entropy, schedule="1f1b", microbatches=2, timeout=300)  # warm-up
        for m in args.construct:
            times: Dict[str, List[float]] = {"ours": [], "torch": []}
            for _ in range(args.reps):
                dist.barrier()
                t0 = time.perf_counter()
                pd.PipeDream(h.mlp(sizes), F.cross_entropy, schedule="1f1b", microbatches=m,
                             timeout=300)
                times["ours"].append(time.perf_counter() - t0)
                layers = list(h.mlp(sizes))
                cut = len(layers) // world
                part = nn.Sequential(*layers[rank * cut: len(layers) if rank == world - 1 else (rank + 1) * cut])
                dist.barrier()
                t0 = time.perf_counter()
                stage = PipelineStage(part, rank, world, torch.device("cpu"))
                Schedule1F1B(stage, n_microbatches=m, loss_fn=F.cross_entropy)
                times["torch"].append(time.perf_counter() - t0)
            ours[str(m)] = statistics.median(times["ours"])
            theirs[str(m)] = statistics.median(times["torch"])
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, {"ours": ours, "torch": theirs})
        result["ranks"] = gathered

    return h.worker(JSON_TAG, body, backend="gloo")


def _slowest(construction: Dict[str, Any], who: str, m: str) -> float:
    return max(r[who][m] for r in construction["ranks"])


# ----------------------------------------------------------------------------- report
def measured_cells(data: Dict[str, Any]) -> Dict[Tuple[str, int, int], Dict[str, Any]]:
    """Every timed cell of a run, both sweeps, by (schedule, stages, microbatches)."""
    out: Dict[Tuple[str, int, int], Dict[str, Any]] = {}
    for part in ("by_microbatches", "by_stages"):
        for name, rows in data.get(part, {}).items():
            for row in rows:
                if "seconds" in row:
                    out[(name, row["stages"], row["microbatches"])] = row
    return out


def _resolved(data: Dict[str, Any], part: str, name: str) -> List[Dict[str, Any]]:
    """A schedule's cells of one sweep, a skipped cell replaced by the other sweep's
    measurement of the same size where there is one."""
    measured = measured_cells(data)
    return [measured.get((name, row["stages"], row["microbatches"]), row)
            for row in data.get(part, {}).get(name, [])]


def _cell_text(row: Optional[Dict[str, Any]], cap: float) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "error"
    if row.get("skipped"):
        estimate = row.get("estimate")
        return f"> {cap:g} (est. {estimate:.0f})" if estimate else f"> {cap:g}"
    return h.fmt(cell_seconds(row), 3)


def _exponent_of(rows: Sequence[Dict[str, Any]], key: str) -> str:
    timed = [r for r in rows if "seconds" in r]
    slope = fit_exponent([r[key] for r in timed], [cell_seconds(r) for r in timed]) if len(timed) >= 2 else None
    text = h.fmt(slope)
    return text if len(timed) == len(rows) or slope is None else f"{text} ({len(timed)} sizes)"


def _speedup(old: Optional[Dict[str, Any]], new: Dict[str, Any]) -> str:
    if not old or "seconds" not in new:
        return "-"
    if "seconds" in old:
        return f"{cell_seconds(old) / cell_seconds(new):.0f}x"
    if old.get("estimate"):
        return f"~{old['estimate'] / cell_seconds(new):.0f}x (est.)"
    return "-"


def _sweep_table(data: Dict[str, Any], before: Optional[Dict[str, Any]], part: str, key: str) -> List[str]:
    cells = data["args"][part]
    label = "m" if key == "microbatches" else "p"
    header = ["schedule", "chunks"]
    for cell in cells:
        header += [f"{label} = {cell[key]}" + (" before / after (CPU s)" if before else " (CPU s)")]
    header += ["exponent" + (" before / after" if before else "")]
    header += (["speed-up, largest"] if before else []) + ["actions (largest)", "CPU µs per action"]
    rows = []
    for name in data[part]:
        after_rows = _resolved(data, part, name)
        old_rows = _resolved(before, part, name) if before else []
        row = [name, str(data["chunks"][name])]
        for k, cell in enumerate(after_rows):
            text = _cell_text(cell, data["args"]["cap"])
            if before:
                old = old_rows[k] if k < len(old_rows) else None
                text = f"{_cell_text(old, before['args']['cap'])} / {text}"
            row.append(text)
        exponent = _exponent_of(after_rows, key)
        if before:
            exponent = f"{_exponent_of(old_rows, key) if old_rows else '-'} / {exponent}"
        row.append(exponent)
        largest = next((r for r in reversed(after_rows) if "seconds" in r), None)
        if before:
            row.append(_speedup(old_rows[after_rows.index(largest)] if largest and old_rows else None,
                                largest or {}))
        row += [f"{largest['actions']:,}" if largest else "-",
                h.fmt(1e6 * cell_seconds(largest) / largest["actions"]) if largest else "-"]
        rows.append(row)
    return h.table(header, rows)


def _construction_table(data: Dict[str, Any], before: Optional[Dict[str, Any]]) -> List[str]:
    construction = data["construction"]
    rows = []
    old = (before or {}).get("construction")
    for m in data["args"]["construct"]:
        ours, theirs = _slowest(construction, "ours", str(m)), _slowest(construction, "torch", str(m))
        row = [str(m)]
        if before:
            row.append(h.fmt(_slowest(old, "ours", str(m)), 3) if old and str(m) in old["ranks"][0]["ours"] else "-")
        row += [h.fmt(ours, 3), h.fmt(theirs, 4), h.fmt(ours / theirs, 1)]
        rows.append(row)
    header = ["microbatches"] + (["PipeDream(...) before (s)"] if before else []) + \
        ["PipeDream(...) (s)", "torch stage + Schedule1F1B (s)", "ours / torch"]
    return h.table(header, rows)


def report(data: Dict[str, Any], before: Optional[Dict[str, Any]], info: Dict[str, str], command: str) -> str:
    """The Markdown report of one run (``before``: an earlier run's JSON, or None)."""
    args = data["args"]
    lines = ["# Schedule construction: build + validate against microbatches and stages", "",
             f"Command: `{command}` (total {data['total_s']:.0f} s).", "", h.machine_line(info), ""]
    if before:
        lines += [f"Before: {before['label']} (`{before.get('command', 'the same script')}`, load "
                  f"average at its start {before.get('machine', {}).get('loadavg_at_start', 'n/a')}); "
                  "after: this run. CPU seconds of the build (the machine is shared: wall time "
                  "depends on the other processes; the JSON record keeps it), the fastest of up to 3 "
                  "builds; `> cap (est. N)`: not run, its time extrapolated from "
                  "the smaller sizes (at least linearly) exceeds the cap. The exponent is the slope of "
                  "log(time) against log(m) (log(p)): 1 linear, 2 quadratic.", ""]
    lines += [f"## Over the microbatches, p = {args['stages']}", ""]
    lines += _sweep_table(data, before, "by_microbatches", "microbatches")
    lines += ["", f"## Over the stages, m = {args['microbatches_at']}", ""]
    lines += _sweep_table(data, before, "by_stages", "stages")
    if "construction" in data:
        lines += ["", f"## PipeDream(...) construction, 2 ranks, 1f1b (median of {args['reps']}, slowest rank)",
                  ""]
        lines += _construction_table(data, before)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- driver
def run_driver(args: argparse.Namespace) -> int:
    from pipedream_ext import schedules

    info, command = h.start_report(LOG)
    t0 = time.perf_counter()
    names = args.schedules or schedules.names()
    by_m = [{"stages": args.stages, "microbatches": m} for m in args.microbatches]
    by_p = [{"stages": p, "microbatches": args.microbatches_at} for p in args.stage_counts]
    data: Dict[str, Any] = {"args": dict(h.run_options(args), by_microbatches=by_m, by_stages=by_p),
                            "chunks": {name: chunks_of(name) for name in names}}
    cache: Dict[Any, Dict[str, Any]] = {}
    data["by_microbatches"] = sweep(names, by_m, "microbatches", args.cap, args.budget, cache)
    data["by_stages"] = sweep(names, by_p, "stages", args.cap, args.budget, cache)
    if args.construct:
        result = h.launch_torchrun(Path(__file__), 2, ["--worker"] + h.forward(
            args, "construct", "reps", "layers", "width"), JSON_TAG, timeout=1800)
        if "error" in result:
            LOG.error("construction launch failed: %s", result["error"])
            return 1
        data["construction"] = result
    data["total_s"] = time.perf_counter() - t0
    data.update(label=args.label, command=command, machine=info)
    before = None
    if args.before and Path(args.before).is_file() and not args.smoke:
        before = json.loads(Path(args.before).read_text())
    h.write_results(Path(args.out_dir), args.name, report(data, before, info, command), data)
    return 0


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a few seconds)")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset of pipedream_ext.schedules.names()")
    p.add_argument("--stages", type=int, default=64, help="p of the sweep over microbatches")
    p.add_argument("--microbatches", type=_ints, default=[128, 256, 512, 1024])
    p.add_argument("--microbatches-at", type=int, default=1024, help="m of the sweep over stages")
    p.add_argument("--stage-counts", type=_ints, default=[16, 64, 256])
    p.add_argument("--construct", type=_ints, default=[256, 1024, 4096],
                   help="microbatches of the PipeDream(...) construction launch (empty: none)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--cap", type=float, default=120.0, help="seconds; a slower build skips larger sizes")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of repeats per cell")
    p.add_argument("--before", default=str(BEFORE), help="an earlier run's JSON to compare with")
    p.add_argument("--label", default="this code", help="what the run measured (kept in its JSON)")
    p.add_argument("--name", default="schedule_build", help="result file stem")
    args = p.parse_args(argv)
    if args.smoke:
        args.stages, args.microbatches, args.microbatches_at = 4, [8, 16, 32], 32
        args.stage_counts, args.construct, args.reps, args.budget = [2, 4, 8], [8, 16], 1, 0.0
    return args


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
