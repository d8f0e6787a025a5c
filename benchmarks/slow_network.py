"""Slow network: time to accuracy of DDP vs pipedream_ext on an emulated 4-host cluster.

PipeDream's central claim is that pipelining beats data parallelism when
communication dominates (up to 5.3x faster to a target accuracy). This script
measures where pipedream_ext stands on one machine: 4 ranks in 4 network
namespaces (``pd-ns0..3``, 10.77.0.1-4) joined by veth links to a bridge, every
link limited with ``tc tbf`` in both directions (``--bandwidths``, default
100 Mbit/s and 1 Gbit/s; see ``benchmarks/_netns.py``).

For every bandwidth, model and configuration it launches 4 torchrun processes,
one per namespace, with torchrun's multi-node c10d rendezvous::

    ip netns exec pd-nsK env GLOO_SOCKET_IFNAME=pd-hK OMP_NUM_THREADS=1 \\
        python -m torch.distributed.run --nnodes 4 --nproc-per-node 1 --node-rank K \\
        --rdzv-backend c10d --rdzv-endpoint 10.77.0.1:PORT --rdzv-id ID --local-addr 10.77.0.K+1 \\
        benchmarks/slow_network.py --worker CONFIG ...

Configurations (same global batch, same optimizer and learning rate, same data order):

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``, each rank a quarter of the batch;
* ``1f1b``: pipedream_ext PipeDream-Flush, one batch of ``--microbatches`` per step;
* ``pipedream``: asynchronous PipeDream (weight stashing), one minibatch of the batch
  size per step and one update per minibatch;
* ``pipedream-2bw``: one batch of ``--microbatches`` per step, double-buffered weights;
* ``1f1b-straight`` (not in the default set): 1f1b on the planner's ``straight=True``
  plan (one stage per rank), to separate pipelining from the planner's choice.

The pipeline configurations run the plan ``pipedream_ext.plan`` gives for the
model's profile (``pipedream_ext.profile``, measured here in the parent, one thread)
on 4 workers at the emulated bandwidth (bytes/s = rate / 8), default cost model
(``two_bw=True`` for pipedream-2bw).

Models: ``digits`` (the CNN and data of ``examples/train_digits.py``) and ``mlp``
(an MLP with 512-wide Linear layers, 0.92 M parameters (3.7 MB) against 256 KB of
activations per boundary per batch, on sklearn's ``make_classification``), where
DDP's all-reduce dominates at 100 Mbit/s.

Wall-clock time counts training only: the clock pauses for evaluation (test
accuracy every ``eval_every`` steps), but asynchronous schedules' ``flush()``
before each evaluation counts. A run stops ``--after-target`` evaluations after
reaching its target, or at ``--max-seconds`` of training, or after the model's
epoch budget. Outputs: ``<out-dir>/slow_network.md`` (tables), ``slow_network.json``
(every record) and ``slow_network_<model>_<bandwidth>.png`` (loss and accuracy
against wall-clock time).

Needs root and iproute2 (``ip``, ``tc``); run ``sudo make bench-network`` or
``sudo python3 benchmarks/slow_network.py``. About 13 minutes on 2 shared cores
(16 runs; mostly the start-up of 8 processes per run).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
import _netns  # noqa: E402

__all__ = ["ModelSpec", "RunOutcome", "bandwidth_label", "build_model", "build_parser", "check_runnable",
           "configs_of", "driver_main", "lcm_all", "load_data", "main", "make_plans", "microbatches_for",
           "parse_args", "parse_bandwidths", "parse_list", "parse_targets", "plan_text", "plot",
           "prerequisite_message", "report", "round_up", "run_configuration", "same_plan_run",
           "scale_profile_text", "summarize", "time_to_target", "torchrun_commands", "worker_main"]

LOG = logging.getLogger("slow_network")
CONFIGS = ("ddp", "1f1b", "pipedream", "pipedream-2bw", "1f1b-straight")
DEFAULT_CONFIGS = CONFIGS[:4]
#: The pipedream_ext schedule of each pipeline configuration.
SCHEDULE = {"1f1b": "1f1b", "pipedream": "pipedream", "pipedream-2bw": "pipedream-2bw",
            "1f1b-straight": "1f1b"}
WORLD = 4
LABELS = {
    "ddp": "DDP (torch DistributedDataParallel)",
    "1f1b": "pipedream_ext 1f1b (flush)",
    "pipedream": "pipedream_ext pipedream (async)",
    "pipedream-2bw": "pipedream_ext pipedream-2bw (async)",
    "1f1b-straight": "pipedream_ext 1f1b on the planner's straight plan",
}
COLORS = {"ddp": "tab:gray", "1f1b": "tab:blue", "pipedream": "tab:red", "pipedream-2bw": "tab:green",
          "1f1b-straight": "tab:purple"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model and its training recipe (identical for every configuration)."""

    name: str
    batch_size: int
    lr: float
    target: float
    eval_every: int  # steps between evaluations
    max_epochs: int
    description: str


MODELS: Dict[str, ModelSpec] = {
    "digits": ModelSpec("digits", batch_size=64, lr=2e-3, target=0.95, eval_every=11, max_epochs=30,
                        description="examples/train_digits.py CNN (10 layers, 38 K parameters) on "
                                    "sklearn digits, 1437 train / 360 test images"),
    "mlp": ModelSpec("mlp", batch_size=128, lr=1e-3, target=0.90, eval_every=16, max_epochs=10,
                     description="MLP 256-512-512-512-512-10 (9 layers, 0.92 M parameters) on "
                                 "make_classification (10 classes, 16 informative of 256 "
                                 "features, class_sep 2), 20000 train / 1024 test samples"),
}


# ------------------------------------------------------------------------ pure helpers
def bandwidth_label(bps: float) -> str:
    """``100mbit``, ``1gbit``, ``2.5gbit``: file-name friendly."""
    if bps >= 1e9 and (bps / 1e9) == round(bps / 1e9, 3):
        return f"{bps / 1e9:g}gbit"
    return f"{bps / 1e6:g}mbit"


def parse_list(text: str, allowed: Sequence[str], what: str) -> List[str]:
    """Comma list of names, each one of ``allowed``; ValueError naming the bad one."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty; choose from {', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise ValueError(f"unknown {what[:-1]} {item!r} in --{what}; choose from {', '.join(allowed)}")
    if len(set(items)) != len(items):
        raise ValueError(f"--{what} lists a name twice: {text!r}")
    return items


def parse_bandwidths(text: str) -> List[float]:
    """``100mbit,1gbit`` -> ``[1e8, 1e9]`` bits/s (ValueError for a bad entry)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("--bandwidths is empty; give e.g. 100mbit,1gbit")
    return [_netns.parse_rate(t) for t in items]


def parse_targets(text: Optional[str]) -> Dict[str, float]:
    """``digits=0.95,mlp=0.9`` -> dict; every value in (0, 1]."""
    out: Dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in MODELS:
            raise ValueError(f"--targets entry {item!r} must be MODEL=ACCURACY with MODEL in "
                             f"{', '.join(MODELS)}")
        acc = float(value)
        if not 0 < acc <= 1:
            raise ValueError(f"--targets {name}={value}: the accuracy must be in (0, 1]")
        out[name] = acc
    return out


def prerequisite_message(missing: Sequence[str], argv: Sequence[str]) -> str:
    """The message printed (exit status 2) when root or iproute2 is missing."""
    args = " ".join(shlex.quote(a) for a in argv)
    return ("slow_network.py builds an emulated cluster of network namespaces with tc rate "
            "limits, which needs:\n"
            + "".join(f"  - {m}\n" for m in missing)
            + "Run it as root with iproute2 installed (apt-get install iproute2), e.g.\n"
              "  sudo make bench-network\n"
              f"  sudo {sys.executable} benchmarks/slow_network.py {args}".rstrip() + "\n")


def round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def lcm_all(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def torchrun_commands(hosts: Sequence[_netns.Host], prefixes: Sequence[Sequence[str]], script: str,
                      worker_args: Sequence[str], port: int, rdzv_id: str,
                      python: str = sys.executable, join_timeout: int = 90) -> List[List[str]]:
    """One torchrun command per host (host K is node rank K; host 0 holds the c10d store).

    ``prefixes[K]`` runs a command on host K (``NetnsCluster.exec_prefix(K)``:
    ``ip netns exec pd-nsK`` plus the host's cgroup)."""
    if len(prefixes) != len(hosts):
        raise ValueError(f"{len(prefixes)} command prefixes for {len(hosts)} hosts")
    cmds = []
    for k, host in enumerate(hosts):
        cmds.append([
            *prefixes[k],
            "env", f"GLOO_SOCKET_IFNAME={host.ifname}", "OMP_NUM_THREADS=1",
            python, "-m", "torch.distributed.run",
            "--nnodes", str(len(hosts)), "--nproc-per-node", "1", "--node-rank", str(k),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{port}",
            "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={'true' if k == 0 else 'false'},join_timeout={join_timeout},"
                           f"read_timeout={join_timeout}",
            # Without it rank 0's agent advertises its hostname (unreachable from
            # the other namespaces) as MASTER_ADDR.
            "--local-addr", host.address,
            "--max-restarts", "0",
            script, *worker_args,
        ])
    return cmds


def time_to_target(records: Sequence[Dict[str, Any]], target: float) -> Optional[Dict[str, Any]]:
    """The first evaluation record with ``test_acc >= target`` (None if never)."""
    for r in records:
        if r["test_acc"] >= target:
            return r
    return None


# ------------------------------------------------------------------------------ data
def build_model(name: str, seed: int):
    """The model (an nn.Sequential), identically initialised for a given seed."""
    if name == "digits":
        return h.digits().make_model(seed)
    return h.mlp([256, 512, 512, 512, 512, 10], seed)


def load_data(name: str, seed: int):
    """``(x_train, y_train, x_test, y_test)`` tensors."""
    import torch

    if name == "digits":
        train, test = h.digits().load_digits(seed)
        return train.tensors[0], train.tensors[1], test.tensors[0], test.tensors[1]
    from sklearn.datasets import make_classification

    n_train, n_test = 20000, 1024
    x, y = make_classification(n_samples=n_train + n_test, n_features=256, n_informative=16,
                               n_redundant=0, n_classes=10, n_clusters_per_class=2, class_sep=2.0,
                               flip_y=0.0, random_state=seed)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


# ---------------------------------------------------------------------------- worker
def _tx_bytes() -> Optional[int]:
    """Bytes sent on this namespace's link so far (sysfs of GLOO_SOCKET_IFNAME)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return None


def worker_main(args: argparse.Namespace) -> int:
    """One rank of one configuration (launched by torchrun inside a namespace)."""
    started = time.perf_counter()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipedream_ext as pd

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s"
                        .replace("%(rank)s", os.environ.get("RANK", "?")))
    config, spec = args.worker, MODELS[args.model]
    target = args.target if args.target is not None else spec.target
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.data:  # tensors the driver saved (saves every rank importing sklearn)
        x_train, y_train, x_test, y_test = torch.load(args.data)
    else:
        x_train, y_train, x_test, y_test = load_data(args.model, args.seed)
    model = build_model(args.model, args.seed)
    batch = spec.batch_size
    steps_per_epoch = len(x_train) // batch

    pipe = ddp = None
    eval_every = spec.eval_every
    if config == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        params = list(ddp.parameters())
        asynchronous = False
    else:
        pipe = pd.PipeDream(model, F.cross_entropy, schedule=SCHEDULE[config], microbatches=args.microbatches,
                            balance=args.plan, timeout=args.timeout)
        params = list(pipe.parameters())
        asynchronous = pipe.asynchronous
        if asynchronous:  # replicated stages flush after whole rounds of minibatches
            eval_every = round_up(eval_every, lcm_all(pipe.replicas))
    opt = torch.optim.Adam(params, lr=spec.lr) if params else None
    LOG.info("%s on %s: %s, eval every %d steps, target %.3f", config, args.model,
             f"balance {pipe.balance} replicas {pipe.replicas}" if pipe else "DDP", eval_every, target)

    records: List[Dict[str, Any]] = []
    state = {"paused": 0.0, "loss_sum": 0.0, "loss_n": 0.0, "tx": 0, "tx_mark": _tx_bytes(),
             "reached_at": None}

    def evaluate(step: int) -> bool:
        """Flush (counted), then (paused) test accuracy and the stop decision."""
        if pipe is not None:
            pipe.flush()
        dist.barrier()
        now = time.perf_counter()
        train_time = now - t0 - state["paused"]
        tx = _tx_bytes()
        if tx is not None and state["tx_mark"] is not None:
            state["tx"] += tx - state["tx_mark"]
        correct = test_loss = have = 0.0
        with torch.no_grad():
            if ddp is not None:
                out = None
                if rank == 0:
                    ddp.module.eval()
                    out = ddp.module(x_test)
                    ddp.module.train()
            else:
                pipe.eval()
                out = pipe.forward_only(x_test)
                pipe.train()
            if out is not None:
                correct = float((out.argmax(dim=1) == y_test).sum())
                test_loss = float(F.cross_entropy(out, y_test)) * len(y_test)
                have = 1.0
        vec = torch.tensor([state["loss_sum"], state["loss_n"], correct, test_loss, have,
                            float(state["tx"]), train_time if rank == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(vec)
        loss_sum, loss_n, correct, test_loss, have, tx_total, train_time = vec.tolist()
        if have != 1:
            raise RuntimeError(f"{have} ranks returned evaluation outputs; expected exactly 1")
        acc = correct / len(y_test)
        record = {"step": step, "samples": step * batch, "time": train_time,
                  "train_loss": loss_sum / loss_n if loss_n else float("nan"),
                  "test_acc": acc, "test_loss": test_loss / len(y_test), "tx_bytes": tx_total}
        records.append(record)
        state["loss_sum"] = state["loss_n"] = 0.0
        if acc >= target and state["reached_at"] is None:
            state["reached_at"] = len(records) - 1
        evals_after = len(records) - 1 - state["reached_at"] if state["reached_at"] is not None else -1
        stop = (evals_after >= args.after_target or train_time >= args.max_seconds)
        if rank == 0:
            LOG.info("step %d  %.2f s  train loss %.4f  test acc %.4f", step, train_time,
                     record["train_loss"], acc)
        state["tx_mark"] = _tx_bytes()
        state["paused"] += time.perf_counter() - now
        return stop

    if args.ready_dir:
        # The driver moves this host's processes into its CPU-quota cgroup once every
        # rank is set up (imports and construction run unthrottled), then says go.
        Path(args.ready_dir, f"ready{rank}").touch()
        go, deadline = Path(args.ready_dir, "go"), time.time() + args.timeout
        while not go.exists():
            if time.time() > deadline:
                raise RuntimeError(f"rank {rank}: no go from the driver within {args.timeout} s")
            time.sleep(0.02)
    dist.barrier()
    setup_s = time.perf_counter() - started
    t0 = time.perf_counter()
    step, stop = 0, False
    for epoch in range(spec.max_epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        for b in range(steps_per_epoch):
            idx = order[b * batch:(b + 1) * batch]
            x, y = x_train[idx], y_train[idx]
            if ddp is not None:
                xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
                loss = F.cross_entropy(ddp(xs), ys)
                loss.backward()
                opt.step()
                opt.zero_grad()
                state["loss_sum"] += float(loss) * len(ys)
                state["loss_n"] += len(ys)
            elif asynchronous:
                loss = pipe.step(x, y, optimizer=opt)
                # pipedream: each last-stage replica returns its own minibatches'
                # losses; 2bw: every last-stage replica returns the batch's loss.
                if loss is not None and (config == "pipedream" or rank == pipe.last_rank):
                    state["loss_sum"] += loss * batch
                    state["loss_n"] += batch
            else:
                loss = pipe.step(x, y)  # the batch's mean loss on every rank
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
                if rank == 0:
                    state["loss_sum"] += loss * batch
                    state["loss_n"] += batch
            step += 1
            if step % eval_every == 0:
                stop = evaluate(step)
                if stop:
                    break
        if stop:
            break
    if not stop and (not records or records[-1]["step"] != step):
        evaluate(step)
    if rank == 0:
        result = {
            "config": config, "model": args.model, "bandwidth": args.bandwidth, "target": target,
            "batch_size": batch, "microbatches": args.microbatches if config != "ddp" else None,
            "lr": spec.lr, "eval_every": eval_every, "steps": step, "setup_s": setup_s,
            "eval_s": state["paused"], "records": records,
            "balance": pipe.balance if pipe else None, "replicas": pipe.replicas if pipe else None,
        }
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- driver
@dataclasses.dataclass
class RunOutcome:
    ok: bool
    wall_s: float
    result: Optional[Dict[str, Any]]
    error: str = ""


def same_plan_run(runs: Sequence[Dict[str, Any]], plans: Dict[Tuple[str, float, str], Dict[str, Any]],
                  name: str, bw: float, cfg: str) -> Optional[Dict[str, Any]]:
    """For ``1f1b-straight``: 1f1b's run if the planner's plan was already straight."""
    if cfg != "1f1b-straight" or (name, bw, "1f1b") not in plans:
        return None
    a, b = plans[(name, bw, "1f1b")], plans[(name, bw, cfg)]
    if (a["layers"], a["replicas"], a["microbatches"]) != (b["layers"], b["replicas"], b["microbatches"]):
        return None
    return next((r for r in runs if r["model"] == name and r["bw"] == bw and r["config"] == "1f1b"
                 and r["ok"]), None)


def run_configuration(cluster: _netns.NetnsCluster, worker_args: List[str], port: int, rdzv_id: str,
                      log_path: Path, result_path: Path, timeout_s: float) -> RunOutcome:
    """Launches one configuration on every host, waits (with a deadline), kills leftovers."""
    ready = result_path.with_suffix(".ready")
    if ready.exists():
        shutil.rmtree(ready)
    ready.mkdir()
    cmds = torchrun_commands(cluster.hosts, [cluster.exec_prefix(k, limit_cpu=False)
                                             for k in range(len(cluster.hosts))],
                             str(Path(__file__).resolve()),
                             worker_args + ["--result", str(result_path), "--ready-dir", str(ready)],
                             port, rdzv_id)
    start = time.perf_counter()
    procs: List[subprocess.Popen] = []
    error = ""
    with open(log_path, "w") as log:
        log.write("\n".join(shlex.join(c) for c in cmds) + "\n\n")
        log.flush()
        try:
            for cmd in cmds:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = start + timeout_s
            failed_at: Optional[float] = None
            went = False
            while True:
                codes = [p.poll() for p in procs]  # poll every one (no short-circuit)
                if all(c is not None for c in codes):
                    break
                if not went and all((ready / f"ready{r}").exists() for r in range(len(procs))):
                    if cluster.cpus is not None:
                        for k in range(len(cluster.hosts)):
                            cluster.move_into_cgroup(k)
                    (ready / "go").touch()
                    went = True
                now = time.perf_counter()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    # The peers fail on their own within their timeouts (or, if they
                    # finished, their torchrun agents wait in an exit barrier).
                    failed_at = now
                if now > deadline:
                    error = f"timed out after {timeout_s:.0f} s"
                    break
                if failed_at is not None and now - failed_at > 20:
                    error = f"a host failed (exit codes {codes}); the others were stopped 20 s later"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            grace = time.perf_counter() + 10
            while any(p.poll() is None for p in list(procs)) and time.perf_counter() < grace:
                time.sleep(0.1)
            # torchrun's workers run in sessions of their own: kill whatever is
            # still inside the namespaces, by PID.
            cluster.kill_processes([h.namespace for h in cluster.hosts])
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    LOG.error("pid %d survived SIGKILL for 10 s", p.pid)
    wall = time.perf_counter() - start
    codes = [p.returncode for p in procs]
    if not error and any(c != 0 for c in codes):
        error = f"exit codes {codes}"
    if error:
        # The log keeps the whole output; the error names the lines that say what failed.
        error += ": " + " | ".join(h.failure_lines(log_path.read_text(errors="replace")))
    result = None
    if result_path.exists():
        with open(result_path) as f:
            result = json.load(f)
    if result is None and not error:
        error = "no result file"
    return RunOutcome(ok=not error and result is not None, wall_s=wall, result=result, error=error)


def scale_profile_text(text: str, factor: float) -> str:
    """A ``graph.txt`` with every forward/backward compute time multiplied by ``factor``."""
    def scale(m: "re.Match[str]") -> str:
        return f"{m.group(1)}={float(m.group(2)) * factor:.6f}"

    return re.sub(r"((?:forward|backward)_compute_time)=([0-9.eE+-]+)", scale, text)


def microbatches_for(config: str, replicas: Sequence[int], requested: int) -> int:
    """Microbatches a pipeline configuration runs: ``requested`` rounded up to a multiple
    of the replica counts' lcm (pipedream-2bw requires it; 1f1b gets the same so
    replicas share a batch evenly). ``pipedream`` takes one minibatch per step."""
    if SCHEDULE[config] == "pipedream":
        return 1
    return round_up(requested, lcm_all(replicas))


def check_runnable(config: str, replicas: Sequence[int], microbatches: int) -> Optional[str]:
    """None if pipedream_ext accepts this schedule/replica layout, else its error."""
    from pipedream_ext import _C, schedules

    schedule = SCHEDULE[config]
    try:
        if schedule in ("pipedream", "pipedream-2bw"):
            _C.AsyncActionFeed(schedule, stages=len(replicas), microbatches=microbatches,
                                 replicas=list(replicas), vertical_sync=False)
        else:
            schedules.build(schedule, stages=len(replicas), microbatches=microbatches,
                            replicas=list(replicas))
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def make_plans(models: Sequence[str], bandwidths: Sequence[float], configs: Sequence[str], work: Path,
               seed: int, cost_model: str, host_cpus: float,
               microbatches: int) -> Dict[Tuple[str, float, str], Dict[str, Any]]:
    """Profiles each model once and plans every pipeline configuration for every bandwidth.

    The profile is measured here on one thread; with a CPU quota of ``host_cpus``
    cores per host its compute times are scaled by ``1 / min(host_cpus, 1)`` so the
    planner sees the emulated hosts' speed. pipedream-2bw is planned with
    ``two_bw=True``. A plan pipedream_ext cannot run for a schedule (see
    :func:`check_runnable`) is replaced by the planner's straight plan, and the
    reason is kept in ``fallback``."""
    import torch
    import torch.nn.functional as F

    import pipedream_ext as pd

    torch.set_num_threads(1)
    factor = 1.0 / min(host_cpus, 1.0) if host_cpus > 0 else 1.0
    plans: Dict[Tuple[str, float, str], Dict[str, Any]] = {}
    for name in models:
        spec = MODELS[name]
        data = load_data(name, seed)
        torch.save(data, work / f"data_{name}.pt")
        x, y = data[0], data[1]
        measured = pd.profile(build_model(name, seed), x[:spec.batch_size], loss_fn=F.cross_entropy,
                              target=y[:spec.batch_size], steps=20, warmup=5)
        text = scale_profile_text(measured.to_string(), factor)
        (work / f"profile_{name}.txt").write_text(text)
        graph = pd.ProfileGraph.parse(text)
        for bw in bandwidths:
            for cfg in configs:
                if cfg == "ddp":
                    continue
                two_bw = cfg == "pipedream-2bw"
                plan = pd.plan(graph, workers=[WORLD], bandwidth=[bw / 8], cost_model=cost_model,
                               two_bw=two_bw, straight=cfg == "1f1b-straight")
                m = microbatches_for(cfg, plan.replicas, microbatches)
                fallback = check_runnable(cfg, plan.replicas, m)
                if fallback is not None:
                    LOG.warning("%s at %s: pipedream_ext rejects the planner's plan %s for %s (%s); "
                                "running the planner's straight plan instead", name,
                                bandwidth_label(bw), plan.replicas, cfg, fallback)
                    plan = pd.plan(graph, workers=[WORLD], bandwidth=[bw / 8], cost_model=cost_model,
                                   two_bw=two_bw, straight=True)
                    m = microbatches_for(cfg, plan.replicas, microbatches)
                path = work / f"plan_{name}_{bandwidth_label(bw)}_{cfg}.json"
                plan.save(path)
                plans[(name, bw, cfg)] = {
                    "path": str(path), "layers": [list(l) for l in plan.layers],
                    "replicas": plan.replicas, "time_per_stage": plan.time_per_stage,
                    "data_parallel_time": plan.data_parallel_time,
                    "speedup_over_dp": plan.speedup_over_dp, "microbatches": m,
                    "fallback": fallback}
                LOG.info("plan %s at %s for %s:\n%s", name, bandwidth_label(bw), cfg, plan.table())
    return plans


def plan_text(plan: Optional[Dict[str, Any]]) -> str:
    """``[0,7)x1 [7,10)x3, m=9``: layer ranges x replicas, microbatches (``*``: fallback)."""
    if plan is None:
        return "full model x4, batch/4 per rank"
    parts = [f"[{a},{b})x{r}" for (a, b), r in zip(plan["layers"], plan["replicas"])]
    return " ".join(parts) + f", m={plan['microbatches']}" + (" (*)" if plan.get("fallback") else "")


def summarize(runs: List[Dict[str, Any]], models: Sequence[str], bandwidths: Sequence[float],
              configs: Sequence[str]) -> Dict[Tuple[str, float], List[Dict[str, Any]]]:
    """Rows per (model, bandwidth): time to target, speedup over DDP, final accuracy, ..."""
    table: Dict[Tuple[str, float], List[Dict[str, Any]]] = {}
    for name in models:
        for bw in bandwidths:
            rows = []
            ddp_time = None
            for cfg in configs:
                run = next((r for r in runs if r["model"] == name and r["bw"] == bw and r["config"] == cfg), None)
                row: Dict[str, Any] = {"config": cfg, "run": run}
                if run is not None and run["result"] is not None:
                    res = run["result"]
                    recs = res["records"]
                    hit = time_to_target(recs, res["target"])
                    row.update(
                        target=res["target"],
                        time_to_target=hit["time"] if hit else None,
                        steps_to_target=hit["step"] if hit else None,
                        final_acc=recs[-1]["test_acc"] if recs else None,
                        best_acc=max(r["test_acc"] for r in recs) if recs else None,
                        train_time=recs[-1]["time"] if recs else None,
                        steps=res["steps"],
                        s_per_step=recs[-1]["time"] / recs[-1]["step"] if recs and recs[-1]["step"] else None,
                        mb_per_step=(recs[-1]["tx_bytes"] / recs[-1]["step"] / 1e6
                                     if recs and recs[-1]["step"] else None),
                    )
                    if cfg == "ddp":
                        ddp_time = row["time_to_target"]
                rows.append(row)
            for row in rows:
                t = row.get("time_to_target")
                row["speedup"] = ddp_time / t if ddp_time and t else None
            table[(name, bw)] = rows
    return table


def configs_of(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The configurations of a (model, bandwidth)'s rows, in order."""
    return [r["config"] for r in rows]


def report(table, plans, runs, probes: Dict[float, float], info: Dict[str, Any], command: str, total_s: float,
           args: argparse.Namespace) -> str:
    """The Markdown report: one table per (model, bandwidth), then the failed runs."""
    lines = ["# Slow network: time to accuracy", "",
             f"Command: `{command}` (whole run {total_s / 60:.1f} min, "
             f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}).",
             h.machine_line(info) + f" Load average at end {os.getloadavg()[0]:.2f} (shared machine). "
             f"4 ranks in 4 network namespaces, one thread each, Gloo over veth links rate limited "
             f"with tc tbf in both directions"
             + (f", each host capped at {args.host_cpus:g} cores (cgroup cpu quota; the profile's "
                f"compute times are scaled by {1 / min(args.host_cpus, 1):g} for the planner)"
                if args.host_cpus else ", no CPU quota (the ranks share the machine's cores)")
             + f"; planner cost model `{args.cost_model}`.", ""]
    lines.append("Measured link bandwidth (one TCP stream, pd-ns0 to pd-ns1): " + ", ".join(
        f"{bandwidth_label(bw)}: {probes[bw] / 1e6:.0f} Mbit/s" for bw in probes) + ".")
    lines.append("")
    lines.append("Time to target = training wall-clock seconds (evaluation excluded, asynchronous "
                 "flushes included) at the first evaluation at or above the target; speedup = DDP's "
                 "time / the configuration's time. MB/step = bytes all 4 ranks put on their links "
                 "during training (sysfs tx_bytes, TCP/IP headers included) / steps.")
    lines.append("")
    for name in sorted({k[0] for k in table}, key=list(MODELS).index):
        spec = MODELS[name]
        lines += [f"## {name}", "", f"{spec.description}; batch {spec.batch_size}, Adam lr {spec.lr:g}, "
                  f"pipelines {args.microbatches} microbatches rounded up to a multiple of the plan's "
                  f"replica counts (pipedream: one minibatch of {spec.batch_size} per step), "
                  f"evaluation every {spec.eval_every} steps.", ""]
        for (m, bw), rows in table.items():
            if m != name:
                continue
            target = next((r["target"] for r in rows if r.get("target") is not None), spec.target)
            lines += [f"### {name} at {bandwidth_label(bw)} (target {100 * target:.0f}% test accuracy)", "",
                      *h.table(["configuration", "plan (layers x replicas)", "planner speedup over DP",
                                "time to target (s)", "steps to target", "speedup over DDP", "final acc", "best acc",
                                "train s/step", "MB/step", "steps", "run wall (s)"])]
            for row in rows:
                cfg = row["config"]
                plan = None if cfg == "ddp" else plans.get((name, bw, cfg))
                run = row["run"]
                if run is None:
                    continue
                if run["result"] is None:
                    lines.append(h.table_row([cfg, plan_text(plan), "", f"failed: {run['error']}"] + [""] * 7
                                             + [f"{run['wall_s']:.0f}"]))
                    continue
                ttt = h.fmt(row["time_to_target"], 1, "not reached")
                if run.get("note"):
                    ttt += f" ({run['note']})"
                lines.append(h.table_row([
                    cfg, plan_text(plan), h.fmt(plan["speedup_over_dp"] if plan else None, 2, "-"), ttt,
                    h.fmt(row["steps_to_target"], 0, "-"), h.fmt(row["speedup"], 2, "-"),
                    h.fmt(row["final_acc"], 3, "-"), h.fmt(row["best_acc"], 3, "-"), h.fmt(row["s_per_step"], 3, "-"),
                    h.fmt(row["mb_per_step"], 2, "-"), row["steps"], f"{run['wall_s']:.0f}"]))
            lines.append("")
            for cfg in configs_of(rows):
                plan = plans.get((name, bw, cfg))
                if plan and plan.get("fallback"):
                    lines.append(f"(*) {cfg}: pipedream_ext rejects the planner's plan "
                                 f"(`{plan['fallback']}`), so this row runs the planner's straight "
                                 "plan (`straight=True`).")
            lines += ["", f"![{name} {bandwidth_label(bw)}](slow_network_{name}_{bandwidth_label(bw)}.png)", ""]
    failed = [r for r in runs if r["result"] is None or not r["ok"]]
    if failed:
        lines += ["## Failed runs", ""]
        for r in failed:
            lines.append(f"- {r['model']} {bandwidth_label(r['bw'])} {r['config']}: {r['error']} "
                         f"(log: {r['log']})")
        lines.append("")
    return "\n".join(lines)


def plot(table, out_dir: Path) -> List[Path]:
    plt = h.pyplot()

    paths = []
    for (name, bw), rows in table.items():
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
        target = None
        for row in rows:
            run = row["run"]
            if run is None or run["result"] is None or run.get("note"):
                continue
            recs = run["result"]["records"]
            target = run["result"]["target"]
            t = [r["time"] for r in recs]
            label = row["config"]
            if row.get("time_to_target") is not None:
                label += f" ({row['time_to_target']:.1f} s)"
            ax_loss.plot([r["time"] for r in recs], [r["train_loss"] for r in recs], marker=".",
                         color=COLORS[row["config"]], label=label)
            ax_acc.plot(t, [r["test_acc"] for r in recs], marker=".",
                        color=COLORS[row["config"]], label=label)
        if target is not None:
            ax_acc.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:g}")
        ax_loss.set(xlabel="training wall-clock time (s)", ylabel="train loss (since last evaluation)",
                    title=f"{name}, {bandwidth_label(bw)} links: loss")
        ax_acc.set(xlabel="training wall-clock time (s)", ylabel="test accuracy",
                   title=f"{name}, {bandwidth_label(bw)} links: accuracy", ylim=(0, 1))
        ax_loss.set_yscale("log")
        for ax in (ax_loss, ax_acc):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        paths.append(h.save_figure(fig, out_dir / f"slow_network_{name}_{bandwidth_label(bw)}.png"))
    return paths


def driver_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tqdm import tqdm

    missing = _netns.missing_prerequisites()
    if missing:
        sys.stderr.write(prerequisite_message(missing, argv))
        return 2
    h.setup_logging(args.verbose)
    total_start = time.perf_counter()
    info = h.machine_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pd_slow_network_"))
    work.mkdir(parents=True, exist_ok=True)
    LOG.info("logs, profiles and plans in %s", work)
    targets = parse_targets(args.targets)
    plans = make_plans(args.models, args.bandwidths, args.configs, work, args.seed, args.cost_model,
                       args.host_cpus, args.microbatches)

    runs: List[Dict[str, Any]] = []
    probes: Dict[float, float] = {}
    jobs = [(bw, m, c) for bw in args.bandwidths for m in args.models for c in args.configs]
    port = args.port
    bar = tqdm(total=len(jobs), desc="configurations", unit="run", file=sys.stdout)
    try:
        for bw in args.bandwidths:
            with _netns.NetnsCluster(WORLD, rate=bw, cpus=args.host_cpus or None) as cluster:
                probes[bw] = cluster.measure_bandwidth(0, 1, seconds=1.0, python=sys.executable)
                LOG.info("link %s: measured %.1f Mbit/s", bandwidth_label(bw), probes[bw] / 1e6)
                for _, name, cfg in [j for j in jobs if j[0] == bw]:
                    bar.set_postfix_str(f"{name} {bandwidth_label(bw)} {cfg}")
                    twin = same_plan_run(runs, plans, name, bw, cfg)
                    if twin is not None:
                        runs.append(dict(twin, config=cfg, note="same plan as 1f1b (not run twice)"))
                        LOG.info("%s %s %s: the planner's plan is already straight; 1f1b's run counts",
                                 name, bandwidth_label(bw), cfg)
                        bar.update(1)
                        continue
                    tag = f"{name}_{bandwidth_label(bw)}_{cfg}"
                    worker_args = ["--worker", cfg, "--model", name, "--bandwidth", str(bw),
                                   "--data", str(work / f"data_{name}.pt"),
                                   "--seed", str(args.seed),
                                   "--max-seconds", str(args.max_seconds),
                                   "--after-target", str(args.after_target),
                                   "--timeout", str(args.timeout)]
                    if name in targets:
                        worker_args += ["--target", str(targets[name])]
                    if cfg != "ddp":
                        plan = plans[(name, bw, cfg)]
                        worker_args += ["--plan", plan["path"], "--microbatches", str(plan["microbatches"])]
                    result_path = work / f"result_{tag}.json"
                    if result_path.exists():
                        result_path.unlink()
                    port += 1
                    outcome = run_configuration(cluster, worker_args, port, f"pd-{tag}-{os.getpid()}",
                                                work / f"log_{tag}.txt", result_path,
                                                timeout_s=args.max_seconds + args.run_overhead)
                    runs.append({"model": name, "bw": bw, "config": cfg, "ok": outcome.ok,
                                 "wall_s": outcome.wall_s, "error": outcome.error,
                                 "result": outcome.result, "log": str(work / f"log_{tag}.txt")})
                    if outcome.ok:
                        hit = time_to_target(outcome.result["records"], outcome.result["target"])
                        LOG.info("%s: %s (run %.0f s)", tag,
                                 f"target at {hit['time']:.1f} s" if hit else "target not reached",
                                 outcome.wall_s)
                    else:
                        LOG.error("%s failed: %s (full output: %s)", tag, outcome.error, work / f"log_{tag}.txt")
                    bar.update(1)
    finally:
        bar.close()

    total_s = time.perf_counter() - total_start
    table = summarize(runs, args.models, args.bandwidths, args.configs)
    command = args.command or ("python3 benchmarks/slow_network.py " + " ".join(shlex.quote(a) for a in argv)).strip()
    h.write_results(out_dir, "slow_network", report(table, plans, runs, probes, info, command, total_s, args),
                    {"machine": info, "command": command, "total_s": total_s,
                     "probes_bps": {bandwidth_label(b): v for b, v in probes.items()},
                     "plans": {f"{m}_{bandwidth_label(b)}_{c}": p for (m, b, c), p in plans.items()},
                     "runs": [{k: v for k, v in r.items()} for r in runs]})
    plot(table, out_dir)
    LOG.info("whole run %.1f min; results in %s", total_s / 60, out_dir)
    return 0 if all(r["ok"] for r in runs) else 1


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = h.make_parser(__doc__, CONFIGS)
    p.add_argument("--bandwidths", default="100mbit,1gbit",
                   help="link rates to emulate, comma separated (tc units: 100mbit, 1gbit, or bits/s)")
    p.add_argument("--models", default="digits,mlp", help=f"models, from {', '.join(MODELS)}")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"configurations, from {', '.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--targets", default=None,
                   help="target test accuracies, e.g. digits=0.95,mlp=0.9 (default: "
                        + ", ".join(f"{m.name}={m.target}" for m in MODELS.values()) + ")")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline microbatches per batch (>= 3)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="cap on one run's training time (seconds)")
    p.add_argument("--after-target", type=int, default=1,
                   help="evaluations to keep training after the target is reached")
    p.add_argument("--host-cpus", type=float, default=(os.cpu_count() or 2) / WORLD,
                   help="CPU quota per emulated host in cores (cgroup; default: this machine's cores / "
                        f"{WORLD}); 0 for none")
    p.add_argument("--cost-model", default="default", choices=("default", "pipedream"),
                   help="planner cost model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29700, help="rendezvous ports start after this one")
    p.add_argument("--timeout", type=float, default=90.0,
                   help="seconds any wait on a peer may take inside a run before it fails")
    p.add_argument("--run-overhead", type=float, default=240.0,
                   help="seconds a run may take beyond --max-seconds (start-up, evaluation) before "
                        "it is killed")
    p.add_argument("--work-dir", default=None, help="logs, profiles and plans (default: a temp dir)")
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)  # how the run was invoked
    # Worker mode (inside torchrun; internal).
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bandwidth", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ready-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and validates; exits with status 2 and a message naming the bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.worker is not None:
            if args.model not in MODELS or args.result is None:
                raise ValueError("--worker needs --model and --result")
            if args.worker != "ddp" and args.plan is None:
                raise ValueError(f"--worker {args.worker} needs --plan")
            return args
        args.bandwidths = parse_bandwidths(args.bandwidths)
        args.models = parse_list(args.models, tuple(MODELS), "models")
        args.configs = parse_list(args.configs, CONFIGS, "configs")
        parse_targets(args.targets)
        if args.microbatches < WORLD - 1:
            raise ValueError(f"--microbatches {args.microbatches}: pipedream-2bw on {WORLD} stages needs "
                             f">= {WORLD - 1}")
        if not args.max_seconds > 0:
            raise ValueError(f"--max-seconds {args.max_seconds} must be > 0")
        if args.host_cpus < 0:
            raise ValueError(f"--host-cpus {args.host_cpus} must be >= 0 (0: no CPU quota)")
        if args.after_target < 0:
            raise ValueError(f"--after-target {args.after_target} must be >= 0")
        if not 1024 <= args.port <= 65000 - 100:
            raise ValueError(f"--port {args.port} must be in 1024..64900")
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return driver_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
