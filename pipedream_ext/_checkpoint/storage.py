"""The interface every checkpoint storage implements: how one format stores its tensors.

``save_checkpoint``, ``load_checkpoint`` and ``consolidate`` do what every format
shares (arguments, the directory every rank means, finishing a pending save, the
exchanges that make the ranks succeed or fail together) and hand the tensors to a
:class:`CheckpointStorage` taken from one table by name (``storages.py``): the
``format=`` of a save, the ``storage`` field of a manifest. The manifest
(``manifest.json``, written last) is the entry point of every format; a storage
writes its files, then builds it with ``phases.build_manifest`` and commits it with
``phases.commit`` (generations, clean-up, durable writes).

A new format is one subclass plus one row in ``storages.STORAGES``.
"""
from __future__ import annotations

import abc
import collections
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple

import torch

from .reshard import StageStates
from .view import PipelineView

__all__ = ["CheckpointStorage", "PreparedLoad"]


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


class CheckpointStorage(abc.ABC):
    """One checkpoint format: how its tensors are written, checked, read and merged.

    Attributes:
        name: its ``save_checkpoint(format=...)`` value and the manifest's ``storage``.
        manifest_version: the manifest ``version`` it writes (the oldest
            pipedream_ext able to read it).
        asynchronous: whether it supports ``save_checkpoint(..., async_save=True)``.
    """

    name: ClassVar[str]
    manifest_version: ClassVar[int]
    asynchronous: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def check_pipeline(self, view: PipelineView) -> None:
        """Refuses a pipeline this storage cannot save, before anything else happens
        (no pending save finished, no flush).

        Raises:
            ValueError: the pipeline's layout is not supported.
        """
        return None  # every layout, unless a storage says otherwise

    @abc.abstractmethod
    def save(self, view: PipelineView, directory: str, optimizer: Optional[torch.optim.Optimizer],
             step: Any, extra: Any, async_save: bool) -> Any:
        """Saves the pipeline into ``directory`` (collective), the manifest last.

        Called after the previous asynchronous save finished and the pipeline was
        flushed. Runs ``phases.agree_to_start`` before writing and ``phases.commit``
        after, so a failure anywhere leaves the previous checkpoint loadable.

        Returns:
            The :class:`~.manifest.CheckpointInfo`, or with ``async_save`` a pending
            handle whose ``result()`` returns it.

        Raises:
            ValueError: a bad argument on any rank (before anything is written).
            CheckpointError: writing failed on some rank (on every rank).
        """

    @abc.abstractmethod
    def prepare_load(self, directory: str, manifest: Mapping[str, Any], view: PipelineView,
                     optimizer: Optional[torch.optim.Optimizer]) -> PreparedLoad:
        """This rank's checks of a checkpoint of this storage against the pipeline
        (local: ``load_checkpoint`` exchanges the outcome before anything is read in).

        Raises:
            CheckpointError: a missing, truncated or corrupt file, another model or
                another optimizer.
            ValueError: the optimizer holds tensors that are not this rank's
                parameters, or the pipeline's layout is not supported.
        """

    @abc.abstractmethod
    def consolidate(self, directory: str, manifest: Mapping[str, Any]
                    ) -> "collections.OrderedDict[str, torch.Tensor]":
        """The whole model's ``state_dict`` in layer order, on the CPU, in one process.

        Raises:
            CheckpointError: a missing, truncated or corrupt file, or tensors that
                differ from the manifest.
        """

    @abc.abstractmethod
    def check_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Checks this storage's fields of a manifest (``read_manifest`` checks the rest).

        Raises:
            KeyError, TypeError, ValueError: a field is missing or malformed
                (``read_manifest`` names the manifest).
        """
