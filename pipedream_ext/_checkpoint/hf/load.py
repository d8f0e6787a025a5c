"""``pipe.load_state_dict(path)`` of Hugging Face weights: each rank reads only its share.

Every rank lists the tensors of the directory (``model.safetensors.index.json``, or
a single file's header) without opening a shard, then, for each key of its own
stages (the unsplit model's names, which are the Hugging Face model's names when
the pipeline wraps that model), opens the shard holding it (a memory map) and
reads that tensor alone; a DTensor parameter (FSDP shards, tensor parallelism)
reads only this rank's slice (``hf_files.ShareReader``). A parameter tied under
several names (``lm_head.weight`` and ``model.embed_tokens.weight`` with
``tie_word_embeddings``) is read under whichever of its names the file holds:
transformers stores a tied weight once. Errors name the keys and the fix; an
exchange makes every rank raise the same error, and nothing changes unless every
rank succeeded.
"""
from __future__ import annotations

import collections
import logging
from typing import Dict, List, Optional, Tuple

from .. import reshard
from ..reshard import IncompatibleKeys, StageStates
from ..view import Pipeline, PipelineView
from . import files as hf_files

__all__ = ["load_hf", "split_hf"]

_log = logging.getLogger(__name__)
_SHOWN = 8


def _listed(keys: List[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def tied_names(view: PipelineView) -> Dict[str, List[str]]:
    """Every name of a tied parameter this rank holds -> its other names in the model
    (the pipeline's shared parameters across stages, and ties within this rank's stages)."""
    groups: List[List[str]] = [list(sp.names) for sp in view.shared_parameters]
    by_tensor: Dict[int, List[str]] = {}
    for name, p in view.module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    groups += [names for names in by_tensor.values() if len(names) > 1]
    others: Dict[str, List[str]] = {}
    for names in groups:
        for name in names:
            others.setdefault(name, []).extend(n for n in names if n != name and n not in others[name])
    return others


def _check_unexpected(weights: hf_files.HfWeights, view: PipelineView, strict: bool) -> List[str]:
    unexpected = [k for k in weights.files if k not in view.model_shapes]
    if unexpected and strict:
        raise ValueError(
            f"{weights.path} holds {len(unexpected)} tensor(s) this model does not have: "
            f"{_listed(unexpected)} (unexpected keys: the weights of another model, or of the "
            "same model under another prefix, e.g. LlamaModel's 'layers.0...' for "
            "LlamaForCausalLM's 'model.layers.0...'); pass the weights of this model, or "
            "strict=False to ignore them")
    return unexpected


def split_hf(view: PipelineView, reader: hf_files.ShareReader,
             strict: bool) -> Tuple[StageStates, List[str], List[str]]:
    """This rank's tensors of a Hugging Face directory, per local stage (local: no exchange).

    Returns:
        ``(per-stage state dicts, missing keys of this rank, unexpected keys)``.

    Raises:
        ValueError: (strict) keys the model lacks, keys this rank's stages need that the
            files lack (naming the stage); any shape that differs (naming both); a shard
            the index lists that is missing.
    """
    weights = reader.weights
    unexpected = _check_unexpected(weights, view, strict)
    others = tied_names(view)
    parts: StageStates = {}
    missing: List[str] = []
    for j, module in view.stages.items():
        parts[j] = collections.OrderedDict()
        absent = []
        for key, current in module.state_dict().items():
            source: Optional[str] = key if key in weights.files else next(
                (n for n in others.get(key, []) if n in weights.files), None)
            if source is None:
                absent.append(key)
                continue
            stored = reader.shape(source)
            if stored != tuple(current.shape):
                raise ValueError(
                    f"{weights.path}: {source!r} has shape {list(stored)} in "
                    f"{weights.files[source]} but this model's {key!r} is {list(current.shape)}; "
                    "the weights are of a model with another configuration (hidden_size, "
                    "vocab_size, ...): build the model from the directory's config.json")
            parts[j][key] = reader.read(source, current)
        if absent and strict:
            start, stop = view.stage_layers[j]
            raise ValueError(
                f"{weights.path} lacks {len(absent)} tensor(s) of stage {j} (layers {start}-{stop - 1}): "
                f"{_listed(absent)} (missing keys); pass the weights of this model (a tied weight "
                "is found under any of its names, e.g. lm_head.weight under "
                "model.embed_tokens.weight: tie it in the model as its config says), or "
                "strict=False to keep their current values")
        missing.extend(absent)
    return parts, missing, unexpected


def load_hf(pipe: Pipeline, path: str, strict: bool = True) -> IncompatibleKeys:
    """Loads this rank's tensors of a Hugging Face directory or ``.safetensors`` file
    into ``pipe``, in place (collective; see ``PipeDream.load_state_dict``).

    Raises:
        ValueError: on every rank, if any rank found missing, unexpected or mis-shaped
            keys, or a directory that is not Hugging Face weights.
        RuntimeError: on every rank, if a rank failed otherwise or a peer did not arrive.
    """
    readers: List[hf_files.ShareReader] = []

    def split(view: PipelineView) -> Tuple[StageStates, List[str], List[str]]:
        readers.append(hf_files.ShareReader(hf_files.HfWeights(path)))
        return split_hf(view, readers[0], strict)

    try:
        keys = reshard.load_parts(pipe, split, f"load_state_dict({path!r})")
        reader = readers[0]
        _log.debug("rank %d read %d tensors (%d bytes) from %d of %d files of %s",
                   pipe.checkpoint_view.rank, len(reader.tensors), reader.bytes,
                   len(reader.opened), len(set(reader.weights.files.values())), path)
        return keys
    finally:
        for reader in readers:
            reader.close()
