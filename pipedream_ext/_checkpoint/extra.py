"""The ``extra`` object of a save: what ``torch.load(weights_only=True)`` can load."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_extra"]


def check_extra(value: Any, where: str = "extra") -> None:
    """Refuses what would not load with ``torch.load(weights_only=True)``.

    Args:
        value: the object (plain containers, numbers, strings and tensors only).
        where: its path inside ``extra``, for the message.

    Raises:
        ValueError: a value or a dict key of another type (naming where it is).
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_extra(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ValueError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_extra(item, f"{where}[{key!r}]")
        return
    raise ValueError(f"{where} is a {type(value).__name__}; extra may hold only dicts, lists, "
                     "tuples, str, int, float, bool, None and tensors (it is loaded with "
                     "torch.load(weights_only=True))")
