"""``save_checkpoint(format="dcp")``'s hooks: one torch.distributed.checkpoint
directory per generation, described for our manifest.

The driver (``driver.save``) calls them in order: :func:`state_to_save` (phase 1:
this rank's state dict by the unsplit model's names, the stages it leads,
``state``), :func:`write` (phase 2: ``dcp.save`` or ``dcp.async_save`` into
``path/g000003-dcp/`` over the pipeline's checkpoint group, Gloo,
``_dist.groups.checkpoint_group``), :func:`written` (phase 3: waits for an
asynchronous write; every rank hashes its share of the directory's files,
``files``; rank 0 lists the tensors) and :func:`complete_manifest` (the manifest's
``dcp`` record). An asynchronous save returns after ``dcp.async_save`` copied the
state to CPU memory; the driver's ``PendingCheckpoint`` (``pending``) runs phases 3-5.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter, Metadata

from ..._frontend.tied_params import alias_names
from .. import durable_io, generations
from ..errors import CheckpointError
from ..storage import FileRecord, SaveJob, Written
from ..view import PipelineView, dcp_group
from . import files as dcp_files
from . import state as dcp_state

__all__ = ["state_to_save", "write", "written", "complete_manifest"]


def _dcp_dir(job: SaveJob) -> str:
    return os.path.join(job.directory, generations.dcp_directory(job.generation))


def state_to_save(view: PipelineView, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """Phase 1: this rank's state dict for DCP, by the unsplit model's names.

    Raises:
        ValueError: the optimizer holds tensors that are not this rank's parameters.
    """
    state: Dict[str, Any] = {dcp_state.MODEL: dcp_state.model_to_save(view)}
    if optimizer is not None:
        state[dcp_state.OPTIM] = dcp_state.optimizer_to_save(view, optimizer)
    return state


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


def write(job: SaveJob) -> Any:
    """Phase 2 (collective over the checkpoint group): DCP's save, or asynchronous save,
    of ``job.prepared``.

    Returns:
        DCP's metadata (a synchronous save) or its future (asynchronous).

    Raises:
        CheckpointError: DCP's save failed (DCP raises it on every rank).
    """
    dcp_dir = _dcp_dir(job)
    try:
        writer = FileSystemWriter(dcp_dir, sync_files=True)
        group = dcp_group(job.view)
        if job.async_save:
            return dcp.async_save(job.prepared, storage_writer=writer, process_group=group)
        return dcp.save(job.prepared, storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
        raise CheckpointError(f"DCP's save into {dcp_dir} failed: {dcp_files.describe_failure(exc)}") from exc


def _metadata(job: SaveJob, handle: Any) -> Metadata:
    """DCP's metadata of the write: the future's result for an asynchronous save."""
    if not job.async_save:
        return handle
    try:
        return handle.result()  # DCP's own waits on peers carry the group's timeout
    except (Exception, CheckpointException) as exc:  # reported to every rank by the driver
        raise CheckpointError(f"DCP's save into {_dcp_dir(job)} failed: "
                              f"{dcp_files.describe_failure(exc)}") from exc


def written(job: SaveJob, handle: Any) -> Written:
    """Phase 3 (local): this rank's share of the directory's files with their sizes and
    sha256 (and on rank 0 the tensor list), once its write finished.

    Raises:
        CheckpointError: the write failed, or a file cannot be read.
    """
    view, dcp_dir = job.view, _dcp_dir(job)
    metadata = _metadata(job, handle)
    if not metadata.storage_data:  # not every DCP version returns it: the file has it
        metadata = dcp_files.read_metadata(dcp_dir)
    files = dcp_files.hash_share(dcp_dir, metadata, view.rank, view.world_size)
    tensors: Dict[str, Dict[str, Any]] = {}
    if view.rank == 0:
        tensors = _tensor_list(view, metadata)
        durable_io.fsync_directory(dcp_dir)
    return Written(stages={}, payload={"files": files, "tensors": tensors})


def complete_manifest(job: SaveJob, manifest: Dict[str, Any],
                      gathered: Sequence[Dict[str, Any]]) -> Tuple[List[FileRecord], List[str]]:
    """The manifest's ``dcp`` record: the generation directory, every rank's files
    and rank 0's tensor list; returns the files and the directory to keep."""
    dcp_name = generations.dcp_directory(job.generation)
    all_files = {name: record for entry in gathered for name, record in entry["files"].items()}
    manifest["dcp"] = {"directory": dcp_name, "files": dict(sorted(all_files.items())),
                       "tensors": gathered[0]["tensors"]}
    files: List[FileRecord] = [(dcp_name, dict(record, file=name), "DCP data")
                               for name, record in manifest["dcp"]["files"].items()]
    return files, [dcp_name]
