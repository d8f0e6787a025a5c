"""``save_checkpoint``: three collective phases, the manifest written last.

1. check: every rank checks its arguments, rank 0 picks the generation; an
   exchange makes a bad argument anywhere fail everywhere before anything is written;
2. write: stage leaders (replica 0) write their stages' files under new names;
3. commit: rank 0 writes ``manifest.json`` atomically, then deletes superseded files.

A crash or error at any moment leaves the previous checkpoint loadable
(docs/checkpoints.md, "Crash analysis").
"""
from __future__ import annotations

import collections
import datetime
import logging
import numbers
import os
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .._dist import collectives
from .._frontend.tied_params import alias_names
from . import durable_io, generations
from . import manifest as manifest_format
from .durable_io import PathLike
from .errors import CheckpointError
from .extra import check_extra
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointInfo
from .optimizer_state import optimizer_by_stage
from .view import Pipeline, PipelineView

__all__ = ["save_checkpoint"]

_log = logging.getLogger(__name__)


def _checked_step(step: Any) -> Optional[int]:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int or None (got {step!r})")
    return int(step)


def _prepare_directory(directory: str) -> int:
    """Rank 0: creates ``directory`` if needed; returns the new save's generation."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    return generations.next_generation(directory)


class _Start(NamedTuple):
    """What phase 1 agreed on."""

    generation: int
    step: Optional[int]
    optimizer_parts: Dict[int, Dict[str, Any]]  # this rank's optimizer state per local stage


def _agree_to_start(view: PipelineView, directory: str, optimizer: Optional[torch.optim.Optimizer],
                    step: Any, extra: Any) -> _Start:
    """Phase 1: local checks and the generation number (nothing written yet).

    Returns:
        The generation (the same on every rank), the checked step and this rank's
        optimizer state per local stage.

    Raises:
        ValueError: a bad argument on any rank, or an optimizer given on some ranks
            with parameters but not on others.
        CheckpointError: another failure on any rank.
    """
    error: Optional[BaseException] = None
    generation = 0
    optimizer_parts: Dict[int, Dict[str, Any]] = {}
    try:
        step = _checked_step(step)
        if view.rank == 0:
            check_extra(extra)
        if optimizer is not None:
            optimizer_parts = optimizer_by_stage(view, optimizer)
        if view.rank == 0:
            generation = _prepare_directory(directory)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    has_params = any(True for _ in view.module.parameters())
    gathered = collectives.gather_outcomes(
        error, view.group, view.timeout, f"saving checkpoint {directory}",
        payload={"generation": generation, "optimizer": optimizer is not None, "has_params": has_params},
        failure=CheckpointError)
    with_opt = [r for r, e in enumerate(gathered) if e["optimizer"]]
    without_opt = [r for r, e in enumerate(gathered) if e["has_params"] and not e["optimizer"]]
    if with_opt and without_opt:
        raise ValueError(f"saving checkpoint {directory}: optimizer= was given on ranks {with_opt} but "
                         f"not on ranks {without_opt}, whose stages have parameters; pass each rank's "
                         "optimizer (None only on ranks without parameters)")
    return _Start(int(gathered[0]["generation"]), step, optimizer_parts)


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
    # A traced stage is one "layer" whose tensors are matched by name alone
    # (its children are partial copies of the model's, not layers).
    children = [(f"stage{j}", "GraphModule")] if view.split_points is not None else \
        [(name, type(child).__qualname__) for name, child in module.named_children()]
    return {"stage": j, "layers": list(view.stage_layers[j]), "ranks": list(view.stage_ranks[j]),
            "layer_names": [name for name, _ in children],
            "layer_types": [kind for _, kind in children],
            "model": model, "optimizer": optim}


def _write_files(view: PipelineView, directory: str, generation: int,
                 optimizer_parts: Dict[int, Dict[str, Any]],
                 extra: Any) -> Tuple[List[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """Phase 2: stage leaders write their files under new names, rank 0 ``extra``.

    Returns:
        Every stage's record (in stage order) and ``extra``'s record, on every rank.

    Raises:
        CheckpointError: writing failed on some rank (on every rank).
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
    gathered = collectives.gather_outcomes(error, view.group, view.timeout,
                                           f"saving checkpoint {directory}",
                                           payload={"stages": records, "extra": extra_record},
                                           failure=CheckpointError)
    stages = sorted((s for entry in gathered for s in entry["stages"]), key=lambda s: s["stage"])
    return stages, gathered[0]["extra"]


def _build_manifest(view: PipelineView, generation: int, step: Optional[int],
                    stages: List[Dict[str, Any]], extra_record: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The manifest of a save from its stage records (their layer lists move to ``layers``)."""
    layers = [{"name": n, "type": t} for s in stages for n, t in zip(s["layer_names"], s["layer_types"])]
    for s in stages:
        del s["layer_names"], s["layer_types"]
    manifest: Dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "generation": generation,
        "step": step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "num_layers": len(layers),
        "layers": layers,
        "pipeline": view.describe(),
        "optimizer": next((s["optimizer"]["class"] for s in stages if s["optimizer"]), None),
        "stages": stages,
        "extra": extra_record,
    }
    if view.split_points is not None:
        manifest["split_points"] = list(view.split_points)
    return manifest


def _commit(view: PipelineView, directory: str, manifest: Dict[str, Any]) -> None:
    """Phase 3: rank 0 writes the manifest last, then removes superseded files.

    Raises:
        CheckpointError: the manifest could not be written (on every rank).
    """
    error: Optional[BaseException] = None
    stages = manifest["stages"]
    if view.rank == 0:
        try:
            if len(stages) != view.num_stages:
                raise CheckpointError(f"{directory}: got files for {len(stages)} of "
                                      f"{view.num_stages} stages")
            manifest_format.write_manifest(directory, manifest)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        else:
            keep = [s["model"]["file"] for s in stages] + \
                [s["optimizer"]["file"] for s in stages if s["optimizer"]] + \
                ([manifest["extra"]["file"]] if manifest["extra"] else [])
            generations.remove_superseded(directory, keep)
    collectives.gather_outcomes(error, view.group, view.timeout,
                                f"saving checkpoint {directory} (writing {MANIFEST})",
                                failure=CheckpointError)


def save_checkpoint(path: PathLike, pipe: Pipeline, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, extra: Any = None) -> CheckpointInfo:
    """Saves the pipeline's weights, buffers and optimizer state under ``path/``.

    Collective: every rank of the pipeline calls it with the same ``path`` (on a
    file system all ranks share). Asynchronous schedules are flushed first
    (``pipe.flush()``). Each stage's leader (replica 0) writes the stage's
    ``state_dict`` and its optimizer state keyed by the original model's names;
    once every rank reported its files, rank 0 writes ``manifest.json`` last and
    atomically, then deletes the files of older saves. A crash or error at any
    moment leaves the previous checkpoint in ``path`` loadable.

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

    Returns:
        The :class:`CheckpointInfo` of the new checkpoint (same on every rank).

    Raises:
        ValueError: a bad ``step`` or ``extra``, an optimizer holding foreign
            tensors, or an optimizer given on some ranks with parameters but not on
            others (raised on every rank, before anything is written).
        CheckpointError: writing failed on some rank, or a rank did not arrive
            within the pipeline's timeout (raised on every rank that can).
    """
    directory = os.fspath(path)
    started = time.perf_counter()
    view = pipe.checkpoint_view
    view.refuse_mesh("save_checkpoint()")
    if view.asynchronous:
        pipe.flush()
    start = _agree_to_start(view, directory, optimizer, step, extra)
    stages, extra_record = _write_files(view, directory, start.generation, start.optimizer_parts, extra)
    manifest = _build_manifest(view, start.generation, start.step, stages, extra_record)
    _commit(view, directory, manifest)
    if view.rank == 0:
        _log.info("saved checkpoint %s (generation %d, step %s, %d stages) in %.2f s",
                  directory, start.generation, start.step, len(stages), time.perf_counter() - started)
    return CheckpointInfo(path=directory, generation=start.generation, step=start.step, extra=extra,
                          manifest=manifest)
