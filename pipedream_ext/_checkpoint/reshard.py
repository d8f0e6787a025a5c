"""A full (unsplit) state dict -> this rank's stages: ``pipe.load_state_dict``.

Every rank is given the whole model's state dict (``model.state_dict()``, a
``torch.load``-ed file, or ``pd.consolidate(ckpt)``) and keeps the entries of its
own stages' layers, keyed by the original model's names. Keys of other ranks'
stages are ignored; keys the model does not have at all, keys this rank's stages
need but the dict lacks, and shapes that differ are errors.

:func:`split_state_dict` is pure (tested in one process); :func:`load_state_dict`
is the collective that agrees on errors and copies in place.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .._dist import collectives

if TYPE_CHECKING:
    from .._pipe import PipeDream

__all__ = ["key_shapes", "split_state_dict", "load_state_dict", "IncompatibleKeys"]

#: ``(missing_keys, unexpected_keys)``, as ``nn.Module.load_state_dict`` returns.
IncompatibleKeys = nn.modules.module._IncompatibleKeys  # noqa: SLF001 - torch's own type

_SHOWN = 8  # keys named in one message; the count says how many more


def key_shapes(model: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Every ``state_dict`` key of the whole model and its shape (meta tensors work).

    Args:
        model: the whole model, before the pipeline keeps its slice.

    Returns:
        ``{key: shape}`` in ``state_dict`` order.
    """
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def _listed(keys: List[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def split_state_dict(state_dict: Mapping[str, Any], model_shapes: Mapping[str, Tuple[int, ...]],
                     stages: Mapping[int, nn.Module], stage_layers: Mapping[int, Tuple[int, int]],
                     strict: bool = True
                     ) -> Tuple[Dict[int, "collections.OrderedDict[str, torch.Tensor]"], List[str],
                                List[str]]:
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
            (naming the key and both shapes); a value that is not a tensor.
    """
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
    result: Dict[int, "collections.OrderedDict[str, torch.Tensor]"] = {}
    missing: List[str] = []
    for j, module in stages.items():
        wanted = list(module.state_dict().keys())
        absent = [k for k in wanted if k not in state_dict]
        if absent and strict:
            start, stop = stage_layers[j]
            raise ValueError(
                f"the state dict lacks {len(absent)} key(s) of stage {j} (layers {start}-{stop - 1}): "
                f"{_listed(absent)} (missing keys); pass a complete state dict of this model, or "
                "strict=False to keep their current values")
        missing.extend(absent)
        result[j] = collections.OrderedDict((k, state_dict[k]) for k in wanted if k in state_dict)
    return result, missing, unexpected


def load_state_dict(pipe: "PipeDream", state_dict: Mapping[str, Any],
                    strict: bool = True) -> IncompatibleKeys:
    """Loads this rank's entries of a full state dict into ``pipe``, in place.

    Collective: every rank of the pipeline calls it with the full state dict. An
    asynchronous pipeline is flushed first (every admitted minibatch finishes, so
    the live weights are the only version). Each rank checks its part; an
    exchange reports every rank's outcome, and unless all succeeded every rank
    raises the same error and nothing changes. Then values are copied into the
    live parameters and buffers under ``no_grad`` (the executor and the weight
    store hold these tensors, so the next step uses them) and gradients are cleared.

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
    if pipe.asynchronous:
        pipe.flush()
    error: Optional[BaseException] = None
    parts: Dict[int, "collections.OrderedDict[str, torch.Tensor]"] = {}
    missing: List[str] = []
    unexpected: List[str] = []
    stages = {j: pipe._stages[j] for j in pipe.local_stages}  # noqa: SLF001 - same package
    try:
        parts, missing, unexpected = split_state_dict(state_dict, pipe._model_shapes,  # noqa: SLF001
                                                      stages, pipe.stage_layers, strict)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    collectives.raise_if_any_failed(error, pipe.group, pipe.timeout, "load_state_dict")
    with torch.no_grad():
        for j, part in parts.items():
            # In place (param.copy_): the executor and weight store keep the same tensors.
            stages[j].load_state_dict(part, strict=False)
            for p in stages[j].parameters():
                p.grad = None
    return IncompatibleKeys(missing, unexpected)
