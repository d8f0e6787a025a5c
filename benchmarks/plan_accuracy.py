"""How good is the profile-plan-run loop? Predicted against measured stage times and
throughput for the digits CNN (examples/train_digits.py) on this machine.

1. **Profile** the example's CNN with ``pd.profile`` at the microbatch size used in
   training (``--batch-size`` / ``--microbatches`` = 64 / 4 = 16 samples), in this
   process with one thread (like every rank), on real digits.
2. **Bandwidth**: ``--bandwidth`` bytes/s, or measured with a Gloo ping-pong of
   ``--probe-bytes`` between two local ranks (the probe ``balance="auto"`` uses).
3. **Plan** for each of ``--workers`` (2 and 4) with each of ``--cost-models``
   (``pipedream`` with ``--compression`` as PipeDream's activation compression
   ratio, default none, i.e. boundary transfers free as in PipeDream's optimizer;
   ``default``, which always pays them).
4. **Run** every plan under ``torch.distributed.run`` (one launch per world size,
   the plans one after another in it, Gloo, one thread per rank) with ``1f1b``
   (``--batch-size`` per step in ``--microbatches``), and plans of the
   ``pipedream`` model also with ``pipedream`` (asynchronous PipeDream, one minibatch
   of batch-size/microbatches per step: the steady state PipeDream's cost model
   describes). ``--warmup`` steps, a flush, then ``--steps`` timed steps (pipedream:
   ``--steps`` x microbatches minibatches, the same samples), Adam as in the example.
5. **Compare** per stage: predicted compute per microbatch (the plan's
   ``compute_seconds`` = the profiled forward+backward of the stage's layers on one
   worker) against measured ``pipe.stats()["seconds_by_kind"]`` F+B (+I+W) per
   microbatch that rank ran; the plan's stage ``time`` (per microbatch of the
   pipeline: compute / replicas plus what the cost model charges for all-reduce and
   transfers) against the measured share (F+B+ALLREDUCE seconds per microbatch of
   the pipeline, the slowest replica); per run: the plan's steady-state throughput
   (microbatch / ``time_per_stage``) and the schedule simulated with the profiled
   per-stage costs (bubble and flush included) against measured samples/s (samples
   / slowest rank's wall time, final flush included). Relative error =
   measured / predicted - 1.

Writes ``<out-dir>/plan_accuracy.md`` (tables, machine, command),
``<out-dir>/plan_accuracy.json`` (raw) and ``<out-dir>/plan_accuracy.png``.
Command, from the repository root (about a minute on an idle 2-core machine):

    python3 benchmarks/plan_accuracy.py [--workers 2,4] [--steps 100] [--bandwidth 1e9]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from _harness import pct  # noqa: E402

__all__ = ["async_minibatches", "breakdown_table", "build_rows", "describe_plan", "main", "measured_stages",
           "merge_rows", "parse_args", "plot", "predictions", "profile_digits", "relative_error", "replica_share",
           "run_config", "run_config_safely", "run_driver", "run_label", "run_table", "run_worker",
           "runtime_rejects", "schedules_for", "short", "stage_profile_costs", "stage_table", "time_breakdown"]

LOG = logging.getLogger("plan_accuracy")
JSON_TAG = "PLAN_ACCURACY_JSON "
COMPUTE_KINDS = ("F", "B", "I", "W")


# ----------------------------------------------------------------------------- pure helpers
def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """``measured / predicted - 1`` (None if either is missing or predicted is 0)."""
    if predicted is None or measured is None or predicted == 0:
        return None
    return measured / predicted - 1.0


def replica_share(total: int, replicas: int, index: int) -> int:
    """Microbatches out of ``total`` that replica ``index`` of ``replicas`` runs
    (round robin: microbatch i goes to replica i mod replicas)."""
    if not 0 <= index < replicas:
        raise ValueError(f"replica index {index} out of range for {replicas} replicas")
    return len(range(index, total, replicas))


def stage_profile_costs(nodes: Sequence[Dict[str, Any]], layers: Tuple[int, int]) -> Dict[str, float]:
    """Profiled forward / backward seconds and output bytes of layers ``[start, end)``.

    ``nodes`` are ``ProfileGraph.nodes()`` of a chain profile: ``node1`` is the Input,
    ``node{i+2}`` layer i."""
    by_id = {n["id"]: n for n in nodes}
    start, end = layers
    picked = [by_id[f"node{i + 2}"] for i in range(start, end)]
    return {"forward_s": sum(n["forward_ms"] for n in picked) / 1e3,
            "backward_s": sum(n["backward_ms"] for n in picked) / 1e3,
            "output_bytes": float(picked[-1]["activation_bytes"]) if picked else 0.0,
            "parameter_bytes": float(sum(n["parameter_bytes"] for n in picked))}


def measured_stages(ranks: Sequence[Dict[str, Any]], pipeline_microbatches: int) -> Dict[int, Dict[str, float]]:
    """Per stage, from every rank's stats of one timed run.

    Each rank dict has ``stage``, ``replica``, ``replicas``, ``seconds_by_kind``.
    ``pipeline_microbatches`` is how many microbatches (minibatches for pipedream)
    went through the pipeline in the timed run.

    Returns per stage: ``compute_s`` (mean over replicas of F+B+I+W seconds per
    microbatch the replica ran), ``stage_s`` (slowest replica's F+B+I+W+ALLREDUCE
    seconds per microbatch of the pipeline), ``allreduce_s`` (likewise, all-reduce
    only), ``replicas``.
    """
    out: Dict[int, Dict[str, float]] = {}
    stages = sorted({r["stage"] for r in ranks})
    for j in stages:
        members = [r for r in ranks if r["stage"] == j]
        per_mb, shares, allreduce = [], [], []
        for r in members:
            kinds = r["seconds_by_kind"]
            compute = sum(kinds.get(k, 0.0) for k in COMPUTE_KINDS)
            ran = replica_share(pipeline_microbatches, r["replicas"], r["replica"])
            per_mb.append(compute / ran if ran else 0.0)
            shares.append((compute + kinds.get("ALLREDUCE", 0.0)) / pipeline_microbatches)
            allreduce.append(kinds.get("ALLREDUCE", 0.0) / pipeline_microbatches)
        out[j] = {"compute_s": statistics.mean(per_mb), "stage_s": max(shares),
                  "allreduce_s": max(allreduce), "replicas": float(members[0]["replicas"])}
    return out


def merge_rows(rows: Sequence[Dict[str, Any]], same: Sequence[str]) -> List[Dict[str, Any]]:
    """Rows that agree on every field in ``same`` become one row whose ``plans`` lists
    every merged row's ``plan_name`` (order kept): plans with the same partition ran once."""
    merged: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for row in rows:
        key = tuple(round(v, 9) if isinstance(v, float) else str(v) for v in (row.get(f) for f in same))
        if key in merged:
            merged[key]["plans"].append(row["plan_name"])
        else:
            merged[key] = {**row, "plans": [row["plan_name"]]}
    return list(merged.values())


def async_minibatches(steps: int, microbatches: int, replicas: Sequence[int]) -> int:
    """Minibatches of a pipedream run with the samples of ``steps`` batches, rounded up to
    a multiple of the lcm of the replica counts (the runtime flushes only after whole
    rounds of replicas)."""
    period = 1
    for r in replicas:
        period = period * r // math.gcd(period, r)
    n = steps * microbatches
    return -(-n // period) * period


WAIT_KINDS = ("RECV_F", "RECV_B", "SEND_WAIT", "ALLREDUCE")
SEND_KINDS = ("SEND_F", "SEND_B")


def time_breakdown(ranks: Sequence[Dict[str, Any]], steps: int) -> Dict[str, float]:
    """Where a rank's wall time per step goes, mean over ranks (seconds per step).

    ``compute``: F+B+I+W; ``waits``: blocked on receives, sends and all-reduces;
    ``sends``: posting sends; ``update``: U (asynchronous optimizer steps); ``other``:
    the rest of the time inside the runtime; ``outside``: wall time outside it (the
    Python step call, the optimizer step of flush schedules, the loss all-reduce)."""
    keys = ("wall", "compute", "waits", "sends", "update", "other", "outside")
    total = {k: 0.0 for k in keys}
    for r in ranks:
        kinds = r["seconds_by_kind"]
        part = {"wall": r["elapsed_s"], "compute": sum(kinds.get(k, 0.0) for k in COMPUTE_KINDS),
                "waits": sum(kinds.get(k, 0.0) for k in WAIT_KINDS),
                "sends": sum(kinds.get(k, 0.0) for k in SEND_KINDS), "update": kinds.get("U", 0.0)}
        part["other"] = max(r["busy_s"] - part["compute"] - part["waits"] - part["sends"] - part["update"], 0.0)
        part["outside"] = max(r["elapsed_s"] - r["busy_s"], 0.0)
        for k in keys:
            total[k] += part[k] / steps / len(ranks)
    return total


def describe_plan(layers: Sequence[Sequence[int]], replicas: Sequence[int]) -> str:
    """``[0,3)x1 [3,10)x1``: layer ranges and replica counts per stage."""
    return " ".join(f"[{a},{b})x{r}" for (a, b), r in zip(layers, replicas))


# ----------------------------------------------------------------------------- worker
def _digits():
    """examples/train_digits.py's ``make_model`` and ``load_digits``."""
    module = h.digits()
    return module.make_model, module.load_digits


def run_config(cfg: Dict[str, Any], args: argparse.Namespace, batches) -> Dict[str, Any]:
    """One plan with one schedule: warm-up, flush, timed steps; every rank's stats."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipedream_ext as pd

    make_model, _ = _digits()
    rank = dist.get_rank()
    M = args.microbatches
    pipe = pd.PipeDream(make_model(args.seed), F.cross_entropy, schedule=cfg["schedule"],
                        microbatches=M, balance=cfg["plan"], timeout=args.pipe_timeout)
    params = list(pipe.parameters())
    opt = torch.optim.Adam(params, lr=args.lr) if params else None
    if pipe.asynchronous:
        mb = args.batch_size // M
        feed = [(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for x, y in batches for i in range(M)]
        warmup = async_minibatches(args.warmup, M, pipe.replicas)
        steps, samples_per_step = async_minibatches(args.steps, M, pipe.replicas), mb

        def one(i: int) -> None:
            x, y = feed[i % len(feed)]
            pipe.step(x, y, optimizer=opt)
    else:
        feed = list(batches)
        warmup, steps, samples_per_step = args.warmup, args.steps, args.batch_size

        def one(i: int) -> None:
            x, y = feed[i % len(feed)]
            pipe.step(x, y)
            if opt is not None:
                opt.step()
                opt.zero_grad()

    pipe.train()
    for i in range(warmup):
        one(i)
    pipe.flush()
    pipe.reset_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        one(warmup + i)
    pipe.flush()
    elapsed = time.perf_counter() - t0
    wall = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    st = pipe.stats()
    stage = pipe.stage_index
    mine = {"rank": rank, "stage": stage, "replica": pipe._schedule.stage_ranks(stage).index(rank),
            "replicas": pipe.replicas[stage], "elapsed_s": elapsed,
            "seconds_by_kind": st["seconds_by_kind"], "compute_s": st["compute_s"], "wait_s": st["wait_s"],
            "busy_s": st["busy_s"], "bubble_fraction": st["bubble_fraction"]}
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    return {"key": cfg["key"], "schedule": cfg["schedule"], "wall_s": float(wall.item()),
            "steps": steps, "samples": steps * samples_per_step,
            "pipeline_microbatches": steps * (1 if pipe.asynchronous else M),
            "samples_per_s": steps * samples_per_step / float(wall.item()), "ranks": gathered}


def run_config_safely(cfg: Dict[str, Any], args: argparse.Namespace, batches) -> Dict[str, Any]:
    """:func:`run_config`; an error on any rank becomes this run's result on every rank."""
    import torch
    import torch.distributed as dist

    try:
        out = run_config(cfg, args, batches)
        failed = torch.zeros(1)
    except Exception as exc:  # noqa: BLE001 - reported as data
        LOG.exception("rank %d: %s failed", dist.get_rank(), cfg["key"])
        out = {"key": cfg["key"], "error": f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"}
        failed = torch.ones(1)
    dist.all_reduce(failed)  # an exception inside a collective above leaves the others waiting
    if failed.item() and "error" not in out:
        out = {"key": cfg["key"], "error": "failed on another rank (see its log)"}
    return out


def run_worker(args: argparse.Namespace) -> int:
    """One rank: the bandwidth probe (``--worker bandwidth``) or every configuration of
    ``--configs`` (``--worker run``)."""
    def body(result: Dict[str, Any]) -> None:
        import torch.distributed as dist

        from pipedream_ext._dist.collectives import measure_bandwidth

        if args.worker == "bandwidth":
            result["bandwidth"] = measure_bandwidth(dist.group.WORLD, 0, 1, size=args.probe_bytes,
                                                    rounds=args.probe_rounds)
            return
        _, load_digits = _digits()
        train, _ = load_digits(args.seed)
        X, Y = train.tensors
        B = args.batch_size
        batches = [(X[i * B:(i + 1) * B], Y[i * B:(i + 1) * B]) for i in range(len(X) // B)]
        configs = json.loads(Path(args.configs).read_text())
        result["runs"] = [run_config_safely(cfg, args, batches) for cfg in configs]

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def profile_digits(args: argparse.Namespace):
    """The digits CNN profiled at the training microbatch size, one thread."""
    import torch
    import torch.nn.functional as F

    import pipedream_ext as pd

    torch.set_num_threads(1)
    make_model, load_digits = _digits()
    train, _ = load_digits(args.seed)
    mb = args.batch_size // args.microbatches
    x, y = train.tensors[0][:mb], train.tensors[1][:mb]
    return pd.profile(make_model(args.seed), x, loss_fn=F.cross_entropy, target=y,
                      steps=args.profile_steps, warmup=args.profile_warmup)


def predictions(plan, nodes: Sequence[Dict[str, Any]], schedule: str, args: argparse.Namespace,
                bandwidth: float) -> Dict[str, Any]:
    """Per-stage predictions of a plan and the simulated throughput of ``schedule``."""
    from pipedream_ext import schedules

    M, B = args.microbatches, args.batch_size
    mb = B // M
    stages = []
    for st in plan.stages:
        costs = stage_profile_costs(nodes, st.layers)
        stages.append({"layers": list(st.layers), "replicas": st.replicas, "time_s": st.time,
                       "compute_s": st.compute_seconds, **costs})
    p = len(stages)
    replicas = [s["replicas"] for s in stages]
    t_comm = [s["output_bytes"] / bandwidth for s in stages[:-1]]
    t_ar = [2 * (r - 1) / r * s["parameter_bytes"] / bandwidth for s, r in zip(stages, replicas)]
    if schedule == "pipedream":
        n = async_minibatches(args.steps, M, replicas)
        sim = schedules.build("pipedream", stages=p, microbatches=n, replicas=replicas)
        samples = n * mb
    else:
        sim = schedules.build(schedule, stages=p, microbatches=M, replicas=replicas)
        samples = B
    res = sim.simulate(t_f=[s["forward_s"] for s in stages], t_b=[s["backward_s"] for s in stages],
                       t_comm=t_comm, t_allreduce=t_ar)
    return {"stages": stages, "steady_samples_per_s": mb / plan.time_per_stage,
            "simulated_samples_per_s": samples / res.makespan, "simulated_bubble": res.bubble_fraction,
            "time_per_stage_s": plan.time_per_stage}


def build_rows(plans: Dict[Tuple[int, str], Any], runs: Dict[Tuple[int, str, str], Dict[str, Any]],
               nodes: Sequence[Dict[str, Any]], args: argparse.Namespace,
               bandwidth: float) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Stage rows and throughput rows for every (workers, cost model, schedule) run."""
    stage_rows, run_rows = [], []
    for (w, cm, variant), plan in plans.items():
        for schedule in schedules_for(cm, args):
            run = runs.get((w, cm, variant, schedule))
            pred = predictions(plan, nodes, schedule, args, bandwidth)
            label = run_label(w, cm, variant, schedule)
            plan_text = describe_plan([s["layers"] for s in pred["stages"]], plan.replicas)
            plan_name = f"{cm}{' (straight)' if variant == 'straight' else ''}"
            base = {"label": label, "plan_name": plan_name, "workers": w, "cost_model": cm, "variant": variant, "schedule": schedule,
                    "plan": plan_text, "speedup": plan.speedup_over_dp}
            if run is None or "error" in run:
                run_rows.append({**base, "error": (run or {}).get("error", "not run"),
                                 "rejected": bool((run or {}).get("rejected")), **pred})
                continue
            meas = measured_stages(run["ranks"], run["pipeline_microbatches"])
            for j, ps in enumerate(pred["stages"]):
                m = meas.get(j, {})
                stage_rows.append({
                    **base, "stage": j,
                    "layers": ps["layers"], "replicas": ps["replicas"],
                    "pred_compute_ms": ps["compute_s"] * 1e3,
                    "meas_compute_ms": m.get("compute_s", float("nan")) * 1e3,
                    "compute_err": relative_error(ps["compute_s"], m.get("compute_s")),
                    "pred_stage_ms": ps["time_s"] * 1e3,
                    "meas_stage_ms": m.get("stage_s", float("nan")) * 1e3,
                    "stage_err": relative_error(ps["time_s"], m.get("stage_s")),
                    "meas_allreduce_ms": m.get("allreduce_s", 0.0) * 1e3,
                })
            bubbles = [r["bubble_fraction"] for r in run["ranks"]]
            run_rows.append({**base, **pred,
                             "measured_samples_per_s": run["samples_per_s"], "wall_s": run["wall_s"],
                             "measured_bubble": statistics.mean(bubbles),
                             "steady_err": relative_error(pred["steady_samples_per_s"], run["samples_per_s"]),
                             "simulated_err": relative_error(pred["simulated_samples_per_s"],
                                                             run["samples_per_s"]),
                             "breakdown": time_breakdown(run["ranks"], run["steps"])})
    stage_rows = merge_rows(stage_rows, ("workers", "plan", "schedule", "stage", "pred_stage_ms"))
    run_rows = merge_rows(run_rows, ("workers", "plan", "schedule", "steady_samples_per_s",
                                     "simulated_samples_per_s", "error"))
    for row in stage_rows + run_rows:
        row["label"] = f"{row['workers']} workers, {row['schedule']}: {' = '.join(row['plans'])}"
    return stage_rows, run_rows


def run_label(workers: int, cost_model: str, variant: str, schedule: str) -> str:
    """``4 workers, pipedream model (straight), 1f1b``."""
    return f"{workers} workers, {cost_model} model{' (straight)' if variant == 'straight' else ''}, {schedule}"


def runtime_rejects(schedule: str, replicas: Sequence[int]) -> Optional[str]:
    """The runtime's own check of an asynchronous layout (None if it accepts it)."""
    if schedule not in ("pipedream", "pipedream-2bw"):
        return None
    from pipedream_ext import _C

    try:
        _C.AsyncActionFeed(schedule, stages=len(replicas), microbatches=1, replicas=list(replicas),
                             vertical_sync=False)
    except ValueError as exc:
        return f"runtime rejects the layout: {exc}"
    return None


def schedules_for(cost_model: str, args: argparse.Namespace) -> List[str]:
    """1f1b for every plan; pipedream (async) too for plans of the pipedream model."""
    out = ["1f1b"]
    if cost_model == "pipedream" and not args.no_async:
        out.append("pipedream")
    return out


def stage_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Per stage: predicted against measured compute and stage time."""
    return h.table(["run", "stage", "layers", "replicas", "predicted F+B per microbatch (ms)", "measured (ms)",
                    "error", "predicted stage time (ms)", "measured (ms)", "error", "of which all-reduce (ms)"],
                   [[r["label"], r["stage"], f"[{r['layers'][0]}, {r['layers'][1]})", r["replicas"],
                     f"{r['pred_compute_ms']:.3f}", f"{r['meas_compute_ms']:.3f}", pct(r["compute_err"]),
                     f"{r['pred_stage_ms']:.3f}", f"{r['meas_stage_ms']:.3f}", pct(r["stage_err"]),
                     f"{r['meas_allreduce_ms']:.3f}"] for r in rows])


def breakdown_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Per run: where a step's wall time goes."""
    lines = h.table(["run", "wall per step (ms)", "F+B", "waiting on peers", "posting sends",
                     "optimizer in runtime (U)", "other runtime", "outside the runtime"])
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        wall = b["wall"] or 1e-12
        lines.append(h.table_row([r["label"], f"{1e3 * b['wall']:.2f}"]
                                 + [f"{1e3 * b[k]:.2f} ({100 * b[k] / wall:.0f}%)"
                                    for k in ("compute", "waits", "sends", "update", "other", "outside")]))
    return lines


def run_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Per run: predicted (plan, simulated) against measured throughput and bubble."""
    lines = h.table(["run", "plan (layers x replicas)", "predicted speedup over DP",
                     "predicted samples/s, plan steady state", "predicted, schedule simulated",
                     "measured samples/s", "error vs steady state", "error vs simulated",
                     "simulated / measured bubble"])
    for r in rows:
        cells = [r["label"], r["plan"], f"{r.get('speedup', 0):.2f}", f"{r['steady_samples_per_s']:.0f}",
                 f"{r['simulated_samples_per_s']:.0f}"]
        if "error" in r:
            cells += [f"{'not run' if r.get('rejected') else 'failed'}: {r['error'][:160]}", "", "", ""]
        else:
            cells += [f"{r['measured_samples_per_s']:.0f}", pct(r["steady_err"]), pct(r["simulated_err"]),
                      f"{r['simulated_bubble']:.2f} / {r['measured_bubble']:.2f}"]
        lines.append(h.table_row(cells))
    return lines


def short(row: Dict[str, Any]) -> str:
    """Compact plot label of a run row."""
    names = "/".join(n.replace("pipedream", "pd").replace("default", "def").replace(" (straight)", "-str")
                     for n in row.get("plans", [row.get("plan_name", "")]))
    return f"{row['workers']}w {row['schedule']} {names}"


def plot(stage_rows: List[Dict[str, Any]], run_rows: List[Dict[str, Any]], path: Path) -> None:
    plt = h.pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{short(r)} s{r['stage']}" for r in stage_rows]
    xs = range(len(stage_rows))
    ax1.bar([x - 0.2 for x in xs], [r["pred_compute_ms"] for r in stage_rows], 0.4, label="predicted (profile)",
            color="#4c72b0")
    ax1.bar([x + 0.2 for x in xs], [r["meas_compute_ms"] for r in stage_rows], 0.4,
            label="measured (stats F+B)", color="#dd8452")
    ax1.set_xticks(list(xs))
    ax1.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax1.set_ylabel("forward+backward per microbatch (ms)")
    ax1.set_title("Per stage: predicted vs measured compute")
    ax1.legend(fontsize=8)
    ok = [r for r in run_rows if "error" not in r]
    xs2 = range(len(ok))
    ax2.bar([x - 0.27 for x in xs2], [r["steady_samples_per_s"] for r in ok], 0.27, label="plan, steady state",
            color="#4c72b0")
    ax2.bar(list(xs2), [r["simulated_samples_per_s"] for r in ok], 0.27, label="plan + schedule simulated",
            color="#8172b3")
    ax2.bar([x + 0.27 for x in xs2], [r["measured_samples_per_s"] for r in ok], 0.27, label="measured",
            color="#dd8452")
    ax2.set_xticks(list(xs2))
    ax2.set_xticklabels([short(r) for r in ok], rotation=40,
                        ha="right", fontsize=7)
    ax2.set_ylabel("samples/s")
    ax2.set_title("Throughput: predicted vs measured")
    ax2.legend(fontsize=8)
    h.save_figure(fig, path)


def run_driver(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import pipedream_ext as pd

    t_start = time.perf_counter()
    out_dir = Path(args.out_dir)
    info, command = h.start_report(LOG)
    script = Path(__file__).resolve()
    common = h.forward(args, "pipe_timeout", "batch_size", "microbatches", "steps", "warmup", "seed", "lr")

    LOG.info("profiling the digits CNN at microbatch %d", args.batch_size // args.microbatches)
    graph = profile_digits(args)
    nodes = graph.nodes()
    single_ms = sum(n["forward_ms"] + n["backward_ms"] for n in nodes)
    if args.bandwidth:
        bandwidth, bw_source = args.bandwidth, "given (--bandwidth)"
    else:
        r = h.launch_torchrun(script, 2, ["--worker", "bandwidth"] + h.forward(args, "probe_bytes", "probe_rounds"),
                              JSON_TAG, args.timeout)
        if "error" in r:
            LOG.error("bandwidth probe failed: %s", r["error"])
            return 1
        bandwidth = r["bandwidth"]
        bw_source = (f"measured: Gloo ping-pong of {args.probe_bytes} bytes x {args.probe_rounds} rounds "
                     "between 2 local ranks")
    LOG.info("bandwidth %.3g B/s (%s)", bandwidth, bw_source)

    plans: Dict[Tuple[int, str], Any] = {}
    runs: Dict[Tuple[int, str, str], Dict[str, Any]] = {}
    launches: Dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in tqdm(args.workers, desc="world sizes", unit="launch"):
            configs, owners = [], {}
            for cm in args.cost_models:
                for variant in args.variants:
                    ratio = args.compression if cm == "pipedream" else None
                    plan = pd.plan(graph, workers=[w], bandwidth=[bandwidth], cost_model=cm,
                                   activation_compression_ratio=ratio, straight=variant == "straight")
                    plans[(w, cm, variant)] = plan
                    path = Path(tmp) / f"plan_{w}_{cm}_{variant}.json"
                    plan.save(path)
                    for schedule in schedules_for(cm, args):
                        owner = (w, cm, variant, schedule)
                        rejected = runtime_rejects(schedule, plan.replicas)
                        if rejected:
                            LOG.warning("%s: %s", run_label(*owner), rejected)
                            runs[owner] = {"error": rejected, "rejected": True}
                            continue
                        # Plans with the same partition run once per schedule.
                        key = f"{describe_plan(plan.layers, plan.replicas)}|{schedule}"
                        if key not in owners:
                            owners[key] = []
                            configs.append({"key": key, "plan": str(path), "schedule": schedule})
                        owners[key].append(owner)
            cfg_path = Path(tmp) / f"configs_{w}.json"
            cfg_path.write_text(json.dumps(configs))
            LOG.info("%d workers: %d runs: %s", w, len(configs), [c["key"] for c in configs])
            result = h.launch_torchrun(script, w, ["--worker", "run", "--configs", str(cfg_path)] + common,
                                     JSON_TAG, args.timeout)
            launches[w] = result.get("launch_s", 0.0)
            if "error" in result:
                LOG.error("%d workers: %s", w, result["error"])
            for run in result.get("runs", []):
                for owner in owners[run["key"]]:
                    runs[owner] = run
                if "error" in run:
                    LOG.error("%d workers %s: %s", w, run["key"], run["error"])
                else:
                    LOG.info("%d workers %s: %.0f samples/s", w, run["key"], run["samples_per_s"])
            for owner_list in owners.values():
                for owner in owner_list:
                    runs.setdefault(owner, {"error": result.get("error", "no result")})

    stage_rows, run_rows = build_rows(plans, runs, nodes, args, bandwidth)
    total_s = time.perf_counter() - t_start
    mb = args.batch_size // args.microbatches
    lines = ["# Planner: predicted vs measured (digits CNN)", "",
             h.command_sentence(command, total_s, launches), "",
             h.machine_line(info) + " One thread per rank (torch.set_num_threads(1), OMP_NUM_THREADS=1), Gloo.", "",
             f"Model: examples/train_digits.py's CNN (10 layers), real digits, Adam lr={args.lr}. Profile: "
             f"`pd.profile` at the training microbatch of {mb} samples (batch {args.batch_size} / "
             f"{args.microbatches} microbatches), median of {args.profile_steps} steps after "
             f"{args.profile_warmup}, one thread: forward+backward of the whole model {single_ms:.3f} ms per "
             f"microbatch. Bandwidth {bandwidth:.3g} B/s ({bw_source}). Plans: "
             + ", ".join(f"`pd.plan(workers=[{w}], cost_model='{cm}'{', straight=True' if v == 'straight' else ''})`"
                         for (w, cm, v) in plans)
             + (f", pipedream model with activation compression ratio {args.compression}" if args.compression
                else ", pipedream model without a compression ratio (boundary transfers free, PipeDream's default)")
             + f". Runs: {args.warmup} warm-up steps, a flush, then {args.steps} timed steps of "
             f"{args.batch_size} samples (1f1b) or {args.steps * args.microbatches} minibatches of {mb} "
             "(pipedream, async; warm-up and timed minibatches rounded up to a multiple of the lcm of the replica "
             "counts, as the runtime flushes only after whole rounds); one launch per world size.", "",
             "## Per stage", "",
             "Predicted F+B per microbatch: the plan's `compute_seconds` (profiled forward+backward of the "
             "stage's layers, one worker). Measured: `seconds_by_kind` F+B per microbatch the rank ran (mean "
             "over replicas). Predicted stage time: the plan's per-stage `time` per microbatch of the pipeline "
             "(compute / replicas plus the cost model's all-reduce and transfer charges). Measured stage time: "
             "(F+B+ALLREDUCE seconds) per microbatch of the pipeline, slowest replica (all-reduce seconds "
             "include waiting for the other replica). Error = measured / predicted - 1.", ""]
    lines += stage_table(stage_rows)
    lines += ["", "## Throughput", "",
              f"Plan steady state: microbatch ({mb}) / `time_per_stage` (PipeDream's prediction, no flush, no "
              "bubble). Schedule simulated: the schedule engine's simulator with the profiled per-stage forward "
              "and backward times, transfers of each boundary's output bytes and ring all-reduce of replicated "
              "stages at the bandwidth above (1f1b: one batch with its fill and drain; pipedream: the "
              f"{args.steps * args.microbatches} timed minibatches). Measured: samples / slowest rank's wall "
              "time (optimizer steps and final flush included). Bubble: simulated bubble fraction vs the mean "
              "over ranks of `stats()['bubble_fraction']`.", ""]
    lines += run_table(run_rows)
    lines += ["", "## Where the time goes", "",
              "Per step (pipedream: per minibatch), mean over the run's ranks, from `pipe.stats()` and the rank's "
              "wall time: forward and backward compute; waiting on peers (receives, sends, all-reduce); posting "
              "sends; optimizer steps inside the runtime (pipedream); the rest of the runtime's time; and wall time "
              "outside the runtime (the Python `step` call around it, the flush schedules' optimizer step and "
              "loss all-reduce).", ""]
    lines += breakdown_table(run_rows)
    lines += ["", "Plot: `plan_accuracy.png` (per stage F+B per microbatch, predicted vs measured; throughput).", ""]
    h.write_results(out_dir, "plan_accuracy", "\n".join(lines), {
        "machine": info, "command": command, "bandwidth": bandwidth, "bandwidth_source": bw_source,
         "profile_nodes": nodes, "plans": {"|".join(map(str, k)): p.to_dict() for k, p in plans.items()},
         "stage_rows": stage_rows, "run_rows": run_rows,
        "runs": {"|".join(map(str, k)): v for k, v in runs.items()}, "total_s": total_s})
    plot(stage_rows, run_rows, out_dir / "plan_accuracy.png")
    LOG.info("done in %.0f s", total_s)
    # A layout the runtime rejects up front is reported, not a failure of this benchmark.
    failed = [r for r in run_rows if "error" in r and not r.get("rejected")]
    return 1 if failed else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, ("run", "bandwidth"))
    p.add_argument("--configs", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4],
                   help="world sizes to plan and run for (comma-separated, default 2,4)")
    p.add_argument("--cost-models", type=lambda s: s.split(","), default=["pipedream", "default"])
    p.add_argument("--variants", type=lambda s: s.split(","), default=["free", "straight"],
                   help="plans per cost model: 'free' (the planner's choice of stages and replicas) and/or "
                        "'straight' (one worker per stage, a real pipeline)")
    p.add_argument("--compression", type=float, default=None,
                   help="activation compression ratio for the pipedream model (default: none, transfers free)")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: measured)")
    p.add_argument("--probe-bytes", type=int, default=4 << 20, help="bandwidth probe message size")
    p.add_argument("--probe-rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="as in examples/train_digits.py")
    p.add_argument("--microbatches", type=int, default=4, help="as in examples/train_digits.py")
    p.add_argument("--steps", type=int, default=100, help="timed steps (pipedream: x microbatches minibatches)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--profile-warmup", type=int, default=5)
    p.add_argument("--no-async", action="store_true", help="skip the pipedream (async) runs")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun launch")
    p.add_argument("--pipe-timeout", type=float, default=120.0, help="PipeDream(timeout=) in the workers")
    args = p.parse_args(argv)
    if args.batch_size % args.microbatches:
        p.error("--batch-size must be divisible by --microbatches")
    for cm in args.cost_models:
        if cm not in ("pipedream", "default"):
            p.error(f"unknown cost model {cm!r}; use pipedream and/or default")
    return args


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
