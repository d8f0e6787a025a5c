"""Seeing what a pipeline does: stats and the merged Chrome trace.

Owns everything a pipeline reports about itself: the executor's stats (kept
across executors an asynchronous flush replaces), the per-action spans for the
trace and the ``PIPEDREAM_LOG=debug`` log, and writing every rank's spans as one
Chrome trace on rank 0. The numbers come from the C++ executor as one bound
schema (``_C.RuntimeStats``); this module only adds which rank and stages they
belong to.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

from .._dist import collectives
from .._extension import _C
from .prediction_check import PredictionCheck

__all__ = ["OUTSIDE_WAITS", "Observer"]

_log = logging.getLogger("pipedream_ext._pipe")

# Chrome trace threads by span category.
_THREADS = {"compute": 0, "update": 0, "send": 1, "post": 1, "wait": 1, "allreduce": 2}
_THREAD_NAMES = (("compute", 0), ("comm", 1), ("allreduce", 2))

Span = Tuple[str, str, int, int]  # (name, category, start_us, duration_us)

#: Waits on other ranks that the step spends outside the executor, by kind: the
#: all-reduce summing a tied parameter's gradient over its stages (``SharedGradients``).
#: The first stage to finish its backward waits there for the last one; the cost model
#: counts that as idle time, so ``stats()`` counts it as a wait.
OUTSIDE_WAITS = ("TIED_ALLREDUCE",)


class Observer:
    """Stats and trace of one rank's pipeline.

    Args:
        rank: this rank in ``group`` (the trace's process id).
        stages: this rank's stage indices.
        group: the group whose ranks' spans one trace merges: the pipeline's, or over a
            mesh every rank's (``ParallelDims.world_group``: one track per rank of the mesh).
        schedule: the schedule's name (recorded in the trace).
        trace_path: where :meth:`write_trace` writes, or ``None`` (not tracing).
        device: this rank's device; on CUDA, :meth:`stats` adds its memory.
        rank_name: how the trace names this rank's track (default ``"rank {rank}"``).
    """

    def __init__(self, rank: int, stages: Sequence[int], group: dist.ProcessGroup,
                 schedule: str, trace_path: Optional[str],
                 device: Optional[torch.device] = None, rank_name: Optional[str] = None) -> None:
        self.rank = rank
        self.rank_name = rank_name if rank_name is not None else f"rank {rank}"
        self.device = device if device is not None else torch.device("cpu")
        self.stages = list(stages)
        self.group = group
        self.schedule = schedule
        self.trace_path = trace_path
        self._spans: List[Span] = []
        self._retired = _C.RuntimeStats()  # executors already replaced
        self._outside: Dict[str, float] = {}  # OUTSIDE_WAITS seconds since the last reset
        self._written: Set[str] = set()  # paths this observer wrote a trace to
        self._check: Optional[PredictionCheck] = None

    def expect(self, prediction: Any, index: int) -> None:
        """Compares the first steps with ``prediction`` (a ``configuration.Prediction``;
        ``index``: this rank's entry in its per-rank lists): ``prediction_check``."""
        self._check = PredictionCheck(prediction.step_seconds, prediction.breakdown(index),
                                      self.rank_name)

    @property
    def tracing(self) -> bool:
        """Whether executors should record spans (a trace, or the debug log)."""
        return self.trace_path is not None or _log.isEnabledFor(logging.DEBUG)

    def after_step(self, executor: Any, step: int) -> None:
        """Moves the step's spans to the trace and/or the debug log; compares the first
        steps with the prediction (if any)."""
        if self._check is not None:
            self._check.after_step(lambda: self.stats(executor)["seconds_by_kind"])
        if not executor.action_logging:
            return
        spans = executor.take_action_log()
        if _log.isEnabledFor(logging.DEBUG):
            for name, category, _start, duration in spans:
                _log.debug("rank %d step %d: %-14s %-9s %8.3f ms", self.rank, step, name,
                           category, duration / 1e3)
        if self.trace_path is not None:
            self._spans.extend(spans)

    def record_wait(self, kind: str, seconds: float) -> None:
        """Adds ``seconds`` that the step waited outside the executor (``kind``, one of
        :data:`OUTSIDE_WAITS`) to :meth:`stats`' ``seconds_by_kind``, ``wait_s`` and
        ``busy_s``."""
        if kind not in OUTSIDE_WAITS:
            raise ValueError(f"kind {kind!r} is not a wait outside the executor; use one of "
                             f"{OUTSIDE_WAITS}")
        self._outside[kind] = self._outside.get(kind, 0.0) + seconds

    def retire(self, executor: Any) -> None:
        """Keeps the stats and spans of an executor about to be replaced."""
        self._retired = self._retired.merge(executor.stats())
        if self.trace_path is not None:
            self._spans.extend(executor.take_action_log())

    def stats(self, executor: Any) -> Dict[str, Any]:
        """This rank's stats since construction or :meth:`reset` (see ``PipeDream.stats``)."""
        stats = self._retired.merge(executor.stats())
        for kind, seconds in self._outside.items():
            stats = stats.with_wait(kind, seconds)
        merged = stats.as_dict()
        merged["rank"] = self.rank
        merged["stages"] = list(self.stages)
        if self._check is not None:
            merged.update(self._check.stats())
        if self.device.type == "cuda":
            # This rank's stages together: what the caching allocator holds for tensors.
            merged["cuda_memory_allocated"] = torch.cuda.memory_allocated(self.device)
            merged["cuda_peak_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return merged

    def reset(self, executor: Any) -> None:
        self._retired = _C.RuntimeStats()
        self._outside = {}
        executor.reset_stats()
        if self._check is not None:
            self._check.restart()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def write_trace(self, executor: Any, path: Optional[Union[str, os.PathLike]]) -> Optional[str]:
        """Merges every rank's spans into one Chrome trace on rank 0 (collective): the spans
        recorded since the last write. A write with none leaves a trace this pipeline
        already wrote at that path as it is (``write_trace()`` then ``close()``).

        Returns:
            The path written, on rank 0; ``None`` elsewhere.

        Raises:
            ValueError: tracing is off.
        """
        if self.trace_path is None:
            raise ValueError("tracing is off: pass PipeDream(..., trace='run.json') or set "
                             "PIPEDREAM_TRACE=run.json before building the pipeline")
        target = os.fspath(path) if path is not None else self.trace_path
        self._spans.extend(executor.take_action_log())
        events = self._events()
        self._spans = []
        gathered = collectives.gather_bytes(json.dumps(events).encode(), self.group)
        if gathered is None:
            return None
        merged = [e for blob in gathered for e in json.loads(blob.decode())]
        if target in self._written and not any(e["ph"] == "X" for e in merged):
            # Nothing ran since this path was written (write_trace() then close()):
            # keep the trace it holds rather than replace it with an empty one.
            _log.info("no actions since the trace at %s was written; left as it is", target)
            return target
        origin = min((e["ts"] for e in merged if "ts" in e), default=0)
        for e in merged:
            if "ts" in e:
                e["ts"] -= origin
        tmp = f"{target}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": merged, "displayTimeUnit": "ms",
                       "otherData": {"schedule": self.schedule, "ranks": len(gathered),
                                     "origin_unix_us": origin}}, f)
        os.replace(tmp, target)
        self._written.add(target)
        _log.info("wrote the execution trace of %d ranks to %s", len(gathered), target)
        return target

    def _events(self) -> List[Dict[str, Any]]:
        events: List[Dict[str, Any]] = [
            {"name": name, "cat": cat, "ph": "X", "ts": start, "dur": max(duration, 1),
             "pid": self.rank, "tid": _THREADS.get(cat, 1)}
            for name, cat, start, duration in self._spans]
        events.append({"name": "process_name", "ph": "M", "pid": self.rank,
                       "args": {"name": f"{self.rank_name}: stages {self.stages}"}})
        for thread, tid in _THREAD_NAMES:
            events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                           "args": {"name": thread}})
        return events
