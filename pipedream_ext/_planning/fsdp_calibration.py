"""What one FSDP collective call costs inside a step, measured on our own runtime:
:func:`fsdp_call_seconds`.

The cost model (``csrc/core/configure.h``) counts FSDP's calls as the runtime issues
them: per step one all-gather (the first forward; ``reshard_after_forward=False`` keeps
the weights for the step) and one reduce-scatter (deferred to the step's end) per unit,
a top-level layer with parameters (``_parallel/fsdp.py``). On a CPU over Gloo such a
call with FSDP2's hooks and copies around it costs several times a bare all-reduce's
latency, so it is measured: two probe pipelines over ``mesh (1, world)`` with
``data_parallel="fsdp"``, one and ``_UNITS`` ``Linear(1, 1)`` units, and the difference
of their steps per extra call. Only ``mesh="auto"`` / ``data_parallel="auto"`` searches
that score FSDP run it (about a second on 2 CPU ranks); it is cached per ranks and
device like the rest of the calibration.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .calibration import _probe_device, _quiet_pipeline_log

__all__ = ["clear_cache", "fsdp_call_seconds"]

_log = logging.getLogger(__name__)

#: Units of the larger probe (the smaller has one).
_UNITS = 5
#: Timed steps per probe (after warm-up), their lower quartile taken.
_ROUNDS = 12
_WARMUP = 3

_CACHE: Dict[Tuple[Tuple[int, ...], str], float] = {}

PipelineFactory = Callable[..., Any]


def _probe_step(pipeline: PipelineFactory, mesh: Any, units: int, device: torch.device,
                timeout: float) -> float:
    """Lower quartile of the step seconds of a probe of ``units`` sharded layers
    (gpipe, one microbatch of one row per dp rank; barriers keep the ranks aligned)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(units)]).to(device)
    with _quiet_pipeline_log():
        pipe = pipeline(model, nn.functional.mse_loss, schedule="gpipe", microbatches=1,
                        balance=[units], mesh=mesh, data_parallel="fsdp", device=device,
                        timeout=timeout)
    x, y = torch.zeros(1, 1, device=device), torch.zeros(1, 1, device=device)
    times: List[float] = []
    try:
        for k in range(_WARMUP + _ROUNDS):
            dist.barrier(mesh.get_group("dp"))
            start = time.perf_counter()
            pipe.step(x, y)
            if k >= _WARMUP:
                times.append(time.perf_counter() - start)
    finally:
        pipe.close()
    return statistics.quantiles(times, n=4)[0]


def fsdp_call_seconds(group: dist.ProcessGroup, device: torch.device, *, timeout: float,
                      pipeline: PipelineFactory) -> float:
    """Seconds of one FSDP collective call of one unit in a step (module docstring);
    collective over ``group``, which must be the whole world (the probe's DeviceMesh).

    Args:
        group: every rank (each must call this).
        device: this rank's pipeline device.
        timeout: seconds any wait on another rank may take.
        pipeline: ``PipeDream`` (its constructor: ``_planning`` cannot import it).

    Returns:
        The seconds, the same on every rank (rank 0's); 0.0 (the cost model then takes an
        all-reduce's latency) on one rank or when ``group`` is not the world.
    """
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - only for FSDP

    world = dist.get_world_size(group)
    key = (tuple(dist.get_process_group_ranks(group)), str(device))
    if world == 1 or world != dist.get_world_size():
        return 0.0
    if key in _CACHE:
        return _CACHE[key]
    start = time.perf_counter()
    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("pp", "dp"))
    one = _probe_step(pipeline, mesh, 1, device, timeout)
    many = _probe_step(pipeline, mesh, _UNITS, device, timeout)
    value = torch.tensor([max(0.0, (many - one) / (2 * (_UNITS - 1)))], dtype=torch.float64,
                         device=_probe_device(group, device))
    dist.broadcast(value, dist.get_global_rank(group, 0), group=group)
    _CACHE[key] = float(value.item())
    if dist.get_rank(group) == 0:
        _log.info("FSDP calibrated in %.2f s: %.3f ms per collective call (probe steps "
                  "%.2f / %.2f ms with 1 / %d units)", time.perf_counter() - start,
                  _CACHE[key] * 1e3, one * 1e3, many * 1e3, _UNITS)
    return _CACHE[key]


def clear_cache() -> None:
    """Forgets the measured costs (tests)."""
    _CACHE.clear()
