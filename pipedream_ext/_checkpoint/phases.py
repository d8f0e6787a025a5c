"""What every checkpoint save shares, whatever format stores its tensors.

:class:`CheckpointSave` is ``save_checkpoint``'s session of the save driver
(``driver.save``, which runs the phases in order): (1) every rank checks its
arguments and prepares what it will write (the format's ``prepare_save``), rank 0
picks the generation; (2) rank 0 writes ``extra``, every rank its format's files
(``write``); (3) the records of every rank's files (``written``) and the manifest
(:func:`build_manifest`, the format's ``complete_manifest``); (4) rank 0 checks
that every rank wrote the same generation into the same directory and that it sees
every file the manifest will name, writes ``manifest.json`` atomically, then
deletes superseded files; if anything fails, rank 0 removes the new generation's
files (:func:`abandon`).
"""
from __future__ import annotations

import datetime
import logging
import numbers
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from . import durable_io, generations
from . import manifest as manifest_format
from .driver import SaveSession
from .errors import CheckpointError
from .extra import check_extra
from .manifest import FORMAT, MANIFEST, CheckpointInfo
from .optimizer_state import class_name
from .storage import CheckpointStorage, FileRecord, SaveJob
from .view import PipelineView

__all__ = ["CheckpointSave", "checked_step", "written_by", "abandon", "stage_record", "build_manifest"]

_log = logging.getLogger(__name__)


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


class CheckpointSave(SaveSession):
    """``save_checkpoint``'s session of the save driver: generation, ``extra`` and
    manifest around one format's hooks (module docstring).

    Args:
        storage: the format that writes the tensors.
        view: the pipeline.
        directory: the checkpoint directory.
        optimizer: this rank's optimizer or ``None``.
        step: the step to record.
        extra: rank 0's ``extra``.
        async_save: whether the format writes in the background.
    """

    def __init__(self, storage: CheckpointStorage, view: PipelineView, directory: str,
                 optimizer: Optional[torch.optim.Optimizer], step: Any, extra: Any, async_save: bool) -> None:
        self.storage = storage
        self.view = view
        self.directory = directory
        self.what = f"saving checkpoint {directory}"
        self.untouched = "nothing was written or deleted"
        self.committed = MANIFEST
        self.asynchronous = async_save
        self._arguments = (optimizer, step, extra)
        self._job: Optional[SaveJob] = None
        self._extra_record: Optional[Dict[str, Any]] = None
        self._manifest: Dict[str, Any] = {}
        self._files: List[FileRecord] = []
        self._keep: List[str] = []
        self._writers: List[Mapping[str, Any]] = []
        self._started = time.perf_counter()

    @property
    def job(self) -> SaveJob:
        """What the format's hooks see (set once the ranks agreed)."""
        assert self._job is not None, "the ranks have not agreed yet"
        return self._job

    def plan(self) -> Dict[str, Any]:
        optimizer, step, extra = self._arguments
        has_params = any(True for _ in self.view.module.parameters())
        self._job = SaveJob(self.view, self.directory, 0, checked_step(step), optimizer, None, self.asynchronous)
        if self.view.rank == 0:
            check_extra(extra)
        self._job.prepared = self.storage.prepare_save(self.view, optimizer)
        generation = _new_generation(self.directory) if self.view.rank == 0 else 0
        return {"generation": generation, "optimizer": optimizer is not None, "has_params": has_params}

    def agreed(self, gathered: List[Dict[str, Any]]) -> None:
        with_opt = [r for r, e in enumerate(gathered) if e["optimizer"]]
        without_opt = [r for r, e in enumerate(gathered) if e["has_params"] and not e["optimizer"]]
        if with_opt and without_opt:
            raise ValueError(f"saving checkpoint {self.directory}: optimizer= was given on ranks {with_opt} "
                             f"but not on ranks {without_opt}, whose stages have parameters; pass each "
                             "rank's optimizer (None only on ranks without parameters)")
        self.generation = self.job.generation = int(gathered[0]["generation"])

    def write(self) -> Any:
        """Rank 0's ``extra``, then the format's files: the format writes even where
        ``extra`` failed, as its write may be collective (DCP's)."""
        error: Optional[BaseException] = None
        extra = self._arguments[2]
        try:
            os.makedirs(self.directory, exist_ok=True)
            if self.view.rank == 0 and extra is not None:
                self._extra_record = durable_io.atomic_torch_save(
                    extra, self.directory, generations.extra_file(self.generation))
        except Exception as exc:  # noqa: BLE001 - raised after the format's write
            error = exc
        try:
            handle = self.storage.write(self.job)
        except Exception as exc:  # noqa: BLE001 - the first error is reported
            error = error or exc
        if error is not None:
            raise error
        return handle

    def written(self, handle: Any) -> Dict[str, Any]:
        own = self.storage.written(self.job, handle)
        optimizer = self._arguments[0]
        stages = [dict(stage_record(self.view, j), **own.stages.get(j, {}))
                  for j in sorted(self.view.stages) if self.view.is_leader(j)]
        return {"stages": stages, "extra": self._extra_record, "format": own.payload,
                "optimizer": class_name(optimizer) if optimizer is not None else None,
                "written": written_by(self.directory, self.generation)}

    def collect(self, gathered: List[Any]) -> None:
        stages = sorted((s for entry in gathered for s in entry["stages"]), key=lambda s: s["stage"])
        optimizer_class = next((e["optimizer"] for e in gathered if e["optimizer"]), None)
        manifest = build_manifest(self.view, self.generation, self.job.step, stages, gathered[0]["extra"],
                                  self.storage, optimizer_class)
        files, keep = self.storage.complete_manifest(self.job, manifest, [e["format"] for e in gathered])
        if manifest["extra"]:
            files.append(("", manifest["extra"], "extra"))
            keep.append(manifest["extra"]["file"])
        self._manifest, self._files, self._keep = manifest, files, keep
        self._writers = [entry["written"] for entry in gathered]

    def commit(self) -> None:
        _check_writers(self.directory, self.generation, self._writers)
        stages = self._manifest["stages"]
        if len(stages) != self.view.num_stages:
            raise CheckpointError(f"{self.directory}: got files for {len(stages)} of "
                                  f"{self.view.num_stages} stages")
        _check_visible(self.directory, self._files)
        manifest_format.write_manifest(self.directory, self._manifest)
        generations.remove_superseded(self.directory, self._keep)

    def abandon(self) -> None:
        abandon(self.view, self.directory, self.generation)

    def result(self) -> CheckpointInfo:
        if self.view.rank == 0:
            _log.info("saved checkpoint %s (format %r, generation %d, step %s) in %.2f s", self.directory,
                      self.storage.name, self.generation, self.job.step, time.perf_counter() - self._started)
        return CheckpointInfo(path=self.directory, generation=self.generation, step=self.job.step,
                              extra=self._arguments[2], manifest=self._manifest)
