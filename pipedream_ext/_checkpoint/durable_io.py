"""Durable file I/O: atomic writes (tmp file, fsync, rename), sha256, verified loads.

Every file of a checkpoint is written as ``<name>.tmp``, fsynced and renamed into
place (:func:`atomic_write`), so a reader sees either the old file or the whole
new one; :func:`load_verified` checks a file's size and sha256 against the record
the manifest keeps before it unpickles anything (``weights_only=True``).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, BinaryIO, Callable, Dict, Mapping, Optional, Union

import torch

from .._dist import signals
from .errors import CheckpointError

__all__ = ["PathLike", "HashingWriter", "fsync_directory", "atomic_write", "atomic_torch_save",
           "sha256_of", "inside", "verified_path", "load_verified"]

PathLike = Union[str, "os.PathLike[str]"]

_READ_CHUNK = 1 << 22


class HashingWriter:
    """A write-only file object that hashes and counts what passes through."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        """Writes ``data`` (any buffer) to the file, hashing and counting it."""
        view = memoryview(data)
        if self._file.closed:
            # torch.save's C++ writer ends its archive in its destructor; after an
            # interrupted save (SIGTERM) that runs once `with open` closed the file, and
            # an exception there aborts the process. The save failed and its .tmp goes.
            return view.nbytes
        self._hash.update(view)
        self.size += view.nbytes
        return self._file.write(view)

    def flush(self) -> None:
        """Flushes the file."""
        self._file.flush()

    def hexdigest(self) -> str:
        """The sha256 of everything written so far."""
        return self._hash.hexdigest()


def fsync_directory(directory: str) -> None:
    """Makes the directory's entries (renames, new files) durable, where the platform can."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse
        pass
    finally:
        os.close(fd)


def atomic_write(directory: str, name: str, write: Callable[[BinaryIO], None],
                 sync_directory: bool = False) -> None:
    """Writes ``directory/name`` via a fsynced ``<name>.tmp`` and ``os.replace``.

    Args:
        directory: where the file goes.
        name: the file's name.
        write: writes the content into the open ``.tmp`` file (binary).
        sync_directory: also fsync the directory, so the rename itself is durable.

    Raises:
        Exception: whatever ``write`` or the file system raised; the ``.tmp`` file
            is removed and an existing ``directory/name`` is left as it was.
    """
    final = os.path.join(directory, name)
    tmp = final + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if sync_directory:
        fsync_directory(directory)


def atomic_torch_save(obj: Any, directory: str, name: str) -> Dict[str, Any]:
    """``torch.save`` to ``directory/name`` atomically (:func:`atomic_write`).

    Args:
        obj: what to save.
        directory: where the file goes.
        name: the file's name.

    Returns:
        ``{"file": name, "bytes": size, "sha256": hex digest}`` of what was written.
    """
    writers = []

    def save(f: BinaryIO) -> None:
        writers.append(HashingWriter(f))
        with signals.deferred():  # a signal inside torch.save's writer breaks it
            torch.save(obj, writers[0])  # type: ignore[arg-type]

    atomic_write(directory, name, save)
    return {"file": name, "bytes": writers[0].size, "sha256": writers[0].hexdigest()}


def sha256_of(path: str) -> str:
    """The sha256 (hex) of a file's content, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def inside(directory: str, name: str, what: str, listed_in: str) -> str:
    """``directory/name``, where that is a plain name whose file (links followed) is
    inside ``directory``: names in a checkpoint come from a file anyone could have
    written, and a link could lead a load to any file of the machine.

    Args:
        directory: the directory the name is in.
        name: the name, as a file lists it.
        what: what the file holds, for messages.
        listed_in: the file listing the name, for messages.

    Returns:
        The path ``directory/name``.

    Raises:
        CheckpointError: a name with a directory part (``..``, an absolute path) or a
            symbolic link leading out of ``directory``, naming it.
    """
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise CheckpointError(f"{listed_in}: bad file name {name!r} for {what} (a plain name in "
                              f"{directory} is expected); the checkpoint was altered or damaged")
    full = os.path.join(directory, name)
    real, base = os.path.realpath(full), os.path.realpath(directory)
    if os.path.commonpath([real, base]) != base or real == base:
        raise CheckpointError(f"{full} ({what}) is a symbolic link to {real}, outside {directory}; a "
                              "checkpoint's files must be inside its directory: copy the file in "
                              "instead of linking it")
    return full


def verified_path(directory: str, record: Mapping[str, Any], what: str, listed_in: str,
                  check_sha256: bool = True) -> str:
    """The full path of a file a record names, after checking it.

    Args:
        directory: the checkpoint directory.
        record: ``{"file", "bytes", "sha256"}`` as :func:`atomic_torch_save` returned it.
        what: what the file holds, for messages (``"weights of stage 0, layers 0..2"``).
        listed_in: the file holding the record (the manifest), for messages.
        check_sha256: also hash the file (``False``: existence and size only, where
            another rank hashes it).

    Returns:
        ``directory/record["file"]``.

    Raises:
        CheckpointError: a bad file name (:func:`inside`), or the file is missing, has
            another size (truncated, overwritten) or another sha256 (corrupt).
    """
    name = record.get("file")
    full = inside(directory, name, what, listed_in)  # type: ignore[arg-type]
    if not os.path.isfile(full):
        raise CheckpointError(f"{directory} is not a complete checkpoint: {name} ({what}) is missing")
    size = os.path.getsize(full)
    if size != record.get("bytes"):
        raise CheckpointError(f"{full} ({what}) has {size} bytes but the manifest says "
                              f"{record.get('bytes')}: the file is truncated or was overwritten")
    if check_sha256 and sha256_of(full) != record.get("sha256"):
        raise CheckpointError(f"{full} ({what}) does not match the sha256 in the manifest: "
                              "the file is corrupt")
    return full


def load_verified(directory: str, record: Mapping[str, Any], what: str, listed_in: str,
                  map_location: Union[str, torch.device],
                  cache: Optional[Dict[str, Any]] = None) -> Any:
    """Verifies a file a record names (:func:`verified_path`) and loads it.

    Args:
        directory: the checkpoint directory.
        record: the file's record (name, size, sha256).
        what: what the file holds, for messages.
        listed_in: the file holding the record, for messages.
        map_location: where the loaded tensors go.
        cache: file name -> loaded object, so a file read by several keys loads once.

    Returns:
        The object, loaded with ``torch.load(..., weights_only=True)``.

    Raises:
        CheckpointError: the file fails verification or cannot be unpickled.
    """
    name = str(record.get("file"))
    if cache is not None and name in cache:
        return cache[name]
    full = verified_path(directory, record, what, listed_in)
    try:
        obj = torch.load(full, map_location=map_location, weights_only=True)
    except Exception as exc:  # any unpickling failure, reported with the file
        raise CheckpointError(f"{full} ({what}) cannot be loaded with torch.load(weights_only=True): "
                              f"{type(exc).__name__}: {exc}") from exc
    if cache is not None:
        cache[name] = obj
    return obj
