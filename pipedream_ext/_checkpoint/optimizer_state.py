"""Optimizer state by parameter name, so it loads into any other split.

Saving turns this rank's ``optimizer.state_dict()`` (keyed by position) into one
payload per local stage keyed by the original model's parameter names; loading
builds the ``state_dict`` of the loading rank's optimizer (its own parameter
order) from whichever stage files hold its parameters.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .._frontend.tied_params import canonical_names
from .errors import CheckpointError
from .manifest import load_file, owner_of_key, stage_what
from .view import PipelineView

__all__ = ["OPTIMIZER_FORMAT", "class_name", "parameter_names", "optimizer_by_stage",
           "optimizer_state_for", "state_dict_from_entries", "hyperparameters", "SavedEntry"]

#: Value of an optimizer file's ``format`` field.
OPTIMIZER_FORMAT = "pipedream_ext-optimizer"
# Keys of a param group that are not hyperparameters: "param_names" (optimizers
# built from named_parameters) describes the group's composition, which loading may change.
_NOT_HYPER = ("params", "param_names")


def class_name(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s class."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def hyperparameters(group: Mapping[str, Any]) -> Dict[str, Any]:
    """A param group's hyperparameters: everything but ``params`` and ``param_names``
    (which describe the group's composition, which loading may change)."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


#: ``name -> (the file holding it, for messages; its saved hyperparameters; its saved
#: state or None)``: how a saved optimizer is read by parameter name.
SavedEntry = Callable[[str], Tuple[str, Dict[str, Any], Optional[Any]]]


def parameter_names(view: PipelineView, optimizer: torch.optim.Optimizer) -> List[List[str]]:
    """For each param group of ``optimizer``, its parameters' names in the original
    model (a shared parameter: its canonical name).

    Args:
        view: the pipeline.
        optimizer: this rank's optimizer.

    Returns:
        One list of names per param group, in the optimizer's order.

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of this
            rank's stages.
    """
    canonical = canonical_names(view.shared_parameters)
    names = {id(p): canonical.get(n, n) for n, p in view.module.named_parameters()}
    result: List[List[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        result.append([])
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"rank {view.rank}: optimizer param group {g} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of this rank's stages; "
                                 "build the optimizer from pipe.parameters()")
            result[-1].append(names[id(p)])
    return result


def optimizer_by_stage(view: PipelineView, optimizer: torch.optim.Optimizer) -> Dict[int, Dict[str, Any]]:
    """This rank's optimizer state split per local stage and keyed by parameter name.

    Args:
        view: the pipeline.
        optimizer: this rank's optimizer over ``pipe.parameters()``.

    Returns:
        For each local stage with parameters in the optimizer: ``{"format", "class",
        "state": {name: {...}}, "param_groups": [{hyperparameters..., "params": [names]}]}``.

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of this
            rank's stages.
    """
    # A parameter shared by stages is saved once, under its canonical name, by the
    # canonical name's stage: the other stages' copies hold the same state.
    index_to_name = [name for names in parameter_names(view, optimizer) for name in names]
    stage_of_name: Dict[str, int] = {}
    for j, module in sorted(view.stages.items()):
        for n, _ in module.named_parameters():
            stage_of_name.setdefault(n, j)  # a name two local stages hold: the first stores it
    packed = optimizer.state_dict()  # runs the optimizer's state_dict hooks; tensors are not copied
    result: Dict[int, Dict[str, Any]] = {}
    for group in packed["param_groups"]:
        kept = [index_to_name[i] for i in group["params"] if index_to_name[i] in stage_of_name]
        for j in sorted({stage_of_name[name] for name in kept}):
            entry = result.setdefault(j, {"format": OPTIMIZER_FORMAT, "class": class_name(optimizer),
                                          "state": {}, "param_groups": []})
            entry["param_groups"].append(dict(hyperparameters(group), params=[
                name for name in kept if stage_of_name[name] == j]))
    for i, value in packed["state"].items():
        name = index_to_name[int(i)]
        if name in stage_of_name:
            result[stage_of_name[name]]["state"][name] = value
    return result


class _SavedOptimizer:
    """The saved optimizer files, read by parameter name (each file loads once)."""

    def __init__(self, directory: str, manifest: Mapping[str, Any], optimizer_class: str,
                 cache: Dict[str, Any]) -> None:
        self._directory = directory
        self._owner_of: Callable[[str], Dict[str, Any]] = owner_of_key(manifest)
        self._class = optimizer_class
        self._cache = cache
        self._group_of: Dict[str, Dict[str, Any]] = {}  # file -> {name: saved group}

    def entry(self, name: str) -> Tuple[str, Dict[str, Any], Optional[Any]]:
        """``(file path, saved hyperparameters, saved state or None)`` of a parameter.

        Raises:
            CheckpointError: no optimizer file for its stage, another optimizer
                class, no entry for the parameter, or a malformed file.
        """
        stage = self._owner_of(name)
        what = stage_what(stage, "optimizer state")
        record = stage.get("optimizer")
        if not record:
            raise CheckpointError(f"{self._directory}: stage {stage['stage']} was saved without "
                                  f"optimizer state, which parameter {name!r} needs")
        full = os.path.join(self._directory, record["file"])
        payload = load_file(self._directory, record, what, "cpu", self._cache)
        try:
            if payload["class"] != self._class:
                raise CheckpointError(f"{full} ({what}) holds the state of a {payload['class']}, "
                                      f"not of a {self._class}; create the same "
                                      "optimizer type as when saving")
            if record["file"] not in self._group_of:
                self._group_of[record["file"]] = {n: saved for saved in payload["param_groups"]
                                                  for n in saved["params"]}
            saved_group = self._group_of[record["file"]].get(name)
            if saved_group is None:
                raise CheckpointError(f"{full} ({what}) has no optimizer entry for parameter {name!r} "
                                      "(the saved optimizer did not hold it)")
            return full, hyperparameters(saved_group), payload["state"].get(name)
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{full} ({what}) is not a pipedream_ext optimizer file: "
                                  f"{type(exc).__name__}: {exc}") from exc


def _group_hyperparameters(entry: SavedEntry, g: int, names: List[str],
                           state: Dict[int, Any], first_index: int) -> Optional[Dict[str, Any]]:
    """The saved hyperparameters of the parameters ``names`` of param group ``g``
    (``None``: the group is empty); fills ``state`` from ``first_index`` on.

    Raises:
        CheckpointError: the parameters were saved with different hyperparameters.
    """
    hyper: Optional[Dict[str, Any]] = None
    hyper_source = ""
    for offset, name in enumerate(names):
        full, saved_hyper, saved_state = entry(name)
        if hyper is None:
            hyper, hyper_source = saved_hyper, name
        else:
            differing = sorted(k for k in set(hyper) | set(saved_hyper)
                               if not _same_value(hyper.get(k), saved_hyper.get(k)))
            if differing:
                raise CheckpointError(
                    f"{full}: optimizer param group {g} holds {hyper_source!r} and {name!r}, "
                    f"which were saved with different {', '.join(differing)}; group the "
                    "parameters as when saving")
        if saved_state is not None:
            state[first_index + offset] = saved_state
    return hyper


def optimizer_state_for(directory: str, manifest: Mapping[str, Any], view: PipelineView,
                        optimizer: torch.optim.Optimizer, cache: Dict[str, Any]) -> Dict[str, Any]:
    """The ``state_dict`` for this rank's optimizer, from the per-name saved state.

    Args:
        directory: the checkpoint directory.
        manifest: its manifest.
        view: the loading pipeline.
        optimizer: this rank's optimizer (same type as when saving).
        cache: loaded files by name (shared with the weights' loading).

    Returns:
        ``{"state", "param_groups"}`` in this optimizer's parameter order, with the
        saved hyperparameters (a group with no parameters keeps its own).

    Raises:
        CheckpointError: the checkpoint has no optimizer state, or it does not fit.
        ValueError: the optimizer holds tensors that are not this rank's parameters.
    """
    if not manifest.get("optimizer"):
        raise CheckpointError(f"{directory} holds no optimizer state (it was saved without "
                              "optimizer=); load it without optimizer=")
    saved = _SavedOptimizer(directory, manifest, class_name(optimizer), cache)
    return state_dict_from_entries(saved.entry, view, optimizer)


def state_dict_from_entries(entry: SavedEntry, view: PipelineView,
                            optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The ``state_dict`` for this rank's optimizer from saved state read by name.

    Args:
        entry: a parameter's saved hyperparameters and state by name (raises
            ``CheckpointError`` for a parameter the checkpoint lacks).
        view: the loading pipeline.
        optimizer: this rank's optimizer.

    Returns:
        ``{"state", "param_groups"}`` in this optimizer's parameter order, with the
        saved hyperparameters (a group with no parameters keeps its own).

    Raises:
        CheckpointError: parameters grouped together were saved with different
            hyperparameters, or ``entry`` raised.
        ValueError: the optimizer holds tensors that are not this rank's parameters.
    """
    state: Dict[int, Any] = {}
    groups: List[Dict[str, Any]] = []
    index = 0
    for g, (group, names) in enumerate(zip(optimizer.param_groups, parameter_names(view, optimizer))):
        hyper = _group_hyperparameters(entry, g, names, state, index)
        new_group = dict(hyper) if hyper is not None else hyperparameters(group)
        new_group["params"] = list(range(index, index + len(names)))
        groups.append(new_group)
        index += len(names)
    return {"state": state, "param_groups": groups}
