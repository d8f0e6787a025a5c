"""Peak memory per pipeline stage during training, with and without ``recompute=True``.

Model: an MLP whose activations dominate its weights: ``--blocks`` x [Linear(H, eH),
ReLU, Linear(eH, H), ReLU] + Linear(H, 10) (H = ``--hidden`` 64, e = ``--expand`` 4;
microbatches of 128 samples, so a block keeps 160 KiB of activations per
microbatch against 128 KiB of weights). Stages split the blocks evenly, the
classifier goes with the last stage. For each world
size in ``--ranks`` (one ``torch.distributed.run`` launch each, Gloo, one thread per
rank) and each schedule in ``--schedules`` (gpipe, 1f1b, pipedream) with
``recompute`` off and on, every rank measures:

* **peak**: the largest amount of memory allocated above the level at the start of
  the measured window, while the window runs. Window: flush schedules, one training
  step (``pipe.step`` + ``optimizer.step`` + ``zero_grad``) started with an empty
  pipeline and no gradients; pipedream, ``--async-steps`` minibatches plus the final
  ``flush()`` (it starts empty and reaches its steady state). Method on CPU:
  ``torch.profiler.profile(profile_memory=True)`` records every allocation and free of
  the CPU allocator on the profiled thread (the executor, autograd on CPU and the
  receive buffers all run on it) as ``[memory]`` events with nanosecond time stamps
  and signed byte counts; the peak is the maximum of their running sum in time order
  (:func:`cumulative_peak`). Checked at start-up on every rank against a known
  pattern (ten 1 MiB tensors alive at once, then 3 MiB: the peak must be 10 MiB).
  RSS is not used (the allocator keeps freed pages; too coarse). On CUDA the peak
  is ``torch.cuda.max_memory_allocated() - memory_allocated()`` at the window's start.
* ``stats()["peak_activations"]`` (most microbatches stashed at once) and
  ``peak_weight_versions``;
* **a**: the memory one microbatch's forward keeps alive on this stage (inputs it
  received, saved tensors, outputs; the loss graph on the last stage), measured the
  same way by running the stage once outside the pipeline.

Expected: stage j of p holds n_j microbatches' activations at once: gpipe n_j = M,
1f1b n_j = min(p - j, M), pipedream n_j = p - j (plus p - j weight versions). Without
recompute the peak is about n_j * a + gradients (+ the stashed weight copies);
with recompute a stage keeps only its inputs (plus one microbatch's activations while
recomputing), so it is about n_j * input + a + gradients.

On the smallest world, 1f1b also runs with ``--m-sweep`` microbatch counts at the same
microbatch size: if only p - j microbatches were alive, its peak would not grow with M
(the slope per extra microbatch is reported beside the stage's boundary bytes).

Writes ``<out-dir>/memory.md``, ``<out-dir>/memory.json`` and ``<out-dir>/memory.png``.
Command, from the repository root (about a minute on an idle 2-core machine):

    python3 benchmarks/memory.py [--ranks 2,4] [--schedules gpipe,1f1b,pipedream]
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["Window", "block_balance", "cumulative_peak", "expected_in_flight", "expected_peak", "main",
           "main_table", "make_model", "parse_args", "plot", "recompute_table", "rows_of", "run_config",
           "run_driver", "run_worker", "self_check", "slope", "stage_activation", "sweep_table", "worker_configs"]

LOG = logging.getLogger("memory")
JSON_TAG = "MEMORY_JSON "
MIB = float(1 << 20)


# ----------------------------------------------------------------------------- pure helpers
def cumulative_peak(events: Iterable[Tuple[int, int]]) -> Tuple[int, int]:
    """Peak and final value of the running sum of ``(time, signed bytes)`` events.

    Events are taken in time order (a stable sort: events with equal time stamps keep
    their recorded order). The sum starts at 0, so the peak is never negative; frees
    of memory allocated before the window lower the running sum.

    Returns:
        ``(peak, final)`` in bytes.
    """
    total = peak = 0
    for _, delta in sorted(events, key=lambda e: e[0]):
        total += delta
        peak = max(peak, total)
    return peak, total


def expected_in_flight(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` of ``stages`` holds at once."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    if schedule == "gpipe":
        return microbatches
    if schedule in ("1f1b", "zb-h1"):
        return min(stages - stage, microbatches)
    if schedule == "pipedream":
        return stages - stage
    raise ValueError(f"no in-flight rule for schedule {schedule!r}")


def block_balance(blocks: int, stages: int, per_block: int = 4) -> List[int]:
    """Modules per stage for ``blocks`` blocks of ``per_block`` modules + a classifier:
    the blocks split evenly (earlier stages take the remainder), the classifier on the
    last stage."""
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot split {blocks} blocks over {stages} stages")
    base, extra = divmod(blocks, stages)
    counts = [per_block * (base + (1 if j < extra else 0)) for j in range(stages)]
    counts[-1] += 1
    return counts


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (bytes per extra microbatch in the M sweep)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("slope needs two or more (x, y) pairs of equal count")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("slope needs at least two different x values")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def expected_peak(in_flight: int, activation: float, input_bytes: float, grads: float, recompute: bool,
                  extra_weights: float = 0.0) -> float:
    """The textbook model: n * a + gradients (+ stashed weight copies); with recompute,
    n * input + a (one microbatch recomputed at a time) + gradients."""
    held = in_flight * input_bytes + activation if recompute else in_flight * activation
    return held + grads + extra_weights


# ----------------------------------------------------------------------------- worker
def make_model(hidden: int, expand: int, blocks: int, seed: int = 0):
    """``blocks`` x [Linear(H, eH), ReLU, Linear(eH, H), ReLU] + Linear(H, 10), flat."""
    return h.mlp([hidden] + [expand * hidden, hidden] * blocks + [10], seed)


class Window:
    """Peak allocated bytes of a code window (context manager): torch.profiler memory
    events on CPU, the CUDA caching allocator's peak counter on CUDA."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.peak = 0
        self.final = 0
        self._prof = None
        self._base = 0

    def __enter__(self) -> "Window":
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
            self.final = torch.cuda.memory_allocated() - self._base
            return
        self._prof.__exit__(*exc)
        events = [(e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type().name == "CPU"]
        self.peak, self.final = cumulative_peak(events)


def self_check(device) -> Dict[str, Any]:
    """Ten 1 MiB tensors alive together, freed, then 3 MiB: the window's peak must be 10 MiB."""
    import torch

    with Window(device) as w:
        keep = [torch.empty(1 << 18, device=device) for _ in range(10)]
        del keep
        other = torch.empty(3 << 18, device=device)
        del other
    return {"expected": 10 << 20, "measured": w.peak, "ok": w.peak == 10 << 20}


def stage_activation(pipe, x_mb, y_mb, device) -> Dict[str, float]:
    """Bytes one microbatch's forward keeps alive on this rank's stage (outside the
    pipeline), and the bytes of the stage's input and output per microbatch."""
    import torch
    import torch.nn.functional as F

    stage = pipe.module
    width = stage[0].in_features
    with Window(device) as w:
        if pipe.is_first:
            inp = x_mb.to(device)  # stage 0's inputs are views of the batch: no new memory
        else:
            inp = torch.randn(x_mb.shape[0], width, device=device, requires_grad=True)
        out = stage(inp)
        out_bytes = 0.0 if pipe.is_last else float(out.numel() * out.element_size())
        if pipe.is_last:
            out = F.cross_entropy(out, y_mb.to(device))
        keep = out
    retained = w.final
    del keep, out, inp
    stage.zero_grad(set_to_none=True)
    input_bytes = 0.0 if pipe.is_first else float(x_mb.shape[0] * width * 4)
    return {"activation_bytes": float(retained), "input_bytes": input_bytes, "output_bytes": out_bytes}


def run_config(cfg: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """One (schedule, recompute, microbatches) configuration; every rank's measurements."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipedream_ext as pd

    world = dist.get_world_size()
    M = cfg["microbatches"]
    mb = args.batch // args.microbatches  # the microbatch size stays fixed (M sweep too)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(mb * M, args.hidden, generator=g)
    y = torch.randint(0, 10, (mb * M,), generator=g)
    pipe = pd.PipeDream(make_model(args.hidden, args.expand, args.blocks, args.seed), F.cross_entropy,
                        schedule=cfg["schedule"], microbatches=M, balance=block_balance(args.blocks, world),
                        recompute=cfg["recompute"], timeout=args.pipe_timeout)
    device = pipe.device
    x, y = x.to(device), y.to(device)
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=args.lr)
    weight_bytes = float(sum(p.numel() * p.element_size() for p in params))
    if pipe.asynchronous:
        feed = [(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for i in range(M)]
        steps = args.async_steps or 3 * world

        def window() -> None:
            for i in range(steps):
                pipe.step(*feed[i % M], optimizer=opt)
            pipe.flush()
    else:
        steps = 1

        def window() -> None:
            pipe.step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        window()
    opt.zero_grad(set_to_none=True)
    pipe.reset_stats()
    dist.barrier()
    with Window(device) as w:
        window()
    st = pipe.stats()
    act = stage_activation(pipe, x[:mb], y[:mb], device)
    mine = {"rank": dist.get_rank(), "stage": pipe.stage_index, "peak_bytes": w.peak,
            "peak_activations": st["peak_activations"],
            "peak_weight_versions": max(st["peak_weight_versions"].values(), default=1),
            "weight_bytes": weight_bytes, "weight_bytes_copied": st["weight_bytes_copied"], **act}
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    return {**cfg, "steps_in_window": steps, "microbatch_size": mb, "ranks": gathered}


def worker_configs(args: argparse.Namespace, world: int) -> List[Dict[str, Any]]:
    """The main grid (schedules x recompute) and, on the smallest world, the 1f1b M sweep."""
    configs = [{"schedule": s, "recompute": rc, "microbatches": args.microbatches, "part": "main"}
               for s in args.schedules for rc in (False, True)]
    if args.m_sweep and world == min(args.ranks):
        configs += [{"schedule": "1f1b", "recompute": rc, "microbatches": m, "part": "sweep"}
                    for m in args.m_sweep for rc in (False, True)]
    return configs


def run_worker(args: argparse.Namespace) -> int:
    """One rank: the method check, then every configuration of :func:`worker_configs`."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() \
            else torch.device("cpu")
        result.update(device=str(device), method="torch.cuda.max_memory_allocated" if device.type == "cuda"
                      else "torch.profiler memory events")
        checks: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(checks, self_check(device))
        result["self_check"] = checks
        result["runs"] = [run_config(c, args) for c in worker_configs(args, dist.get_world_size())]

    return h.worker(JSON_TAG, body)


# ----------------------------------------------------------------------------- driver
def rows_of(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per (configuration, stage) of one world size."""
    rows = []
    p = result["world"]
    for run in result.get("runs", []):
        for r in sorted(run["ranks"], key=lambda r: r["stage"]):
            n = expected_in_flight(run["schedule"], p, r["stage"], run["microbatches"])
            extra = (r["peak_weight_versions"] - 1) * r["weight_bytes"] if run["schedule"] == "pipedream" else 0.0
            exp = expected_peak(n, r["activation_bytes"], r["input_bytes"], r["weight_bytes"], run["recompute"],
                                extra)
            rows.append({"ranks": p, "part": run["part"], "schedule": run["schedule"],
                         "recompute": run["recompute"], "microbatches": run["microbatches"], "stage": r["stage"],
                         "peak_mib": r["peak_bytes"] / MIB, "peak_activations": r["peak_activations"],
                         "expected_in_flight": n, "activation_mib": r["activation_bytes"] / MIB,
                         "input_mib": r["input_bytes"] / MIB, "output_mib": r["output_bytes"] / MIB,
                         "weight_mib": r["weight_bytes"] / MIB, "versions": r["peak_weight_versions"],
                         "expected_mib": exp / MIB, "ratio": r["peak_bytes"] / exp if exp else float("nan")})
    return rows


def main_table(rows: List[Dict[str, Any]]) -> List[str]:
    """The peak per (world, schedule, recompute, stage) beside the textbook expectation."""
    return h.table(["ranks", "schedule", "recompute", "stage", "peak (MiB)", "stats peak_activations",
                    "expected n", "a: one microbatch (MiB)", "stage input / output per microbatch (MiB)",
                    "weights (MiB)", "weight versions", "textbook expectation (MiB)", "measured / expected"],
                   [[r["ranks"], r["schedule"], "yes" if r["recompute"] else "no", r["stage"],
                     f"{r['peak_mib']:.2f}", r["peak_activations"], r["expected_in_flight"],
                     f"{r['activation_mib']:.3f}", f"{r['input_mib']:.3f} / {r['output_mib']:.3f}",
                     f"{r['weight_mib']:.3f}", r["versions"], f"{r['expected_mib']:.2f}", f"{r['ratio']:.2f}"]
                    for r in rows])


def recompute_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Peak per stage without and with recompute, and the share saved."""
    lines = h.table(["ranks", "schedule", "stage", "without recompute (MiB)", "with recompute (MiB)", "saved"])
    pairs: Dict[Tuple[int, str, int], Dict[bool, float]] = {}
    for r in rows:
        pairs.setdefault((r["ranks"], r["schedule"], r["stage"]), {})[r["recompute"]] = r["peak_mib"]
    for (p, s, j), v in pairs.items():
        if False in v and True in v:
            saved = 1 - v[True] / v[False] if v[False] else float("nan")
            lines.append(h.table_row([p, s, j, f"{v[False]:.2f}", f"{v[True]:.2f}", f"{round(100 * saved):d}%"]))
    return lines


def sweep_table(rows: List[Dict[str, Any]]) -> Tuple[List[str], Dict[Tuple[int, bool], float]]:
    """Peak per stage against M (1f1b, fixed microbatch size) and the slope per microbatch."""
    ms = sorted({r["microbatches"] for r in rows})
    keys = sorted({(r["stage"], r["recompute"]) for r in rows})
    lines = h.table(["stage", "recompute"] + [f"M={m}" for m in ms]
                    + ["slope (MiB per extra microbatch)", "stage input + output per microbatch (MiB)"])
    slopes: Dict[Tuple[int, bool], float] = {}
    for j, rc in keys:
        pts = {r["microbatches"]: r for r in rows if (r["stage"], r["recompute"]) == (j, rc)}
        xs = [m for m in ms if m in pts]
        k = slope(xs, [pts[m]["peak_mib"] for m in xs]) if len(xs) >= 2 else float("nan")
        slopes[(j, rc)] = k
        any_row = next(iter(pts.values()))
        lines.append(h.table_row([j, "yes" if rc else "no"]
                                 + [f"{pts[m]['peak_mib']:.2f}" if m in pts else "n/a" for m in ms]
                                 + [f"{k:.3f}", f"{any_row['input_mib'] + any_row['output_mib']:.3f}"]))
    return lines, slopes


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    plt = h.pyplot()

    worlds = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 4.6), squeeze=False)
    for ax, p in zip(axes[0], worlds):
        keys: List[Tuple[str, int]] = []
        for r in rows:
            k = (r["schedule"], r["stage"])
            if r["ranks"] == p and k not in keys:
                keys.append(k)

        def pick(k: Tuple[str, int], rc: bool) -> Optional[Dict[str, Any]]:
            return next((r for r in rows if r["ranks"] == p and (r["schedule"], r["stage"]) == k
                         and r["recompute"] == rc), None)

        for offset, rc, color, name in ((-0.2, False, "#dd8452", "without recompute"),
                                        (0.2, True, "#55a868", "recompute=True")):
            vals = [(pick(k, rc) or {}).get("peak_mib", 0.0) for k in keys]
            ax.bar([i + offset for i in range(len(keys))], vals, 0.4, color=color, label=name)
            for i, k in enumerate(keys):
                row = pick(k, rc)
                if row:
                    ax.plot([i + offset - 0.2, i + offset + 0.2], [row["expected_mib"]] * 2, color="black", lw=1.2)
        ax.plot([], [], color="black", lw=1.2, label="textbook expectation")
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{s}\nstage {j}" for s, j in keys], fontsize=7)
        ax.set_ylabel("peak allocated in the window (MiB)")
        ax.set_title(f"Peak memory per stage, {p} ranks")
        ax.legend(fontsize=8)
    h.save_figure(fig, path)


def run_driver(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    t_start = time.perf_counter()
    info, command = h.start_report(LOG)
    script = Path(__file__).resolve()
    common = h.forward(args, "hidden", "expand", "blocks", "batch", "microbatches", "warmup", "async_steps",
                       "schedules", "ranks", "m_sweep", "seed", "lr", "pipe_timeout")
    results, rows, errors, launches = [], [], [], {}
    for p in tqdm(args.ranks, desc="world sizes", unit="launch"):
        r = h.launch_torchrun(script, p, ["--worker"] + common, JSON_TAG, args.timeout)
        launches[p] = r.get("launch_s", 0.0)
        if "error" in r:
            LOG.error("%d ranks: %s", p, r["error"])
            errors.append(f"{p} ranks: {r['error']}")
        r.setdefault("world", p)
        results.append(r)
        rows += rows_of(r)
    total_s = time.perf_counter() - t_start
    mb = args.batch // args.microbatches
    main_rows = [r for r in rows if r["part"] == "main"]
    sweep_rows = [r for r in rows if r["part"] == "sweep"]
    checks = [c for r in results for c in r.get("self_check", [])]
    methods = sorted({r.get("method", "?") for r in results})
    check_text = (f"Method check on every rank of every launch: ten 1 MiB tensors alive at once, freed, then 3 MiB; "
                  f"measured peaks {sorted({c['measured'] for c in checks})} bytes, expected {10 << 20}: "
                  f"{'passed' if checks and all(c['ok'] for c in checks) else 'FAILED'}.")
    cuda_text = ("CUDA: not available on this machine, so `torch.cuda.max_memory_allocated` was not used (the "
                 "script uses it automatically when CUDA is present)." if info["cuda"] == "none"
                 else f"CUDA: {info['cuda']} (peaks from torch.cuda.max_memory_allocated).")
    e = args.expand * args.hidden
    lines = ["# Memory per stage, with and without recompute", "",
             h.command_sentence(command, total_s, launches), "",
             h.machine_line(info) + " One thread per rank, Gloo.", "",
             f"Model: {args.blocks} x [Linear({args.hidden}, {e}), ReLU, Linear({e}, {args.hidden}), ReLU] + "
             f"Linear({args.hidden}, 10), SGD; batch {args.batch} in M={args.microbatches} microbatches of {mb} "
             f"(pipedream: minibatches of {mb}); stages split the blocks evenly, the classifier on the last "
             f"stage. Window: one step after {args.warmup} warm-up steps (pipedream: "
             f"{args.async_steps or '3 x ranks'} minibatches plus the flush, starting empty). Measured with: "
             f"{', '.join(methods)}. " + check_text + " " + cuda_text, "",
             "Peak = most bytes allocated above the window's start level (weights and the batch exist before "
             "it, so they are not in it; the gradients, allocated during the step, are). a = bytes one "
             "microbatch's forward keeps alive on the stage (received input, saved tensors, output), measured "
             "the same way outside the pipeline. Textbook expectation: n * a + weights (their gradients); with "
             "recompute n * input + a + weights; pipedream also (versions - 1) * weights for stashed copies. "
             "n: gpipe M, 1f1b min(p - j, M), pipedream p - j.", "",
             "## Peak per stage", ""]
    lines += main_table(main_rows)
    lines += ["", "## With against without recompute", ""] + recompute_table(main_rows)
    if sweep_rows:
        st, _ = sweep_table(sweep_rows)
        lines += ["", f"## 1f1b against M ({min(args.ranks)} ranks, microbatch of {mb} fixed)", "",
                  "If only p - j microbatches' activations were alive, the peak would not grow with M. The slope is "
                  "the least-squares growth per extra microbatch.", ""] + st
    if errors:
        lines += ["", "Failed:"] + [f"- {err}" for err in errors]
    lines += ["", "Plot: `memory.png` (peak per stage with and without recompute, textbook expectation marked).", ""]
    h.write_results(Path(args.out_dir), "memory", "\n".join(lines),
                    {"machine": info, "command": command, "results": results, "rows": rows, "total_s": total_s})
    if main_rows:
        plot(main_rows, Path(args.out_dir) / "memory.png")
    LOG.info("done in %.0f s", total_s)
    return 1 if errors or not all(c["ok"] for c in checks) else 0


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--ranks", type=_ints, default=[2, 4], help="world sizes (comma-separated, default 2,4)")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=["gpipe", "1f1b", "pipedream"])
    p.add_argument("--hidden", type=int, default=64, help="H")
    p.add_argument("--expand", type=int, default=4, help="e: inner width e x H of a block")
    p.add_argument("--blocks", type=int, default=8, help="blocks [Linear, ReLU, Linear, ReLU]")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--m-sweep", type=_ints, default=[2, 4, 8, 16],
                   help="M values of the 1f1b sweep at a fixed microbatch size, smallest world only "
                        "('' to skip)")
    p.add_argument("--warmup", type=int, default=2, help="windows run before the measured one")
    p.add_argument("--async-steps", type=int, default=0,
                   help="pipedream minibatches per window (default 3 x ranks)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pipe-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun launch")
    args = p.parse_args(argv)
    for s in args.schedules:
        if s not in ("gpipe", "1f1b", "zb-h1", "pipedream"):
            p.error(f"schedule {s!r}: this benchmark supports gpipe, 1f1b, zb-h1, pipedream")
    if args.batch % args.microbatches:
        p.error("--batch must be divisible by --microbatches")
    if any(not 1 <= r <= args.blocks for r in args.ranks):
        p.error(f"every --ranks value must be between 1 and --blocks={args.blocks}")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
