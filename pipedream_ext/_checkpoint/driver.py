"""The one collective sequence of every save and every load; formats answer hooks.

Saving (``save_checkpoint``: :class:`~.phases.CheckpointSave` over a format's
hooks, ``storage.CheckpointStorage``; ``save_pretrained``: the Hugging Face
format's session), on every rank of the pipeline::

    rank r                                   every rank (one exchange each)
    ------                                   ------------------------------
    1 agree   session.plan()              -> gather_outcomes: checks, generation, directory
              session.agreed(gathered)       (a bad argument anywhere fails everywhere;
                                              nothing is written yet)
    2 write   session.write()                this rank's files under new names
              (async_save: return a PendingCheckpoint; 3-5 run in its result())
    3 gather  session.written(handle)     -> gather_outcomes: every rank's file records
              session.collect(gathered)      (the manifest, the same on every rank)
    4 commit  rank 0: session.commit()       checks it sees every file, writes the
                                             manifest (or index) last, removes what it supersedes
    5 outcome                             -> gather_outcomes: every rank returns or raises
              session.result()

A failure in 2-5 anywhere makes every rank raise and calls ``session.abandon()``
(the new files go; the previous checkpoint stays loadable); a failed commit is
abandoned on rank 0 before the outcome's exchange. Loading
(:func:`load`): read and check the manifest, the format's ``prepare_load``, one
exchange (directory, generation), then ``PreparedLoad.read`` and the copy into
the live tensors. docs/checkpoints.md draws both.
"""
from __future__ import annotations

import abc
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .._dist import collectives
from . import copies, pending, reshard
from . import directory as directory_check
from .errors import CheckpointError
from .manifest import CheckpointInfo, load_file
from .storage import CheckpointStorage, PreparedLoad
from .view import PipelineView

__all__ = ["SaveSession", "save", "load"]

_log = logging.getLogger(__name__)


class SaveSession(abc.ABC):
    """One collective save as :func:`save` runs it; the hooks in call order.

    Attributes:
        view: the pipeline.
        directory: where the save writes.
        what: the operation, for messages (``"saving checkpoint ckpt"``).
        untouched: what a refused start says was left (``"nothing was written"``).
        committed: the file the commit writes last (``manifest.json``).
        asynchronous: whether :meth:`write` returns a background write (then the
            save returns a ``PendingCheckpoint`` of ``generation``).
        generation: the generation an asynchronous save writes.
    """

    view: PipelineView
    directory: str
    what: str
    untouched: str
    committed: str
    asynchronous: bool = False
    generation: int = 0

    @abc.abstractmethod
    def plan(self) -> Dict[str, Any]:
        """Phase 1, local: checks this rank's part; returns what it tells the others.

        Raises:
            ValueError: a bad argument (every rank raises it).
        """

    @abc.abstractmethod
    def agreed(self, gathered: List[Dict[str, Any]]) -> None:
        """Phase 1, every rank, after the exchange: what the ranks agreed on.

        Raises:
            ValueError: the ranks' arguments do not fit together (nothing written).
        """

    @abc.abstractmethod
    def write(self) -> Any:
        """Phase 2: this rank's files; returns a handle for :meth:`written`."""

    @abc.abstractmethod
    def written(self, handle: Any) -> Any:
        """Phase 3, local, once this rank's write finished: its records (JSON)."""

    @abc.abstractmethod
    def collect(self, gathered: List[Any]) -> None:
        """Phase 3, every rank: every rank's records (the manifest or index to write)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Phase 4, rank 0: checks the files, writes the last file, removes superseded ones."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """After a failure in phases 2-5: removes this save's new files (never the
        previous checkpoint's)."""

    @abc.abstractmethod
    def result(self) -> Any:
        """Phase 5, every rank, once every rank committed: what the save returns."""


def _agree(session: SaveSession) -> None:
    """Phase 1: every rank's :meth:`~SaveSession.plan` and the directory it resolves."""
    view = session.view
    error: Optional[BaseException] = None
    plan: Dict[str, Any] = {}
    try:
        plan = session.plan()
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    gathered = collectives.gather_outcomes(
        error, view.group, view.timeout, session.what,
        payload=dict(plan, directory=directory_check.describe(session.directory)), failure=CheckpointError)
    directory_check.check_same(session.what, [e["directory"] for e in gathered], session.untouched)
    session.agreed(gathered)


def _commit(session: SaveSession) -> Optional[BaseException]:
    """Phase 4: rank 0's commit; where it fails, rank 0 abandons the save before the
    outcome's exchange, so no rank returns while the new files are still there."""
    if session.view.rank != 0:
        return None
    try:
        session.commit()
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        session.abandon()
        return exc
    return None


def _complete(session: SaveSession, handle: Any, error: Optional[BaseException]) -> Any:
    """Phases 3-5 (collective): the records, rank 0's commit, the outcome."""
    view = session.view
    records: Any = None
    try:
        if error is None:
            try:
                records = session.written(handle)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                error = exc
        gathered = collectives.gather_outcomes(error, view.group, view.timeout, session.what,
                                               payload=records, failure=CheckpointError)
        session.collect(gathered)
    except BaseException:
        session.abandon()
        raise
    error = _commit(session)
    try:
        collectives.gather_outcomes(error, view.group, view.timeout,
                                    f"{session.what} (writing {session.committed})", failure=CheckpointError)
    except BaseException:
        if error is None:  # rank 0 abandoned already where its commit failed
            session.abandon()
        raise
    return session.result()


def save(session: SaveSession) -> Any:
    """Runs ``session`` through phases 1-5 (module docstring), on every rank.

    Returns:
        ``session.result()``, or for an asynchronous session a ``PendingCheckpoint``
        whose ``result()`` runs phases 3-5.

    Raises:
        ValueError: a bad argument on any rank (before anything is written).
        CheckpointError: writing failed on some rank (on every rank); the new files
            are removed.
    """
    _agree(session)
    handle: Any = None
    error: Optional[BaseException] = None
    try:
        handle = session.write()
    except Exception as exc:  # noqa: BLE001 - reported to every rank in phase 3
        error = exc
    if session.asynchronous:
        return pending.register(session.view, session.directory, session.generation, handle,
                                lambda: _complete(session, handle, error))
    return _complete(session, handle, error)


def _prepare_load(directory: str, view: PipelineView, optimizer: Optional[torch.optim.Optimizer],
                  open_manifest: Callable[[str], Tuple[Dict[str, Any], CheckpointStorage]]
                  ) -> Tuple[Dict[str, Any], Optional[PreparedLoad], Any, Optional[BaseException]]:
    """This rank's part before the exchange: the manifest, the format's checks, ``extra``."""
    manifest: Dict[str, Any] = {}
    try:
        manifest, storage = open_manifest(directory)
        prepared = storage.prepare_load(directory, manifest, view, optimizer)
        extra = load_file(directory, manifest["extra"], "extra", "cpu") if manifest.get("extra") else None
        return manifest, prepared, extra, None
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return manifest, None, None, exc


def load(directory: str, view: PipelineView, optimizer: Optional[torch.optim.Optimizer],
         open_manifest: Callable[[str], Tuple[Dict[str, Any], CheckpointStorage]],
         storage_name: Callable[[Mapping[str, Any]], str]) -> CheckpointInfo:
    """Loads ``directory`` into the pipeline (collective; ``load_checkpoint``'s sequence).

    Args:
        directory: the checkpoint directory.
        view: the pipeline (flushed, no save pending).
        optimizer: this rank's optimizer or ``None``.
        open_manifest: reads and checks a directory's manifest; returns it and its format.
        storage_name: the format a manifest names (for the exchange).

    Returns:
        The :class:`CheckpointInfo`.

    Raises:
        CheckpointError, ValueError: as ``load_checkpoint``'s, on every rank.
    """
    manifest, prepared, extra, error = _prepare_load(directory, view, optimizer, open_manifest)
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
