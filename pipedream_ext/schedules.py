"""Pipeline schedules as data: build, inspect, validate and simulate them.

A schedule is, for every rank, an ordered list of typed actions (:class:`Action`:
``stage``, ``kind``, ``microbatch``, ``version``), shown in a compact text form
(``2F0``: stage 2 forward of microbatch 0; ``1B3v2``: stage 1 backward of
microbatch 3 reading weight version 2; ``0U1``: the update that creates version 1
of stage 0; ``3SEND_F1`` / ``4RECV_F1``: communication). Generators, lowering,
validation, the simulator and the actions themselves are C++ (``_C``); this
module is a thin typed wrapper.

Example:
    >>> from pipedream_ext import schedules
    >>> s = schedules.build("1f1b", stages=4, microbatches=8)
    >>> s.actions(0, comm=False)[:5]
    [0F0, 0F1, 0F2, 0F3, 0B0]
    >>> a = s.actions(0, comm=False)[4]
    >>> a.kind == schedules.ActionKind.B, a.stage, a.microbatch, a.is_backward_like
    (True, 0, 0, True)
    >>> round(s.simulate(t_f=1, t_b=1).bubble_fraction, 4)
    0.2727
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _viz
from ._extension import _C

__all__ = ["Action", "ActionKind", "Schedule", "SimulationResult", "TransferKey", "build", "names",
           "parse_action", "traits", "synchronous_names", "asynchronous_names"]

#: One action of a rank's list (bound from ``csrc/core/action.h``): ``stage``, ``kind``
#: (:class:`ActionKind`), ``microbatch`` (-1 for UPDATE and ALLREDUCE), ``version``;
#: ``is_compute`` (F/B/I/W), ``is_backward_like`` (B/I/W), ``is_comm`` (SEND/RECV),
#: ``transfer`` (the :class:`TransferKey` of a SEND/RECV). ``str()`` and ``repr()`` are
#: the compact text (``1B3v2``), :meth:`Action.parse` reads it back; equal actions have
#: equal hashes. Transition: ``action["kind"]`` (the dict :func:`parse_action` returned)
#: and comparing with a text (``action == "1F0"``) still work with a DeprecationWarning.
Action = _C.Action
#: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, UPDATE, ALLREDUCE.
ActionKind = _C.ActionKind
#: The transfer a SEND/RECV action is one end of (``forward``, ``boundary``,
#: ``microbatch``); both ends have equal keys. ``repr``: ``F0:3``.
TransferKey = _C.TransferKey

Costs = Union[float, int, Sequence[float]]

def names() -> List[str]:
    """Returns the names of all schedule generators."""
    return list(_C.schedule_names())


def traits(name: str) -> "_C.ScheduleTraits":
    """What a schedule means, from the C++ table (``csrc/core/traits.h``).

    Fields: ``asynchronous``, ``update_rule`` (``"caller_per_batch"``: the user
    steps after each flushed batch; ``"per_minibatch"`` / ``"per_batch"``: the
    runtime steps inside the pipeline), ``replica_reduction`` (``"sum"`` or
    ``"mean"``), ``microbatches_per_step(m)``, ``multi_chunk``, ``fixed_chunks`` (0, or
    the chunks per rank a schedule requires), ``chunk_placement`` (``"round_robin"`` or
    ``"v"``), ``supports_replicas``, ``split_backward``, ``stash_weights``, ``streaming``,
    ``supports_vertical_sync``, ``planner_straight``, ``planner_two_versions``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    return _C.schedule_traits(name)


def synchronous_names() -> List[str]:
    """Flush schedules: gradients equal the unsplit model's; the user steps the optimizer."""
    return [t.name for t in _C.all_schedule_traits() if not t.asynchronous]


def asynchronous_names() -> List[str]:
    """Asynchronous schedules: weight stashing; the runtime steps the optimizer."""
    return [t.name for t in _C.all_schedule_traits() if t.asynchronous]


def parse_action(text: str) -> Action:
    """Parses one action such as ``"1B3v2"`` (the same as :meth:`Action.parse`).

    Returns:
        The :class:`Action`. Reading it as the dict this function returned before
        (``a["kind"]``) warns and names the attribute (``a.kind``; ``a.kind.name`` is
        the old string).

    Raises:
        ValueError: if ``text`` is not a valid action (the C++ parser's message).
    """
    return Action.parse(text)


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """Figures of one simulated run of a schedule.

    Attributes:
        makespan: time from the first action to the last, in cost units.
        bubble_fraction: idle share of all ranks, 1 - compute / (ranks * makespan).
        bubble_fraction_per_rank: the same per rank.
        peak_activations: per stage, most microbatches between F and the end
            of their backward (B, or I when split); max over a stage's replicas.
        peak_activations_per_rank: the same summed over the stages of a rank.
        peak_deferred_weight_grads: per stage, most microbatches between I and W.
        peak_weight_versions: per stage, most weight versions alive at once
            (versions read by in-flight microbatches plus the current one).
        timeline: ``(rank, step, action, start, end)`` for every action (an :class:`Action`).
    """

    makespan: float
    bubble_fraction: float
    bubble_fraction_per_rank: List[float]
    peak_activations: List[int]
    peak_activations_per_rank: List[int]
    peak_deferred_weight_grads: List[int]
    peak_weight_versions: List[int]
    timeline: List[tuple] = dataclasses.field(repr=False, default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """Returns the figures (without the timeline) as a JSON-ready dict."""
        out = dataclasses.asdict(dataclasses.replace(self, timeline=[]))  # no copy of every action
        out.pop("timeline")
        return out


def _per(values: Costs, count: int, name: str) -> List[float]:
    if isinstance(values, (int, float)):
        return [float(values)] * count
    values = [float(v) for v in values]
    if len(values) != count:
        raise ValueError(
            f"{name} lists {len(values)} costs but {count} are needed; "
            "pass a single number or one value per stage (per boundary for t_comm)"
        )
    return values


def _wrap(raw: "_C.SimulationResult") -> SimulationResult:
    return SimulationResult(
        makespan=raw.makespan,
        bubble_fraction=raw.bubble_fraction,
        bubble_fraction_per_rank=list(raw.bubble_fraction_per_rank),
        peak_activations=list(raw.peak_activations),
        peak_activations_per_rank=list(raw.peak_activations_per_rank),
        peak_deferred_weight_grads=list(raw.peak_deferred_weight_grads),
        peak_weight_versions=list(raw.peak_weight_versions),
        timeline=[(e.rank, e.step, e.action, e.start, e.end) for e in raw.timeline],
    )


class Schedule:
    """Per-rank action lists of one pipeline schedule (see :func:`build`).

    Holds the compute-only form (F/B/I/W, U, ALLREDUCE) and the lowered form
    (with SEND/RECV), which is what the runtime executes: every SEND right after
    its producer, every RECV where the receive is posted, in an order both ends
    of each pair of ranks share (no tags needed, safe under NCCL's rules:
    :meth:`channels`, docs/runtime.md).
    """

    def __init__(self, compute: "_C.Schedule", lowered: Optional["_C.Schedule"] = None) -> None:
        self._compute = compute
        traits = _C.schedule_traits(compute.name)
        per_step = traits.microbatches_per_step(compute.microbatches) if traits.streaming else 0
        self._lowered = _C.order_transfers(lowered if lowered is not None else _C.lower(compute),
                                           per_step)

    # -- metadata ---------------------------------------------------------
    @property
    def lowered(self) -> "_C.Schedule":
        """The C++ schedule with its transfers (SEND/RECV), in the order the executor runs it."""
        return self._lowered

    @property
    def name(self) -> str:
        return self._compute.name

    @property
    def num_stages(self) -> int:
        """Stages (virtual stages for interleaved schedules)."""
        return self._compute.num_stages

    @property
    def num_ranks(self) -> int:
        return self._compute.num_ranks

    @property
    def microbatches(self) -> int:
        """Microbatches per batch (minibatches for ``pipedream``)."""
        return self._compute.microbatches

    @property
    def batches(self) -> int:
        return self._compute.batches

    @property
    def replicas(self) -> List[int]:
        """Replica count of every stage."""
        return list(self._compute.layout.replicas)

    def stage_ranks(self, stage: int) -> List[int]:
        """Ranks that hold ``stage`` (its replicas, in round-robin order)."""
        return list(self._compute.layout.stage_ranks(stage))

    def stages_of_rank(self, rank: int) -> List[int]:
        """Stages ``rank`` holds, ascending, from the layout (``zbv``: ``[r, 2p-1-r]``)."""
        return list(self._compute.layout.stages_of_rank(rank))

    # -- views --------------------------------------------------------------
    def actions(self, rank: int, comm: bool = True) -> List[Action]:
        """Returns rank ``rank``'s :class:`Action` list, with communication unless ``comm=False``.

        ``str(action)`` is its text (``0SEND_F0``); :meth:`to_text` gives every rank's line.
        """
        source = self._lowered if comm else self._compute
        return list(source.actions(rank))

    def grid(self, comm: bool = False) -> str:
        """Rank-by-step text grid (compute-only unless ``comm=True``)."""
        return (self._lowered if comm else self._compute).grid()

    def to_text(self, comm: bool = True) -> str:
        """One line per rank: ``rank 0: 0F0 0SEND_F0 ...``."""
        return (self._lowered if comm else self._compute).to_text()

    def to_csv(self, path: Optional[Union[str, os.PathLike]] = None, comm: bool = True) -> str:
        """Returns (and optionally writes) one CSV row of action texts per rank."""
        text = (self._lowered if comm else self._compute).to_csv()
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        return text

    def with_actions(self, text: str, fmt: str = "text") -> "Schedule":
        """Returns a validated schedule with this layout and the given actions.

        Args:
            text: actions in the :meth:`to_text` form, or CSV when ``fmt="csv"``;
                lowered (with SEND/RECV) or compute-only. The SENDs stay where the
                text puts them; every RECV is moved to where the transfer order
                posts it (:meth:`channels`).
            fmt: ``"text"`` or ``"csv"``.

        Raises:
            ValueError: on a parse error or an invalid schedule (the message
                shows the grid with the offending action marked).
        """
        if fmt == "text":
            parsed = self._compute.with_actions_from_text(text)
        elif fmt == "csv":
            parsed = self._compute.with_actions_from_csv(text)
        else:
            raise ValueError(f"fmt must be 'text' or 'csv' (got {fmt!r})")
        _C.validate(parsed)
        schedule = Schedule(_C.strip_communication(parsed), parsed) if parsed.is_lowered else Schedule(parsed)
        schedule.validate()
        return schedule

    def validate(self) -> None:
        """Checks both forms, and that the transfer order is safe under NCCL's rules
        (every pair of ranks issues its transfers in one mirrored order; no deadlock).

        Raises:
            ValueError: naming the problem, with the grid marked at the action (or
                the pair's sequences).
        """
        _C.validate(self._compute)
        _C.validate(self._lowered)
        _C.validate_channels(self._lowered)
        _C.validate_channels(self._lowered, forward_only=True)

    def pairs(self) -> List[List[str]]:
        """The F&B pairs ``PipeDream(overlap=True)`` runs together, per rank: an F followed,
        past transfers only, by a B of another stage (``"0F3&3B1"``); after
        ``_C.pair_forward_backward`` makes each adjacent (csrc/core/pairs.h). Empty lists
        for a schedule without any (every one but ``dualpipev``).

        Raises:
            ValueError: moving the pairs' transfers would not be safe (the channels' proof).
        """
        paired = _C.pair_forward_backward(self._lowered)
        out = []
        for rank in range(paired.num_ranks):
            actions = paired.actions(rank)
            out.append([f"{actions[k]}&{actions[k + 1]}" for k in _C.pair_starts(paired, rank)])
        return out

    def channels(self) -> str:
        """Each rank's operations with each peer, in the order it issues them.

        Returns:
            One line per rank and peer (``rank 0 -> 1: 0SEND_F0 0SEND_F1 0RECV_B0 ...``);
            the two lines of a pair mirror each other position by position: the k-th
            send of one end is the k-th receive of the other, as NCCL matches them.
        """
        return _C.channels_to_text(self._lowered)

    # -- simulation -----------------------------------------------------------
    def _costs(self, t_f: Costs, t_b: Costs, t_w: Optional[Costs], t_comm: Costs,
               t_allreduce: Costs) -> "_C.StageCosts":
        stages = self.num_stages
        costs = _C.StageCosts()
        costs.forward = _per(t_f, stages, "t_f")
        costs.backward = _per(t_b, stages, "t_b")
        costs.weight = [] if t_w is None else _per(t_w, stages, "t_w")
        costs.comm = _per(t_comm, max(0, stages - 1), "t_comm")
        costs.all_reduce = _per(t_allreduce, stages, "t_allreduce")
        return costs

    def _simulate(self, **costs: Any) -> "_C.SimulationResult":
        return _C.simulate(self._lowered, self._costs(**costs))

    def simulate(self, t_f: Costs = 1.0, t_b: Costs = 2.0, t_w: Optional[Costs] = None,
                 t_comm: Costs = 0.0, t_allreduce: Costs = 0.0) -> SimulationResult:
        """Simulates the lowered schedule.

        Args:
            t_f: forward time, one number or one per stage.
            t_b: backward time. With ``t_w=None`` the backward is not split: B
                costs ``t_b`` and I, W cost ``t_b / 2`` each. Otherwise I costs
                ``t_b``, W costs ``t_w`` and B costs ``t_b + t_w``.
            t_w: weight-gradient time (see ``t_b``), or None.
            t_comm: transfer time per stage boundary (one number or p-1).
            t_allreduce: gradient all-reduce time of a replicated stage.

        Returns:
            The :class:`SimulationResult`.

        Raises:
            ValueError: on negative or mis-sized costs.
        """
        raw = self._simulate(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, t_allreduce=t_allreduce)
        return _wrap(raw)

    def to_chrome_trace(self, path: Union[str, os.PathLike], t_f: Costs = 1.0, t_b: Costs = 2.0,
                        t_w: Optional[Costs] = None, t_comm: Costs = 0.0,
                        t_allreduce: Costs = 0.0) -> SimulationResult:
        """Simulates and writes a Chrome trace (chrome://tracing, Perfetto) to ``path``.

        Returns:
            The :class:`SimulationResult` of the simulated run.
        """
        raw = self._simulate(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, t_allreduce=t_allreduce)
        text = _C.to_chrome_trace(self._lowered, raw)
        json.loads(text)  # never write a broken trace
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return _wrap(raw)

    def plot(self, path: Union[str, os.PathLike], t_f: Costs = 1.0, t_b: Costs = 2.0,
             t_w: Optional[Costs] = None, t_comm: Costs = 0.0, t_allreduce: Costs = 0.0,
             comm: bool = False, title: Optional[str] = None, width: int = 1200) -> SimulationResult:
        """Simulates and draws a rank-by-time chart of the schedule as a PNG (needs matplotlib).

        One row per rank, a box per compute action coloured by kind with its
        microbatch number, U as a bar, SEND/RECV as thin strips with ``comm=True``;
        the title gives the bubble fraction. The image is ``width`` by
        ``116 + 40 * num_ranks`` pixels. Costs as for :meth:`simulate`.

        Returns:
            The :class:`SimulationResult` that was drawn.

        Raises:
            ValueError: ``path`` does not end in .png or its directory is missing
                or not writable; bad costs or width.
            RuntimeError: matplotlib is not installed.
        """
        path = _viz.check_png_path(path)
        _viz.image_size(self.num_ranks, width)
        result = self.simulate(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, t_allreduce=t_allreduce)
        comm_costs = _per(t_comm, max(0, self.num_stages - 1), "t_comm")
        _viz.draw_schedule(self, result, comm_costs, path, comm=comm, title=title, width=width)
        return result

    def __repr__(self) -> str:
        return (f"Schedule(name={self.name!r}, stages={self.num_stages}, ranks={self.num_ranks}, "
                f"microbatches={self.microbatches}, batches={self.batches}, "
                f"replicas={self.replicas})")


def build(name: str, stages: int, microbatches: int, chunks: int = 1,
          replicas: Optional[Sequence[int]] = None, batches: int = 1,
          vertical_sync: bool = False) -> Schedule:
    """Builds, lowers and validates a schedule.

    Args:
        name: one of :func:`names`: ``gpipe``, ``1f1b``, ``interleaved-1f1b``,
            ``zb-h1``, ``zbv``, ``dualpipev``, ``interleaved-zb``, ``pipedream``,
            ``pipedream-2bw``.
        stages: pipeline stages p (ranks, for schedules with several chunks per rank).
        microbatches: microbatches per batch m (for ``pipedream``: minibatches,
            each followed by an update).
        chunks: model chunks per rank v (``interleaved-1f1b``, ``interleaved-zb``; exactly
            2 for ``zbv`` and ``dualpipev``, whose layout puts rank r's chunks on stages
            r and 2p-1-r: :meth:`Schedule.stages_of_rank`).
        replicas: replica count per stage, e.g. ``[2, 1, 1]`` (gpipe, 1f1b,
            pipedream, pipedream-2bw); microbatch i runs on replica i mod r.
        batches: consecutive batches in the schedule (not for ``pipedream``).
        vertical_sync: ``pipedream`` only: every stage reads, for minibatch i,
            the weight version stage 0 read (equal replica counts needed).

    Returns:
        The validated :class:`Schedule`.

    Raises:
        ValueError: unknown name or impossible parameters, naming the value.
    """
    for label, value in (("stages", stages), ("microbatches", microbatches),
                         ("chunks", chunks), ("batches", batches)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{label} must be an integer (got {value!r})")
    compute = _C.build_schedule(name, stages, microbatches, chunks,
                                list(replicas) if replicas is not None else [], batches,
                                bool(vertical_sync))
    schedule = Schedule(compute)
    schedule.validate()
    return schedule
