"""``load_checkpoint``: restore a checkpoint into any balance, replica layout or world size.

The manifest names the storage (``storages.storage_of``), which checks and reads:
each rank gathers its stages' tensors by name (:mod:`.reshard`) from whichever
stage files of the checkpoint hold them, checking every file against the
manifest (:mod:`.stage_files_load`), or (a DCP checkpoint, :mod:`.dcp_load`) asks
DCP for them by name; nothing changes unless every rank succeeded.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

import torch

from .._dist import collectives
from . import copies, reshard
from . import directory as directory_check
from .dcp import save as dcp_save
from .durable_io import PathLike
from .errors import CheckpointError
from .manifest import CheckpointInfo, load_file
from .storage import PreparedLoad
from .storages import read_manifest, storage_name, storage_of
from .view import Pipeline

__all__ = ["load_checkpoint"]

_log = logging.getLogger(__name__)


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
            parameter; or copies of one tensor (tied, replicated over dp or tp) would
            differ (``copies.check_copies``).
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
    prepared: Optional[PreparedLoad] = None
    extra: Any = None
    try:
        manifest = read_manifest(directory)
        prepared = storage_of(manifest).prepare_load(directory, manifest, view, optimizer)
        if manifest.get("extra"):
            extra = load_file(directory, manifest["extra"], "extra", "cpu")
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    gathered = collectives.gather_outcomes(
        error, view.group, view.timeout, f"loading checkpoint {directory}",
        payload={"storage": storage_name(manifest), "generation": manifest.get("generation"),
                 "directory": directory_check.describe(directory)}, failure=CheckpointError)
    directory_check.check_same(f"loading checkpoint {directory}", [e["directory"] for e in gathered],
                               "nothing was loaded")
    read = sorted({(e["generation"], e["storage"]) for e in gathered})
    if len(read) > 1:  # a save replaced the manifest while the ranks read it
        raise CheckpointError(f"loading checkpoint {directory}: the ranks read manifests of different "
                              f"generations or formats ({', '.join(f'generation {g} ({s})' for g, s in read)}); "
                              "it changed while loading (nothing was loaded)")
    assert prepared is not None  # every rank prepared, or the exchange raised
    weights, optimizer_state = prepared.read(view)
    copies.check_copies(view, weights, f"loading checkpoint {directory}", CheckpointError)
    reshard.copy_into_stages(view.stages, weights, strict=True)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if view.rank == 0:
        _log.info("loaded checkpoint %s (generation %s, step %s)", directory,
                  manifest.get("generation"), manifest.get("step"))
    return CheckpointInfo(path=directory, generation=int(manifest["generation"]),
                          step=manifest.get("step"), extra=extra, manifest=manifest)
