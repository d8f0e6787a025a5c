"""Every flush schedule of ours against its torch.distributed.pipelining counterpart, on
the GPT that examples and benchmarks share (CPU, Gloo, 2 ranks, one launch).

The model: examples/models.py's ``gpt_sequential`` (token and position embedding,
``--blocks`` pre-norm blocks of width ``--width`` with ``--heads`` heads, a final
LayerNorm, a head tied to the token embedding), context ``--context``, byte vocabulary;
batch ``--batch`` in ``--microbatches`` microbatches, next-token cross-entropy, SGD. The
1-chunk schedules cut it in 2 stages (the embedding and half the blocks; the rest,
LayerNorm and head), the 2-chunk ones in 4 (2 ranks x 2 chunks at block boundaries),
the same boundaries for ours and torch's. Each pair (:data:`COMPARISONS`):

* gpipe - ``ScheduleGPipe``; 1f1b - ``Schedule1F1B``; interleaved-1f1b -
  ``ScheduleInterleaved1F1B`` (2 chunks, round robin);
* zb-h1 - ``ScheduleInterleavedZeroBubble`` with one stage per rank: torch's ZB1P on
  one chunk, the same work split the same way (input backward I, weight backward W),
  torch has no single-stage class for ZB-H1. The orders differ in where W goes: torch
  runs each W right after its I where ours defers W into the bubble (ZB-H1 as in the
  paper; rank 0 of 2, M = 8: ours ``F0 F1 I0 F2 I1 W0 ...``, torch's ``F0 F1 I0 W0 F2
  I1 W1 ...``); the comparison is of two zero-bubble 1-chunk schedules, not of one order;
* zbv - ``ScheduleZBVZeroBubble``, dualpipev - ``ScheduleDualPipeV`` (a V: rank r
  holds stages r and 3 - r), interleaved-zb - ``ScheduleInterleavedZeroBubble``
  (2 chunks, round robin).

Torch's stages are built by hand, one ``PipelineStage`` per chunk on the rank its
placement gives it. The tied weight: where the embedding and the head are on one rank
(the V) both stages hold one parameter and its gradient accumulates; where they are on
two ranks ours all-reduces the two copies' gradients inside ``step`` and torch's runner
here does the same after ``step`` (one all-reduce on the pipeline's group), so both do
the same work. Before timing, each configuration's first step is checked against the
unsplit model (loss and every gradient, by every name of every parameter).

Then ``--pairs`` rounds over all comparisons: in each round, per comparison, torch's
configuration runs ``--steps`` steps between two barriers, then ours (samples/s of the
slower rank, the 1-minute load average after each); the ratio is per pair, ours /
torch. Every configuration has its own Gloo group and stays built for the whole run, so
the load of other jobs falls on all of them alike. Ours records its trace during the
timed rounds: the report gives the time its executors were blocked on receives
(``stats()["seconds_by_kind"]`` RECV_F + RECV_B, both ranks, per step) and counts the
receive waits a later message released (``pipedream_ext.diagnostics.late_receive_waits``),
per 8 steps.

``--protocol`` forces our point-to-point protocol (``PIPEDREAM_P2P_PROTOCOL``: fused,
the default on Gloo, or split). Writes ``<out-dir>/vs_torch.md`` and ``vs_torch.json``.
``--device cuda:0`` puts every rank's stages on one GPU, ``--world 1`` runs the
multi-chunk schedules with every stage on one rank (interleaved: 4 chunks; the V: 2), on
``cpu:gloo,cuda:nccl`` with CUDA (``make gpu-check`` runs both; torch's stages on Gloo
with CUDA tensors may be refused by Gloo: that is reported as the configuration's error).
On CUDA the report adds our host synchronisations per transfer (``stats()["host_syncs"]``
over ``sends``). Command, from the repository root (6-10 minutes on 2 shared cores;
``--smoke``: a tiny GPT, one pair of one step, about 30 s):

    python3 benchmarks/vs_torch.py [--pairs 16] [--steps 2] [--protocol split] [--smoke]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h
from zero_bubble import placement, ratio_stats

__all__ = ["COMPARISONS", "balance", "main", "parse_args", "report", "run_driver", "run_worker", "summarise"]

JSON_TAG = "VS_TORCH_JSON "
LOG = logging.getLogger("vs_torch")
# (ours, chunks per rank, torch.distributed.pipelining's class)
COMPARISONS: Tuple[Tuple[str, int, str], ...] = (
    ("gpipe", 1, "ScheduleGPipe"),
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
    ("zbv", 2, "ScheduleZBVZeroBubble"),
    ("dualpipev", 2, "ScheduleDualPipeV"),
    ("interleaved-zb", 2, "ScheduleInterleavedZeroBubble"),
)
SMOKE = {"blocks": 4, "width": 16, "heads": 2, "context": 8, "batch": 8, "pairs": 1, "steps": 1, "warmup": 1}
PROTOCOL_ENV = "PIPEDREAM_P2P_PROTOCOL"


def balance(blocks: int, stages: int) -> List[int]:
    """Layers per stage of ``gpt_sequential(blocks)`` (embedding, ``blocks`` blocks,
    LayerNorm, head, flatten) in ``stages`` stages: the blocks split evenly, the embedding
    with the first stage, LayerNorm, head and flatten with the last.

    Raises:
        ValueError: ``blocks`` is not a multiple of ``stages``.
    """
    if blocks % stages:
        raise ValueError(f"--blocks must be a multiple of {stages} (the stages), got {blocks}")
    per = blocks // stages
    out = [per] * stages
    out[0] += 1
    out[-1] += 3
    return out


def summarise(rounds: Sequence[Dict[str, Any]], ours: str) -> Dict[str, Any]:
    """Samples/s of ours and torch's side of one comparison and the per-pair ratio.

    Args:
        rounds: ``{"pair": k, "config": "ours zbv" | "torch zbv", "samples_per_s": v,
            "seconds": s, "steps": n}`` in run order.
    """
    torch_rounds = [r for r in rounds if r["config"] == f"torch {ours}"]
    our_rounds = [r for r in rounds if r["config"] == f"ours {ours}"]
    ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(torch_rounds, our_rounds)
              if a["samples_per_s"] > 0]
    ms = {side: ratio_stats([1e3 * r["seconds"] / r["steps"] for r in rs])
          for side, rs in (("ours", our_rounds), ("torch", torch_rounds))}
    return {"ours": ratio_stats([r["samples_per_s"] for r in our_rounds]),
            "torch": ratio_stats([r["samples_per_s"] for r in torch_rounds]),
            "ms_per_step": ms, "ratio": ratio_stats(ratios), "ratios": ratios,
            "ours_ahead": sum(r > 1 for r in ratios)}


# ----------------------------------------------------------------------------- worker
def _model(args: argparse.Namespace) -> Any:
    import torch

    torch.manual_seed(0)
    return h.models().gpt_sequential(args.blocks, args.width, args.heads, args.context).to(args.device)


def _batch(args: argparse.Namespace) -> Tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, h.models().VOCAB, (args.batch, args.context + 1), generator=g).to(args.device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def chunks_for(ours: str, world: int) -> int:
    """Chunks per rank of ``ours`` on ``world`` ranks: 1 for the 1-chunk schedules, 2 for
    the V (zbv, dualpipev: exactly 2), and round robin so that there are 4 stages; 0 where
    the comparison does not run (a 1-chunk schedule on 1 rank has no pipeline)."""
    from pipedream_ext import schedules

    traits = schedules.traits(ours)
    if not traits.multi_chunk:
        return 1 if world > 1 else 0
    return 2 if ours in ("zbv", "dualpipev") else 4 // world


def _loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits, targets.reshape(-1))


class _Config:
    """One built configuration on this rank: ``step()`` (a batch and the optimizer step)
    and ``first_step()`` (the batch loss and this rank's gradients by every name)."""

    step: Callable[[], None]
    first_step: Callable[[], Tuple[float, Dict[str, Any]]]
    pipe: Any = None  # ours


def _ours(args: argparse.Namespace, name: str, chunks: int, group: Any, x: Any, y: Any, trace: str) -> _Config:
    import torch

    import pipedream_ext as pd

    pipe = pd.PipeDream(_model(args), _loss, schedule=name, microbatches=args.microbatches, chunks=chunks,
                        balance=balance(args.blocks, args.world * chunks), process_group=group,
                        timeout=args.pipe_timeout, trace=trace, device=args.device)
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    c = _Config()
    c.pipe = pipe

    def step() -> None:
        pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def first_step() -> Tuple[float, Dict[str, Any]]:
        loss = pipe.step(x, y)
        grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
        opt.zero_grad(set_to_none=True)  # the same weights for the warm-up and timing as torch's
        return float(loss), grads

    c.step, c.first_step = step, first_step
    return c


def _torch(args: argparse.Namespace, name: str, chunks: int, cls_name: str, group: Any, x: Any, y: Any) -> _Config:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = world * chunks
    model = _model(args)
    layers = list(model.children())
    bounds = [0]
    for b in balance(args.blocks, n):
        bounds.append(bounds[-1] + b)
    mine = placement(name, rank, world, chunks)
    stages = [pipelining.PipelineStage(torch.nn.Sequential(*layers[bounds[j]:bounds[j + 1]]), j, n,
                                       torch.device(args.device), group=group) for j in mine]
    cls = getattr(pipelining, cls_name)
    # scale_grads=False: torch divides each stage's gradients by M, twice for a weight two
    # local stages share (the V's tied embedding and head); divided here once per weight.
    sched = cls(stages if cls_name not in ("ScheduleGPipe", "Schedule1F1B") else stages[0], args.microbatches,
                loss_fn=_loss, scale_grads=False)
    params = list({id(p): p for s in stages for p in s.submod.parameters()}.values())
    names: Dict[int, List[str]] = {}
    for full_name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(full_name)
    tied = layers[0].tok.weight  # the head's weight too
    # Embedding (stage 0) and head (stage n - 1) on two ranks: two copies of the weight.
    holder = {j: r for r in range(world) for j in placement(name, r, world, chunks)}
    split_tie = holder[0] != holder[n - 1]
    opt = torch.optim.SGD(params, lr=args.lr)

    def run() -> List[Any]:
        losses: List[Any] = []
        sched.step(*((x,) if 0 in mine else ()), **({"target": y, "losses": losses} if n - 1 in mine else {}))
        if split_tie:
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=group)
        for p in params:
            if p.grad is not None:
                p.grad.div_(args.microbatches)
        return losses

    def step() -> None:
        run()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def first_step() -> Tuple[float, Dict[str, Any]]:
        losses = run()
        mean = float(torch.stack([l.detach() for l in losses]).mean()) if losses else 0.0
        value = torch.tensor([mean], dtype=torch.float64)
        dist.all_reduce(value, group=group)  # one rank holds the last stage
        grads = {nm: p.grad.detach().clone() for p in params if p.grad is not None for nm in names[id(p)]}
        opt.zero_grad(set_to_none=True)
        return float(value.item()), grads

    c = _Config()
    c.step, c.first_step = step, first_step
    return c


def _same_work(config: _Config, ref_loss: float, ref_grads: Dict[str, Any], canonical: Dict[str, str],
               group: Any) -> Dict[str, Any]:
    """The first step's loss and gradients against the unsplit model's (max over ranks);
    ``canonical`` names each parameter by its first name (the tied weight has two)."""
    import torch
    import torch.distributed as dist

    loss, grads = config.first_step()
    diff = max((float((g - ref_grads[n]).abs().max()) for n, g in grads.items() if n in ref_grads),
               default=float("inf"))
    t = torch.tensor([diff, abs(loss - ref_loss)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    names = [n for n in grads if n in ref_grads]
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, names, group=group)
    covered = {canonical[n] for names_of_rank in gathered for n in names_of_rank}
    return {"loss": loss, "unsplit_loss": ref_loss, "loss_diff": float(t[1]), "grad_max_abs_diff": float(t[0]),
            "grad_max_abs": max(float(g.abs().max()) for g in ref_grads.values()),
            "params_compared": len(covered), "params": len(set(canonical.values()))}


def _reference(args: argparse.Namespace, x: Any, y: Any) -> Tuple[float, Dict[str, Any], Dict[str, str]]:
    """The unsplit model's loss and gradients by every name of every parameter, and each
    name's canonical one (the first of its parameter)."""
    model = _model(args)
    loss = _loss(model(x), y)
    loss.backward()
    first: Dict[int, str] = {}
    canonical = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return float(loss), grads, canonical


def _build(args: argparse.Namespace, x: Any, y: Any, trace_dir: str, result: Dict[str, Any]) -> Dict[str, _Config]:
    """Every configuration (torch's, then ours, per comparison), checked against the
    unsplit model and warmed up; a failing one is recorded and left out."""
    import datetime

    import torch
    import torch.distributed as dist

    ref_loss, ref_grads, canonical = _reference(args, x, y)
    timeout = datetime.timedelta(seconds=args.pipe_timeout)
    configs: Dict[str, _Config] = {}
    for ours, _, cls_name in COMPARISONS:
        chunks = chunks_for(ours, args.world)
        if ours not in args.schedules or not chunks:
            continue
        for side in ("torch", "ours"):
            key = f"{side} {ours}"
            group = dist.new_group(list(range(args.world)), timeout=timeout)
            entry = result["configs"].setdefault(key, {"class": cls_name if side == "torch" else ours})
            try:
                config = (_torch(args, ours, chunks, cls_name, group, x, y) if side == "torch"
                          else _ours(args, ours, chunks, group, x, y, os.path.join(trace_dir, f"{ours}.json")))
                entry["same_work"] = _same_work(config, ref_loss, ref_grads, canonical, group)
                for _ in range(args.warmup - 1):
                    config.step()
                if config.pipe is not None:
                    config.pipe.write_trace(os.path.join(trace_dir, "warmup.json"))  # drops the warm-up's spans
                    config.pipe.reset_stats()
                configs[key] = config
            except Exception as exc:  # a failing configuration is a result
                entry["error"] = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
                LOG.exception("%s failed", key)
            ok = torch.tensor([float(key in configs)])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # both ranks agree on whether it runs
            if not ok.item() and configs.pop(key, None) is not None:
                entry.setdefault("error", "the peer rank failed (its error is in its log)")
    return configs


def _timed_round(args: argparse.Namespace, config: _Config) -> float:
    """``--steps`` steps between two barriers: the slower rank's seconds."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        config.step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_worker(args: argparse.Namespace) -> int:
    """Both ranks: every configuration, then the interleaved rounds; rank 0 reports."""
    def body(result: Dict[str, Any]) -> None:
        import torch.distributed as dist

        import pipedream_ext.diagnostics as pdd

        if dist.get_world_size() != args.world:
            raise ValueError(f"vs_torch.py --world {args.world} runs on {args.world} ranks, "
                             f"not {dist.get_world_size()}")
        x, y = _batch(args)
        result.update(rounds=[], configs={}, loadavg_start=list(os.getloadavg()),
                      protocol=os.environ.get(PROTOCOL_ENV) or "default")
        with tempfile.TemporaryDirectory(prefix="vs_torch-") as trace_dir:
            configs = _build(args, x, y, trace_dir, result)
            for pair in range(args.pairs):
                for ours, _chunks, _cls in COMPARISONS:
                    for key in (f"torch {ours}", f"ours {ours}"):
                        if key not in configs:
                            continue
                        seconds = _timed_round(args, configs[key])
                        result["rounds"].append({"pair": pair, "config": key, "seconds": seconds, "steps": args.steps,
                                                 "samples_per_s": args.steps * args.batch / seconds,
                                                 "loadavg_1min": os.getloadavg()[0]})
            for key, config in configs.items():
                if config.pipe is None:
                    continue
                stats = config.pipe.stats()
                by_kind = stats["seconds_by_kind"]
                result["configs"][key]["transfers"] = h.all_gather_json(
                    {"sends": stats["sends"], "host_syncs": stats["host_syncs"]})
                waited = h.all_gather_json(by_kind.get("RECV_F", 0.0) + by_kind.get("RECV_B", 0.0))
                result["configs"][key]["recv_wait_ms_per_step"] = 1e3 * sum(waited) / (args.pairs * args.steps)
                written = config.pipe.write_trace(os.path.join(trace_dir, "timed.json"))
                if written is not None:
                    late = pdd.late_receive_waits(written)
                    result["configs"][key]["late_waits"] = len(late)
                    result["configs"][key]["late_examples"] = [
                        f"rank {w.rank} {w.wait} waited {w.wait_us / 1e3:.1f} ms for {w.sent}, sent "
                        f"{w.sent_before_us / 1e3:.1f} ms before, until {w.ended_after_us / 1e3:.1f} ms after "
                        f"rank {w.peer} began {w.released_after}" for w in late[:3]]
                    result["configs"][key]["late_ended_after_ms"] = [w.ended_after_us / 1e3 for w in late]
                    result["configs"][key]["timed_steps"] = args.pairs * args.steps
        result["loadavg_end"] = list(os.getloadavg())

    return h.worker(JSON_TAG, body, backend=args.backend)


# ----------------------------------------------------------------------------- report
def _fmt_range(s: Dict[str, float], digits: int = 0) -> str:
    if not s:
        return "n/a"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _recv_wait(entry: Dict[str, Any]) -> str:
    value = entry.get("recv_wait_ms_per_step")
    return "n/a" if value is None else f"{value:.0f}"


def _late_per_8(entry: Dict[str, Any]) -> str:
    if "late_waits" not in entry or not entry.get("timed_steps"):
        return "n/a"
    return f"{8 * entry['late_waits'] / entry['timed_steps']:.1f}"


def _host_syncs(entry: Dict[str, Any]) -> str:
    """Device-to-host synchronisations per send (Gloo carrying CUDA tensors), over ranks."""
    transfers = entry.get("transfers")
    if not transfers:
        return "n/a"
    sends = sum(t["sends"] for t in transfers)
    syncs = sum(t["host_syncs"] for t in transfers)
    return f"{syncs / sends:.2f} ({syncs} / {sends})" if sends else f"no sends ({syncs} syncs)"


def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> Tuple[str, Dict[str, Any]]:
    """The Markdown report and the summary figures of one run."""
    mb = args.batch // args.microbatches
    where = f"{args.device}, {args.world} rank{'s' if args.world > 1 else ''}, {args.backend}"
    layout = (f"1 chunk: 2 stages {balance(args.blocks, 2)} (layers); 2 chunks: 4 stages {balance(args.blocks, 4)} "
              "(V for zbv and dualpipev, round robin otherwise)" if args.world == 2 else
              f"Every stage on the one rank: 4 stages {balance(args.blocks, 4)} (layers) round robin, 2 stages "
              f"{balance(args.blocks, 2)} for the V (zbv, dualpipev); the 1-chunk schedules do not run")
    lines = [f"# Every flush schedule against torch.distributed.pipelining on a GPT ({where})", "",
             f"Model: examples/models.py `gpt_sequential({args.blocks}, width={args.width}, heads={args.heads}, "
             f"context={args.context})` (tied head), batch {args.batch} x {args.context} tokens in "
             f"{args.microbatches} microbatches of {mb}, cross-entropy, SGD lr={args.lr}. {layout}, the same cut "
             "for ours and torch's. Our protocol: "
             f"{result.get('protocol', 'default')}. {args.pairs} rounds over all comparisons, each torch's "
             f"{args.steps} steps then ours between barriers (samples/s of the slower rank), after "
             f"{args.warmup} warm-up steps (the first checks loss and gradients).", ""]
    summaries: Dict[str, Any] = {}
    rows = []
    for ours, _chunks, cls_name in COMPARISONS:
        if f"ours {ours}" not in result["configs"]:
            continue
        s = summarise(result["rounds"], ours)
        summaries[ours] = s
        errors = "; ".join(e for e in (result["configs"].get(f"{side} {ours}", {}).get("error")
                                       for side in ("torch", "ours")) if e)
        rows.append([ours, cls_name, _fmt_range(s["ms_per_step"]["ours"]), _fmt_range(s["ms_per_step"]["torch"]),
                     _fmt_range(s["ours"]), _fmt_range(s["torch"]), _fmt_range(s["ratio"], 2),
                     f"{s['ours_ahead']} of {len(s['ratios'])}", _recv_wait(result["configs"][f"ours {ours}"]),
                     _late_per_8(result["configs"][f"ours {ours}"]),
                     _host_syncs(result["configs"][f"ours {ours}"]), errors])
    lines += h.table(["ours", "torch", "ours ms/step, median [min-max]", "torch ms/step", "ours samples/s",
                      "torch samples/s", "ratio ours / torch per pair, median [min-max]", "pairs ours ahead",
                      "ours blocked on receives, ms per step (both ranks)",
                      "our waits released by a later message, per 8 steps",
                      "our host syncs per transfer (sends, all ranks)", "errors"], rows)
    loads = [r["loadavg_1min"] for r in result["rounds"]]
    if loads:
        lines += ["", f"Load average (1 min) over the rounds: {min(loads):.2f}-{max(loads):.2f} (start "
                  f"{' '.join(f'{v:.2f}' for v in result['loadavg_start'])}, end "
                  f"{' '.join(f'{v:.2f}' for v in result.get('loadavg_end', []))})."]
    lines += _same_work_lines(result)
    lines += ["", h.machine_line(info), "", h.command_sentence(command, total_s, {args.world: result["launch_s"]}),
              ""]
    return "\n".join(lines), {"comparisons": summaries}


def _same_work_lines(result: Dict[str, Any]) -> List[str]:
    rows = []
    for key, entry in result["configs"].items():
        sw = entry.get("same_work")
        if sw is None:
            rows.append([key, "n/a", "", "", "", entry.get("error", "")])
            continue
        rows.append([key, f"{sw['loss']:.6f}", f"{sw['unsplit_loss']:.6f}", f"{sw['loss_diff']:.1e}",
                     f"{sw['grad_max_abs_diff']:.1e} (of {sw['grad_max_abs']:.1e})",
                     f"{sw['params_compared']} of {sw['params']}"])
    return ["", "Same work: each configuration's first step against the unsplit model (the gradient of "
            "every parameter on every rank that holds it; the tied weight on both where the embedding and "
            "the head are on two ranks):", ""] + h.table(
        ["configuration", "first-step loss", "unsplit loss", "|difference|",
         "max abs gradient difference (largest gradient)", "parameters compared"], rows)


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(LOG)
    start = time.perf_counter()
    worker_args = ["--worker"] + h.forward(args, "pairs", "steps", "warmup", "batch", "blocks", "width", "heads",
                                           "context", "microbatches", "lr", "pipe_timeout", "schedules",
                                           "world", "device", "backend")
    env = {PROTOCOL_ENV: args.protocol} if args.protocol else None
    result = h.launch_torchrun(Path(__file__).resolve(), args.world, worker_args, JSON_TAG,
                               timeout=args.timeout, env_extra=env)
    if h.launch_failed(result) or "rounds" not in result:
        LOG.error("the launch failed: %s", result.get("error"))
        return 1
    text, summary = report(result, info, command, args, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), "vs_torch", text,
                    {"machine": info, "command": command, "args": h.run_options(args), "result": result,
                     "summary": summary})
    if "error" in result:
        LOG.error("%s", result["error"])
    return 1 if "error" in result else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--pairs", type=int, default=16, help="rounds over every comparison (torch, then ours)")
    p.add_argument("--steps", type=int, default=2, help="steps per round")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (the first checks the same work)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8, help="transformer blocks (a multiple of 4)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedules", type=lambda s: s.split(","), default=[c for c, _, _ in COMPARISONS],
                   help="ours of each comparison to run (comma-separated; default: all)")
    p.add_argument("--protocol", choices=("fused", "split"), default=None,
                   help=f"force our point-to-point protocol ({PROTOCOL_ENV}); default: the engine's choice")
    p.add_argument("--pipe-timeout", type=float, default=120.0, help="seconds any wait on the peer may take")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole launch")
    p.add_argument("--world", type=int, choices=(1, 2), default=2,
                   help="ranks: 2 (every comparison), or 1 (the multi-chunk schedules, all stages on one rank)")
    p.add_argument("--device", default="cpu",
                   help="where every rank's stages live: cpu, or cuda:0 (one GPU: every rank on it)")
    p.add_argument("--backend", default=None,
                   help="the default group's backend (default: gloo; cpu:gloo,cuda:nccl for --world 1 on CUDA)")
    p.add_argument("--smoke", action="store_true", help="a tiny GPT, one pair of one step: checks that everything runs")
    args = p.parse_args(argv)
    h.apply_smoke(args, SMOKE)
    if args.backend is None:
        args.backend = "cpu:gloo,cuda:nccl" if args.world == 1 and args.device.startswith("cuda") else "gloo"
    unknown = set(args.schedules) - {c for c, _, _ in COMPARISONS}
    if unknown:
        p.error(f"unknown schedules {sorted(unknown)}; known: {[c for c, _, _ in COMPARISONS]}")
    h.check_step_args(p, args)
    if args.blocks % 4:
        p.error("--blocks must be a multiple of 4 (4 stages at block boundaries)")
    return args


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
