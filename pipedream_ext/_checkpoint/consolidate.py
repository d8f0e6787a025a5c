"""``consolidate``: the whole model's plain ``state_dict`` from a checkpoint, no process group."""
from __future__ import annotations

import collections
import os
from typing import Any, Mapping

import torch

from .dcp_files import consolidate_dcp
from .durable_io import PathLike
from .errors import CheckpointError
from .manifest import MANIFEST, STORAGE_DCP, load_file, read_manifest, stage_what, storage_of

__all__ = ["consolidate"]


def _add_stage(directory: str, stage: Mapping[str, Any],
               result: "collections.OrderedDict[str, torch.Tensor]") -> None:
    """Adds one stage file's tensors to ``result``, checked against the manifest."""
    what = stage_what(stage, "weights")
    data = load_file(directory, stage["model"], what, "cpu")
    full = os.path.join(directory, stage["model"]["file"])
    listed = stage["model"].get("tensors", {})
    stored = [k for k, v in listed.items() if "same_as" not in v]
    missing = [k for k in stored if k not in data]
    unexpected = [k for k in data if k not in stored]
    if missing or unexpected:
        raise CheckpointError(f"{full} ({what}) does not hold what the manifest lists: "
                              f"missing {missing}, unexpected {unexpected}")
    for key, record in listed.items():
        # A parameter shared with an earlier stage: the same tensor under both
        # names, as in the tied model's own state_dict.
        value = data[key] if "same_as" not in record else result.get(record["same_as"])
        if value is None:
            raise CheckpointError(f"{full} ({what}): {key!r} is the same tensor as "
                                  f"{record['same_as']!r}, which no earlier stage holds")
        if list(value.shape) != record["shape"]:
            raise CheckpointError(f"{full} ({what}): {key!r} has shape {list(value.shape)} but "
                                  f"the manifest says {record['shape']}")
        result[key] = value


def consolidate(path: PathLike) -> "collections.OrderedDict[str, torch.Tensor]":
    """The whole original model's ``state_dict`` from a checkpoint, in layer order.

    Needs no process group: ``model.load_state_dict(consolidate(path))`` works on
    the unsplit ``nn.Sequential``, and ``torch.save`` of the result loads anywhere
    with plain PyTorch (``weights_only=True``). Tensors are loaded on the CPU.
    Both formats: per-stage files, or a DCP directory (read with ``dcp.load`` in
    this process, as ``format_utils.dcp_to_torch_save`` does).

    Args:
        path: the checkpoint directory.

    Returns:
        An ``OrderedDict`` from the original model's names (``"3.weight"``) to tensors.

    Raises:
        CheckpointError: no complete checkpoint, a missing, truncated or corrupt
            file, or a file whose tensors differ from the manifest (names the file
            and the entry).
    """
    directory = os.fspath(path)
    manifest = read_manifest(directory)
    if storage_of(manifest) == STORAGE_DCP:
        return consolidate_dcp(directory, manifest, os.path.join(directory, MANIFEST))
    result: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
    for stage in manifest["stages"]:
        _add_stage(directory, stage, result)
    return result
