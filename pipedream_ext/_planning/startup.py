"""Planning at start-up: ``balance="auto"`` and saved plans.

Owns turning a plan into the runtime's partition (``partition_from_plan``; a
traced model's plan becomes a stage per fx node in ``_graph_profile``) and
``balance="auto"`` (``auto_plan``): rank 0 profiles the model on the sample
(an ``nn.Sequential`` layer by layer, any other model as its traced graph),
plans for the torchrun world (one or two topology levels, bandwidths given or
measured) with the schedule's planner assumptions, and every rank gets the same
plan as JSON bytes (no pickle). With a ``(pp, dp)`` device mesh the plan is for
the pp dimension with ``data_parallel`` ranks inside every stage (``mesh_shape``:
a stage's dp ranks are consecutive, rank = stage * dp + dp_rank); with a ``(pp, dp,
tp)`` mesh, ``tensor_parallel`` ranks inside each of those (rank = (stage * dp +
dp_rank) * tp + tp_rank, ``Plan.mesh_ranks``), and a saved plan must be made for the
mesh's dp and tp sizes.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from ..planner import Plan
from ..planner import plan as make_plan
from .profiler import profile

__all__ = ["cluster_shape", "mesh_shape", "auto_plan", "check_plan_world", "partition_from_plan"]

_log = logging.getLogger(__name__)


def cluster_shape(world_size: int, per_node: Optional[int] = None) -> List[int]:
    """Workers per topology level, innermost first: ``[per_node]`` or ``[per_node, nodes]``.

    Args:
        world_size: ranks in the pipeline.
        per_node: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``); a
            value that does not divide the world means one node.
    """
    if per_node is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node < 1 or world_size % per_node:
        per_node = world_size
    nodes = world_size // per_node
    return [per_node] if nodes == 1 else [per_node, nodes]


def mesh_shape(world_size: int, data_parallel: int, per_node: Optional[int] = None,
               tensor_parallel: int = 1) -> List[int]:
    """Pipeline workers per topology level of a ``(pp, dp)`` or ``(pp, dp, tp)`` mesh,
    innermost first.

    A stage's ``data_parallel x tensor_parallel`` ranks are consecutive
    (``init_device_mesh(dev, (pp, dp, tp))``: rank = (stage * dp + dp_rank) * tp +
    tp_rank), so a node of ``per_node`` ranks holds ``per_node // (dp * tp)`` stages;
    when ``dp * tp`` does not divide it, one level.

    Args:
        world_size: ranks of the mesh (pp * dp * tp).
        data_parallel: the mesh's dp size.
        per_node: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``).
        tensor_parallel: the mesh's tp size.

    Raises:
        ValueError: ``data_parallel`` (times ``tensor_parallel``) is not a positive
            divisor of the world.
    """
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or \
            data_parallel < 1 or world_size % (data_parallel * tensor_parallel):
        raise ValueError(f"data_parallel={data_parallel!r} must be a positive divisor of the "
                         f"world size {world_size}"
                         + (f" / tensor_parallel {tensor_parallel}" if tensor_parallel > 1 else "")
                         + " (the mesh is pp x dp" + (" x tp" if tensor_parallel > 1 else "")
                         + " ranks); use the mesh's dp size")
    block = data_parallel * tensor_parallel
    pipeline = world_size // block
    if per_node is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    stages_per_node = per_node // block if per_node % block == 0 else pipeline
    return cluster_shape(pipeline, max(stages_per_node, 1))


def _bandwidths(group: dist.ProcessGroup, workers: List[int],
                bandwidth: Optional[Sequence[float]], data_parallel: Optional[int],
                tensor_parallel: int = 1) -> List[float]:
    """Bytes/s per level (with ``data_parallel`` > 1 the dp level first), given or measured.

    Collective when measuring: rank 0 probes its dp neighbour (rank ``tensor_parallel``),
    its next stage (rank dp * tp) and its first stage on the next node.
    """
    dp = data_parallel or 1
    if bandwidth is None:
        per_node, block = workers[0], dp * tensor_parallel
        measured = [collectives.measure_bandwidth(group, 0, block) if per_node > 1 else 1e10]
        if len(workers) > 1:
            measured.append(collectives.measure_bandwidth(group, 0, per_node * block))
        if dp > 1:
            measured.insert(0, collectives.measure_bandwidth(group, 0, tensor_parallel))
        bandwidth = measured
    bandwidth = [float(b) for b in bandwidth]
    levels = len(workers) + (1 if dp > 1 else 0)
    if len(bandwidth) == levels or (data_parallel == 1 and len(bandwidth) == levels + 1):
        return bandwidth
    if data_parallel is None:
        raise ValueError(f"bandwidth lists {len(bandwidth)} levels but the cluster has "
                         f"{len(workers)} ({workers}); give one bytes/s value per level")
    raise ValueError(f"bandwidth lists {len(bandwidth)} levels but a mesh of {dp} data-parallel "
                     f"ranks per stage and pipeline levels {workers} needs {levels}: "
                     + ("the dp ranks' bytes/s first, then " if dp > 1 else "")
                     + "one bytes/s value per pipeline level")


def auto_plan(module: nn.Module, loss_fn: Callable[..., torch.Tensor],
              sample: Optional[Tuple[Any, Any]], bandwidth: Optional[Sequence[float]],
              traits: Any, group: dist.ProcessGroup,
              profile_fn: Optional[Callable[[], Any]] = None,
              data_parallel: Optional[int] = None, sharding: Optional[str] = None,
              tensor_parallel: Optional[int] = None, sequence_parallel: bool = False) -> Plan:
    """Profiles on rank 0, plans for this world, and gives every rank the same plan.

    Collective: every rank of ``group`` calls it. If profiling or planning fails on
    rank 0, every rank raises (the others are told instead of waiting). With
    ``data_parallel``, ``group`` holds every rank of the ``(pp, dp)`` mesh (one plan
    for all of them) and the plan is for its pp dimension: straight stages over
    ``world / (data_parallel * tensor_parallel)`` pipeline workers, ``data_parallel``
    (times ``tensor_parallel``) ranks in each.

    Args:
        module: the whole model (an ``nn.Sequential``, profiled layer by layer).
        loss_fn: the pipeline's loss.
        sample: ``(inputs, targets)`` of one batch.
        bandwidth: bytes/s per level, or ``None`` to measure.
        traits: the schedule's traits (what the planner must assume).
        group: the pipeline's group.
        profile_fn: makes the profile graph instead (rank 0 only; a traced model's
            graph profile, ``graph_profile.profile_groups``).
        data_parallel: the mesh's dp size, or ``None`` (no mesh: PipeDream replicas
            may be planned). With dp > 1 a given ``bandwidth`` lists the dp ranks'
            bytes/s first, then one per pipeline level.
        sharding: with ``data_parallel``: ``"fsdp"`` or ``"replicate"`` (the plan's
            memory per rank; docs/planner.md).
        tensor_parallel: with ``data_parallel``: the mesh's tp size, or ``None`` (no tp
            dimension). Its bandwidth is measured between ranks 0 and 1 when
            ``bandwidth`` is ``None``, else the planner's default (the fastest given).
        sequence_parallel: with ``tensor_parallel``: the plan shards activations too.

    Raises:
        ValueError: no sample, bandwidths that do not match the levels, a
            ``data_parallel`` that does not divide the world, an ``nn.Sequential`` with
            fewer layers than a mesh's pipeline stages, or what profiling or planning
            raised on rank 0.
    """
    if sample is None:
        raise ValueError('balance="auto" profiles the model: pass sample=(inputs, targets) '
                         "with one batch")
    world_size, tp = dist.get_world_size(group), tensor_parallel or 1
    workers = cluster_shape(world_size) if data_parallel is None else \
        mesh_shape(world_size, data_parallel, tensor_parallel=tp)
    stages = world_size // ((data_parallel or 1) * tp)
    if data_parallel is not None and profile_fn is None and isinstance(module, nn.Sequential) \
            and len(module) < stages:
        raise ValueError(f"balance='auto' on a mesh with {stages} pipeline stages (mesh['pp']) "
                         f"needs at least one layer per stage, but the model has {len(module)} "
                         f"layers; use a mesh with at most {len(module)} pp ranks (and more dp "
                         "ranks), or split the model into more layers")
    bandwidths = _bandwidths(group, workers, bandwidth, data_parallel, tp)
    tp_options: Dict[str, Any] = {} if tensor_parallel is None else {
        "tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel,
        "tensor_parallel_bandwidth": collectives.measure_bandwidth(group, 0, 1)
        if bandwidth is None and tp > 1 else None}
    def profile_and_plan() -> str:
        inputs, targets = sample
        started = time.perf_counter()
        graph = profile_fn() if profile_fn is not None else \
            profile(module, inputs, loss_fn=loss_fn, target=targets, steps=10, warmup=3)
        profiled = time.perf_counter()
        chosen = make_plan(graph, workers=workers, bandwidth=bandwidths, cost_model="default",
                           straight=bool(traits.planner_straight) or None,
                           two_bw=bool(traits.planner_two_versions),
                           data_parallel=data_parallel, sharding=sharding, **tp_options)
        _log.info("profiled %d nodes in %.2f s, planned over %d %s states in %.3f s",
                  len(graph), profiled - started, chosen.num_states, chosen.state_kind,
                  time.perf_counter() - profiled)
        return chosen.to_json(indent=None)
    return Plan.from_json(collectives.from_rank_zero(
        profile_and_plan, group, 'balance="auto": rank 0 could not profile and plan the model'))


def _check_plan_mesh(plan: Plan, data_parallel: int, sharding: Optional[str],
                     tensor_parallel: Optional[int] = None) -> None:
    """A plan run on a ``(pp, dp)`` or ``(pp, dp, tp)`` mesh: no PipeDream replicas, and
    made for this dp (and tp).

    Raises:
        ValueError: the plan replicates stages, or was made for another dp or tp size
            or for FSDP while the mesh replicates (its memory per rank would be too low).
    """
    if any(r != 1 for r in plan.replicas):
        raise ValueError(f"the plan replicates stages PipeDream's way (replicas {plan.replicas}), "
                         f"but the mesh already runs {data_parallel} data-parallel ranks per "
                         "stage; re-plan with data_parallel (python -m pipedream_ext plan "
                         f"--data-parallel {data_parallel})")
    if plan.data_parallel is None:
        return
    tp = tensor_parallel or 1
    replan = f"--data-parallel {data_parallel} --sharding {sharding or 'replicate'}" + \
        (f" --tensor-parallel {tp}" if tp > 1 else "")
    if (plan.tensor_parallel or 1) != tp:
        mesh_ranks = plan.mesh_ranks or [[]]
        raise ValueError(f"the plan was made for {plan.tensor_parallel or 1} tensor-parallel ranks "
                         f"per data-parallel rank (a {plan.mesh_shape} (pp, dp, tp) mesh, stage 0 "
                         f"on ranks {mesh_ranks[0]}), but the mesh has tp size {tp}"
                         + ("" if tensor_parallel else " (no 'tp' dimension)")
                         + ", so its memory and time per rank do not hold; re-plan with "
                         f"{replan}" + ("" if tp > 1 else " (no --tensor-parallel)")
                         + f", or run it on a (pp, dp, tp) = {plan.mesh_shape} mesh with a "
                         "tensor_parallel= plan")
    if plan.data_parallel != data_parallel or (plan.sharding == "fsdp" and sharding != "fsdp"):
        raise ValueError(f"the plan was made for {plan.data_parallel} data-parallel ranks per "
                         f"stage with sharding {plan.sharding!r}, but the mesh has {data_parallel}"
                         f" with {sharding!r}, so its memory per rank does not hold; re-plan with "
                         f"{replan}")


def check_plan_world(plan: Plan, world_size: int, data_parallel: Optional[int] = None,
                     sharding: Optional[str] = None,
                     tensor_parallel: Optional[int] = None) -> Optional[List[int]]:
    """The plan's replicas (``None`` when none is above 1), checked against the world.

    Args:
        plan: the plan.
        world_size: the pipeline's ranks (on a mesh: its pp size).
        data_parallel: the mesh's dp size, or ``None`` without a mesh.
        sharding: with ``data_parallel``: ``"fsdp"`` or ``"replicate"``.
        tensor_parallel: with ``data_parallel``: the mesh's tp size (``None``: no tp
            dimension); a mesh plan (one made with ``data_parallel``) must be made for it.

    Raises:
        ValueError: the plan uses another number of workers, or does not fit the mesh.
    """
    if data_parallel is not None:
        _check_plan_mesh(plan, data_parallel, sharding, tensor_parallel)
    if plan.used_workers != world_size or sum(plan.replicas) != world_size:
        raise ValueError(f"the plan uses {plan.used_workers} workers but the world has "
                         f"{world_size} ranks; re-plan for {world_size} workers")
    start = 0
    for j, stage in enumerate(plan.stages):  # the runtime's placement: consecutive ranks
        placed = list(range(start, start + stage.replicas))
        if list(stage.ranks) != placed:
            raise ValueError(f"plan stage {j} lists ranks {list(stage.ranks)}, but PipeDream runs "
                             f"stage j on the next replicas[j] ranks in stage order, so stage {j} "
                             f"runs on ranks {placed}; a plan cannot move stages to other ranks: "
                             "re-plan (python -m pipedream_ext plan) or list ranks in stage order")
        start += stage.replicas
    replicas = list(plan.replicas)
    return None if all(r == 1 for r in replicas) else replicas


def partition_from_plan(plan: Plan, num_layers: int, world_size: int,
                        data_parallel: Optional[int] = None, sharding: Optional[str] = None,
                        tensor_parallel: Optional[int] = None
                        ) -> Tuple[List[int], Optional[List[int]]]:
    """Balance and replicas (``None`` when none is above 1) of a plan for this model
    and world.

    Args:
        plan: the plan.
        num_layers: the model's layers.
        world_size: the pipeline's ranks (on a ``(pp, dp)`` mesh: its pp size).
        data_parallel: the mesh's dp size, or ``None`` without a mesh.
        sharding: with ``data_parallel``: ``"fsdp"`` or ``"replicate"``.
        tensor_parallel: with ``data_parallel``: the mesh's tp size, or ``None``.

    Raises:
        ValueError: the plan is for another model, world, mesh or a branching graph.
    """
    layers = plan.layers
    if layers is None:
        raise ValueError("the plan is for a branching graph (no layer ranges); plan a "
                         "profile of this nn.Sequential (pipedream_ext.profile)")
    replicas = check_plan_world(plan, world_size, data_parallel, sharding, tensor_parallel)
    bounds = [0]
    for start, end in layers:
        if start != bounds[-1] or end <= start:
            raise ValueError(f"the plan's layer ranges {layers} are not contiguous")
        bounds.append(end)
    if bounds[-1] != num_layers:
        raise ValueError(f"the plan covers {bounds[-1]} layers but the model has {num_layers}; "
                         "was it made for another model?")
    return [end - start for start, end in layers], replicas
