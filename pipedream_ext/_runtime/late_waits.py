"""Receive waits that a later message released, read from a merged Chrome trace.

A rank waiting for a transfer whose data its peer sent before the wait began should
have it at once. If the wait lasts while the peer computes its next message to this
rank and ends only after the peer starts sending that one, the receiving side did not
take the data that was there: it waited for something posted later, or the transport
did not move the bytes until the peer's threads let it (docs/runtime.md, "Receives
that wait for a later message", names both). :func:`late_receive_waits` counts such
waits from the order of the trace's events, not from their durations.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .. import schedules

__all__ = ["LateWait", "late_receive_waits"]

Span = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LateWait:
    """One receive wait that ended only after the peer started a later send to this rank.

    Attributes:
        rank: the waiting rank.
        wait: the wait's span name (``"2RECV_B3"``).
        peer: the sending rank.
        sent: the matching send (``"3SEND_B3"``), which ended before the wait began.
        released_after: the peer's later send to this rank (``"3SEND_B4"``), whose
            producing compute action began after the wait began.
        start_us: when the wait began (the trace's microseconds).
        wait_us: the wait's duration (microseconds).
        sent_before_us: how long before the wait began the matching send ended.
        ended_after_us: how long after the later send began the wait ended.
    """

    rank: int
    wait: str
    peer: int
    sent: str
    released_after: str
    start_us: int
    wait_us: int
    sent_before_us: int
    ended_after_us: int


def _load(trace: Union[str, os.PathLike, Mapping[str, Any]]) -> List[Span]:
    if isinstance(trace, Mapping):
        return list(trace["traceEvents"])
    with open(trace) as f:
        return list(json.load(f)["traceEvents"])


def _transfer(name: str) -> Optional[Tuple[schedules.TransferKey, bool]]:
    """The transfer a span is one end of, and whether it is the sending end: ``2RECV_B3``
    and ``3SEND_B3`` are the two ends of one transfer. ``None`` for other spans."""
    try:
        action = schedules.Action.parse(name)
    except ValueError:
        return None  # "wait for sends", all-reduce waits
    if not action.is_comm:
        return None
    return action.transfer, action.kind in (schedules.ActionKind.SEND_F, schedules.ActionKind.SEND_B)


Ends = Dict[Tuple[schedules.TransferKey, bool], List[Span]]


def _occurrences(spans: List[Span]) -> Ends:
    """Transfer spans by transfer and end (sending or receiving), each list in time
    order (one entry per step)."""
    ends: Ends = collections.defaultdict(list)
    for e in spans:
        end = _transfer(e["name"])
        if end is not None:
            ends[end].append(e)
    return ends


def _end(e: Span) -> int:
    return e["ts"] + e["dur"]


def late_receive_waits(trace: Union[str, os.PathLike, Mapping[str, Any]]) -> List[LateWait]:
    """The receive waits of a merged trace (``PipeDream(trace=...)``, ``write_trace()``)
    that a later message released.

    A wait for transfer X on rank r counts when the peer's send of X ended before the
    wait began, and the wait ended only after the peer started its next send to r
    whose producing compute action (the compute span before that send on the peer's
    track) began after the wait began: the wait outlasted a whole computation of the
    peer although its own data was already sent. The n-th span of a send's name is
    matched with the n-th of its receive's (one per step).

    Args:
        trace: the trace file's path, or its loaded JSON.

    Returns:
        One :class:`LateWait` per such wait, in time order.
    """
    spans = sorted((e for e in _load(trace) if e.get("ph") == "X"), key=lambda e: (e["ts"], e["pid"]))
    ends = _occurrences(spans)
    track: Dict[int, List[Span]] = collections.defaultdict(list)
    for e in spans:
        track[e["pid"]].append(e)
    position = {id(e): k for events in track.values() for k, e in enumerate(events)}
    late: List[LateWait] = []
    for (key, send), waits in ends.items():
        if send:
            continue
        for wait, sent in zip(waits, ends.get((key, True), [])):
            if _end(sent) > wait["ts"]:
                continue  # the data was not sent yet when the wait began
            after = _released_after(track[sent["pid"]], position[id(sent)], wait, ends)
            if after is not None:
                late.append(LateWait(wait["pid"], wait["name"], sent["pid"], sent["name"], after["name"], wait["ts"],
                                     wait["dur"], wait["ts"] - _end(sent), _end(wait) - after["ts"]))
    return sorted(late, key=lambda w: (w.start_us, w.rank))


def _released_after(peer_track: List[Span], start: int, wait: Span, ends: Ends) -> Optional[Span]:
    """The peer's first send to the waiting rank after ``peer_track[start]`` whose
    producer began after ``wait`` began, if it started before the wait ended."""
    producer: Optional[Span] = None
    for e in peer_track[start + 1:]:
        if e["ts"] >= _end(wait):
            return None
        if e.get("cat") == "compute":
            producer = e
            continue
        if e.get("cat") != "send" or not _to_rank(e, wait["pid"], ends):
            continue
        if producer is not None and producer["ts"] > wait["ts"]:
            return e
    return None


def _to_rank(send: Span, rank: int, ends: Ends) -> bool:
    """Whether ``send`` goes to ``rank`` (the rank that waits for it)."""
    end = _transfer(send["name"])
    receives = ends.get((end[0], False), []) if end is not None else []
    return bool(receives) and receives[0]["pid"] == rank
