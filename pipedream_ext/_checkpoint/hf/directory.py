"""Writing a Hugging Face model into the user's directory without losing what is in it.

``save_pretrained`` and ``consolidate(format="hf")`` write into ``out_dir`` as
transformers' ``PreTrainedModel.save_pretrained`` does: the directory is never
replaced, renamed or emptied (a tokenizer, a README, ``runs/``, a project's ``src/``
stay), and the only files removed are weight shards of a previous save, recognised
by transformers' shard name (``model-0000k-of-0000n.safetensors``), that the new
save does not name, once the new index is in place.

Every file is first written into a staging directory inside ``out_dir``
(``.tmp-pipedream-<token>``: the same file system, so a move is an atomic
``os.replace``, and hidden from ``from_pretrained`` and hub uploads), then moved
into ``out_dir`` one by one: the shards, the configs, the index last. A failure
before the moves leaves ``out_dir`` as it was; the staging directory is removed.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import List

from ..durable_io import fsync_directory
from . import files as hf_files

__all__ = ["STAGING_PREFIX", "is_shard", "check_out_dir", "staging", "publish", "discard"]

_log = logging.getLogger(__name__)

#: The staging directory's name in ``out_dir`` is this and a 12-digit hex token.
STAGING_PREFIX = ".tmp-pipedream-"
# transformers' shard names (its stale-shard pattern, ``<weights>-\d{5}-of-\d{5}``,
# for the safetensors weights without a variant): the only files a save removes.
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_STAGING = re.compile(re.escape(STAGING_PREFIX) + r"[0-9a-f]{12}")
# What a staging directory holds besides shards (the configs save_pretrained writes).
_STAGED = {hf_files.INDEX, "config.json", "generation_config.json"}


def is_shard(name: str) -> bool:
    """Whether ``name`` is a weight shard's name as transformers (and this package) writes it."""
    return _SHARD.fullmatch(name) is not None


def _left_by_a_crash(full: str) -> bool:
    """Whether ``full`` is a staging directory a crashed save left: our name, a
    directory (not a link) holding only the files a save stages."""
    if not _STAGING.fullmatch(os.path.basename(full)) or os.path.islink(full) or not os.path.isdir(full):
        return False
    return all(is_shard(n) or n in _STAGED for n in os.listdir(full))


def check_out_dir(out_dir: str, what: str) -> None:
    """Refuses an ``out_dir`` a save cannot write into without a wrong or lost result.

    Args:
        out_dir: the directory to write (it need not exist).
        what: the call, for messages (``"save_pretrained"``).

    Raises:
        ValueError: ``out_dir`` is a file, a symbolic link to nothing, or holds a
            ``model.safetensors``, which ``from_pretrained`` would load instead of
            the new shards and index (and which this package did not write).
    """
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
        raise ValueError(f"{what}: {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does "
                         "not exist; create that directory or pass another out_dir")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{what}: {out_dir} exists and is not a directory; pass a directory (new, "
                         "or one to add the model's files to)")
    single = os.path.join(out_dir, hf_files.SINGLE)
    if os.path.lexists(single):
        raise ValueError(f"{what}: {out_dir} holds {hf_files.SINGLE} (a single-file save), which "
                         f"from_pretrained would load instead of the new shards and "
                         f"{hf_files.INDEX}; move or delete it, or pass another out_dir")


def staging(out_dir: str, token: str) -> str:
    """The staging directory a save writes into (``token``: 12 hex digits, the same on every rank)."""
    return os.path.join(out_dir, f"{STAGING_PREFIX}{token}")


def _order(names: List[str]) -> List[str]:
    """The moves' order: shards, then the configs (and anything else), the index last."""
    return sorted(names, key=lambda n: (n == hf_files.INDEX, not is_shard(n), n))


def _move_all(folder: str, out_dir: str, names: List[str]) -> None:
    """Moves ``names`` from ``folder`` into ``out_dir`` (``os.replace`` each); on a failure
    removes the files it moved that were new (a replaced file cannot come back)."""
    created: List[str] = []
    try:
        for name in names:
            target = os.path.join(out_dir, name)
            existed = os.path.lexists(target)
            os.replace(os.path.join(folder, name), target)
            if not existed:
                created.append(target)
    except BaseException:
        for target in created:
            try:
                os.remove(target)
            except OSError:
                pass
        raise


def publish(folder: str, out_dir: str) -> None:
    """Moves every file of the staging directory ``folder`` into ``out_dir`` (the index
    last), then removes the stale shards: ``model-*-of-*.safetensors`` the new save does
    not name, and staging directories a crashed save left (holding only what a save
    stages; anything else there is kept).

    A new shard that takes the name of an existing file the old index may name would,
    after a crash between two moves, leave the old index over a mixture of old and new
    shards, which loads silently; so the old index is removed first in that case (a
    crash then leaves no index: ``from_pretrained`` fails, it does not mix).

    Args:
        folder: the staging directory, holding only the new save's files (fsynced).
        out_dir: the directory the files go to.

    Raises:
        OSError: a move failed; the new files moved so far are removed.
    """
    names = _order(os.listdir(folder))
    index = os.path.join(out_dir, hf_files.INDEX)
    if os.path.lexists(index) and any(is_shard(n) and os.path.lexists(os.path.join(out_dir, n))
                                      for n in names):
        os.remove(index)
        fsync_directory(out_dir)
    _move_all(folder, out_dir, names)
    fsync_directory(out_dir)
    for name in os.listdir(out_dir):
        full = os.path.join(out_dir, name)
        try:
            if is_shard(name) and name not in names and os.path.isfile(full):
                os.remove(full)
            elif name != os.path.basename(folder) and _left_by_a_crash(full):
                shutil.rmtree(full)
        except OSError as exc:  # the new save is complete; a leftover is harmless
            _log.warning("could not delete the stale %s: %s", full, exc)


def discard(folder: str, out_dir: str, created: bool) -> None:
    """Removes the staging directory ``folder`` and ``out_dir`` too if the save created
    it and it is empty (a failed save leaves nothing behind)."""
    shutil.rmtree(folder, ignore_errors=True)
    if created:
        try:
            os.rmdir(out_dir)
        except OSError:  # not empty, or gone: it is not ours to remove then
            pass
