"""Measured against predicted: one warning when a run differs from its plan.

Owns the comparison of a rank's measured step time with the configuration's predicted
one (``pipe.configuration``, docs/planner.md "Choosing the whole configuration"). The
first steps warm caches and allocators, so the measured step time is the median time
between the ends of steps :data:`FIRST` to :data:`LAST` (the step call, the optimizer
and whatever the loop does between calls: what the prediction's ``overhead`` counts).
More than :data:`TOLERANCE` apart: one ``UserWarning`` (and a log line) naming the term
whose measured seconds per step differ most from the prediction's breakdown for this
rank (compute, waits, transfers, all-reduce, overhead), measured from the executor's
``seconds_by_kind``. Each rank compares its own numbers: no communication.
"""
from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

from ..configuration import measured_breakdown

__all__ = ["FIRST", "LAST", "TOLERANCE", "PredictionCheck", "measured_terms"]

_log = logging.getLogger("pipedream_ext._pipe")

#: The measured steps (0-based): the time between the ends of steps FIRST - 1 and LAST.
FIRST, LAST = 3, 7
#: The relative difference of measured and predicted step time that warns.
TOLERANCE = 0.25


def measured_terms(before: Dict[str, float], after: Dict[str, float], steps: int,
                   step_seconds: float) -> Dict[str, float]:
    """Seconds per step of each term of a prediction's breakdown, measured
    (``configuration.measured_breakdown`` of what the spans added between two readings).

    Args:
        before: ``seconds_by_kind`` at the start of the measured steps.
        after: ``seconds_by_kind`` at their end.
        steps: how many steps lie between.
        step_seconds: the measured step time (overhead is what the other terms leave).
    """
    return measured_breakdown({k: t - before.get(k, 0.0) for k, t in after.items()}, steps,
                              step_seconds)


class PredictionCheck:
    """Compares one rank's step time with its prediction once, after the first steps.

    Args:
        predicted_step_seconds: the configuration's predicted step time.
        predicted_terms: ``Prediction.breakdown(rank)`` for this rank of the pipeline.
        rank_name: how messages name this rank.
    """

    def __init__(self, predicted_step_seconds: float, predicted_terms: Dict[str, float],
                 rank_name: str) -> None:
        self.predicted = float(predicted_step_seconds)
        self.predicted_terms = dict(predicted_terms)
        self.rank_name = rank_name
        self.measured: Optional[float] = None
        self.warned = False
        self._ends: List[float] = []
        self._before: Optional[Dict[str, float]] = None
        self._steps = 0

    def stats(self) -> Dict[str, Any]:
        """``predicted_step_seconds`` and ``measured_step_seconds`` (``None`` until measured)."""
        return {"predicted_step_seconds": self.predicted, "measured_step_seconds": self.measured}

    def restart(self) -> None:
        """Stats were reset: the steps measured so far no longer match them."""
        if self.measured is None:
            self._ends, self._before, self._steps = [], None, 0

    def after_step(self, seconds_by_kind: Callable[[], Dict[str, float]]) -> None:
        """Notes the end of a step; after step :data:`LAST`, compares (and may warn)."""
        if self.measured is not None:
            return
        step, self._steps = self._steps, self._steps + 1
        if step < FIRST - 1:
            return
        self._ends.append(time.perf_counter())
        if step == FIRST - 1:
            self._before = dict(seconds_by_kind())
            return
        if step < LAST:
            return
        assert self._before is not None
        intervals = [b - a for a, b in zip(self._ends, self._ends[1:])]
        self.measured = statistics.median(intervals)
        terms = measured_terms(self._before, dict(seconds_by_kind()), len(intervals),
                               self.measured)
        self._compare(terms)

    def _compare(self, terms: Dict[str, float]) -> None:
        """Warns once when the measured step time is more than TOLERANCE from the prediction."""
        assert self.measured is not None
        if self.predicted > 0 and abs(self.measured - self.predicted) <= TOLERANCE * self.predicted:
            return
        worst = max(terms, key=lambda t: abs(terms[t] - self.predicted_terms.get(t, 0.0)))
        message = (
            f"{self.rank_name}: measured step time {self.measured * 1e3:.3f} ms differs from the "
            f"predicted {self.predicted * 1e3:.3f} ms by more than {TOLERANCE:.0%}; the largest "
            f"difference is {worst}: measured {terms[worst] * 1e3:.3f} ms per step, predicted "
            f"{self.predicted_terms.get(worst, 0.0) * 1e3:.3f} ms (docs/planner.md, \"Choosing the "
            "whole configuration\"; pipe.stats() keeps both step times)")
        self.warned = True
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=2)
