"""Pipeline + FSDP (2D) on 4 CPU ranks: ours against torch's own composition.

Model: ``--layers`` MLP blocks (``Linear(w, 4w), GELU, Linear(4w, w)``, default 8
blocks of width 512: 16.8M fp32 parameters) as an ``nn.Sequential``, built on the
meta device, MSE loss; global batch ``--batch`` (default 32) split over 2 dp ranks,
``--microbatches`` (default 4) per dp rank; a ``("pp", "dp")`` mesh of 2 x 2, 1f1b,
AdamW. Four ``torch.distributed.run`` launches in one run: one per mode (fresh
processes, so the bytes and peak RSS are each mode's own) and one building all three
and taking their steps in turn (the order rotating every step), for samples/s that
other work's load on a shared machine affects alike:

* **fsdp** (the reference of the ratios): ``pd.PipeDream(..., mesh=mesh,
  data_parallel="fsdp")``: FSDP2 ``fully_shard`` of each block and of each stage
  over ``mesh["dp"]``, gradients reduce-scattered once per step;
* **replicate**: ``pd.PipeDream(..., mesh=mesh, data_parallel="replicate")``:
  whole stages on each dp rank, gradients all-reduced after each step;
* **torch**: torchtitan's pattern: each pp rank cuts its stage out of the meta
  model, ``fully_shard``s each block and then the stage over ``mesh["dp"]``,
  materialises the shards (``to_empty`` + ``reset_parameters``), and runs
  ``torch.distributed.pipelining``'s ``PipelineStage`` + ``Schedule1F1B`` on
  ``mesh["pp"]`` (the stage defers FSDP's gradient sync to the last microbatch).

Per rank, after the timed steps: the bytes of parameters, gradients and optimizer
state this rank holds (the sum of its local tensors' bytes; a DTensor's local
shard), and the peak RSS above the RSS before the model was built
(``ru_maxrss``); per mode, samples/s: the global batch over the slowest rank's median of ``--steps``
timed steps (after ``--warmup``), each step between two barriers, in the interleaved
launch (the comparison) and in the mode's own launch.
Writes benchmarks/results/fsdp_2d.md (and .json).

Command (about 75 s on 2 cores; ``--smoke``: a tiny model, for the tests):

    python benchmarks/fsdp_2d.py
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["MODES", "main", "parse_args", "report", "run_driver", "run_worker", "tensor_bytes"]

LOG = logging.getLogger("fsdp_2d")
JSON_TAG = "FSDP_2D_JSON "
MODES = ("fsdp", "replicate", "torch")
PP, DP = 2, 2
MIB = float(1 << 20)


def rss_bytes() -> int:
    """The current resident set size (``/proc/self/statm``'s second field, in pages)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tensor_bytes(tensors: Any) -> int:
    """The bytes of the local data of ``tensors`` (a DTensor's local shard; None skipped)."""
    total = 0
    for t in tensors:
        if t is None or not hasattr(t, "element_size"):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _make(layers: int, width: int) -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width)) for _ in range(layers)])


def _ours(args: argparse.Namespace, mesh: Any, mode: str) -> Any:
    """A step function of ``pd.PipeDream`` on the mesh, and its parameters."""
    import torch
    import torch.nn.functional as F

    import pipedream_ext as pd

    with torch.device("meta"):
        model = _make(args.layers, args.width)
    pipe = pd.PipeDream(model, F.mse_loss, schedule="1f1b", microbatches=args.microbatches,
                        init_seed=0, mesh=mesh, data_parallel=mode, timeout=300)
    return lambda x, y: pipe.step(x, y), list(pipe.parameters())


def _torch(args: argparse.Namespace, mesh: Any, mode: str = "torch") -> Any:
    """torchtitan's composition: FSDP2 per block on mesh["dp"], pipelining on mesh["pp"]."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp_rank = mesh["pp"].get_local_rank()
    with torch.device("meta"):
        model = _make(args.layers, args.width)
    per = args.layers // PP
    stage_mod = model[pp_rank * per:(pp_rank + 1) * per]
    for block in stage_mod:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage_mod, mesh=mesh["dp"], reshard_after_forward=False)
    stage_mod.to_empty(device="cpu")
    torch.manual_seed(pp_rank)
    with torch.no_grad():
        for m in stage_mod.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    stage = PipelineStage(stage_mod, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)

    def step(x: Any, y: Any) -> None:
        if pp_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    return step, list(stage_mod.parameters())


def _batch(args: argparse.Namespace, i: int, dp_rank: int) -> Any:
    """Step ``i``'s global batch (seeded), this dp rank's rows of it."""
    import torch

    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    rows = args.batch // DP
    return x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]


def _timed(step: Any, opt: Any, x: Any, y: Any) -> float:
    """One training step between two barriers, in seconds."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    step(x, y)
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradients' memory to count it
    dist.barrier()
    return time.perf_counter() - t0


def _build(args: argparse.Namespace, mesh: Any, mode: str) -> Any:
    import torch

    step, params = (_torch if mode == "torch" else _ours)(args, mesh, mode)
    return step, params, torch.optim.AdamW(params, lr=1e-4)


def _one_mode(args: argparse.Namespace, mesh: Any, result: Dict[str, Any]) -> None:
    """This launch's mode alone: bytes held, peak RSS and the median step."""
    import torch

    baseline = rss_bytes()
    step, params, opt = _build(args, mesh, args.worker)
    dp_rank = mesh["dp"].get_local_rank()
    times = [_timed(step, opt, *_batch(args, i, dp_rank)) for i in range(args.warmup + args.steps)]
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    mine = {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optim": tensor_bytes(state),
            "peak_rss_delta": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline,
            "step_s": statistics.median(times[args.warmup:])}
    result.update(ranks=h.all_gather_json(mine))


def _interleaved(args: argparse.Namespace, mesh: Any, result: Dict[str, Any]) -> None:
    """All three modes in one launch, their steps taken in turn (the order rotating),
    so that load from other work falls on each alike: the median step of each."""
    built = {mode: _build(args, mesh, mode) for mode in MODES}
    dp_rank = mesh["dp"].get_local_rank()
    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    for i in range(args.warmup + args.steps):
        x, y = _batch(args, i, dp_rank)
        for k in range(len(MODES)):
            mode = MODES[(i + k) % len(MODES)]
            step, _, opt = built[mode]
            times[mode].append(_timed(step, opt, x, y))
    result.update(ranks=h.all_gather_json({m: statistics.median(t[args.warmup:]) for m, t in times.items()}))


def run_worker(args: argparse.Namespace) -> int:
    """One rank of a launch: one mode (bytes, RSS, steps) or all three interleaved (steps)."""
    def body(result: Dict[str, Any]) -> None:
        # Every mode imports what any mode uses before the baseline RSS is taken.
        import torch.distributed.fsdp
        import torch.distributed.pipelining  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh

        import pipedream_ext  # noqa: F401

        mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
        result.update(mode=args.worker, batch=args.batch,
                      model_params=args.layers * (8 * args.width * args.width + 5 * args.width))
        (_interleaved if args.worker == "interleaved" else _one_mode)(args, mesh, result)

    return h.worker(JSON_TAG, body, backend="gloo")


def _ratio(value: float, ref: float) -> str:
    return f"{value / ref:.2f}x" if ref else "n/a"


def report(results: Dict[str, Dict[str, Any]], info: Dict[str, str], command: str,
           total_s: float, args: argparse.Namespace) -> str:
    """The Markdown report: per rank and mode the bytes held and peak RSS, per mode
    samples/s, each as a ratio to ``fsdp``.

    Args:
        results: each mode's launch result (rank 0's JSON with every rank's values).
        info: :func:`_harness.machine_info`.
        command: the command line.
        total_s: the run's seconds.
        args: the options (model and batch).

    Returns:
        The report.
    """
    params = results.get("fsdp", {}).get("model_params", 0)
    lines = ["# Pipeline + FSDP (2D): ours against torch's composition", "", h.machine_line(info), "",
             f"Model: {args.layers} MLP blocks of width {args.width} (hidden {4 * args.width}), "
             f"{params / 1e6:.1f}M fp32 parameters, built on meta; pp {PP} x dp {DP} (4 Gloo ranks), "
             f"1f1b, {args.microbatches} microbatches per dp rank, global batch {args.batch}, AdamW. "
             "Bytes: the local tensors a rank holds after a step (parameters + gradients + AdamW "
             "state; a DTensor's shard). Peak RSS: `ru_maxrss` above the RSS before the model was "
             f"built. Samples/s: global batch / median of {args.steps} steps after {args.warmup} "
             f"warm-up, in one launch taking the three modes' steps in turn (so other work's load "
             "falls on each alike), and in each mode's own launch. "
             "Ratios are to `fsdp` (ours, data_parallel=\"fsdp\").", ""]
    ref = results.get("fsdp", {})
    rows = []
    for mode in MODES:
        result = results.get(mode, {})
        if "error" in result:
            lines += [f"**{mode} failed**: {result['error']} (log: {result.get('log', 'n/a')})", ""]
        for r, (mine, base) in enumerate(zip(result.get("ranks", []), ref.get("ranks", []))):
            held = mine["params"] + mine["grads"] + mine["optim"]
            base_held = base["params"] + base["grads"] + base["optim"]
            rows.append([mode, r, f"{mine['params'] / MIB:.1f}", f"{mine['grads'] / MIB:.1f}",
                         f"{mine['optim'] / MIB:.1f}", f"{held / MIB:.1f}", _ratio(held, base_held),
                         f"{mine['peak_rss_delta'] / MIB:.0f}",
                         _ratio(mine["peak_rss_delta"], base["peak_rss_delta"])])
    lines += h.table(["mode", "rank", "params MiB", "grads MiB", "AdamW MiB", "held MiB",
                      "held / fsdp", "peak RSS delta MiB", "RSS / fsdp"], rows)
    speed = []
    together = results.get("interleaved", {}).get("ranks") or []
    for mode in MODES:
        step_s = max((r[mode] for r in together), default=0.0)
        alone = _samples_per_s(results.get(mode, {}), args.batch)
        ref_step = max((r["fsdp"] for r in together), default=0.0)
        speed.append([mode, f"{args.batch / step_s:.1f}" if step_s else "n/a",
                      _ratio(ref_step, step_s) if step_s else "n/a", f"{alone:.1f}" if alone else "n/a"])
    if "error" in results.get("interleaved", {}):
        lines += ["", f"**interleaved failed**: {results['interleaved']['error']}"]
    lines += [""] + h.table(["mode", "samples/s (interleaved launch)", "/ fsdp",
                             "samples/s (its own launch)"], speed)
    launches = ", ".join(f"{mode} {r.get('launch_s', 0.0):.0f} s" for mode, r in results.items())
    lines += ["", f"Command: `{command}` (total {total_s:.0f} s; torchrun launches: {launches}).", ""]
    return "\n".join(lines)


def _samples_per_s(result: Dict[str, Any], batch: int) -> float:
    """A launch's samples/s: the global batch over the slowest rank's median step (0
    when the launch failed)."""
    ranks = result.get("ranks") or []
    return batch / max(r["step_s"] for r in ranks) if ranks and "error" not in result else 0.0


def run_driver(args: argparse.Namespace) -> int:
    """The four launches, then ``<out-dir>/fsdp_2d.md`` and ``.json``."""
    info, command = h.start_report(LOG)
    t0 = time.perf_counter()
    results: Dict[str, Dict[str, Any]] = {}
    for mode in MODES + ("interleaved",):
        LOG.info("launching %d ranks: %s", PP * DP, mode)
        results[mode] = h.launch_torchrun(Path(__file__), PP * DP, ["--worker", mode] + h.forward(
            args, "layers", "width", "batch", "microbatches", "warmup", "steps"), JSON_TAG,
            timeout=args.timeout)
    text = report(results, info, command, time.perf_counter() - t0, args)
    h.write_results(Path(args.out_dir), "fsdp_2d", text,
                    {"machine": info, "command": command, "results": results})
    return 1 if any("error" in r for r in results.values()) else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--worker fsdp|replicate|torch`` under torchrun)."""
    parser = h.make_parser(__doc__, MODES + ("interleaved",))
    parser.add_argument("--layers", type=int, default=8, help="MLP blocks (even: 2 stages)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--microbatches", type=int, default=4, help="per dp rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true",
                        help="4 blocks of width 32, 1 warm-up + 2 timed steps (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.warmup, args.steps = 4, 32, 1, 2
    if args.layers % PP or args.batch % (DP * args.microbatches):
        parser.error(f"--layers {args.layers} must be even and --batch {args.batch} a multiple "
                     f"of {DP} x --microbatches {args.microbatches}")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
