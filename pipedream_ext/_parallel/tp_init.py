"""Meta-device models with tensor parallelism: each stage sharded before it is materialised.

A model built under ``with torch.device("meta"):`` with ``tensor_parallel=`` never has a
whole stage on any rank. The plan is applied to the meta stages first
(``parallelize_module`` on meta modules gives meta ``DTensor`` parameters with the
plan's placements); then :func:`materialize_sharded` materialises the stages one
top-level layer at a time with deferred initialisation's rule
(``_frontend.deferred_init``: the layer's seed, ``reset_parameters()`` or ``init_fn``):
the layer's tensors get their full (unsplit) shapes and values, and each tensor the
plan had made a ``DTensor`` is replaced at once by this rank's shard of those values
(``distribute_tensor`` without communication), with the recorded placements. The
seeding rule gives a layer the same values on every rank, so the tp ranks start from
one model without the broadcast the eager path makes.

So a parameter's shards equal ``materialize(model)``'s values split by the plan, and
a rank holds at most its shards of the stages plus one whole layer (while that layer
is initialised): initialising the shards directly (torchtitan's way) would not give
the unsplit model's values, since a layer's ``reset_parameters()`` draws its random
numbers for the whole tensor.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import torch
from torch import nn

from .._dist.collectives import is_dtensor
from .._frontend.local_stages import LocalStages, Replacements

__all__ = ["materialize_sharded"]


@dataclasses.dataclass
class _Sharded:
    """A meta ``DTensor`` the plan put on a module: where it sits and how it is split."""

    module: nn.Module
    name: str
    is_param: bool
    mesh: Any
    placements: tuple
    requires_grad: bool

    def owned(self) -> Dict[str, Any]:
        return self.module._parameters if self.is_param else self.module._buffers  # noqa: SLF001 - direct ownership


def _sharded_tensors(layer: nn.Module) -> List[_Sharded]:
    """The meta ``DTensor`` parameters and buffers of ``layer``'s modules, each where it sits."""
    found = []
    for module in layer.modules():
        owned = [(n, t, True) for n, t in module._parameters.items()]  # noqa: SLF001 - direct ownership
        owned += [(n, t, False) for n, t in module._buffers.items()]  # noqa: SLF001
        for name, t, is_param in owned:
            if t is not None and t.is_meta and is_dtensor(t):
                found.append(_Sharded(module, name, is_param, t.device_mesh, tuple(t.placements),
                                      t.requires_grad))
    return found


def materialize_sharded(stages: LocalStages) -> None:
    """Materialises this rank's meta layers (``stages.pending``, already parallelized)
    one at a time: each layer's full values, then every tensor the plan made a
    ``DTensor`` replaced by this rank's shard of them (no communication).

    Args:
        stages: this rank's stages built with ``defer_meta=True``, the plan applied.

    Raises:
        ValueError: what deferred initialisation raises (``materialize_layer``).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415 - only with tp

    sharded = {id(layer): _sharded_tensors(layer) for _, _, layer in stages.pending}

    def shard(layer: nn.Module) -> Replacements:
        replaced: Replacements = {}
        with torch.no_grad():
            for slot in sharded[id(layer)]:
                value = slot.owned()[slot.name]
                if id(value) in replaced or is_dtensor(value):  # a tie: sharded already
                    slot.owned()[slot.name] = replaced.get(id(value), value)
                    continue
                split = distribute_tensor(value.detach(), slot.mesh, slot.placements, src_data_rank=None)
                piece = split.to_local()
                if piece.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
                    # A shard of dim 0 is a view of the whole tensor: its own copy lets that go.
                    split = DTensor.from_local(piece.clone(), slot.mesh, slot.placements,
                                               run_check=False, shape=split.shape,
                                               stride=split.stride())
                del piece
                new = nn.Parameter(split, requires_grad=slot.requires_grad) if slot.is_param else split
                slot.owned()[slot.name] = new
                replaced[id(value)] = new
        return replaced

    stages.materialize_pending(shard)
