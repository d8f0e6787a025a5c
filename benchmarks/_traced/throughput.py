"""Part 3 of benchmarks/traced.py (a worker of a 2-rank launch): six training
configurations of one model, their first step against the unsplit model, then rounds of
steps interleaved step by step."""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .common import (
    CONFIGS,
    LOG,
    SMOKE_THROUGHPUT_SIZES,
    THROUGHPUT_SIZES,
    build,
    config_order,
    grad_check,
    loss_fn,
    make_batch,
    reference,
    sequential_twin,
    split_point,
)

__all__ = ["run_throughput"]

#: What building a configuration gives: its training step, its pipeline (pipedream_ext;
#: None for torch), its first step's loss and (max gradient difference, max gradient,
#: parameters without a gradient) against the unsplit model.
Built = Tuple[Callable[[], None], Optional[Any], float, Tuple[float, float, int]]


@dataclasses.dataclass
class _Setup:
    """One model's launch: its batches, split point, loss and the unsplit model's first step."""

    kind: str
    size: Dict[str, Any]
    batch: int
    microbatches: int
    point: str
    lossf: Callable
    train: Tuple[Any, Any]   # the batch every timed step runs
    check: Tuple[Any, Any]   # the first step's batch, against the unsplit model
    ref_loss: float
    ref_grads: Dict[str, Any]
    rank: int
    world: int

    @classmethod
    def make(cls, args: argparse.Namespace) -> "_Setup":
        import torch.distributed as dist

        kind = args.model
        size = (SMOKE_THROUGHPUT_SIZES if args.smoke else THROUGHPUT_SIZES)[kind]
        B, M = args.batch, args.microbatches
        check = make_batch(kind, size, B, seed=2)
        ref_loss, ref_grads = reference(kind, size, *check, M)
        return cls(kind, size, B, M, split_point(kind, size), loss_fn(kind), make_batch(kind, size, B, seed=1),
                   check, ref_loss, ref_grads, dist.get_rank(), dist.get_world_size())


def _pipedream_config(cfg: str, model: Any, args: argparse.Namespace, s: _Setup, info: Dict[str, Any]) -> Built:
    """pipedream_ext, traced (``split_points``) or the ``nn.Sequential`` twin (``balance``)."""
    import torch

    import pipedream_ext as pd

    (x, y), (cx, cy) = s.train, s.check
    schedule = cfg.rsplit("-", 1)[1]
    t0 = time.perf_counter()
    if cfg.startswith("pd-traced"):
        pipe = pd.PipeDream(model, s.lossf, schedule=schedule, microbatches=s.microbatches, split_points=[s.point],
                            sample=(x, y), timeout=args.pipe_timeout)
        names = {n: n for n, _ in pipe.named_parameters()}
    else:
        original = {id(p): n for n, p in model.named_parameters()}
        twin, balance = sequential_twin(s.kind, model)
        names = {n: original[id(p)] for n, p in twin.named_parameters(remove_duplicate=False)}
        pipe = pd.PipeDream(twin, s.lossf, schedule=schedule, microbatches=s.microbatches, balance=balance,
                            timeout=args.pipe_timeout)
    info["build_s"] = time.perf_counter() - t0
    loss = float(pipe.step(cx, cy))
    check = grad_check([(names[n], p.grad) for n, p in pipe.named_parameters()], s.ref_grads)
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=args.lr) if params else None

    def step() -> None:
        pipe.step(x, y)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    for p in params:
        p.grad = None
    return step, pipe, loss, check


def _torch_config(cfg: str, model: Any, args: argparse.Namespace, s: _Setup, info: Dict[str, Any]) -> Built:
    """torch.distributed.pipelining: ``pipeline()`` + ``build_stage``, Schedule1F1B or ScheduleGPipe."""
    import torch
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    (x, y), (cx, cy) = s.train, s.check
    t0 = time.perf_counter()
    split = pipeline(model, mb_args=(x[:s.batch // s.microbatches],), split_spec={s.point: SplitPoint.BEGINNING})
    stage = split.build_stage(s.rank, torch.device("cpu"))
    cls = Schedule1F1B if cfg.rsplit("-", 1)[1] == "1f1b" else ScheduleGPipe
    sched = cls(stage, s.microbatches, loss_fn=s.lossf)
    info["build_s"] = time.perf_counter() - t0
    losses: List[Any] = []
    if s.rank == 0:
        sched.step(cx)
    else:
        sched.step(target=cy, losses=losses)
    loss = float(torch.stack(losses).mean()) if losses else 0.0
    check = grad_check([(n, p.grad) for n, p in stage.submod.named_parameters(remove_duplicate=False)],
                       s.ref_grads)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=args.lr)

    def step() -> None:
        if s.rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)

    for p in stage.submod.parameters():
        p.grad = None
    return step, None, loss, check


def _first_step_figures(s: _Setup, loss: float, check: Tuple[float, float, int]) -> Dict[str, Any]:
    """Every rank's first-step figures together (the loss is known on the last rank (torch) or all)."""
    import torch
    import torch.distributed as dist

    diff, scale, missing = check
    last = s.rank == s.world - 1
    t = torch.tensor([abs(loss - s.ref_loss) if last else 0.0, diff, scale, float(missing), loss if last else 0.0],
                     dtype=torch.float64)
    dist.all_reduce(t[:4], op=dist.ReduceOp.MAX)
    dist.all_reduce(t[4:], op=dist.ReduceOp.SUM)
    return dict(loss_diff=float(t[0]), grad_max_diff=float(t[1]), grad_max=float(t[2]),
                params_without_grad=int(t[3]), first_loss=float(t[4]))


def _build_configs(args: argparse.Namespace, s: _Setup, result: Dict[str, Any]
                   ) -> Tuple[Dict[str, Callable[[], None]], Dict[str, Any]]:
    """Every configuration of :data:`CONFIGS` on its own copy of the weights, its first step
    checked: the training steps, and the pipedream_ext pipelines (for their ``stats()``)."""
    import torch.distributed as dist

    steps: Dict[str, Callable[[], None]] = {}
    pipes: Dict[str, Any] = {}
    for cfg in CONFIGS:
        info: Dict[str, Any] = {}
        result["configs"][cfg] = info
        model = build(s.kind, s.size)
        dist.barrier()
        try:
            builder = _pipedream_config if cfg.startswith("pd-") else _torch_config
            step, pipe, loss, check = builder(cfg, model, args, s, info)
            if pipe is not None:
                pipes[cfg] = pipe
            info.update(_first_step_figures(s, loss, check))
            steps[cfg] = step
        except Exception as exc:  # recorded for the report, then raised: the launch fails
            LOG.exception("rank %d: %s failed", s.rank, cfg)
            info["error"] = f"rank {s.rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            raise
    return steps, pipes


def _one_round(args: argparse.Namespace, r: int, steps: Dict[str, Callable[[], None]], pipes: Dict[str, Any]
               ) -> Tuple[Any, Any]:
    """Round ``r``: ``--steps`` steps per configuration, interleaved step by step (A B C ...
    then ... C B A), each between two barriers, so that load from other jobs on the machine
    falls on every configuration alike. Returns, per configuration of :data:`CONFIGS`, the
    wall seconds (the slower rank) then pipedream_ext's compute seconds (the busier rank),
    and the CPU seconds of both ranks together (Gloo's threads included)."""
    import torch
    import torch.distributed as dist

    wall = {cfg: 0.0 for cfg in CONFIGS}
    cpu = {cfg: 0.0 for cfg in CONFIGS}
    for pipe in pipes.values():
        pipe.reset_stats()
    for k in range(args.steps):
        for cfg in config_order(r * args.steps + k):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            steps[cfg]()
            dist.barrier()
            wall[cfg] += time.perf_counter() - t0
            cpu[cfg] += time.process_time() - c0
    compute = {cfg: sum(v for kind_, v in pipe.stats()["seconds_by_kind"].items() if kind_ in ("F", "B", "I", "W"))
               for cfg, pipe in pipes.items()}
    t = torch.tensor([wall[c] for c in CONFIGS] + [compute.get(c, 0.0) for c in CONFIGS], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c = torch.tensor([cpu[c] for c in CONFIGS], dtype=torch.float64)
    dist.all_reduce(c)
    return t, c


def run_throughput(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    """One model, 2 ranks: the six configurations, the first-step check, the rounds."""
    s = _Setup.make(args)
    result.update(model=s.kind, size=s.size["label"], batch=s.batch, microbatches=s.microbatches,
                  split_point=s.point, reference_loss=s.ref_loss, configs={})
    steps, pipes = _build_configs(args, s, result)
    for step in steps.values():  # warm-up
        for _ in range(args.warmup):
            step()
    result["loadavg"] = [list(os.getloadavg())]
    for r in range(args.reps):
        t, c = _one_round(args, r, steps, pipes)
        samples = args.steps * s.batch
        for i, cfg in enumerate(CONFIGS):
            info = result["configs"][cfg]
            info.setdefault("samples_per_s", []).append(samples / float(t[i]))
            info.setdefault("cpu_us_per_sample", []).append(float(c[i]) / samples * 1e6)
            if cfg in pipes:
                info.setdefault("compute_ms_per_step", []).append(float(t[len(CONFIGS) + i]) / args.steps * 1e3)
        result["loadavg"].append(list(os.getloadavg()))
        LOG.info("rank %d: round %d done", s.rank, r)
