"""The checkpoint directory every rank means: compared across ranks before anything
is written or read.

``save_checkpoint`` and ``load_checkpoint`` are collective over one directory. A
path that differs on one rank (``"ckpt"`` on all but the last, ``"ckpt-typo"``
there) would otherwise split a save over two directories, whose manifest then
names files that are not there, and whose clean-up deletes the previous
checkpoint's files; a load would mix two checkpoints. Each rank reports the path
it was given and the path resolved on its own file system
(``os.path.realpath``: relative to its working directory, symbolic links
followed) in the first exchange of the call; the resolved paths must be equal.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Sequence

__all__ = ["describe", "check_same"]


def describe(directory: str) -> Dict[str, str]:
    """This rank's directory as it reports it: ``{"given": ..., "resolved": ...}``."""
    return {"given": directory, "resolved": os.path.realpath(directory)}


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def check_same(what: str, entries: Sequence[Mapping[str, Any]], consequence: str) -> None:
    """Raises unless every rank's resolved directory is the same.

    Args:
        what: the call, for the message (``"saving checkpoint ckpt"``).
        entries: each rank's :func:`describe`, in group rank order.
        consequence: what did not happen (``"nothing was written or deleted"``).

    Raises:
        ValueError: the ranks resolved different directories; the message names each
            directory with the paths given for it and the ranks that gave them.
    """
    by_resolved: Dict[str, List[int]] = {}
    for rank, entry in enumerate(entries):
        by_resolved.setdefault(entry["resolved"], []).append(rank)
    if len(by_resolved) <= 1:
        return
    parts = []
    for resolved, ranks in by_resolved.items():
        given = sorted({entries[r]["given"] for r in ranks} - {resolved})
        as_given = f" (given as {', '.join(repr(g) for g in given)})" if given else ""
        parts.append(f"{resolved}{as_given} on {_ranks(ranks)}")
    raise ValueError(f"{what}: the ranks were given different directories: {'; '.join(parts)}. "
                     "Every rank must pass the same directory, on a file system all ranks share; "
                     f"{consequence}")
