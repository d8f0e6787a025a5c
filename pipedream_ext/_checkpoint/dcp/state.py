"""Names between a pipeline and a DCP checkpoint, both ways.

A DCP checkpoint of a pipeline holds one state dict, ``{"model": ..., "optim": ...}``,
keyed by the unsplit model's names, so it loads into any other split and into the
unsplit model:

* ``model``: ``get_model_state_dict`` of each stage this rank leads (replica 0;
  the other replicas hold the same parameters), and with ``mesh=``,
  ``data_parallel="fsdp"`` of every local stage (each dp rank gives its shards, as
  DTensors, which DCP writes as one tensor); a parameter shared by stages is
  written once, under its canonical name (``_frontend/tied_params.py``).
* ``optim``: torch's flattened optimizer state
  (``get_optimizer_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``):
  ``state.{name}.{key}`` and ``param_groups.{name}.{hyperparameter}`` per parameter, so
  the loading ranks form their own groups. It is built here from
  ``optimizer.state_dict()`` and the parameters' names, not by that function, which
  steps an optimizer that has no state yet (an Adam saved before its first step
  would resume at step 1) and names a tied copy by this rank's name for it.
  ``param_names`` (a group's composition) is not saved, as in the pipedream format.

Tensors are passed as they are (no copies, no conversion), so a DTensor stays a
DTensor. Loading asks DCP for each local key by its saved name, into new tensors
laid out like the live ones (``empty_like``), and maps the values back to this
rank's names (:class:`LoadRequest`).
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ..._frontend.tied_params import alias_names
from ..errors import CheckpointError
from ..optimizer_state import hyperparameters, parameter_names
from ..reshard import StageStates
from ..view import PipelineView

__all__ = ["MODEL", "OPTIM", "model_to_save", "optimizer_to_save", "LoadRequest"]

#: Top-level keys of the saved state dict.
MODEL, OPTIM = "model", "optim"
_STATE, _GROUPS = "state", "param_groups"


def _model_state(module: nn.Module) -> Dict[str, Any]:
    """``get_model_state_dict(module)``; ``{}`` for a module without tensors (which
    that function refuses)."""
    if not module.state_dict():
        return {}
    return get_model_state_dict(module)


def model_to_save(view: PipelineView) -> Dict[str, Any]:
    """This rank's part of ``model``: the stages it leads, shared parameters once.

    Args:
        view: the pipeline.

    Returns:
        ``{original name: tensor}`` (the live tensors, not copies).
    """
    result: Dict[str, Any] = {}
    for j, module in sorted(view.stages.items()):
        if not view.writes(j):
            continue
        aliases = alias_names(view.shared_parameters, stage=j)
        for key, value in _model_state(module).items():
            if key not in aliases:
                result.setdefault(key, value)
    return result


def _written_parameters(view: PipelineView) -> Set[str]:
    """The parameter names whose optimizer state this rank writes."""
    names: Set[str] = set()
    for j, module in view.stages.items():
        if view.writes(j):
            aliases = alias_names(view.shared_parameters, stage=j)
            names.update(n for n, _ in module.named_parameters() if n not in aliases)
    return names


def _flatten_into(flat: Dict[str, Any], prefix: str, value: Any) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten_into(flat, f"{prefix}.{key}", item)
    else:
        flat[prefix] = value


def optimizer_to_save(view: PipelineView, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """This rank's part of ``optim``, flattened by parameter name.

    Args:
        view: the pipeline.
        optimizer: this rank's optimizer over ``pipe.parameters()``.

    Returns:
        ``{"state.{name}.{key}": value, "param_groups.{name}.{hyperparameter}": value}``
        for the parameters of the stages this rank leads (tensors not copied).

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of this
            rank's stages.
    """
    index_to_name = [name for names in parameter_names(view, optimizer) for name in names]
    written = _written_parameters(view)
    packed = optimizer.state_dict()  # runs the optimizer's state_dict hooks; no copies
    flat: Dict[str, Any] = {}
    for group in packed["param_groups"]:
        hyper = hyperparameters(group)
        for i in group["params"]:
            if index_to_name[i] in written:
                for key, value in hyper.items():
                    flat[f"{_GROUPS}.{index_to_name[i]}.{key}"] = value
    for i, state in packed["state"].items():
        name = index_to_name[int(i)]
        if name in written:
            _flatten_into(flat, f"{_STATE}.{name}", state)
    return flat


def _split_optimizer_key(key: str, names: Set[str]) -> Optional[Tuple[str, str, str]]:
    """``"optim.state.3.weight.exp_avg"`` -> ``("state", "3.weight", "exp_avg")`` where
    ``3.weight`` is one of ``names`` (parameter names have dots too); else ``None``."""
    for section in (_STATE, _GROUPS):
        prefix = f"{OPTIM}.{section}."
        if key.startswith(prefix):
            parts = key[len(prefix):].split(".")
            for cut in range(len(parts) - 1, 0, -1):
                name = ".".join(parts[:cut])
                if name in names:
                    return section, name, ".".join(parts[cut:])
    return None


def _unflatten(flat: Dict[str, Any]) -> Dict[str, Any]:
    nested: Dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


class LoadRequest:
    """What this rank asks of a DCP checkpoint, and the answers under its own names.

    ``state`` is the state dict to give ``dcp.load``: every saved name this rank's
    stages (and optimizer) need, each with a new tensor laid out like the live one
    (``empty_like``: a DTensor stays one) or ``None`` for a non-tensor value; the
    live tensors are untouched until the caller copies the answers in.

    Args:
        view: the loading pipeline.
        optimizer: its optimizer, or ``None``.
        metadata: the checkpoint's DCP metadata (which optimizer entries exist, their
            sizes and dtypes).
        where: the DCP directory, for messages.
    """

    def __init__(self, view: PipelineView, optimizer: Optional[torch.optim.Optimizer],
                 metadata: Metadata, where: str) -> None:
        self._where = where
        self.state: Dict[str, Dict[str, Any]] = {MODEL: {}}
        self._keys: Dict[int, List[Tuple[str, str]]] = {}  # stage -> (local key, saved name)
        for j, module in sorted(view.stages.items()):
            aliases = alias_names(view.shared_parameters, stage=j)
            self._keys[j] = []
            for key, value in _model_state(module).items():
                saved = aliases.get(key, key)
                self._keys[j].append((key, saved))
                if saved not in self.state[MODEL]:
                    self.state[MODEL][saved] = (torch.empty_like(value) if isinstance(value, torch.Tensor)
                                                else None)
        self._names: List[str] = []
        # name -> (hyperparameters, flattened state), built from the answers on first use
        self._by_name: Optional[Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]]] = None
        if optimizer is not None:
            self._names = [n for names in parameter_names(view, optimizer) for n in names]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.state[OPTIM] = self._optimizer_request(dict(zip(self._names, params)), metadata)

    @staticmethod
    def _optimizer_request(params: Dict[str, torch.Tensor], metadata: Metadata) -> Dict[str, Any]:
        """The saved optimizer entries of ``params`` (by name), with tensors to load into:
        one shaped like its parameter is laid out like it (its device, a DTensor's
        placement); any other (a step count) on the CPU, as the optimizer keeps it."""
        request: Dict[str, Any] = {}
        names = set(params)
        for key, md in metadata.state_dict_metadata.items():
            split = _split_optimizer_key(key, names)
            if split is None:
                continue
            section, name, rest = split
            if not isinstance(md, TensorStorageMetadata):
                value: Any = None
            elif tuple(md.size) == tuple(params[name].shape) and rest != "step":
                value = torch.empty_like(params[name], dtype=md.properties.dtype)
            else:
                value = torch.empty(md.size, dtype=md.properties.dtype)
            request[f"{section}.{name}.{rest}"] = value
        return request

    def stage_states(self) -> StageStates:
        """After ``dcp.load``: each local stage's state dict under its own keys."""
        return {j: collections.OrderedDict((key, self.state[MODEL][saved]) for key, saved in keys)
                for j, keys in self._keys.items()}

    def optimizer_entry(self, name: str) -> Tuple[str, Dict[str, Any], Optional[Any]]:
        """After ``dcp.load``: a parameter's saved hyperparameters and state
        (``optimizer_state.SavedEntry``).

        Raises:
            CheckpointError: the checkpoint holds no optimizer entry for it.
        """
        if self._by_name is None:  # one pass over the answers
            self._by_name = {n: ({}, {}) for n in self._names}
            names = set(self._names)
            for key, value in self.state[OPTIM].items():
                section, owner, rest = _split_optimizer_key(f"{OPTIM}.{key}", names)  # type: ignore[misc]
                hyper, flat_state = self._by_name[owner]
                (flat_state if section == _STATE else hyper)[rest] = value
        hyper, flat_state = self._by_name.get(name, ({}, {}))
        if not hyper:
            raise CheckpointError(f"{self._where} has no optimizer entry for parameter {name!r} "
                                  "(the saved optimizer did not hold it)")
        return self._where, hyper, _unflatten(flat_state) or None
