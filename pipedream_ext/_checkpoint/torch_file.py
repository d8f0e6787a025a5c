"""The ``"torch"`` format: one ``torch.save`` file of a state dict, a row of the format table.

A weights format (``checkpoints = False``): ``pipe.load_state_dict(path)`` reads it
memory-mapped with ``weights_only=True`` and re-shards it by name.
"""
from __future__ import annotations

import os

import torch

from . import reshard
from .reshard import IncompatibleKeys
from .storage import CheckpointStorage
from .view import Pipeline

__all__ = ["TorchFileStorage", "TORCH_SUFFIXES"]

#: Files ``pipe.load_state_dict(path)`` reads with ``torch.load`` (a saved state dict).
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class TorchFileStorage(CheckpointStorage):
    """``"torch"``: a ``.pt``/``.pth``/``.bin`` file of ``torch.save``."""

    name = "torch"
    checkpoints = False
    looks_like = f"a torch.save file ({', '.join(TORCH_SUFFIXES)})"

    def holds(self, path: str) -> bool:
        return os.path.isfile(path) and path.endswith(TORCH_SUFFIXES)

    def load_path(self, pipe: Pipeline, path: str, strict: bool = True) -> IncompatibleKeys:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return reshard.load_state_dict(pipe, state, strict)
