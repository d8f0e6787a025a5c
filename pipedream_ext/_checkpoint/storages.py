"""The checkpoint storages by name: the one table a format's name is looked up in.

``save_checkpoint(format=...)`` and a manifest's ``storage`` field both name a row
of :data:`STORAGES`; nothing else in the package compares format names. Adding a
format: a :class:`~.storage.CheckpointStorage` subclass (its own module) and its
row here.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

from . import manifest as manifest_format
from .dcp.storage import DcpStorage
from .durable_io import PathLike
from .stage_files.storage import StageFilesStorage
from .storage import CheckpointStorage

__all__ = ["STORAGES", "DEFAULT", "FORMATS", "storage_named", "storage_name", "storage_of",
           "read_manifest"]

#: Every storage by its name, in the order messages list them.
STORAGES: Dict[str, CheckpointStorage] = {s.name: s for s in (StageFilesStorage(), DcpStorage())}
#: ``save_checkpoint``'s default format, and the storage of manifests without a
#: ``storage`` field (written before DCP checkpoints existed).
DEFAULT = StageFilesStorage.name
#: The values of ``save_checkpoint(format=...)``.
FORMATS = tuple(STORAGES)


def storage_named(format: Any) -> CheckpointStorage:
    """The storage ``save_checkpoint(format=format)`` writes with.

    Raises:
        ValueError: no storage has that name (the message lists the choices).
    """
    storage = STORAGES.get(format) if isinstance(format, str) else None
    if storage is None:
        raise ValueError(f"format={format!r} is not a checkpoint format; use "
                         f"{' or '.join(repr(f) for f in FORMATS)}")
    return storage


def storage_name(manifest: Mapping[str, Any]) -> str:
    """The ``storage`` a manifest names (:data:`DEFAULT` without the field)."""
    return str(manifest.get("storage", DEFAULT))


def storage_of(manifest: Mapping[str, Any]) -> CheckpointStorage:
    """The storage that wrote a checkpoint, by its manifest.

    Raises:
        ValueError: this pipedream_ext has no storage of that name.
    """
    name = storage_name(manifest)
    if name not in STORAGES:
        raise ValueError(f"unknown storage {name!r} (this pipedream_ext reads {', '.join(STORAGES)})")
    return STORAGES[name]


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
