"""What this machine adds to the layers' compute, measured at start-up: ``calibrate``.

Owns the machine's side of the configuration search's cost model
(csrc/core/configure.h, ``MachineCosts``), measured in a few hundred milliseconds:

- point-to-point latency and bandwidth between group ranks 0 and 1: a ping-pong of a
  one-element message, then of 4 MiB (``latency + bytes / bandwidth`` each way), and
  the time rank 0 takes to post a send (``isend`` of a small message, not waiting);
- all-reduce latency and bus bandwidth over the group: one float, then 4 MiB (a ring
  moves ``2 (n - 1) / n`` of the bytes);
- the runtime's own overheads, on our runtime: rank 0 times a one-stage pipeline of
  one ``Linear(1, 1)`` (built with ``pipeline``, ``PipeDream``'s constructor, on a
  group of rank 0 alone) at two microbatch counts and fits ``step = step_seconds +
  actions * action_seconds`` (a forward and a backward action per microbatch);
- the optimizer: ``torch.optim.Adam`` steps on a scratch tensor, seconds per byte;
- cores this process may use (``os.sched_getaffinity``) and ranks per node
  (torchrun's ``LOCAL_WORLD_SIZE``).

Rank 0's values reach every rank as JSON (no pickle); every wait has a timeout.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives

__all__ = ["MACHINE_COST_KEYS", "calibrate", "calibrate_local"]

log = logging.getLogger(__name__)

#: The fields of the machine's costs (``configuration.MachineCosts``, csrc/core/configure.h).
MACHINE_COST_KEYS = ("action_seconds", "send_seconds", "step_seconds", "latency_seconds",
                     "bandwidth", "all_reduce_latency_seconds", "all_reduce_bandwidth",
                     "optimizer_seconds_per_byte", "cores", "ranks_per_node")

#: ``PipeDream``'s constructor (``_planning`` sits below the pipeline, so it is passed in).
PipelineFactory = Callable[..., Any]

_LARGE = 4 << 20  # bytes of the bandwidth probes
_ROUNDS = 5       # timed repetitions of each probe (the median is kept)
_BUFFER = 4096    # bytes of the broadcast carrying rank 0's JSON
_MICROBATCHES = (2, 16)  # the overhead probe's two microbatch counts


def _delta(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout)


def _median_seconds(run: Callable[[], None], rounds: int, warmup: int = 1) -> float:
    times = []
    for i in range(warmup + rounds):
        start = time.perf_counter()
        run()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _probe_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
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
            dist.isend(buffer, peer, group=group).wait(_delta(timeout))
            dist.irecv(buffer, peer, group=group).wait(_delta(timeout))
        else:
            dist.irecv(buffer, peer, group=group).wait(_delta(timeout))
            dist.isend(buffer, peer, group=group).wait(_delta(timeout))
    return _median_seconds(round_trip, _ROUNDS) / 2


def _post_seconds(group: dist.ProcessGroup, device: torch.device, timeout: float) -> float:
    """Rank 0's time to post one small send (rank 1 receives them; others wait)."""
    rank, count = dist.get_rank(group), 16
    if rank > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - rank)
    buffers = [torch.zeros(256, device=device) for _ in range(count)]
    if rank == 1:
        for work in [dist.irecv(b, peer, group=group) for b in buffers]:
            work.wait(_delta(timeout))
        return 0.0
    start = time.perf_counter()
    works = [dist.isend(b, peer, group=group) for b in buffers]
    posted = time.perf_counter() - start
    for work in works:
        work.wait(_delta(timeout))
    return posted / count


def _point_to_point(group: dist.ProcessGroup, device: torch.device,
                    timeout: float) -> Dict[str, float]:
    """Latency, bandwidth and send posting between group ranks 0 and 1."""
    small = torch.zeros(1, device=device)
    large = torch.zeros(_LARGE // 4, device=device)
    latency = _ping_pong(group, small, timeout)
    one_way = _ping_pong(group, large, timeout)
    send = _post_seconds(group, device, timeout)
    return {"latency_seconds": latency, "send_seconds": send,
            "bandwidth": _LARGE / max(one_way - latency, 1e-9)}


def _all_reduce(group: dist.ProcessGroup, device: torch.device, timeout: float) -> Dict[str, float]:
    """All-reduce latency (one float) and ring bus bandwidth (4 MiB) over the group."""
    world = dist.get_world_size(group)
    small = torch.zeros(1, device=device)
    large = torch.zeros(_LARGE // 4, device=device)

    def reduce(t: torch.Tensor) -> Callable[[], None]:
        return lambda: dist.all_reduce(t, group=group, async_op=True).wait(_delta(timeout))
    latency = _median_seconds(reduce(small), _ROUNDS)
    seconds = _median_seconds(reduce(large), _ROUNDS)
    moved = 2 * (world - 1) / world * _LARGE
    return {"all_reduce_latency_seconds": latency,
            "all_reduce_bandwidth": moved / max(seconds - latency, 1e-9)}


# -- on rank 0 alone ----------------------------------------------------------------------
def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """``(intercept, slope)`` through two points, both kept >= 0."""
    slope = max(0.0, (ys[1] - ys[0]) / (xs[1] - xs[0]))
    return max(0.0, ys[0] - slope * xs[0]), slope


def _overheads(pipeline: PipelineFactory, group: dist.ProcessGroup, device: torch.device,
               timeout: float) -> Dict[str, float]:
    """The runtime's per-step and per-action seconds: a one-stage pipeline of a
    ``Linear(1, 1)`` on ``group`` (one rank), timed at two microbatch counts."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 1)).to(device)
    steps = []
    for m in _MICROBATCHES:
        pipe = pipeline(model, nn.functional.mse_loss, schedule="gpipe", microbatches=m,
                        balance=[1], process_group=group, device=device, timeout=timeout)
        x, y = torch.zeros(m, 1, device=device), torch.zeros(m, 1, device=device)
        try:
            steps.append(_median_seconds(lambda: pipe.step(x, y), 7, warmup=2))
        finally:
            pipe.close()
    step, action = _fit_line([2 * m for m in _MICROBATCHES], steps)
    return {"step_seconds": step, "action_seconds": action}


def _optimizer_seconds_per_byte(device: torch.device) -> float:
    """``torch.optim.Adam``'s step time per parameter byte (a 4 MiB scratch tensor)."""
    weight = nn.Parameter(torch.zeros(_LARGE // 4, device=device))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.Adam([weight], lr=1e-3)

    def step() -> None:
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _median_seconds(step, _ROUNDS, warmup=2) / _LARGE


def _local(pipeline: PipelineFactory, group: dist.ProcessGroup, device: torch.device,
           timeout: float) -> Dict[str, float]:
    """What one process measures: the runtime's overheads, the optimizer, cores and ranks
    per node."""
    values = _overheads(pipeline, group, device, timeout)
    values["optimizer_seconds_per_byte"] = _optimizer_seconds_per_byte(device)
    values["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    values["ranks_per_node"] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return values


def _machine_costs(values: Dict[str, Any]) -> Dict[str, Any]:
    """``values`` completed with the cost model's defaults, in :data:`MACHINE_COST_KEYS` order."""
    defaults = {"action_seconds": 0.0, "send_seconds": 0.0, "step_seconds": 0.0,
                "latency_seconds": 0.0, "bandwidth": 1e10, "all_reduce_latency_seconds": 0.0,
                "all_reduce_bandwidth": 1e10, "optimizer_seconds_per_byte": 0.0, "cores": 0,
                "ranks_per_node": 0}
    merged = {k: values.get(k, defaults[k]) for k in MACHINE_COST_KEYS}
    merged["cores"], merged["ranks_per_node"] = int(merged["cores"]), int(merged["ranks_per_node"])
    return merged


def _describe(costs: Dict[str, Any]) -> str:
    return (f"step {costs['step_seconds'] * 1e3:.3f} ms + {costs['action_seconds'] * 1e6:.1f} us "
            f"per action, send post {costs['send_seconds'] * 1e6:.1f} us, p2p "
            f"{costs['latency_seconds'] * 1e6:.1f} us + {costs['bandwidth'] / 1e9:.2f} GB/s, "
            f"all-reduce {costs['all_reduce_latency_seconds'] * 1e6:.1f} us + "
            f"{costs['all_reduce_bandwidth'] / 1e9:.2f} GB/s, Adam "
            f"{costs['optimizer_seconds_per_byte'] * 1e9:.3f} ns/byte, {costs['cores']} cores for "
            f"{costs['ranks_per_node']} ranks per node")


# -- the entry points ---------------------------------------------------------------------
@contextlib.contextmanager
def _group_of_one(device: torch.device, members: Optional[List[int]] = None
                  ) -> Iterator[dist.ProcessGroup]:
    """A process group of this rank alone (``members``: its global rank), made by this
    rank only; without a default group, a one-process default group for the body."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
        return
    group = dist.new_group(members or [dist.get_rank()], use_local_synchronization=True)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


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
    dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group,
                   async_op=True).wait(_delta(timeout))
    raw = buffer.cpu().numpy().tobytes().rstrip(b"\0")
    return json.loads(raw.decode())


def calibrate(group: dist.ProcessGroup, device: torch.device, *, timeout: float,
              pipeline: PipelineFactory) -> Dict[str, Any]:
    """Measures the machine's costs (module docstring); collective over ``group``.

    Takes a fraction of a second on a CPU machine: two probes between ranks 0 and 1, two
    all-reduces over the group, and on rank 0 a one-rank pipeline and a few Adam steps.

    Args:
        group: every rank of the run (each must call this).
        device: this rank's pipeline device (probes use it when the group has a backend
            for it, else the group's metadata device).
        timeout: seconds any wait on another rank may take.
        pipeline: ``PipeDream`` (its constructor: ``_planning`` cannot import it).

    Returns:
        The machine's costs, a dict of :data:`MACHINE_COST_KEYS` (seconds, bytes/s,
        counts), the same on every rank (rank 0's measurement).

    Raises:
        RuntimeError: rank 0's measurement failed (on every rank, with its message), or a
            peer did not answer within ``timeout``.
    """
    start = time.perf_counter()
    device = torch.device(device)
    probe = _probe_device(group, device)
    values: Dict[str, Any] = {"ranks_per_node": int(os.environ.get(
        "LOCAL_WORLD_SIZE", dist.get_world_size(group)))}
    if dist.get_world_size(group) > 1:
        values.update(_point_to_point(group, probe, timeout))
        values.update(_all_reduce(group, probe, timeout))
    payload = None
    if dist.get_rank(group) == 0:
        try:
            with _group_of_one(device, [dist.get_global_rank(group, 0)]) as alone:
                local = _local(pipeline, alone, device, timeout)
            local["ranks_per_node"] = values["ranks_per_node"]
            payload = {"costs": _machine_costs({**values, **local})}
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            payload = {"error": f"{type(exc).__name__}: {exc}"}
    answer = _broadcast_json(payload, group, timeout)
    if "error" in answer:
        raise RuntimeError(f"calibrating the machine's costs failed on rank 0: {answer['error']}")
    costs = answer["costs"]
    if dist.get_rank(group) == 0:
        log.info("calibrated in %.2f s: %s", time.perf_counter() - start, _describe(costs))
    return costs


def calibrate_local(device: torch.device, *, pipeline: PipelineFactory,
                    timeout: float = 60.0) -> Dict[str, Any]:
    """The costs one process can measure (no peers): the runtime's overheads, the
    optimizer, cores; latency, bandwidth and all-reduce keep the cost model's defaults.

    Runs on a process group of this rank alone (a one-process default group for the call
    when none exists, destroyed after).

    Args:
        device: where the pipeline would run.
        pipeline: ``PipeDream`` (its constructor).
        timeout: seconds the probe pipeline may wait.

    Returns:
        A dict of :data:`MACHINE_COST_KEYS`.
    """
    start = time.perf_counter()
    device = torch.device(device)
    with _group_of_one(device) as group:
        costs = _machine_costs(_local(pipeline, group, device, timeout))
    log.info("calibrated (one process) in %.2f s: %s", time.perf_counter() - start,
             _describe(costs))
    return costs
