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
  actions * action_seconds`` (a forward and a backward action per microbatch); this
  and the optimizer are timed on the thread's CPU clock when the CPU computes with one
  thread (other processes on the cores do not stretch them), the probes on the wall clock;
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
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._dist.groups import checkpoint_group, side_group
from ..configuration import MachineCosts

__all__ = ["calibrate", "calibrate_local"]

log = logging.getLogger(__name__)

#: ``PipeDream``'s constructor (``_planning`` sits below the pipeline, so it is passed in).
PipelineFactory = Callable[..., Any]

_LARGE = 4 << 20  # bytes of the bandwidth probes
_ROUNDS = 5       # timed repetitions of each probe (the median is kept)
_BUFFER = 4096    # bytes of the broadcast carrying rank 0's JSON
_TENSORS = 64    # tensors of the optimizer's per-tensor probe
_MICROBATCHES = (2, 16)  # the overhead probe's two microbatch counts


def _delta(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout)


def _median_seconds(run: Callable[[], None], rounds: int, warmup: int = 1,
                    clock: Callable[[], float] = time.perf_counter) -> float:
    times = []
    for i in range(warmup + rounds):
        start = clock()
        run()
        if i >= warmup:
            times.append(clock() - start)
    return statistics.median(times)


def _compute_clock(device: torch.device) -> Callable[[], float]:
    """For work that only computes: this thread's CPU time when it computes on the CPU
    with one thread (immune to other processes on the cores, as ``layer_costs`` times
    layers), else the wall clock."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 \
        else time.perf_counter


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
            collectives.post_send(buffer, peer, group).wait(_delta(timeout))
            collectives.post_receive(buffer, peer, group).wait(_delta(timeout))
        else:
            collectives.post_receive(buffer, peer, group).wait(_delta(timeout))
            collectives.post_send(buffer, peer, group).wait(_delta(timeout))
    return _median_seconds(round_trip, _ROUNDS) / 2


def _post_seconds(group: dist.ProcessGroup, device: torch.device, timeout: float) -> float:
    """Rank 0's time to post one small send (rank 1 receives them; others wait)."""
    rank, count = dist.get_rank(group), 16
    if rank > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - rank)
    buffers = [torch.zeros(256, device=device) for _ in range(count)]
    if rank == 1:
        for work in [collectives.post_receive(b, peer, group) for b in buffers]:
            work.wait(_delta(timeout))
        return 0.0
    start = time.perf_counter()
    works = [collectives.post_send(b, peer, group) for b in buffers]
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
        return lambda: collectives.all_reduce_waited(t, group, timeout)
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
            steps.append(_median_seconds(lambda: pipe.step(x, y), 15, warmup=3,
                                         clock=_compute_clock(device)))
        finally:
            pipe.close()
    step, action = _fit_line([2 * m for m in _MICROBATCHES], steps)
    return {"step_seconds": step, "action_seconds": action}


def _adam_seconds(device: torch.device, tensors: int) -> float:
    """``torch.optim.Adam``'s step time over ``_LARGE`` bytes of scratch parameters split
    into ``tensors`` equal tensors."""
    weights = [nn.Parameter(torch.zeros(_LARGE // 4 // tensors, device=device))
               for _ in range(tensors)]
    for weight in weights:
        weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.Adam(weights, lr=1e-3)

    def step() -> None:
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _median_seconds(step, _ROUNDS, warmup=2, clock=_compute_clock(device))


def _optimizer_costs(device: torch.device) -> Dict[str, float]:
    """Adam's step per parameter byte and per parameter tensor: the same bytes as one
    tensor and as ``_TENSORS`` tensors (the difference is the per-tensor cost)."""
    one, many = _adam_seconds(device, 1), _adam_seconds(device, _TENSORS)
    per_tensor = max(0.0, (many - one) / (_TENSORS - 1))
    return {"optimizer_seconds_per_tensor": per_tensor,
            "optimizer_seconds_per_byte": max(0.0, one - per_tensor) / _LARGE}


def _local(pipeline: PipelineFactory, group: dist.ProcessGroup, device: torch.device,
           timeout: float) -> Dict[str, float]:
    """What one process measures: the runtime's overheads, the optimizer, cores and ranks
    per node."""
    values = _overheads(pipeline, group, device, timeout)
    values.update(_optimizer_costs(device))
    values["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    values["ranks_per_node"] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return values


def _describe(costs: MachineCosts) -> str:
    return (f"step {costs.step_seconds * 1e3:.3f} ms + {costs.action_seconds * 1e6:.1f} us per "
            f"action, send post {costs.send_seconds * 1e6:.1f} us, p2p "
            f"{costs.latency_seconds * 1e6:.1f} us + {costs.bandwidth / 1e9:.2f} GB/s, all-reduce "
            f"{costs.all_reduce_latency_seconds * 1e6:.1f} us + "
            f"{costs.all_reduce_bandwidth / 1e9:.2f} GB/s, Adam "
            f"{costs.optimizer_seconds_per_byte * 1e9:.3f} ns/byte + "
            f"{costs.optimizer_seconds_per_tensor * 1e6:.1f} us/tensor, {costs.cores} cores for "
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


def _group_of_rank0(group: dist.ProcessGroup, timeout: float) -> Optional[dist.ProcessGroup]:
    """A group of ``group``'s rank 0 alone, for its probe pipeline (``None`` on other ranks).

    ``new_group`` is collective over the default group, in order, and so are the groups a
    pipeline makes for its ranks (side channel, checkpoints): every rank makes all three
    here, so the pipeline finds them made and the ranks' later groups stay in step.
    """
    ranks = [dist.get_global_rank(group, 0)]
    alone = dist.new_group(ranks, timeout=_delta(timeout))
    side_group(ranks)
    checkpoint_group(ranks, timeout)
    return alone if dist.get_rank(group) == 0 else None


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
              pipeline: PipelineFactory) -> MachineCosts:
    """Measures the machine's costs (module docstring); collective over ``group``.

    Takes a fraction of a second on a CPU machine: two probes between ranks 0 and 1, two
    all-reduces over the group, and on rank 0 a one-rank pipeline and a few Adam steps.

    Every rank of the default group must call it, in the same order as its other group
    creations (it makes a group of rank 0 alone, which ``new_group`` makes collective).

    Args:
        group: the ranks whose costs are measured (each must call this).
        device: this rank's pipeline device (probes use it when the group has a backend
            for it, else the group's metadata device).
        timeout: seconds any wait on another rank may take.
        pipeline: ``PipeDream`` (its constructor: ``_planning`` cannot import it).

    Returns:
        The machine's costs (seconds, bytes/s, counts), the same on every rank (rank 0's
        measurement; what it cannot measure, the cost model's defaults).

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
    alone = _group_of_rank0(group, timeout)
    if alone is not None:
        try:
            local = _local(pipeline, alone, device, timeout)
            local["ranks_per_node"] = values["ranks_per_node"]
            payload = {"costs": MachineCosts.from_dict({**values, **local}).to_dict()}
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            payload = {"error": f"{type(exc).__name__}: {exc}"}
    answer = _broadcast_json(payload, group, timeout)
    if "error" in answer:
        raise RuntimeError(f"calibrating the machine's costs failed on rank 0: {answer['error']}")
    costs = MachineCosts.from_dict(answer["costs"])
    if dist.get_rank(group) == 0:
        log.info("calibrated in %.2f s: %s", time.perf_counter() - start, _describe(costs))
    return costs


def calibrate_local(device: torch.device, *, pipeline: PipelineFactory,
                    timeout: float = 60.0) -> MachineCosts:
    """The costs one process can measure (no peers): the runtime's overheads, the
    optimizer, cores; latency, bandwidth and all-reduce keep the cost model's defaults.

    Runs on the default group of a one-process world (made for the call when there is
    none, destroyed after).

    Args:
        device: where the pipeline would run.
        pipeline: ``PipeDream`` (its constructor).
        timeout: seconds the probe pipeline may wait.

    Returns:
        The machine's costs (the cost model's defaults for latency and bandwidth).

    Raises:
        ValueError: this process is one rank of several (use :func:`calibrate`).
    """
    start = time.perf_counter()
    device = torch.device(device)
    with _local_group(device) as group:
        costs = MachineCosts.from_dict(_local(pipeline, group, device, timeout))
    log.info("calibrated (one process) in %.2f s: %s", time.perf_counter() - start,
             _describe(costs))
    return costs
