"""``load_checkpoint``: restore a checkpoint into any balance, replica layout or world size.

After the pending save and the flush, the load driver (``driver.load``) reads the
manifest, which names the format (``storages.open_manifest``), whose
``prepare_load`` checks: each rank gathers its stages' tensors by name
(:mod:`.reshard`) from whichever stage files of the checkpoint hold them, checking
every file against the manifest (``stage_files.load``), or (a DCP checkpoint,
``dcp.load``) asks DCP for them by name; nothing changes unless every rank succeeded.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import driver
from .durable_io import PathLike
from .manifest import CheckpointInfo
from .pending import finish_pending
from .storages import open_manifest, storage_name
from .view import Pipeline

__all__ = ["load_checkpoint"]


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
    finish_pending(view)
    if view.asynchronous:
        pipe.flush()
    return driver.load(directory, view, optimizer, open_manifest, storage_name)
