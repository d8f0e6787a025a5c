"""``consolidate``: the whole model's plain ``state_dict`` from a checkpoint, no process group."""
from __future__ import annotations

import collections
import os

import torch

from .durable_io import PathLike
from .storages import read_manifest, storage_of

__all__ = ["consolidate"]


def consolidate(path: PathLike) -> "collections.OrderedDict[str, torch.Tensor]":
    """The whole original model's ``state_dict`` from a checkpoint, in layer order.

    Needs no process group: ``model.load_state_dict(consolidate(path))`` works on
    the unsplit ``nn.Sequential``, and ``torch.save`` of the result loads anywhere
    with plain PyTorch (``weights_only=True``). Tensors are loaded on the CPU.
    Every storage (``storages.STORAGES``): per-stage files, or a DCP directory
    (read with ``dcp.load`` in this process, as ``format_utils.dcp_to_torch_save`` does).

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
    return storage_of(manifest).consolidate(directory, manifest)
