"""Pipeline x tensor parallelism (pp 2 x tp 2, 4 CPU ranks, Gloo): ours against
torchtitan's composition of torch's own pieces, on one torchtitan-style Llama, in one
launch.

The model (benchmarks/_llama.py): an ``nn.Sequential`` of a token embedding,
``--blocks`` Llama blocks (grouped-query attention with ``--heads`` query and
``--kv-heads`` key/value heads and rotary embeddings, a SwiGLU feed-forward of width
``--hidden``, pre-norm RMSNorms), a final RMSNorm and an untied head; width ``--dim``,
vocabulary ``--vocab``, ``--seq`` tokens; batch ``--batch`` in ``--microbatches``
microbatches, next-token cross-entropy, AdamW. The TP plan is torchtitan's without
sequence parallelism (the embedding row-wise, wq/wk/wv and w1/w3 column-wise, wo and
w2 row-wise, the head column-wise with replicated logits), keys for the Sequential's
module names. Both sides apply it to the same stages of the same model:

* **ours**: ``pd.PipeDream(model, loss, schedule=S, mesh=init_device_mesh("cpu", (2, 1,
  2), ("pp", "dp", "tp")), tensor_parallel=plan)``;
* **torch**: torchtitan's way: each rank cuts its stages out of the model by hand (the
  same cut), ``parallelize_module(stage, mesh["tp"], plan)``, one
  ``torch.distributed.pipelining.PipelineStage`` per stage on ``mesh["pp"]``'s group and
  the matching schedule class (:data:`COMPARISONS`): 1f1b - ``Schedule1F1B``, zb-h1 -
  ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's ZB1P on one chunk:
  the same I/W split, each W right after its I where ours defers W into the bubble;
  torch has no single-stage ZB-H1 class), zbv - ``ScheduleZBVZeroBubble`` (a V: rank
  r holds stages r and 3 - r). 1 chunk: 2 stages (embedding and half the blocks | the
  rest, the norm and the head); zbv: 4 stages (embedding and a quarter of the blocks |
  ... | the last quarter, the norm and the head).

Before timing, each configuration's first step is checked against the unsplit model
(the loss, and every gradient of every parameter on every rank that holds it, gathered
from its shards), so both sides do the same work. Then ``--pairs`` rounds over the
comparisons: per comparison, ``--steps`` steps of torch's configuration and of ours
between barriers, the side that goes first alternating per round (samples/s of the
slowest rank; the 1-minute load average after each); every configuration stays built
for the whole launch, so the load of other work falls on both alike. The ratio is per
pair, ours / torch.

After the rounds, per configuration and rank: the bytes it holds (parameters,
gradients and AdamW state: the sum of its local tensors, a DTensor's local shard), and
one profiled forward-backward step (``torch.profiler`` with ``profile_memory=True`` on
the calling thread, where both sides run their stages, autograd and receive buffers):
the peak of the CPU allocator's bytes above the step's start (activations, transfer
buffers and autograd temporaries; the gradients were allocated before), the
collectives it issued (``c10d::`` ops by name) and their time; ours also its executors'
time blocked on receives (``stats()["seconds_by_kind"]`` RECV_F + RECV_B) over the
timed rounds. Writes ``<out-dir>/vs_torch_tp.md`` and ``vs_torch_tp.json``.

Command, from the repository root (3-4 minutes on 2 cores shared at a load average
of 20-30; ``--smoke``: a tiny model, one pair of one step, 35 s idle):

    python3 benchmarks/vs_torch_tp.py [--pairs 16] [--steps 1] [--smoke]
"""
from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h
from fsdp_2d import tensor_bytes
from memory import cumulative_peak
from vs_torch import summarise
from zero_bubble import placement

__all__ = ["COMPARISONS", "Config", "add_round_args", "balance", "bytes_table", "check_round_args",
           "collective_counts", "collectives_table", "cpu_ms_per_step", "drive", "lm_loss", "main", "measure",
           "named_parameters_of", "parse_args", "report", "run_driver", "run_worker", "same_work", "same_work_lines",
           "speed_table", "timed_rounds"]

JSON_TAG = "VS_TORCH_TP_JSON "
LOG = logging.getLogger("vs_torch_tp")
PP, TP = 2, 2
MIB = float(1 << 20)
# (ours, chunks per rank, torch.distributed.pipelining's class)
COMPARISONS: Tuple[Tuple[str, int, str], ...] = (
    ("1f1b", 1, "Schedule1F1B"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
    ("zbv", 2, "ScheduleZBVZeroBubble"),
)
SMOKE = {"dim": 32, "heads": 4, "kv_heads": 2, "hidden": 64, "vocab": 64, "blocks": 4, "seq": 8, "batch": 4,
         "microbatches": 2, "pairs": 1, "steps": 1, "warmup": 1}


def balance(blocks: int, stages: int) -> List[int]:
    """Layers per stage of the Sequential (embedding, ``blocks`` blocks, norm, head) in
    ``stages`` stages: the blocks split evenly, the embedding with the first stage, the
    norm and the head with the last.

    Raises:
        ValueError: ``blocks`` is not a multiple of ``stages``.
    """
    if blocks % stages:
        raise ValueError(f"--blocks must be a multiple of {stages} (the stages), got {blocks}")
    out = [blocks // stages] * stages
    out[0] += 1
    out[-1] += 2
    return out


def collective_counts(names: Sequence[str]) -> Dict[str, int]:
    """How many times each ``c10d::`` collective (profiler op name, e.g.
    ``c10d::allreduce_``) occurs in ``names``, by name."""
    out: Dict[str, int] = {}
    for name in names:
        if name.startswith("c10d::"):
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def cpu_ms_per_step(rounds: Sequence[Dict[str, Any]], ours: str) -> Dict[str, float]:
    """The median CPU milliseconds per step (all ranks together) of each side of a
    comparison: ``{"ours": ..., "torch": ...}`` (a side without rounds left out).

    Args:
        rounds: ``{"config": "ours zbv" | "torch zbv", "cpu_s": s, "steps": n, ...}``.
    """
    out = {}
    for side in ("ours", "torch"):
        values = [1e3 * r["cpu_s"] / r["steps"] for r in rounds if r["config"] == f"{side} {ours}"]
        if values:
            out[side] = statistics.median(values)
    return out


# ----------------------------------------------------------------------------- worker
def _llama_cfg(args: argparse.Namespace) -> Any:
    import _llama

    return _llama.LlamaConfig(dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, hidden=args.hidden,
                              vocab=args.vocab, blocks=args.blocks, seq=args.seq)


def _model(args: argparse.Namespace) -> Any:
    import _llama

    return _llama.llama(_llama_cfg(args), seed=0)


def _plan(args: argparse.Namespace) -> Dict[str, Any]:
    import _llama

    return _llama.tp_plan(_llama_cfg(args))


def _batch(args: argparse.Namespace) -> Tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Config:
    """One built configuration on this rank: ``forward_backward(loss)`` (a batch's
    forward and backward; with ``loss``, returns the batch loss on every rank), its
    parameters and optimizer."""

    forward_backward: Callable[[bool], float]
    params: List[Any]
    named: List[Tuple[str, Any]]
    opt: Any
    pipe: Any = None  # ours

    def step(self) -> None:
        """One training step; the gradients stay allocated (zeroed), to be counted."""
        self.forward_backward(False)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)


def _ours(args: argparse.Namespace, name: str, chunks: int, mesh: Any, x: Any, y: Any) -> Config:
    import torch

    import pipedream_ext as pd

    pipe = pd.PipeDream(_model(args), lm_loss, schedule=name, microbatches=args.microbatches, chunks=chunks,
                        balance=balance(args.blocks, PP * chunks), mesh=mesh, tensor_parallel=_plan(args),
                        timeout=args.pipe_timeout)
    c = Config()
    c.pipe = pipe
    c.params = list(pipe.parameters())
    named_parameters_of(c, pipe)
    c.opt = torch.optim.AdamW(c.params, lr=args.lr)

    def forward_backward(loss: bool) -> float:
        # step() starts the loss's all-reduce over the ranks; only reading it waits.
        value = pipe.step(x, y)
        return float(value) if loss else 0.0

    c.forward_backward = forward_backward
    return c


def _torch_stage_module(layers: Sequence[Any], start: int, stop: int) -> Any:
    """Layers ``[start, stop)`` as a Sequential keeping the unsplit model's names (``"3"``),
    as torchtitan's pipeline splitting keeps its ``layers.N`` names."""
    from collections import OrderedDict

    from torch import nn

    return nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(start, stop)))


def _torch(args: argparse.Namespace, name: str, chunks: int, cls_name: str, mesh: Any, x: Any, y: Any) -> Config:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.tensor.parallel import parallelize_module

    pp_rank, n = mesh["pp"].get_local_rank(), PP * chunks
    layers = list(_model(args).children())
    bounds = [0]
    for b in balance(args.blocks, n):
        bounds.append(bounds[-1] + b)
    mine = placement(name, pp_rank, PP, chunks)
    plan = _plan(args)
    stages = []
    for j in mine:
        module = _torch_stage_module(layers, bounds[j], bounds[j + 1])
        names = [m for m, _ in module.named_modules()]
        parallelize_module(module, mesh["tp"], {k: v for k, v in plan.items() if fnmatch.filter(names, k)})
        stages.append(pipelining.PipelineStage(module, j, n, torch.device("cpu"), group=mesh["pp"].get_group()))
    cls = getattr(pipelining, cls_name)
    sched = cls(stages if chunks > 1 or cls_name != "Schedule1F1B" else stages[0], args.microbatches,
                loss_fn=lm_loss)

    def forward_backward(loss: bool) -> float:
        losses: List[Any] = []
        sched.step(*((x,) if 0 in mine else ()), **({"target": y, "losses": losses} if n - 1 in mine else {}))
        if not loss:
            return 0.0
        # The tp ranks holding the last stage each have the batch's loss; everyone gets it.
        mean = float(torch.stack([v.detach() for v in losses]).mean()) if losses else 0.0
        value = torch.tensor([mean / TP], dtype=torch.float64)
        dist.all_reduce(value)
        return float(value.item())

    c = Config()
    c.params = [p for s in stages for p in s.submod.parameters()]
    named_parameters_of(c, stages)
    c.opt = torch.optim.AdamW(c.params, lr=args.lr)
    c.forward_backward = forward_backward
    return c


def named_parameters_of(config: Config, pipe_or_stages: Any) -> None:
    """``config.named``: this rank's parameters by their name in the unsplit model."""
    if hasattr(pipe_or_stages, "named_parameters"):
        config.named = list(pipe_or_stages.named_parameters())
    else:
        config.named = [nm for s in pipe_or_stages for nm in s.submod.named_parameters()]


def _reference(args: argparse.Namespace, x: Any, y: Any) -> Tuple[float, Dict[str, Any]]:
    """The unsplit model's loss and gradients by name."""
    model = _model(args)
    loss = lm_loss(model(x), y)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def same_work(config: Config, ref_loss: float, ref_grads: Dict[str, Any]) -> Dict[str, Any]:
    """The first step's loss and every gradient (gathered from its tp shards) against the
    unsplit model's, the largest difference over the ranks; the gradients are dropped
    after, so that both sides go on from the same weights."""
    import torch
    import torch.distributed as dist

    loss = config.forward_backward(True)
    diff, names = 0.0, []
    for name, p in config.named:
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        diff = max(diff, float((grad - ref_grads[name]).abs().max()))
        names.append(name)
    t = torch.tensor([diff, abs(loss - ref_loss)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    covered = {n for rank_names in h.all_gather_json(names) for n in rank_names}
    config.opt.zero_grad(set_to_none=True)
    return {"loss": loss, "unsplit_loss": ref_loss, "loss_diff": float(t[1]), "grad_max_abs_diff": float(t[0]),
            "grad_max_abs": max(float(g.abs().max()) for g in ref_grads.values()),
            "params_compared": len(covered), "params": len(ref_grads)}


def _build_one(args: argparse.Namespace, side: str, comparison: Tuple[str, int, str], mesh: Any, x: Any, y: Any,
               reference: Tuple[float, Dict[str, Any]]) -> Tuple[Config, Dict[str, Any]]:
    """One configuration, checked against the unsplit model and warmed up."""
    ours, chunks, cls_name = comparison
    if side == "torch":
        config = _torch(args, ours, chunks, cls_name, mesh, x, y)
    else:
        config = _ours(args, ours, chunks, mesh, x, y)
    same = same_work(config, *reference)
    for _ in range(args.warmup - 1):
        config.step()
    if config.pipe is not None:
        config.pipe.reset_stats()
    return config, same


def _build(args: argparse.Namespace, mesh: Any, x: Any, y: Any, result: Dict[str, Any]) -> Dict[str, Config]:
    """Every configuration (torch's, then ours, per comparison); a failing one is
    recorded and left out (every rank agrees on which run)."""
    import torch
    import torch.distributed as dist

    reference = _reference(args, x, y)
    configs: Dict[str, Config] = {}
    for comparison in COMPARISONS:
        if comparison[0] not in args.schedules:
            continue
        for side in ("torch", "ours"):
            key = f"{side} {comparison[0]}"
            entry = result["configs"].setdefault(key, {"class": comparison[2] if side == "torch" else comparison[0]})
            try:
                configs[key], entry["same_work"] = _build_one(args, side, comparison, mesh, x, y, reference)
            except Exception as exc:  # a failing configuration is a result
                entry["error"] = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
                LOG.exception("%s failed", key)
            ok = torch.tensor([float(key in configs)])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item() and configs.pop(key, None) is not None:
                entry.setdefault("error", "another rank failed (its error is in its log)")
    return configs


def _cpu_seconds() -> float:
    """This process's CPU time, every thread (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_round(args: argparse.Namespace, config: Config) -> Tuple[float, float]:
    """``--steps`` training steps between two barriers: the slowest rank's seconds and
    the CPU seconds of all ranks together (less moved by other work's load than the
    wall time: a rank that waits for the CPU does not count it)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu_seconds()
    for _ in range(args.steps):
        config.step()
    dist.barrier()
    wall, cpu = (torch.tensor([v], dtype=torch.float64) for v in (time.perf_counter() - t0, _cpu_seconds() - c0))
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall.item()), float(cpu.item())


def _profiled_step(config: Config) -> Dict[str, Any]:
    """One forward-backward under ``torch.profiler`` (CPU, memory): the allocator's peak
    above the step's start, the collectives by name and their milliseconds on this
    rank's calling thread."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        config.forward_backward(False)
    events = list(prof.profiler.kineto_results.events())
    peak, _ = cumulative_peak((e.start_ns(), e.nbytes()) for e in events
                              if e.name() == "[memory]" and e.device_type().name == "CPU")
    config.opt.zero_grad(set_to_none=False)
    return {"step_peak": peak, "collectives": collective_counts([e.name() for e in events]),
            "collective_ms": sum(e.duration_ns() for e in events if "c10d" in e.name()) / 1e6}


def _held(config: Config) -> Dict[str, int]:
    """The bytes of this rank's parameters, gradients and AdamW state (local shards)."""
    import torch

    state = [t for s in config.opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"params": tensor_bytes(config.params), "grads": tensor_bytes(p.grad for p in config.params),
            "optim": tensor_bytes(state)}


def timed_rounds(args: argparse.Namespace, configs: Dict[str, Config], result: Dict[str, Any],
            comparisons: Sequence[Tuple[str, int, str]] = COMPARISONS) -> None:
    """``--pairs`` rounds; per comparison both sides' ``--steps`` steps, the first side
    alternating per round."""
    for pair in range(args.pairs):
        for ours, _chunks, _cls in comparisons:
            sides = ("torch", "ours") if pair % 2 == 0 else ("ours", "torch")
            for key in (f"{side} {ours}" for side in sides):
                if key not in configs:
                    continue
                seconds, cpu = _timed_round(args, configs[key])
                result["rounds"].append({"pair": pair, "config": key, "seconds": seconds, "cpu_s": cpu,
                                         "steps": args.steps,
                                         "samples_per_s": args.steps * args.batch / seconds,
                                         "loadavg_1min": os.getloadavg()[0]})


def measure(args: argparse.Namespace, configs: Dict[str, Config], result: Dict[str, Any]) -> None:
    """Per configuration: every rank's bytes held and profiled step; ours' receive waits."""
    for key, config in configs.items():
        entry = result["configs"][key]
        if config.pipe is not None:
            by_kind = config.pipe.stats()["seconds_by_kind"]
            waited = h.all_gather_json(by_kind.get("RECV_F", 0.0) + by_kind.get("RECV_B", 0.0))
            entry["recv_wait_ms_per_step"] = 1e3 * sum(waited) / max(1, args.pairs * args.steps)
        entry["ranks"] = h.all_gather_json({**_held(config), **_profiled_step(config)})


def run_worker(args: argparse.Namespace) -> int:
    """Every rank: every configuration, the interleaved rounds, the bytes and profiles."""
    def body(result: Dict[str, Any]) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != PP * TP:
            raise ValueError(f"vs_torch_tp.py runs on {PP * TP} ranks (pp {PP} x tp {TP}), "
                             f"not {dist.get_world_size()}")
        mesh = init_device_mesh("cpu", (PP, 1, TP), mesh_dim_names=("pp", "dp", "tp"))
        x, y = _batch(args)
        result.update(rounds=[], configs={}, loadavg_start=list(os.getloadavg()))
        configs = _build(args, mesh, x, y, result)
        timed_rounds(args, configs, result)
        result["loadavg_end"] = list(os.getloadavg())
        measure(args, configs, result)
        for config in configs.values():
            if config.pipe is not None:
                config.pipe.close()

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- report
def _fmt_range(s: Dict[str, float], digits: int = 0) -> str:
    return "n/a" if not s else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def speed_table(result: Dict[str, Any], comparisons: Sequence[Tuple[str, int, str]] = COMPARISONS
                 ) -> Tuple[List[str], Dict[str, Any]]:
    summaries: Dict[str, Any] = {}
    rows = []
    for ours, _chunks, cls_name in comparisons:
        entries = [result["configs"].get(f"{side} {ours}", {}) for side in ("ours", "torch")]
        if not any(entries):
            continue
        s = summarise(result["rounds"], ours)
        summaries[ours] = s
        errors = "; ".join(e["error"] for e in entries if "error" in e)
        s["cpu_ms_per_step"] = cpu_ms_per_step(result["rounds"], ours)
        wait = entries[0].get("recv_wait_ms_per_step")
        cpu = s["cpu_ms_per_step"]
        rows.append([ours, cls_name, _fmt_range(s["ms_per_step"]["ours"]), _fmt_range(s["ms_per_step"]["torch"]),
                     _fmt_range(s["ours"], 1), _fmt_range(s["torch"], 1), _fmt_range(s["ratio"], 2),
                     f"{s['ours_ahead']} of {len(s['ratios'])}",
                     *(h.fmt(cpu.get(side), 0) for side in ("ours", "torch")),
                     "n/a" if wait is None else f"{wait:.0f}", errors])
    return h.table(["ours", "torch", "ours ms/step, median [min-max]", "torch ms/step", "ours samples/s",
                    "torch samples/s", "ratio ours / torch per pair, median [min-max]", "pairs ours ahead",
                    "ours CPU ms per step (4 ranks), median", "torch CPU ms per step",
                    "ours blocked on receives, ms per step (4 ranks)", "errors"], rows), summaries


def bytes_table(result: Dict[str, Any], comparisons: Sequence[Tuple[str, int, str]] = COMPARISONS) -> List[str]:
    rows = []
    for ours, _chunks, _cls in comparisons:
        sides = [result["configs"].get(f"{side} {ours}", {}).get("ranks") for side in ("ours", "torch")]
        if not all(sides):
            continue
        for rank, (mine, theirs) in enumerate(zip(*sides)):
            held = [r["params"] + r["grads"] + r["optim"] for r in (mine, theirs)]
            rows.append([ours, rank, f"{mine['params'] / MIB:.2f}", f"{mine['grads'] / MIB:.2f}",
                         f"{mine['optim'] / MIB:.2f}", f"{held[0] / MIB:.2f}", f"{held[1] / MIB:.2f}",
                         f"{held[0] / held[1]:.2f}x" if held[1] else "n/a",
                         f"{mine['step_peak'] / MIB:.2f}", f"{theirs['step_peak'] / MIB:.2f}",
                         f"{mine['step_peak'] / theirs['step_peak']:.2f}x" if theirs["step_peak"] else "n/a"])
    return h.table(["schedule", "rank", "ours params MiB", "ours grads MiB", "ours AdamW MiB", "ours held MiB",
                    "torch held MiB", "held ours / torch", "ours step peak MiB", "torch step peak MiB",
                    "peak ours / torch"], rows)


def collectives_table(result: Dict[str, Any], comparisons: Sequence[Tuple[str, int, str]] = COMPARISONS
                       ) -> List[str]:
    rows = []
    for ours, _chunks, _cls in comparisons:
        for side in ("ours", "torch"):
            ranks = result["configs"].get(f"{side} {ours}", {}).get("ranks")
            for rank, r in enumerate(ranks or []):
                counts = ", ".join(f"{name.split('::')[-1]} {n}" for name, n in r["collectives"].items())
                rows.append([ours, side, rank, counts or "none", f"{r['collective_ms']:.1f}"])
    return h.table(["schedule", "side", "rank", "collectives in one step (profiler op: count)",
                    "their ms on the calling thread"], rows)


def same_work_lines(result: Dict[str, Any]) -> List[str]:
    rows = []
    for key, entry in result["configs"].items():
        sw = entry.get("same_work")
        if sw is None:
            rows.append([key, "n/a", "", "", "", entry.get("error", "")])
            continue
        rows.append([key, f"{sw['loss']:.6f}", f"{sw['unsplit_loss']:.6f}", f"{sw['loss_diff']:.1e}",
                     f"{sw['grad_max_abs_diff']:.1e} (of {sw['grad_max_abs']:.1e})",
                     f"{sw['params_compared']} of {sw['params']}"])
    return h.table(["configuration", "first-step loss", "unsplit loss", "|difference|",
                    "max abs gradient difference (largest gradient)", "parameters compared"], rows)


def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> Tuple[str, Dict[str, Any]]:
    """The Markdown report and the summary figures of one run.

    Args:
        result: rank 0's JSON (rounds, configs with every rank's bytes and profile).
        info: :func:`_harness.machine_info`.
        command: the command line.
        args: the options (model, batch, rounds).
        total_s: the run's seconds.

    Returns:
        ``(text, {"comparisons": {ours: summarise(...)}})``.
    """
    speed, summaries = speed_table(result)
    lines = [f"# pp {PP} x tp {TP}: ours against torch's pieces composed torchtitan's way", "",
             f"Model: a torchtitan-style Llama (benchmarks/_llama.py): {args.blocks} blocks of width {args.dim}, "
             f"{args.heads} query and {args.kv_heads} key/value heads (GQA, rotary), SwiGLU {args.hidden}, "
             f"RMSNorm, untied head, vocabulary {args.vocab}; batch {args.batch} x {args.seq} tokens in "
             f"{args.microbatches} microbatches, cross-entropy, AdamW lr={args.lr}; torchtitan's TP plan without "
             f"SP (embedding row-wise, attention and SwiGLU column/row-wise, head column-wise, replicated "
             f"logits). 4 Gloo ranks, mesh (pp {PP}, dp 1, tp {TP}); 1 chunk: stages "
             f"{balance(args.blocks, PP)} (layers), zbv: {balance(args.blocks, 2 * PP)} in a V; the same cut "
             f"for both. {args.pairs} rounds, per comparison {args.steps} steps of each side between barriers "
             f"(the side going first alternating), after {args.warmup} warm-up steps (the first checks the "
             "loss and every gradient against the unsplit model).", ""] + speed
    loads = [r["loadavg_1min"] for r in result["rounds"]]
    if loads:
        lines += ["", f"Load average (1 min) over the rounds: {min(loads):.2f}-{max(loads):.2f} (start "
                  f"{' '.join(f'{v:.2f}' for v in result['loadavg_start'])}, end "
                  f"{' '.join(f'{v:.2f}' for v in result.get('loadavg_end', []))})."]
    lines += ["", "Bytes per rank after the rounds: parameters, gradients and AdamW state (local shards); "
              "torch's held bytes beside ours. Step peak: one forward-backward under torch.profiler "
              "(`profile_memory=True`, the calling thread): the CPU allocator's peak above the step's start "
              "(activations, transfer buffers, autograd temporaries; the gradients were allocated before).",
              ""] + bytes_table(result)
    lines += ["", "Collectives of that profiled step, per rank: the c10d ops the calling thread issued "
              "(both sides' pipeline transfers are `send`/`recv_`; TP's are `allreduce_` and, for the "
              "head's replicated logits, `allgather_into_tensor_coalesced_`), and their time on that "
              "thread, waits for the peers included (under the profiler):", ""] + collectives_table(result)
    lines += ["", "Same work: each configuration's first step against the unsplit model:", ""]
    lines += same_work_lines(result)
    lines += ["", h.machine_line(info), "", h.command_sentence(command, total_s, {PP * TP: result["launch_s"]}), ""]
    return "\n".join(lines), {"comparisons": summaries}


def drive(args: argparse.Namespace, script: Path, name: str, world: int, tag: str, model_args: Sequence[str],
          report_fn: Callable[..., Tuple[str, Dict[str, Any]]], log: logging.Logger) -> int:
    """A comparison script's driver: its one launch of ``world`` ranks (forwarding the
    rounds' options and ``model_args``), then ``<out-dir>/<name>.md`` and ``.json`` from
    ``report_fn`` (:func:`report`'s signature); non-zero when the launch or a
    configuration failed."""
    info, command = h.start_report(log)
    start = time.perf_counter()
    worker_args = ["--worker"] + h.forward(args, "pairs", "steps", "warmup", "batch", *model_args, "seq",
                                           "microbatches", "lr", "pipe_timeout", "schedules")
    result = h.launch_torchrun(script, world, worker_args, tag, timeout=args.timeout)
    if h.launch_failed(result) or "rounds" not in result:
        log.error("the launch failed: %s", result.get("error"))
        return 1
    text, summary = report_fn(result, info, command, args, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), name, text,
                    {"machine": info, "command": command, "args": h.run_options(args), "result": result,
                     "summary": summary})
    failed = "error" in result or any("error" in e for e in result["configs"].values())
    if failed:
        log.error("%s", result.get("error") or "a configuration failed (see the report)")
    return 1 if failed else 0


def run_driver(args: argparse.Namespace) -> int:
    """The one 4-rank launch, then ``<out-dir>/vs_torch_tp.md`` and ``.json``."""
    return drive(args, Path(__file__).resolve(), "vs_torch_tp", PP * TP, JSON_TAG,
                 ["dim", "heads", "kv_heads", "hidden", "vocab", "blocks"], report, LOG)


def add_round_args(p: argparse.ArgumentParser, comparisons: Sequence[Tuple[str, int, str]], pairs: int,
                   batch: int, batch_help: Optional[str] = None) -> None:
    """A comparison script's options for the rounds, the launch and the batch (its model's
    are its own)."""
    p.add_argument("--pairs", type=int, default=pairs, help="rounds over every comparison")
    p.add_argument("--steps", type=int, default=1, help="steps per side per round")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (the first checks the same work)")
    p.add_argument("--batch", type=int, default=batch, help=batch_help)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedules", type=lambda s: s.split(","), default=[c for c, _, _ in comparisons],
                   help="ours of each comparison to run (comma-separated; default: all)")
    p.add_argument("--pipe-timeout", type=float, default=120.0, help="seconds any wait on another rank may take")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole launch")
    p.add_argument("--smoke", action="store_true", help="a tiny model, one pair of one step: checks that it runs")


def check_round_args(p: argparse.ArgumentParser, args: argparse.Namespace,
                     comparisons: Sequence[Tuple[str, int, str]], smoke: Dict[str, Any]) -> None:
    """``--smoke``'s sizes applied, then the schedules and step counts checked (``p.error``)."""
    h.apply_smoke(args, smoke)
    unknown = set(args.schedules) - {c for c, _, _ in comparisons}
    if unknown:
        p.error(f"unknown schedules {sorted(unknown)}; known: {[c for c, _, _ in comparisons]}")
    h.check_step_args(p, args)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--worker`` under torchrun)."""
    p = h.make_parser(__doc__, worker=True)
    add_round_args(p, COMPARISONS, pairs=16, batch=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8, help="query heads (a multiple of tp and of --kv-heads)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (a multiple of tp)")
    p.add_argument("--hidden", type=int, default=768, help="SwiGLU width (a multiple of tp)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary (a multiple of tp)")
    p.add_argument("--blocks", type=int, default=4, help="Llama blocks (a multiple of 4: the V's 4 stages)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    args = p.parse_args(argv)
    check_round_args(p, args, COMPARISONS, SMOKE)
    if args.blocks % 4:
        p.error(f"--blocks {args.blocks} must be a multiple of 4 (4 stages at block boundaries for zbv)")
    if args.heads % args.kv_heads or any(v % TP for v in (args.heads, args.kv_heads, args.hidden, args.vocab)) \
            or args.dim % args.heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}, both and --hidden "
                f"{args.hidden} and --vocab {args.vocab} multiples of tp {TP}, and --dim {args.dim} a multiple "
                "of --heads")
    return args


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
