"""The point-to-point engine against the last one and torch.distributed.pipelining.

    python3 benchmarks/p2p_engine.py            # about 10 minutes on 2 cores
    python3 benchmarks/p2p_engine.py --smoke    # a few launches, tiny sizes

2 ranks on the CPU (Gloo), one thread each, the same MLP cut in 2 stages for every
runtime: 8 x [Linear(w, w), ReLU] + Linear(w, 10), batch 64 in M = 8 microbatches,
cross-entropy, SGD. Three sizes: tiny (w = 32: almost no arithmetic, so a step is
the runtime's own cost), medium (w = 512) and large (w = 2048). Two schedules:
1f1b (torch: Schedule1F1B) and zb-h1 (torch: ScheduleInterleavedZeroBubble with one
stage per rank, its ZB-H1). Runtimes:

* ``torch``: torch.distributed.pipelining, stages built by hand at the same cut;
* ``last``: pipedream_ext's engine before the transfer-order rewrite (commit
  ``LAST_ENGINE``: tagged messages, a header then the data per transfer, every
  receive's header posted at the start of the step), built once into
  build/p2p_last (a git worktree; ``--last-tree`` uses another checkout);
* ``ours``: this tree (the fused protocol Gloo uses: one message per transfer);
* ``sequential``: one process running the same microbatches one after another,
  the baseline of the pipeline's efficiency.

Each launch is one runtime at one size and schedule: 3 warm-up steps (the first
checks the loss against the unsplit model), then 6 rounds of 4 steps between
barriers; a round's time is the slower rank's, its CPU time that of both ranks'
processes (all threads). Launches are interleaved by pair (torch, last, ours,
sequential, then the next pair), so a burst of other work on the machine moves all
of one pair. Reported per size and schedule: samples/s (median over pairs of each
launch's median round), the ratios per pair, the efficiency against the ideal
2M/(M+1) (samples/s over the sequential process's, divided by 2M/(M+1) = 1.78), and
the runtime's fixed cost per compute action: (CPU time of a step on both ranks -
the sequential process's CPU time for the same work) / (F and B actions of the
step, 4M), in microseconds, at every size (at the tiny size it is nearly all of a
step). Ours also reports messages per transfer.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h

LOG = logging.getLogger("p2p_engine")
TAG = "P2P_RESULT "
LAST_ENGINE = "375d556"  # the tagged engine, with the header fix the GPU build needed
SIZES = {"tiny": 32, "medium": 512, "large": 2048}
SCHEDULES = ("1f1b", "zb-h1")
TORCH_CLASSES = {"1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble"}
RUNTIMES = ("torch", "last", "ours")
LAYERS, BATCH, MICROBATCHES = 8, 64, 8


# ----------------------------------------------------------------------------- worker
def _model(width: int) -> Any:
    return h.mlp([width] * (LAYERS + 1) + [10], seed=0)


def _batch(width: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _cut(model: Any) -> List[Any]:
    import torch

    mods = list(model.children())
    half = len(mods) // 2
    return [torch.nn.Sequential(*mods[:half]), torch.nn.Sequential(*mods[half:])]


def _reference_loss(width: int) -> float:
    import torch.nn.functional as F

    x, y = _batch(width)
    return float(F.cross_entropy(_model(width)(x), y))


def _ours_step(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F

    import pipedream_ext as pd

    model = _model(args.width)
    half = len(list(model.children())) // 2
    pipe = pd.PipeDream(model, F.cross_entropy, schedule=args.schedule, microbatches=MICROBATCHES,
                        balance=[half, len(list(model.children())) - half], timeout=120)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    x, y = _batch(args.width)

    def step() -> float:
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss  # read only where used: reading waits for its all-reduce

    step.pipe = pipe
    return step


def _torch_step(args: argparse.Namespace) -> Any:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    rank = dist.get_rank()
    part = _cut(_model(args.width))[rank]
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = getattr(pipelining, TORCH_CLASSES[args.schedule])
    sched = cls([stage] if args.schedule == "zb-h1" else stage, MICROBATCHES, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)
    x, y = _batch(args.width)

    def step() -> float:
        losses: List[Any] = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0], dtype=torch.float64)
        dist.all_reduce(value)  # as ours returns the batch loss on every rank
        return float(value)

    return step


def _sequential_step(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F

    model = _model(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = _batch(args.width)
    parts = list(zip(torch.tensor_split(x, MICROBATCHES), torch.tensor_split(y, MICROBATCHES)))

    def step() -> float:
        total = 0.0
        for xi, yi in parts:  # the pipeline's work, one microbatch after another
            loss = F.cross_entropy(model(xi), yi) * (len(yi) / BATCH)
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def run_worker(args: argparse.Namespace) -> int:
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        make = {"torch": _torch_step, "sequential": _sequential_step}.get(args.runtime, _ours_step)
        step = make(args)
        first = step()
        result["first_loss"] = float(first)
        result["reference_loss"] = _reference_loss(args.width)
        for _ in range(args.warmup - 1):
            step()
        pipe = getattr(step, "pipe", None)
        if pipe is not None:
            pipe.reset_stats()
        walls, cpus = [], []
        for _ in range(args.rounds):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            both = torch.tensor([wall, cpu], dtype=torch.float64)
            dist.all_reduce(both[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(both[1:], op=dist.ReduceOp.SUM)
            walls.append(float(both[0]) / args.steps)
            cpus.append(float(both[1]) / args.steps)
        result.update(step_s=walls, cpu_s=cpus)
        if pipe is not None:
            stats = pipe.stats()
            counts = torch.tensor([stats["sends"], stats.get("messages_sent", 2 * stats["sends"])],
                                  dtype=torch.float64)
            dist.all_reduce(counts)
            result["messages_per_transfer"] = float(counts[1] / counts[0]) if counts[0] else None

    return h.worker(TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def last_engine_tree(args: argparse.Namespace) -> Optional[Path]:
    """A checkout of LAST_ENGINE with its extension built (made once, then reused)."""
    if args.last_tree:
        return Path(args.last_tree)
    tree = h.ROOT / "build" / "p2p_last"
    if not (tree / ".git").exists():
        h.run_command(["git", "-C", str(h.ROOT), "worktree", "add", "--detach", "--force", str(tree),
                       LAST_ENGINE], timeout=300)
    if not list((tree / "pipedream_ext").glob("_C*.so")):
        LOG.info("building the last engine (commit %s) in %s: a few minutes", LAST_ENGINE, tree)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                       env=dict(os.environ, MAX_JOBS="2"), check=True, capture_output=True, timeout=3600)
    return tree


def launch(args: argparse.Namespace, runtime: str, size: str, schedule: str,
           last: Optional[Path]) -> Dict[str, Any]:
    world = 1 if runtime == "sequential" else 2
    extra = {}
    if runtime == "last":
        extra["PYTHONPATH"] = str(last) + os.pathsep + os.environ.get("PYTHONPATH", "")
    worker_args = ["--worker", "--runtime", runtime, "--schedule", schedule, "--width", SIZES[size],
                   "--warmup", args.warmup, "--rounds", args.rounds, "--steps", args.steps]
    # "last": this tree's worker file with the last engine's package first on the path
    out = h.launch_torchrun(Path(__file__).resolve(), world, worker_args, TAG,
                            timeout=args.launch_timeout, env_extra=extra)
    out.update(runtime=runtime, size=size, schedule=schedule)
    if "step_s" in out:
        LOG.info("%-10s %-6s %-5s %.2f ms/step, %.0f us CPU/step", runtime, size, schedule,
                 1e3 * statistics.median(out["step_s"]), 1e6 * statistics.median(out["cpu_s"]))
    return out


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(LOG)
    t0 = time.time()
    last = None if args.no_last else last_engine_tree(args)
    sizes = ["tiny"] if args.smoke else list(SIZES)
    runs: List[Dict[str, Any]] = []
    for pair in range(args.pairs):
        for size in sizes:
            for schedule in SCHEDULES:
                for runtime in RUNTIMES:
                    if runtime == "last" and last is None:
                        continue
                    runs.append(dict(launch(args, runtime, size, schedule, last), pair=pair))
            runs.append(dict(launch(args, "sequential", size, "1f1b", last), pair=pair))
    data = {"machine": info, "command": command, "total_s": time.time() - t0, "runs": runs,
            "options": h.run_options(args)}
    h.write_results(Path(args.out_dir), "p2p_engine", report(data, sizes), data)
    return 0 if not any("error" in r for r in runs) else 1


# ----------------------------------------------------------------------------- report
def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(runs: Sequence[Dict[str, Any]], size: str, schedule: str) -> Dict[str, Any]:
    """Per runtime: medians over pairs of each launch's median round, the ratios per
    pair, efficiency and fixed cost per action."""
    def per_pair(runtime: str, key: str) -> Dict[int, float]:
        sched = "1f1b" if runtime == "sequential" else schedule
        return {r["pair"]: statistics.median(r[key]) for r in runs
                if r["runtime"] == runtime and r["size"] == size and r["schedule"] == sched and key in r}

    seq_step, seq_cpu = per_pair("sequential", "step_s"), per_pair("sequential", "cpu_s")
    actions = 2 * 2 * MICROBATCHES  # F and B of each microbatch on each of 2 stages
    ideal = 2 * MICROBATCHES / (MICROBATCHES + 1)
    out: Dict[str, Any] = {}
    for runtime in RUNTIMES:
        step, cpu = per_pair(runtime, "step_s"), per_pair(runtime, "cpu_s")
        if not step:
            continue
        pairs = sorted(step)
        eff = [seq_step[p] / step[p] / ideal for p in pairs if p in seq_step]
        fixed = [(cpu[p] - seq_cpu[p]) / actions * 1e6 for p in pairs if p in seq_cpu]
        messages = [r["messages_per_transfer"] for r in runs if r["runtime"] == runtime and
                    r["size"] == size and r["schedule"] == schedule and r.get("messages_per_transfer")]
        out[runtime] = {"samples_s": _median([BATCH / step[p] for p in pairs]),
                        "step_s": step, "efficiency": _median(eff), "fixed_us": _median(fixed),
                        "messages_per_transfer": _median(messages)}
    for base in ("torch", "last"):
        if "ours" in out and base in out:
            ours, other = out["ours"]["step_s"], out[base]["step_s"]
            ratios = [other[p] / ours[p] for p in ours if p in other]
            out[f"ours_over_{base}"] = {"median": _median(ratios), "min": min(ratios), "max": max(ratios),
                                        "ahead": sum(r > 1 for r in ratios), "pairs": len(ratios)}
    return out


def report(data: Dict[str, Any], sizes: Sequence[str]) -> str:
    runs = data["runs"]
    lines = [h.command_sentence(data["command"], data["total_s"], {}), "",
             h.machine_line(data["machine"]) + " One thread per rank, Gloo, 2 ranks.", "",
             f"Model: {LAYERS} x [Linear(w, w), ReLU] + Linear(w, 10), batch {BATCH} in M = {MICROBATCHES} "
             f"microbatches, cut in 2 stages; sizes {', '.join(f'{s} w={SIZES[s]}' for s in sizes)}. "
             f"Pairs: {max((r['pair'] for r in runs), default=-1) + 1}. Ideal speed-up 2M/(M+1) = "
             f"{2 * MICROBATCHES / (MICROBATCHES + 1):.2f}.", ""]
    rows = []
    for size in sizes:
        for schedule in SCHEDULES:
            s = summarize(runs, size, schedule)
            for runtime in RUNTIMES:
                if runtime not in s:
                    continue
                r = s[runtime]
                ratio = s.get(f"ours_over_{runtime}") if runtime != "ours" else None
                rows.append([size, schedule, runtime, h.fmt(r["samples_s"], 0), h.fmt(r["efficiency"]),
                             h.fmt(r["fixed_us"], 0), h.fmt(r["messages_per_transfer"], 2),
                             "" if ratio is None else
                             f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}], "
                             f"{ratio['ahead']}/{ratio['pairs']} ahead"])
    lines += ["### Samples/s, efficiency, fixed cost per action", "",
              "efficiency = (samples/s / sequential samples/s) / (2M/(M+1)); fixed cost = (CPU of a "
              "step, both ranks - sequential CPU of the same work) / 4M actions, us; ours / runtime "
              "= that runtime's step time over ours, per pair (above 1: ours faster).", ""]
    lines += h.table(["size", "schedule", "runtime", "samples/s", "efficiency", "fixed us/action",
                      "messages/transfer", "ours / runtime, per pair"], rows)
    checks = [f"{r['runtime']} {r['size']} {r['schedule']}: first loss {r['first_loss']:.6f} vs "
              f"{r['reference_loss']:.6f}" for r in runs if r.get("pair") == 0 and "first_loss" in r
              and abs(r["first_loss"] - r["reference_loss"]) > 1e-5]
    errors = [f"{r['runtime']} {r['size']} {r['schedule']} pair {r['pair']}: {r['error']}"
              for r in runs if "error" in r]
    lines += ["", "Same work: every launch's first loss equals the unsplit model's "
              f"({'all within 1e-5' if not checks else '; '.join(checks)})."]
    if errors:
        lines += ["", "Errors:", *[f"- {e}" for e in errors]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--runtime", choices=RUNTIMES + ("sequential",), default="ours", help=argparse.SUPPRESS)
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="steps per round")
    p.add_argument("--launch-timeout", type=float, default=600)
    p.add_argument("--last-tree", default=None, help="a checkout of the last engine, built")
    p.add_argument("--no-last", action="store_true", help="skip the last engine")
    p.add_argument("--smoke", action="store_true", help="tiny size only, 1 pair, short rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.pairs, args.rounds, args.steps, args.warmup = 1, 2, 2, 2
    return args


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
