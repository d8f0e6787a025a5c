"""Re-sharding by name: the whole model's tensors -> this rank's stages.

The one implementation behind ``load_checkpoint`` (tensors from the stage files
of a checkpoint saved with any split) and ``pipe.load_state_dict`` (a full state
dict: ``model.state_dict()``, a ``torch.load``-ed file, ``pd.consolidate(ckpt)``):
:func:`gather_by_name` asks a source for each key of each local stage's
``state_dict`` by the original model's name; once every rank agreed,
:func:`copy_into_stages` copies the values into the live tensors.

For a full state dict, every rank keeps the entries of its own stages' layers;
keys of other ranks' stages are ignored; keys the model does not have at all,
keys this rank's stages need but the dict lacks, and shapes that differ are
errors. A stage tensor that is a DTensor (a mesh's FSDP shards, tensor parallelism)
takes its own shard of the whole value, cut on the rank by its placements.
:func:`split_state_dict` is pure (tested in one process); :func:`load_state_dict` is
the collective that agrees on errors and copies in place.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .._dist import collectives
from . import copies
from .view import Pipeline

__all__ = ["load_parts", "key_shapes", "gather_by_name", "copy_into_stages", "split_state_dict",
           "load_state_dict", "IncompatibleKeys", "StageStates"]

#: ``(missing_keys, unexpected_keys)``, as ``nn.Module.load_state_dict`` returns.
IncompatibleKeys = nn.modules.module._IncompatibleKeys  # noqa: SLF001 - torch's own type
#: Local stage index -> the state dict to load into it.
StageStates = Dict[int, "collections.OrderedDict[str, torch.Tensor]"]

_SHOWN = 8  # keys named in one message; the count says how many more


def key_shapes(model: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Every ``state_dict`` key of the whole model and its shape (meta tensors work).

    Args:
        model: the whole model, before the pipeline keeps its slice.

    Returns:
        ``{key: shape}`` in ``state_dict`` order.
    """
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def gather_by_name(stages: Mapping[int, nn.Module],
                   fetch: Callable[[str, torch.Tensor], Optional[torch.Tensor]]
                   ) -> Tuple[StageStates, Dict[int, List[str]]]:
    """Each local stage's state dict, fetched key by key by the original model's name.

    Args:
        stages: this rank's stage modules (children named as in the model).
        fetch: ``(key, current tensor) -> the value to load``, or ``None`` where the
            source lacks the key; it raises for a value that does not fit.

    Returns:
        ``(per-stage state dicts in state_dict order, per-stage keys the source lacks)``.
    """
    parts: StageStates = {}
    absent: Dict[int, List[str]] = {}
    for j, module in stages.items():
        parts[j] = collections.OrderedDict()
        absent[j] = []
        for key, current in module.state_dict().items():
            value = fetch(key, current)
            if value is None:
                absent[j].append(key)
            else:
                parts[j][key] = value
    return parts, absent


def copy_into_stages(stages: Mapping[int, nn.Module], parts: StageStates, strict: bool) -> None:
    """Copies each part into its stage's live tensors, in place, and clears gradients.

    In place (``param.copy_`` under ``no_grad``): the executor and the weight store
    of asynchronous schedules hold these tensors, so the next step uses the values.

    Args:
        stages: this rank's stage modules.
        parts: :func:`gather_by_name`'s state dicts.
        strict: every key of a stage must be in its part.
    """
    with torch.no_grad():
        for j, part in parts.items():
            stages[j].load_state_dict(part, strict=strict)
            for p in stages[j].parameters():
                p.grad = None


def _listed(keys: List[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _check_whole_dict(state_dict: Any, model_shapes: Mapping[str, Tuple[int, ...]],
                      strict: bool) -> List[str]:
    """The keys the model does not have; raises ValueError for any of them (strict),
    a value that is not a tensor, or a shape that differs from the model's."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict is a {type(state_dict).__name__}, not a mapping from "
                         "names to tensors; pass model.state_dict() or pd.consolidate(path)")
    unexpected = [k for k in state_dict if k not in model_shapes]
    if unexpected and strict:
        raise ValueError(
            f"the state dict has {len(unexpected)} key(s) this model does not have: "
            f"{_listed(unexpected)} (unexpected keys: a state dict of another model?); pass the "
            "state dict of this model, or strict=False to ignore them")
    for key, value in state_dict.items():
        if key not in model_shapes:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != tuple(model_shapes[key]):
            raise ValueError(f"state dict entry {key!r} has shape {list(value.shape)} but this "
                             f"model's is {list(model_shapes[key])}; pass the state dict of a model "
                             "with the same layer sizes")
    return unexpected


def _refuse_meta(state_dict: Mapping[str, Any], keys: List[str]) -> None:
    """Raises ValueError naming the entries of ``keys`` that are on the meta device
    (shapes without values: nothing could be copied from them)."""
    meta = [k for k in keys if isinstance(state_dict.get(k), torch.Tensor) and state_dict[k].is_meta]
    if meta:
        raise ValueError(
            f"state dict entr{'ies' if len(meta) > 1 else 'y'} {_listed(meta)} "
            f"{'are' if len(meta) > 1 else 'is'} on the meta device, which has shapes but no "
            "values (the state dict of a model built under torch.device('meta')?); pass a "
            "state dict with values: of a materialised model (pd.materialize(model)), a file "
            "(torch.load(path, mmap=True)) or pd.consolidate(checkpoint)")


def _laid_out_like(value: Optional[torch.Tensor], current: torch.Tensor) -> Optional[torch.Tensor]:
    """``value`` (a whole tensor) as ``current`` holds it: a DTensor (tensor parallelism,
    FSDP over a mesh's ``dp``) takes this rank's shard by its placements, cut locally
    (``src_data_rank=None``: every rank has the whole value, nothing is sent)."""
    if value is None or not collectives.is_dtensor(current):
        return value
    # Only reached with a DTensor, so torch.distributed.tensor is loaded already; at
    # module level it would cost every rank's start-up.
    from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 - only with DTensors
    return distribute_tensor(value.detach().to(current.device), current.device_mesh, current.placements,
                             src_data_rank=None)


def split_state_dict(state_dict: Mapping[str, Any], model_shapes: Mapping[str, Tuple[int, ...]],
                     stages: Mapping[int, nn.Module], stage_layers: Mapping[int, Tuple[int, int]],
                     strict: bool = True) -> Tuple[StageStates, List[str], List[str]]:
    """This rank's entries of a full state dict, per local stage.

    Args:
        state_dict: the whole model's state dict (original names).
        model_shapes: :func:`key_shapes` of the whole model.
        stages: this rank's stage modules (children named as in the model).
        stage_layers: each local stage's layer range ``[start, stop)``, for messages.
        strict: refuse missing and unexpected keys (shapes are always checked).

    Returns:
        ``(per-stage state dicts, missing keys of this rank, unexpected keys)``.

    Raises:
        ValueError: (strict) keys the model does not have, keys this rank's stages
            need that the dict lacks (naming the stage); any shape that differs
            (naming the key and both shapes); a value that is not a tensor; values of
            this rank's keys on the meta device (naming them).
    """
    unexpected = _check_whole_dict(state_dict, model_shapes, strict)
    _refuse_meta(state_dict, [key for module in stages.values() for key in module.state_dict()])
    parts, absent = gather_by_name(stages, lambda key, current: _laid_out_like(state_dict.get(key), current))
    missing: List[str] = []
    for j, keys in absent.items():
        if keys and strict:
            start, stop = stage_layers[j]
            raise ValueError(
                f"the state dict lacks {len(keys)} key(s) of stage {j} (layers {start}-{stop - 1}): "
                f"{_listed(keys)} (missing keys); pass a complete state dict of this model, or "
                "strict=False to keep their current values")
        missing.extend(keys)
    return parts, missing, unexpected


def load_state_dict(pipe: Pipeline, state_dict: Mapping[str, Any],
                    strict: bool = True) -> IncompatibleKeys:
    """Loads this rank's entries of a full state dict into ``pipe``, in place.

    Collective: every rank of the pipeline calls it with the full state dict. An
    asynchronous pipeline is flushed first (every admitted minibatch finishes, so
    the live weights are the only version). Each rank checks its part; an
    exchange reports every rank's outcome, and unless all succeeded every rank
    raises the same error and nothing changes. Then values are copied into the
    live parameters and buffers (:func:`copy_into_stages`) and gradients are cleared.

    Args:
        pipe: the pipeline.
        state_dict: the whole model's state dict, keyed by its original names.
        strict: refuse missing and unexpected keys.

    Returns:
        ``(missing_keys, unexpected_keys)`` of this rank (empty when strict).

    Raises:
        ValueError: on every rank, if any rank found missing keys for its stages,
            keys the model does not have, or a shape that differs (naming them).
        RuntimeError: on every rank, if a rank failed otherwise or a peer did not
            arrive within the pipeline's timeout.
    """
    return load_parts(pipe, lambda view: split_state_dict(
        state_dict, view.model_shapes, view.stages, view.stage_layers, strict), "load_state_dict")


def load_parts(pipe: Pipeline, split: Callable[[Any], Tuple[StageStates, List[str], List[str]]],
               what: str) -> IncompatibleKeys:
    """What every load into a live pipeline does around its source: an asynchronous
    pipeline flushed, ``split(view)`` (this rank's stage states, missing and unexpected
    keys) agreed on by every rank, then copied into the stages.

    Args:
        pipe: the pipeline.
        split: reads this rank's part from the source (a state dict, a Hugging Face file).
        what: how errors name the load.

    Returns:
        ``(missing_keys, unexpected_keys)`` of this rank.

    Raises:
        ValueError, RuntimeError: on every rank, what any rank's ``split`` raised (or a
            peer that did not arrive within the pipeline's timeout); ``ValueError``:
            copies of one tensor (tied, replicated) would differ (``copies.check_copies``).
    """
    view = pipe.checkpoint_view
    if view.asynchronous:
        pipe.flush()
    error: Optional[BaseException] = None
    parts: StageStates = {}
    missing: List[str] = []
    unexpected: List[str] = []
    try:
        parts, missing, unexpected = split(view)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    collectives.raise_if_any_failed(error, view.group, view.timeout, what)
    copies.check_copies(view, parts, what)
    # strict=False: a non-strict load leaves the keys the source lacks as they are.
    copy_into_stages(view.stages, parts, strict=False)
    return IncompatibleKeys(missing, unexpected)
