"""The table of formats: the one place a format's name is looked up, and which
format a path holds.

``save_checkpoint(format=...)`` and a manifest's ``storage`` field name a
checkpoint row of :data:`STORAGES`; ``consolidate(format=...)`` a row that writes
state dicts; :func:`detect` asks the rows which one holds a path, and
:func:`load_path` reads it with that row. Nothing else in the package compares
format names. Adding a format: a :class:`~.storage.CheckpointStorage` subclass
(its own folder) and its row here. This module alone imports every format; the
formats import only the shared modules below them (pyproject.toml's contract).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

from . import manifest as manifest_format
from .dcp.storage import DcpStorage
from .durable_io import PathLike
from .hf.storage import HF
from .manifest import MANIFEST
from .reshard import IncompatibleKeys
from .stage_files.storage import StageFilesStorage
from .storage import CheckpointStorage
from .torch_file import TorchFileStorage
from .view import Pipeline

__all__ = ["STORAGES", "DEFAULT", "FORMATS", "WRITERS", "storage_named", "state_dict_writer", "storage_name",
           "storage_of", "read_manifest", "open_manifest", "detect", "load_path"]

#: Every format by its name, checkpoint formats first, in the order messages list them.
STORAGES: Dict[str, CheckpointStorage] = {
    s.name: s for s in (StageFilesStorage(), DcpStorage(), HF, TorchFileStorage())}
#: ``save_checkpoint``'s default format, and the storage of manifests without a
#: ``storage`` field (written before DCP checkpoints existed).
DEFAULT = StageFilesStorage.name
#: The values of ``save_checkpoint(format=...)``.
FORMATS = tuple(name for name, s in STORAGES.items() if s.checkpoints)
#: The values of ``consolidate(format=...)``, besides ``None``.
WRITERS = tuple(name for name, s in STORAGES.items() if s.writes_state_dicts)


def _checkpoint_formats() -> Dict[str, CheckpointStorage]:
    return {name: s for name, s in STORAGES.items() if s.checkpoints}


def storage_named(format: Any) -> CheckpointStorage:
    """The storage ``save_checkpoint(format=format)`` writes with.

    Raises:
        ValueError: no checkpoint format has that name (the message lists the choices).
    """
    storage = _checkpoint_formats().get(format) if isinstance(format, str) else None
    if storage is None:
        raise ValueError(f"format={format!r} is not a checkpoint format; use "
                         f"{' or '.join(repr(f) for f in FORMATS)}")
    return storage


def state_dict_writer(format: Any) -> Optional[CheckpointStorage]:
    """The format ``consolidate(format=format)`` writes with (``None``: no such writer)."""
    storage = STORAGES.get(format) if isinstance(format, str) else None
    return storage if storage is not None and storage.writes_state_dicts else None


def storage_name(manifest: Mapping[str, Any]) -> str:
    """The ``storage`` a manifest names (:data:`DEFAULT` without the field)."""
    return str(manifest.get("storage", DEFAULT))


def storage_of(manifest: Mapping[str, Any]) -> CheckpointStorage:
    """The storage that wrote a checkpoint, by its manifest.

    Raises:
        ValueError: this pipedream_ext has no checkpoint format of that name.
    """
    readable = _checkpoint_formats()
    storage = readable.get(storage_name(manifest))
    if storage is None:
        raise ValueError(f"unknown storage {storage_name(manifest)!r} (this pipedream_ext reads "
                         f"{', '.join(readable)})")
    return storage


def _check_storage(manifest: Mapping[str, Any]) -> None:
    storage_of(manifest).check_manifest(manifest)


def read_manifest(path: PathLike) -> Dict[str, Any]:
    """Reads and checks the manifest of a checkpoint (no files are loaded).

    Args:
        path: the checkpoint directory.

    Returns:
        The parsed ``manifest.json``.

    Raises:
        CheckpointError: no directory, no manifest ("not a complete checkpoint"),
            invalid JSON, another format, a newer version, an unknown storage, or
            inconsistent stages or storage fields.
    """
    return manifest_format.parse_manifest(path, _check_storage)


def open_manifest(path: str) -> Tuple[Dict[str, Any], CheckpointStorage]:
    """:func:`read_manifest` and the format it names (``load_checkpoint``'s first step).

    Raises:
        CheckpointError: as :func:`read_manifest`.
    """
    manifest = read_manifest(path)
    return manifest, storage_of(manifest)


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
    weights = [s for s in STORAGES.values() if not s.checkpoints]
    holder = next((s for s in weights if s.holds(path)), None)
    if holder is not None:
        return holder.name
    what = "no such file or directory" if not os.path.exists(path) else "not a format pipedream_ext reads"
    kinds = [f"a checkpoint directory (with {MANIFEST})"] + [s.looks_like for s in weights]
    raise ValueError(f"{path}: {what}; pass {', '.join(kinds[:-1])} or {kinds[-1]}")


def load_path(pipe: Pipeline, path: PathLike, strict: bool = True) -> IncompatibleKeys:
    """``pipe.load_state_dict(path)``: a Hugging Face directory or ``.safetensors`` file
    (each rank reads its share), or a ``torch.save`` file (memory-mapped).

    Raises:
        ValueError: a checkpoint directory (naming ``pd.load_checkpoint``) or another path.
    """
    path = os.fspath(path)
    storage = STORAGES[detect(path)]
    if storage.checkpoints:
        raise ValueError(f"load_state_dict({path!r}): a {storage.name!r} checkpoint directory; restore it "
                         "with pd.load_checkpoint(path, pipe), or pass pd.consolidate(path)")
    return storage.load_path(pipe, path, strict)
