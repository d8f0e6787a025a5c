"""argparse ``type=`` converters the commands share."""
from __future__ import annotations

import argparse
from typing import Callable, List, TypeVar

__all__ = ["float_list", "int_list"]

_Number = TypeVar("_Number", int, float)


def int_list(text: str) -> List[int]:
    """``"4,4"`` -> ``[4, 4]``.

    Raises:
        argparse.ArgumentTypeError: not integers, or none at all.
    """
    return _number_list(text, int, "integers", "4,4")


def float_list(text: str) -> List[float]:
    """``"16e9,1.25e9"`` -> ``[16e9, 1.25e9]``.

    Raises:
        argparse.ArgumentTypeError: not numbers, or none at all.
    """
    return _number_list(text, float, "numbers", "16e9,1.25e9")


def _number_list(text: str, convert: Callable[[str], _Number], noun: str, example: str) -> List[_Number]:
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {noun}, e.g. {example}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one of the {noun}, e.g. {example}")
    return values
