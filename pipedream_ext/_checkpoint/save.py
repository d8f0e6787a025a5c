"""``save_checkpoint``: three collective phases, the manifest written last.

1. check (``phases.agree_to_start``): every rank checks its arguments and its
   directory, rank 0 picks the generation; an exchange makes a bad argument
   anywhere fail everywhere before anything is written;
2. write: stage leaders (replica 0) write their stages' files under new names
   (here), or every rank writes its part of one DCP directory (``dcp_save``); a
   failure anywhere removes the new generation's files;
3. commit (``phases.commit``): rank 0 checks the writes, writes ``manifest.json``
   atomically, then deletes superseded files.

A crash or error at any moment leaves the previous checkpoint loadable
(docs/checkpoints.md, "Crash analysis").
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .._dist import collectives
from .._frontend.tied_params import alias_names
from . import dcp_save, durable_io, generations, phases
from .dcp_save import PendingCheckpoint
from .durable_io import PathLike
from .errors import CheckpointError
from .manifest import STORAGE_DCP, STORAGE_PIPEDREAM, CheckpointInfo
from .optimizer_state import optimizer_by_stage
from .view import Pipeline, PipelineView

__all__ = ["save_checkpoint", "FORMATS"]

_log = logging.getLogger(__name__)

#: The values of ``save_checkpoint(format=...)``.
FORMATS = (STORAGE_PIPEDREAM, STORAGE_DCP)


def _describe(t: torch.Tensor) -> Dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def _write_stage(view: PipelineView, j: int, directory: str, generation: int,
                 optimizer_part: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Writes local stage ``j``'s weights (and optimizer) file; returns its record."""
    module = view.stages[j]
    aliases = alias_names(view.shared_parameters, stage=j)
    state = module.state_dict()  # detached views, no copies
    # A name of a parameter shared with an earlier stage is listed with the
    # name it is stored under ("same_as"), not stored again.
    stored = collections.OrderedDict((k, v) for k, v in state.items() if k not in aliases)
    model = durable_io.atomic_torch_save(stored, directory, generations.model_file(generation, j))
    model["tensors"] = {k: dict(_describe(v), same_as=aliases[k]) if k in aliases
                        else _describe(v) for k, v in state.items()}
    optim = None
    if optimizer_part is not None:
        optim = durable_io.atomic_torch_save(optimizer_part, directory,
                                             generations.optimizer_file(generation, j))
        optim["class"] = optimizer_part["class"]
        held = {n for g in optimizer_part["param_groups"] for n in g["params"]}
        optim["params"] = [n for n, _ in module.named_parameters() if n in held]
    return dict(phases.stage_record(view, j), model=model, optimizer=optim)


def _write_files(view: PipelineView, directory: str, generation: int,
                 optimizer_parts: Dict[int, Dict[str, Any]],
                 extra: Any) -> Tuple[List[Dict[str, Any]], Optional[Dict[str, Any]], List[Dict[str, Any]]]:
    """Phase 2: stage leaders write their files under new names, rank 0 ``extra``.

    Returns:
        Every stage's record (in stage order), ``extra``'s record and every rank's
        ``phases.written_by``, on every rank.

    Raises:
        CheckpointError: writing failed on some rank (on every rank); rank 0 removed
            the new generation's files.
    """
    error: Optional[BaseException] = None
    records: List[Dict[str, Any]] = []
    extra_record: Optional[Dict[str, Any]] = None
    try:
        os.makedirs(directory, exist_ok=True)
        for j in view.stages:
            if view.is_leader(j):  # replicas hold the leader's weights
                records.append(_write_stage(view, j, directory, generation, optimizer_parts.get(j)))
        if view.rank == 0 and extra is not None:
            extra_record = durable_io.atomic_torch_save(extra, directory,
                                                        generations.extra_file(generation))
        durable_io.fsync_directory(directory)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    try:
        gathered = collectives.gather_outcomes(
            error, view.group, view.timeout, f"saving checkpoint {directory}",
            payload={"stages": records, "extra": extra_record,
                     "written": phases.written_by(directory, generation)},
            failure=CheckpointError)
    except BaseException:
        phases.abandon(view, directory, generation)
        raise
    stages = sorted((s for entry in gathered for s in entry["stages"]), key=lambda s: s["stage"])
    return stages, gathered[0]["extra"], [entry["written"] for entry in gathered]


def _save_files(view: PipelineView, directory: str, optimizer: Optional[torch.optim.Optimizer],
                step: Any, extra: Any) -> CheckpointInfo:
    """The per-stage-files format: check, write, commit."""
    start = phases.agree_to_start(view, directory, optimizer, step, extra,
                                  lambda: optimizer_by_stage(view, optimizer) if optimizer is not None else {})
    stages, extra_record, writers = _write_files(view, directory, start.generation, start.prepared, extra)
    manifest = phases.build_manifest(view, start.generation, start.step, stages, extra_record,
                                     STORAGE_PIPEDREAM,
                                     next((s["optimizer"]["class"] for s in stages if s["optimizer"]), None))
    files: List[phases.FileRecord] = [("", s["model"], f"weights of stage {s['stage']}") for s in stages]
    files += [("", s["optimizer"], f"optimizer state of stage {s['stage']}") for s in stages if s["optimizer"]]
    files += [("", manifest["extra"], "extra")] if manifest["extra"] else []
    phases.commit(view, directory, manifest, [record["file"] for _, record, _ in files], files, writers)
    return CheckpointInfo(path=directory, generation=start.generation, step=start.step, extra=extra,
                          manifest=manifest)


def _check_format(format: Any, async_save: Any) -> None:
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not a checkpoint format; use "
                         f"{' or '.join(repr(f) for f in FORMATS)}")
    if not isinstance(async_save, bool):
        raise ValueError(f"async_save must be True or False (got {async_save!r})")
    if async_save and format != STORAGE_DCP:
        raise ValueError("async_save=True needs format='dcp' (torch.distributed.checkpoint's "
                         "async_save); the 'pipedream' format saves synchronously")


def save_checkpoint(path: PathLike, pipe: Pipeline, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, extra: Any = None, format: str = STORAGE_PIPEDREAM,
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
        format: ``"pipedream"`` (one ``torch.save`` file per stage, sha256-checked)
            or ``"dcp"`` (one torch.distributed.checkpoint directory, which DCP's
            own tools read and re-shard; docs/checkpoints.md says when to choose which).
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
    _check_format(format, async_save)
    directory = os.fspath(path)
    started = time.perf_counter()
    view = pipe.checkpoint_view
    if format != STORAGE_DCP:
        view.refuse_mesh("save_checkpoint(format='pipedream')")
    dcp_save.finish_pending(view)
    if view.asynchronous:
        pipe.flush()
    if format == STORAGE_DCP:
        return dcp_save.save_dcp(view, directory, optimizer, step, extra, async_save)
    info = _save_files(view, directory, optimizer, step, extra)
    if view.rank == 0:
        _log.info("saved checkpoint %s (generation %d, step %s, %d stages) in %.2f s",
                  directory, info.generation, info.step, len(info.manifest["stages"]),
                  time.perf_counter() - started)
    return info
