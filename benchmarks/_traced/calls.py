"""Part 2 of benchmarks/traced.py: each stage alone, the traced ``GraphModule`` against the
``nn.Sequential`` stage of the same modules (forward, and forward+backward)."""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Sequence, Tuple

from .common import LOG, build, loss_fn, make_batch, median, ratio_stats, sequential_twin, split_point

__all__ = ["stage_call_part"]


def _fwd_bwd(stage, inp, last: bool, lossf, y) -> None:
    import torch

    out = stage(inp)
    if last:
        lossf(out, y).backward()
    else:
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])


def _fwd(stage, inp, last: bool, lossf, y) -> None:
    import torch

    with torch.no_grad():
        stage(inp)


def stage_call_part(args: argparse.Namespace, cases: Sequence[Tuple[str, str, Dict[str, Any], int]]
                    ) -> List[Dict[str, Any]]:
    """Part 2: each stage alone, traced vs nn.Sequential, forward (no grad) and
    forward+backward on one microbatch; ``cases``: (label, kind, size, microbatch size)."""
    import torch
    from torch import nn

    import pipedream_ext.diagnostics as pdd

    rows = []
    for label, kind, size, mb in cases:
        x, y = make_batch(kind, size, mb, seed=5)
        traced = pdd.trace_split(build(kind, size), [split_point(kind, size)], (x,)).stages
        twin, balance = sequential_twin(kind, build(kind, size))
        children = list(twin.children())
        seq = [nn.Sequential(*children[:balance[0]]), nn.Sequential(*children[balance[0]:])]
        lossf = loss_fn(kind)
        with torch.no_grad():
            mid = seq[0](x)
        inputs = [x, tuple(t.detach().requires_grad_() for t in mid) if isinstance(mid, tuple)
                  else mid.detach().requires_grad_()]
        for j in range(2):
            mods = {"traced": traced[j], "sequential": seq[j]}
            row: Dict[str, Any] = {"case": label, "model": kind, "size": size["label"], "microbatch": mb, "stage": j,
                                   "traced_calls": sum(n.op == "call_module" for n in traced[j].graph.nodes),
                                   "traced_nodes": len(traced[j].graph.nodes)}
            for what, fn in (("fwd", _fwd), ("fwd_bwd", _fwd_bwd)):
                times: Dict[str, List[float]] = {"traced": [], "sequential": []}
                for name in mods:
                    fn(mods[name], inputs[j], j == 1, lossf, y)  # warm-up
                for r in range(args.call_reps):
                    for name in (("traced", "sequential") if r % 2 == 0 else ("sequential", "traced")):
                        t0 = time.perf_counter()
                        fn(mods[name], inputs[j], j == 1, lossf, y)
                        times[name].append(time.perf_counter() - t0)
                row[f"{what}_traced_ms"] = median(times["traced"]) * 1e3
                row[f"{what}_sequential_ms"] = median(times["sequential"]) * 1e3
                row[f"{what}_ratio"] = ratio_stats(times["traced"], times["sequential"])
            for m in mods.values():
                m.zero_grad(set_to_none=True)
            LOG.info("stage call %s %s stage %d: fwd+bwd traced %.3f ms, sequential %.3f ms", label, kind, j,
                     row["fwd_bwd_traced_ms"], row["fwd_bwd_sequential_ms"])
            rows.append(row)
    return rows

