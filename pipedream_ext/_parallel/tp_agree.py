"""What applying a tensor-parallel plan must leave alike on every rank: checked at once.

``TensorParallel.apply`` applies the plan to this rank's stages, then one exchange over
the whole mesh (``collectives.gather_outcomes``) carries each rank's outcome and what
the plan made of its stages; every rank reads the same answers and raises the same
error, before any step can pair mismatched collectives:

* a plan that raised on some ranks (a callable's exception): every rank fails naming
  them and the exception;
* a stage split differently on two ranks holding it (a callable that reads the rank):
  :func:`layouts` of each stage compared, naming the tensor, both placements and ranks;
* a dimension split unevenly (``ColwiseParallel()`` on a layer of 7 outputs over tp=2):
  torch's sharding propagation would fail on some ranks only (:func:`uneven`), so it is
  refused naming the parameter, the dimension, its size and tp.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

from torch import nn

from .._dist.collectives import is_dtensor
from .._dist.groups import RankNames

__all__ = ["layouts", "refuse_differences", "refuse_uneven", "uneven"]


def _tensors(module: nn.Module) -> List[Any]:
    """``(name, tensor)`` of every parameter and buffer, as named in the model."""
    return list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())


def _layout(t: Any) -> str:
    if not is_dtensor(t):
        return "not split"
    return f"{tuple(t.placements)} over mesh {tuple(t.device_mesh.mesh_dim_names or ())}"


def layouts(stages: Mapping[int, nn.Module]) -> Dict[str, Dict[str, str]]:
    """How the plan split each tensor of each stage (JSON: ``{stage: {name: layout}}``)."""
    return {str(j): {name: _layout(t) for name, t in _tensors(m)} for j, m in stages.items()}


def uneven(stages: Mapping[int, nn.Module]) -> List[List[Any]]:
    """``[name, shape, dim, size, parts, mesh dimension]`` of every tensor the plan
    shards on a dimension its mesh dimension does not divide."""
    found = []
    for module in stages.values():
        for name, t in _tensors(module):
            if not is_dtensor(t):
                continue
            names = t.device_mesh.mesh_dim_names or ()
            for i, placement in enumerate(t.placements):
                parts = t.device_mesh.size(i)
                if placement.is_shard() and t.shape[placement.dim] % parts:
                    found.append([name, list(t.shape), placement.dim % t.dim(), t.shape[placement.dim],
                                  parts, names[i] if i < len(names) else str(i)])
    return found


def refuse_differences(gathered: Sequence[Mapping[str, Any]], names: RankNames) -> None:
    """Refuses a stage whose tensors two of its ranks split differently.

    Args:
        gathered: every rank's :func:`layouts` (global rank order).
        names: how messages name ranks.

    Raises:
        ValueError: naming the stage, the tensor, both layouts and ranks.
    """
    first: Dict[str, int] = {}
    for rank, stages in enumerate(gathered):
        for j, mine in stages.items():
            other = first.setdefault(j, rank)
            theirs = gathered[other][j]
            if mine == theirs:
                continue
            name = next(n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n))
            raise ValueError(
                f"tensor_parallel split stage {j} differently on its ranks: {name!r} is "
                f"{theirs.get(name, 'absent')} on {names.of_global(other)} but "
                f"{mine.get(name, 'absent')} on {names.of_global(rank)}; a plan must split every "
                "stage alike on every rank (a callable plan may not depend on the rank or on "
                "anything else that differs between processes)")


def refuse_uneven(found: Sequence[Sequence[Any]]) -> None:
    """Refuses a tensor sharded unevenly (:func:`uneven`, gathered from every rank).

    Raises:
        ValueError: naming the parameter, its shape, the dimension, its size and tp.
    """
    if not found:
        return
    name, shape, dim, size, parts, over = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise ValueError(
        f"tensor_parallel shards {name!r} (shape {shape}) on dim {dim}, of size {size}, over "
        f"{over}={parts}, which does not divide it evenly{more}: torch's sharding propagation "
        "then fails on some ranks only (uneven shards); give dim "
        f"{dim} a size divisible by {parts} (e.g. {-(-size // parts) * parts}) or leave that "
        "module out of the plan")
