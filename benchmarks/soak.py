"""Soak run: many steps of a tiny model on 4 ranks for every schedule; memory per rank
must stay flat, no queue may grow and throughput must stay steady.

For each schedule in ``--schedules`` (gpipe, 1f1b, interleaved-1f1b with 2 chunks,
zb-h1, pipedream, pipedream-2bw) one ``torch.distributed.run`` launch of
``--ranks`` ranks (Gloo, one thread each) trains ``--blocks`` x [Linear(W, W), ReLU]
+ Linear(W, 10) (W = ``--width`` 32) for ``--steps`` calls of ``pipe.step`` (flush
schedules: a batch of ``--batch`` in ``--microbatches``, then ``optimizer.step()``;
pipedream: one minibatch of batch/microbatches per step; pipedream-2bw: one batch per
step; the asynchronous ones never flush until the end, so their stream runs for all
steps). Every ``--sample-every`` steps each rank records: RSS (``/proc/self/statm``
resident pages x page size), the steps/s of the last window, ``pipe.stats()``
counters (compute/wait/busy seconds, bytes and transfer counts, peak activations and
weight versions, weight bytes copied), the number of Python objects the GC tracks,
and the queues ``pipe.stats()`` reports: ``held_targets`` (targets kept until their
backward: ``pending_targets`` for asynchronous schedules, ``flush_targets`` for flush
ones) and ``executor_actions`` / ``executor_position`` (the executor's window of actions).

Verdict, after the warm-up (the first ``--warmup-frac`` of the steps):

* RSS: a rank whose RSS rises more than ``--rss-threshold-mib`` (default 5 MiB) above
  its value at the end of the warm-up fails;
* throughput: steps/s of the last quarter below (1 - ``--max-drop``) (default 30%)
  times the first quarter's fails (rank 0's clock; ranks are coupled);
* queues: a queue whose largest sampled value in the last quarter exceeds the first
  quarter's by more than max(2, half of it) fails (a bounded, periodic queue does not).

The script exits 1 if any schedule fails (or a launch fails), else 0. Writes
``<out-dir>/soak.md``, ``<out-dir>/soak.json`` and ``<out-dir>/soak.png`` (RSS per rank
and steps/s against the step, one panel per schedule). Command, from the repository
root (the issue's run: 20 000 steps per schedule; measure with fewer first):

    python3 benchmarks/soak.py [--steps 20000] [--schedules gpipe,1f1b,...]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["after_warmup", "assess", "cpu_per_step", "evaluate", "main", "parse_args", "plot", "quarters",
           "queue_growing", "rate", "rss_bytes", "rss_summary", "run_driver", "run_worker", "summary_table",
           "throughput_summary"]

LOG = logging.getLogger("soak")
JSON_TAG = "SOAK_JSON "
MIB = float(1 << 20)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "pipedream", "pipedream-2bw")
QUEUES = ("pending_targets", "executor_size", "flush_targets")


# ----------------------------------------------------------------------------- pure helpers
def rss_bytes(statm: Optional[str] = None, page_size: Optional[int] = None) -> int:
    """Resident set size from /proc/self/statm (its second field, in pages)."""
    if statm is None:
        with open("/proc/self/statm", encoding="ascii") as fh:
            statm = fh.read()
    if page_size is None:
        page_size = os.sysconf("SC_PAGE_SIZE")
    return int(statm.split()[1]) * page_size


def after_warmup(samples: Sequence[Dict[str, Any]], warmup_step: int) -> List[Dict[str, Any]]:
    """Samples at or after ``warmup_step`` (the first of them is the baseline)."""
    return [s for s in samples if s["step"] >= warmup_step]


def quarters(samples: Sequence[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """First and last quarter (by step) of a list of samples, each at least two samples
    long when there are two (so a rate can be taken over it)."""
    if not samples:
        return [], []
    lo, hi = samples[0]["step"], samples[-1]["step"]
    span = hi - lo
    first = [s for s in samples if s["step"] <= lo + span / 4]
    last = [s for s in samples if s["step"] >= hi - span / 4]
    if len(first) < 2:
        first = list(samples[:2])
    if len(last) < 2:
        last = list(samples[-2:])
    return first, last


def rate(samples: Sequence[Dict[str, Any]]) -> Optional[float]:
    """Steps per second between the first and last sample of a run of samples."""
    if len(samples) < 2 or samples[-1]["t"] <= samples[0]["t"]:
        return None
    return (samples[-1]["step"] - samples[0]["step"]) / (samples[-1]["t"] - samples[0]["t"])


def rss_summary(samples: Sequence[Dict[str, Any]], warmup_step: int) -> Dict[str, float]:
    """RSS (bytes) at the end of warm-up, mean of the first and last quarter after it,
    and the largest rise above the warm-up value."""
    post = after_warmup(samples, warmup_step)
    if not post:
        raise ValueError(f"no samples at or after step {warmup_step}")
    first, last = quarters(post)
    base = post[0]["rss"]
    return {"baseline": float(base), "first": sum(s["rss"] for s in first) / len(first),
            "last": sum(s["rss"] for s in last) / len(last),
            "max_growth": float(max(s["rss"] for s in post) - base)}


def throughput_summary(samples: Sequence[Dict[str, Any]], warmup_step: int) -> Dict[str, Optional[float]]:
    """Steps/s over the first and the last quarter after warm-up, and overall."""
    post = after_warmup(samples, warmup_step)
    first, last = quarters(post)
    return {"first": rate(first), "last": rate(last), "overall": rate(post)}


def cpu_per_step(samples: Sequence[Dict[str, Any]], warmup_step: int) -> Dict[str, Optional[float]]:
    """CPU seconds per step of the process and the mean 1-minute load average over the
    first and last quarter after warm-up: a throughput drop with the same CPU time per
    step and a higher load average points at other work on the machine."""
    first, last = quarters(after_warmup(samples, warmup_step))
    out: Dict[str, Optional[float]] = {}
    for name, part in (("first", first), ("last", last)):
        ok = [s for s in part if s.get("cpu_s") is not None]
        span = ok[-1]["step"] - ok[0]["step"] if len(ok) >= 2 else 0
        out[f"cpu_ms_per_step_{name}"] = 1e3 * (ok[-1]["cpu_s"] - ok[0]["cpu_s"]) / span if span else None
        loads = [s["loadavg"] for s in part if s.get("loadavg") is not None]
        out[f"loadavg_{name}"] = sum(loads) / len(loads) if loads else None
    return out


def queue_growing(values_first: Sequence[float], values_last: Sequence[float]) -> bool:
    """True when the last quarter's largest value exceeds the first quarter's largest by
    more than max(2, half of it): a bounded (periodic) queue never does."""
    if not values_first or not values_last:
        return False
    a, b = max(values_first), max(values_last)
    return b > a + max(2.0, 0.5 * a)


def assess(ranks: Sequence[Sequence[Dict[str, Any]]], warmup_step: int, rss_threshold: float,
           max_drop: float) -> Tuple[List[str], Dict[str, Any]]:
    """Problems found in one schedule's samples (one list per rank) and the figures.

    Returns:
        ``(problems, figures)``; an empty list means the run passed.
    """
    problems: List[str] = []
    rss = [rss_summary(s, warmup_step) for s in ranks]
    for r, fig in enumerate(rss):
        if fig["max_growth"] > rss_threshold:
            problems.append(f"rank {r}: RSS grew {fig['max_growth'] / MIB:.2f} MiB after warm-up "
                            f"(threshold {rss_threshold / MIB:.2f} MiB)")
    tp = throughput_summary(ranks[0], warmup_step)
    tp.update(cpu_per_step(ranks[0], warmup_step))
    if tp["first"] and tp["last"] is not None and tp["last"] < (1 - max_drop) * tp["first"]:
        problems.append(f"throughput fell from {tp['first']:.1f} to {tp['last']:.1f} steps/s "
                        f"(more than {100 * max_drop:.0f}%)")
    queues: Dict[str, Dict[str, float]] = {}
    for r, samples in enumerate(ranks):
        first, last = quarters(after_warmup(samples, warmup_step))
        for q in QUEUES:
            a = [s[q] for s in first if s.get(q) is not None]
            b = [s[q] for s in last if s.get(q) is not None]
            if not a or not b:
                continue
            cur = queues.setdefault(q, {"first": 0.0, "last": 0.0})
            cur["first"], cur["last"] = max(cur["first"], max(a)), max(cur["last"], max(b))
            if queue_growing(a, b):
                problems.append(f"rank {r}: {q} grew from at most {max(a)} to {max(b)}")
    return problems, {"rss": rss, "throughput": tp, "queues": queues}


# ----------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> int:
    """One rank: ``--steps`` steps of schedule ``--worker``, sampled every ``--sample-every``."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from tqdm import tqdm

        import pipedream_ext as pd

        rank, world = dist.get_rank(), dist.get_world_size()
        schedule = result["schedule"] = args.worker
        M = args.microbatches
        pipe = pd.PipeDream(h.mlp([args.width] * (args.blocks + 1) + [10], args.seed), F.cross_entropy,
                            schedule=schedule,
                            microbatches=M, chunks=2 if schedule == "interleaved-1f1b" else 1,
                            timeout=args.pipe_timeout)
        params = list(pipe.parameters())
        opt = torch.optim.SGD(params, lr=args.lr) if params else None
        g = torch.Generator().manual_seed(args.seed)
        data = [(torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
                for _ in range(8)]
        if schedule == "pipedream":
            mb = args.batch // M
            feed = [(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for x, y in data for i in range(M)]
        else:
            feed = data

        def one(i: int) -> None:
            x, y = feed[i % len(feed)]
            if pipe.asynchronous:
                pipe.step(x, y, optimizer=opt)
            else:
                pipe.step(x, y)
                if opt is not None:
                    opt.step()
                    opt.zero_grad()

        def sample(step: int, t: float, window_rate: Optional[float]) -> Dict[str, Any]:
            st = pipe.stats()
            return {"step": step, "t": t, "rss": rss_bytes(), "steps_per_s": window_rate,
                    "cpu_s": time.process_time(), "loadavg": os.getloadavg()[0],
                    "compute_s": st["compute_s"], "wait_s": st["wait_s"], "busy_s": st["busy_s"],
                    "bytes_sent": st["bytes_sent"], "sends": st["sends"], "receives": st["receives"],
                    "peak_activations": st["peak_activations"],
                    "peak_weight_versions": max(st["peak_weight_versions"].values(), default=0),
                    "weight_bytes_copied": st["weight_bytes_copied"], "gc_objects": len(gc.get_objects()),
                    "pending_targets": st["held_targets"] if pipe.asynchronous else None,
                    "flush_targets": None if pipe.asynchronous else st["held_targets"],
                    "executor_size": st["executor_actions"],
                    "executor_position": st["executor_position"]}

        every = max(1, args.sample_every or args.steps // 100)
        dist.barrier()
        t0 = time.perf_counter()
        samples = [sample(0, 0.0, None)]
        last_t, last_step = 0.0, 0
        for i in tqdm(range(args.steps), desc=f"{schedule} rank {rank}", disable=rank != 0 or not args.progress,
                      mininterval=5.0, file=sys.stderr):
            one(i)
            step = i + 1
            if step % every == 0 or step == args.steps:
                t = time.perf_counter() - t0
                samples.append(sample(step, t, (step - last_step) / max(t - last_t, 1e-9)))
                last_t, last_step = t, step
        pipe.flush()
        wall = time.perf_counter() - t0
        mine = {"rank": rank, "stages": list(pipe.local_stages), "wall_s": wall, "samples": samples,
                "final_rss": rss_bytes()}
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        result["ranks"] = gathered

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def plot(runs: Dict[str, Dict[str, Any]], path: Path, warmup_step: int) -> None:
    plt = h.pyplot()

    names = [s for s, r in runs.items() if r.get("ranks")]
    cols = 2
    rows = max(1, (len(names) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        ranks = sorted(runs[name]["ranks"], key=lambda r: r["rank"])
        for r in ranks:
            ss = r["samples"]
            ax.plot([s["step"] for s in ss], [s["rss"] / MIB for s in ss], lw=1, label=f"RSS rank {r['rank']}")
        ax.axvline(warmup_step, color="gray", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("RSS (MiB)")
        ax2 = ax.twinx()
        ss = ranks[0]["samples"][1:]
        ax2.plot([s["step"] for s in ss], [s["steps_per_s"] for s in ss], color="black", lw=0.8, alpha=0.6,
                 label="steps/s (rank 0)")
        ax2.set_ylabel("steps/s")
        ax2.set_ylim(bottom=0)
        verdict = "ok" if not runs[name].get("problems") else "FAIL"
        ax.set_title(f"{name}: {verdict}", fontsize=10)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    h.save_figure(fig, path, dpi=100)


def summary_table(runs: Dict[str, Dict[str, Any]]) -> List[str]:
    """One row per schedule: throughput, CPU and load, RSS, queues and the verdict."""
    lines = h.table(["schedule", "steps", "wall (s)", "steps/s first quarter -> last quarter",
                     "rank 0 CPU ms per step; load average (1 min), first -> last quarter",
                     "RSS per rank, first -> last quarter (MiB)", "max RSS growth after warm-up (MiB, worst rank)",
                     "queues, max first -> last quarter", "peak activations / weight versions", "verdict"])
    for name, run in runs.items():
        if "figures" not in run:
            error = run.get("error", "no result").replace("|", "/")
            lines.append(h.table_row([name] + [""] * 8 + [f"FAILED: {error[:300]}"]))
            continue
        f = run["figures"]
        tp = f["throughput"]
        change = (f" ({100 * (tp['last'] / tp['first'] - 1):+.0f}%)" if tp["first"] and tp["last"] else "")
        rss = ", ".join(f"{x['first'] / MIB:.1f} -> {x['last'] / MIB:.1f}" for x in f["rss"])
        growth = max(x["max_growth"] for x in f["rss"]) / MIB
        queues = "; ".join(f"{q} {v['first']:.0f} -> {v['last']:.0f}" for q, v in f["queues"].items())
        last = [r["samples"][-1] for r in run["ranks"]]
        peaks = (f"{max(s['peak_activations'] for s in last)} / "
                 f"{max(s['peak_weight_versions'] for s in last)}")
        verdict = "ok" if not run["problems"] else "FAIL: " + "; ".join(run["problems"]).replace("|", "/")
        cpu = (f"{tp.get('cpu_ms_per_step_first') or 0:.2f} -> {tp.get('cpu_ms_per_step_last') or 0:.2f}; "
               f"{tp.get('loadavg_first') or 0:.1f} -> {tp.get('loadavg_last') or 0:.1f}")
        lines.append(h.table_row([name, run["steps"], f"{run['wall_s']:.0f}",
                                  f"{tp['first'] or 0:.0f} -> {tp['last'] or 0:.0f}{change}", cpu, rss,
                                  f"{growth:.2f}", queues, peaks, verdict]))
    return lines


def evaluate(name: str, r: Dict[str, Any], args: argparse.Namespace, warmup_step: int) -> bool:
    """Adds ``problems`` and ``figures`` to one schedule's launch result; True if it failed.

    A launch that failed after every rank reported its samples (e.g. a crash at
    shutdown) is assessed too, and fails with the launch error among its problems."""
    if not r.get("ranks"):
        LOG.error("%s: %s", name, r.get("error", "no result"))
        return True
    ranks = sorted(r["ranks"], key=lambda x: x["rank"])
    problems, figures = assess([x["samples"] for x in ranks], warmup_step, args.rss_threshold_mib * MIB,
                               args.max_drop)
    if "error" in r:
        problems.append(f"the launch failed after the samples were in: {r['error']}")
    r.update(problems=problems, figures=figures, wall_s=max(x["wall_s"] for x in ranks), ranks=ranks)
    tp = figures["throughput"]
    LOG.info("%s: %d steps in %.0f s (launch %.0f s), steps/s %.0f -> %.0f, max RSS growth %.2f MiB: %s",
             name, r["steps"], r["wall_s"], r.get("launch_s", 0.0), tp["first"] or 0, tp["last"] or 0,
             max(x["max_growth"] for x in figures["rss"]) / MIB, problems or "ok")
    return bool(problems)


def run_driver(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    t_start = time.perf_counter()
    out_dir = Path(args.out_dir)
    warmup_step = int(args.steps * args.warmup_frac)
    runs: Dict[str, Dict[str, Any]] = {}
    failed = False
    if args.from_json:
        # Re-assess and re-report a previous run (same --steps and thresholds as given now).
        data = json.loads(Path(args.from_json).read_text())
        info, command, total_s = data["machine"], data["command"], data["total_s"]
        for name, r in data["runs"].items():
            r.pop("problems", None)
            r.pop("figures", None)
            runs[name] = r
            failed = evaluate(name, r, args, warmup_step) or failed
    else:
        info, command = h.start_report(LOG)
        script = Path(__file__).resolve()
        common = h.forward(args, "steps", "sample_every", "width", "blocks", "batch", "microbatches", "lr", "seed",
                           "pipe_timeout")
        for name in tqdm(args.schedules, desc="schedules", unit="schedule"):
            r = h.launch_torchrun(script, args.ranks, ["--worker", name] + common, JSON_TAG, args.timeout)
            r["steps"] = args.steps
            runs[name] = r
            failed = evaluate(name, r, args, warmup_step) or failed
        total_s = time.perf_counter() - t_start
    every = max(1, args.sample_every or args.steps // 100)
    lines = ["# Soak", "",
             f"Command: `{command}` (total {total_s:.0f} s, launches included)."
             + (f" Report regenerated from its JSON with `{h.command_line()}`." if args.from_json else ""), "",
             h.machine_line(info) + " One thread per rank, Gloo.", "",
             f"{args.ranks} ranks; model {args.blocks} x [Linear({args.width}, {args.width}), ReLU] + "
             f"Linear({args.width}, 10), SGD lr={args.lr}; {args.steps} steps per schedule (flush schedules and "
             f"pipedream-2bw: a batch of {args.batch} in {args.microbatches} microbatches per step; pipedream: "
             f"one minibatch of {args.batch // args.microbatches} per step; asynchronous schedules flush only at "
             f"the end); samples every {every} steps; warm-up = the first {warmup_step} steps. Criteria: RSS "
             f"growth after warm-up at most {args.rss_threshold_mib:g} MiB on every rank; last-quarter steps/s at "
             f"least {100 * (1 - args.max_drop):.0f}% of the first quarter's (rank 0); no queue "
             "(pending targets, executor window, flush targets) whose last-quarter maximum exceeds the first "
             "quarter's by more than max(2, half of it); every launch exits cleanly.", ""]
    lines += summary_table(runs)
    lines += ["", "Plot: `soak.png` (RSS per rank and rank 0's steps/s against the step, one panel per schedule).", ""]
    h.write_results(out_dir, "soak", "\n".join(lines), {"machine": info, "command": command, "total_s": total_s,
                                                        "warmup_step": warmup_step, "args": vars(args), "runs": runs})
    plot(runs, out_dir / "soak.png", warmup_step)
    LOG.info("done in %.0f s: %s", total_s, "FAILED" if failed else "all schedules passed")
    return 1 if failed else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, SCHEDULES)
    p.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=20000, help="pipe.step calls per schedule")
    p.add_argument("--sample-every", type=int, default=0,
                   help="steps between samples (default steps/100; a sample walks the GC's objects, some ms)")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="share of the steps treated as warm-up")
    p.add_argument("--rss-threshold-mib", type=float, default=5.0)
    p.add_argument("--max-drop", type=float, default=0.30, help="largest allowed throughput drop (fraction)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pipe-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per torchrun launch")
    p.add_argument("--from-json", help="re-assess and re-report a previous soak.json (no runs)")
    p.add_argument("--progress", action="store_true", help="workers: tqdm bar on rank 0 (stderr)")
    args = p.parse_args(argv)
    for s in args.schedules:
        if s not in SCHEDULES:
            p.error(f"unknown schedule {s!r}; choose from {', '.join(SCHEDULES)}")
    if args.batch % args.microbatches:
        p.error("--batch must be divisible by --microbatches")
    if args.steps < 8:
        p.error("--steps must be at least 8 (quarters after warm-up)")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
