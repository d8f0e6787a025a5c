"""What the checkpoint code reads of a pipeline: a frozen, read-only view.

``PipeDream.checkpoint_view`` builds a :class:`PipelineView`; saving, loading and
re-sharding read the pipeline only through it (and call ``pipe.flush()``), never
through the pipeline's private fields.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PipelineView", "Pipeline", "dcp_group"]


@dataclasses.dataclass(frozen=True)
class PipelineView:
    """A read-only snapshot of one rank's pipeline, as the checkpoint code needs it.

    Mappings are read-only (``MappingProxyType``) and sequences are tuples; the
    modules are the live ones (loading copies into their tensors in place).

    Attributes:
        rank: this rank within ``group``.
        world_size: ranks of the pipeline.
        group: the pipeline's process group.
        timeout: seconds an exchange among the ranks may wait for a peer.
        device: where this rank's parameters live.
        module: this rank's stages as one module, named as in the original model.
        stages: local stage index -> that stage's module (children named as in the model).
        stage_layers: local stage index -> its layer range ``(start, stop)``.
        stage_ranks: for every stage, the ranks that run it (the leader, replica 0, first).
        model_shapes: every ``state_dict`` key of the whole model -> its shape.
        shared_parameters: parameters used by several stages (``find_shared``).
        split_points: a traced model's split points (``None``: an ``nn.Sequential``).
        schedule_name: the schedule's name.
        microbatches: microbatches per step.
        chunks: model chunks per rank (interleaved schedules).
        balance: layers per stage.
        replicas: ranks per stage.
        asynchronous: whether the schedule updates weights asynchronously.
        checkpoint_group: the Gloo group over ``group``'s ranks that DCP checkpoints
            use (``None``: DCP checkpoints are refused).
        data_parallel: ``"fsdp"`` or ``"replicate"`` over a mesh's ``dp`` dimension,
            else ``None``. With a mesh, ``rank``, ``world_size``, ``group`` and
            ``stage_ranks`` are the whole world's (every dp rank runs each stage: a
            copy, or with ``"fsdp"`` a shard), ``checkpoint_group`` a Gloo group over it.
        tp_size: the ranks of each stage holding shards of one copy: a mesh's tp size
            (``PipeDream(tensor_parallel=...)``) or ep size (``expert_parallel=``); 1
            without: each stage's first ``tp_size`` ranks in ``stage_ranks`` are dp rank
            0's tp (or ep) ranks, each holding its own shards of the stage (DTensors over
            ``mesh["tp"]``, or the experts' over ``mesh["ep"]``).
        expert_parallel: whether the stages' experts are sharded over a mesh's ``ep``
            ranks (``PipeDream(expert_parallel=...)``): DCP checkpoints and
            ``load_state_dict`` handle them; ``save_pretrained`` refuses them for now.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup
    timeout: float
    device: torch.device
    module: nn.Module
    stages: Mapping[int, nn.Module]
    stage_layers: Mapping[int, Tuple[int, int]]
    stage_ranks: Tuple[Tuple[int, ...], ...]
    model_shapes: Mapping[str, Tuple[int, ...]]
    shared_parameters: Tuple[Any, ...]
    split_points: Optional[Tuple[str, ...]]
    schedule_name: str
    microbatches: int
    chunks: int
    balance: Tuple[int, ...]
    replicas: Tuple[int, ...]
    asynchronous: bool
    checkpoint_group: Optional[dist.ProcessGroup] = None
    data_parallel: Optional[str] = None
    tp_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        # Frozen copies: the view cannot change the pipeline's own containers.
        frozen: Dict[str, Any] = {
            "stages": types.MappingProxyType(dict(self.stages)),
            "stage_layers": types.MappingProxyType({j: tuple(r) for j, r in self.stage_layers.items()}),
            "stage_ranks": tuple(tuple(r) for r in self.stage_ranks),
            "model_shapes": types.MappingProxyType({k: tuple(s) for k, s in self.model_shapes.items()}),
            "shared_parameters": tuple(self.shared_parameters),
            "split_points": None if self.split_points is None else tuple(self.split_points),
            "balance": tuple(self.balance),
            "replicas": tuple(self.replicas),
        }
        for name, value in frozen.items():
            object.__setattr__(self, name, value)

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline (all ranks)."""
        return len(self.stage_ranks)

    def is_leader(self, stage: int) -> bool:
        """Whether this rank is ``stage``'s leader (replica 0), which writes its files."""
        return self.stage_ranks[stage][0] == self.rank

    def writes(self, stage: int) -> bool:
        """Whether this rank writes ``stage``'s tensors to a DCP checkpoint: its leader
        (with tensor parallelism each tp rank of the leading dp rank: their shards),
        or with ``data_parallel="fsdp"`` every rank (each holds a shard: DTensors that
        DCP assembles; a plain tensor several ranks give, such as a step count or a
        weight tensor parallelism replicates, DCP writes once)."""
        return self.rank in self.stage_ranks[stage][:self.tp_size] or self.data_parallel == "fsdp"

    def refuse_mesh(self, call: str) -> None:
        """The pipedream format knows one whole copy of each stage; a mesh's dp ranks hold
        several (or shards of one), its tp ranks shards: DCP checkpoints handle them.

        Raises:
            ValueError: ``call`` on a pipeline built with ``mesh=``.
        """
        if self.data_parallel is not None:
            holds = ("each ep rank holds other experts of its stage (expert_parallel)"
                     if self.expert_parallel else
                     "each tp rank holds shards of its stage (tensor_parallel)" if self.tp_size > 1
                     else "each dp rank holds a copy or a shard of its stage")
            raise ValueError(f"{call} does not support pipelines built with mesh= "
                             f"(data_parallel={self.data_parallel!r}): {holds}; use "
                             "save_checkpoint(..., format='dcp') and load_checkpoint of that "
                             "checkpoint (DCP re-shards), or "
                             "pd.consolidate(path) for the unsplit state dict")

    def describe(self) -> Dict[str, Any]:
        """The pipeline's layout as the manifest records it (JSON)."""
        return {"schedule": self.schedule_name, "microbatches": self.microbatches,
                "balance": list(self.balance), "replicas": list(self.replicas),
                "chunks": self.chunks, "world_size": self.world_size}


def dcp_group(view: PipelineView) -> dist.ProcessGroup:
    """The group DCP's collectives run on for ``view``'s pipeline.

    Raises:
        ValueError: the pipeline was built without one.
    """
    if view.checkpoint_group is None:
        raise ValueError("this pipeline has no checkpoint group (PipelineView.checkpoint_group); "
                         "DCP checkpoints need a pipeline built by pipedream_ext.PipeDream")
    return view.checkpoint_group


class Pipeline(Protocol):
    """What the checkpoint functions need of the object they are given (a ``PipeDream``)."""

    @property
    def checkpoint_view(self) -> PipelineView:
        """The pipeline's :class:`PipelineView`."""

    def flush(self) -> None:
        """Finishes every admitted minibatch (asynchronous schedules)."""
