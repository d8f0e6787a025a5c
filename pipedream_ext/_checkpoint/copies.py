"""After a load, before anything is copied in: every copy of a tensor got the same value.

Several ranks (or one rank under several names) hold copies of one tensor that must
stay equal: a parameter tied across stages (each of its stages' ranks), or within a
rank's stages; a stage's replicas (a mesh's dp ranks with ``data_parallel="replicate"``,
a pipeline's ``replicas``); a tensor tensor parallelism keeps whole on every tp rank (a
norm's weight, plain or a ``Replicate()`` ``DTensor``), or the same shard of one on
every dp rank. Every load takes each copy's value from its own source: a state dict
(``pipe.load_state_dict``), which may differ per rank, or a checkpoint whose shards are
cut anew (``load_checkpoint``). Copies that differ would train apart, silently.

So :func:`check_copies` digests the value each copy would take (the loaded value, or
for a key the source lacked the tensor's current one, where it is tied to a loaded
key), one all-gather of the digests over the pipeline's ranks compares every copy of
each tensor (by its canonical name and the shard it holds), and every rank raises the
same error naming the tensor, its names and the ranks, before anything changed. We
refuse rather than broadcast one rank's values: which rank's copy was meant cannot be
known, and torch (DCP, ``set_model_state_dict``) leaves replicated copies as loaded.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple, Type

from .._dist import collectives
from .._dist.collectives import is_dtensor
from .._dist.fingerprint import tensor_digest
from .view import PipelineView

__all__ = ["check_copies"]

#: One copy: ``(canonical name, the shard it holds)``.
CopyKey = Tuple[str, str]


def _shard(current: Any) -> str:
    """Which shard of the whole tensor ``current`` holds: its coordinates on the mesh
    dimensions it is sharded over (``""`` for a whole tensor)."""
    if not is_dtensor(current):
        return ""
    coordinate = current.device_mesh.get_coordinate() or []
    names = current.device_mesh.mesh_dim_names or tuple(str(i) for i in range(len(coordinate)))
    return ",".join(f"{names[i]}={c}" for i, (c, placement) in enumerate(zip(coordinate, current.placements))
                    if not placement.is_replicate())


def _canonical(view: PipelineView) -> Dict[str, str]:
    """Every name of a tied parameter -> its first name (ties across stages, and names
    of one tensor within this rank's stages)."""
    canonical = {n: sp.names[0] for sp in view.shared_parameters for n in sp.names}
    first: Dict[int, str] = {}
    for name, p in view.module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)
        if name not in canonical:
            canonical[name] = canonical.get(owner, owner)
    return canonical


def _digests(view: PipelineView, parts: Mapping[int, Mapping[str, Any]]) -> Dict[str, List[Any]]:
    """``"canonical|shard" -> [[name, digest, loaded], ...]`` of this rank's copies."""
    canonical = _canonical(view)
    found: Dict[str, List[Any]] = {}
    for j, module in view.stages.items():
        part = parts.get(j, {})
        for name, current in module.state_dict(keep_vars=True).items():
            value = part.get(name, current)
            local = value.to_local() if is_dtensor(value) else value
            # Compared as the copy will hold it (load_state_dict casts to its dtype).
            local = local.to((current.to_local() if is_dtensor(current) else current).dtype)
            key = f"{canonical.get(name, name)}|{_shard(current)}"
            found.setdefault(key, []).append([name, tensor_digest(local), name in part])
    return found


def check_copies(view: PipelineView, parts: Mapping[int, Mapping[str, Any]], what: str,
                 failure: Type[Exception] = ValueError) -> None:
    """Refuses a load that would leave copies of one tensor different. Collective over
    ``view.group``; every rank raises alike.

    Args:
        view: the pipeline.
        parts: each local stage's values about to be loaded (:mod:`.reshard`'s parts).
        what: how the error names the load (``"load_state_dict"``).
        failure: the exception type raised.

    Raises:
        failure: naming the tensor, its names, the ranks and their digests, and the fix
            (nothing was loaded).
    """
    gathered = collectives.all_gather_json(_digests(view, parts), view.group)
    copies: Dict[str, List[Tuple[int, str, str, bool]]] = {}
    for rank, found in enumerate(gathered):
        for key, entries in found.items():
            copies.setdefault(key, []).extend((rank, n, d, loaded) for n, d, loaded in entries)
    for key, entries in copies.items():
        if len({d for _, _, d, _ in entries}) < 2 or not any(loaded for *_, loaded in entries):
            continue
        tensor, shard = key.split("|")
        each = "; ".join(f"{name!r} on rank {rank}: {digest}{'' if loaded else ' (not in the source: kept)'}"
                         for rank, name, digest, loaded in entries)
        raise failure(
            f"{what}: the copies of {tensor!r}{f' (shard {shard})' if shard else ''} would differ "
            f"after the load ({each}); they are one tensor (tied, replicated over dp or tp, or one "
            "shard held by several ranks) and would train apart. Load the same values into "
            "every copy: the same state dict on every rank, and equal values under every name "
            "of a tied parameter (nothing was loaded)")
