"""What a mesh's data parallelism costs inside a step, measured on our own runtime:
:func:`mesh_costs`.

The cost model (``csrc/core/configure.h``) counts the calls as the runtime issues them:
replicated stages one flat all-reduce per stage with parameters after the step
(``_parallel/data_parallel.py``); FSDP per step one all-gather (the first forward;
``reshard_after_forward=False`` keeps the weights for the step) and one reduce-scatter
(deferred to the step's end) per unit, a top-level layer with parameters
(``_parallel/fsdp.py``). On a CPU over Gloo such a call inside a step (ranks waking
each other, FSDP2's hooks and copies) costs several times a bare all-reduce's latency,
so it is measured on probe pipelines over ``mesh (1, world)`` of ``Linear(1, 1)`` layers:
``replicate_call_seconds`` is a one-layer replicated probe's step less what the
calibrated cost model predicts for it without data parallelism;
``fsdp_call_seconds`` the difference of FSDP probes of one and ``_UNITS`` units per
extra call. Only searches that score ``dp > 1`` run it (a few seconds on 2 to 4 CPU
ranks); it is cached per ranks and device like the rest of the calibration.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from ..configuration import Configuration, LayerCost, MachineCosts, predict
from .calibration import cached_on_every_rank, probe_device, quiet_pipeline_log

__all__ = ["mesh_costs"]

_log = logging.getLogger(__name__)

#: Units of the larger probe (the smaller has one).
_UNITS = 5
#: Timed steps per probe (after warm-up), their lower quartile taken.
_ROUNDS = 12
_WARMUP = 3

_CACHE: Dict[Tuple[Tuple[int, ...], str, bool], Dict[str, float]] = {}

PipelineFactory = Callable[..., Any]


def _probe_step(pipeline: PipelineFactory, mesh: Any, units: int, sharding: str,
                device: torch.device, timeout: float) -> float:
    """Lower quartile of the step seconds of a probe of ``units`` layers held as
    ``sharding`` (gpipe, one microbatch of one row per dp rank; barriers keep the ranks
    aligned)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(units)]).to(device)
    with quiet_pipeline_log():
        pipe = pipeline(model, nn.functional.mse_loss, schedule="gpipe", microbatches=1,
                        balance=[units], mesh=mesh, data_parallel=sharding, device=device,
                        timeout=timeout)
    x, y = torch.zeros(1, 1, device=device), torch.zeros(1, 1, device=device)
    times: List[float] = []
    try:
        for k in range(_WARMUP + _ROUNDS):
            collectives.barrier(mesh.get_group("dp"), timeout)
            start = time.perf_counter()
            pipe.step(x, y)
            if k >= _WARMUP:
                times.append(time.perf_counter() - start)
    finally:
        pipe.close()
    return statistics.quantiles(times, n=4)[0]


def _replicate_model_seconds(machine: MachineCosts, world: int) -> float:
    """What the calibrated cost model predicts for the one-layer replicated probe
    without its all-reduce."""
    probe = LayerCost(output_bytes_per_sample=4.0, input_bytes_per_sample=4.0,
                      parameter_bytes=8.0, parameter_tensors=2.0, largest_parameter_bytes=4.0)
    config = Configuration(schedule="gpipe", microbatches=1, balance=[1], mesh=(1, world, 1))
    free = dataclasses.replace(machine, all_reduce_latency_seconds=0.0, all_reduce_bandwidth=1e30,
                               replicate_call_seconds=0.0, optimizer_seconds_per_byte=0.0,
                               optimizer_seconds_per_tensor=0.0)
    return predict([probe], free, config, batch_size=1).step_seconds


def mesh_costs(group: dist.ProcessGroup, device: torch.device, machine: MachineCosts, *,
               timeout: float, pipeline: PipelineFactory, fsdp: bool) -> MachineCosts:
    """``machine`` with the in-step calls of data parallelism measured (module
    docstring): ``replicate_call_seconds``, and with ``fsdp`` ``fsdp_call_seconds``;
    collective over ``group``, which must be the whole world (the probes' DeviceMesh).

    Args:
        group: every rank (each must call this).
        device: this rank's pipeline device.
        machine: the calibrated costs (``calibration.calibrate``).
        timeout: seconds any wait on another rank may take.
        pipeline: ``PipeDream`` (its constructor: ``_planning`` cannot import it).
        fsdp: measure FSDP's call too.

    Returns:
        The costs, the same on every rank (rank 0's measurement); ``machine`` unchanged
        on one rank or when ``group`` is not the world (the cost model then takes an
        all-reduce's latency per call).
    """
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - only for dp

    world = dist.get_world_size(group)
    if world == 1 or world != dist.get_world_size():
        return machine
    key = (tuple(dist.get_process_group_ranks(group)), str(device), fsdp)
    costs = cached_on_every_rank(_CACHE, key, group, timeout)
    if costs is None:
        start = time.perf_counter()
        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("pp", "dp"))
        replicated = _probe_step(pipeline, mesh, 1, "replicate", device, timeout)
        measured = [max(0.0, replicated - _replicate_model_seconds(machine, world)), 0.0]
        if fsdp:
            one = _probe_step(pipeline, mesh, 1, "fsdp", device, timeout)
            many = _probe_step(pipeline, mesh, _UNITS, "fsdp", device, timeout)
            measured[1] = max(0.0, (many - one) / (2 * (_UNITS - 1)))
        values = torch.tensor(measured, dtype=torch.float64, device=probe_device(group, device))
        collectives.broadcast_waited(values, dist.get_global_rank(group, 0), group, timeout)
        costs = _CACHE[key] = {"replicate_call_seconds": float(values[0]),
                               "fsdp_call_seconds": float(values[1])}
        if dist.get_rank(group) == 0:
            _log.info("data parallelism calibrated in %.2f s: %.3f ms per replicated all-reduce, "
                      "%.3f ms per FSDP call, in a step", time.perf_counter() - start,
                      values[0] * 1e3, values[1] * 1e3)
    return dataclasses.replace(machine, **costs)
