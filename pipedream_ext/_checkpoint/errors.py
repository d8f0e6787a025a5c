"""The error every checkpoint function raises for a bad or unusable checkpoint."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model.

    The message names the checkpoint file and, where one is involved, the parameter.
    """
