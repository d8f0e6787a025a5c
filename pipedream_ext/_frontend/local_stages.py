"""Model -> this rank's stages: ``LocalStages``.

Owns which stages of a partition (``_frontend.partition``) this rank keeps: the
modules, their parameters and the original model's names, meta-device layers
materialised as they are kept. Pure apart from moving the kept
layers to the device: tested in one process.

Index legend: ``j`` stage, ``l`` layer (child of the ``nn.Sequential``).
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .deferred_init import (
    DEFAULT_INIT_SEED,
    InitFn,
    Memo,
    has_meta_tensors,
    materialize_layer,
    materialize_traced,
    replace_materialized,
)
from .graph_split import merge_stage_modules
from .partition import Partition

__all__ = ["LocalStages", "Replacements"]

#: Tensors a layer's ``after_layer`` replaced: ``id(old)`` -> the new tensor.
Replacements = Dict[int, torch.Tensor]


class LocalStages:
    """The stages one rank keeps, each an ``nn.Sequential`` of the original children.

    Layers keep their child names, so parameter names (``"3.weight"``) match the
    unsplit model's in ``named_parameters()``, ``state_dict()`` and checkpoints.
    A parameter tied across stages stays one object in every kept stage that uses
    it (``_shared`` keeps the ranks' copies equal).

    A traced model (``split_points``, ``_trace``) gives its stage modules instead:
    layer ``j`` is stage ``j``, a ``GraphModule`` holding the original submodules at
    their original paths, and this rank's module merges them by path, so names are
    the original model's there too (no stage-index prefix).

    Args:
        module: the whole model.
        partition: the stages of the whole model.
        indices: the stages this rank keeps, ascending.
        device: where the kept layers go.
        init_seed: base seed of kept layers built on the meta device (``deferred_init``; a
            traced model: of the units its stages hold, ``materialize_traced``).
        init_fn: their initialiser instead of ``reset_parameters()`` (``deferred_init``).
        traced: the stage modules of a traced model (``partition.balance`` all ones).
        after_layer: called with each kept layer once it has real tensors, before the
            next one is materialised (``sharding.FsdpStages.shard_layer``: a rank then
            never holds more than one whole layer).
        defer_meta: keep meta layers on the meta device (and the stages unmoved) until
            :meth:`materialize_pending` (tensor parallelism shards the meta stages first).
    """

    def __init__(self, module: nn.Module, partition: Partition, indices: Sequence[int],
                 device: torch.device, init_seed: int = DEFAULT_INIT_SEED,
                 init_fn: Optional[InitFn] = None,
                 traced: Optional[Sequence[nn.Module]] = None,
                 after_layer: Optional[Callable[[nn.Module], Optional[Replacements]]] = None,
                 defer_meta: bool = False) -> None:
        self.partition = partition
        #: Stage indices of this rank, ascending.
        self.indices: List[int] = list(indices)
        #: Whether the stages come from a traced model (``_frontend.graph_split``).
        self.traced = traced is not None
        #: The kept layers still on the meta device, ``(index, name, layer)``, with what
        #: materialises them (``defer_meta``; :meth:`materialize_pending`).
        self.pending: List[Tuple[int, str, nn.Module]] = []
        if traced is not None:
            self.layers: Dict[int, Tuple[int, int]] = {j: (j, j + 1) for j in indices}
            kept = [traced[j] for j in indices]
            if any(has_meta_tensors(stage) for stage in kept):  # only what this rank's stages hold
                tensors = [t for stage in kept for t in (*stage.parameters(), *stage.buffers())]
                memo = materialize_traced(module, device, init_seed, init_fn, tensors)
                replace_materialized(kept, memo, f"stages {list(indices)}")
            self._modules: Dict[int, nn.Module] = {j: traced[j].to(device) for j in indices}
            self.module: nn.Module = merge_stage_modules([self._modules[j] for j in indices])
            return
        bounds = partition.bounds()
        children = list(module.named_children())
        kept = sorted({l for j in indices for l in range(bounds[j], bounds[j + 1])})
        if defer_meta:
            self.pending = [(l, *children[l]) for l in kept]
        self._init = (device, init_seed, init_fn)
        #: Layer range ``[start, end)`` of each local stage.
        self.layers = {j: (bounds[j], bounds[j + 1]) for j in indices}
        self._modules = {
            j: nn.Sequential(collections.OrderedDict(children[bounds[j]:bounds[j + 1]]))
            for j in indices}
        if not defer_meta:
            self.materialize_pending(after_layer, [(l, *children[l]) for l in kept])
        merged: "collections.OrderedDict[str, nn.Module]" = collections.OrderedDict()
        for j in indices:
            merged.update(self._modules[j].named_children())
        #: This rank's layers as one module, named as in the original model.
        self.module = (self._modules[self.indices[0]] if len(self.indices) == 1
                       else nn.Sequential(merged))

    def materialize_pending(self, after_layer: Optional[Callable[[nn.Module], Optional[Replacements]]] = None,
                            layers: Optional[Sequence[Tuple[int, str, nn.Module]]] = None) -> None:
        """Gives the kept meta layers storage and values (deferred initialisation), one
        layer at a time, and moves the stages to the device.

        Args:
            after_layer: called with each layer once it has real tensors, before the next
                one is materialised; it may return the tensors it replaced (``{id(old):
                new}``), which a later layer tied to them then shares instead.
            layers: ``(index, name, layer)`` to materialise (default :attr:`pending`).
        """
        device, init_seed, init_fn = self._init
        # Meta layers get storage here, only those this rank keeps (deferred initialisation).
        memo: Memo = {}
        for l, name, layer in (self.pending if layers is None else layers):
            materialize_layer(layer, l, name, device, init_seed, init_fn, memo)
            replaced = (after_layer(layer) if after_layer is not None else None) or {}
            # A later tie shares the new tensor; the memo no longer holds the old one.
            memo.update({key: (meta, replaced[id(old)]) for key, (meta, old) in memo.items()
                         if id(old) in replaced})
        self.pending = []
        for j in self.indices:
            self._modules[j].to(device)

    def __getitem__(self, stage: int) -> nn.Module:
        return self._modules[stage]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __contains__(self, stage: object) -> bool:
        return stage in self._modules

    def parameters_of(self, stage: int) -> List[torch.Tensor]:
        """The parameters of ``stage`` in ``named_parameters`` order (what the executor sees)."""
        return list(self._modules[stage].parameters())

    def parameter_names(self, stage: int) -> List[str]:
        """Names of :meth:`parameters_of` within the stage's module."""
        return [name for name, _ in self._modules[stage].named_parameters()]

    def remerge(self) -> None:
        """Builds :attr:`module` of a traced model again from the stages.

        The merged module holds the tensors a graph reads directly (``get_attr``) as
        the objects they were when it was built; after ``fully_shard`` replaced them
        by sharded parameters it must hold those instead."""
        if self.traced:
            self.module = merge_stage_modules([self._modules[j] for j in self.indices])

    def parameters_by_stage(self) -> Dict[int, List[torch.Tensor]]:
        return {j: self.parameters_of(j) for j in self.indices}
