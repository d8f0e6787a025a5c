"""The ``"hf"`` format: Hugging Face model directories, a row of the format table.

A Hugging Face directory has no manifest, no optimizer state and no generations:
it is weights for ``from_pretrained``, not a checkpoint to resume from. So it is a
weights format (``checkpoints = False``: not a ``save_checkpoint(format=...)``
value, never a manifest's ``storage``) answering the weights hooks: read into a
pipeline, each rank its share (``load.load_hf``), write a whole state dict
(``save.write_state_dict``, for ``consolidate(..., format="hf")``) and recognise
its paths (``detect``). Writing a pipeline (``save.save_pretrained``) runs the
save driver with the session ``save.HfSave``.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from ..reshard import IncompatibleKeys
from ..storage import CheckpointStorage
from ..view import Pipeline
from . import files as hf_files
from . import load as hf_load
from . import save as hf_save

__all__ = ["HfStorage", "HF"]


class HfStorage(CheckpointStorage):
    """``"hf"``: a Hugging Face model directory (safetensors shards, index, config)."""

    name = "hf"
    checkpoints = False
    writes_state_dicts = True
    looks_like = (f"a Hugging Face model directory ({hf_files.SINGLE} or {hf_files.INDEX}), "
                  "a .safetensors file")

    def holds(self, path: str) -> bool:
        return hf_files.is_hf(path)

    def load_path(self, pipe: Pipeline, path: str, strict: bool = True) -> IncompatibleKeys:
        """``pipe.load_state_dict(path)``: see ``load.load_hf``."""
        return hf_load.load_hf(pipe, path, strict)

    def write_state_dict(self, state_dict: Mapping[str, torch.Tensor], out_dir: str,
                         config: Any = None) -> Dict[str, str]:
        """A whole state dict as a Hugging Face directory (``save.write_state_dict``)."""
        return hf_save.write_state_dict(state_dict, out_dir, config)


HF = HfStorage()
