"""The loss ``PipeDream.step`` returns: a number whose all-reduce finishes in the background.

Only the last stage's ranks know a batch's loss; every rank gets it through one
all-reduce over the pipeline's group. Waiting for that all-reduce at the end of every
step would hold every rank at the slowest one even when nobody reads the loss (a
loop that logs every hundred steps). So ``step`` starts the all-reduce and returns a
:class:`StepLoss`: reading it (``float(loss)``, ``loss.item()``, arithmetic,
comparisons, formatting, ``print``) waits for the all-reduce, once; a loss nobody
reads is never waited for, except under ``torch.profiler``: there ``step`` waits for
it before returning (:meth:`StepLoss.finish_reduction`).
"""
from __future__ import annotations

import datetime
import math
import numbers
import operator
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["StepLoss"]


class StepLoss:
    """A batch's mean loss, on every rank, read lazily.

    Behaves as the float it holds (a registered ``numbers.Real``): ``float()``, ``.item()``
    (as a tensor's, so a DDP loop's ``loss.item()`` keeps working), arithmetic,
    comparisons, ``round``/``math.floor``, formatting, ``numpy.asarray``, pickling (as
    the float). The first read waits for the loss all-reduce (within the pipeline's
    timeout). What accepts only ``float`` itself (``json``, ``torch.tensor``, some
    loggers) takes ``float(loss)``.

    Args:
        total: the all-reduced tensor (one element; being summed in the background).
        work: the all-reduce's handle, or None when ``total`` is final.
        timeout: seconds a read waits for the all-reduce.
        describe: what failed, for the error of a read (``"rank 1: the all-reduce of
            the batch loss after step 3"``).
        check: called with the reduced tensor (the loss first, then what else the
            all-reduce carried) before its value is read; what it raises, every read
            raises (``mesh_steps.MeshSteps.check``).
    """

    __slots__ = ("_total", "_work", "_timeout", "_describe", "_value", "_check", "_error")

    def __init__(self, total: torch.Tensor, work: Optional[dist.Work], timeout: float,
                 describe: Callable[[], str],
                 check: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self._total = total
        self._work = work
        self._timeout = timeout
        self._describe = describe
        self._value: Optional[float] = None
        self._check = check
        self._error: Optional[Exception] = None

    @classmethod
    def of(cls, value: float) -> "StepLoss":
        """A loss already known (its all-reduce waited for)."""
        loss = cls(torch.zeros(1, dtype=torch.float64), None, 0.0, lambda: "")
        loss._value = float(value)
        loss._total = None
        return loss

    def wait(self) -> float:
        """Waits for the all-reduce (once) and returns the loss.

        Raises:
            RuntimeError: the all-reduce failed or timed out, naming the rank and step;
                or what ``check`` raised (on every read).
        """
        if self._error is not None:
            raise self._error
        if self._value is None:
            self._wait_work()
            if self._check is not None:
                try:
                    self._check(self._total)
                except Exception as exc:
                    self._error = exc
                    raise
            self._value = float(self._total.reshape(-1)[0].item())
            self._total = None
        return self._value

    def finish_reduction(self) -> None:
        """Waits for the all-reduce now (within the timeout) without reading the loss.

        For a step under ``torch.profiler``: torch ends its record of a collective when
        the collective completes, on the backend's thread; one still running when the
        profiler stopped corrupts the heap (a torch bug: benchmarks/README.md, "heap").
        A failure is kept for the first read to raise, as if that read had waited.
        """
        if self._work is None or self._error is not None:
            return
        try:
            self._wait_work()
        except RuntimeError as exc:
            self._error = exc

    def _wait_work(self) -> None:
        """Waits for the all-reduce, if still running (within the timeout).

        Raises:
            RuntimeError: it failed or timed out, naming the rank and step.
        """
        if self._work is None:
            return
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=self._timeout))
        except RuntimeError as exc:  # Gloo names an address; say which rank and step
            raise RuntimeError(f"{self._describe()} failed or timed out: {exc}") from exc
        self._work = None

    def item(self) -> float:
        """The loss as a Python float (as ``Tensor.item``)."""
        return self.wait()

    def __reduce__(self) -> Any:
        return float, (self.wait(),)  # pickled (torch.save, queues) as the float

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return np.asarray(self.wait(), dtype=dtype)

    # -- the number: everything reads the float ------------------------------------------
    def __float__(self) -> float:
        return self.wait()

    def __repr__(self) -> str:
        return repr(self.wait())

    def __str__(self) -> str:
        return str(self.wait())

    def __format__(self, spec: str) -> str:
        return format(self.wait(), spec)

    def __hash__(self) -> int:
        return hash(self.wait())

    def __bool__(self) -> bool:
        return bool(self.wait())

    def __trunc__(self) -> int:
        return math.trunc(self.wait())

    def __floor__(self) -> int:
        return math.floor(self.wait())

    def __ceil__(self) -> int:
        return math.ceil(self.wait())

    def __round__(self, ndigits: Optional[int] = None) -> Any:
        return round(self.wait(), ndigits)

    def __neg__(self) -> float:
        return -self.wait()

    def __pos__(self) -> float:
        return +self.wait()

    def __abs__(self) -> float:
        return abs(self.wait())


def _binary(op: Callable[[Any, Any], Any]) -> Callable[[StepLoss, Any], Any]:
    def forward(self: StepLoss, other: Any) -> Any:
        return op(self.wait(), float(other) if isinstance(other, StepLoss) else other)

    return forward


def _reflected(op: Callable[[Any, Any], Any]) -> Callable[[StepLoss, Any], Any]:
    def reverse(self: StepLoss, other: Any) -> Any:
        return op(other, self.wait())

    return reverse


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow)):
    setattr(StepLoss, f"__{_name}__", _binary(_op))
    setattr(StepLoss, f"__r{_name}__", _reflected(_op))
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt),
                   ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge)):
    setattr(StepLoss, f"__{_name}__", _binary(_op))
numbers.Real.register(StepLoss)
