"""Part 4 of benchmarks/traced.py (a worker): a skip connection across several cuts,
pipedream_ext against torch.distributed.pipelining's schedules on the same split."""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Sequence

from .common import build, grad_check, loss_fn, make_batch, reference

__all__ = ["PROBES", "PROBE_SIZE", "run_probe"]

#: Part 4: the U-Net cut so that the first level's skip connection crosses several cuts,
#: by world size. 2 ranks: 4 stages, two per rank (interleaved schedules); 3 ranks: 3
#: stages, one per rank. "fan-out": the skip is the output of a stage that also feeds the
#: next stage (the first encoder alone, or its successor too, in stage 0), so two later
#: stages use one value; "jump": the stage that makes the skip sends it only to the stage
#: using it, over the stage(s) between.
PROBES: Dict[int, Dict[str, Any]] = {
    2: {"pd": "interleaved-1f1b", "torch": ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS"),
        "splits": {"fan-out": ["encs.1", "encs.2", "ups.1"], "jump": ["encs.2", "ups.1", "decs.1"]}},
    3: {"pd": "1f1b", "torch": ("Schedule1F1B", "ScheduleGPipe"),
        "splits": {"fan-out": ["encs.1", "ups.1"], "jump": ["encs.2", "ups.1"]}},
}
PROBE_SIZE = dict(label="depth 3, width 4, 16x16", depth=3, width=4, image=16)


def _torch_schedule(name: str, points: Sequence[str], args: argparse.Namespace, x: Any, y: Any,
                    ref_grads: Dict[str, Any]) -> List[Dict[str, Any]]:
    """torch's schedule ``name`` on the split at ``points``, one step: every rank's outcome
    (its loss and gradient check, or its error, and the seconds it took)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import SplitPoint, pipeline

    rank, world = dist.get_rank(), dist.get_world_size()
    B, M = x.shape[0], 4
    stages = len(points) + 1
    mine_stages = list(range(rank, stages, world))
    # A group of its own with a short timeout: ranks blocked on a failing peer give up.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.probe_timeout))
    mine: Dict[str, Any] = {"rank": rank}
    t0 = time.perf_counter()
    try:
        split = pipeline(build("unet", PROBE_SIZE), mb_args=(x[:B // M],),
                         split_spec={p: SplitPoint.BEGINNING for p in points})
        built = [split.build_stage(j, torch.device("cpu"), group=group) for j in mine_stages]
        sched = getattr(pipelining, name)(built if stages > world else built[0], M, loss_fn=loss_fn("unet"))
        losses: List[Any] = []
        if 0 in mine_stages:
            sched.step(x)
        elif stages - 1 in mine_stages:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        if losses:
            mine["loss"] = float(torch.stack(losses).mean())
        mine["grad_max_diff"], mine["grad_max"], _ = grad_check(
            [(n, p.grad) for s in built for n, p in s.submod.named_parameters()], ref_grads)
    except Exception as exc:  # noqa: BLE001 - the peer's failure is the result
        mine["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    mine["seconds"] = time.perf_counter() - t0
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered


def run_probe(args: argparse.Namespace) -> Dict[str, Any]:
    """Part 4 on this launch's ranks (:data:`PROBES`): pipedream_ext and torch's schedules,
    one step from the initial weights against the unsplit model, every rank's error."""
    import torch
    import torch.distributed as dist

    import pipedream_ext as pd

    world = dist.get_world_size()
    probe = PROBES[world]
    B, M = 8, 4
    x, y = make_batch("unet", PROBE_SIZE, B, seed=2)
    lossf = loss_fn("unet")
    ref_loss, ref_grads = reference("unet", PROBE_SIZE, x, y, M)
    result: Dict[str, Any] = {"world": world, "size": PROBE_SIZE["label"], "reference_loss": ref_loss,
                              "pd_schedule": probe["pd"], "splits": {}}
    splits = list(probe["splits"].items())[:1 if args.smoke else None]
    for label, points in splits:
        stages = len(points) + 1
        out: Dict[str, Any] = {"split_points": points, "stages": stages}
        result["splits"][label] = out
        pipe = pd.PipeDream(build("unet", PROBE_SIZE), lossf, schedule=probe["pd"], microbatches=M,
                            chunks=stages // world, split_points=points, sample=(x, y), timeout=args.pipe_timeout)
        loss = pipe.step(x, y)
        diff, scale, _ = grad_check([(n, p.grad) for n, p in pipe.named_parameters()], ref_grads)
        t = torch.tensor([diff, scale], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["pipedream_ext"] = {"loss": float(loss), "loss_diff": abs(loss - ref_loss), "grad_max_diff": float(t[0]),
                                "grad_max": float(t[1]), "live": pipe.traced.live}
        out["torch"] = {name: _torch_schedule(name, points, args, x, y, ref_grads)
                        for name in probe["torch"][:1 if args.smoke else None]}
    return result
