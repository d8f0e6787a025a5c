"""Traced models (``split_points``): the cost of tracing, and training throughput against
the same layers as an ``nn.Sequential`` and against torch.distributed.pipelining.

Three models of examples/models.py, each in a few sizes:

* ``resnet``: a ResNet-style CNN: a stem (conv, BatchNorm, ReLU), ``layer1``-``layer4``
  of basic residual blocks (BatchNorm, a 1x1 conv + BatchNorm on the skip path where
  the shape changes), ``F.adaptive_avg_pool2d``, ``torch.flatten``, ``fc``;
* ``unet``: a U-Net-style model: encoder levels ``encs.i`` (the first keeps the
  resolution, the others halve it), a middle block, and per level an up-convolution
  ``ups.k`` and a decoder ``decs.k`` that concatenates the encoder's output of that
  level (the skip connection);
* ``gpt``: a GPT-style decoder: token + position embedding, ``blocks.i`` pre-norm
  blocks with causal attention, a final LayerNorm and a head tied to the token
  embedding (``head.weight = embed.tok.weight``).

Each model can also be written as an ``nn.Sequential`` of the *same module objects*
with the same 2-stage boundary (:func:`sequential_twin`; the U-Net's twin has two
layers, its encoder path returning the skip connections as a tuple and its decoder
path taking them), so the traced path and the ``nn.Sequential`` path run the same
weights, the same operations and the same microbatches.

Parts of a run:

1. **Trace and split** (this process, one thread): ``split_model`` on every model size
   with its 2-stage split point and a sample batch of ``--trace-batch``; the time of each
   phase (``pipedream_ext.diagnostics.time_split``: ``symbolic_trace``, cutting and live
   sets, the value check, which runs the sample through the graph once, building the
   stage ``GraphModule``s, the ownership check, the rest), the graph's node count and the
   cost per node; beside it
   ``torch.distributed.pipelining.pipeline`` (torch.export) on the same model, split
   point and one microbatch. Median of ``--trace-reps``, ours and torch's interleaved.
   Then ``split_model`` of the middle ResNet and GPT sizes against the sample's batch
   size (``--sample-batches``): the value check runs the whole sample.
2. **Stage calls** (this process): forward (no grad) and forward+backward of each
   stage alone on one microbatch (no communication), the traced ``GraphModule`` against
   the ``nn.Sequential`` stage, interleaved, median of ``--call-reps``; at the throughput
   sizes and at tiny sizes with a microbatch of 1, where a call is nearly all Python
   overhead.
3. **Throughput** (one ``torchrun`` launch per model, 2 ranks, Gloo, one thread per
   rank): six configurations in one process pair, each on its own copy of the same
   weights: pipedream_ext traced and ``nn.Sequential`` with 1f1b and gpipe, and
   torch.distributed.pipelining ``pipeline(model, mb_args, split_spec={point:
   SplitPoint.BEGINNING})`` + ``build_stage`` with Schedule1F1B and ScheduleGPipe; same
   global batch, same ``--microbatches``, same loss, SGD. First each configuration runs
   one step on a check batch from the initial weights: its loss and every gradient are
   compared with the unsplit model's (run microbatch by microbatch, as a pipeline runs
   BatchNorm). Then ``--reps`` rounds of ``--steps`` steps per configuration,
   interleaved step by step (the six in turn, A B C ... then ... C B A, every step
   between two barriers), so that the load of other jobs falls on all of them alike;
   samples/s from the wall time between the barriers (the slower rank's), CPU time of
   both ranks per sample, and pipedream_ext's compute time (``stats()``: F and B
   actions, the busier rank). The ratios traced / ``nn.Sequential`` and ours / torch
   are taken per round (median, min, max).
4. **A skip connection across several cuts**: the U-Net cut so that its first skip
   connection crosses more than one cut, "fan-out" (the stage making it also feeds it to
   the next stage: two later stages use one value) and "jump" (it goes over the stages
   between to the one using it); 2 ranks with 4 stages (interleaved schedules, at the
   end of the last throughput launch) and 3 ranks with 3 stages (its own launch):
   pipedream_ext relays the skip (first step against the unsplit model) and
   torch.distributed.pipelining's schedules are run on the same split, their errors
   recorded per rank (on a group with a ``--probe-timeout`` so that the peers of a
   failing rank give up instead of hanging).

The parts live in ``benchmarks/_traced/`` (``common``: models, sizes and helpers; ``split``,
``calls``, ``throughput``, ``skips``: parts 1 to 4; ``report``); this script launches them.

Results: ``<out-dir>/traced.md`` and ``traced.json``. ``--smoke`` runs every part on
tiny sizes, with one throughput launch (the U-Net, 1 round of 1 step) that also runs
part 4 on 2 ranks: about 25 s on a quiet 2-core machine (tests/test_bench_scripts.py).

Command, from the repository root (2.5 minutes at load 2-3 on 2 cores, 5 at load 6):

    python3 benchmarks/traced.py
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h
from _traced.calls import stage_call_part
from _traced.common import (
    CONFIGS,
    JSON_TAG,
    LOG,
    MODELS,
    SMOKE_THROUGHPUT_SIZES,
    SMOKE_TRACE_SIZES,
    THROUGHPUT_SIZES,
    TRACE_SIZES,
    WORKERS,
    build,
    config_order,
    fmt_ratio,
    make_batch,
    ratio_stats,
    sequential_twin,
    split_point,
)
from _traced.report import report
from _traced.skips import run_probe
from _traced.split import sample_part, trace_part
from _traced.throughput import run_throughput

__all__ = ["CONFIGS", "TRACE_SIZES", "THROUGHPUT_SIZES", "build", "config_order", "fmt_ratio", "make_batch",
           "main", "parse_args", "ratio_stats", "report", "run_driver", "run_worker",
           "sequential_twin", "split_point"]


def run_worker(args: argparse.Namespace) -> int:
    """One rank of a launch: ``--worker throughput --model M`` (part 3, and part 4 with
    ``--run-probe``) or ``--worker probe`` (part 4)."""
    def body(result: Dict[str, Any]) -> None:
        if args.worker == "throughput":
            run_throughput(args, result)
        if args.worker == "probe" or args.run_probe:
            result["probe"] = run_probe(args)

    return h.worker(JSON_TAG, body, backend="gloo")


def run_driver(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("pipedream_ext").setLevel(logging.WARNING)
    info, command = h.start_report(LOG)
    t0 = time.perf_counter()
    trace_sizes = SMOKE_TRACE_SIZES if args.smoke else TRACE_SIZES
    tp_sizes = SMOKE_THROUGHPUT_SIZES if args.smoke else THROUGHPUT_SIZES
    data: Dict[str, Any] = {"machine": info, "command": command, "args": vars(args)}
    data["trace"] = trace_part(args, trace_sizes)
    data["sample_batches"] = sample_part(args, trace_sizes)
    mb = max(1, args.batch // args.microbatches)
    cases = [("throughput size", k, tp_sizes[k], mb) for k in args.models]
    cases += [("tiny, overhead-bound", k, SMOKE_TRACE_SIZES[k][0], 1) for k in args.models]
    data["stage_calls"] = stage_call_part(args, cases)
    common = ["--batch", args.batch, "--microbatches", args.microbatches] + h.forward(
        args, "reps", "steps", "warmup", "lr", "pipe_timeout", "probe_timeout") + (["--smoke"] if args.smoke else [])
    data["throughput"] = {}
    for kind in args.models:
        LOG.info("throughput: %s on 2 ranks", kind)
        probe = ["--run-probe"] if args.probe and kind == args.models[-1] else []
        data["throughput"][kind] = h.launch_torchrun(Path(__file__), 2, ["--worker", "throughput", "--model", kind]
                                                     + probe + common, JSON_TAG, timeout=args.timeout)
        if probe:
            data["probe2"] = data["throughput"][kind].pop("probe", None) or {
                "error": data["throughput"][kind].get("error", "no result")}
    if args.probe and args.probe_ranks > 2:
        LOG.info("skip connections across cuts: %d ranks", args.probe_ranks)
        data["probe3"] = h.launch_torchrun(Path(__file__), args.probe_ranks, ["--worker", "probe"] + common,
                                           JSON_TAG, timeout=args.timeout)
        data["probe3"] = data["probe3"].get("probe") or {"error": data["probe3"].get("error", "no result")}
    data["total_s"] = time.perf_counter() - t0
    data["loadavg_at_end"] = list(os.getloadavg())
    h.write_results(Path(args.out_dir), "traced", report(data, info, command), data)
    failed = [k for k, r in data["throughput"].items() if "error" in r]
    failed += [k for k in ("probe2", "probe3") if "error" in data.get(k, {})]
    if failed:
        LOG.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, WORKERS)
    p.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help="models for the stage-call and throughput parts (comma-separated; default: all, "
                   "with --smoke: unet)")
    p.add_argument("--batch", type=int, default=32, help="global batch of the throughput part")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--reps", type=int, default=10, help="rounds of the throughput part")
    p.add_argument("--steps", type=int, default=3, help="steps per configuration and round")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per configuration")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--trace-batch", type=int, default=8, help="sample batch for the trace part")
    p.add_argument("--trace-reps", type=int, default=3)
    p.add_argument("--sample-batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8, 64],
                   help="sample batch sizes of the split_model-against-sample table (comma-separated)")
    p.add_argument("--call-reps", type=int, default=40, help="interleaved pairs of the stage-call part")
    p.add_argument("--pipe-timeout", type=float, default=120.0, help="pipedream_ext's timeout (s)")
    p.add_argument("--probe-timeout", type=float, default=10.0,
                   help="seconds the peers of a failing torch.distributed.pipelining rank wait")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="leave out the skip-connection part (part 4)")
    p.add_argument("--run-probe", action="store_true", help=argparse.SUPPRESS)  # worker: part 4 too
    p.add_argument("--probe-ranks", type=int, choices=(2, 3), default=3,
                   help="3: part 4 on 2 ranks (in the last throughput launch) and on 3 ranks (its own "
                   "launch); 2: on 2 ranks only (default with --smoke)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, 1 round of 1 step: every part in well under a minute")
    args = p.parse_args(argv)
    if args.smoke:
        args.reps, args.steps, args.warmup, args.trace_reps, args.call_reps = 1, 1, 0, 1, 2
        args.batch, args.trace_batch, args.probe_timeout = min(args.batch, 8), min(args.trace_batch, 4), 3.0
        args.probe_ranks, args.sample_batches = 2, [1, 4]
    if args.models is None:
        args.models = ["unet"] if args.smoke else list(MODELS)
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown models {bad}; choose from {list(MODELS)}")
    if args.batch % args.microbatches:
        p.error("--batch must be divisible by --microbatches")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
