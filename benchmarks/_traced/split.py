"""Part 1 of benchmarks/traced.py: the cost of tracing and splitting (``split_model``'s
phases, timed by ``pipedream_ext.diagnostics.time_split``), beside torch's ``pipeline()``."""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import _harness as h

from .common import LOG, MODELS, build, make_batch, median, split_point

__all__ = ["SHOWN_PHASES", "sample_part", "time_split", "trace_part"]

#: The phases of ``diagnostics.time_split`` the trace table shows, each in its column; the
#: rest of the split (the fingerprint among it) is its "other" column.
SHOWN_PHASES = ("trace", "cut", "value_check", "build", "ownership")


def _torch_pipeline(kind: str, size: Dict[str, Any], x: Any, point: str, batch: int,
                    microbatches: int) -> Dict[str, Any]:
    """torch's ``pipeline()`` (torch.export) on the same model and split point, one
    microbatch as ``mb_args``: ``torch_s``, or ``torch_error`` where it fails."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    mb = x[: max(1, batch // microbatches)]
    t0 = time.perf_counter()
    try:
        pipeline(build(kind, size), mb_args=(mb,), split_spec={point: SplitPoint.BEGINNING})
        return {"torch_s": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
        return {"torch_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def time_split(kind: str, size: Dict[str, Any], batch: int, microbatches: int,
               with_torch: bool = True) -> Dict[str, Any]:
    """One ``split_model`` call with its phases timed, then (``with_torch``) torch's
    ``pipeline()`` on the same model and split point (one microbatch as ``mb_args``)."""
    import torch

    import pipedream_ext.diagnostics as pdd

    model = build(kind, size)
    x, _ = make_batch(kind, size, batch, seed=3)
    point = split_point(kind, size)
    timing = pdd.time_split(model, [point], (x,))
    split = timing.split
    out: Dict[str, Any] = {"total_s": timing.total_s, "nodes": timing.graph_nodes, "phases_s": timing.phases_s,
                           "stage_nodes": [len(s.graph.nodes) for s in split.stages],
                           "live": [len(v) for v in split.live]}
    out["other_s"] = timing.total_s - sum(timing.phases_s.get(p, 0.0) for p in SHOWN_PHASES)
    # The value check runs the sample through the graph: compare with the plain forward.
    model.eval()
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x)
        out["forward_s"] = time.perf_counter() - t0
    model.train()
    if with_torch:
        out.update(_torch_pipeline(kind, size, x, point, batch, microbatches))
    return out


def trace_part(args: argparse.Namespace, sizes: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Part 1: every model size, ``--trace-reps`` interleaved repetitions, medians."""
    import warnings

    rows = []
    for kind in MODELS:
        for size in sizes[kind]:
            runs = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.export's pytree deprecations
                for _ in range(args.trace_reps):
                    runs.append(time_split(kind, size, args.trace_batch, args.microbatches))
            phases = sorted({p for r in runs for p in r["phases_s"]})
            row = {"model": kind, "size": size["label"], "nodes": runs[0]["nodes"],
                   "stage_nodes": runs[0]["stage_nodes"], "live": runs[0]["live"],
                   "total_s": median([r["total_s"] for r in runs]),
                   "forward_s": median([r["forward_s"] for r in runs]),
                   "other_s": median([r["other_s"] for r in runs]),
                   "phases_s": {p: median([r["phases_s"].get(p, 0.0) for r in runs]) for p in phases},
                   "torch_s": median([r["torch_s"] for r in runs if "torch_s" in r]),
                   "torch_error": next((r["torch_error"] for r in runs if "torch_error" in r), None),
                   "runs": runs}
            LOG.info("trace %s %s: %d nodes, split_model %.3f s, torch pipeline() %s s", kind, size["label"],
                     row["nodes"] or 0, row["total_s"], h.fmt(row["torch_s"], 3))
            rows.append(row)
    return rows


def sample_part(args: argparse.Namespace, sizes: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Part 1b: ``split_model`` against the sample's batch size (the value check runs the
    sample), for the middle ResNet and GPT sizes."""
    rows = []
    for kind in ("resnet", "gpt"):
        size = sizes[kind][len(sizes[kind]) // 2]
        for batch in args.sample_batches:
            runs = [time_split(kind, size, batch, args.microbatches, with_torch=False)
                    for _ in range(args.trace_reps)]
            rows.append({"model": kind, "size": size["label"], "batch": batch,
                         "total_s": median([r["total_s"] for r in runs]),
                         "value_check_s": median([r["phases_s"].get("value_check", 0.0) for r in runs]),
                         "forward_s": median([r["forward_s"] for r in runs])})
            LOG.info("sample batch %d, %s %s: split_model %.3f s", batch, kind, size["label"], rows[-1]["total_s"])
    return rows
