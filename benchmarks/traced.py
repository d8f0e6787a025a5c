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
   phase (``symbolic_trace``, cutting and live sets, the value check, which runs the
   sample through the graph once, building the stage ``GraphModule``s, the ownership
   check, the rest), the graph's node count and the cost per node; beside it
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
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

__all__ = ["CONFIGS", "TRACE_SIZES", "THROUGHPUT_SIZES", "build", "config_order", "make_batch",
           "main", "parse_args", "ratio_stats", "report", "run_driver", "run_worker",
           "sequential_twin", "split_point"]

LOG = logging.getLogger("traced")
JSON_TAG = "TRACED_JSON "
MODELS = ("resnet", "unet", "gpt")
WORKERS = ("throughput", "probe")

#: The throughput configurations, in the order of an even round (odd rounds: reversed).
CONFIGS = ("pd-traced-1f1b", "pd-sequential-1f1b", "torch-1f1b",
           "torch-gpipe", "pd-sequential-gpipe", "pd-traced-gpipe")
LABELS = {"pd-traced-1f1b": "pipedream_ext traced, 1f1b",
          "pd-sequential-1f1b": "pipedream_ext nn.Sequential, 1f1b",
          "torch-1f1b": "torch.distributed.pipelining Schedule1F1B",
          "pd-traced-gpipe": "pipedream_ext traced, gpipe",
          "pd-sequential-gpipe": "pipedream_ext nn.Sequential, gpipe",
          "torch-gpipe": "torch.distributed.pipelining ScheduleGPipe"}

#: Model sizes for the trace table: kind -> list of size dicts (``label`` names the size).
TRACE_SIZES: Dict[str, List[Dict[str, Any]]] = {
    "resnet": [dict(label="8 blocks (2,2,2,2)", blocks=(2, 2, 2, 2), width=16, image=32),
               dict(label="16 blocks (3,4,6,3)", blocks=(3, 4, 6, 3), width=16, image=32),
               dict(label="33 blocks (3,4,23,3)", blocks=(3, 4, 23, 3), width=16, image=32)],
    "unet": [dict(label="depth 2", depth=2, width=8, image=64),
             dict(label="depth 4", depth=4, width=8, image=64),
             dict(label="depth 6", depth=6, width=8, image=64)],
    "gpt": [dict(label="4 blocks", blocks=4, width=64, heads=4, context=64),
            dict(label="16 blocks", blocks=16, width=64, heads=4, context=64),
            dict(label="48 blocks", blocks=48, width=64, heads=4, context=64)],
}
#: One size per model for the stage-call and throughput parts.
THROUGHPUT_SIZES: Dict[str, Dict[str, Any]] = {
    "resnet": dict(label="8 blocks (2,2,2,2), width 16, 32x32", blocks=(2, 2, 2, 2), width=16, image=32),
    "unet": dict(label="depth 4, width 8, 64x64", depth=4, width=8, image=64),
    "gpt": dict(label="8 blocks, width 128, 32 tokens", blocks=8, width=128, heads=4, context=32),
}
#: --smoke: every part on tiny sizes.
SMOKE_TRACE_SIZES: Dict[str, List[Dict[str, Any]]] = {
    "resnet": [dict(label="4 blocks (1,1,1,1)", blocks=(1, 1, 1, 1), width=4, image=16)],
    "unet": [dict(label="depth 3", depth=3, width=4, image=16)],
    "gpt": [dict(label="2 blocks", blocks=2, width=16, heads=2, context=8)],
}
SMOKE_THROUGHPUT_SIZES: Dict[str, Dict[str, Any]] = {k: v[0] for k, v in SMOKE_TRACE_SIZES.items()}
VOCAB = 256


# ----------------------------------------------------------------------------- models
def build(kind: str, size: Dict[str, Any], seed: int = 0):
    """The model ``kind`` of ``size`` in train mode, initialised from ``manual_seed(seed)``."""
    import torch

    m = h.models()
    torch.manual_seed(seed)
    if kind == "resnet":
        widths = [size["width"] * 2 ** i for i in range(len(size["blocks"]))]
        return m.ResNet(size["blocks"], widths).train()
    if kind == "unet":
        return m.UNet(size["depth"], size["width"]).train()
    if kind == "gpt":
        return m.GPT(size["blocks"], size["width"], size["heads"], size["context"], VOCAB).train()
    raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")


def split_point(kind: str, size: Dict[str, Any]) -> str:
    """The module the second of 2 stages starts at (about half the compute on each side)."""
    if kind == "resnet":
        return "layer3"
    if kind == "unet":
        return "mid"
    return f"blocks.{size['blocks'] // 2}"


def sequential_twin(kind: str, model) -> Tuple[Any, List[int]]:
    """``model``'s modules (the same objects) as an ``nn.Sequential`` and the balance that
    puts its boundary where :func:`split_point` does."""
    from torch import nn

    m = h.models()
    if kind == "resnet":
        layers = [model.stem]
        first = 1
        for i in range(model.num_layers):
            blocks = list(getattr(model, f"layer{i + 1}"))
            layers += blocks
            if i < 2:
                first += len(blocks)
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), model.fc]
        return nn.Sequential(*layers), [first, len(layers) - first]
    if kind == "unet":
        return nn.Sequential(m.EncoderPath(model.encs), m.DecoderPath(model)), [1, 1]
    n = len(model.blocks)
    layers = [model.embed, *model.blocks, model.ln_f, model.head, m.FlattenLogits()]
    return nn.Sequential(*layers), [1 + n // 2, len(layers) - 1 - n // 2]


def make_batch(kind: str, size: Dict[str, Any], batch: int, seed: int):
    """``(inputs, targets)`` for ``kind``: images and labels, images and per-pixel labels,
    or token ids and next tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "resnet":
        s = size["image"]
        return torch.randn(batch, 3, s, s, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if kind == "unet":
        s = size["image"]
        return torch.randn(batch, 3, s, s, generator=g), torch.randint(0, 3, (batch, s, s), generator=g)
    ids = torch.randint(0, VOCAB, (batch, size["context"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(kind: str) -> Callable:
    """Cross entropy in the shape each model's output takes (mean reduction)."""
    import torch.nn.functional as F

    if kind == "gpt":
        return lambda logits, targets: F.cross_entropy(logits, targets.reshape(-1))
    return F.cross_entropy


# ----------------------------------------------------------------------------- pure helpers
def config_order(round_index: int, configs: Sequence[str] = CONFIGS) -> List[str]:
    """The configurations of one round: as listed in even rounds, reversed in odd ones
    (A B C, C B A: each neighbour pair runs in both orders)."""
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def ratio_stats(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Optional[Dict[str, float]]:
    """Median, min and max of the per-round ratios ``a[r] / b[r]`` (rounds where either
    is missing or ``b[r]`` is 0 are left out); None when no round has both."""
    ratios = [x / y for x, y in zip(a, b) if x is not None and y]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios),
            "at_least_1": sum(r >= 1.0 for r in ratios)}


def fmt_ratio(stats: Optional[Dict[str, float]]) -> str:
    """``1.02 [0.97-1.05], 3/5 >= 1`` for :func:`ratio_stats`'s result, ``n/a`` for None."""
    if stats is None:
        return "n/a"
    return (f"{stats['median']:.2f} [{stats['min']:.2f}-{stats['max']:.2f}], "
            f"{stats['at_least_1']}/{stats['n']} >= 1")


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


# ----------------------------------------------------------------------------- part 1: tracing
def time_split(kind: str, size: Dict[str, Any], batch: int, microbatches: int,
               with_torch: bool = True) -> Dict[str, Any]:
    """One ``split_model`` call with its phases timed, then (``with_torch``) torch's
    ``pipeline()`` on the same model and split point (one microbatch as ``mb_args``)."""
    import torch

    import pipedream_ext._frontend.graph_split as _trace

    model = build(kind, size)
    x, _ = make_batch(kind, size, batch, seed=3)
    point = split_point(kind, size)
    phases = ("trace_model", "stage_starts", "live_sets", "_value_kinds", "build_stages",
              "_check_one_stage_per_state")
    spent: Dict[str, float] = {}
    graph: Dict[str, int] = {}
    originals = {name: getattr(_trace, name) for name in phases if hasattr(_trace, name)}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            if name == "trace_model":
                graph["nodes"] = len(out.graph.nodes)
            return out
        return wrapper

    for name, fn in originals.items():
        setattr(_trace, name, timed(name, fn))
    try:
        t0 = time.perf_counter()
        split = _trace.split_model(model, [point], (x,))
        total = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(_trace, name, fn)
    out: Dict[str, Any] = {"total_s": total, "nodes": graph.get("nodes"), "phases_s": spent,
                           "stage_nodes": [len(s.graph.nodes) for s in split.stages],
                           "live": [len(v) for v in split.live]}
    out["other_s"] = total - sum(spent.values())
    # The value check runs the sample through the graph: compare with the plain forward.
    model.eval()
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x)
        out["forward_s"] = time.perf_counter() - t0
    model.train()
    if not with_torch:
        return out
    from torch.distributed.pipelining import SplitPoint, pipeline

    mb = x[: max(1, batch // microbatches)]
    t0 = time.perf_counter()
    try:
        pipeline(build(kind, size), mb_args=(mb,), split_spec={point: SplitPoint.BEGINNING})
        out["torch_s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
        out["torch_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
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
                   "total_s": _median([r["total_s"] for r in runs]),
                   "forward_s": _median([r["forward_s"] for r in runs]),
                   "other_s": _median([r["other_s"] for r in runs]),
                   "phases_s": {p: _median([r["phases_s"].get(p, 0.0) for r in runs]) for p in phases},
                   "torch_s": _median([r["torch_s"] for r in runs if "torch_s" in r]),
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
                         "total_s": _median([r["total_s"] for r in runs]),
                         "value_check_s": _median([r["phases_s"].get("_value_kinds", 0.0) for r in runs]),
                         "forward_s": _median([r["forward_s"] for r in runs])})
            LOG.info("sample batch %d, %s %s: split_model %.3f s", batch, kind, size["label"], rows[-1]["total_s"])
    return rows


# ----------------------------------------------------------------------------- part 2: stage calls
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

    from pipedream_ext._frontend.graph_split import split_model

    rows = []
    for label, kind, size, mb in cases:
        x, y = make_batch(kind, size, mb, seed=5)
        traced = split_model(build(kind, size), [split_point(kind, size)], (x,)).stages
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
                row[f"{what}_traced_ms"] = _median(times["traced"]) * 1e3
                row[f"{what}_sequential_ms"] = _median(times["sequential"]) * 1e3
                row[f"{what}_ratio"] = ratio_stats(times["traced"], times["sequential"])
            for m in mods.values():
                m.zero_grad(set_to_none=True)
            LOG.info("stage call %s %s stage %d: fwd+bwd traced %.3f ms, sequential %.3f ms", label, kind, j,
                     row["fwd_bwd_traced_ms"], row["fwd_bwd_sequential_ms"])
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- part 3: throughput (worker)
def _grad_check(named_grads: Sequence[Tuple[str, Any]], ref_grads: Dict[str, Any]) -> Tuple[float, float, int]:
    """(max |g - g_ref|, max |g_ref| over the same names, names without a gradient)."""
    diff, scale, missing = 0.0, 0.0, 0
    for name, grad in named_grads:
        want = ref_grads.get(name)
        if want is None:
            continue
        if grad is None:
            missing += 1
            continue
        diff = max(diff, float((grad - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
    return diff, scale, missing


def reference(kind: str, size: Dict[str, Any], x, y, microbatches: int) -> Tuple[float, Dict[str, Any]]:
    """The unsplit model's loss and gradients on ``(x, y)``, run microbatch by microbatch
    (each microbatch's loss weighted by its share of the batch, as a pipeline does), by
    every name of every parameter (a tied weight under both names)."""
    import torch

    model = build(kind, size)
    lossf = loss_fn(kind)
    total = 0.0
    for xs, ys in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
        loss = lossf(model(xs), ys) * (ys.shape[0] / y.shape[0])
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


def run_throughput(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    """One model, 2 ranks: the six configurations, the first-step check, the rounds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        SplitPoint,
        pipeline,
    )

    import pipedream_ext as pd

    rank, world = dist.get_rank(), dist.get_world_size()
    kind = args.model
    size = (SMOKE_THROUGHPUT_SIZES if args.smoke else THROUGHPUT_SIZES)[kind]
    B, M = args.batch, args.microbatches
    x, y = make_batch(kind, size, B, seed=1)
    cx, cy = make_batch(kind, size, B, seed=2)
    lossf = loss_fn(kind)
    point = split_point(kind, size)
    ref_loss, ref_grads = reference(kind, size, cx, cy, M)
    result.update(model=kind, size=size["label"], batch=B, microbatches=M, split_point=point,
                  reference_loss=ref_loss, configs={})
    steps: Dict[str, Callable[[], None]] = {}
    pipes: Dict[str, Any] = {}
    for cfg in CONFIGS:
        info: Dict[str, Any] = {}
        result["configs"][cfg] = info
        model = build(kind, size)
        schedule = cfg.rsplit("-", 1)[1]
        dist.barrier()
        t0 = time.perf_counter()
        try:
            if cfg.startswith("pd-"):
                if cfg.startswith("pd-traced"):
                    pipe = pd.PipeDream(model, lossf, schedule=schedule, microbatches=M, split_points=[point],
                                        sample=(x, y), timeout=args.pipe_timeout)
                    names = {n: n for n, _ in pipe.named_parameters()}
                else:
                    original = {id(p): n for n, p in model.named_parameters()}
                    twin, balance = sequential_twin(kind, model)
                    names = {n: original[id(p)] for n, p in twin.named_parameters(remove_duplicate=False)}
                    pipe = pd.PipeDream(twin, lossf, schedule=schedule, microbatches=M, balance=balance,
                                        timeout=args.pipe_timeout)
                info["build_s"] = time.perf_counter() - t0
                loss = float(pipe.step(cx, cy))
                diff, scale, missing = _grad_check([(names[n], p.grad) for n, p in pipe.named_parameters()],
                                                   ref_grads)
                params = list(pipe.parameters())
                opt = torch.optim.SGD(params, lr=args.lr) if params else None
                pipes[cfg] = pipe

                def step(pipe=pipe, opt=opt) -> None:
                    pipe.step(x, y)
                    if opt is not None:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            else:
                split = pipeline(model, mb_args=(x[:B // M],), split_spec={point: SplitPoint.BEGINNING})
                stage = split.build_stage(rank, torch.device("cpu"))
                cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
                sched = cls(stage, M, loss_fn=lossf)
                info["build_s"] = time.perf_counter() - t0
                losses: List[Any] = []
                if rank == 0:
                    sched.step(cx)
                else:
                    sched.step(target=cy, losses=losses)
                loss = float(torch.stack(losses).mean()) if losses else 0.0
                diff, scale, missing = _grad_check(
                    [(n, p.grad) for n, p in stage.submod.named_parameters(remove_duplicate=False)], ref_grads)
                opt = torch.optim.SGD(stage.submod.parameters(), lr=args.lr)

                def step(sched=sched, opt=opt) -> None:
                    if rank == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y, losses=[])
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            for p in (pipes[cfg].parameters() if cfg in pipes else stage.submod.parameters()):
                p.grad = None
            # Every rank's figures together: the loss is known on the last rank (torch) or all.
            t = torch.tensor([abs(loss - ref_loss) if rank == world - 1 else 0.0, diff, scale, float(missing),
                              loss if rank == world - 1 else 0.0], dtype=torch.float64)
            dist.all_reduce(t[:4], op=dist.ReduceOp.MAX)
            dist.all_reduce(t[4:], op=dist.ReduceOp.SUM)
            info.update(loss_diff=float(t[0]), grad_max_diff=float(t[1]), grad_max=float(t[2]),
                        params_without_grad=int(t[3]), first_loss=float(t[4]))
            steps[cfg] = step
        except Exception as exc:  # noqa: BLE001 - a configuration's failure is a result
            LOG.exception("rank %d: %s failed", rank, cfg)
            info["error"] = f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            raise
    for cfg, step in steps.items():  # warm-up
        for _ in range(args.warmup):
            step()
    result["loadavg"] = [list(os.getloadavg())]
    for r in range(args.reps):
        # Interleaved step by step (A B C ... then ... C B A), each step between two
        # barriers: load from other jobs on the machine falls on every configuration alike.
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
        dist.all_reduce(c)  # CPU seconds of both ranks together (Gloo's threads included)
        samples = args.steps * B
        for i, cfg in enumerate(CONFIGS):
            info = result["configs"][cfg]
            info.setdefault("samples_per_s", []).append(samples / float(t[i]))
            info.setdefault("cpu_us_per_sample", []).append(float(c[i]) / samples * 1e6)
            if cfg in pipes:
                info.setdefault("compute_ms_per_step", []).append(float(t[len(CONFIGS) + i]) / args.steps * 1e3)
        result["loadavg"].append(list(os.getloadavg()))
        LOG.info("rank %d: round %d done", rank, r)


# ----------------------------------------------------------------------------- part 4: skip across cuts (worker)
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


def run_probe(args: argparse.Namespace) -> Dict[str, Any]:
    """Part 4 on this launch's ranks (:data:`PROBES`): pipedream_ext and torch's schedules,
    one step from the initial weights against the unsplit model, every rank's error."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import SplitPoint, pipeline

    import pipedream_ext as pd

    rank, world = dist.get_rank(), dist.get_world_size()
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
        mine_stages = list(range(rank, stages, world))
        out: Dict[str, Any] = {"split_points": points, "stages": stages}
        result["splits"][label] = out
        pipe = pd.PipeDream(build("unet", PROBE_SIZE), lossf, schedule=probe["pd"], microbatches=M,
                            chunks=stages // world, split_points=points, sample=(x, y), timeout=args.pipe_timeout)
        loss = pipe.step(x, y)
        diff, scale, _ = _grad_check([(n, p.grad) for n, p in pipe.named_parameters()], ref_grads)
        t = torch.tensor([diff, scale], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["pipedream_ext"] = {"loss": float(loss), "loss_diff": abs(loss - ref_loss), "grad_max_diff": float(t[0]),
                                "grad_max": float(t[1]), "live": pipe.traced.live}
        out["torch"] = {}
        for name in probe["torch"][:1 if args.smoke else None]:
            # A group of its own with a short timeout: ranks blocked on a failing peer give up.
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.probe_timeout))
            mine: Dict[str, Any] = {"rank": rank}
            t0 = time.perf_counter()
            try:
                split = pipeline(build("unet", PROBE_SIZE), mb_args=(x[:B // M],),
                                 split_spec={p: SplitPoint.BEGINNING for p in points})
                built = [split.build_stage(j, torch.device("cpu"), group=group) for j in mine_stages]
                sched = getattr(pipelining, name)(built if stages > world else built[0], M, loss_fn=lossf)
                losses: List[Any] = []
                if 0 in mine_stages:
                    sched.step(x)
                elif stages - 1 in mine_stages:
                    sched.step(target=y, losses=losses)
                else:
                    sched.step()
                if losses:
                    mine["loss"] = float(torch.stack(losses).mean())
                mine["grad_max_diff"], mine["grad_max"], _ = _grad_check(
                    [(n, p.grad) for s in built for n, p in s.submod.named_parameters()], ref_grads)
            except Exception as exc:  # noqa: BLE001 - the peer's failure is the result
                mine["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            mine["seconds"] = time.perf_counter() - t0
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            out["torch"][name] = gathered
    return result


def run_worker(args: argparse.Namespace) -> int:
    """One rank of a launch: ``--worker throughput --model M`` (part 3, and part 4 with
    ``--run-probe``) or ``--worker probe`` (part 4)."""
    def body(result: Dict[str, Any]) -> None:
        if args.worker == "throughput":
            run_throughput(args, result)
        if args.worker == "probe" or args.run_probe:
            result["probe"] = run_probe(args)

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- report
def _phase_ms(row: Dict[str, Any], *names: str) -> str:
    return h.fmt(sum(row["phases_s"].get(n, 0.0) for n in names) * 1e3, 1)


def report(data: Dict[str, Any], info: Dict[str, str], command: str) -> str:
    """The Markdown report of a run (``data``: the JSON written beside it)."""
    a = data["args"]
    lines = ["# Traced models", "", f"Command: `{command}` (total {data['total_s']:.0f} s).", "",
             h.machine_line(info) + " One thread per process (torch.set_num_threads(1), OMP_NUM_THREADS=1); "
             "the machine is shared, so compare within a run: every comparison below is interleaved.", ""]
    # Part 1
    lines += ["## Trace and split", "",
              f"`split_model(model, [point], (x,))` with a sample batch of {a['trace_batch']} (median of "
              f"{a['trace_reps']}); `symbolic_trace`, cut (`stage_starts` + `live_sets`), value check "
              "(`_value_kinds`: the sample run through the graph once, in eval mode), build (one "
              "`GraphModule` per stage), ownership check, other (the rest of `split_model`). 'forward' is "
              "the model's own forward on the same sample (no grad, eval), for scale. torch's "
              "`pipeline()` (torch.export) gets one microbatch of "
              f"{max(1, a['trace_batch'] // a['microbatches'])} as `mb_args`.", ""]
    rows = []
    for r in data["trace"]:
        per_node = r["total_s"] / r["nodes"] * 1e6 if r["nodes"] else None
        no_check = ((r["total_s"] - r["phases_s"].get("_value_kinds", 0.0)) / r["nodes"] * 1e6
                    if r["nodes"] else None)
        torch_cell = h.fmt(r["torch_s"], 3) if r["torch_s"] is not None else f"failed: {r['torch_error']}"
        ratio = h.fmt(r["torch_s"] / r["total_s"], 1) if r["torch_s"] else "n/a"
        rows.append([r["model"], r["size"], r["nodes"], "/".join(map(str, r["stage_nodes"])),
                     "/".join(map(str, r["live"])), h.fmt(r["total_s"], 3),
                     _phase_ms(r, "trace_model"), _phase_ms(r, "stage_starts", "live_sets"),
                     _phase_ms(r, "_value_kinds"), _phase_ms(r, "build_stages"),
                     _phase_ms(r, "_check_one_stage_per_state"), h.fmt(r["other_s"] * 1e3, 1),
                     h.fmt(r["forward_s"] * 1e3, 1), h.fmt(per_node, 0), h.fmt(no_check, 0), torch_cell, ratio])
    lines += h.table(["model", "size", "graph nodes", "stage nodes", "live values", "split_model (s)",
                      "symbolic_trace (ms)", "cut (ms)", "value check (ms)", "build (ms)", "ownership (ms)",
                      "other (ms)", "forward (ms)", "us per node", "us per node without value check",
                      "torch pipeline() (s)", "torch / ours"], rows)
    if data.get("sample_batches"):
        lines += ["", "`split_model` against the sample's batch size (the value check runs the whole sample "
                  "through the model once; `PipeDream(sample=(x, y))` passes the batch it is given):", ""]
        lines += h.table(["model", "size", "sample batch", "split_model (s)", "value check (s)", "forward (s)"],
                         [[r["model"], r["size"], r["batch"], h.fmt(r["total_s"], 3), h.fmt(r["value_check_s"], 3),
                           h.fmt(r["forward_s"], 3)] for r in data["sample_batches"]])
    # Part 2
    lines += ["", "## Stage calls: traced GraphModule against nn.Sequential stage", "",
              "Each stage alone on one microbatch (no communication): forward under no_grad, and "
              f"forward+backward, {a['call_reps']} interleaved pairs each, median ms; ratio = traced / "
              "nn.Sequential per pair (median [min-max], pairs where the traced stage was slower or equal). "
              "'extra per call' = (traced - nn.Sequential forward) / module calls, at the tiny sizes: they have "
              "almost no compute, so they show the Python cost of a call (at the throughput sizes that "
              "difference is below the noise).", ""]
    rows = []
    for r in data["stage_calls"]:
        extra = ((r["fwd_traced_ms"] - r["fwd_sequential_ms"]) * 1e3 / r["traced_calls"]
                 if r["traced_calls"] and r["case"].startswith("tiny") else None)
        rows.append([r["case"], r["model"], f"{r['size']}, microbatch {r['microbatch']}", r["stage"],
                     r["traced_nodes"], r["traced_calls"],
                     f"{r['fwd_traced_ms']:.3f} / {r['fwd_sequential_ms']:.3f}", fmt_ratio(r["fwd_ratio"]),
                     h.fmt(extra, 1, ""), f"{r['fwd_bwd_traced_ms']:.3f} / {r['fwd_bwd_sequential_ms']:.3f}",
                     fmt_ratio(r["fwd_bwd_ratio"])])
    lines += h.table(["case", "model", "size", "stage", "GraphModule nodes", "module calls",
                      "forward ms (traced / nn.Sequential)", "forward ratio", "extra per call (us)",
                      "forward+backward ms (traced / nn.Sequential)", "forward+backward ratio"], rows)
    # Part 3
    lines += ["", "## Throughput, 2 ranks", "",
              f"Global batch {a['batch']}, {a['microbatches']} microbatches, SGD; {a['reps']} rounds of {a['steps']} "
              f"steps per configuration after {a['warmup']} warm-up steps, interleaved step by step (the six "
              "configurations in turn, the order reversed every other step, each step between two barriers); "
              "samples/s from the slower rank (median [min-max] over rounds). 'first step' compares the first "
              "step's loss and every gradient with the unsplit model on the same microbatches (max abs "
              "difference; max |gradient| in brackets). 'compute' is pipedream_ext's F and B time per step on "
              "the busier rank (`stats()`).", ""]
    for model, res in data["throughput"].items():
        load = res.get("loadavg") or []
        load_text = (f"load average (1 min) {load[0][0]:.2f} at the start of the rounds, "
                     f"{max(x[0] for x in load):.2f} at most") if load else "load n/a"
        lines += [f"### {model}: {res.get('size', '')}, split at `{res.get('split_point', '')}` ({load_text})", ""]
        if "error" in res and not res.get("configs"):
            lines += [f"Failed: {res['error']} (log: {res.get('log', 'n/a')})", ""]
            continue
        rows = []
        for cfg in CONFIGS:
            c = res.get("configs", {}).get(cfg, {})
            sps = c.get("samples_per_s") or []
            if "error" in c or not sps:
                rows.append([LABELS[cfg], f"n/a ({c.get('error', res.get('error', 'no result'))})"] + [""] * 5)
                continue
            check = (f"loss {c['loss_diff']:.1e}, grads {c['grad_max_diff']:.1e} [{c['grad_max']:.1e}]"
                     + (f", {c['params_without_grad']} params without grad" if c["params_without_grad"] else ""))
            rows.append([LABELS[cfg], f"{_median(sps):.1f} [{min(sps):.1f}-{max(sps):.1f}]",
                         h.fmt(_median(c.get("cpu_us_per_sample") or []), 0),
                         h.fmt(_median(c["compute_ms_per_step"]), 1) if c.get("compute_ms_per_step") else "",
                         h.fmt(c.get("build_s"), 2), check])
        lines += h.table(["configuration", "samples/s", "CPU us/sample (both ranks)", "compute ms/step",
                          "construction (s)", "first step vs unsplit"], rows)
        cfgs = res.get("configs", {})

        def sps_of(cfg: str) -> List[Optional[float]]:
            return list(cfgs.get(cfg, {}).get("samples_per_s") or [])

        def cmp_of(cfg: str) -> List[Optional[float]]:
            return list(cfgs.get(cfg, {}).get("compute_ms_per_step") or [])

        def inv(values: List[Optional[float]]) -> List[Optional[float]]:
            return [1.0 / v if v else None for v in values]

        def cpu_of(cfg: str) -> List[Optional[float]]:
            return list(cfgs.get(cfg, {}).get("cpu_us_per_sample") or [])

        ratio_rows = [
            ("samples/s, traced / nn.Sequential", sps_of, "pd-traced", "pd-sequential", False),
            ("CPU time per sample, nn.Sequential / traced", cpu_of, "pd-traced", "pd-sequential", True),
            ("compute time per step, nn.Sequential / traced", cmp_of, "pd-traced", "pd-sequential", True),
            ("samples/s, pipedream_ext traced / torch", sps_of, "pd-traced", "torch", False),
            ("CPU time per sample, torch / pipedream_ext traced", cpu_of, "pd-traced", "torch", True)]
        rows = []
        for title, get, a_cfg, b_cfg, invert in ratio_rows:
            cells = []
            for sched in ("1f1b", "gpipe"):
                x_, y_ = get(f"{a_cfg}-{sched}"), get(f"{b_cfg}-{sched}")
                cells.append(fmt_ratio(ratio_stats(inv(x_), inv(y_)) if invert else ratio_stats(x_, y_)))
            rows.append([title] + cells)
        lines += [""] + h.table(["ratio per round (> 1: the first named is faster)", "1f1b", "gpipe"], rows) + [""]
    # Part 4
    lines += ["## A skip connection across several cuts", "",
              f"The U-Net ({PROBE_SIZE['label']}) cut so that the first level's skip connection crosses "
              "more than one cut, two ways: **fan-out** (the stage making the skip also feeds it to the "
              "next stage, so two later stages use one value) and **jump** (the skip goes only to the "
              "stage using it, over the stages between). 2 ranks: 4 stages, two per rank (pipedream_ext "
              "interleaved-1f1b, chunks=2; torch ScheduleInterleaved1F1B and ScheduleLoopedBFS); 3 ranks: "
              "3 stages (pipedream_ext 1f1b; torch Schedule1F1B and ScheduleGPipe). One step of 4 "
              "microbatches from the initial weights against the unsplit model. The torch schedules run "
              f"on a group with a {a['probe_timeout']:.0f} s timeout, so that ranks blocked on a failing "
              "peer give up instead of hanging.", ""]
    rows = []
    for key in ("probe2", "probe3"):
        probe = data.get(key)
        if not probe:
            continue
        if "splits" not in probe:
            rows.append([key[-1], "", "", "", f"failed: {probe.get('error', 'no result')}", "", "", ""])
            continue
        ref = probe["reference_loss"]
        for label, out in probe["splits"].items():
            p = out["pipedream_ext"]
            rows.append([probe["world"], f"{label} ({out['stages']} stages)", f"`{out['split_points']}`",
                         f"pipedream_ext {probe['pd_schedule']}", "runs", f"{p['loss_diff']:.1e}",
                         f"{p['grad_max_diff']:.1e} [{p['grad_max']:.1e}]",
                         "live sets " + ", ".join(f"cut {k + 1}: {v}" for k, v in enumerate(p["live"]))])
            for name, ranks in (out.get("torch") or {}).items():
                errors = [f"rank {r['rank']} ({r['seconds']:.0f} s): {r['error']}" for r in ranks if "error" in r]
                if errors:
                    rows.append(["", "", "", f"torch {name}", "fails", "", "", "; ".join(errors)])
                    continue
                loss = next((r["loss"] for r in ranks if "loss" in r), None)
                diff = max(r.get("grad_max_diff", 0.0) for r in ranks)
                scale = max(r.get("grad_max", 0.0) for r in ranks)
                rows.append(["", "", "", f"torch {name}", "runs",
                             f"{abs(loss - ref):.1e}" if loss is not None else "n/a", f"{diff:.1e} [{scale:.1e}]",
                             ""])
    lines += h.table(["ranks", "split", "split points", "runtime", "result", "loss difference",
                      "max gradient difference [max gradient]", "notes"], rows)
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver
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
