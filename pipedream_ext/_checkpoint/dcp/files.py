"""The files of a DCP generation directory: records, checks, metadata, consolidation.

DCP itself keeps no checksums. The manifest records every file of the directory
(``.metadata`` and the ``__{rank}_{i}.distcp`` files its ``storage_data`` names) with
its size and sha256: after a save each rank hashes its share of the files
(``files[rank::world]``; rank 0 also ``.metadata``), and before a load every rank
checks every file's size and hashes its share again, so a truncated, missing or
corrupt file is named (the exchange that follows raises it on every rank) before
DCP reads anything; the total cost is one read of the checkpoint, spread over the
ranks. :func:`consolidate_dcp` reads the model's tensors in one process, as
``format_utils.dcp_to_torch_save`` does, after checking every file.
"""
from __future__ import annotations

import collections
import os
import warnings
from typing import Any, Collection, Dict, List, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, Metadata, TensorStorageMetadata

from .. import durable_io
from ..errors import CheckpointError
from . import safe as dcp_safe

__all__ = ["METADATA_FILE", "generation_dir", "describe_failure", "data_files", "hash_share", "verify_files",
           "read_metadata", "consolidate_dcp"]

#: DCP's metadata file inside a generation directory (written last by DCP's coordinator).
METADATA_FILE = ".metadata"
_WHAT = {METADATA_FILE: "DCP metadata"}


def generation_dir(directory: str, manifest: Mapping[str, Any], listed_in: str) -> str:
    """The DCP directory the manifest names, inside ``directory`` (``durable_io.inside``).

    Raises:
        CheckpointError: a name or a symbolic link leading out of ``directory``.
    """
    return durable_io.inside(directory, manifest["dcp"]["directory"], "DCP directory", listed_in)


def describe_failure(exc: BaseException) -> str:
    """A DCP error in one line per failed rank (``CheckpointException`` carries every
    rank's exception; its own text is their tracebacks)."""
    if isinstance(exc, CheckpointException):
        parts = []
        for rank, failure in sorted(exc.failures.items()):
            error = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(error).__name__}: {error}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def data_files(metadata: Metadata) -> List[str]:
    """The data files a DCP checkpoint's metadata names, sorted."""
    storage = metadata.storage_data or {}
    return sorted({info.relative_path for info in storage.values()})


def _record(dcp_dir: str, name: str) -> Dict[str, Any]:
    full = os.path.join(dcp_dir, name)
    return {"bytes": os.path.getsize(full), "sha256": durable_io.sha256_of(full)}


def hash_share(dcp_dir: str, metadata: Metadata, rank: int, world_size: int) -> Dict[str, Dict[str, Any]]:
    """This rank's share of the directory's file records (``files[rank::world]``; rank 0
    also ``.metadata``).

    Args:
        dcp_dir: the generation directory ``dcp.save`` wrote.
        metadata: what ``dcp.save`` returned.
        rank: this rank in the pipeline's group.
        world_size: ranks in it.

    Returns:
        ``{file name: {"bytes", "sha256"}}``.
    """
    names = data_files(metadata)[rank::world_size] + ([METADATA_FILE] if rank == 0 else [])
    return {name: _record(dcp_dir, name) for name in names}


def verify_files(dcp_dir: str, files: Mapping[str, Mapping[str, Any]], rank: int, world_size: int,
                 listed_in: str) -> None:
    """Checks every file the manifest lists: present and of its size; the sha256 of
    ``.metadata`` and of this rank's share of the data files.

    Args:
        dcp_dir: the generation directory.
        files: the manifest's ``dcp.files``.
        rank: this rank (``0`` with ``world_size=1`` checks everything).
        world_size: ranks sharing the hashing.
        listed_in: the manifest's path, for messages.

    Raises:
        CheckpointError: a file is missing, has another size (truncated) or
            another sha256 (corrupt), naming it.
    """
    data = sorted(name for name in files if name != METADATA_FILE)
    if METADATA_FILE not in files:
        raise CheckpointError(f"{listed_in} lists no {METADATA_FILE} for {dcp_dir}")
    durable_io.verified_path(dcp_dir, dict(files[METADATA_FILE], file=METADATA_FILE),
                             _WHAT[METADATA_FILE], listed_in)
    for i, name in enumerate(data):
        durable_io.verified_path(dcp_dir, dict(files[name], file=name), "DCP data", listed_in,
                                 check_sha256=i % world_size == rank)


def _check_storage_paths(dcp_dir: str, metadata: Metadata, listed: Collection[str], listed_in: str) -> None:
    """Every data file DCP's metadata points to is a plain name the manifest lists
    (DCP opens ``dcp_dir/relative_path``: a crafted ``../`` or absolute path would read
    outside the checkpoint)."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{os.path.join(dcp_dir, METADATA_FILE)} ({_WHAT[METADATA_FILE]}) has no "
                              "storage_data or state_dict_metadata mapping; the checkpoint is damaged")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name not in listed or name == METADATA_FILE:
            raise CheckpointError(
                f"{os.path.join(dcp_dir, METADATA_FILE)} ({_WHAT[METADATA_FILE]}) stores "
                f"{getattr(index, 'fqn', index)!r} in {name!r}, which is not a data file {listed_in} "
                "lists (a DCP checkpoint's files are inside its directory); the checkpoint was "
                "altered or damaged: save it again")


def read_metadata(dcp_dir: str, listed: Optional[Collection[str]] = None, listed_in: str = "") -> Metadata:
    """DCP's metadata of a generation directory, unpickled without running code from it
    (``dcp_safe.load_metadata``; check the files with :func:`verify_files` first).

    Args:
        dcp_dir: the generation directory.
        listed: the file names the manifest lists; given, every data file the metadata
            points to must be one of them.
        listed_in: the manifest's path, for messages.

    Raises:
        CheckpointError: it cannot be read, references anything but DCP's metadata
            classes, or points to a file the manifest does not list (naming it).
    """
    metadata = dcp_safe.load_metadata(os.path.join(dcp_dir, METADATA_FILE))
    if listed is not None:
        _check_storage_paths(dcp_dir, metadata, listed, listed_in)
    return metadata


def consolidate_dcp(directory: str, manifest: Mapping[str, Any], listed_in: str
                    ) -> "collections.OrderedDict[str, torch.Tensor]":
    """The whole model's ``state_dict`` from a DCP checkpoint, in one process.

    Every file is checked first; the tensors of ``model`` are read into new CPU
    tensors (``dcp.load`` with ``no_dist=True``); a shared parameter's other names
    (``same_as``) become keys for the same tensor, as in a tied model's ``state_dict``.

    Args:
        directory: the checkpoint directory.
        manifest: its manifest (``storage`` ``"dcp"``).
        listed_in: the manifest's path, for messages.

    Returns:
        ``{original name: tensor}`` in the unsplit model's ``state_dict`` order.

    Raises:
        CheckpointError: a missing, truncated or corrupt file, or tensors that differ
            from the manifest's list.
    """
    record = manifest["dcp"]
    dcp_dir = generation_dir(directory, manifest, listed_in)
    verify_files(dcp_dir, record["files"], 0, 1, listed_in)
    metadata = read_metadata(dcp_dir, record["files"], listed_in)
    listed = record["tensors"]
    request: Dict[str, torch.Tensor] = {}
    for key, entry in listed.items():
        if "same_as" in entry:
            continue
        md = metadata.state_dict_metadata.get(f"model.{key}")
        if not isinstance(md, TensorStorageMetadata) or list(md.size) != entry["shape"]:
            raise CheckpointError(f"{dcp_dir}: {key!r} is listed in the manifest with shape "
                                  f"{entry['shape']} but DCP's metadata has "
                                  f"{list(md.size) if isinstance(md, TensorStorageMetadata) else md}")
        request[key] = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load({"model": request}, storage_reader=dcp_safe.CheckedReader(dcp_dir, metadata),
                     planner=dcp_safe.SafeLoadPlanner(dcp_dir), no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's read errors, reported with the directory
        raise CheckpointError(f"{dcp_dir}: reading the DCP checkpoint failed: "
                              f"{describe_failure(exc)}") from exc
    result: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
    for key, entry in listed.items():
        result[key] = request[entry.get("same_as", key)]
    return result
