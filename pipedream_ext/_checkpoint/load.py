"""``load_checkpoint``: restore a checkpoint into any balance, replica layout or world size.

Each rank gathers its stages' tensors by name (:mod:`.reshard`) from whichever
stage files of the checkpoint hold them, checking every file against the
manifest, or (a DCP checkpoint, :mod:`.dcp_load`) asks DCP for them by name;
nothing changes unless every rank succeeded.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Mapping, Optional

import torch

from .._dist import collectives
from . import dcp_load, dcp_save, reshard
from . import directory as directory_check
from .durable_io import PathLike
from .errors import CheckpointError
from .manifest import (
    MANIFEST,
    STORAGE_DCP,
    CheckpointInfo,
    check_layers,
    check_model_kind,
    load_file,
    owner_of_key,
    read_manifest,
    stage_what,
    storage_of,
)
from .optimizer_state import optimizer_state_for
from .reshard import StageStates
from .view import Pipeline, PipelineView

__all__ = ["load_checkpoint"]

_log = logging.getLogger(__name__)


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


def load_checkpoint(path: PathLike, pipe: Pipeline,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> CheckpointInfo:
    """Restores a checkpoint into ``pipe`` (and ``optimizer``), in place.

    Collective: every rank of the pipeline calls it, with the same ``path``
    (checked: the path each rank resolves must be the same). The pipeline may differ from
    the one that saved: another balance, replica layout, schedule or world size;
    each rank gathers its layers' tensors by name from whichever stage files hold
    them. Every file is checked against the manifest (size, sha256) and loaded with
    ``torch.load(..., weights_only=True)``; a DCP checkpoint (the manifest says
    which format) is read with ``dcp.load`` by name, after the same checks. An
    asynchronous save in progress on these ranks is finished first. Nothing is changed unless every rank
    succeeded; then parameters and buffers are copied into the live tensors (so the
    executor and the weight store of asynchronous schedules see them; an
    asynchronous pipeline is flushed first), gradients are cleared, and the
    optimizer gets its per-parameter state and the saved param-group
    hyperparameters.

    Args:
        path: the checkpoint directory.
        pipe: the pipeline; its model must have the same layers (names, types and
            shapes) as the saved one.
        optimizer: this rank's optimizer over ``pipe.parameters()`` (same type as
            when saving), or ``None`` to load only weights and buffers.

    Returns:
        The :class:`CheckpointInfo` (``step`` and ``extra`` as saved).

    Raises:
        CheckpointError: on every rank, if any rank found the checkpoint missing,
            incomplete (no manifest, a missing or truncated file), corrupt, or not
            matching the model or optimizer; the message names the file and the
            parameter.
        ValueError: the optimizer holds tensors that are not this rank's parameters,
            or ``path`` resolves to another directory on some rank.
    """
    directory = os.fspath(path)
    view = pipe.checkpoint_view
    dcp_save.finish_pending(view)
    if view.asynchronous:
        pipe.flush()
    error = None
    manifest: Dict[str, Any] = {}
    weights: StageStates = {}
    optimizer_state: Optional[Dict[str, Any]] = None
    dcp_job: Optional[dcp_load.DcpLoad] = None
    extra: Any = None
    try:
        manifest = read_manifest(directory)
        cache: Dict[str, Any] = {}
        if storage_of(manifest) == STORAGE_DCP:
            dcp_job = dcp_load.prepare(directory, manifest, view, optimizer)
        else:
            view.refuse_mesh(f"load_checkpoint() of a format='pipedream' checkpoint ({directory})")
            weights = _prepare_weights(directory, manifest, view, cache)
            if optimizer is not None:
                optimizer_state = optimizer_state_for(directory, manifest, view, optimizer, cache)
        if manifest.get("extra"):
            extra = load_file(directory, manifest["extra"], "extra", "cpu")
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    gathered = collectives.gather_outcomes(
        error, view.group, view.timeout, f"loading checkpoint {directory}",
        payload={"storage": storage_of(manifest), "generation": manifest.get("generation"),
                 "directory": directory_check.describe(directory)}, failure=CheckpointError)
    directory_check.check_same(f"loading checkpoint {directory}", [e["directory"] for e in gathered],
                               "nothing was loaded")
    read = sorted({(e["generation"], e["storage"]) for e in gathered})
    if len(read) > 1:  # a save replaced the manifest while the ranks read it
        raise CheckpointError(f"loading checkpoint {directory}: the ranks read manifests of different "
                              f"generations or formats ({', '.join(f'generation {g} ({s})' for g, s in read)}); "
                              "it changed while loading (nothing was loaded)")
    if dcp_job is not None:
        weights, optimizer_state = dcp_load.read(dcp_job, view)
    reshard.copy_into_stages(view.stages, weights, strict=True)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if view.rank == 0:
        _log.info("loaded checkpoint %s (generation %s, step %s)", directory,
                  manifest.get("generation"), manifest.get("step"))
    return CheckpointInfo(path=directory, generation=int(manifest["generation"]),
                          step=manifest.get("step"), extra=extra, manifest=manifest)
