"""Generations: one number per completed save, in every file name it writes.

A new save's files never take the name of a file the current manifest names, and
superseded files are deleted only after the new manifest is in place, so a crash
at any moment leaves the previous checkpoint loadable. A save that failed removes
its own generation's files (:func:`remove_generation`), never another's.

Only what this package wrote is ever deleted: a name it writes (``g`` and at least
six digits: ``model_file``'s, ``dcp_directory``'s) of the kind it writes there (a
regular file, not a link; a DCP directory holding only what ``dcp.save`` writes).
Anything else in the directory, whatever its name, is the user's and stays.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Sequence

from .errors import CheckpointError
from .manifest import FORMAT, MANIFEST

__all__ = ["model_file", "optimizer_file", "extra_file", "dcp_directory", "next_generation",
           "remove_superseded", "remove_generation"]

_log = logging.getLogger(__name__)

# The names of the files and DCP directories this package writes in a checkpoint
# directory (``{generation:06d}``, ``stage{stage:03d}``): the only names deleted.
_OWN_FILE = re.compile(r"^g(\d{6,})-(?:(?:stage\d{3,}-(?:model|optim)|extra)\.pt(?:\.tmp)?|dcp)$")
# What dcp.save (FileSystemWriter) writes into its directory: the only entries a DCP
# directory may hold to be deleted as ours.
_DCP_ENTRY = re.compile(r"(?:__\d+)?\.metadata(?:\.tmp)?|__\d+_\d+\.distcp")


def model_file(generation: int, stage: int) -> str:
    """The name of a stage's weights file."""
    return f"g{generation:06d}-stage{stage:03d}-model.pt"


def optimizer_file(generation: int, stage: int) -> str:
    """The name of a stage's optimizer file."""
    return f"g{generation:06d}-stage{stage:03d}-optim.pt"


def extra_file(generation: int) -> str:
    """The name of the file holding ``extra``."""
    return f"g{generation:06d}-extra.pt"


def dcp_directory(generation: int) -> str:
    """The name of the directory a DCP save writes (``save_checkpoint(format="dcp")``)."""
    return f"g{generation:06d}-dcp"


def _manifest_generation(directory: str) -> int:
    """The generation ``directory``'s manifest names (0: none, or a damaged manifest).

    Raises:
        CheckpointError: ``manifest.json`` belongs to something else than a checkpoint.
    """
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.exists(manifest_path):
        return 0
    try:
        with open(manifest_path, encoding="utf-8") as f:
            old = json.load(f)
    except ValueError:
        return 0  # a damaged manifest: the new save replaces it
    if not isinstance(old, dict):
        return 0
    if old.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} exists and is not a pipedream_ext checkpoint "
                              "manifest; refusing to overwrite it (choose another path)")
    generation = old.get("generation")
    return generation if isinstance(generation, int) else 0


def next_generation(directory: str) -> int:
    """1 + the newest generation found in ``directory`` (manifest or leftover files).

    Args:
        directory: the checkpoint directory (it exists).

    Returns:
        The new save's generation.

    Raises:
        CheckpointError: ``directory`` has a ``manifest.json`` of something else.
    """
    generations = [0, _manifest_generation(directory)]
    for name in os.listdir(directory):
        match = _OWN_FILE.match(name)
        if match:
            generations.append(int(match.group(1)))
    return max(generations) + 1


def _own(directory: str, name: str) -> bool:
    """Whether ``directory/name`` is something this package wrote: our name, and a
    regular file (``.pt``) or a DCP directory holding only DCP's files (``-dcp``)."""
    if not _OWN_FILE.match(name):
        return False
    full = os.path.join(directory, name)
    if os.path.islink(full):
        return False
    if name.endswith("-dcp"):
        try:
            return os.path.isdir(full) and all(_DCP_ENTRY.fullmatch(n) for n in os.listdir(full))
        except OSError:  # gone meanwhile (ranks sharing the directory race): nothing to do
            return False
    return os.path.isfile(full)


def remove_superseded(directory: str, keep: Sequence[str]) -> None:
    """Deletes this package's files and DCP directories in ``directory`` that ``keep``
    (the current manifest's) does not name; one that cannot be deleted, or that has
    our name but not our kind (``_own``), is logged and kept."""
    keep_set = set(keep)
    for name in os.listdir(directory):
        if name in keep_set or not _OWN_FILE.match(name):
            continue
        full = os.path.join(directory, name)
        if not _own(directory, name):
            _log.warning("not deleting %s: named like a checkpoint file, but not one this package "
                         "wrote (a link, or a directory holding other files than dcp.save's)", full)
            continue
        try:
            if os.path.isdir(full):
                shutil.rmtree(full)
            else:
                os.remove(full)
        except OSError as exc:  # the checkpoint is complete; leftovers are harmless
            _log.warning("could not delete superseded checkpoint file %s: %s", full, exc)


def _remove(full: str) -> None:
    """Deletes a file or a directory tree; one another rank deleted first is fine."""
    if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full, ignore_errors=True)  # ranks sharing the directory race here
        if os.path.exists(full):
            raise OSError(f"{full} could not be removed")
    else:
        try:
            os.remove(full)
        except FileNotFoundError:
            pass


def remove_generation(directory: str, generation: int) -> None:
    """Deletes the files and DCP directory of a save that failed: only ``generation``'s,
    and nothing if the manifest names that generation.

    Every rank of a failed save calls it (each removes what its own file system
    shows; ranks sharing one race harmlessly); a file that cannot be deleted is
    logged and left for the next successful save.

    Args:
        directory: the checkpoint directory.
        generation: the failed save's generation.
    """
    try:
        if not os.path.isdir(directory) or _manifest_generation(directory) == generation:
            return
        names = os.listdir(directory)
    except (OSError, CheckpointError) as exc:
        _log.warning("not removing the files of the failed save of %s (generation %d): %s",
                     directory, generation, exc)
        return
    for name in names:
        match = _OWN_FILE.match(name)
        if match and int(match.group(1)) == generation and _own(directory, name):
            full = os.path.join(directory, name)
            try:
                _remove(full)
            except OSError as exc:
                _log.warning("could not delete %s of the failed save: %s", full, exc)
