"""The small collectives the Python layer runs, with one device rule.

Owns every collective outside the C++ executor: the agreement exchanges
(``_agree``: arguments, stage fingerprints, batches), plan broadcast, bandwidth
probe, loss all-reduce, finite-check flags, trace and checkpoint metadata
gathering, and the broadcast of a replica leader's weights. Boundary tensors, replica all-reduces and the
schedule's own traffic are the executor's (``csrc/runtime``).

The device rule: a metadata tensor lives on the device the group has a backend
for, preferring the CPU. PipeDream creates its default group with
``cpu:gloo,cuda:nccl`` on GPU machines, so metadata stays on the CPU (no device
synchronisation per collective); a group the user created with NCCL alone gets
its metadata on the current CUDA device. Payloads travel as UTF-8 bytes in
uint8 tensors, never pickled.
"""
from __future__ import annotations

import datetime
import json
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist

from .groups import RankNames

__all__ = ["is_dtensor", "metadata_device", "all_reduce", "all_reduce_start", "all_reduce_bounded", "all_reduce_data",
           "broadcast_data", "broadcast_bytes", "from_rank_zero", "gather_bytes", "all_gather_json",
           "measure_bandwidth", "barrier",
           "raise_if_any_failed", "gather_outcomes", "failure_entry", "post_send", "post_receive",
           "all_reduce_waited", "broadcast_waited"]


def is_dtensor(value: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's or tensor parallelism's), duck-typed:
    importing the class costs start-up time for cases that only FSDP2 or TP create."""
    return hasattr(value, "device_mesh") and hasattr(value, "placements") and hasattr(value, "to_local")


def _backend_device_types(group: dist.ProcessGroup) -> set:
    """The device types ("cpu", "cuda") ``group`` has a backend for."""
    return {t.type if isinstance(t, torch.device) else str(t) for t in group._device_types}  # noqa: SLF001 - no public accessor


def metadata_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device metadata tensors of ``group`` live on: CPU when the group has a
    CPU backend, else the current CUDA device.

    Args:
        group: a process group (default: the default group).

    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", current)``.

    Raises:
        RuntimeError: the group has neither a CPU nor a CUDA backend.
    """
    group = group if group is not None else dist.group.WORLD
    types = _backend_device_types(group)
    if "cpu" in types:
        return torch.device("cpu")
    if "cuda" in types:
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(f"process group {group} has no CPU or CUDA backend (device types "
                       f"{sorted(types)}); create it with backend='gloo', 'nccl' or "
                       "'cpu:gloo,cuda:nccl'")


def all_reduce(values: List[float], group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM,
               dtype: torch.dtype = torch.float64) -> List[float]:
    """All-reduces a few numbers; returns them reduced (as Python numbers of ``dtype``)."""
    t = torch.tensor(values, dtype=dtype, device=metadata_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.cpu().tolist()


def all_reduce_start(value: Union[float, torch.Tensor],
                     group: dist.ProcessGroup) -> Tuple[torch.Tensor, Any]:
    """Starts summing one number (or a small vector) over ``group`` (float64, on the
    metadata device).

    Returns:
        The tensor being reduced and the all-reduce's handle (``wait()`` before reading).
    """
    device = metadata_device(group)
    t = value.to(device, torch.float64).clone() if isinstance(value, torch.Tensor) else \
        torch.tensor([value], dtype=torch.float64, device=device)
    return t, dist.all_reduce(t, group=group, async_op=True)


def all_reduce_bounded(values: torch.Tensor, group: dist.ProcessGroup, op: Any,
                       timeout: float) -> torch.Tensor:
    """Reduces a small vector over ``group`` on the metadata device and waits at most
    ``timeout`` seconds for it (a dead or stuck peer fails this rank instead of hanging it).

    Args:
        values: a few numbers (any device; copied to the metadata device).
        group: the ranks that reduce.
        op: ``dist.ReduceOp.SUM`` or ``MAX``.
        timeout: seconds the wait may take.

    Returns:
        The reduced vector, on the CPU.

    Raises:
        RuntimeError: the all-reduce failed or timed out (the backend's message).
    """
    t = values.detach().to(metadata_device(group)).clone()
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=timeout))
    return t.cpu()


def _require_data_backend(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Raises ValueError unless ``group`` has a backend for ``tensor``'s device type."""
    types = _backend_device_types(group)
    if tensor.device.type not in types:
        raise ValueError(f"process group {group} has no backend for {tensor.device.type} tensors "
                         f"(it has {sorted(types)}); create the default group with a backend for "
                         "the parameters' device, e.g. 'cpu:gloo,cuda:nccl'")


def all_reduce_data(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sums a data tensor (gradients) over ``group`` in place, on the tensor's own device.

    Unlike metadata, data stays where the parameters are: the group must have a
    backend for that device (PipeDream's default group has one for CPU and CUDA).

    Raises:
        ValueError: the group has no backend for the tensor's device.
    """
    _require_data_backend(tensor, group)
    dist.all_reduce(tensor, group=group)


def broadcast_data(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """Overwrites a data tensor (weights) with group rank ``src``'s, in place, on the
    tensor's own device (the rule of :func:`all_reduce_data`).

    Raises:
        ValueError: the group has no backend for the tensor's device.
    """
    _require_data_backend(tensor, group)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)


def _to_tensor(payload: bytes, size: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(size, dtype=torch.uint8)
    if payload:
        buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(device)


def broadcast_bytes(payload: Optional[bytes], src: int, group: dist.ProcessGroup) -> bytes:
    """Broadcasts a byte string from group rank ``src``; every rank gets it.

    Args:
        payload: the bytes on ``src`` (ignored elsewhere).
        src: the sender's rank within ``group``.
        group: the process group.
    """
    device = metadata_device(group)
    mine = dist.get_rank(group) == src
    length = torch.tensor([len(payload) if mine and payload else 0], dtype=torch.int64,
                          device=device)
    global_src = dist.get_global_rank(group, src)
    dist.broadcast(length, src=global_src, group=group)
    size = int(length.item())
    buffer = _to_tensor(payload if mine and payload else b"", size, device)
    dist.broadcast(buffer, src=global_src, group=group)
    return buffer.cpu().numpy().tobytes()


def from_rank_zero(compute: Callable[[], str], group: dist.ProcessGroup, failed: str) -> str:
    """Runs ``compute`` on group rank 0 and gives every rank its text (UTF-8, no pickle).

    Collective: every rank of ``group`` calls it; only rank 0 runs ``compute``.

    Args:
        compute: what rank 0 runs; its text reaches every rank.
        group: the process group.
        failed: how the other ranks' error begins when ``compute`` raised on rank 0.

    Raises:
        Exception: on rank 0, what ``compute`` raised; on the others a ``ValueError``
            ``"<failed>: <type>: <message>"``, so no rank waits on a rank that failed.
    """
    payload: Optional[bytes] = None
    error: Optional[BaseException] = None
    if dist.get_rank(group) == 0:
        try:
            payload = b"T" + compute().encode()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
            payload = b"E" + f"{type(exc).__name__}: {exc}".encode()
    data = broadcast_bytes(payload, 0, group)
    if data[:1] == b"E":
        if error is not None:
            raise error
        raise ValueError(f"{failed}: {data[1:].decode()}")
    return data[1:].decode()


def _gathered_lengths(size: int, group: dist.ProcessGroup, device: torch.device) -> List[int]:
    world = dist.get_world_size(group)
    length = torch.tensor([size], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    return [int(l.item()) for l in lengths]


def gather_bytes(payload: bytes, group: dist.ProcessGroup) -> Optional[List[bytes]]:
    """Gathers one byte string per rank on group rank 0.

    Returns:
        The byte strings in rank order on rank 0, ``None`` elsewhere.
    """
    device = metadata_device(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = _gathered_lengths(len(payload), group, device)
    size = max(lengths)
    buffer = _to_tensor(payload, size, device)
    gathered = [torch.zeros(size, dtype=torch.uint8, device=device)
                for _ in range(world)] if rank == 0 else None
    dist.gather(buffer, gathered, dst=dist.get_global_rank(group, 0), group=group)
    if gathered is None:
        return None
    return [g[:n].cpu().numpy().tobytes() for g, n in zip(gathered, lengths)]


def all_gather_json(payload: Any, group: dist.ProcessGroup) -> List[Any]:
    """Every rank contributes a JSON-serialisable object; every rank gets them all."""
    if dist.get_world_size(group) == 1:
        return [json.loads(json.dumps(payload))]
    device = metadata_device(group)
    data = json.dumps(payload).encode("utf-8")
    lengths = _gathered_lengths(len(data), group, device)
    size = max(lengths)
    mine = _to_tensor(data, size, device)
    gathered = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(gathered, mine, group=group)
    return [json.loads(t[:n].cpu().numpy().tobytes().decode("utf-8"))
            for t, n in zip(gathered, lengths)]


def barrier(group: dist.ProcessGroup, timeout: float) -> None:
    """A barrier that names a missing rank where the backend can (Gloo's
    ``monitored_barrier``); a plain barrier elsewhere."""
    if "gloo" in str(dist.get_backend(group)) and metadata_device(group).type == "cpu":
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout),
                               wait_all_ranks=True)
    else:
        dist.barrier(group=group)


def failure_entry(error: Optional[BaseException],
                  failure: Type[Exception] = RuntimeError) -> Optional[Dict[str, Any]]:
    """A rank's outcome as JSON for :func:`gather_outcomes` (``None``: it succeeded).

    Args:
        error: this rank's exception, or ``None``.
        failure: the type the agreed error is raised as (see :func:`gather_outcomes`).

    Returns:
        ``{"value": is it a ValueError, "message": text}``; the text is the
        exception's own message for a ``ValueError`` or an instance of a specific
        ``failure`` type (one more precise than ``RuntimeError``, whose messages
        already say what failed), else ``"TypeName: message"``.
    """
    if error is None:
        return None
    own = isinstance(error, ValueError) or (failure is not RuntimeError and isinstance(error, failure))
    return {"value": isinstance(error, ValueError),
            "message": str(error) if own else f"{type(error).__name__}: {error}"}


def _exchange(entry: Any, group: dist.ProcessGroup, timeout: float, what: str,
              failure: Type[Exception], names: Optional[RankNames]) -> List[Any]:
    """Barrier (bounded by ``timeout``), then :func:`all_gather_json`; none on 1 rank."""
    if dist.get_world_size(group) == 1:
        return [json.loads(json.dumps(entry))]
    try:
        barrier(group, timeout)
        return all_gather_json(entry, group)
    except Exception as exc:  # a dead or stuck peer
        me = f"rank {dist.get_rank(group)}" if names is None else names.of_global(dist.get_rank())
        raise failure(f"{me}: {what}: waiting for the other ranks failed: "
                      f"{type(exc).__name__}: {exc}") from exc


def gather_outcomes(error: Optional[BaseException], group: dist.ProcessGroup, timeout: float,
                    what: str, payload: Any = None,
                    failure: Type[Exception] = RuntimeError,
                    names: Optional[RankNames] = None) -> List[Any]:
    """Every rank reports whether its part of ``what`` failed, with a JSON payload;
    if any rank failed, every rank raises the same error.

    Lets a step that runs on each rank separately (and may run user code) fail on
    all of them together, instead of leaving the others to time out on a peer; the
    payloads let the ranks share what they need next in the same exchange.

    Args:
        error: this rank's exception, or ``None``.
        group: the ranks that agree.
        timeout: seconds the barrier before the exchange may wait (Gloo names a
            rank that does not arrive).
        what: the operation, for the message (``"load_state_dict"``).
        payload: this rank's JSON-serialisable contribution (sent even on failure).
        failure: the exception type raised for anything but bad input (e.g. the
            checkpoint's ``CheckpointError``).
        names: how the message names ranks: by global rank with mesh coordinates
            (``RankNames``); default: ``group``'s ranks as they are.

    Returns:
        Every rank's payload, in group rank order.

    Raises:
        ValueError: every failed rank raised a ``ValueError`` (bad input).
        failure: any other failure, with the original type named; or a peer did not
            arrive. The message names the failed ranks and each distinct message
            once: ``"{what} failed on rank 1: ..."``.
    """
    entry = {"error": failure_entry(error, failure), "payload": payload}
    gathered = _exchange(entry, group, timeout, what, failure, names)
    failed = [(rank, e["error"]) for rank, e in enumerate(gathered) if e["error"] is not None]
    if failed:
        messages: List[str] = []
        for _, e in failed:
            if e["message"] not in messages:
                messages.append(e["message"])
        ranks = [r for r, _ in failed]
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" \
            if names is None else names.many([dist.get_global_rank(group, r) for r in ranks])
        text = f"{what} failed on {where}: " + "; ".join(messages)
        if all(e["value"] for _, e in failed):
            raise ValueError(text) from error
        raise failure(text) from error
    return [e["payload"] for e in gathered]


def raise_if_any_failed(error: Optional[BaseException], group: dist.ProcessGroup, timeout: float,
                        what: str, names: Optional[RankNames] = None) -> None:
    """Every rank reports whether its part of ``what`` failed; if any did, every rank raises.

    :func:`gather_outcomes` without payloads, raising ``RuntimeError`` for
    anything but bad input.

    Args:
        error: this rank's exception, or ``None``.
        group: the ranks that agree.
        timeout: seconds the barrier before the exchange may wait.
        what: the operation, for the message (``"load_state_dict"``).
        names: how the message names ranks (:func:`gather_outcomes`).

    Raises:
        ValueError: every failed rank raised a ``ValueError`` (bad input).
        RuntimeError: any other failure, with the original type named; or a peer
            did not arrive.
    """
    gather_outcomes(error, group, timeout, what, names=names)


def measure_bandwidth(group: dist.ProcessGroup, a: int, b: int, size: int = 4 << 20,
                      rounds: int = 3, device: Optional[torch.device] = None) -> float:
    """Bytes/s between group ranks ``a`` and ``b`` (ping-pong of ``size`` bytes,
    ``rounds`` times each way). Every rank of ``group`` must call it.

    Args:
        device: where the probe's buffer lives (default: the metadata device;
            pass the pipeline's device to measure what boundary tensors see).
    """
    rank = dist.get_rank(group)
    probe_device = device if device is not None else metadata_device(group)
    seconds = 0.0
    if rank in (a, b):
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=probe_device)
        peer = dist.get_global_rank(group, b if rank == a else a)
        start = time.perf_counter()
        for _ in range(rounds):
            if rank == a:
                dist.send(buffer, peer, group=group)
                dist.recv(buffer, peer, group=group)
            else:
                dist.recv(buffer, peer, group=group)
                dist.send(buffer, peer, group=group)
        seconds = time.perf_counter() - start
    # Only a and b measured; the others contribute 0 and the maximum is theirs.
    seconds = all_reduce([seconds], group, op=dist.ReduceOp.MAX)[0]
    return 2 * rounds * size / max(seconds, 1e-9)


def post_send(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Any:
    """Posts a send of ``tensor`` to global rank ``peer`` (the calibration's probes; the
    caller picks a device ``group`` has a backend for); returns its work to wait on."""
    return dist.isend(tensor, peer, group=group)


def post_receive(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Any:
    """Posts a receive into ``tensor`` from global rank ``peer``; returns its work."""
    return dist.irecv(tensor, peer, group=group)


def all_reduce_waited(tensor: torch.Tensor, group: dist.ProcessGroup, timeout: float) -> None:
    """Sums ``tensor`` over ``group`` in place, waiting at most ``timeout`` seconds."""
    dist.all_reduce(tensor, group=group, async_op=True).wait(datetime.timedelta(seconds=timeout))


def broadcast_waited(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, timeout: float) -> None:
    """``tensor`` from global rank ``src`` on every rank of ``group``, waiting at most
    ``timeout`` seconds."""
    dist.broadcast(tensor, src=src, group=group, async_op=True).wait(datetime.timedelta(seconds=timeout))
