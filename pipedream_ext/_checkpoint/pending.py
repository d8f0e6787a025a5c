"""Asynchronous saves in progress: one per pipeline group, finished before the next
save or load, by ``pipe.close()`` or at interpreter exit.

``save_checkpoint(..., async_save=True)`` returns a :class:`PendingCheckpoint` (the
driver registers it here); its ``result()`` runs the rest of the save (the
exchange, the manifest). :func:`finish_pending` is what ``save_checkpoint``,
``load_checkpoint`` and ``pipe.close()`` call first; at a normal interpreter exit
:func:`_finish_pending_at_exit` finishes what nobody finished, or says loudly why
it could not. Whatever format wrote it, a pending save is the same handle.
"""
from __future__ import annotations

import atexit
import logging
import sys
import warnings
from concurrent.futures import Future
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from .errors import CheckpointError
from .manifest import CheckpointInfo
from .view import PipelineView

__all__ = ["PendingCheckpoint", "register", "finish_pending"]

_log = logging.getLogger(__name__)

# The asynchronous save in progress per pipeline group: id(group) -> (group, save).
_PENDING: Dict[int, Tuple[dist.ProcessGroup, "PendingCheckpoint"]] = {}


class PendingCheckpoint:
    """An asynchronous save in progress (``save_checkpoint(..., format="dcp",
    async_save=True)``).

    The state was copied to CPU memory before ``save_checkpoint`` returned, so
    training may go on and change the weights; DCP writes the copy in a
    background thread over a Gloo group of its own. The checkpoint exists only
    once :meth:`result` wrote its manifest: until then ``path`` holds the previous
    checkpoint. :meth:`result` is collective (every rank of the pipeline calls it);
    the next ``save_checkpoint`` or ``load_checkpoint`` on these ranks and
    ``pipe.close()`` call it if you did not. A process that ends without any of
    them leaves the previous checkpoint (the written files are removed by the next save).
    """

    def __init__(self, view: PipelineView, path: str, generation: int, future: Optional["Future[Any]"],
                 finish: Callable[[], CheckpointInfo]) -> None:
        self._view = view
        self._path = path
        self._generation = generation
        self._future = future
        self._finish = finish
        self._info: Optional[CheckpointInfo] = None
        self._failure: Optional[BaseException] = None

    @property
    def path(self) -> str:
        """The checkpoint directory."""
        return self._path

    @property
    def generation(self) -> int:
        """The generation this save writes."""
        return self._generation

    @property
    def timeout(self) -> float:
        """Seconds its exchange may wait for a peer (the pipeline's)."""
        return self._view.timeout

    def done(self) -> bool:
        """Whether this rank's write finished (the manifest may still be missing)."""
        return self._info is not None or self._future is None or self._future.done()

    def result(self) -> CheckpointInfo:
        """Waits for this rank's write, agrees with every rank, and (rank 0) writes the
        manifest. Collective; later calls return the same result.

        Returns:
            The :class:`CheckpointInfo` of the new checkpoint.

        Raises:
            CheckpointError: the save failed on some rank (on every rank); the
                previous checkpoint in ``path`` is left as it was.
        """
        if self._info is not None:
            return self._info
        if self._failure is not None:
            raise self._failure
        cached = _PENDING.get(id(self._view.group))
        if cached is not None and cached[1] is self:
            del _PENDING[id(self._view.group)]
        try:
            self._info = self._finish()
        except Exception as exc:
            self._failure = exc
            raise
        return self._info

    wait = result


def register(view: PipelineView, path: str, generation: int, future: Optional["Future[Any]"],
             finish: Callable[[], CheckpointInfo]) -> PendingCheckpoint:
    """A :class:`PendingCheckpoint` that :func:`finish_pending` finishes on ``view``'s group.

    Args:
        view: the pipeline.
        path: the checkpoint directory.
        generation: the generation being written.
        future: the background write (``None``: it failed to start).
        finish: the rest of the save (collective), returning its result.
    """
    pending = PendingCheckpoint(view, path, generation, future, finish)
    _PENDING[id(view.group)] = (view.group, pending)
    return pending


def finish_pending(view: PipelineView) -> None:
    """Finishes the asynchronous save in progress on ``view``'s group, if any (collective).

    Raises:
        CheckpointError: that save failed (on every rank).
    """
    cached = _PENDING.get(id(view.group))
    if cached is None or cached[0] is not view.group:
        return
    pending = cached[1]
    try:
        pending.result()
    except CheckpointError as exc:
        raise CheckpointError(f"the asynchronous save of {pending.path} (generation "
                              f"{pending.generation}) failed: {exc}") from exc


def _why_not_at_exit() -> Optional[str]:
    """Why a pending save cannot be finished at exit (``None``: it can)."""
    # Set by an uncaught exception before atexit handlers run (3.12: also last_exc).
    ending = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if ending is not None:
        return (f"the process is ending with an uncaught {type(ending).__name__}, so the other ranks "
                "may not be there to finish it with this one")
    if not dist.is_initialized():
        return "the process group was destroyed before (dist.destroy_process_group())"
    return None


@atexit.register
def _finish_pending_at_exit() -> None:
    """At interpreter exit: finishes the asynchronous saves nobody finished (collective:
    every rank of their pipelines gets here; bounded by the pipeline's timeout), or
    says loudly why not: a log warning and a ``RuntimeWarning``."""
    for _, pending in list(_PENDING.values()):
        what = f"the asynchronous checkpoint save of {pending.path} (generation {pending.generation})"
        reason = _why_not_at_exit()
        if reason is None:
            _log.warning("%s was still pending at exit: finishing it now (every rank does; at most "
                         "%g s). Call its result() or pipe.close() on every rank before the end",
                         what, pending.timeout)
            try:
                pending.result()
                continue
            except Exception as exc:  # noqa: BLE001 - reported below
                reason = f"finishing it at exit failed: {exc}"
        message = (f"{what} was still pending at exit and was not finished: {reason}. {pending.path} "
                   "holds the previous checkpoint; call its result() or pipe.close() on every rank "
                   "before the process ends")
        _log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=1)
