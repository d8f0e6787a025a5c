"""One rank's stages parallelized in a straight line: tensor parallelism, then FSDP or
replicas (torchtitan's ``parallelize_llama`` order).

:func:`data_parallel_policy` picks the data-parallel policy from the run's dims before
the stages exist (FSDP shards each layer as it is materialised); once the stages are
built, :func:`parallelize_stages` applies the tensor-parallel plan and hands the stages
to that policy; expert parallelism (``expert_parallel.py``) is one more step between
the two.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .. import schedules
from .._frontend.local_stages import LocalStages
from .data_parallel import DataParallel, ReplicatedStages
from .dims import ParallelDims
from .expert_parallel import apply_expert_parallel
from .fsdp import FsdpStages, keep_unsharded_after
from .tensor_parallel import TensorParallel
from .tp_init import materialize_sharded
from .tp_tied import Ties

__all__ = ["apply_tensor_parallel", "data_parallel_policy", "parallelize_stages"]


def data_parallel_policy(dims: ParallelDims, average_over_dp: bool,
                         actions: Callable[[], Sequence[schedules.Action]]) -> DataParallel:
    """The data-parallel policy of ``dims``, before the stages exist: FSDP, replicas, or
    (one copy of each pipeline) the policy whose hooks do nothing.

    Args:
        dims: the run's dims.
        average_over_dp: dp ranks' gradients are averaged, else summed (:class:`DataParallel`).
        actions: this rank's compute actions (for :func:`keep_unsharded_after`).

    Returns:
        The policy the runner calls around each step.
    """
    if dims.fsdp_enabled:
        keep = keep_unsharded_after(actions()) if dims.reshard_after_forward else set()
        return FsdpStages(dims, average_over_dp, keep)
    if dims.replicate_enabled:
        return ReplicatedStages(dims, average_over_dp)
    return DataParallel(dims, average_over_dp)


def parallelize_stages(stages: LocalStages, dims: ParallelDims, data_parallel: DataParallel) -> None:
    """This rank's built stages parallelized: the tensor-parallel plan, the
    expert-parallel plan, then data parallelism (FSDP2 over the plan's DTensors, or replicas from dp rank 0's weights).

    Args:
        stages: this rank's stages (meta layers still pending with tensor parallelism).
        dims: the run's dims.
        data_parallel: the policy from :func:`data_parallel_policy`.

    Raises:
        ValueError: a plan that fails or differs on some ranks (``TensorParallel.apply``).
    """
    if dims.tp_enabled:
        apply_tensor_parallel(stages, dims)
    if dims.ep_enabled:
        apply_expert_parallel(stages, dims)
    data_parallel.attach(stages)


def apply_tensor_parallel(stages: LocalStages, dims: ParallelDims) -> None:
    """The plan applied to this rank's stages, parameters tied on this rank tied again
    (``tp_tied.Ties``); meta layers (``stages.pending``) are parallelized on the meta
    device, then materialised shard by shard (``tp_init``).

    Args:
        stages: this rank's stages.
        dims: the run's dims (its plan, tp mesh and groups).
    """
    ties = Ties(stages[j] for j in stages)
    TensorParallel(dims.tensor_parallel, dims.tp_mesh, dims.plan_group, dims.names,
                   dims.timeout).apply({j: stages[j] for j in stages})
    ties.restore()  # before materialisation: a tie's later use keeps the first's values
    if stages.pending:
        materialize_sharded(stages)
