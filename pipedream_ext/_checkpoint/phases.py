"""What every save shares, whatever stores its tensors: the first and last phases.

1. :func:`agree_to_start`: every rank checks its arguments and prepares what it
   will write, rank 0 picks the generation; one exchange makes a bad argument
   anywhere fail everywhere before anything is written, and checks that every rank
   means the same directory (``directory.check_same``);
2. (the storage's own writing, ``storage.CheckpointStorage.save``: ``stage_files.py``
   per-stage files, ``dcp_save.py`` DCP);
   if it fails anywhere, rank 0 removes the new generation's files
   (:func:`abandon`);
3. :func:`commit`: rank 0 checks that every rank wrote the same generation into
   the same directory and that it sees every file the manifest will name, writes
   ``manifest.json`` atomically, then deletes superseded files; one exchange makes
   every rank return or raise together.

Also the manifest's common fields (:func:`build_manifest`) from the stage records
(:func:`stage_record`) the writing phase gathered.
"""
from __future__ import annotations

import datetime
import numbers
import os
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from .._dist import collectives
from . import directory as directory_check
from . import generations
from . import manifest as manifest_format
from .errors import CheckpointError
from .extra import check_extra
from .manifest import FORMAT, MANIFEST
from .storage import CheckpointStorage
from .view import PipelineView

__all__ = ["Start", "checked_step", "agree_to_start", "written_by", "abandon", "stage_record",
           "build_manifest", "commit"]

#: A file the manifest will name: (its folder inside the checkpoint directory, its
#: record with ``file`` and ``bytes``, what it holds).
FileRecord = Tuple[str, Mapping[str, Any], str]


def checked_step(step: Any) -> Optional[int]:
    """``step`` as an int (or ``None``).

    Raises:
        ValueError: a negative number, a bool or another type.
    """
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int or None (got {step!r})")
    return int(step)


def _new_generation(directory: str) -> int:
    """Rank 0: the new save's generation (nothing is created before the ranks agreed;
    the writing phase creates ``directory``)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} exists and is not a directory")
    return generations.next_generation(directory) if os.path.isdir(directory) else 1


class Start(NamedTuple):
    """What phase 1 agreed on."""

    generation: int
    step: Optional[int]
    prepared: Any  # what this rank's ``prepare`` returned


def agree_to_start(view: PipelineView, directory: str, optimizer: Optional[torch.optim.Optimizer],
                   step: Any, extra: Any, prepare: Callable[[], Any]) -> Start:
    """Phase 1: local checks, this rank's preparation and the generation (nothing written yet).

    Args:
        view: the pipeline.
        directory: the checkpoint directory.
        optimizer: this rank's optimizer or ``None``.
        step: the step to record.
        extra: rank 0's ``extra``.
        prepare: builds what this rank will write (raises ``ValueError`` for an
            optimizer holding foreign tensors).

    Returns:
        The generation (the same on every rank), the checked step and ``prepare()``.

    Raises:
        ValueError: a bad argument on any rank, an optimizer given on some ranks
            with parameters but not on others, or ranks given different directories.
        CheckpointError: another failure on any rank.
    """
    error: Optional[BaseException] = None
    generation = 0
    prepared: Any = None
    try:
        step = checked_step(step)
        if view.rank == 0:
            check_extra(extra)
        prepared = prepare()
        if view.rank == 0:
            generation = _new_generation(directory)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    has_params = any(True for _ in view.module.parameters())
    gathered = collectives.gather_outcomes(
        error, view.group, view.timeout, f"saving checkpoint {directory}",
        payload={"generation": generation, "optimizer": optimizer is not None, "has_params": has_params,
                 "directory": directory_check.describe(directory)},
        failure=CheckpointError)
    directory_check.check_same(f"saving checkpoint {directory}", [e["directory"] for e in gathered],
                               "nothing was written or deleted")
    with_opt = [r for r, e in enumerate(gathered) if e["optimizer"]]
    without_opt = [r for r, e in enumerate(gathered) if e["has_params"] and not e["optimizer"]]
    if with_opt and without_opt:
        raise ValueError(f"saving checkpoint {directory}: optimizer= was given on ranks {with_opt} but "
                         f"not on ranks {without_opt}, whose stages have parameters; pass each rank's "
                         "optimizer (None only on ranks without parameters)")
    return Start(int(gathered[0]["generation"]), step, prepared)


def written_by(directory: str, generation: int) -> Dict[str, Any]:
    """What a rank reports with its writing phase's outcome: where it wrote, which generation."""
    return {"resolved": os.path.realpath(directory), "generation": generation}


def abandon(view: PipelineView, directory: str, generation: int) -> None:
    """After a failed writing phase or commit: rank 0 removes ``generation``'s files.

    Only rank 0, which alone writes manifests, knows that no manifest will name this
    generation, whatever the other ranks saw (a rank that timed out waiting cannot
    tell whether rank 0 went on); see ``generations.remove_generation``.
    """
    if view.rank == 0:
        generations.remove_generation(directory, generation)


def stage_record(view: PipelineView, j: int) -> Dict[str, Any]:
    """Local stage ``j``'s manifest record: layer range, ranks, and its layers'
    names and classes (moved to the manifest's ``layers`` by :func:`build_manifest`)."""
    module = view.stages[j]
    # A traced stage is one "layer" whose tensors are matched by name alone
    # (its children are partial copies of the model's, not layers).
    children = [(f"stage{j}", "GraphModule")] if view.split_points is not None else \
        [(name, manifest_format.layer_type(child)) for name, child in module.named_children()]
    return {"stage": j, "layers": list(view.stage_layers[j]), "ranks": list(view.stage_ranks[j]),
            "layer_names": [name for name, _ in children],
            "layer_types": [kind for _, kind in children]}


def build_manifest(view: PipelineView, generation: int, step: Optional[int],
                   stages: List[Dict[str, Any]], extra_record: Optional[Dict[str, Any]],
                   storage: CheckpointStorage, optimizer_class: Optional[str]) -> Dict[str, Any]:
    """The manifest of a save from its stage records (their layer lists move to ``layers``).

    Args:
        view: the pipeline.
        generation: the save's generation.
        step: the checked step.
        stages: every stage's record (:func:`stage_record` and the storage's fields), in order.
        extra_record: ``extra``'s file record, or ``None``.
        storage: the storage that wrote the files (sets ``storage`` and ``version``).
        optimizer_class: the saved optimizer's class, or ``None``.

    Returns:
        The manifest; the storage adds its own fields.
    """
    layers = [{"name": n, "type": t} for s in stages for n, t in zip(s["layer_names"], s["layer_types"])]
    for s in stages:
        del s["layer_names"], s["layer_types"]
    manifest: Dict[str, Any] = {
        "format": FORMAT,
        "version": storage.manifest_version,
        "storage": storage.name,
        "generation": generation,
        "step": step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "num_layers": len(layers),
        "layers": layers,
        "pipeline": view.describe(),
        "optimizer": optimizer_class,
        "stages": stages,
        "extra": extra_record,
    }
    if view.split_points is not None:
        manifest["split_points"] = list(view.split_points)
    return manifest


def _check_writers(directory: str, generation: int, writers: Sequence[Mapping[str, Any]]) -> None:
    """Rank 0: every rank wrote ``generation`` into ``directory`` (agreed in phase 1;
    checked again before anything is deleted)."""
    mine = written_by(directory, generation)
    others = [(r, w) for r, w in enumerate(writers) if dict(w) != mine]
    if others:
        described = "; ".join(f"rank {r}: generation {w['generation']} in {w['resolved']}" for r, w in others)
        raise CheckpointError(f"{directory}: the ranks did not all write generation {generation} into "
                              f"{mine['resolved']} ({described}); the manifest was not written and the "
                              "previous checkpoint was kept")


def _check_visible(directory: str, files: Sequence[FileRecord]) -> None:
    """Rank 0: every file the manifest will name is in ``directory`` as its writer
    reported it (a rank that wrote elsewhere, or a file system not shared)."""
    for folder, record, what in files:
        name = os.path.join(folder, str(record["file"]))
        full = os.path.join(directory, name)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size != record["bytes"]:
            seen = "is missing" if size is None else f"has {size} bytes, not {record['bytes']}"
            raise CheckpointError(f"{directory}: {name} ({what}) {seen} on rank 0, which writes the "
                                  "manifest: the ranks wrote into different directories, or the "
                                  "directory is not on a file system all ranks share; the manifest "
                                  "was not written and the previous checkpoint was kept")


def commit(view: PipelineView, directory: str, manifest: Dict[str, Any], keep: Sequence[str],
           files: Sequence[FileRecord], writers: Sequence[Mapping[str, Any]]) -> None:
    """Phase 3: rank 0 checks the writes, writes the manifest last, then removes
    superseded files; if it cannot, it removes the new generation's files instead.

    Args:
        view: the pipeline.
        directory: the checkpoint directory.
        manifest: the new manifest.
        keep: the files and directories it names (everything else of ours goes).
        files: every file it names, with its record (rank 0 checks it sees them).
        writers: every rank's :func:`written_by`, from the writing phase's exchange.

    Raises:
        CheckpointError: the writes do not check out or the manifest could not be
            written (on every rank); the previous checkpoint is kept.
    """
    error: Optional[BaseException] = None
    stages = manifest["stages"]
    generation = int(manifest["generation"])
    if view.rank == 0:
        try:
            _check_writers(directory, generation, writers)
            if len(stages) != view.num_stages:
                raise CheckpointError(f"{directory}: got files for {len(stages)} of "
                                      f"{view.num_stages} stages")
            _check_visible(directory, files)
            manifest_format.write_manifest(directory, manifest)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
            abandon(view, directory, generation)
        else:
            generations.remove_superseded(directory, keep)
    collectives.gather_outcomes(error, view.group, view.timeout,
                                f"saving checkpoint {directory} (writing {MANIFEST})",
                                failure=CheckpointError)
