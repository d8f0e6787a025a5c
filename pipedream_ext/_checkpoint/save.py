"""``save_checkpoint``: the format's row, then the save driver's phases.

The format named by ``format=`` (``storages.STORAGES``) answers the hooks that
``driver.save`` calls over a ``phases.CheckpointSave``: (1) agree: every rank
checks its arguments and its directory, rank 0 picks the generation; an exchange
makes a bad argument anywhere fail everywhere before anything is written; (2)
write: rank 0 writes ``extra``, then stage leaders (replica 0) write their
stages' files (``"pipedream"``), or every rank its part of one DCP directory
(``"dcp"``); (3) gather: every rank's file records, the manifest; (4) commit: rank
0 checks the writes, writes ``manifest.json`` atomically, then deletes superseded
files; a failure anywhere removes the new generation's files.

A crash or error at any moment leaves the previous checkpoint loadable
(docs/checkpoints.md, "Crash analysis").
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

from . import driver, storages
from .durable_io import PathLike
from .manifest import CheckpointInfo
from .pending import PendingCheckpoint, finish_pending
from .phases import CheckpointSave
from .storage import CheckpointStorage
from .storages import DEFAULT, STORAGES
from .view import Pipeline

__all__ = ["save_checkpoint"]


def _storage_for(format: Any, async_save: Any) -> CheckpointStorage:
    """The storage ``format`` names, checked against ``async_save``.

    Raises:
        ValueError: an unknown format, or ``async_save`` not a bool or not supported.
    """
    storage = storages.storage_named(format)
    if not isinstance(async_save, bool):
        raise ValueError(f"async_save must be True or False (got {async_save!r})")
    if async_save and not storage.asynchronous:
        capable = " or ".join(f"format={s.name!r}" for s in STORAGES.values() if s.asynchronous)
        raise ValueError(f"async_save=True needs {capable} (torch.distributed.checkpoint's "
                         f"async_save); the {storage.name!r} format saves synchronously")
    return storage


def save_checkpoint(path: PathLike, pipe: Pipeline, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, extra: Any = None, format: str = DEFAULT,
                    async_save: bool = False) -> Union[CheckpointInfo, PendingCheckpoint]:
    """Saves the pipeline's weights, buffers and optimizer state under ``path/``.

    Collective: every rank of the pipeline calls it with the same ``path`` (on a
    file system all ranks share; checked: the path each rank resolves must be the
    same, and rank 0 must see every file the others wrote). An asynchronous save still in progress on this
    pipeline's ranks is finished first, and asynchronous schedules are flushed
    (``pipe.flush()``). Everything is keyed by the original model's names and
    written by one replica of each stage; once every rank reported its part,
    rank 0 writes ``manifest.json`` last and atomically, then deletes the files of
    older saves. A crash or error at any moment leaves the previous checkpoint in
    ``path`` loadable.

    Args:
        path: the checkpoint directory (created if needed; an existing checkpoint
            there is replaced once the new one is complete).
        pipe: the pipeline.
        optimizer: this rank's optimizer (``None`` on ranks whose stages have no
            parameters; given on one rank with parameters, it must be given on all).
            Its per-parameter state and its param-group hyperparameters (``lr``,
            ``initial_lr`` of LR schedulers, ...) are saved.
        step: a step counter to store in the manifest (e.g. the number of batches done).
        extra: anything else to keep, from rank 0: dicts, lists, tuples, str,
            numbers, ``None`` and tensors, e.g. ``{"scheduler": sched.state_dict()}``.
        format: the storage (``FORMATS``): ``"pipedream"`` (one ``torch.save`` file
            per stage, sha256-checked) or ``"dcp"`` (one torch.distributed.checkpoint
            directory, which DCP's own tools read and re-shard; docs/checkpoints.md
            says when to choose which).
        async_save: with ``format="dcp"``: copy the state to CPU memory, write it in
            a background thread and return at once; the manifest is written by the
            returned handle's ``result()`` (collective), by the next
            ``save_checkpoint`` or ``load_checkpoint``, or by ``pipe.close()``.

    Returns:
        The :class:`CheckpointInfo` of the new checkpoint (same on every rank), or
        with ``async_save=True`` a :class:`PendingCheckpoint` whose ``result()``
        returns it.

    Raises:
        ValueError: a bad ``step``, ``extra``, ``format`` or ``async_save``, an
            optimizer holding foreign tensors, an optimizer given on some ranks
            with parameters but not on others, or a ``path`` that resolves to
            another directory on some rank (raised on every rank, before anything
            is written).
        CheckpointError: writing failed on some rank, a rank did not arrive within
            the pipeline's timeout, or the previous asynchronous save failed
            (raised on every rank that can). The previous checkpoint in ``path``
            is kept, and the failed save's own files are removed.
    """
    storage = _storage_for(format, async_save)
    directory = os.fspath(path)
    view = pipe.checkpoint_view
    storage.check_pipeline(view)
    finish_pending(view)
    if view.asynchronous:
        pipe.flush()
    return driver.save(CheckpointSave(storage, view, directory, optimizer, step, extra, async_save))
