"""Process groups of a pipeline: the default group, replica groups, the leaders.

Owns creating the default group from the torchrun environment (Gloo on CPU;
``cpu:gloo,cuda:nccl`` on GPU, so that metadata collectives stay on the CPU:
see ``_collectives``) and the groups a pipeline adds: one per replicated stage
(its gradient all-reduce), one of the stage leaders (evaluation runs on one
replica per stage), and a Gloo *side group* beside each group the executor
sends on (its metadata and the payloads the data channel cannot size in
advance: ``csrc/runtime/comm_engine.h``), plus which point-to-point protocol
the executor speaks on a group; groups whose every collective is bounded by a
pipeline's timeout (a mesh's pipelines, dp groups and world), and how messages
name ranks (``RankNames``: global ranks, with ``(pp, dp)`` coordinates on a mesh).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import weakref
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import elastic

__all__ = ["init_default_group", "default_backend", "PipelineGroups", "side_group",
           "checkpoint_group", "bounded_group", "RankNames", "p2p_protocol", "PROTOCOL_ENV"]

# Forces the executor's point-to-point protocol ("fused" or "split"): for tests
# and benchmarks; by default it follows the data backend (see p2p_protocol).
PROTOCOL_ENV = "PIPEDREAM_P2P_PROTOCOL"
# A side group's receives may wait for a peer as long as the user's loop takes
# between steps; the executor's own waits carry the pipeline's timeout.
_SIDE_TIMEOUT = datetime.timedelta(days=7)
# Side groups by their ranks, with the default group they were made under:
# pipelines over the same ranks share one, so constructing many does not pile
# up groups (each Gloo group holds sockets and threads).
_SIDE_GROUPS: Dict[tuple, tuple] = {}
# Checkpoint groups by their ranks, with the default group they were made under.
_CHECKPOINT_GROUPS: Dict[tuple, tuple] = {}
# Groups with a pipeline's timeout (a mesh's dp groups) by (ranks, seconds), likewise.
_BOUNDED_GROUPS: Dict[tuple, tuple] = {}
# "rank N" in a message where N is not yet followed by mesh coordinates.
_BARE_RANK = re.compile(r"\brank (\d+)\b(?! \(pp )")


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
    elastic.init_process_group(default_backend(device), timeout)


def data_backend(group: dist.ProcessGroup, device: torch.device) -> str:
    """The name of the backend that carries ``device``'s tensors on ``group``."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend
    for part in backend.split(","):
        device_type, _, name = part.partition(":")
        if device_type == device.type:
            return name
    return backend


def p2p_protocol(group: dist.ProcessGroup, device: torch.device, streaming: bool) -> str:
    """The executor's point-to-point protocol on ``group``.

    ``"fused"`` (one packed message per transfer; slot capacities agreed per step)
    for flush schedules on host memory; ``"split"`` (metadata on the side group,
    tensors alone on the data channel) for NCCL-like data backends, where the host
    must not read device memory, and for asynchronous streams, whose slots do not
    repeat in step with their receives. ``PIPEDREAM_P2P_PROTOCOL`` forces one.

    Raises:
        ValueError: the variable names another protocol, or "fused" for a stream.
    """
    forced = os.environ.get(PROTOCOL_ENV, "")
    if forced:
        if forced not in ("fused", "split"):
            raise ValueError(f"{PROTOCOL_ENV}={forced!r}: use 'fused' or 'split'")
        if forced == "fused" and streaming:
            raise ValueError(f"{PROTOCOL_ENV}=fused: asynchronous schedules need 'split' (their "
                             "receives do not repeat per step); unset it or use 'split'")
        return forced
    if streaming or data_backend(group, device).startswith("nccl"):
        return "split"
    return "fused"


def side_group(ranks: List[int]) -> dist.ProcessGroup:
    """A Gloo group over the global ``ranks`` for an executor's side channel.

    Every rank of the default group must call it, in the same order (as for any
    ``new_group``; non-members get ``GroupMember.NON_GROUP_MEMBER``); pipelines over
    the same ranks share one, for as long as the default group lives.
    """
    key = tuple(ranks)
    cached = _SIDE_GROUPS.get(key)
    if cached is not None and cached[0]() is dist.group.WORLD:
        return cached[1]
    side = dist.new_group(list(ranks), backend="gloo", timeout=_SIDE_TIMEOUT)
    _SIDE_GROUPS[key] = (weakref.ref(dist.group.WORLD), side)
    return side


def checkpoint_group(ranks: List[int], timeout: float) -> dist.ProcessGroup:
    """A Gloo group over the global ``ranks`` for torch.distributed.checkpoint (DCP).

    DCP moves its plans as pickled objects (a CPU backend is what it needs), and an
    asynchronous save runs its collectives in a background thread while training
    goes on: on a group of their own they never interleave with the pipeline's or
    the executor's. Made with the pipeline's groups (:meth:`PipelineGroups.create`),
    because ``new_group`` is collective over the default group, in order, which a
    save on some ranks could not keep; pipelines over the same ranks share one while
    the default group lives, with the timeout of the first.

    Args:
        ranks: the pipeline's global ranks.
        timeout: seconds any DCP collective may wait for a peer.

    Returns:
        The group (``GroupMember.NON_GROUP_MEMBER`` on other ranks).
    """
    key = tuple(ranks)
    cached = _CHECKPOINT_GROUPS.get(key)
    if cached is not None and cached[0]() is dist.group.WORLD:
        return cached[1]
    new = dist.new_group(list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    _CHECKPOINT_GROUPS[key] = (weakref.ref(dist.group.WORLD), new)
    return new


def bounded_group(ranks: Sequence[int], timeout: float) -> dist.ProcessGroup:
    """A group over the global ``ranks`` (the default group's backends) whose every
    collective waits at most ``timeout`` seconds for a peer.

    A ``DeviceMesh``'s groups carry the process group's default timeout (30 minutes
    on Gloo), which no argument of ``init_device_mesh`` changes; FSDP's and the
    replicas' collectives over a mesh's ``dp`` dimension run on this group instead,
    so a stuck dp peer fails them within the pipeline's timeout. Collective over the
    default group, in order, like ``new_group``; groups over the same ranks and
    timeout are shared while the default group lives.

    Args:
        ranks: global ranks, ascending (a process group's order).
        timeout: seconds.

    Returns:
        The group (``GroupMember.NON_GROUP_MEMBER`` on other ranks).
    """
    key = (tuple(ranks), float(timeout))
    cached = _BOUNDED_GROUPS.get(key)
    if cached is not None and cached[0]() is dist.group.WORLD:
        return cached[1]
    new = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout))
    _BOUNDED_GROUPS[key] = (weakref.ref(dist.group.WORLD), new)
    return new


@dataclasses.dataclass(frozen=True)
class RankNames:
    """How messages name ranks: by global rank, with ``(pp, dp)`` coordinates on a mesh.

    A pipeline's own numbers are its group's ranks (the executor's, the schedule's);
    on a mesh each pipeline is one group of several, so its messages translate them
    to global ranks: ``rank 3 (pp 1, dp 1)``, where ``pp`` is the rank's position in
    its pipeline (``mesh["pp"].get_local_rank()``) and ``dp`` the pipeline's
    (``mesh["dp"].get_local_rank()``). Without a mesh the pipeline's ranks are used
    as they are.

    Attributes:
        group_ranks: the global rank of each rank of this pipeline's group.
        pipelines: on a mesh, the global ranks of every pipeline (dp order), each in
            its group's order; ``None`` without one.
    """

    group_ranks: List[int]
    pipelines: Optional[List[List[int]]] = None
    #: A mesh's tp size: pipeline ``c`` is ``(dp, tp) = divmod(c, tp_size)``.
    tp_size: int = 1
    #: A mesh's ep size: the ``dp`` above is ``d * ep_size + e``.
    ep_size: int = 1

    def of_global(self, rank: int) -> str:
        """``"rank 3 (pp 1, dp 1)"`` on a mesh (``"(pp 1, dp 0, tp 1)"`` with tp,
        ``"(pp 1, dp 0, ep 1, tp 1)"`` with ep and tp), else ``"rank 3"``."""
        for copy, ranks in enumerate(self.pipelines or ()):
            if rank in ranks:
                dp, tp = divmod(copy, self.tp_size)
                dp, ep = divmod(dp, self.ep_size)
                where = (f", ep {ep}" if self.ep_size > 1 else "") + (f", tp {tp}" if self.tp_size > 1 else "")
                return f"rank {rank} (pp {ranks.index(rank)}, dp {dp}{where})"
        return f"rank {rank}"

    def of_group(self, rank: int) -> str:
        """The name of the pipeline group's rank ``rank``."""
        if self.pipelines is None:
            return f"rank {rank}"
        return self.of_global(self.group_ranks[rank])

    def many(self, ranks: Sequence[int]) -> str:
        """``"ranks 1 (pp 0, dp 1), 3 (pp 1, dp 1)"`` (global ranks), or ``"rank 2 ..."``."""
        names = [self.of_global(r)[len("rank "):] for r in ranks]
        return f"rank{'s' if len(names) > 1 else ''} {', '.join(names)}"

    def translate(self, text: str) -> str:
        """``text`` with every bare ``rank N`` (a pipeline group's rank, as the executor
        words it) named as :meth:`of_group` does; names already with coordinates stay."""
        if self.pipelines is None:
            return text
        size = len(self.group_ranks)
        return _BARE_RANK.sub(lambda m: self.of_group(int(m.group(1)))
                              if int(m.group(1)) < size else m.group(0), text)


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
        side: the Gloo side group of ``group`` (see :func:`side_group`).
        leader_side: the side group of ``leader_group``.
        checkpoint: the Gloo group DCP checkpoints use (see :func:`checkpoint_group`).
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    replica_groups: Dict[int, dist.ProcessGroup]
    leaders: List[int]
    leader_group: dist.ProcessGroup
    side: dist.ProcessGroup
    leader_side: dist.ProcessGroup
    checkpoint: dist.ProcessGroup

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
        global_ranks = dist.get_process_group_ranks(group)
        side = side_group(global_ranks)
        leader_side = side if leader_group is group else side_group([global_ranks[r] for r in leaders])
        return cls(group, rank, dist.get_world_size(group), replica_groups, leaders, leader_group,
                   side, leader_side, checkpoint_group(global_ranks, timeout))
