"""Looking inside a pipeline: stage fingerprints, agreement checks, tracing phases, late receives.

``PipeDream(...)`` does all of this itself; these functions run its steps one at a
time, for two purposes (docs/tracing.md "Diagnostics"):

* **debugging why ranks disagree.** Every rank traces or slices the model on its own
  and the ranks compare fingerprints of what each stage computes
  (:func:`fingerprint_layers`, :func:`fingerprint_split`) at construction
  (:func:`check_stages_agree`) and the batches of the first steps
  (:func:`check_batches_agree`). Printing :func:`describe_stage` on every rank shows
  what each one built; the checks raise the ``ValueError`` ``PipeDream`` would;
* **timing tracing**: :func:`trace_split` is the cut ``PipeDream(split_points=...)``
  makes, in one process without torch.distributed, and :func:`time_split` the same
  with the time of each phase (tracing, cutting, the value check on the sample,
  building the stage graphs, the ownership check, the fingerprint)::

      import pipedream_ext.diagnostics as pdd
      timing = pdd.time_split(model, ["layer3"], (x,))
      print(timing.total_s, timing.phases_s, timing.graph_nodes)

What the configuration planner sees (``pipedream_ext.configuration``; docs/planner.md):
:func:`measure_layer_costs` times a model's layers in this process and
:func:`calibrate` measures the machine's costs over a group (both as
``PipeDream(sample=...)`` does before choosing), so a study can predict configurations
with ``configuration.predict`` without building a pipeline for each.

Beside construction, :func:`late_receive_waits` reads a merged Chrome trace
(``PipeDream(trace=...)``) for receive waits that a later message released: waits for
data the peer had already sent that ended only after the peer started its next send.

:func:`check_stages_agree` and :func:`check_batches_agree` are collectives: every rank
of the group calls them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from . import configuration
from ._dist.agreement import StepAgreement, agree_at_construction
from ._dist.collectives import measure_bandwidth
from ._dist.fingerprint import StagesFingerprint, graph_fingerprint, layers_fingerprint
from ._frontend import export, graph_split
from ._frontend.fx_graph import count_stages, node_stages
from ._frontend.graph_split import TracedSplit, split_model
from ._pipe import PipeDream
from ._planning import calibration
from ._planning.layer_costs import LayerCosts, measure_layer_costs
from ._runtime.late_waits import LateWait, late_receive_waits

__all__ = ["PHASES", "LateWait", "LayerCosts", "SplitTiming", "StagesFingerprint", "TracedSplit", "calibrate",
           "check_batches_agree", "check_stages_agree", "describe_stage", "fingerprint_layers", "fingerprint_split",
           "late_receive_waits", "measure_bandwidth", "measure_layer_costs", "time_split", "trace_split"]

Inputs = Union[Tuple[torch.Tensor, ...], Mapping[str, torch.Tensor]]

#: The phases of :func:`time_split`, in the order ``split_model`` runs them: ``trace``
#: (torch.fx), ``export`` (torch.export, where fx cannot trace the forward), ``cut`` (stage
#: boundaries and the values crossing each cut), ``value_check`` (the sample run through
#: the graph once), ``build`` (one ``GraphModule`` per stage), ``ownership`` (no module
#: state held by two stages), ``fingerprint``.
PHASES: Tuple[str, ...] = ("trace", "export", "cut", "value_check", "build", "ownership",
                           "fingerprint")

# The functions each phase times: (module, attribute), looked up by the tracing code
# when it calls them, so wrapping the attribute for one split times every call of it.
_PHASE_FUNCTIONS: Dict[str, Tuple[Tuple[Any, str], ...]] = {
    "trace": ((graph_split, "trace_model"),),
    "export": ((export, "export_model"),),
    "cut": ((graph_split, "stage_starts"), (graph_split, "stage_assignment"),
            (export, "localize_sizes"), (graph_split, "live_sets")),
    "value_check": ((graph_split, "value_kinds"),),
    "build": ((graph_split, "build_stages"),),
    "ownership": ((graph_split, "check_one_stage_per_state"),),
    "fingerprint": ((graph_split, "graph_fingerprint"),),
}


@dataclasses.dataclass
class SplitTiming:
    """What :func:`time_split` measured.

    Attributes:
        split: the stages, as :func:`trace_split` returns them.
        total_s: wall time of the whole split, in seconds.
        phases_s: seconds per phase of :data:`PHASES` that ran (``"export"`` only where
            torch.fx could not trace the forward; ``"trace"`` then holds fx's attempt).
        graph_nodes: nodes of the whole traced graph.
    """

    split: TracedSplit
    total_s: float
    phases_s: Dict[str, float]
    graph_nodes: int

    @property
    def other_s(self) -> float:
        """The time of the split outside every phase (the rest of ``split_model``)."""
        return self.total_s - sum(self.phases_s.values())


def trace_split(model: nn.Module, split_points: Sequence[str], inputs: Inputs,
                concrete_args: Optional[Mapping[str, Any]] = None) -> TracedSplit:
    """Traces ``model`` and cuts it at ``split_points``, as ``PipeDream(split_points=...)``
    does on every rank, here in one process (no torch.distributed needed).

    Args:
        model: any module torch.fx or torch.export can trace.
        split_points: module names; stage ``j + 1`` starts at ``split_points[j]``.
        inputs: one sample batch of the model's tensor inputs: a tuple (positional) or a
            dict of named tensors.
        concrete_args: non-tensor ``forward`` arguments fixed while tracing
            (``{"use_cache": False}``).

    Returns:
        The split: ``stages`` (one ``torch.fx.GraphModule`` per stage, callable on
        their own), ``live`` (the values crossing each cut) and ``fingerprint``.

    Raises:
        ValueError: what ``PipeDream`` raises for this model and these split points.
    """
    return split_model(model, split_points, inputs, concrete_args)


@contextlib.contextmanager
def _phases_timed(spent: Dict[str, float]) -> Iterator[None]:
    """Wraps the functions of every phase so that each call adds its time to
    ``spent[phase]``; restores them on exit. Not thread-safe: one split at a time."""
    originals: List[Tuple[Any, str, Callable[..., Any]]] = []

    def timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - start
        return wrapper

    try:
        for phase, targets in _PHASE_FUNCTIONS.items():
            for module, name in targets:
                fn = getattr(module, name)  # AttributeError: a phase names a moved function
                originals.append((module, name, fn))
                setattr(module, name, timed(phase, fn))
        yield
    finally:
        for module, name, fn in reversed(originals):
            setattr(module, name, fn)


def time_split(model: nn.Module, split_points: Sequence[str], inputs: Inputs,
               concrete_args: Optional[Mapping[str, Any]] = None) -> SplitTiming:
    """:func:`trace_split` with each of its phases timed (:data:`PHASES`).

    Args:
        model, split_points, inputs, concrete_args: as for :func:`trace_split`.

    Returns:
        The split, its wall time and the time of each phase.

    Raises:
        ValueError: as :func:`trace_split`.
    """
    spent: Dict[str, float] = {}
    with _phases_timed(spent):
        start = time.perf_counter()
        split = split_model(model, split_points, inputs, concrete_args)
        total = time.perf_counter() - start
    nodes = len(split.cut.gm.graph.nodes) if split.cut is not None else 0
    return SplitTiming(split, total, spent, nodes)


def fingerprint_layers(model: nn.Sequential, balance: Sequence[int]) -> StagesFingerprint:
    """The fingerprint ranks compare for an ``nn.Sequential`` cut into stages of
    ``balance`` layers: every module by position, type, configuration, tensor shapes and
    dtypes (not values).

    Args:
        model: the whole ``nn.Sequential``.
        balance: layers per stage, summing to ``len(model)``.

    Returns:
        One digest per stage (``stages``); :func:`describe_stage` names what each holds.

    Raises:
        ValueError: ``balance`` does not cover the model's layers.
    """
    if any(n < 1 for n in balance) or sum(balance) != len(model):
        raise ValueError(f"balance {list(balance)} must be positive layer counts summing to "
                         f"the model's {len(model)} layers")
    bounds = [0]
    for n in balance:
        bounds.append(bounds[-1] + n)
    return layers_fingerprint(model, bounds)


def fingerprint_split(split: TracedSplit) -> StagesFingerprint:
    """The fingerprint of a traced model's stages, computed again (as ``split.fingerprint``
    was while cutting): what each stage computes, independent of node names and of the
    order of independent operations.

    Args:
        split: from :func:`trace_split` (or :func:`time_split`'s ``split``).

    Returns:
        One digest per stage and the digests of the values crossing each cut.

    Raises:
        ValueError: ``split`` holds no traced graph (stages built from parts).
    """
    cut = split.cut
    if cut is None:
        raise ValueError("this split holds no traced graph to fingerprint; make it with trace_split")
    return graph_fingerprint(cut.gm, cut.model, node_stages(cut.gm, cut.starts), cut.live,
                             count_stages(cut.starts))


def describe_stage(fingerprint: StagesFingerprint, stage: int) -> List[str]:
    """What stage ``stage`` computes, one readable line per operation (a traced model) or
    module (an ``nn.Sequential``), each with its digest: print it on every rank and compare.

    Raises:
        IndexError: no such stage.
    """
    if not 0 <= stage < len(fingerprint.stages):
        raise IndexError(f"stage {stage} of a fingerprint of {len(fingerprint.stages)} stages")
    return [f"{entry.digest} {entry.text}" for entry in fingerprint.entries(stage)]


def check_stages_agree(fingerprint: StagesFingerprint, config: Optional[Mapping[str, Any]] = None,
                       group: Optional[dist.ProcessGroup] = None) -> Optional[List[List[str]]]:
    """Checks that every rank of ``group`` has the same stages (and ``config``), as
    ``PipeDream`` does at construction: one all-gather. Collective.

    Args:
        fingerprint: this rank's, from :func:`fingerprint_layers` or :func:`fingerprint_split`.
        config: values that must match on every rank (JSON values), by name.
        group: the ranks to compare (default: the whole world).

    Returns:
        ``None`` where this rank agrees with rank 0 in full; else rank 0's order of the
        values crossing each cut (digests), where this rank computes the same values but
        listed them in another order (``PipeDream`` then rebuilds its stages in that order).

    Raises:
        ValueError: on every rank: a ``config`` value, the number of stages or a stage
            differs, naming the value per rank or the first differing operation.
    """
    return agree_at_construction(group or dist.group.WORLD, dict(config or {}), fingerprint)


def check_batches_agree(inputs: Any, targets: Any, group: Optional[dist.ProcessGroup] = None,
                        first_ranks: Sequence[int] = (0,),
                        last_ranks: Optional[Sequence[int]] = None) -> None:
    """Checks a batch as ``PipeDream.step()`` does for its first ``check_agreement``
    calls: the ranks of stage 0 and of the last stage were given the same batch
    (fingerprints of inputs and targets, and their rows). One all-gather. Collective; on a
    group of one rank it checks nothing.

    Args:
        inputs: what this rank was given as inputs (``None``: nothing).
        targets: likewise, the targets.
        group: the pipeline's ranks (default: the whole world).
        first_ranks: the ranks (of ``group``) holding stage 0.
        last_ranks: the ranks holding the last stage (default: the last rank).

    Raises:
        ValueError: on every rank: a first and a last stage were given different batches
            or batches of different sizes (naming the ranks and fingerprints).
    """
    group = group or dist.group.WORLD
    if last_ranks is None:
        last_ranks = [dist.get_world_size(group) - 1]
    StepAgreement(group, first_ranks, last_ranks, check_steps=1).check("step", inputs, targets)


def calibrate(group: dist.ProcessGroup, device: Union[str, torch.device], *,
              timeout: float = 60.0, recalibrate: bool = False) -> configuration.MachineCosts:
    """The machine's costs the configuration planner uses (runtime overheads per action
    and step, send posting, latency, bandwidth, all-reduce, optimizer per byte, cores),
    measured over ``group`` in a fraction of a second.

    Collective: every rank of ``group`` calls it and gets rank 0's measurement. Cached per
    process for the group's ranks and device (what ``PipeDream(sample=...)`` reuses).

    Args:
        group: the ranks of the run.
        device: this rank's pipeline device.
        timeout: seconds any wait on another rank may take.
        recalibrate: measure again even when the costs are cached.

    Returns:
        The costs, for ``configuration.predict`` and ``configuration.search``.

    Raises:
        RuntimeError: the measurement failed on rank 0, or a peer did not answer in time.
    """
    return calibration.calibrate(group, torch.device(device), timeout=timeout,
                                 pipeline=PipeDream, recalibrate=recalibrate)
