"""The interface every checkpoint format implements: the hooks the driver calls.

``save_checkpoint``, ``load_checkpoint``, ``save_pretrained`` and ``consolidate``
do what every format shares: the driver (``driver.py``) runs the collective
sequence (agree, write, gather, commit; and load's), and asks a
:class:`CheckpointStorage` taken from one table by name (``storages.py``) only
what differs: how its files are written, described, read and merged. The
manifest (``manifest.json``, written last) is the entry point of every
checkpoint format; the driver builds and commits it (``phases.CheckpointSave``).

A new format is one subclass plus one row in ``storages.STORAGES``.
"""
from __future__ import annotations

import abc
import collections
import dataclasses
from typing import Any, ClassVar, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from .reshard import IncompatibleKeys, StageStates
from .view import Pipeline, PipelineView

__all__ = ["CheckpointStorage", "PreparedLoad", "SaveJob", "Written", "FileRecord"]

#: A file a manifest names: (its folder inside the checkpoint directory, its record
#: with ``file`` and ``bytes``, what it holds).
FileRecord = Tuple[str, Mapping[str, Any], str]


@dataclasses.dataclass
class SaveJob:
    """One ``save_checkpoint`` call, as a format's save hooks see it.

    Attributes:
        view: the pipeline.
        directory: the checkpoint directory.
        generation: the new generation (agreed by every rank).
        step: the checked step.
        optimizer: this rank's optimizer or ``None``.
        prepared: what this rank's :meth:`CheckpointStorage.prepare_save` returned.
        async_save: whether the write goes on in the background.
    """

    view: PipelineView
    directory: str
    generation: int
    step: Optional[int]
    optimizer: Optional[torch.optim.Optimizer]
    prepared: Any
    async_save: bool


class Written(NamedTuple):
    """What one rank's write reports (:meth:`CheckpointStorage.written`).

    Attributes:
        stages: local stage ``j`` -> fields added to its manifest record (the stages
            this rank leads; ``{}`` when the format records nothing per stage).
        payload: the format's own JSON record of this rank's files, gathered from
            every rank for :meth:`CheckpointStorage.complete_manifest`.
    """

    stages: Dict[int, Dict[str, Any]]
    payload: Dict[str, Any]


class PreparedLoad(abc.ABC):
    """A load one storage checked on this rank (before the ranks agreed to go on)."""

    @abc.abstractmethod
    def read(self, view: PipelineView) -> Tuple[StageStates, Optional[Dict[str, Any]]]:
        """Reads what was prepared; called on every rank once every rank prepared
        (collective where the storage needs the other ranks).

        Returns:
            Each local stage's state dict and the optimizer's ``state_dict``
            (``None`` without an optimizer), for ``load_checkpoint`` to copy in.

        Raises:
            CheckpointError: reading failed on some rank (on every rank; nothing changed).
        """


class CheckpointStorage:
    """One format of the table: the hooks the driver calls, each format the ones it has.

    A checkpoint format (``checkpoints``: ``save_checkpoint(format=...)``, a
    manifest's ``storage``) answers the save hooks, in this order (``driver.save``):
    :meth:`check_pipeline`, :meth:`prepare_save` (phase 1, agree), :meth:`write`
    (phase 2, after rank 0 wrote ``extra``), :meth:`written` (phase 3, once this
    rank's write finished; then the exchange), :meth:`complete_manifest` (phase 4,
    before rank 0 commits); and the load hooks :meth:`check_manifest` (reading the
    manifest), :meth:`prepare_load` (before the exchange) and
    :meth:`consolidate`. A weights format (Hugging Face, ``torch.save`` files)
    answers :meth:`holds` (``detect``) and :meth:`load_path`
    (``pipe.load_state_dict(path)``), and may answer :meth:`write_state_dict`
    (``consolidate(format=...)``); the Hugging Face format's ``save_pretrained``
    runs the save driver with a session of its own (``hf.save.HfSave``).
    A hook a format does not answer raises ``NotImplementedError``.

    Attributes:
        name: its ``format=`` value (a checkpoint's: also the manifest's ``storage``).
        manifest_version: the manifest ``version`` it writes (the oldest
            pipedream_ext able to read it).
        asynchronous: whether it supports ``save_checkpoint(..., async_save=True)``.
        checkpoints: whether it is a checkpoint format (a manifest lists its files).
        writes_state_dicts: whether it answers :meth:`write_state_dict`.
        looks_like: how ``detect``'s message describes a path of a weights format.
    """

    name: ClassVar[str]
    manifest_version: ClassVar[int] = 0
    asynchronous: ClassVar[bool] = False
    checkpoints: ClassVar[bool] = True
    writes_state_dicts: ClassVar[bool] = False
    looks_like: ClassVar[str] = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def _unanswered(self, hook: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name!r} format has no {hook}()")

    # -- saving a checkpoint (driver.save), in call order -------------------------

    def check_pipeline(self, view: PipelineView) -> None:
        """Refuses a pipeline this storage cannot save, before anything else happens
        (no pending save finished, no flush).

        Raises:
            ValueError: the pipeline's layout is not supported.
        """
        return None  # every layout, unless a storage says otherwise

    def prepare_save(self, view: PipelineView, optimizer: Optional[torch.optim.Optimizer]) -> Any:
        """Phase 1 (local, before the ranks agree): what this rank will write.

        Returns:
            Anything; :meth:`write` finds it as ``job.prepared``.

        Raises:
            ValueError: the optimizer holds tensors that are not this rank's parameters.
        """
        raise self._unanswered("prepare_save")

    def write(self, job: SaveJob) -> Any:
        """Phase 2 (every rank, even where an earlier part failed: a format's write may
        be collective): this rank's files of ``job.generation`` under new names.

        Returns:
            A handle for :meth:`written` (with ``job.async_save``: the write going on
            in the background).

        Raises:
            Exception: writing failed (reported to every rank; the generation's files
                are removed).
        """
        raise self._unanswered("write")

    def written(self, job: SaveJob, handle: Any) -> Written:
        """Phase 3 (local; after an asynchronous write, when the save is finished):
        waits for this rank's write and describes its files.

        Raises:
            Exception: the write failed (reported to every rank).
        """
        raise self._unanswered("written")

    def complete_manifest(self, job: SaveJob, manifest: Dict[str, Any],
                          gathered: Sequence[Dict[str, Any]]) -> Tuple[List[FileRecord], List[str]]:
        """Phase 4 (every rank, before rank 0 commits): adds the format's fields to
        ``manifest`` from every rank's :attr:`Written.payload`.

        Returns:
            The files the manifest names (rank 0 checks it sees them) and the names
            to keep in the directory (everything else of ours goes), ``extra`` aside.
        """
        raise self._unanswered("complete_manifest")

    # -- loading a checkpoint (driver.load) --------------------------------------

    def check_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Checks this storage's fields of a manifest (``read_manifest`` checks the rest).

        Raises:
            KeyError, TypeError, ValueError: a field is missing or malformed
                (``read_manifest`` names the manifest).
        """
        raise self._unanswered("check_manifest")

    def prepare_load(self, directory: str, manifest: Mapping[str, Any], view: PipelineView,
                     optimizer: Optional[torch.optim.Optimizer]) -> PreparedLoad:
        """This rank's checks of a checkpoint of this storage against the pipeline
        (local: the driver exchanges the outcome before anything is read in).

        Raises:
            CheckpointError: a missing, truncated or corrupt file, another model or
                another optimizer.
            ValueError: the optimizer holds tensors that are not this rank's
                parameters, or the pipeline's layout is not supported.
        """
        raise self._unanswered("prepare_load")

    def consolidate(self, directory: str, manifest: Mapping[str, Any]
                    ) -> "collections.OrderedDict[str, torch.Tensor]":
        """The whole model's ``state_dict`` in layer order, on the CPU, in one process.

        Raises:
            CheckpointError: a missing, truncated or corrupt file, or tensors that
                differ from the manifest.
        """
        raise self._unanswered("consolidate")

    # -- weights formats -----------------------------------------------------------

    def holds(self, path: str) -> bool:
        """Whether ``path`` is of this weights format (``detect``)."""
        return False

    def load_path(self, pipe: Pipeline, path: str, strict: bool) -> IncompatibleKeys:
        """``pipe.load_state_dict(path)`` of a path this format :meth:`holds`."""
        raise self._unanswered("load_path")

    def write_state_dict(self, state_dict: Mapping[str, torch.Tensor], out_dir: str,
                         config: Any = None) -> Dict[str, str]:
        """A whole state dict into ``out_dir``, in this process (``consolidate(format=...)``).

        Returns:
            Tensor name -> the file holding it.
        """
        raise self._unanswered("write_state_dict")
