"""``consolidate``: the whole model's plain ``state_dict`` from a checkpoint, no process group."""
from __future__ import annotations

import collections
import os
from typing import Any, Optional

import torch

from .durable_io import PathLike
from .storages import WRITERS, read_manifest, state_dict_writer, storage_of

__all__ = ["consolidate"]


def consolidate(path: PathLike, format: Optional[str] = None, out_dir: Optional[PathLike] = None,
                config: Any = None) -> "collections.OrderedDict[str, torch.Tensor]":
    """The whole original model's ``state_dict`` from a checkpoint, in layer order.

    Needs no process group: ``model.load_state_dict(consolidate(path))`` works on
    the unsplit ``nn.Sequential``, and ``torch.save`` of the result loads anywhere
    with plain PyTorch (``weights_only=True``). Tensors are loaded on the CPU.
    Every storage (``storages.STORAGES``): per-stage files, or a DCP directory
    (read with ``dcp.load`` in this process, as ``format_utils.dcp_to_torch_save`` does).

    With ``format="hf"`` it also writes the state dict to ``out_dir`` as a Hugging
    Face model directory that ``from_pretrained`` loads (safetensors shards, their
    index; ``config.json`` from ``config``; a tied weight stored once, under its
    first name), as ``save_pretrained`` does: each file staged inside ``out_dir`` and
    moved into place whole, the index last; the other files in ``out_dir`` are kept,
    only a previous save's stale shards are removed (docs/checkpoints.md).

    Args:
        path: the checkpoint directory.
        format: ``None`` (only return the state dict) or ``"hf"`` (write ``out_dir`` too).
        out_dir: with ``format="hf"``: the directory to write into (created if missing).
        config: with ``format="hf"``: the model's ``PretrainedConfig`` (``model.config``),
            written as ``config.json``; ``None`` writes the weights alone.

    Returns:
        An ``OrderedDict`` from the original model's names (``"3.weight"``) to tensors.

    Raises:
        ValueError: a ``format`` other than ``None`` or ``"hf"``, ``format="hf"``
            without ``out_dir``, or an ``out_dir`` that is a file, a link to nothing
            or holds a ``model.safetensors`` (``hf_directory.check_out_dir``).
        CheckpointError: no complete checkpoint, a missing, truncated or corrupt
            file, or a file whose tensors differ from the manifest (names the file
            and the entry).
    """
    writer = state_dict_writer(format)
    if format is not None and writer is None:
        raise ValueError(f"consolidate(format={format!r}): use format=None (the state dict) or "
                         f"{' or '.join(f'format={name!r}' for name in WRITERS)} (also a Hugging "
                         "Face directory in out_dir)")
    if (writer is None) != (out_dir is None):
        raise ValueError(f"consolidate: out_dir={out_dir!r} with format={format!r}; pass both "
                         f"format={WRITERS[0]!r} and out_dir=, or neither")
    directory = os.fspath(path)
    manifest = read_manifest(directory)
    state = storage_of(manifest).consolidate(directory, manifest)
    if writer is not None and out_dir is not None:
        writer.write_state_dict(state, os.fspath(out_dir), config)
    return state
