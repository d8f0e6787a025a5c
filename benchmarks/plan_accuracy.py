"""How well does the configuration planner predict what runs? Predicted against measured
step time and peak memory for three models, on 2 and 4 ranks of this machine, over a grid
of schedules x microbatches x balance x recompute, and the planner's own choice against
the best configuration measured.

1. **Layer costs** (driver, one process, one thread): for each model, per layer affine
   forward/backward costs, saved-tensor, input and output bytes and parameter bytes,
   measured at two microbatch sizes (``--batch`` / 8 and / 2) by
   ``pipedream_ext.diagnostics.measure_layer_costs``.
2. **Grid**: every valid (schedule, microbatches, balance, recompute) of ``--schedules``
   x ``--microbatches`` x ``--balances`` (``even``: layers split evenly; ``skewed``: one
   layer moved from the last stage to the first) x recompute off/on, ``--configs`` of
   them drawn with ``--seed`` (the same draw for every run of the script).
3. **Run** (one ``torch.distributed.run`` launch per model and world size, Gloo, one
   thread per rank): first ``pipedream_ext.diagnostics.calibrate`` (the machine costs:
   runtime overheads, latency, bandwidth, optimizer seconds per byte, cores), then on rank
   0 ``configuration.search`` over the grid's space (balance and recompute per stage
   searched) and its choice is run beside the grid's configurations ("auto"). Each
   configuration: ``pd.PipeDream(...)``, Adam, ``--warmup`` steps, one step under the
   memory probe, ``--steps`` timed steps (``pipe.step`` + ``opt.step()`` +
   ``opt.zero_grad()``).
   With ``--repeats N`` every launch runs N times (in rounds: every launch once, then
   again), the same configurations each time.
4. **Measure**: step time = median over the timed steps of the slowest rank's step, then
   the median over the rounds (how far the rounds lie apart is reported: the machine's own
   noise, which no cost model predicts); the CPU share other processes and the hypervisor
   took during each launch (``_harness.CpuWatch``) is reported beside it;
   peak memory per rank = bytes held at the probe's start (weights, optimizer state) +
   the largest amount allocated above it during one step (torch.profiler memory events,
   the method of benchmarks/memory.py); per rank and step, where the time goes
   (``pipe.stats()``: compute F/B/I/W, waits on peers, posting sends, the rest).
5. **Predict** (driver): ``configuration.predict`` with the model's layer costs and the
   launch's machine costs, for every configuration; error = measured / predicted - 1.
   Reported: median and worst |error| of step time, Spearman rank correlation of
   predicted and measured step times, peak memory error, and the measured step time of
   the planner's choice against the best one measured.

Writes ``<out-dir>/plan_accuracy.md``, ``.json`` (raw measurements: ``--report-only``
re-reads it) and ``.png`` (predicted vs measured). Command, from the repository root
(about 4 minutes per round on an idle 2-core machine):

    python3 benchmarks/plan_accuracy.py [--models digits,gpt,mlp] [--workers 2,4] [--configs 24] [--repeats 3]
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h
from _harness import pct

__all__ = ["MODELS", "accuracy_summary", "balance_for", "draw_grid", "error_stats", "main", "measured_step",
           "measured_terms", "optimizer_of", "overhead_parts", "overhead_table", "parse_args", "plot",
           "predicted_terms", "round_spread", "relative_error", "run_config", "run_driver", "run_worker", "spearman",
           "summary_table", "time_breakdown"]

LOG = logging.getLogger("plan_accuracy")
JSON_TAG = "PLAN_ACCURACY_JSON "
MIB = float(1 << 20)
#: The terms of ``Prediction.breakdown``, measured as ``configuration.measured_breakdown``.
TERMS = ("compute", "waits", "transfers", "all-reduce", "overhead")
#: The models of the study: batch (samples per step) and what builds them in a worker.
MODELS: Dict[str, Dict[str, Any]] = {
    "digits": {"batch": 64, "text": "examples/train_digits.py's CNN (10 layers), real digits"},
    "gpt": {"batch": 16, "text": "examples/models.py's `gpt_sequential(6, 64, 4, 32)` (10 layers: embedding, "
                                 "6 blocks, LayerNorm, tied head, flatten), random bytes, sequence 32"},
    "mlp": {"batch": 64, "text": "`_harness.mlp([256, 1024, 256, 1024, 256, 1024, 256, 10])` (13 layers), "
                                 "random data"},
}


# ----------------------------------------------------------------------------- pure helpers
def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """``measured / predicted - 1`` (None if either is missing or predicted is 0)."""
    if predicted is None or measured is None or predicted == 0:
        return None
    return measured / predicted - 1.0


def balance_for(kind: str, layers: int, stages: int) -> Optional[List[int]]:
    """Layers per stage: ``even`` (differing by at most one, the longer stages first) or
    ``skewed`` (even, then one layer of the last stage that has more than one moved to
    stage 0).

    Returns:
        The balance, or None when ``skewed`` cannot differ from ``even`` (every stage
        after the first has one layer).

    Raises:
        ValueError: fewer layers than stages, or an unknown kind.
    """
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} stages")
    base, extra = divmod(layers, stages)
    even = [base + (1 if j < extra else 0) for j in range(stages)]
    if kind == "even":
        return even
    if kind != "skewed":
        raise ValueError(f"unknown balance kind {kind!r}; use even or skewed")
    donors = [j for j in range(1, stages) if even[j] > 1]
    if not donors:
        return None
    even[donors[-1]] -= 1
    even[0] += 1
    return even


def draw_grid(schedules: Sequence[str], microbatches: Sequence[int], balances: Sequence[str],
              recompute: Sequence[bool], count: int, seed: int,
              valid: Callable[[Dict[str, Any]], bool]) -> List[Dict[str, Any]]:
    """``count`` configurations drawn without replacement from the valid points of the grid
    (all of them when fewer), in the grid's order.

    Args:
        schedules, microbatches, balances, recompute: the grid's axes.
        count: how many to draw.
        seed: the draw's seed (the same seed gives the same configurations).
        valid: whether a point ``{"schedule", "microbatches", "balance_kind", "recompute"}`` can run.
    """
    points = [{"schedule": s, "microbatches": m, "balance_kind": b, "recompute": r}
              for s, m, b, r in itertools.product(schedules, microbatches, balances, recompute)]
    points = [p for p in points if valid(p)]
    if len(points) <= count:
        return points
    keep = set(random.Random(seed).sample(range(len(points)), count))
    return [p for i, p in enumerate(points) if i in keep]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs
    or a constant side."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} predicted against {len(ys)} measured values")
    if len(xs) < 3:
        return None

    def ranks(v: Sequence[float]) -> List[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


def error_stats(errors: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """Median and worst absolute relative error, and the median signed one (None when empty)."""
    vals = [e for e in errors if e is not None]
    if not vals:
        return {"median_abs": None, "worst_abs": None, "median": None, "n": 0}
    return {"median_abs": statistics.median(abs(e) for e in vals), "worst_abs": max(abs(e) for e in vals),
            "median": statistics.median(vals), "n": len(vals)}


def measured_step(step_seconds: Sequence[Sequence[float]]) -> float:
    """Step time of a run: per step the slowest rank, then the median over steps.

    Args:
        step_seconds: per rank, the wall time of each timed step.
    """
    steps = len(step_seconds[0])
    if not steps or any(len(r) != steps for r in step_seconds):
        raise ValueError(f"ranks timed different numbers of steps: {[len(r) for r in step_seconds]}")
    return statistics.median(max(r[i] for r in step_seconds) for i in range(steps))


def measured_terms(rank: Dict[str, Any], step_s: float) -> Dict[str, float]:
    """Where one rank's step goes, in seconds per step, from its ``pipe.stats()``: the
    terms of ``Prediction.breakdown`` as ``configuration.measured_breakdown`` counts them
    (``waits``: blocked on receives, sends and the tied weights' all-reduce;
    ``all-reduce``: the replicas' gradients; ``overhead``: the rest of ``step_s``, the
    runtime's own time, the ``step`` call around it, the optimizer, the loss all-reduce).
    """
    from pipedream_ext import configuration

    return configuration.measured_breakdown(rank["seconds_by_kind"], rank["steps"], step_s)


def overhead_parts(rank: Dict[str, Any], step_s: float) -> Dict[str, float]:
    """One rank's overhead (:func:`measured_terms`) in parts, seconds per step:
    ``optimizer`` (the user's ``opt.step()`` and ``zero_grad``, mean over steps), ``runtime``
    (inside the runtime but in no F/B/I/W, wait or send span) and ``outside`` (the rest: the
    ``step`` call around the runtime, the loss all-reduce, the ranks' drift)."""
    from pipedream_ext import configuration

    kinds, steps = rank["seconds_by_kind"], rank["steps"]
    spans = sum(kinds.get(k, 0.0) for ks in configuration.ACTION_TERMS.values() for k in ks) / steps
    optimizer = statistics.mean(rank["optimizer_s"]) if rank.get("optimizer_s") else 0.0
    runtime = max(rank["busy_s"] / steps - spans, 0.0)
    return {"optimizer": optimizer, "runtime": runtime, "outside": step_s - spans - optimizer - runtime}


def predicted_terms(prediction: Dict[str, Any], rank: int) -> Dict[str, float]:
    """The prediction's terms for ``rank`` (``Prediction.breakdown`` of its dict form), in
    seconds per step."""
    from pipedream_ext import configuration

    return configuration.Prediction.from_dict(prediction).breakdown(rank)


def time_breakdown(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per term, the median over rows and ranks of measured and predicted seconds per step
    and of measured - predicted (rows without a prediction are left out)."""
    out: Dict[str, Dict[str, float]] = {}
    for term in TERMS:
        meas, pred = [], []
        for row in rows:
            if row.get("prediction") is None:
                continue
            for r, terms in enumerate(row["terms"]):
                meas.append(terms[term])
                pred.append(predicted_terms(row["prediction"], r)[term])
        if meas:
            out[term] = {"measured": statistics.median(meas), "predicted": statistics.median(pred),
                         "difference": statistics.median(m - p for m, p in zip(meas, pred))}
    return out


def accuracy_summary(rows: Sequence[Dict[str, Any]], choice: bool = True) -> Dict[str, Any]:
    """The study's numbers for a set of measured and predicted rows: step time and peak
    memory errors, rank correlation, and (``choice``: the rows are one model on one world
    size) the planner's choice against the best measured.

    Each row has ``step_s``, ``prediction`` (``step_seconds``, ``peak_bytes``),
    ``peak_bytes`` (measured, per rank) and ``auto`` (the planner's choice)."""
    ok = [r for r in rows if "error" not in r and r.get("prediction")]
    step_err = [relative_error(r["prediction"]["step_seconds"], r["step_s"]) for r in ok]
    mem_err = [relative_error(p, m) for r in ok for p, m in zip(r["prediction"]["peak_bytes"], r["peak_bytes"])]
    spreads = [round_spread(r["step_s_rounds"]) for r in ok if len(r.get("step_s_rounds", [])) > 1]
    out = {"runs": len(ok), "step": error_stats(step_err), "memory": error_stats(mem_err),
           "spearman": spearman([r["prediction"]["step_seconds"] for r in ok], [r["step_s"] for r in ok]),
           "round_spread": statistics.median(spreads) if spreads else None}
    if ok and choice:
        best = min(ok, key=lambda r: r["step_s"])
        auto = [r for r in ok if r.get("auto")]
        grid = [r for r in ok if not r.get("auto")]
        picked = min(grid, key=lambda r: r["prediction"]["step_seconds"]) if grid else None
        out.update(best=best["key"], best_s=best["step_s"],
                   auto=auto[0]["key"] if auto else None,
                   auto_vs_best=relative_error(best["step_s"], auto[0]["step_s"]) if auto else None,
                   picked=picked["key"] if picked else None,
                   picked_vs_best=relative_error(best["step_s"], picked["step_s"]) if picked else None)
    return out


def round_spread(steps: Sequence[float]) -> float:
    """How far one configuration's measured step times of several launches lie apart:
    (largest - smallest) / median."""
    return (max(steps) - min(steps)) / statistics.median(steps)


def config_key(cfg: Dict[str, Any]) -> str:
    """``1f1b M4 even rc`` (``rc``: recompute; a list of stages for the planner's choice)."""
    rc = cfg["recompute"]
    rc_text = ("rc" if rc else "-") if isinstance(rc, bool) else "rc" + "".join("1" if x else "0" for x in rc)
    chunks = f" c{cfg['chunks']}" if cfg.get("chunks", 1) > 1 else ""
    return f"{cfg['schedule']}{chunks} M{cfg['microbatches']} {cfg['balance_kind']} {rc_text}"


# ----------------------------------------------------------------------------- worker
def gpt_loss(logits: Any, targets: Any) -> Any:
    """Next-byte cross entropy: (batch * time, vocab) logits against (batch, time) targets."""
    import torch.nn.functional as F

    return F.cross_entropy(logits, targets.reshape(-1))


def build_model(name: str, seed: int) -> Tuple[Any, Callable[..., Any]]:
    """The study's model ``name`` (an ``nn.Sequential``, the same on every rank) and its loss."""
    import torch
    import torch.nn.functional as F

    if name == "digits":
        return h.digits().make_model(seed), F.cross_entropy
    if name == "gpt":
        torch.manual_seed(seed)
        return h.models().gpt_sequential(6, 64, 4, 32), gpt_loss
    if name == "mlp":
        return h.mlp([256, 1024, 256, 1024, 256, 1024, 256, 10], seed), F.cross_entropy
    raise ValueError(f"unknown model {name!r}; use one of {sorted(MODELS)}")


def model_batches(name: str, batch: int, seed: int, count: int = 4) -> List[Tuple[Any, Any]]:
    """``count`` batches of ``batch`` samples for model ``name`` (real digits for ``digits``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if name == "digits":
        train, _ = h.digits().load_digits(seed)
        xs, ys = train.tensors
        return [(xs[i * batch:(i + 1) * batch], ys[i * batch:(i + 1) * batch]) for i in range(count)]
    if name == "gpt":
        ids = [torch.randint(0, 256, (batch, 33), generator=g) for _ in range(count)]
        return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in ids]
    return [(torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(count)]


def bytes_held(params: Sequence[Any], optimizer: Optional[Any]) -> float:
    """Bytes of the distinct tensors a rank holds between steps: its weights and optimizer
    state (``optimizer`` None: weights only)."""
    import torch

    seen, total = set(), 0
    states = optimizer.state.values() if optimizer is not None else ()
    tensors = list(params) + [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return float(total)


def on_every_rank(fn: Callable[[], Any]) -> Any:
    """``fn()``, raising on every rank when it raised on any (so no rank goes on into a
    collective its failed peers never reach)."""
    import torch
    import torch.distributed as dist

    error: Optional[BaseException] = None
    try:
        out = fn()
    except Exception as exc:  # re-raised below, after the peers know
        LOG.exception("rank %d failed", dist.get_rank())
        error, out = exc, None
    failed = torch.tensor([0.0 if error is None else 1.0])
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("failed on another rank (see its log)")
    return out


def run_config(cfg: Dict[str, Any], args: argparse.Namespace, batches: Sequence[Tuple[Any, Any]]) -> Dict[str, Any]:
    """One configuration: warm-up, one step under the memory probe, timed steps; every rank's
    step times, peak bytes and ``pipe.stats()``."""
    import memory
    import torch
    import torch.distributed as dist

    import pipedream_ext as pd

    def build() -> Tuple[Any, List[Any], Optional[Any]]:
        model, loss_fn = build_model(args.model, args.seed)
        pipe = pd.PipeDream(model, loss_fn, schedule=cfg["schedule"], microbatches=cfg["microbatches"],
                            chunks=cfg["chunks"], balance=cfg["balance"], recompute=cfg["recompute"],
                            timeout=args.pipe_timeout)
        params = list(pipe.parameters())
        # A stage of parameter-free layers (ReLU, pooling) has nothing to optimise.
        return pipe, params, torch.optim.Adam(params, lr=args.lr) if params else None

    pipe, params, opt = on_every_rank(build)

    optimizer_s: List[float] = []

    def one(i: int) -> None:
        x, y = batches[i % len(batches)]
        pipe.step(x, y)
        if opt is not None:
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            optimizer_s.append(time.perf_counter() - t0)

    pipe.train()
    for i in range(args.warmup):
        one(i)
    dist.barrier()
    held = bytes_held(params, opt)
    with memory.Window(torch.device("cpu")) as window:
        one(args.warmup)
    pipe.reset_stats()
    dist.barrier()
    optimizer_s.clear()
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        one(args.warmup + 1 + i)
        times.append(time.perf_counter() - t0)
    st = pipe.stats()
    mine = {"rank": dist.get_rank(), "step_s": times, "optimizer_s": optimizer_s or [0.0] * len(times),
            "steps": args.steps, "held_bytes": held, "parameter_bytes": float(sum(p.nbytes for p in params)),
            "parameter_tensors": len(params),
            "window_peak_bytes": float(window.peak), "peak_bytes": held + window.peak,
            "seconds_by_kind": st["seconds_by_kind"], "busy_s": st["busy_s"],
            "bubble_fraction": st["bubble_fraction"], "peak_activations": st["peak_activations"]}
    ranks = h.all_gather_json(mine)
    dist.barrier()
    return {**cfg, "ranks": ranks}


def run_config_safely(cfg: Dict[str, Any], args: argparse.Namespace, batches) -> Dict[str, Any]:
    """:func:`run_config`; an error on any rank becomes this run's result on every rank."""
    import torch
    import torch.distributed as dist

    try:
        out = run_config(cfg, args, batches)
        failed = torch.zeros(1)
    except Exception as exc:  # reported as data
        LOG.exception("rank %d: %s failed", dist.get_rank(), cfg["key"])
        out = {**cfg, "error": f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"}
        failed = torch.ones(1)
    dist.all_reduce(failed)  # an exception inside a collective above leaves the others waiting
    if failed.item() and "error" not in out:
        out = {**cfg, "error": "failed on another rank (see its log)"}
    return out


def search_space(spec: Dict[str, Any], world: int) -> Dict[str, Any]:
    """Keyword arguments of ``configuration.search`` for the grid's space on ``world`` ranks:
    its schedules and microbatch counts, pipelines only (mesh (world, 1, 1)), balance and
    recompute per stage searched."""
    return {"world_size": world, "batch_size": spec["batch"], "schedules": list(spec["schedules"]),
            "microbatches": list(spec["microbatches"]), "meshes": [(world, 1, 1)], "recompute": "search",
            "interleaved_chunks": (spec["chunks"],), "candidates": 5}


def auto_config(spec: Dict[str, Any], machine: Dict[str, Any], world: int) -> Dict[str, Any]:
    """The planner's choice over the grid's space, as a configuration to run ("auto")."""
    from pipedream_ext import configuration

    layers = [configuration.LayerCost.from_dict(d) for d in spec["layers"]]
    best = configuration.search(layers, configuration.MachineCosts.from_dict(machine), **search_space(spec, world))
    rc = [bool(x) for x in best.recompute]
    cfg = {"schedule": best.schedule, "chunks": best.chunks, "microbatches": best.microbatches,
           "balance": list(best.balance), "balance_kind": "auto",
           "recompute": rc[0] if len(set(rc)) == 1 else rc, "auto": True}
    return {**cfg, "key": "auto: " + config_key(cfg)}


def run_worker(args: argparse.Namespace) -> int:
    """One rank of a launch: the machine's calibration (``--worker calibrate``), or every
    configuration of ``--spec`` one after another (``--worker run``).

    The calibration has a launch of its own: it builds a probe pipeline on rank 0 alone,
    whose ``new_group`` calls the other ranks never make, so a pipeline built after it in
    the same process group would wait for them forever."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        from pipedream_ext import diagnostics

        if args.worker == "calibrate":
            t0 = time.perf_counter()
            result["machine"] = diagnostics.calibrate(dist.group.WORLD, torch.device("cpu"),
                                                      timeout=args.pipe_timeout).to_dict()
            result["calibration_s"] = time.perf_counter() - t0
            return
        spec = json.loads(Path(args.spec).read_text())
        batches = model_batches(args.model, spec["batch"], args.seed)
        result["runs"] = []
        for cfg in spec["configs"]:
            result["runs"].append(run_config_safely(cfg, args, batches))
            LOG.info("rank %d: %s done", dist.get_rank(), cfg["key"])

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def chunks_of(schedule: str, interleaved: int) -> int:
    """Chunks per rank the runtime runs ``schedule`` with: its fixed count, ``interleaved``
    for the other multi-chunk schedules, else 1."""
    from pipedream_ext import schedules

    t = schedules.traits(schedule)
    return t.fixed_chunks or (interleaved if t.multi_chunk else 1)


def grid_configs(args: argparse.Namespace, layers: int, world: int) -> List[Dict[str, Any]]:
    """The configurations of the grid that run for a model of ``layers`` layers on ``world``
    ranks (the schedule builds, the balance exists), drawn as :func:`draw_grid` says."""
    from pipedream_ext import schedules

    def valid(p: Dict[str, Any]) -> bool:
        chunks = chunks_of(p["schedule"], args.chunks)
        if world * chunks > layers or balance_for(p["balance_kind"], layers, world * chunks) is None:
            return False
        try:
            schedules.build(p["schedule"], stages=world, microbatches=p["microbatches"], chunks=chunks)
        except ValueError:
            return False
        return True

    out = []
    for p in draw_grid(args.schedules, args.microbatches, args.balances, (False, True), args.configs,
                       args.seed + world, valid):
        chunks = chunks_of(p["schedule"], args.chunks)
        cfg = {**p, "chunks": chunks, "balance": balance_for(p["balance_kind"], layers, world * chunks),
               "auto": False}
        out.append({**cfg, "key": config_key(cfg)})
    return out


def measure_costs(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The model's per-layer costs (``diagnostics.measure_layer_costs`` at batch / 8 and
    batch / 2, one thread, in this process) as a JSON-able dict."""
    import torch

    from pipedream_ext import diagnostics

    torch.set_num_threads(1)
    batch = MODELS[name]["batch"]
    model, loss_fn = build_model(name, args.seed)
    sample = model_batches(name, batch, args.seed, count=1)[0]
    costs = diagnostics.measure_layer_costs(model, sample, loss_fn,
                                            microbatch_sizes=[max(1, batch // 8), max(1, batch // 2)])
    return costs.to_dict()


def prediction_of(layers: Sequence[Any], machine: Any, cfg: Dict[str, Any], world: int,
                  batch: int) -> Dict[str, Any]:
    """``configuration.predict`` of one run's configuration, as a dict."""
    from pipedream_ext import configuration

    stages = len(cfg["balance"])
    rc = cfg["recompute"]
    rc = [bool(rc)] * stages if isinstance(rc, bool) else [bool(x) for x in rc]
    conf = configuration.Configuration(schedule=cfg["schedule"], chunks=cfg["chunks"],
                                       microbatches=cfg["microbatches"], balance=list(cfg["balance"]),
                                       recompute=rc, mesh=(world, 1, 1))
    return configuration.predict(layers, machine, conf, batch).to_dict()


def optimizer_of(layers: Sequence[Any], machine: Any, cfg: Dict[str, Any], world: int) -> List[float]:
    """The prediction's optimizer step of each rank: its layers' ``optimizer_seconds`` plus
    the machine's per-byte and per-tensor terms (stage ``j`` runs on rank ``j % world``)."""
    bounds = list(itertools.accumulate(cfg["balance"], initial=0))
    out = [0.0] * world
    for j in range(len(cfg["balance"])):
        for layer in layers[bounds[j]:bounds[j + 1]]:
            out[j % world] += (layer.optimizer_seconds + machine.optimizer_seconds_per_byte * layer.parameter_bytes
                               + machine.optimizer_seconds_per_tensor * layer.parameter_tensors)
    return out


def _rounds_of(launch: Dict[str, Any], repeats: Sequence[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    """Every round's run of configuration ``key`` that did not fail (the first launch
    alone for a study measured before rounds existed)."""
    rounds = [r for rep in (repeats or [launch]) for r in rep.get("runs", []) if r.get("key") == key]
    return [r for r in rounds if "error" not in r]


def _median_round(rounds: Sequence[Dict[str, Any]]) -> Tuple[Dict[str, Any], float, List[float]]:
    """The round whose measured step time is the median (the lower one of an even count),
    that step time and every round's."""
    steps = [measured_step([r["step_s"] for r in run["ranks"]]) for run in rounds]
    order = sorted(range(len(rounds)), key=lambda i: steps[i])
    middle = order[(len(order) - 1) // 2]
    return rounds[middle], steps[middle], steps


def build_rows(raw: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per configuration: measured step time (the median of its rounds, and each
    round's), peak bytes and terms per rank of that median round, and the prediction (None
    when the launch gave no machine costs)."""
    from pipedream_ext import configuration

    rows = []
    for name, model in raw["models"].items():
        layers = [configuration.LayerCost.from_dict(d) for d in model["layer_costs"]["layers"]]
        for world, launch in model["launches"].items():
            costs = raw["machines"].get(world, {})
            machine = None if "error" in costs else configuration.MachineCosts.from_dict(costs)
            repeats = model.get("repeats", {}).get(world, [])
            for run in launch.get("runs", []):
                row = {k: v for k, v in run.items() if k != "ranks"}
                row.update(model=name, world=int(world))
                rounds = _rounds_of(launch, repeats, run["key"]) if "error" not in run else []
                if rounds:
                    median, row["step_s"], row["step_s_rounds"] = _median_round(rounds)
                    ranks = median["ranks"]
                    row["peak_bytes"] = [r["peak_bytes"] for r in ranks]
                    row["terms"] = [measured_terms(r, row["step_s"]) for r in ranks]
                    row["overhead_parts"] = [overhead_parts(r, row["step_s"]) for r in ranks]
                row["machine_costs"] = None if machine is None else machine.to_dict()
                if machine is not None and "error" not in run:
                    row["predicted_optimizer"] = optimizer_of(layers, machine, run, int(world))
                row["prediction"] = (prediction_of(layers, machine, run, int(world), MODELS[name]["batch"])
                                     if machine is not None else None)
                rows.append(row)
    return rows


def quiet_text(quiet: Optional[Dict[str, float]]) -> str:
    """`` (others 3%, steal 0%)`` for a launch's :class:`_harness.CpuWatch` shares, or ''."""
    if not quiet:
        return ""
    return f" (others {quiet['others_cpu_share']:.0%}, steal {quiet['steal_share']:.0%})"


def summary_table(groups: Sequence[Tuple[str, Dict[str, Any]]]) -> List[str]:
    """One line per group of runs (:func:`accuracy_summary`), against the issue's targets."""
    lines = h.table(["runs", "n", "step time: median abs error (target 10%)", "worst (25%)", "median signed",
                     "Spearman (>= 0.8)", "launches apart (median)", "peak memory: median abs error", "worst (15%)",
                     "planner's choice vs best measured (10%)", "grid's predicted best vs best measured",
                     "best measured"])
    for label, s in groups:
        st, mem = s["step"], s["memory"]
        lines.append(h.table_row([
            label, s["runs"], pct(st["median_abs"]), pct(st["worst_abs"]), pct(st["median"]),
            h.fmt(s["spearman"]), pct(s.get("round_spread")), pct(mem["median_abs"]), pct(mem["worst_abs"]),
            f"{pct(s.get('auto_vs_best'))} ({s.get('auto') or 'not run'})" if "best" in s else "",
            f"{pct(s.get('picked_vs_best'))} ({s.get('picked')})" if "best" in s else "",
            f"{s.get('best')}: {1e3 * s['best_s']:.2f} ms" if s.get("best") else "n/a"]))
    return lines


def runs_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Every run: predicted and measured step time and the largest peak of its ranks."""
    lines = h.table(["model", "ranks", "configuration", "balance", "predicted step (ms)", "measured (ms)",
                     "error", "predicted peak, max rank (MiB)", "measured (MiB)", "error"])
    for r in rows:
        cells = [r["model"], r["world"], r["key"], "-".join(map(str, r["balance"]))]
        if "error" in r:
            lines.append(h.table_row(cells + [f"failed: {r['error'][:160]}", "", "", "", "", ""]))
            continue
        p = r["prediction"]
        pred_step = p["step_seconds"] if p else None
        pred_peak = max(p["peak_bytes"]) if p else None
        meas_peak = max(r["peak_bytes"])
        lines.append(h.table_row(cells + [
            h.fmt(None if pred_step is None else 1e3 * pred_step), f"{1e3 * r['step_s']:.2f}",
            pct(relative_error(pred_step, r["step_s"])), h.fmt(None if pred_peak is None else pred_peak / MIB),
            f"{meas_peak / MIB:.2f}", pct(relative_error(pred_peak, meas_peak))]))
    return lines


def terms_table(groups: Sequence[Tuple[str, Sequence[Dict[str, Any]]]]) -> List[str]:
    """Per group, per term: the median over runs and ranks of measured and predicted ms per step."""
    lines = h.table(["runs"] + [f"{t}: measured / predicted (ms), median difference" for t in TERMS])
    for label, rows in groups:
        b = time_breakdown(rows)
        if not b:
            continue
        lines.append(h.table_row([label] + [
            f"{1e3 * b[t]['measured']:.2f} / {1e3 * b[t]['predicted']:.2f}, {1e3 * b[t]['difference']:+.2f}"
            for t in TERMS]))
    return lines


def overhead_table(groups: Sequence[Tuple[str, Sequence[Dict[str, Any]]]]) -> List[str]:
    """Per group, the measured overhead's parts (median over runs and ranks, ms per step)
    against the machine costs' per-step terms."""
    lines = h.table(["runs", "optimizer: measured / predicted (ms)", "runtime outside spans (ms)",
                     "outside the runtime: measured / predicted step_seconds (ms)"])
    for label, rows in groups:
        ok = [r for r in rows if "error" not in r and r.get("predicted_optimizer") and r.get("overhead_parts")]
        if not ok:
            continue
        parts = [p for r in ok for p in r["overhead_parts"]]
        pred_opt = [t for r in ok for t in r["predicted_optimizer"]]
        step = statistics.median(r["machine_costs"]["step_seconds"] for r in ok)
        lines.append(h.table_row([
            label, f"{1e3 * statistics.median(p['optimizer'] for p in parts):.2f} / "
                   f"{1e3 * statistics.median(pred_opt):.2f}",
            f"{1e3 * statistics.median(p['runtime'] for p in parts):.2f}",
            f"{1e3 * statistics.median(p['outside'] for p in parts):.2f} / {1e3 * step:.2f}"]))
    return lines


def plot(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    """Predicted against measured step time and peak memory (log axes, y = x and +-25% lines)."""
    plt = h.pyplot()
    ok = [r for r in rows if "error" not in r and r.get("prediction")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    colors = {"digits": "#4c72b0", "gpt": "#dd8452", "mlp": "#55a868"}
    markers = {2: "o", 4: "^"}
    panels = [(axes[0], lambda r: [r["prediction"]["step_seconds"] * 1e3], lambda r: [r["step_s"] * 1e3],
               "step time (ms)"),
              (axes[1], lambda r: [b / MIB for b in r["prediction"]["peak_bytes"]],
               lambda r: [b / MIB for b in r["peak_bytes"]], "peak memory per rank (MiB)")]
    for ax, pred, meas, what in panels:
        values = []
        for (model, world), color in ((k, colors.get(k[0], "k")) for k in sorted({(r["model"], r["world"])
                                                                                   for r in ok})):
            mine = [r for r in ok if r["model"] == model and r["world"] == world]
            xs = [v for r in mine for v in pred(r)]
            ys = [v for r in mine for v in meas(r)]
            values += xs + ys
            ax.scatter(xs, ys, c=color, marker=markers.get(world, "s"), s=22, alpha=0.75,
                       label=f"{model}, {world} ranks")
            ax.scatter([x for r in mine if r.get("auto") for x in pred(r)],
                       [y for r in mine if r.get("auto") for y in meas(r)], facecolors="none",
                       edgecolors="k", marker="o", s=110, linewidths=1.2)
        if values:
            lo, hi = min(values) * 0.8, max(values) * 1.25
            ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
            for f, style in ((1.1, ":"), (1.25, "--")):
                ax.plot([lo, hi], [lo * f, hi * f], "k" + style, lw=0.6)
                ax.plot([lo, hi], [lo / f, hi / f], "k" + style, lw=0.6)
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"predicted {what}")
        ax.set_ylabel(f"measured {what}")
        ax.set_title(f"{what}: measured vs predicted (lines: y = x, +-10%, +-25%)", fontsize=9)
    axes[0].legend(fontsize=7, title="circled: planner's choice", title_fontsize=7)
    h.save_figure(fig, path)


def calibrate_worlds(args: argparse.Namespace, raw: Dict[str, Any]) -> None:
    """One calibration launch per world size: ``raw["machines"][world]`` (or the error)."""
    script = Path(__file__).resolve()
    for world in args.workers:
        result = h.launch_torchrun(script, world, ["--worker", "calibrate"] + h.forward(args, "pipe_timeout"),
                                   JSON_TAG, args.timeout)
        raw["launch_s"][f"calibrate {world}"] = result.get("launch_s", 0.0)
        if "machine" in result:
            raw["machines"][str(world)] = result["machine"]
            LOG.info("%d ranks: machine costs %s", world, result["machine"])
        else:
            LOG.error("%d ranks: calibration failed: %s", world, result.get("error"))
            raw["machines"][str(world)] = {"error": result.get("error", "no result")}


def _spec_of(name: str, world: int, costs: Dict[str, Any], raw: Dict[str, Any], args: argparse.Namespace,
             launch: Dict[str, Any]) -> Dict[str, Any]:
    """The configurations one (model, world size) launch runs: the grid and, unless
    ``--no-auto``, the planner's choice (an error finding it is kept in ``launch``)."""
    spec = {"batch": MODELS[name]["batch"], "schedules": args.schedules, "microbatches": args.microbatches,
            "chunks": args.chunks, "layers": costs["layers"],
            "configs": grid_configs(args, len(costs["layers"]), world)}
    machine = raw["machines"][str(world)]
    if not args.no_auto and "error" not in machine:
        try:
            spec["configs"].append(auto_config(spec, machine, world))
        except ValueError as exc:  # nothing fits: reported, the grid still runs
            launch["auto_error"] = str(exc)
    return spec


def measure_all(args: argparse.Namespace, command: str, info: Dict[str, str]) -> Dict[str, Any]:
    """Machine costs per world size, layer costs of every model and ``--repeats`` rounds of
    one launch per (model, world size) running the grid and the planner's choice (the same
    configurations every round: launch-to-launch noise is measured, not averaged away
    unseen); the raw results, ``launches[world]`` the first round and ``repeats[world]``
    every round."""
    script = Path(__file__).resolve()
    common = h.forward(args, "pipe_timeout", "steps", "warmup", "seed", "lr")
    raw: Dict[str, Any] = {"machine": info, "command": command, "options": h.run_options(args, "report_only"),
                           "models": {}, "machines": {}, "launch_s": {}, "quiet": {}}
    calibrate_worlds(args, raw)
    with tempfile.TemporaryDirectory() as tmp:
        specs: Dict[Tuple[str, int], Path] = {}
        for name in args.models:
            LOG.info("%s: measuring layer costs", name)
            costs = measure_costs(name, args)
            raw["models"][name] = {"layer_costs": costs, "launches": {}, "repeats": {}}
            for world in args.workers:
                launch: Dict[str, Any] = {}
                spec = _spec_of(name, world, costs, raw, args, launch)
                raw["models"][name]["launches"][str(world)] = launch
                specs[name, world] = Path(tmp) / f"spec_{name}_{world}.json"
                specs[name, world].write_text(json.dumps(spec))
        for round_ in range(args.repeats):
            for (name, world), path in specs.items():
                LOG.info("%s, %d ranks: round %d of %d", name, world, round_ + 1, args.repeats)
                result = h.launch_torchrun(script, world, ["--worker", "run", "--spec", str(path), "--model", name]
                                           + common, JSON_TAG, args.timeout)
                label = f"{name} {world}" + (f" #{round_ + 1}" if args.repeats > 1 else "")
                raw["launch_s"][label] = result.get("launch_s", 0.0)
                raw["quiet"][label] = {k: result[k] for k in ("others_cpu_share", "steal_share") if k in result}
                if "error" in result:
                    LOG.error("%s, %d ranks: %s", name, world, result["error"])
                model = raw["models"][name]
                model["repeats"].setdefault(str(world), []).append(result)
                if round_ == 0:
                    model["launches"][str(world)] = {**result, **model["launches"][str(world)]}
    return raw


def report(raw: Dict[str, Any], rows: List[Dict[str, Any]], total_s: float) -> str:
    """The Markdown report of a study."""
    opts = raw["options"]
    groups = [(f"{m}, {w} ranks", [r for r in rows if r["model"] == m and r["world"] == w])
              for m in raw["models"] for w in sorted({r["world"] for r in rows if r["model"] == m})]
    summaries = [(label, accuracy_summary(rs)) for label, rs in groups]
    summaries.append(("all", accuracy_summary(rows, choice=False)))
    machines = [f"{w} ranks: " + (machine["error"] if "error" in machine else
                                  ", ".join(f"{k}={v:.3g}" for k, v in machine.items()))
                for w, machine in raw["machines"].items()]
    auto_errors = [f"{m}, {w} ranks: {launch['auto_error']}" for m, model in raw["models"].items()
                   for w, launch in model["launches"].items() if "auto_error" in launch]
    launch_text = ", ".join(f"{k} {v:.0f} s{quiet_text(raw.get('quiet', {}).get(k))}"
                            for k, v in raw["launch_s"].items())
    rounds = opts.get("repeats", 1)
    lines = ["# Configuration planner: predicted vs measured", "",
             f"Command: `{raw['command']}` (total {total_s:.0f} s; launches: {launch_text}).", "",
             h.machine_line(raw["machine"]) + " One thread per rank, Gloo.", "",
             "Models: " + "; ".join(f"**{m}** ({MODELS[m]['text']}, batch {MODELS[m]['batch']})"
                                   for m in raw["models"]) + ". Adam (lr "
             f"{opts['lr']}), {opts['warmup']} warm-up steps, one step under the memory probe, "
             f"{opts['steps']} timed steps per configuration. Grid: {', '.join(opts['schedules'])} x "
             f"microbatches {opts['microbatches']} x balance {', '.join(opts['balances'])} x recompute off/on, "
             f"{opts['configs']} drawn per model and world size (seed {opts['seed']}), plus the planner's "
             "choice (`configuration.search` over the same schedules and microbatch counts, balance and "
             "recompute per stage searched).", "",
             "Step time: median over timed steps of the slowest rank's step (`pipe.step` + `opt.step()` + "
             f"`zero_grad`), then the median over {rounds} launch{'es' if rounds > 1 else ''} of the same "
             "configurations (*launches apart*: the median over configurations of (slowest - fastest) / "
             "median of their launches: what the machine itself varies). In brackets after each launch: the "
             "share of the CPUs other processes (*others*) and the hypervisor (*steal*) took meanwhile. "
             "Peak memory per rank: weights and optimizer state held at the probe's start plus the "
             "largest amount allocated above it during one step (torch.profiler memory events, as "
             "benchmarks/memory.py). Predicted: `configuration.predict` with the layer costs measured in the "
             "driver and the machine costs calibrated per world size (a launch of its own). Error = measured / "
             "predicted - 1.", "",
             "## Accuracy", ""]
    lines += summary_table(summaries)
    lines += ["", "## Where the time goes", "",
              "Per rank and step (median over the runs and ranks of each group), measured from `pipe.stats()` "
              "against the prediction's terms (`Prediction.breakdown`, measured by "
              "`configuration.measured_breakdown`, as the run's own check does): compute (F, B, I, W), waits "
              "(receives, sends, the tied weights' all-reduce; the prediction's idle time in the simulated "
              "makespan), transfers (posting sends), all-reduce (the replicas' gradients: none here, every "
              "run is one pipeline) and overhead (the rest of the step: the runtime's own time, the `step` "
              "call, the optimizer, the loss all-reduce; predicted: per-step costs and the optimizer).", ""]
    lines += terms_table(groups)
    lines += ["", "The overhead in parts (median over runs and ranks): the user's optimizer step and `zero_grad` "
              "against the rank's layers' `optimizer_seconds` (Adam over copies of their parameters, less its "
              "per-step part, which `step_seconds` holds); the runtime's time outside its F/B/I/W, wait and send "
              "spans (predicted inside compute, as `action_seconds` per action); the rest of the step outside the "
              "runtime against `step_seconds`.", ""]
    lines += overhead_table(groups)
    lines += ["", "Machine costs (`diagnostics.calibrate`, one launch per world size):", ""]
    lines += [f"* {m}" for m in machines]
    if auto_errors:
        lines += ["", "The planner found no configuration:", ""] + [f"* {e}" for e in auto_errors]
    lines += ["", "## Every run", ""] + runs_table(rows)
    lines += ["", "![predicted vs measured](plan_accuracy.png)", ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    """The study (or, with ``--report-only``, its report from saved measurements); exit
    status 1 when a run failed."""
    t_start = time.perf_counter()
    out_dir = Path(args.out_dir)
    if args.report_only:
        raw = json.loads(Path(args.report_only).read_text())["raw"]
    else:
        info, command = h.start_report(LOG)
        raw = measure_all(args, command, info)
        raw["measure_s"] = time.perf_counter() - t_start
        # The measurements first: a report that fails can be made again with --report-only.
        h.write_results(out_dir, "plan_accuracy", "(no report yet)", {"raw": raw}, echo=False)
    rows = build_rows(raw)
    text = report(raw, rows, raw.get("measure_s", 0.0))
    h.write_results(out_dir, "plan_accuracy", text, {"raw": raw, "rows": rows})
    plot(rows, out_dir / "plan_accuracy.png")
    LOG.info("done in %.0f s", time.perf_counter() - t_start)
    return 1 if any("error" in r for r in rows) else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    def names(s: str) -> List[str]:
        return [v for v in s.split(",") if v]

    def ints(s: str) -> List[int]:
        return [int(v) for v in s.split(",") if v]

    p = h.make_parser(__doc__, ("run", "calibrate"))
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--models", type=names, default=list(MODELS), help="default: digits,gpt,mlp")
    p.add_argument("--workers", type=ints, default=[2, 4], help="world sizes (default 2,4)")
    p.add_argument("--schedules", type=names, default=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
    p.add_argument("--chunks", type=int, default=2, help="chunks per rank of interleaved schedules")
    p.add_argument("--microbatches", type=ints, default=[2, 4, 8])
    p.add_argument("--balances", type=names, default=["even", "skewed"])
    p.add_argument("--configs", type=int, default=24, help="configurations drawn per model and world size")
    p.add_argument("--no-auto", action="store_true", help="do not run the planner's choice")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--repeats", type=int, default=1, help="launches of every (model, world size), the "
                   "same configurations each time; the step time is their median (default 1)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun launch")
    p.add_argument("--pipe-timeout", type=float, default=120.0, help="PipeDream(timeout=) in the workers")
    p.add_argument("--report-only", metavar="JSON", help="re-read a study's plan_accuracy.json: predictions "
                   "and report again, no measurement")
    args = p.parse_args(argv)
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; use {','.join(MODELS)}")
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be at least 1")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
