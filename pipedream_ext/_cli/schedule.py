"""CLI command ``schedule``: print, simulate and export a pipeline schedule."""
from __future__ import annotations

import argparse
import json
import logging
from typing import Optional

from .. import _viz, schedules
from .._runtime import options
from .arg_types import int_list

__all__ = ["register"]

_log = logging.getLogger(__name__)


def _cost(text: str) -> Optional[object]:
    """A cost: one number, a comma-separated list, or 'none' (t-w only)."""
    if text.lower() == "none":
        return None
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or comma-separated numbers (got {text!r})") from None
    return values[0] if len(values) == 1 else values


def _default(name: str) -> object:
    """``PipeDream``'s default of option ``name`` (``_runtime/options.py``)."""
    return options.PipelineOptions.__dataclass_fields__[name].default


def _help(name: str) -> str:
    """The help of the flag for option ``name``: its documentation's first sentence and
    ``PipeDream``'s default, where it has one to show (not ``None`` or ``False``)."""
    default = _default(name)
    return options.summary(name) + ("" if default in (None, False) else f"; default {default}")


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Adds the ``schedule`` command."""
    p = subparsers.add_parser(
        "schedule",
        help="print and simulate a pipeline schedule",
        description="Builds a schedule, prints its rank-by-step grid and simulated figures "
                    "(makespan, bubble fraction, peak activations and weight versions per stage).",
    )
    p.add_argument("--name", required=True, help="one of: " + ", ".join(schedules.names()))
    p.add_argument("--stages", type=int, required=True,
                   help="pipeline stages p (ranks, for schedules with several chunks per rank)")
    p.add_argument("--microbatches", type=int, required=True,
                   help=options.summary("microbatches") + " (m; pipedream: minibatches)")
    p.add_argument("--chunks", type=int, default=None,
                   help=_help("chunks") + " (zbv, dualpipev: 2)")
    p.add_argument("--replicas", type=int_list, default=_default("replicas"),
                   help=_help("replicas") + "; comma-separated: 2,1,1")
    p.add_argument("--batches", type=int, default=1, help="consecutive batches (default 1)")
    p.add_argument("--vertical-sync", action="store_true", default=_default("vertical_sync"),
                   help=_help("vertical_sync"))
    p.add_argument("--t-f", type=_cost, default=1.0, help="forward time (one or per stage; default 1)")
    p.add_argument("--t-b", type=_cost, default=2.0,
                   help="backward time (default 2); with --t-w, the input-gradient part I")
    p.add_argument("--t-w", type=_cost, default=None,
                   help="weight-gradient time W (default none: the backward is not split, "
                        "I and W take half of --t-b each)")
    p.add_argument("--t-comm", type=_cost, default=0.0, help="transfer time per boundary (default 0)")
    p.add_argument("--t-allreduce", type=_cost, default=0.0,
                   help="all-reduce time of a replicated stage (default 0)")
    p.add_argument("--comm", action="store_true", help="show SEND/RECV in the grid")
    p.add_argument("--channels", action="store_true",
                   help="also print each rank's operations with each peer, in the order it issues "
                        "them (the two lines of a pair mirror each other, as NCCL matches them)")
    p.add_argument("--pairs", action="store_true",
                   help="print the F&B pairs per rank that PipeDream(overlap=True) runs together (dualpipev)")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome trace (chrome://tracing, Perfetto)")
    p.add_argument("--csv", metavar="PATH", help="write the lowered schedule as CSV")
    p.add_argument("--plot", metavar="PATH.png",
                   help="draw a rank-by-time chart of the simulated run as PNG (matplotlib); "
                        "with --comm also SEND/RECV")
    p.add_argument("--plot-width", type=int, default=1200, metavar="PIXELS",
                   help="width of the --plot image (default 1200; height 116 + 40 per rank)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.plot:  # fail before any work on a path that cannot be written
        _viz.check_png_path(args.plot)
        _viz.image_size(1, args.plot_width)
    chunks = args.chunks
    if chunks is None:  # the schedule's own number (zbv, dualpipev: 2 in a V), else 1
        chunks = schedules.traits(args.name).fixed_chunks or 1
    schedule = schedules.build(args.name, args.stages, args.microbatches, chunks=chunks,
                               replicas=args.replicas, batches=args.batches,
                               vertical_sync=args.vertical_sync)
    costs = dict(t_f=args.t_f, t_b=args.t_b, t_w=args.t_w, t_comm=args.t_comm,
                 t_allreduce=args.t_allreduce)
    if args.trace:
        result = schedule.to_chrome_trace(args.trace, **costs)
        _log.info("wrote Chrome trace to %s", args.trace)
    else:
        result = schedule.simulate(**costs)
    if args.plot:
        schedule.plot(args.plot, comm=args.comm, width=args.plot_width, **costs)
        _log.info("wrote schedule plot to %s", args.plot)
    if args.csv:
        schedule.to_csv(args.csv)
        _log.info("wrote schedule CSV to %s", args.csv)
    if args.json:
        out = {"schedule": schedule.name, "stages": schedule.num_stages,
               "ranks": schedule.num_ranks, "microbatches": schedule.microbatches,
               "batches": schedule.batches, "replicas": schedule.replicas}
        out.update(result.to_dict())
        print(json.dumps(out))
        return 0
    print(f"{schedule!r}\n")
    print(schedule.grid(comm=args.comm))
    rows = [
        ("makespan", f"{result.makespan:g}"),
        ("bubble fraction", f"{result.bubble_fraction:.4f}"),
        ("bubble per rank", " ".join(f"{b:.3f}" for b in result.bubble_fraction_per_rank)),
        ("peak activations per stage", " ".join(map(str, result.peak_activations))),
        ("peak weight versions per stage", " ".join(map(str, result.peak_weight_versions))),
    ]
    if any(result.peak_deferred_weight_grads):
        rows.append(("peak deferred W per stage",
                     " ".join(map(str, result.peak_deferred_weight_grads))))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}")
    if args.channels:
        print("\ntransfer order per pair of ranks:\n" + schedule.channels(), end="")
    if args.pairs:
        print("\nF&B pairs (overlap=True runs each together):")
        for rank, pairs in enumerate(schedule.pairs()):
            print(f"rank {rank}: {' '.join(pairs) or '(none)'}")
    return 0
