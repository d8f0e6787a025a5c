"""Loading a ``"pipedream"`` checkpoint (per-stage files) into a pipeline of any layout.

Each rank gathers its stages' tensors by name (:mod:`.reshard`) from whichever
stage files of the checkpoint hold them, checking every file against the manifest
(size, sha256) before ``torch.load(..., weights_only=True)``; the optimizer's
state comes by parameter name (:mod:`.optimizer_state`). Everything is read
before ``load_checkpoint``'s exchange, so nothing is left to do after it.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from .. import reshard
from ..errors import CheckpointError
from ..manifest import MANIFEST, check_layers, check_model_kind, load_file, owner_of_key, stage_what
from ..optimizer_state import optimizer_state_for
from ..reshard import StageStates
from ..storage import PreparedLoad
from ..view import PipelineView

__all__ = ["prepare"]


class _StageFiles:
    """The checkpoint's weights files, read by key (each file loads once)."""

    def __init__(self, directory: str, manifest: Mapping[str, Any], device: torch.device,
                 cache: Dict[str, Any]) -> None:
        self.directory = directory
        self.owner_of = owner_of_key(manifest)
        self._device = device
        self._cache = cache

    def load(self, stage: Mapping[str, Any]) -> Any:
        """The loaded weights file of a stage record (verified first)."""
        return load_file(self.directory, stage["model"], stage_what(stage, "weights"),
                         self._device, self._cache)

    def tensor(self, key: str, current: torch.Tensor) -> torch.Tensor:
        """The saved tensor for ``key``, checked against this model's ``current`` one.

        Raises:
            CheckpointError: the file lacks it, holds no tensor, or another shape.
        """
        stage = self.owner_of(key)
        # A parameter shared with an earlier stage is stored under that stage's name.
        same_as = stage["model"].get("tensors", {}).get(key, {}).get("same_as")
        if same_as is not None:
            stage = self.owner_of(same_as)
        data = self.load(stage)
        where = f"{os.path.join(self.directory, stage['model']['file'])} ({stage_what(stage, 'weights')})"
        source = key if same_as is None else same_as
        if source not in data:
            raise CheckpointError(f"{where} has no entry for {source!r}, which this model "
                                  "has (missing parameter or buffer)")
        value = data[source]
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: {key!r} is a {type(value).__name__}, not a tensor")
        if value.shape != current.shape:
            raise CheckpointError(f"{where}: {key!r} has shape {list(value.shape)} in the "
                                  f"checkpoint but {list(current.shape)} in this model")
        return value


def _check_no_unexpected_keys(files: _StageFiles, view: PipelineView) -> None:
    """An ``nn.Sequential``: the files of the local layers' stages hold no key of
    those layers that the model lacks."""
    for module in view.stages.values():
        layer_names = {name for name, _ in module.named_children()}
        expected = module.state_dict()
        owners = {id(stage): stage for stage in map(files.owner_of, layer_names)}
        for stage in owners.values():
            for key in files.load(stage):
                if key.split(".", 1)[0] in layer_names and key not in expected:
                    raise CheckpointError(
                        f"{os.path.join(files.directory, stage['model']['file'])} "
                        f"({stage_what(stage, 'weights')}) has {key!r}, "
                        "which this model does not have (unexpected parameter or buffer)")


def _check_no_foreign_keys(manifest_path: str, manifest: Mapping[str, Any], view: PipelineView) -> None:
    """A traced model: the manifest lists no key the model lacks."""
    listed = {key for stage in manifest["stages"] for key in stage["model"].get("tensors", {})}
    foreign = listed - set(view.model_shapes)
    if foreign:
        raise CheckpointError(f"{manifest_path} lists {sorted(foreign)[:8]}, which this model does "
                              "not have (unexpected parameters or buffers: saved from another model)")


def _prepare_weights(directory: str, manifest: Mapping[str, Any], view: PipelineView,
                     cache: Dict[str, Any]) -> StageStates:
    """For each local stage, its state_dict gathered by name from the checkpoint's
    stage files: an ``nn.Sequential``'s keys from the stage of their layer, a traced
    model's from the stage file listing them (any split of the same model)."""
    manifest_path = os.path.join(directory, MANIFEST)
    check_model_kind(manifest_path, manifest, view)
    if view.split_points is None:
        check_layers(manifest_path, manifest, view)
    else:
        _check_no_foreign_keys(manifest_path, manifest, view)
    files = _StageFiles(directory, manifest, view.device, cache)
    parts, _ = reshard.gather_by_name(view.stages, files.tensor)
    if view.split_points is None:
        _check_no_unexpected_keys(files, view)
    return parts


class _Loaded(PreparedLoad):
    """What :func:`prepare` read: nothing is left to read after the exchange."""

    def __init__(self, weights: StageStates, optimizer_state: Optional[Dict[str, Any]]) -> None:
        self._weights = weights
        self._optimizer_state = optimizer_state

    def read(self, view: PipelineView) -> Tuple[StageStates, Optional[Dict[str, Any]]]:
        return self._weights, self._optimizer_state


def prepare(directory: str, manifest: Mapping[str, Any], view: PipelineView,
            optimizer: Optional[torch.optim.Optimizer]) -> PreparedLoad:
    """``StageFilesStorage.prepare_load`` (its arguments): this rank's stages' state
    dicts and optimizer state, read from the stage files and checked (local).

    Returns:
        What was read, for ``load_checkpoint`` to copy in once every rank succeeded.

    Raises:
        CheckpointError: a missing, truncated or corrupt file, or another model or
            optimizer (the message names the file and the parameter).
        ValueError: the optimizer holds tensors that are not this rank's parameters.
    """
    cache: Dict[str, Any] = {}
    weights = _prepare_weights(directory, manifest, view, cache)
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = optimizer_state_for(directory, manifest, view, optimizer, cache)
    return _Loaded(weights, optimizer_state)
