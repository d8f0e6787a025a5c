"""Data parallelism's policy: what a runner calls around each step, with its no-op default.

:class:`DataParallel` is the policy of a run without data parallelism (``dp = 1``): its
hooks do nothing, so a runner calls them on every run. Its subclasses run one copy of
the pipeline per rank of ``mesh["dp"]``, each on its own part of the batch:

* :class:`ReplicatedStages` (``data_parallel="replicate"``): every dp rank keeps whole
  stages; gradients are all-reduced over ``dp`` at the end of each step (with expert
  parallelism, ``dp`` counts the ep ranks too, and the experts' shards are reduced over
  the ranks holding the same ones: ``expert_parallel.py``).
* ``fsdp.FsdpStages`` (``data_parallel="fsdp"``): FSDP2 over ``dp``.

``parallelize.data_parallel_policy`` picks one from the run's ``ParallelDims``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .._dist import collectives
from .._dist.collectives import is_dtensor
from .._frontend.local_stages import LocalStages
from .dims import ParallelDims
from .expert_parallel import split_experts

__all__ = ["DataParallel", "ReplicatedStages", "broadcast_from_first"]


class DataParallel:
    """The hooks a runner calls around each step; here each does nothing (``dp = 1``).

    Args:
        dims: the run's dims.
        average_over_dp: dp ranks' gradients are averaged (``loss_reduction="mean"``), else
            summed (``"sum"``, and ``"tokens"``, whose losses are already divided by the
            whole batch's tokens): ``LossReduction.averages_over_dp``.
    """

    def __init__(self, dims: ParallelDims, average_over_dp: bool) -> None:
        self.dims = dims
        self.average_over_dp = average_over_dp
        #: This rank's stages, once built (:meth:`attach`).
        self.stages: Optional[LocalStages] = None

    def check_batch(self, value: Any, microbatches: int, what: str) -> None:
        """On a mesh each dp rank's batch must split evenly into microbatches (the global
        mean weights every dp rank alike); without a mesh ``check_batch`` of
        ``_runtime.stage_call`` suffices.

        Args:
            value: this rank's inputs or targets.
            microbatches: the microbatches of a step.
            what: ``"inputs"`` or ``"targets"``.

        Raises:
            ValueError: naming the batch size and the fix.
        """
        if not self.dims.on_mesh:
            return
        rows = _first_tensor(value).shape[0]
        if rows % microbatches:
            raise ValueError(f"{what} of this data-parallel rank have batch size {rows}, which "
                             f"does not split into microbatches={microbatches} equal parts; "
                             "with mesh= every dp rank's batch must be a multiple of "
                             f"microbatches (e.g. {max(1, rows // microbatches) * microbatches})")

    @property
    def after_layer(self) -> Optional[Callable[[nn.Module], None]]:
        """What ``LocalStages`` calls on each layer it materialises (``None``: nothing)."""
        return None

    def attach(self, stages: LocalStages) -> None:
        """Takes this rank's built stages (after tensor parallelism's plan)."""
        self.stages = stages

    def before_forward(self, stage: int, microbatch: int, training: bool) -> None:
        """Called before each forward of a stage (through each step's StepContext.before_forward)."""

    def before_step(self) -> None:
        """Called before the executor runs a step."""

    def after_step(self) -> None:
        """Called after the executor's run: gradients synchronised over dp."""

    def after_evaluation(self) -> None:
        """Called after ``forward_only``."""


def broadcast_from_first(module: nn.Module, dims: ParallelDims) -> None:
    """``module``'s parameters and buffers (their local shards) from dp rank 0, as DDP
    broadcasts rank 0's at construction; one broadcast per tensor. With expert
    parallelism the expert shards come from the first rank holding the same ones (its
    dp coordinate 0), the rest from the first copy.

    Args:
        module: a stage or one of its layers.
        dims: the run's dims (its dp group and expert dp group).
    """
    dense, experts = split_experts(list(module.parameters()), dims)
    with torch.no_grad():
        for t in dense + list(module.buffers()):
            collectives.broadcast_data(_local(t.detach()), 0, dims.dp_group)
        for t in experts if dims.expert_dp_group is not None else ():
            collectives.broadcast_data(_local(t.detach()), 0, dims.expert_dp_group)


class ReplicatedStages(DataParallel):
    """Whole stages on every dp rank, starting from dp rank 0's weights; gradients
    all-reduced over ``dp`` after each step (averaged for ``loss_reduction="mean"``,
    summed for ``"sum"`` and ``"tokens"``), one flat all-reduce per stage."""

    def attach(self, stages: LocalStages) -> None:
        """Takes this rank's built stages; every replica starts from dp rank 0's weights
        (with expert parallelism: its dense weights from the first copy, its expert
        shards from the first rank holding the same shards)."""
        self.stages = stages
        for j in stages:
            broadcast_from_first(stages[j], self.dims)

    def after_step(self) -> None:
        for j in self.stages:
            params = [p for p in self.stages.parameters_of(j) if p.requires_grad]
            dense, experts = split_experts(params, self.dims)
            self._reduce(dense, self.dims.dp_group)
            # An expert shard's gradient already holds every ep rank's tokens' part.
            self._reduce(experts, self.dims.expert_dp_group)

    def _reduce(self, params: List[nn.Parameter], group: Any) -> None:
        """``params``' gradients summed over ``group`` (``None``: this rank alone) in one
        flat all-reduce, then divided by ``dp_size`` when averaging."""
        if not params:
            return
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # A DTensor's gradient (tensor or expert parallelism): its local shard, in place.
            grads = [_local(p.grad) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if group is not None:
                collectives.all_reduce_data(flat, group)
            if self.average_over_dp:
                flat /= self.dims.dp_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard, or ``t``."""
    return t.to_local() if is_dtensor(t) else t
