"""The manifest: ``manifest.json``, a checkpoint's only entry point.

It lists the model's layers, the pipeline that saved it, and per stage its layer
range, ranks and files (name, size, sha256, the tensors' names, shapes and
dtypes); a DCP checkpoint (``"storage": "dcp"``) lists its DCP directory and that
directory's files instead. This module writes and checks it (a storage's own
fields: that storage's ``check_manifest``, given by ``storages.read_manifest``),
answers which stage's file holds a layer or a ``state_dict`` key, and checks a
pipeline's layers against it. Layout and fields: docs/checkpoints.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch

from . import durable_io
from .durable_io import PathLike
from .errors import CheckpointError
from .view import PipelineView

__all__ = ["layer_type", "MANIFEST", "FORMAT", "FORMAT_VERSION", "CheckpointInfo", "parse_manifest",
           "write_manifest", "manifest_text", "stage_of_layer", "owner_of_key", "stage_what", "load_file",
           "check_model_kind", "check_layers"]

#: Name of the manifest inside a checkpoint directory.
MANIFEST = "manifest.json"
#: Value of the manifest's ``format`` field.
FORMAT = "pipedream_ext-checkpoint"
#: The newest manifest version this package reads.
FORMAT_VERSION = 2

_INNERMOST = re.compile(r"[\[{][^\[\]{}]*[\]}]")
_FLAT_DICT = re.compile(r"\{(?:[^{}\[\]]|\[[^\[\]\n]*\])*\}")

StageRecord = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`save_checkpoint` wrote or :func:`load_checkpoint` restored.

    Attributes:
        path: the checkpoint directory.
        generation: the save's generation number (1 for the first save into ``path``).
        step: the ``step`` given to :func:`save_checkpoint` (``None`` if none was).
        extra: the ``extra`` object given by rank 0 (``None`` if none was); its
            tensors are loaded on the CPU.
        manifest: the parsed ``manifest.json``.
    """

    path: str
    generation: int
    step: Optional[int]
    extra: Any
    manifest: Dict[str, Any]


def manifest_text(manifest: Mapping[str, Any]) -> str:
    """Indented JSON with small containers (shapes, layers, records) on one line."""
    text = json.dumps(manifest, indent=1)
    for pattern in (_INNERMOST, _FLAT_DICT):
        text = pattern.sub(lambda m: re.sub(r"\s*\n\s*", " ", m.group(0)), text)
    return text + "\n"


def write_manifest(directory: str, manifest: Mapping[str, Any]) -> None:
    """Writes ``manifest.json`` atomically (tmp file, fsync, rename, directory fsync).

    Args:
        directory: the checkpoint directory.
        manifest: the manifest (JSON-serialisable).
    """
    data = manifest_text(manifest).encode("utf-8")
    durable_io.atomic_write(directory, MANIFEST, lambda f: f.write(data), sync_directory=True)


def _check_header(manifest: Any, manifest_path: str) -> None:
    """Refuses another format or a newer version."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a pipedream_ext checkpoint manifest "
                              f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path} has format version {version!r}; this pipedream_ext "
                              f"reads versions up to {FORMAT_VERSION} (upgrade pipedream_ext)")


def _check_contents(manifest: Mapping[str, Any], check_storage: Callable[[Mapping[str, Any]], None]) -> None:
    """Raises KeyError, TypeError or ValueError unless the storage's fields check out
    (``check_storage``), the stages cover every layer once, in order, and the counters are valid."""
    layers = manifest["layers"]
    check_storage(manifest)
    end = 0
    for j, stage in enumerate(manifest["stages"]):
        start, stop = stage["layers"]
        if stage["stage"] != j or start != end or stop <= start:
            raise ValueError(f"stage {j} covers layers {start}..{stop}, expected to start at {end}")
        end = stop
    if end != len(layers) or manifest["num_layers"] != len(layers):
        raise ValueError(f"the stages cover {end} layers but the model has {len(layers)}")
    for field, optional in (("step", True), ("generation", False)):
        value = manifest.get(field)
        if (value is None and optional) or (isinstance(value, int) and
                                             not isinstance(value, bool) and value >= 0):
            continue
        raise ValueError(f"{field!r} is {value!r} ({type(value).__name__}); it must be a "
                         f"non-negative integer{' or null' if optional else ''} (as "
                         "save_checkpoint writes it)")


def parse_manifest(path: PathLike, check_storage: Callable[[Mapping[str, Any]], None]) -> Dict[str, Any]:
    """Reads and checks the manifest of a checkpoint (no files are loaded); the
    package's ``read_manifest`` (``storages.py``) gives the storage's check.

    Args:
        path: the checkpoint directory.
        check_storage: checks the fields of the storage the manifest names; raises
            KeyError, TypeError or ValueError (an unknown storage: ValueError).

    Returns:
        The parsed ``manifest.json``.

    Raises:
        CheckpointError: no directory, no manifest ("not a complete checkpoint"),
            invalid JSON, another format, a newer version, or inconsistent stages or
            storage fields.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: {MANIFEST} is missing (the save did not "
            "finish, or this directory is not a pipedream_ext checkpoint)")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
    _check_header(manifest, manifest_path)
    try:
        _check_contents(manifest, check_storage)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is inconsistent: {type(exc).__name__}: {exc}") from exc
    return manifest


def load_file(directory: str, record: Mapping[str, Any], what: str,
              map_location: Union[str, torch.device], cache: Optional[Dict[str, Any]] = None) -> Any:
    """Loads a file the manifest names, after checking its size and sha256
    (:func:`durable_io.load_verified`; messages name the manifest)."""
    return durable_io.load_verified(directory, record, what, os.path.join(directory, MANIFEST),
                                    map_location, cache)


def stage_of_layer(manifest: Mapping[str, Any]) -> List[StageRecord]:
    """For each layer index of the original model, the manifest's record of its stage."""
    owner: List[StageRecord] = []
    for stage in manifest["stages"]:
        start, stop = stage["layers"]
        owner.extend([stage] * (stop - start))
    return owner


def _traced_owner(manifest: Mapping[str, Any]) -> Callable[[str], StageRecord]:
    """:func:`owner_of_key` for a traced model: the stage whose file lists the key."""
    # A name several stages list (a parameter read on both sides of a cut) is
    # stored by one and listed "same_as" itself by the others: that one owns it.
    listed = {key: stage for stage in manifest["stages"]
              for key, record in stage["model"].get("tensors", {}).items()
              if "same_as" not in record}
    listed.update({key: stage for stage in manifest["stages"]
                   for key in stage["model"].get("tensors", {}) if key not in listed})

    def owner(key: str) -> StageRecord:
        if key not in listed:
            raise CheckpointError(f"the checkpoint has no entry for {key!r}, which this model "
                                  "has (missing parameter or buffer)")
        return listed[key]
    return owner


def owner_of_key(manifest: Mapping[str, Any]) -> Callable[[str], StageRecord]:
    """``key -> the manifest's record of the stage whose weights file lists key``.

    An ``nn.Sequential``'s key belongs to the stage of its layer (its first name
    component); a traced model's (``split_points`` in the manifest) to the stage
    whose file lists it, so it loads into any other split by name.

    Args:
        manifest: a manifest :func:`read_manifest` accepted.

    Returns:
        The lookup; it raises ``CheckpointError`` (traced) or ``KeyError``
        (``nn.Sequential``: an unknown layer) for a key the checkpoint lacks.
    """
    if "split_points" in manifest:
        return _traced_owner(manifest)
    owner = stage_of_layer(manifest)
    layer_index = {layer["name"]: i for i, layer in enumerate(manifest["layers"])}
    return lambda key: owner[layer_index[key.split(".", 1)[0]]]


def stage_what(stage: Mapping[str, Any], kind: str) -> str:
    """A stage file's description for messages: ``"weights of stage 1, layers 3..5"``."""
    start, stop = stage["layers"]
    return f"{kind} of stage {stage['stage']}, layers {start}..{stop - 1}"


def check_model_kind(manifest_path: str, manifest: Mapping[str, Any], view: PipelineView) -> None:
    """Refuses a traced checkpoint for an ``nn.Sequential`` pipeline and the reverse.

    Raises:
        CheckpointError: the kinds differ.
    """
    if ("split_points" in manifest) != (view.split_points is not None):
        saved, here = (("a traced model (split_points)", "an nn.Sequential")
                       if "split_points" in manifest else
                       ("an nn.Sequential", "a traced model (split_points)"))
        raise CheckpointError(f"{manifest_path} was saved from {saved} but this pipeline runs "
                              f"{here}; load it into a pipeline built the same way, or load "
                              "pd.consolidate(path) with pipe.load_state_dict")


def layer_type(module: torch.nn.Module) -> str:
    """A layer's class as the manifest records it: its ``__qualname__``, FSDP2's
    ``fully_shard`` wrapper class (``FSDPLinear``, bases ``(FSDPModule, Linear)``)
    unwrapped, so a sharded layer matches the plain one."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        cls = bases[1]
    return cls.__qualname__


def check_layers(manifest_path: str, manifest: Mapping[str, Any], view: PipelineView) -> None:
    """An ``nn.Sequential``: the same number of layers, and every local layer has the
    saved name and class.

    Raises:
        CheckpointError: another layer count, or a local layer with another name or class.
    """
    layers = manifest["layers"]
    num_layers = sum(view.balance)
    if len(layers) != num_layers:
        raise CheckpointError(
            f"{manifest_path}: the checkpoint's model has {len(layers)} layers "
            f"({', '.join(l['name'] + ':' + l['type'] for l in layers[:12])}"
            f"{', ...' if len(layers) > 12 else ''}) but this pipeline's model has {num_layers}")
    for j, module in view.stages.items():
        start = view.stage_layers[j][0]
        for i, (name, child) in enumerate(module.named_children(), start):
            saved = layers[i]
            if saved["name"] != name or saved["type"] != layer_type(child):
                raise CheckpointError(
                    f"{manifest_path}: layer {i} is {saved['name']!r} ({saved['type']}) in the "
                    f"checkpoint but {name!r} ({layer_type(child)}) in this model; "
                    "the checkpoint was saved from a different model")
