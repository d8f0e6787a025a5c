"""Turns inside an overlapped F&B pair (csrc/runtime/overlap.h): :func:`yield_turn`.

With ``PipeDream(schedule="dualpipev", overlap=True)`` the executor runs each pair's
forward and backward on two threads that take turns, so that every rank issues its
collectives in one order. Code inside either half yields its turn right after issuing an
asynchronous collective, before waiting for it: the other half computes meanwhile.
"""
from __future__ import annotations

from .._extension import _C

__all__ = ["BACKWARD", "FORWARD", "yield_turn"]

#: The half of the pair calling :func:`yield_turn`.
FORWARD, BACKWARD = "forward", "backward"
_DIRECTIONS = {FORWARD: 0, BACKWARD: 1}


def yield_turn(direction: str) -> bool:
    """Lets the other half of the running F&B pair run until it yields or ends.

    Call it in a forward (``"forward"``) or in an autograd backward (``"backward"``),
    right after issuing an asynchronous collective (``async_op=True``) and before
    ``work.wait()``. Outside an overlapped pair, or from the half not holding the turn
    (a forward recomputed inside a backward), it returns at once.

    Args:
        direction: ``"forward"`` or ``"backward"``.

    Returns:
        Whether the other half ran.

    Raises:
        ValueError: another direction.
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"yield_turn({direction!r}): give 'forward' or 'backward'")
    return bool(_C.overlap_yield(_DIRECTIONS[direction]))
