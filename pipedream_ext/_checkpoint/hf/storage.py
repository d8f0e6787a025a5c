"""The ``"hf"`` storage: Hugging Face model directories, and telling formats apart by path.

A Hugging Face directory has no manifest, no optimizer state and no generations:
it is weights for ``from_pretrained``, not a checkpoint to resume from. So it is
not a row of ``storages.STORAGES`` (``save_checkpoint(format=...)``, whose files
a manifest lists) but a storage of weights alone, with the same three jobs:
write a pipeline (``hf_save.save_pretrained``), read into a pipeline, each rank
its share (``hf_load.load_hf``), and write a whole state dict
(``hf_save.write_state_dict``, for ``consolidate(..., format="hf")``).
:func:`detect` names the format of any path the loaders accept.
"""
from __future__ import annotations

import os
from typing import Any, ClassVar, Dict, Mapping

import torch

from .. import reshard
from ..durable_io import PathLike
from ..manifest import MANIFEST
from ..reshard import IncompatibleKeys
from ..storages import read_manifest, storage_name
from ..view import Pipeline
from . import files as hf_files
from . import load as hf_load
from . import save as hf_save

__all__ = ["HfStorage", "HF", "WRITERS", "detect", "load_path", "TORCH_SUFFIXES"]

#: Files ``pipe.load_state_dict(path)`` reads with ``torch.load`` (a saved state dict).
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class HfStorage:
    """``"hf"``: a Hugging Face model directory (safetensors shards, index, config)."""

    name: ClassVar[str] = "hf"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def save(self, pipe: Pipeline, out_dir: str, config: Any = None) -> Dict[str, str]:
        """``pd.save_pretrained``: see ``hf_save.save_pretrained``."""
        return hf_save.save_pretrained(pipe, out_dir, config)

    def load(self, pipe: Pipeline, path: str, strict: bool = True) -> IncompatibleKeys:
        """``pipe.load_state_dict(path)``: see ``hf_load.load_hf``."""
        return hf_load.load_hf(pipe, path, strict)

    def write_state_dict(self, state_dict: Mapping[str, torch.Tensor], out_dir: str,
                         config: Any = None) -> Dict[str, str]:
        """A whole state dict as a Hugging Face directory (``hf_save.write_state_dict``)."""
        return hf_save.write_state_dict(state_dict, out_dir, config)


HF = HfStorage()
#: The formats ``consolidate(format=...)`` writes besides returning the state dict.
WRITERS: Dict[str, HfStorage] = {HF.name: HF}


def detect(path: PathLike) -> str:
    """The format of ``path``: ``"pipedream"`` or ``"dcp"`` (a checkpoint directory: its
    manifest's storage), ``"hf"`` (a Hugging Face directory or a ``.safetensors`` file)
    or ``"torch"`` (a ``.pt``/``.pth``/``.bin`` file of ``torch.save``).

    Raises:
        ValueError: none of those (the message says what each looks like).
        CheckpointError: a checkpoint directory whose manifest is unreadable.
    """
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST)):
        return storage_name(read_manifest(path))
    if hf_files.is_hf(path):
        return HF.name
    if os.path.isfile(path) and path.endswith(TORCH_SUFFIXES):
        return "torch"
    what = "no such file or directory" if not os.path.exists(path) else "not a format pipedream_ext reads"
    raise ValueError(f"{path}: {what}; pass a checkpoint directory (with {MANIFEST}), a Hugging "
                     f"Face model directory ({hf_files.SINGLE} or {hf_files.INDEX}), a .safetensors "
                     f"file or a torch.save file ({', '.join(TORCH_SUFFIXES)})")


def _load_torch_file(pipe: Pipeline, path: str, strict: bool) -> IncompatibleKeys:
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return reshard.load_state_dict(pipe, state, strict)


#: What ``pipe.load_state_dict(path)`` does with each format :func:`detect` names.
_PATH_READERS = {HF.name: HF.load, "torch": _load_torch_file}


def load_path(pipe: Pipeline, path: PathLike, strict: bool = True) -> IncompatibleKeys:
    """``pipe.load_state_dict(path)``: a Hugging Face directory or ``.safetensors`` file
    (each rank reads its share), or a ``torch.save`` file (memory-mapped).

    Raises:
        ValueError: a checkpoint directory (naming ``pd.load_checkpoint``) or another path.
    """
    path = os.fspath(path)
    kind = detect(path)
    read = _PATH_READERS.get(kind)
    if read is None:
        raise ValueError(f"load_state_dict({path!r}): a {kind!r} checkpoint directory; restore it "
                         "with pd.load_checkpoint(path, pipe), or pass pd.consolidate(path)")
    return read(pipe, path, strict)
