"""What this machine adds to the layers' compute, measured at start-up: ``calibrate``.

Owns the machine's side of the configuration search's cost model
(csrc/core/configure.h, ``MachineCosts``), measured in well under two seconds:

- point-to-point latency and bandwidth between group ranks 0 and 1: a ping-pong of a
  one-element message, then of 4 MiB (``latency + bytes / bandwidth`` each way), and
  the time rank 0 takes to post a send (``isend``, not waiting) of 1 KiB and of 256 KiB
  (per send and per byte: posting copies and writes the bytes);
- all-reduce latency and bus bandwidth over the group: one float, then 4 MiB (a ring
  moves ``2 (n - 1) / n`` of the bytes);
- the runtime's own overheads, on our runtime over ALL ranks of the group: a pipeline of
  one ``Linear(1, 1)`` per rank, schedule 1f1b (what ``PipeDream``'s constructor
  builds for the user, so the loss all-reduce, the step's synchronisation with peers and
  the executor's actions all count), timed at two microbatch counts.
  ``action_seconds`` is what its ``pipe.stats()`` shows per F/B action (the compute
  spans and the runtime's time outside any span), ``send_seconds`` the larger of the
  bare ``isend``'s and its send spans per send (with the posts of as many receives); ``step_seconds`` is the rest of the
  measured step: ``measured(m) - predict(m)`` with the measured action, send, latency and
  bandwidth costs and layers of no cost (mean over the counts, >= 0), plus the
  optimizer's per-step cost: ``torch.optim.Adam``'s step and ``zero_grad`` over one
  one-element parameter (the parameters' own share is each layer's
  ``optimizer_seconds``, measured by ``measure_layer_costs``);
- cores this process may use (``os.sched_getaffinity``) and ranks per node
  (torchrun's ``LOCAL_WORLD_SIZE``).

Latency-like probes keep the minimum of several rounds (other processes on the cores
only ever add to them); the step probes keep the lower quartile (a step of the run waits
on peers like the probe's, but spikes from other processes on the cores are left out).
Rank 0's values reach every rank as JSON (no pickle); every wait has a timeout.

The result is cached per process, keyed by the group's global ranks and the device: a
later ``calibrate`` over the same ranks (every ``PipeDream(sample=...)`` calls it)
returns it after one all-reduce that checks every rank has the entry;
``recalibrate=True`` (or :func:`clear_cache`) measures again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from ..configuration import Configuration, LayerCost, MachineCosts, predict

__all__ = ["cached_on_every_rank", "calibrate", "calibrate_local", "clear_cache", "probe_device",
           "quiet_pipeline_log", "shared_core_action_seconds", "step_overhead"]

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

#: ``PipeDream``'s constructor (``_planning`` sits below the pipeline, so it is passed in).
PipelineFactory = Callable[..., Any]

_LARGE = 4 << 20  # bytes of the bandwidth probes
_ROUNDS = 9       # timed repetitions of each latency-like probe (the minimum is kept)
_BUFFER = 4096    # bytes of the broadcast carrying rank 0's JSON
_POST_SMALL, _POST_LARGE = 1 << 10, 256 << 10  # bytes of the send-posting probes
_MICROBATCHES = (2, 6)  # the overhead probe's two microbatch counts
_STEP_ROUNDS = 12  # timed steps at each count (the lower quartile is kept), after 3 warm-ups

#: Calibrated costs of this process by (the group's global ranks, device); every rank
#: of a group stores its entry in the same call, after the same broadcast.
_CACHE: Dict[Tuple[Tuple[int, ...], str], MachineCosts] = {}


def _delta(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout)


def _times(run: Callable[[], None], rounds: int, warmup: int = 1,
           clock: Callable[[], float] = time.perf_counter) -> List[float]:
    times = []
    for i in range(warmup + rounds):
        start = clock()
        run()
        if i >= warmup:
            times.append(clock() - start)
    return times


def _min_seconds(run: Callable[[], None], rounds: int = _ROUNDS, warmup: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of ``rounds`` runs: load from other processes only adds time."""
    return min(_times(run, rounds, warmup, clock))


def _compute_clock(device: torch.device) -> Callable[[], float]:
    """For work that only computes: this thread's CPU time when it computes on the CPU
    with one thread (immune to other processes on the cores, as ``layer_costs`` times
    layers), else the wall clock."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 \
        else time.perf_counter


def probe_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where probe tensors live: the pipeline's device when the group has a backend for it
    (what boundary tensors see), else the group's metadata device."""
    types = {str(getattr(t, "type", t)) for t in group._device_types}  # noqa: SLF001 - no public accessor
    return device if device.type in types else collectives.metadata_device(group)


# -- point to point and all-reduce ------------------------------------------------------
def _ping_pong(group: dist.ProcessGroup, buffer: torch.Tensor, timeout: float) -> float:
    """Seconds of one message each way between group ranks 0 and 1 (their half of a
    round trip); 0.0 on other ranks, which take no part."""
    rank = dist.get_rank(group)
    if rank > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - rank)

    def round_trip() -> None:
        if rank == 0:
            collectives.post_send(buffer, peer, group).wait(_delta(timeout))
            collectives.post_receive(buffer, peer, group).wait(_delta(timeout))
        else:
            collectives.post_receive(buffer, peer, group).wait(_delta(timeout))
            collectives.post_send(buffer, peer, group).wait(_delta(timeout))
    return _min_seconds(round_trip) / 2


def _post_seconds(group: dist.ProcessGroup, device: torch.device, timeout: float,
                  elements: int) -> float:
    """Rank 0's time to post one send of ``elements`` floats (rank 1 receives them;
    others wait)."""
    rank, count = dist.get_rank(group), 16
    if rank > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - rank)
    buffers = [torch.zeros(elements, device=device) for _ in range(count)]
    fastest = float("inf")
    for _ in range(_ROUNDS):
        if rank == 1:
            for work in [collectives.post_receive(b, peer, group) for b in buffers]:
                work.wait(_delta(timeout))
            continue
        start = time.perf_counter()
        works = [collectives.post_send(b, peer, group) for b in buffers]
        fastest = min(fastest, (time.perf_counter() - start) / count)
        for work in works:
            work.wait(_delta(timeout))
    return 0.0 if rank == 1 else fastest


def _point_to_point(group: dist.ProcessGroup, device: torch.device,
                    timeout: float) -> Dict[str, float]:
    """Latency, bandwidth and send posting between group ranks 0 and 1."""
    small = torch.zeros(1, device=device)
    large = torch.zeros(_LARGE // 4, device=device)
    latency = _ping_pong(group, small, timeout)
    one_way = _ping_pong(group, large, timeout)
    # Posting a send copies and writes its bytes: per send, and per byte from a large one.
    send = _post_seconds(group, device, timeout, _POST_SMALL // 4)
    send_large = _post_seconds(group, device, timeout, _POST_LARGE // 4)
    per_byte = max(0.0, send_large - send) / (_POST_LARGE - _POST_SMALL)
    return {"latency_seconds": latency, "send_seconds": send, "send_seconds_per_byte": per_byte,
            "bandwidth": _LARGE / max(one_way - latency, 1e-9)}


def _all_reduce(group: dist.ProcessGroup, device: torch.device, timeout: float) -> Dict[str, float]:
    """All-reduce latency (one float) and ring bus bandwidth (4 MiB) over the group."""
    world = dist.get_world_size(group)
    small = torch.zeros(1, device=device)
    large = torch.zeros(_LARGE // 4, device=device)

    def reduce(t: torch.Tensor) -> Callable[[], None]:
        return lambda: collectives.all_reduce_waited(t, group, timeout)
    latency = _min_seconds(reduce(small))
    seconds = _min_seconds(reduce(large))
    moved = 2 * (world - 1) / world * _LARGE
    return {"all_reduce_latency_seconds": latency,
            "all_reduce_bandwidth": moved / max(seconds - latency, 1e-9)}


# -- the runtime's overheads, fitted against the cost model -------------------------------
@contextlib.contextmanager
def quiet_pipeline_log() -> Iterator[None]:
    """The probe pipeline's start-up lines are not the user's pipeline: kept out of the log
    (warnings still pass)."""
    logger = logging.getLogger("pipedream_ext._pipe")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _step_times(pipeline: PipelineFactory, group: dist.ProcessGroup, device: torch.device,
                timeout: float) -> Tuple[List[float], Dict[str, float]]:
    """Seconds of one step (lower quartile of ``_STEP_ROUNDS``) of a pipeline of one
    ``Linear(1, 1)`` per rank of ``group`` (1f1b, one sample per microbatch) at each of
    ``_MICROBATCHES``, and from this rank's ``pipe.stats()`` its seconds per F or B action
    (the runtime's time in them and outside any span) and per send it posts, with a
    receive's post (0.0 with one rank); collective.

    The wall clock, as the run's steps wait on peers; on a group of one process computing
    on the CPU with one thread, the thread's CPU clock (other processes on the cores do
    not stretch it)."""
    world = dist.get_world_size(group)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(world)]).to(device)
    clock = _compute_clock(device) if world == 1 else time.perf_counter
    steps, actions, sends = [], [], []
    for m in _MICROBATCHES:
        with quiet_pipeline_log():
            pipe = pipeline(model, nn.functional.mse_loss, schedule="1f1b", microbatches=m,
                            balance=[1] * world, process_group=group, device=device,
                            timeout=timeout)
        x, y = torch.zeros(m, 1, device=device), torch.zeros(m, 1, device=device)
        try:
            _times(lambda: pipe.step(x, y), 0, warmup=3)
            pipe.reset_stats()
            times = _times(lambda: pipe.step(x, y), _STEP_ROUNDS, warmup=0, clock=clock)
            steps.append(statistics.quantiles(times, n=4)[0])
            stats = pipe.stats()
            actions.append(_action_seconds(stats, 2 * m))
            kinds = stats["seconds_by_kind"]
            # A rank posts as many receives as sends (each boundary crossed both ways):
            # a receive's post (its buffer, Gloo's ready note) is charged to the send.
            posting = sum(kinds.get(k, 0.0) for k in ("SEND_F", "SEND_B", "RECV_POST"))
            sends.append(posting / stats["sends"] if stats.get("sends") else 0.0)
        finally:
            pipe.close()
    return steps, {"action_seconds": statistics.mean(actions), "send_seconds": min(sends)}


def _action_seconds(stats: Dict[str, Any], per_step: int) -> float:
    """Seconds per F/B action of a rank running ``per_step`` of them per step: its compute
    spans and its runtime time outside any span (waits and sends excluded)."""
    kinds = stats["seconds_by_kind"]
    compute = sum(kinds.get(k, 0.0) for k in ("F", "B", "I", "W"))
    outside = max(0.0, stats["busy_s"] - sum(kinds.values()))
    return (compute + outside) / max(1, stats["steps"] * per_step)


def _probe_seconds(machine: MachineCosts, ranks: int, microbatches: int) -> float:
    """What the cost model predicts for the probe pipeline without ``step_seconds``."""
    probe = LayerCost(output_bytes_per_sample=4.0, input_bytes_per_sample=4.0)
    config = Configuration(schedule="1f1b", microbatches=microbatches, balance=[1] * ranks,
                           mesh=(ranks, 1, 1))
    machine = dataclasses.replace(machine, step_seconds=0.0, optimizer_seconds_per_byte=0.0,
                                  optimizer_seconds_per_tensor=0.0)
    return predict([probe] * ranks, machine, config, batch_size=microbatches).step_seconds


def step_overhead(machine: MachineCosts, ranks: int, microbatches: Sequence[int],
                  measured: Sequence[float]) -> float:
    """``step_seconds`` such that ``step_seconds + predict(m)`` (the probe pipeline, with
    ``machine``'s action, send, latency and bandwidth costs) matches the measured steps:
    the mean remainder over the microbatch counts, kept >= 0.

    Args:
        machine: the measured costs (its step seconds are ignored).
        ranks: the probe pipeline's stages (one per rank).
        microbatches: the microbatch counts measured.
        measured: seconds of one step at each count.

    Returns:
        The per-step seconds.
    """
    remainders = [t - _probe_seconds(machine, ranks, m)
                  for m, t in zip(microbatches, measured)]
    return max(0.0, statistics.mean(remainders))


def shared_core_action_seconds(machine: MachineCosts, ranks: int, microbatches: Sequence[int],
                               measured: Sequence[float]) -> float:
    """Seconds per action when a node runs more ranks than it has cores: at least the
    runtime's own (``machine.action_seconds``, from the spans), and as much more as makes
    the probe's predicted step grow from the fewest to the most microbatches as the
    measured one did (bisection). A rank whose message arrives waits for a core before it
    acts again; the spans do not show that wait, the step's growth per action does.

    Args:
        machine: the measured costs (``action_seconds`` the floor).
        ranks: the probe pipeline's stages (one per rank).
        microbatches: the microbatch counts measured, increasing.
        measured: seconds of one step at each count.

    Returns:
        The per-action seconds.
    """
    def growth(action: float) -> float:
        at = dataclasses.replace(machine, action_seconds=action)
        return _probe_seconds(at, ranks, microbatches[-1]) - _probe_seconds(at, ranks, microbatches[0])
    target = measured[-1] - measured[0]
    low = high = machine.action_seconds
    if growth(low) >= target:
        return low
    step = max(low, 1e-6)
    while growth(high) < target and high < 10.0:  # the predicted step grows with the actions
        low, high = high, high + step
        step *= 2
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if growth(middle) < target else (low, middle)
    return high


def _optimizer_step_seconds(device: torch.device) -> float:
    """``torch.optim.Adam``'s step and ``zero_grad`` over one one-element parameter: what
    a rank's optimizer costs per step whatever its parameters (the layers' own share is
    ``LayerCost.optimizer_seconds``, measured by ``measure_layer_costs`` the same way)."""
    weight = nn.Parameter(torch.zeros(1, device=device))
    optimizer = torch.optim.Adam([weight], lr=1e-3)

    def step() -> None:
        weight.grad = torch.ones_like(weight)
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _min_seconds(step, warmup=2, clock=_compute_clock(device))


def _local(device: torch.device) -> Dict[str, float]:
    """What one process measures alone: the optimizer, cores and ranks per node."""
    return {"optimizer_step_seconds": _optimizer_step_seconds(device),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
            os.cpu_count() or 1,
            "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}


def _with_overheads(values: Dict[str, Any], ranks: int, steps: Sequence[float],
                    runtime: Dict[str, float]) -> MachineCosts:
    """``values`` as costs, with the probe pipeline's seconds per action and per send (the
    runtime's send when it costs more than a bare ``isend``: its protocol and the threads
    it wakes) and the step seconds fitted to the probe's steps, plus the optimizer's
    per-step cost (``optimizer_step_seconds``)."""
    values = dict(values)
    optimizer = values.pop("optimizer_step_seconds", 0.0)
    machine = dataclasses.replace(
        MachineCosts.from_dict(values), action_seconds=runtime["action_seconds"],
        send_seconds=max(values.get("send_seconds", 0.0), runtime["send_seconds"]))
    if ranks > 1 and machine.cores > 0 and machine.ranks_per_node > machine.cores:
        machine = dataclasses.replace(machine, action_seconds=shared_core_action_seconds(
            machine, ranks, _MICROBATCHES, steps))
    step = step_overhead(machine, ranks, _MICROBATCHES, steps)
    return dataclasses.replace(machine, step_seconds=step + optimizer)


def _describe(costs: MachineCosts) -> str:
    return (f"step {costs.step_seconds * 1e3:.3f} ms + {costs.action_seconds * 1e6:.1f} us per "
            f"action, send post {costs.send_seconds * 1e6:.1f} us + "
            f"{costs.send_seconds_per_byte * 1e12:.0f} us/MB, p2p "
            f"{costs.latency_seconds * 1e6:.1f} us + {costs.bandwidth / 1e9:.2f} GB/s, all-reduce "
            f"{costs.all_reduce_latency_seconds * 1e6:.1f} us + "
            f"{costs.all_reduce_bandwidth / 1e9:.2f} GB/s, {costs.cores} cores for "
            f"{costs.ranks_per_node} ranks per node")


# -- the entry points ---------------------------------------------------------------------
@contextlib.contextmanager
def _local_group(device: torch.device) -> Iterator[dist.ProcessGroup]:
    """The group of this process alone: the default group of a one-process world, made for
    the body when there is none.

    Raises:
        ValueError: a default group of several processes (its ranks must calibrate
            together: :func:`calibrate`).
    """
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            raise ValueError(f"calibrate_local runs in a process of its own, but this one is rank "
                             f"{dist.get_rank()} of {dist.get_world_size()}; call calibrate(group, "
                             "device, ...) on every rank instead")
        yield dist.group.WORLD
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def cached_on_every_rank(cache: Dict[K, V], key: K, group: dist.ProcessGroup, timeout: float,
                         recalibrate: bool = False) -> Optional[V]:
    """``cache[key]`` when every rank of ``group`` has it and none asked to measure
    again, else None on every rank (collective).

    Every rank stores its entry in the same call after the same broadcast, so they agree
    by construction; but a rank whose broadcast timed out (or that cleared its cache, or
    passed ``recalibrate``) would skip the collectives the others run and hang them, so
    one all-reduce counts the ranks that will use the entry.

    Args:
        cache: this process's measured values by key.
        key: the group's entry (its global ranks and device, at least).
        group: every rank that measures together.
        timeout: seconds the all-reduce may wait.
        recalibrate: this rank wants to measure again.
    """
    mine = cache.get(key) if not recalibrate else None
    if dist.get_world_size(group) > 1:
        count = torch.tensor([0.0 if mine is None else 1.0],
                             device=collectives.metadata_device(group))
        collectives.all_reduce_waited(count, group, timeout)
        if int(count.item()) != dist.get_world_size(group):
            return None
    return mine


def _broadcast_json(payload: Optional[Dict[str, Any]], group: dist.ProcessGroup,
                    timeout: float) -> Dict[str, Any]:
    """Group rank 0's JSON object on every rank, waiting at most ``timeout`` seconds."""
    device = collectives.metadata_device(group)
    buffer = torch.zeros(_BUFFER, dtype=torch.uint8)
    if dist.get_rank(group) == 0:
        data = json.dumps(payload).encode()
        if len(data) > _BUFFER:  # a long error message: cut, still valid JSON
            data = json.dumps({"error": str(payload)[:_BUFFER // 2]}).encode()
        buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffer = buffer.to(device)
    collectives.broadcast_waited(buffer, dist.get_global_rank(group, 0), group, timeout)
    raw = buffer.cpu().numpy().tobytes().rstrip(b"\0")
    return json.loads(raw.decode())


def calibrate(group: dist.ProcessGroup, device: torch.device, *, timeout: float,
              pipeline: PipelineFactory, recalibrate: bool = False) -> MachineCosts:
    """Measures the machine's costs (module docstring); collective over ``group``.

    Takes well under two seconds on a CPU machine of 2 to 4 ranks: probes between ranks 0
    and 1, all-reduces over the group, the probe pipeline over every rank and, on rank 0,
    a few Adam steps. A later call over the same ranks and device returns the cached
    costs (after one all-reduce checking every rank has them).

    Every rank of ``group`` must call it; it makes no group of its own (the probe
    pipeline's groups are those of a pipeline over ``group``, made on every rank alike).

    Args:
        group: the ranks whose costs are measured (each must call this).
        device: this rank's pipeline device (probes use it when the group has a backend
            for it, else the group's metadata device).
        timeout: seconds any wait on another rank may take.
        pipeline: ``PipeDream`` (its constructor: ``_planning`` cannot import it).
        recalibrate: measure again even when the costs are cached (on any rank: all
            of them measure).

    Returns:
        The machine's costs (seconds, bytes/s, counts), the same on every rank (rank 0's
        measurement; what it cannot measure, the cost model's defaults).

    Raises:
        RuntimeError: rank 0's measurement failed (on every rank, with its message), or a
            peer did not answer within ``timeout``.
    """
    device = torch.device(device)
    key = (tuple(dist.get_process_group_ranks(group)), str(device))
    cached = cached_on_every_rank(_CACHE, key, group, timeout, recalibrate)
    if cached is not None:
        return cached
    start = time.perf_counter()
    probe = probe_device(group, device)
    world = dist.get_world_size(group)
    values: Dict[str, Any] = {}
    if world > 1:
        values.update(_point_to_point(group, probe, timeout))
        values.update(_all_reduce(group, probe, timeout))
    steps, runtime = _step_times(pipeline, group, device, timeout)
    payload = None
    if dist.get_rank(group) == 0:
        try:
            values.update(_local(device))
            values["ranks_per_node"] = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            payload = {"costs": _with_overheads(values, world, steps, runtime).to_dict()}
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            payload = {"error": f"{type(exc).__name__}: {exc}"}
    answer = _broadcast_json(payload, group, timeout)
    if "error" in answer:
        raise RuntimeError(f"calibrating the machine's costs failed on rank 0: {answer['error']}")
    costs = _CACHE[key] = MachineCosts.from_dict(answer["costs"])
    if dist.get_rank(group) == 0:
        log.info("calibrated in %.2f s (probe steps %s ms): %s", time.perf_counter() - start,
                 "/".join(f"{t * 1e3:.2f}" for t in steps), _describe(costs))
    return costs


def calibrate_local(device: torch.device, *, pipeline: PipelineFactory,
                    timeout: float = 60.0, recalibrate: bool = False) -> MachineCosts:
    """The costs one process can measure (no peers): the runtime's overheads, the
    optimizer, cores; latency, bandwidth and all-reduce keep the cost model's defaults.

    Runs on the default group of a one-process world (made for the call when there is
    none, destroyed after). Cached per process and device, as :func:`calibrate`.

    Args:
        device: where the pipeline would run.
        pipeline: ``PipeDream`` (its constructor).
        timeout: seconds the probe pipeline may wait.
        recalibrate: measure again even when the costs are cached.

    Returns:
        The machine's costs (the cost model's defaults for latency and bandwidth).

    Raises:
        ValueError: this process is one rank of several (use :func:`calibrate`).
    """
    device = torch.device(device)
    key = ((), str(device))
    if not recalibrate and key in _CACHE:
        return _CACHE[key]
    start = time.perf_counter()
    with _local_group(device) as group:
        steps, runtime = _step_times(pipeline, group, device, timeout)
        costs = _CACHE[key] = _with_overheads(_local(device), 1, steps, runtime)
    log.info("calibrated (one process) in %.2f s: %s", time.perf_counter() - start,
             _describe(costs))
    return costs


def clear_cache() -> None:
    """Forgets every calibrated cost of this process: the next :func:`calibrate` (on
    every rank of its group) or :func:`calibrate_local` measures again."""
    _CACHE.clear()
