"""Training throughput on this machine (CPU, Gloo, 2 ranks): pipedream_ext against its peers.

One model (an ``nn.Sequential`` MLP: ``--layers`` x [Linear(H, H), ReLU] then
Linear(H, 10), H = ``--hidden``), one global batch B per step, one thread per rank
(``torch.set_num_threads(1)``, OMP_NUM_THREADS=1), SGD. Configurations:

* ``single``: one process, the whole batch per step (the baseline, ratio 1.0);
* ``ddp``: DistributedDataParallel over 2 ranks (gloo), B/2 samples per rank;
* ``torch-gpipe``, ``torch-1f1b``: ``torch.distributed.pipelining`` ScheduleGPipe /
  Schedule1F1B, 2 stages (manual split), M microbatches of B/M;
* ``pd-gpipe``, ``pd-1f1b``, ``pd-zb-h1``: pipedream_ext flush schedules, same split
  and microbatches, one batch per step;
* ``pd-pipedream``: asynchronous PipeDream, one minibatch of B/M samples per step
  (M steps = the same samples as one batch of the others);
* ``pd-pipedream-2bw``: one batch of M microbatches per step.

The 2-stage split is the same everywhere: stage 0 holds the first ``layers/2``
Linear+ReLU pairs, stage 1 the rest and the classifier. Asynchronous schedules
include their final ``flush()`` in the timing. Each repetition runs ``--steps``
batches' worth of samples after ``--warmup`` steps; samples/s = samples / wall
time (the slowest rank's, between two barriers); we report the median over
``--reps`` repetitions with min and max. A sweep over M (``--sweep``) runs
pd-1f1b and torch-1f1b at the same global batch for the pipeline efficiency
= throughput / (2 x single-process throughput).

Driver mode (default) launches each configuration as its own
``python -m torch.distributed.run --standalone --nproc-per-node N`` subprocess of this
script in ``--worker CONFIG`` mode, collects the one JSON line each prints, writes
``<out-dir>/throughput.md``, ``<out-dir>/throughput.png`` and
``<out-dir>/pipeline_efficiency.png``, and prints the tables. With ``--profile``,
``--profile-configs`` (default pd-1f1b, torch-1f1b, pd-pipedream, pd-pipedream-2bw)
are re-run once more with a per-rank time breakdown (in-pipeline forward time
from module hooks, standalone forward+backward cost of the stage, cProfile of the
step loop), added to ``throughput.md``.

Command, from the repository root (about 6-8 minutes on 2 cores):

    python3 benchmarks/throughput.py [--global-batch 128] [--microbatches 8] [--reps 5] [--steps 20]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["ForwardTimer", "launch", "main", "main_table", "make_batch", "make_model", "parse_args", "plot_main",
           "plot_sweep", "profile_section", "profile_steps", "run_driver", "run_worker", "stage_bounds",
           "sweep_table", "time_fwd_bwd"]

LOG = logging.getLogger("throughput")
JSON_TAG = "THROUGHPUT_JSON "

MAIN_CONFIGS = ("single", "ddp", "torch-gpipe", "torch-1f1b", "pd-gpipe", "pd-1f1b",
                "pd-zb-h1", "pd-pipedream", "pd-pipedream-2bw")
SWEEP_CONFIGS = ("pd-1f1b", "torch-1f1b")
LABELS = {
    "single": "single process (baseline)",
    "ddp": "DDP, 2 ranks",
    "torch-gpipe": "torch.distributed.pipelining ScheduleGPipe",
    "torch-1f1b": "torch.distributed.pipelining Schedule1F1B",
    "pd-gpipe": "pipedream_ext gpipe",
    "pd-1f1b": "pipedream_ext 1f1b",
    "pd-zb-h1": "pipedream_ext zb-h1",
    "pd-pipedream": "pipedream_ext pipedream (async)",
    "pd-pipedream-2bw": "pipedream_ext pipedream-2bw (async)",
}


# ----------------------------------------------------------------------------- worker
def make_model(hidden: int, layers: int, seed: int = 0):
    """``layers`` x [Linear(H, H), ReLU] + Linear(H, 10)."""
    return h.mlp([hidden] * (layers + 1) + [10], seed)


def stage_bounds(layers: int) -> List[int]:
    """Module counts of the 2 stages: layers/2 Linear+ReLU pairs, then the rest."""
    first = 2 * (layers // 2)
    return [first, 2 * layers + 1 - first]


def make_batch(batch: int, hidden: int, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, hidden, generator=g), torch.randint(0, 10, (batch,), generator=g)


def time_fwd_bwd(module, x, y=None, repeat: int = 20) -> Tuple[float, float]:
    """Median seconds of a forward (no grad) and of a forward+backward of ``module`` on ``x``.

    Without ``y`` the backward starts from a ones gradient on the output."""
    import torch
    import torch.nn.functional as F

    def fb() -> None:
        out = module(x)
        if y is not None:
            F.cross_entropy(out, y).backward()
        else:
            out.backward(torch.ones_like(out))

    for _ in range(3):
        fb()
    fwd, both = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        with torch.no_grad():
            module(x)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        fb()
        both.append(time.perf_counter() - t)
    module.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(both)


class ForwardTimer:
    """Sums wall time spent inside a module's forward (pre/post hooks)."""

    def __init__(self, module) -> None:
        self.total = 0.0
        self.calls = 0
        self._t0 = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._t0
        self.calls += 1

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    logging.getLogger("pipedream_ext").setLevel(logging.WARNING)
    cfg = args.worker
    B, M, H = args.global_batch, args.microbatches, args.hidden
    distributed = cfg != "single"
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    model = make_model(H, args.layers)
    x, y = make_batch(B, H)
    bounds = stage_bounds(args.layers)
    result: Dict[str, Any] = {"config": cfg, "microbatches": M, "global_batch": B, "world": world}

    def barrier() -> None:
        if distributed:
            dist.barrier()

    stage_module = None  # this rank's pipeline stage, for --profile
    samples_per_step = B
    steps = args.steps
    warmup = args.warmup
    finish = None  # called at the end of a timed repetition (async flush)
    try:
        if cfg == "single":
            opt = torch.optim.SGD(model.parameters(), lr=args.lr)
            mb = B // M
            f_mb, fb_mb = time_fwd_bwd(model, x[:mb], y[:mb])
            f_b, fb_b = time_fwd_bwd(model, x, y)
            s0 = torch.nn.Sequential(*list(model.children())[:bounds[0]])
            s1 = torch.nn.Sequential(*list(model.children())[bounds[0]:])
            h = s0(x[:mb]).detach()
            f0, fb0 = time_fwd_bwd(s0, x[:mb])
            f1, fb1 = time_fwd_bwd(s1, h.requires_grad_(), y[:mb])
            result["timings_ms"] = {
                "fwd_microbatch": f_mb * 1e3, "fwd_bwd_microbatch": fb_mb * 1e3,
                "fwd_batch": f_b * 1e3, "fwd_bwd_batch": fb_b * 1e3,
                "stage0_fwd_microbatch": f0 * 1e3, "stage0_fwd_bwd_microbatch": fb0 * 1e3,
                "stage1_fwd_microbatch": f1 * 1e3, "stage1_fwd_bwd_microbatch": fb1 * 1e3,
            }

            def step_fn() -> None:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif cfg == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
            half = B // world
            xs, ys = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]

            def step_fn() -> None:
                F.cross_entropy(ddp(xs), ys).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif cfg.startswith("torch-"):
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleGPipe,
            )

            if world != 2:
                raise ValueError("torch pipelining configs use exactly 2 ranks")
            children = list(model.children())
            stage_module = torch.nn.Sequential(*(children[:bounds[0]] if rank == 0 else children[bounds[0]:]))
            opt = torch.optim.SGD(stage_module.parameters(), lr=args.lr)
            stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
            cls = Schedule1F1B if cfg == "torch-1f1b" else ScheduleGPipe
            sched = cls(stage, M, loss_fn=F.cross_entropy)

            def step_fn() -> None:
                if rank == 0:
                    sched.step(x)
                else:
                    losses: List[Any] = []
                    sched.step(target=y, losses=losses, return_outputs=False)
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif cfg.startswith("pd-"):
            import pipedream_ext as pd

            schedule = cfg[3:]
            pipe = pd.PipeDream(model, loss_fn=F.cross_entropy, schedule=schedule,
                                microbatches=M, balance=bounds)
            stage_module = pipe.module
            opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
            if schedule == "pipedream":
                mbs = B // M
                samples_per_step = mbs
                steps, warmup = args.steps * M, args.warmup * M
                chunks = [(x[i * mbs:(i + 1) * mbs], y[i * mbs:(i + 1) * mbs]) for i in range(M)]
                counter = [0]

                def step_fn() -> None:
                    cx, cy = chunks[counter[0] % M]
                    counter[0] += 1
                    pipe.step(cx, cy, optimizer=opt)

                finish = pipe.flush
            elif schedule == "pipedream-2bw":
                def step_fn() -> None:
                    pipe.step(x, y, optimizer=opt)

                finish = pipe.flush
            else:
                def step_fn() -> None:
                    pipe.step(x, y)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        else:
            raise ValueError(f"unknown config {cfg!r}")

        # warm-up
        for _ in range(warmup):
            step_fn()
        if finish is not None:
            finish()
        reps: List[float] = []
        cpu_per_sample: List[float] = []
        for _ in range(args.reps):
            barrier()
            t0 = time.perf_counter()
            c0 = time.process_time()  # this process, all threads (Gloo's included)
            for _ in range(steps):
                step_fn()
            if finish is not None:
                finish()
            cpu = time.process_time() - c0
            barrier()
            elapsed = time.perf_counter() - t0
            if distributed:
                t = torch.tensor([elapsed, cpu], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                elapsed = float(t[0].item())
                c = torch.tensor([cpu], dtype=torch.float64)
                dist.all_reduce(c)  # CPU seconds of all ranks together
                cpu = float(c.item())
            reps.append(steps * samples_per_step / elapsed)
            cpu_per_sample.append(cpu / (steps * samples_per_step))
        if cpu_per_sample:
            result["cpu_us_per_sample"] = statistics.median(cpu_per_sample) * 1e6
        if reps:
            result.update(samples_per_s=reps, median=statistics.median(reps), min=min(reps),
                          max=max(reps), samples_per_rep=steps * samples_per_step)

        if args.profile and stage_module is not None:
            result["profile"] = profile_steps(args, rank, world, stage_module, step_fn, finish, x, y,
                                              bounds, steps_per_batch=steps // args.steps)
    except Exception as exc:  # noqa: BLE001 - reported to the driver as data
        LOG.error("rank %d: %s: %s", rank, type(exc).__name__, exc)
        result["error"] = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            print(JSON_TAG + json.dumps(result), flush=True)
        return 0  # torchrun would tear the other rank down; the driver reads the error
    if rank == 0:
        print(JSON_TAG + json.dumps(result), flush=True)
    if distributed:
        dist.barrier()
        # What holds the process group (DDP's reducer, the pipelines) goes first:
        # torn down after the group, a rank of the ddp configuration sometimes
        # aborted at exit ("terminate called without an active exception").
        del step_fn, stage_module, model, finish
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


def profile_steps(args, rank, world, stage_module, step_fn, finish, x, y, bounds,
                  steps_per_batch: int) -> Dict[str, Any]:
    """Per-rank breakdown of ``--profile-steps`` batches: wall time, forward time inside
    the pipeline, standalone forward+backward cost of this stage, cProfile top entries."""
    import torch
    import torch.distributed as dist

    M, B = args.microbatches, args.global_batch
    mb = B // M
    # Standalone cost of this stage on one microbatch (no communication).
    children = list(stage_module.children())
    probe = torch.nn.Sequential(*children)
    if rank == 0:
        f, fb = time_fwd_bwd(probe, x[:mb])
    else:
        h = torch.randn(mb, args.hidden, requires_grad=True)
        f, fb = time_fwd_bwd(probe, h, y[:mb])
    timer = ForwardTimer(stage_module)
    n = args.profile_steps
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n * steps_per_batch):
        step_fn()
    if finish is not None:
        finish()
    prof.disable()
    wall = time.perf_counter() - t0
    dist.barrier()
    # Operator-level view (also sees the aten ops the C++ executor runs on this thread).
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(n * steps_per_batch):
            step_fn()
        if finish is not None:
            finish()
    dist.barrier()
    ops = []
    for ev in sorted(tprof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]:
        ops.append(f"{ev.key[:60]:<60} calls {ev.count:>6}  self {ev.self_cpu_time_total / 1e3 / n:8.2f} ms/batch"
                   f"  total {ev.cpu_time_total / 1e3 / n:8.2f} ms/batch")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
    top = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(top) if ln.strip().startswith("ncalls")), 0)
    mine = {
        "rank": rank, "wall_ms_per_batch": wall / n * 1e3,
        "fwd_in_pipeline_ms_per_batch": timer.total / n * 1e3, "fwd_calls": timer.calls,
        "standalone_fwd_ms_per_batch": f * M * 1e3, "standalone_fwd_bwd_ms_per_batch": fb * M * 1e3,
        "cprofile_top": top[start:start + 13], "torch_profiler_top": ops,
    }
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {"steps": n, "ranks": gathered}


# ----------------------------------------------------------------------------- driver
def launch(args: argparse.Namespace, cfg: str, microbatches: int, profile: bool = False) -> Dict[str, Any]:
    """Runs configuration ``cfg`` under torchrun (1 rank for ``single``, else 2)."""
    worker_args = ["--worker", cfg, "--microbatches", str(microbatches), "--reps", str(0 if profile else args.reps)]
    worker_args += h.forward(args, "global_batch", "hidden", "layers", "lr", "steps", "warmup")
    if profile:
        worker_args += ["--profile"] + h.forward(args, "profile_steps")
    out = h.launch_torchrun(Path(__file__).resolve(), 1 if cfg == "single" else 2, worker_args, JSON_TAG,
                            args.timeout)
    out.setdefault("config", cfg)
    out.setdefault("microbatches", microbatches)
    if "error" in out:
        LOG.warning("%s M=%d: %s", cfg, microbatches, out["error"])
    return out


def main_table(results: Dict[str, Dict[str, Any]], base: float, M: int) -> List[str]:
    """The main table: every configuration's samples/s against the single process."""
    rows = h.table(["configuration", "samples/s (median)", "min", "max", "ratio to single process",
                    "CPU us/sample (all ranks)"])
    for cfg in MAIN_CONFIGS:
        r = results[cfg]
        if "error" in r:
            rows.append(h.table_row([LABELS[cfg], f"n/a ({r['error'][:80]})", "", "", "", ""]))
            continue
        rows.append(h.table_row([LABELS[cfg], f"{r['median']:.0f}", f"{r['min']:.0f}", f"{r['max']:.0f}",
                                 f"{r['median'] / base:.2f}", f"{r.get('cpu_us_per_sample', float('nan')):.0f}"]))
    return rows


def sweep_table(sweep: Dict[Tuple[str, int], Dict[str, Any]], base: float, ms: List[int]) -> List[str]:
    """Samples/s and efficiency per M of the sweep (the header's ``{}``: microbatch sizes)."""
    rows = h.table(["runtime"] + [f"M={m} (mb {{}})" for m in ms])
    for cfg in SWEEP_CONFIGS:
        sps, eff = [], []
        for m in ms:
            r = sweep.get((cfg, m), {})
            if "median" in r:
                sps.append(f"{r['median']:.0f} [{r['min']:.0f}-{r['max']:.0f}]")
                eff.append(f"{r['median'] / (2 * base):.2f}")
            else:
                sps.append("n/a")
                eff.append("n/a")
        rows.append(h.table_row([f"{LABELS[cfg]}: samples/s [min-max]"] + sps))
        rows.append(h.table_row([f"{LABELS[cfg]}: efficiency"] + eff))
    ratio = []
    for m in ms:
        a, b = sweep.get(("pd-1f1b", m), {}), sweep.get(("torch-1f1b", m), {})
        ratio.append(f"{a['median'] / b['median']:.2f}" if "median" in a and "median" in b else "n/a")
    rows.append(h.table_row(["ratio pipedream_ext / torch"] + ratio))
    return rows


def plot_main(results, base, path: Path, M: int, B: int) -> None:
    plt = h.pyplot()

    cfgs = [c for c in MAIN_CONFIGS if "median" in results[c]]
    med = [results[c]["median"] for c in cfgs]
    lo = [results[c]["median"] - results[c]["min"] for c in cfgs]
    hi = [results[c]["max"] - results[c]["median"] for c in cfgs]
    colors = ["#777777" if c == "single" else "#4c72b0" if c == "ddp" else
              "#dd8452" if c.startswith("torch") else "#55a868" for c in cfgs]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.bar(range(len(cfgs)), med, yerr=[lo, hi], capsize=4, color=colors)
    ax.axhline(base, color="black", lw=0.8, ls="--", label="single process")
    ax.axhline(2 * base, color="black", lw=0.8, ls=":", label="2 x single process")
    ax.set_xticks(range(len(cfgs)))
    ax.set_xticklabels([c.replace("pd-", "ours ") for c in cfgs], rotation=30, ha="right")
    ax.set_ylabel("samples/s (median, min-max bars)")
    ax.set_title(f"Training throughput, CPU, 2 ranks x 1 thread, global batch {B}, M={M}")
    ax.legend(loc="upper left", fontsize=8)
    h.save_figure(fig, path, dpi=120)


def plot_sweep(sweep, base, ms: List[int], path: Path, B: int) -> None:
    plt = h.pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for cfg, color in (("pd-1f1b", "#55a868"), ("torch-1f1b", "#dd8452")):
        pts = [(m, sweep[(cfg, m)]) for m in ms if "median" in sweep.get((cfg, m), {})]
        if not pts:
            continue
        xs = [m for m, _ in pts]
        eff = [r["median"] / (2 * base) for _, r in pts]
        lo = [(r["median"] - r["min"]) / (2 * base) for _, r in pts]
        hi = [(r["max"] - r["median"]) / (2 * base) for _, r in pts]
        ax.errorbar(xs, eff, yerr=[lo, hi], marker="o", capsize=3, color=color, label=LABELS[cfg])
    ax.plot(ms, [m / (m + 1) for m in ms], color="gray", ls=":", label="bubble bound M/(M+1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels([str(m) for m in ms])
    ax.set_xlabel(f"microbatches M (global batch {B})")
    ax.set_ylabel("throughput / (2 x single process)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Pipeline efficiency, 1F1B, 2 stages (CPU)")
    ax.legend(fontsize=8)
    h.save_figure(fig, path, dpi=120)


def profile_section(profiles: Dict[str, Dict[str, Any]], M: int) -> List[str]:
    lines = [f"Per rank, {M} microbatches, ms per batch (step loop under cProfile, so wall times are "
             "somewhat inflated). 'forward in pipeline' sums the stage module's forward calls "
             "(module hooks); 'standalone' is the same stage's forward / forward+backward on one "
             "microbatch, times M, with no communication.", "",
             *h.table(["runtime", "rank", "wall", "forward in pipeline", "standalone forward",
                       "standalone fwd+bwd", "wall - standalone fwd+bwd"])]
    for cfg, prof in profiles.items():
        if "profile" not in prof:
            lines.append(h.table_row([LABELS[cfg], f"n/a ({prof.get('error', 'no profile')})"] + [""] * 5))
            continue
        for r in prof["profile"]["ranks"]:
            lines.append(h.table_row([LABELS[cfg], r["rank"], f"{r['wall_ms_per_batch']:.1f}",
                                      f"{r['fwd_in_pipeline_ms_per_batch']:.1f}",
                                      f"{r['standalone_fwd_ms_per_batch']:.1f}",
                                      f"{r['standalone_fwd_bwd_ms_per_batch']:.1f}",
                                      f"{r['wall_ms_per_batch'] - r['standalone_fwd_bwd_ms_per_batch']:.1f}"]))
    for cfg, prof in profiles.items():
        for r in prof.get("profile", {}).get("ranks", []):
            lines += ["", f"cProfile, {LABELS[cfg]}, rank {r['rank']} (top by tottime, "
                      f"{prof['profile']['steps']} batches):", "", "```"] + r["cprofile_top"] + ["```"]
            lines += ["", f"torch.profiler, {LABELS[cfg]}, rank {r['rank']} (top operators by self CPU "
                      "time, per batch):", "", "```"] + r.get("torch_profiler_top", []) + ["```"]
    return lines


def run_driver(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    out_dir = Path(args.out_dir)
    M, B = args.microbatches, args.global_batch
    ms = sorted(set(args.sweep))
    info, command = h.start_report(LOG)
    jobs: List[Tuple[str, int, bool]] = [(c, M, False) for c in MAIN_CONFIGS]
    jobs += [(c, m, False) for m in ms if m != M for c in SWEEP_CONFIGS]
    # Interleaved A/B pairs, torch's Schedule1F1B then ours, on the same work: the
    # ratio per pair cancels slow drifts of a shared machine.
    jobs += [(c, M, False) for _ in range(args.ab_pairs) for c in ("torch-1f1b", "pd-1f1b")]
    if args.profile:
        jobs += [(c, M, True) for c in args.profile_configs]
    t_start = time.perf_counter()
    main: Dict[str, Dict[str, Any]] = {}
    sweep: Dict[Tuple[str, int], Dict[str, Any]] = {}
    profiles: Dict[str, Dict[str, Any]] = {}
    pairs: List[Dict[str, Any]] = []
    for cfg, m, prof in tqdm(jobs, desc="configurations", unit="cfg"):
        r = launch(args, cfg, m, profile=prof)
        if prof:
            profiles[cfg] = r
        elif m == M and cfg in MAIN_CONFIGS and cfg not in main:
            main[cfg] = r
        elif m == M and cfg in ("torch-1f1b", "pd-1f1b"):
            if cfg == "torch-1f1b":
                pairs.append({"torch": r})
            else:
                pairs[-1]["ours"] = r
        if not prof and cfg in SWEEP_CONFIGS:
            sweep[(cfg, m)] = r
        if "median" in r:
            LOG.info("%s M=%d: %.0f samples/s [%.0f-%.0f] (launch %.1f s)", cfg, m, r["median"], r["min"],
                     r["max"], r["launch_s"])
    total_s = time.perf_counter() - t_start
    if "median" not in main["single"]:
        LOG.error("the baseline failed: %s", main["single"].get("error"))
        return 1
    base = main["single"]["median"]
    tm = main["single"]["timings_ms"]
    mb = B // M
    lines = ["# Throughput (CPU, 2 ranks)", "",
             f"Command: `{command}`", "",
             h.machine_line(info) + " Other work on the machine slows every configuration alike; compare "
             "within a run. One thread per rank (torch.set_num_threads(1), OMP_NUM_THREADS=1), Gloo.", "",
             f"Model: {args.layers} x [Linear({args.hidden}, {args.hidden}), ReLU] + "
             f"Linear({args.hidden}, 10), SGD lr={args.lr}. Global batch {B}, M={M} microbatches of {mb}; "
             f"2 stages of {stage_bounds(args.layers)} modules (stage 0: {args.layers // 2} Linear+ReLU pairs). "
             f"Per repetition {args.steps} batches of {B} samples (pipedream: {args.steps * M} minibatches of "
             f"{mb}) after {args.warmup} warm-up batches; {args.reps} repetitions; samples/s = samples / "
             "slowest rank's wall time, final flush included for async schedules. Total run time "
             f"{total_s:.0f} s.", "",
             "Single-process timings (median of 20, one thread): "
             f"forward of one microbatch ({mb} samples) {tm['fwd_microbatch']:.2f} ms, forward+backward "
             f"{tm['fwd_bwd_microbatch']:.2f} ms; whole batch ({B}) forward {tm['fwd_batch']:.2f} ms, "
             f"forward+backward {tm['fwd_bwd_batch']:.2f} ms; per stage on one microbatch, forward / "
             f"forward+backward: stage 0 {tm['stage0_fwd_microbatch']:.2f} / {tm['stage0_fwd_bwd_microbatch']:.2f} ms, "
             f"stage 1 {tm['stage1_fwd_microbatch']:.2f} / {tm['stage1_fwd_bwd_microbatch']:.2f} ms.", "",
             f"## Throughput, global batch {B}, M={M}", ""]
    lines += main_table(main, base, M)
    r1, t1 = main["pd-1f1b"], main["torch-1f1b"]
    if "median" in r1 and "median" in t1:
        lines += ["", f"pipedream_ext 1f1b / torch Schedule1F1B: {r1['median'] / t1['median']:.2f}"]
    if pairs:
        lines += ["", f"## pipedream_ext 1f1b against torch Schedule1F1B: {len(pairs)} interleaved pairs, M={M}",
                  "", "Each pair runs torch's Schedule1F1B, then ours, on the same model, batch and "
                  "microbatches (median samples/s of each run's repetitions). CPU time is all "
                  "threads of both ranks per sample.", "",
                  *h.table(["pair", "torch Schedule1F1B (samples/s)", "pipedream_ext 1f1b (samples/s)", "ratio",
                            "CPU us/sample torch", "CPU us/sample ours"])]
        ratios = []
        for k, pair in enumerate(pairs, 1):
            t, o = pair.get("torch", {}), pair.get("ours", {})
            if "median" in t and "median" in o:
                ratios.append(o["median"] / t["median"])
                lines.append(h.table_row([k, f"{t['median']:.0f}", f"{o['median']:.0f}", f"{ratios[-1]:.2f}",
                                          f"{t.get('cpu_us_per_sample', float('nan')):.0f}",
                                          f"{o.get('cpu_us_per_sample', float('nan')):.0f}"]))
            else:
                lines.append(h.table_row([k, t.get("error", "n/a"), o.get("error", "n/a"), "n/a", "", ""]))
        if ratios:
            lines += ["", f"Median ratio {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
                      f"max {max(ratios):.2f}); {sum(r >= 1 for r in ratios)} of {len(ratios)} pairs >= 1."]
    lines += ["", f"## Pipeline efficiency against M (global batch {B})", "",
              "Efficiency = samples/s / (2 x single-process samples/s). Microbatch size = "
              f"{B}/M.", ""]
    st = sweep_table(sweep, base, ms)
    st[0] = st[0].format(*[B // m for m in ms])
    lines += st
    errors = [f"- {c} M={m}: {r['error']}" for (c, m), r in sorted(sweep.items()) if "error" in r]
    if errors:
        lines += ["", "Failed or rejected:"] + errors
    if profiles:
        lines += ["", f"## Time breakdown, M={M}", ""] + profile_section(profiles, M)
    lines += ["", "![throughput](throughput.png)", "", "![pipeline efficiency](pipeline_efficiency.png)", ""]
    h.write_results(out_dir, "throughput", "\n".join(lines),
                    {"machine": info, "command": command, "main": main, "ab_pairs": pairs,
                     "sweep": {f"{c}@{m}": r for (c, m), r in sweep.items()}, "profiles": profiles})
    plot_main(main, base, out_dir / "throughput.png", M, B)
    plot_sweep(sweep, base, ms, out_dir / "pipeline_efficiency.png", B)
    failed = [r for r in [*main.values(), *sweep.values(), *profiles.values()] if h.launch_failed(r)]
    failed += [r for pair in pairs for r in pair.values() if h.launch_failed(r)]
    if failed:
        LOG.error("%d launches failed; their output is in %s", len(failed), ", ".join(r["log"] for r in failed))
    return 1 if failed else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, MAIN_CONFIGS)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=8, help="M for the main table")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs before the classifier")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="batches per repetition")
    p.add_argument("--warmup", type=int, default=5, help="warm-up batches")
    p.add_argument("--sweep", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16],
                   help="microbatch counts for the 1f1b efficiency sweep (comma-separated)")
    p.add_argument("--ab-pairs", type=int, default=5,
                   help="interleaved torch-1f1b / pd-1f1b pairs for the A/B table")
    p.add_argument("--profile", action="store_true",
                   help="also re-run --profile-configs with a time breakdown (driver) / this worker")
    p.add_argument("--profile-steps", type=int, default=10, help="batches under the profiler")
    p.add_argument("--profile-configs", type=lambda s: s.split(","),
                   default=["pd-1f1b", "torch-1f1b", "pd-pipedream", "pd-pipedream-2bw"],
                   help="configurations to re-run with a time breakdown (comma-separated)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    args = p.parse_args(argv)
    if args.global_batch % args.microbatches or any(args.global_batch % m for m in args.sweep):
        p.error("--global-batch must be divisible by --microbatches and every --sweep value")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
