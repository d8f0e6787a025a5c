"""Process groups of a pipeline: the default group, replica groups, the leaders.

Owns creating the default group from the torchrun environment (Gloo on CPU;
``cpu:gloo,cuda:nccl`` on GPU, so that metadata collectives stay on the CPU:
see ``_collectives``) and the groups a pipeline adds: one per replicated stage
(its gradient all-reduce) and one of the stage leaders (evaluation runs on one
replica per stage).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import _elastic

__all__ = ["init_default_group", "default_backend", "PipelineGroups"]


def default_backend(device: torch.device) -> str:
    """The backend string of the default group PipeDream creates for ``device``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_default_group(device: torch.device, timeout: datetime.timedelta) -> None:
    """Creates the default group from the torchrun environment unless one exists.

    Raises:
        RuntimeError: no group and no torchrun environment (``RANK``, ``WORLD_SIZE``).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "no torch.distributed process group and no torchrun environment (RANK, WORLD_SIZE); "
            "launch with `torchrun --nproc-per-node N script.py` or call "
            "torch.distributed.init_process_group() first")
    _elastic.init_process_group(default_backend(device), timeout)


@dataclasses.dataclass
class PipelineGroups:
    """The groups one pipeline runs on.

    Attributes:
        group: the pipeline's group (every rank of the pipeline).
        rank: this rank within ``group``.
        world_size: ranks in ``group``.
        replica_groups: stage -> the group of its replicas, for the replicated
            stages this rank holds.
        leaders: the first replica's rank of every stage, in stage order.
        leader_group: the group of ``leaders`` (``group`` when nothing is replicated).
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    replica_groups: Dict[int, dist.ProcessGroup]
    leaders: List[int]
    leader_group: dist.ProcessGroup

    @classmethod
    def create(cls, group: Optional[dist.ProcessGroup], stage_ranks: List[List[int]],
               timeout: float) -> "PipelineGroups":
        """Creates the replica and leader groups; every rank must call it, in order.

        Args:
            group: the pipeline's group (``None``: the default group).
            stage_ranks: the ranks of every stage, replica order.
            timeout: seconds, for the new groups' operations.
        """
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        span = datetime.timedelta(seconds=timeout)
        replica_groups: Dict[int, dist.ProcessGroup] = {}
        leaders = [ranks[0] for ranks in stage_ranks]
        leader_group = group
        if any(len(ranks) > 1 for ranks in stage_ranks):
            for j, ranks in enumerate(stage_ranks):
                if len(ranks) > 1:
                    new = dist.new_group(ranks, timeout=span)
                    if rank in ranks:
                        replica_groups[j] = new
            leader_group = dist.new_group(leaders, timeout=span)
        return cls(group, rank, dist.get_world_size(group), replica_groups, leaders, leader_group)
