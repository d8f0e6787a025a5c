"""``save_checkpoint(format="dcp")``: one torch.distributed.checkpoint directory per
generation, then our manifest.

1. ``phases.agree_to_start``: checks, the generation, and this rank's state dict
   (``dcp_state``: the unsplit model's names, the stages this rank leads);
2. ``dcp.save`` (or ``dcp.async_save``) into ``path/g000003-dcp/`` over the
   pipeline's checkpoint group (Gloo, ``_dist.groups.checkpoint_group``); rank 0
   also writes ``extra`` (``g000003-extra.pt``);
3. :func:`_finish`: every rank hashes its share of the directory's files
   (``dcp_files``); an exchange gathers them with every stage's record; rank 0
   writes ``manifest.json`` and removes superseded generations (``phases.commit``).

The manifest is the only entry point and is written only once every rank's write
finished, so a crash at any moment leaves the previous checkpoint loadable. An
asynchronous save returns after ``dcp.async_save`` copied the state to CPU memory;
its :class:`PendingCheckpoint` runs step 3 when ``result()`` is called, by the next
save or load on the pipeline's ranks (:func:`finish_pending`) or by ``pipe.close()``;
at a normal interpreter exit, by :func:`_finish_pending_at_exit` (or it says loudly
why it could not).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import warnings
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter, Metadata

from ..._dist import collectives
from ..._frontend.tied_params import alias_names
from .. import durable_io, generations, phases
from ..errors import CheckpointError
from ..manifest import CheckpointInfo
from ..optimizer_state import class_name
from ..storage import CheckpointStorage
from ..view import PipelineView, dcp_group
from . import files as dcp_files
from . import state as dcp_state

__all__ = ["PendingCheckpoint", "save_dcp", "finish_pending"]

_log = logging.getLogger(__name__)

# The asynchronous save in progress per pipeline group: id(group) -> (group, save).
_PENDING: Dict[int, Tuple[dist.ProcessGroup, "PendingCheckpoint"]] = {}


class _Job:
    """One DCP save: what step 3 needs."""

    def __init__(self, storage: CheckpointStorage, view: PipelineView, directory: str, start: phases.Start,
                 extra: Any, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.storage = storage
        self.view = view
        self.directory = directory
        self.generation = start.generation
        self.step = start.step
        self.extra = extra
        self.optimizer_class = class_name(optimizer) if optimizer is not None else None
        self.dcp_name = generations.dcp_directory(start.generation)
        self.dcp_dir = os.path.join(directory, self.dcp_name)
        self.extra_record: Optional[Dict[str, Any]] = None
        self.started = time.perf_counter()


def _tensor_list(view: PipelineView, metadata: Metadata) -> Dict[str, Dict[str, Any]]:
    """Every key of the model in ``state_dict`` order with its shape and dtype; a
    shared parameter's other names with ``same_as`` (stored once)."""
    aliases = alias_names(view.shared_parameters)
    tensors: Dict[str, Dict[str, Any]] = {}
    for key, shape in view.model_shapes.items():
        stored = aliases.get(key, key)
        md = metadata.state_dict_metadata.get(f"{dcp_state.MODEL}.{stored}")
        entry: Dict[str, Any] = {"shape": list(shape)}
        if md is not None and hasattr(md, "properties"):
            entry["dtype"] = str(md.properties.dtype).replace("torch.", "")
        if stored != key:
            entry["same_as"] = stored
        tensors[key] = entry
    return tensors


def _finish(job: _Job, metadata: Optional[Metadata], error: Optional[BaseException]) -> CheckpointInfo:
    """Step 3 (collective): file records, the exchange, the manifest.

    Raises:
        CheckpointError: writing failed on some rank (on every rank); rank 0 removed
            the generation's partial directory (and ``extra`` file).
    """
    view = job.view
    files: Dict[str, Dict[str, Any]] = {}
    tensors: Dict[str, Dict[str, Any]] = {}
    try:
        if error is not None:
            raise error
        assert metadata is not None
        if not metadata.storage_data:  # not every DCP version returns it: the file has it
            metadata = dcp_files.read_metadata(job.dcp_dir)
        files = dcp_files.hash_share(job.dcp_dir, metadata, view.rank, view.world_size)
        if view.rank == 0:
            tensors = _tensor_list(view, metadata)
            durable_io.fsync_directory(job.dcp_dir)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    records = [phases.stage_record(view, j) for j in sorted(view.stages) if view.is_leader(j)]
    try:
        gathered = collectives.gather_outcomes(
            error, view.group, view.timeout, f"saving checkpoint {job.directory}",
            payload={"stages": records, "files": files, "optimizer": job.optimizer_class,
                     "extra": job.extra_record, "tensors": tensors,
                     "written": phases.written_by(job.directory, job.generation)}, failure=CheckpointError)
    except BaseException:
        phases.abandon(view, job.directory, job.generation)  # the partial generation directory
        raise
    stages = sorted((s for entry in gathered for s in entry["stages"]), key=lambda s: s["stage"])
    optimizer_class = next((e["optimizer"] for e in gathered if e["optimizer"]), None)
    manifest = phases.build_manifest(view, job.generation, job.step, stages, gathered[0]["extra"],
                                     job.storage, optimizer_class)
    all_files = {name: record for entry in gathered for name, record in entry["files"].items()}
    manifest["dcp"] = {"directory": job.dcp_name, "files": dict(sorted(all_files.items())),
                       "tensors": gathered[0]["tensors"]}
    keep = [job.dcp_name] + ([manifest["extra"]["file"]] if manifest["extra"] else [])
    written: List[phases.FileRecord] = [(job.dcp_name, dict(record, file=name), "DCP data")
                                        for name, record in manifest["dcp"]["files"].items()]
    written += [("", manifest["extra"], "extra")] if manifest["extra"] else []
    phases.commit(view, job.directory, manifest, keep, written, [entry["written"] for entry in gathered])
    if view.rank == 0:
        _log.info("saved DCP checkpoint %s (generation %d, step %s, %d files) in %.2f s", job.directory,
                  job.generation, job.step, len(all_files), time.perf_counter() - job.started)
    return CheckpointInfo(path=job.directory, generation=job.generation, step=job.step,
                          extra=job.extra, manifest=manifest)


class PendingCheckpoint:
    """An asynchronous DCP save in progress (``save_checkpoint(..., format="dcp",
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

    def __init__(self, job: _Job, future: Optional["Future[Any]"], error: Optional[BaseException]) -> None:
        self._job = job
        self._future = future
        self._error = error
        self._info: Optional[CheckpointInfo] = None
        self._failure: Optional[BaseException] = None

    @property
    def path(self) -> str:
        """The checkpoint directory."""
        return self._job.directory

    @property
    def generation(self) -> int:
        """The generation this save writes."""
        return self._job.generation

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
        cached = _PENDING.get(id(self._job.view.group))
        if cached is not None and cached[1] is self:
            del _PENDING[id(self._job.view.group)]
        metadata, error = None, self._error
        if self._future is not None and error is None:
            try:
                metadata = self._future.result()  # DCP's own waits on peers carry the group's timeout
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported to every rank
                error = CheckpointError(f"DCP's save into {self._job.dcp_dir} failed: "
                                        f"{dcp_files.describe_failure(exc)}")
        try:
            self._info = _finish(self._job, metadata, error)
        except Exception as exc:
            self._failure = exc
            raise
        return self._info

    wait = result


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
                         what, pending._job.view.timeout)  # noqa: SLF001 - this module's class
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


def _start_write(job: _Job, state: Dict[str, Any], async_save: bool
                 ) -> Tuple[Optional[Metadata], Optional["Future[Any]"], Optional[BaseException]]:
    """Step 2: rank 0's ``extra``, then DCP's save (or asynchronous save) of ``state``.

    Every rank takes part in DCP's save even when its own part failed (rank 0's
    ``extra``), so no rank waits on one that left; :func:`_finish` reports the error.

    Returns:
        DCP's metadata (a synchronous save), its future (asynchronous), and this
        rank's error, if any.
    """
    view = job.view
    error: Optional[BaseException] = None
    if view.rank == 0:
        try:
            os.makedirs(job.directory, exist_ok=True)
            if job.extra is not None:
                job.extra_record = durable_io.atomic_torch_save(job.extra, job.directory,
                                                                generations.extra_file(job.generation))
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _finish
            error = exc
    metadata, future = None, None
    try:
        group = dcp_group(view)
        writer = FileSystemWriter(job.dcp_dir, sync_files=True)
        if async_save:
            future = dcp.async_save(state, storage_writer=writer, process_group=group)
        else:
            metadata = dcp.save(state, storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises it on every rank
        error = error or CheckpointError(f"DCP's save into {job.dcp_dir} failed: "
                                         f"{dcp_files.describe_failure(exc)}")
    return metadata, future, error  # type: ignore[return-value]


def save_dcp(storage: CheckpointStorage, view: PipelineView, directory: str,
             optimizer: Optional[torch.optim.Optimizer], step: Any, extra: Any, async_save: bool) -> Any:
    """``save_checkpoint(format="dcp")`` after the pending save and the flush.

    Args:
        storage: the DCP storage (its name and manifest version go into the manifest).
        view, directory, optimizer, step, extra, async_save: as ``save_checkpoint``'s.

    Returns:
        The :class:`CheckpointInfo`, or with ``async_save`` a :class:`PendingCheckpoint`.

    Raises:
        ValueError: a bad argument on any rank (before anything is written).
        CheckpointError: writing failed on some rank (on every rank).
    """
    def prepare() -> Dict[str, Any]:
        state: Dict[str, Any] = {dcp_state.MODEL: dcp_state.model_to_save(view)}
        if optimizer is not None:
            state[dcp_state.OPTIM] = dcp_state.optimizer_to_save(view, optimizer)
        return state

    start = phases.agree_to_start(view, directory, optimizer, step, extra, prepare)
    job = _Job(storage, view, directory, start, extra, optimizer)
    metadata, future, error = _start_write(job, start.prepared, async_save)
    if not async_save:
        return _finish(job, metadata, error)
    pending = PendingCheckpoint(job, future, error)
    _PENDING[id(view.group)] = (view.group, pending)
    return pending
