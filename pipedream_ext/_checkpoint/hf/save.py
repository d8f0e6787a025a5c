"""``save_pretrained``: a directory ``from_pretrained`` loads, written by the ranks
that hold the tensors; and the same layout from a whole state dict (``consolidate``).

Layout (as transformers writes it): ``model-0000k-of-0000n.safetensors`` (one per
stage that stores tensors, in stage order, written by that stage's leader),
``model.safetensors.index.json`` (``weight_map``, ``metadata.total_size``),
``config.json`` and ``generation_config.json`` when the model has them. A tied
parameter is stored once, under its first name in the model
(``model.embed_tokens.weight``, not ``lm_head.weight``), as transformers stores it.

Phases, the save driver's (``driver.save``, with :class:`HfSave`'s hooks), as
``save_checkpoint``'s: (1) every rank checks its part and rank 0 the
directory (``directory.check_out_dir``) and picks a token; one exchange makes a
bad argument anywhere fail everywhere before anything is written; (2) each stage's
leader writes its file into the staging directory ``<out_dir>/.tmp-pipedream-<token>``:
a DTensor (FSDP shards, tensor parallelism) is gathered tensor by tensor within the
stage's ranks (``full_tensor``) to the leader only, so a rank holds at most its stage
whole, never the model; (3) rank 0 checks every file, writes the index and configs
there and moves each file into ``out_dir`` (the index last), then removes the
previous save's stale shards (``directory.publish``). Nothing else in ``out_dir``
is touched. A failure anywhere removes the staging directory (each rank its own
files) and leaves ``out_dir`` as it was.
"""
from __future__ import annotations

import collections
import json
import os
import uuid
from typing import Any, Dict, List, Mapping

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from ..._frontend.tied_params import alias_names
from .. import driver
from ..driver import SaveSession
from ..errors import CheckpointError
from ..view import Pipeline, PipelineView
from . import directory as hf_directory
from . import files as hf_files

__all__ = ["HfSave", "save_pretrained", "write_state_dict", "shard_name", "MAX_SHARD_BYTES"]

#: ``write_state_dict``'s shard size (transformers' default ``max_shard_size="50GB"``
#: would make one file; smaller shards let a pipeline's ranks read their own).
MAX_SHARD_BYTES = 5 * 10**9


def shard_name(k: int, n: int) -> str:
    """The ``k``-th (0-based) of ``n`` shard files, named as transformers names them."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def _stored_keys(view: PipelineView, j: int) -> List[str]:
    """The keys local stage ``j`` stores: a parameter tied to an earlier stage's, or
    to an earlier name within the stage, is stored once, under its first name."""
    aliases = alias_names(view.shared_parameters, stage=j)
    seen = set()
    keys = []
    for key, value in view.stages[j].state_dict(keep_vars=True).items():
        if key in aliases or id(value) in seen:
            continue
        seen.add(id(value))
        keys.append(key)
    return keys


def _write_file(folder: str, name: str, tensors: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """Writes one shard (contiguous CPU tensors, ``{"format": "pt"}`` as transformers
    expects) and fsyncs it; returns its record."""
    path = os.path.join(folder, name)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"file": name, "bytes": os.path.getsize(path),
            "tensors": {k: v.numel() * v.element_size() for k, v in tensors.items()}}


def _finish(folder: str, out_dir: str, records: List[Dict[str, Any]], config: Any,
            generation_config: Any) -> None:
    """Rank 0: checks every shard, writes the index and configs into the staging
    directory ``folder`` and moves its files into ``out_dir`` (``hf_directory.publish``)."""
    for record in records:
        full = os.path.join(folder, record["file"])
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size != record["bytes"]:
            raise CheckpointError(f"save_pretrained {out_dir}: {record['file']} is "
                                  f"{'missing' if size is None else f'{size} bytes'} on rank 0 "
                                  f"(written: {record['bytes']} bytes): the ranks do not share "
                                  "this file system; nothing was replaced")
    weight_map = {k: r["file"] for r in records for k in r["tensors"]}
    total = sum(b for r in records for b in r["tensors"].values())
    with open(os.path.join(folder, hf_files.INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
        f.write("\n")
    for extra in (config, generation_config):
        if extra is not None:
            extra.save_pretrained(folder)
    for name in os.listdir(folder):  # the moves are durable only with their contents
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
    hf_directory.publish(folder, out_dir)


def _hf_parts(model_like: Any, config: Any) -> Any:
    """The ``(config, generation_config)`` to write: ``config`` if given, else the
    model's (objects with ``save_pretrained``; ``None`` where there is none)."""
    config = config if config is not None else getattr(model_like, "model_config", None)
    generation = getattr(model_like, "generation_config", None)
    for value, name in ((config, "config"), (generation, "generation_config")):
        if value is not None and not callable(getattr(value, "save_pretrained", None)):
            raise ValueError(f"save_pretrained: {name} is a {type(value).__name__} without "
                             "save_pretrained(); pass a transformers PretrainedConfig or None")
    return config, generation


def _stage_tensors(view: PipelineView, j: int, keep: bool) -> "collections.OrderedDict[str, torch.Tensor]":
    """Local stage ``j``'s stored tensors, whole: DTensors gathered one at a time
    (collective over the stage's ranks, which all call it); kept only on the writer."""
    state = view.stages[j].state_dict()
    tensors: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
    for key in _stored_keys(view, j):
        value = state[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            tensors[key] = value
    return tensors


def _remove_own(paths: List[str]) -> None:
    """Removes the staged files this rank wrote (a failed save; rank 0 removes the rest)."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:  # already gone: rank 0 removed the staging directory first
            pass


class HfSave(SaveSession):
    """``save_pretrained``'s session of the save driver (module docstring's phases).

    Args:
        view: the pipeline.
        out_dir: the directory to write into.
        config: the ``config.json`` to write (``None``: none).
        generation_config: the ``generation_config.json`` to write (``None``: none).
    """

    def __init__(self, view: PipelineView, out_dir: str, config: Any, generation_config: Any) -> None:
        self.view = view
        self.directory = out_dir
        self.what = f"save_pretrained {out_dir}"
        self.untouched = "nothing was written"
        self.committed = hf_files.INDEX
        self._configs = (config, generation_config)
        self._created = False  # rank 0 found no out_dir: a failed save removes the one it made
        self._folder = ""
        self._shards: Dict[int, int] = {}  # stage -> its shard's index
        self._own: List[Dict[str, Any]] = []  # the records of the files this rank wrote
        self._records: List[Dict[str, Any]] = []  # every rank's, by file name

    def plan(self) -> Dict[str, Any]:
        """Which stages write a file; rank 0 checks ``out_dir`` and picks a token."""
        view = self.view
        counts = {str(j): len(_stored_keys(view, j)) for j in view.stages if view.is_leader(j)}
        token = ""
        if view.rank == 0:
            hf_directory.check_out_dir(self.directory, "save_pretrained")
            self._created = not os.path.isdir(self.directory)
            token = uuid.uuid4().hex[:12]
        return {"counts": counts, "token": token}

    def agreed(self, gathered: List[Dict[str, Any]]) -> None:
        writing = sorted({int(j) for e in gathered for j, n in e["counts"].items() if n})
        self._folder = hf_directory.staging(self.directory, gathered[0]["token"])
        self._shards = {j: k for k, j in enumerate(writing)}

    def write(self) -> List[Dict[str, Any]]:
        """Each stage's leader writes its shard into the staging directory."""
        view = self.view
        os.makedirs(self._folder, exist_ok=True)
        for j in view.stages:
            tensors = _stage_tensors(view, j, keep=view.is_leader(j))
            if tensors:
                self._own.append(_write_file(self._folder, shard_name(self._shards[j], len(self._shards)),
                                             tensors))
        return self._own

    def written(self, handle: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return handle

    def collect(self, gathered: List[Any]) -> None:
        self._records = sorted((r for rank_records in gathered for r in rank_records), key=lambda r: r["file"])

    def commit(self) -> None:
        """Checks every shard, writes the index and configs, moves them into place."""
        _finish(self._folder, self.directory, self._records, *self._configs)
        hf_directory.discard(self._folder, self.directory, False)

    def abandon(self) -> None:
        """Rank 0 removes the staging directory (and an ``out_dir`` it created), the
        others the files they wrote."""
        if self.view.rank == 0:
            hf_directory.discard(self._folder, self.directory, self._created)
        else:
            _remove_own([os.path.join(self._folder, r["file"]) for r in self._own])

    def result(self) -> Dict[str, str]:
        """The index's ``weight_map``."""
        return {k: r["file"] for r in self._records for k in r["tensors"]}


def save_pretrained(pipe: Pipeline, out_dir: str, config: Any = None) -> Dict[str, str]:
    """Writes the pipeline's weights as a Hugging Face model directory that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` (the model's own class) loads.

    Collective: every rank calls it with the same ``out_dir`` (on a file system all
    ranks share; checked). Each stage's leader writes its stage's tensors as one
    shard ``model-0000k-of-0000n.safetensors`` (a stage whose tensors all belong to
    another stage, such as a tied head, writes none); DTensor parameters (``mesh=``:
    FSDP, tensor parallelism) are gathered one tensor at a time within the stage's
    ranks to its leader (expert shards over the ep ranks too: ``expert_parallel``), so no rank
    holds more than its stage whole. Rank 0 writes
    ``model.safetensors.index.json``, ``config.json`` and ``generation_config.json``
    (the model's, when it has them). Like transformers' ``save_pretrained`` it adds
    its files to ``out_dir`` and keeps everything else there (a tokenizer, a README,
    other directories); it removes only the shards of a previous save that the new
    one does not name, after the new index is in place. Every file is staged inside
    ``out_dir`` and moved into place whole (``os.replace``), the index last; a failure
    anywhere before the moves leaves ``out_dir`` as it was. A symbolic link
    ``out_dir`` is written through. Keys are the unsplit model's names (those of the
    Hugging Face model the pipeline wraps); a tied weight is stored once, under its
    first name (``model.embed_tokens.weight``), as transformers stores it. An
    asynchronous pipeline is flushed first.

    Args:
        pipe: the pipeline.
        out_dir: the directory to write into (created if missing).
        config: the ``PretrainedConfig`` to write as ``config.json``; by default the
            model's own (``model.config``, kept by ``PipeDream``); ``None`` on a model
            without one writes the weights alone.

    Returns:
        The index's ``weight_map`` (tensor name -> shard file), on every rank.

    Raises:
        ValueError: on every rank: ``out_dir`` is a file, a link to nothing, or holds
            a ``model.safetensors`` (``hf_directory.check_out_dir``), ranks given
            different directories, or a ``config`` without ``save_pretrained``.
        CheckpointError: on every rank: writing failed on some rank, or rank 0 does not
            see a file another rank wrote (nothing was replaced).
    """
    view = pipe.checkpoint_view
    if view.asynchronous:
        pipe.flush()
    out_dir = os.fspath(out_dir)
    config, generation = _hf_parts(pipe, config)
    return driver.save(HfSave(view, out_dir, config, generation))


def _split(state_dict: Mapping[str, torch.Tensor],
           max_shard_bytes: int) -> List["collections.OrderedDict[str, torch.Tensor]"]:
    """``state_dict`` in shards of at most ``max_shard_bytes`` (a bigger tensor alone),
    each tensor once (a tied weight under its first name)."""
    seen = set()
    shards: List["collections.OrderedDict[str, torch.Tensor]"] = [collections.OrderedDict()]
    size = 0
    for key, value in state_dict.items():
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if ident in seen:
            continue
        seen.add(ident)
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append(collections.OrderedDict())
            size = 0
        shards[-1][key] = value
        size += nbytes
    return shards


def write_state_dict(state_dict: Mapping[str, torch.Tensor], out_dir: str, config: Any = None,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> Dict[str, str]:
    """Writes a whole state dict as a Hugging Face directory, in this process, into
    ``out_dir`` as ``save_pretrained`` does (other files kept, the previous save's stale
    shards removed once the new index is in place, every file staged and moved whole).
    Tensors sharing storage (a tied weight under several names) are stored once,
    under the first name.

    Args:
        state_dict: the whole model's tensors.
        out_dir: the directory to write into (created if missing).
        config: the ``PretrainedConfig`` to write as ``config.json``, or ``None``.
        max_shard_bytes: the largest shard (a bigger tensor gets a shard of its own).

    Returns:
        The index's ``weight_map``.

    Raises:
        ValueError: ``out_dir`` is a file, a link to nothing or holds a
            ``model.safetensors`` (``hf_directory.check_out_dir``), or ``config`` has
            no ``save_pretrained``.
        OSError: writing failed (``out_dir`` is left as it was).
    """
    out_dir = os.fspath(out_dir)
    hf_directory.check_out_dir(out_dir, "consolidate")
    config, _ = _hf_parts(None, config)
    shards = _split(state_dict, max_shard_bytes)
    created = not os.path.isdir(out_dir)
    folder = hf_directory.staging(out_dir, uuid.uuid4().hex[:12])
    done = False
    try:
        os.makedirs(folder)
        records = [_write_file(folder, shard_name(k, len(shards)), part) for k, part in enumerate(shards)]
        _finish(folder, out_dir, records, config, None)
        done = True
    finally:
        hf_directory.discard(folder, out_dir, created and not done)
    return {k: r["file"] for r in records for k in r["tensors"]}
