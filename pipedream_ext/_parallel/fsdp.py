"""FSDP2 inside pipeline stages (``data_parallel="fsdp"``): :class:`FsdpStages`.

FSDP2's ``fully_shard`` over ``mesh["dp"]``, one unit per top-level layer with
parameters and one root per stage, applied while the stages are built
(``LocalStages(after_layer=...)``), so a meta-device layer is sharded right after it is
materialised and before the executor (or the split backward) ever sees a parameter;
with tensor parallelism after the plan (``parallelize.parallelize_stages``), each
parameter then a 2-D DTensor over the ``(dp, tp)`` mesh. A traced stage's units are the
modules its graph calls once (:func:`graph_units`); a parameter tied between two units
of one rank is refused (:func:`refuse_split_ties`).

Gradient synchronisation waits for each stage's last backward, as torch's
``torch/distributed/pipelining/stage.py`` does: during the step every unit runs
without gradient sync, without resharding after backward and not as the last
backward (its post-backward only accumulates the unsharded gradient); after the
executor's run, which ends with every stage's last ``B`` or ``W``, the flags are
set and every parameter group's ``post_backward`` and the root's final callback run:
one reduce-scatter per unit per step. With ``reshard_after_forward=True`` and a
split-backward schedule, a forward is not resharded when the next backward action
of its stage is a ``W`` (:func:`keep_unsharded_after`): ``W`` runs from saved
activations without the pre-backward hook that would all-gather the weights again
(the built-in schedules never need it: each ``W`` follows an ``I`` of its stage
after the stage's last forward; it guards other action lists).
docs/runtime.md ("Pipeline + FSDP") has the details.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torch import nn

from .. import schedules
from .._frontend.local_stages import LocalStages
from .data_parallel import DataParallel, broadcast_from_first
from .dims import ParallelDims
from .expert_parallel import split_experts

__all__ = ["FsdpStages", "graph_units", "keep_unsharded_after", "refuse_split_ties"]


def refuse_split_ties(dims: ParallelDims,
                      tied: Sequence[Tuple[Sequence[str], Sequence[Tuple[str, int]]]]) -> None:
    """FSDP shards each unit's parameters on its own: one Parameter in two units of a
    rank would become two sharded parameters, silently untied.

    A tie across ranks is fine (each rank's copy is one parameter of one unit, its
    gradient summed over the copies by ``SharedGradients``); a tie between two units
    on one rank (two top-level layers, or two stages of one rank) is refused.

    Args:
        dims: the run's dims.
        tied: per tied parameter, its names and the ``(unit, pp rank)`` of every use.

    Raises:
        ValueError: with ``data_parallel="fsdp"``, naming the parameter, the units and
            the fix.
    """
    if not dims.on_mesh or dims.data_parallel != "fsdp":
        return
    for names, uses in tied:
        units_of_rank: Dict[int, List[str]] = {}
        for unit, rank in uses:
            if unit not in units_of_rank.setdefault(rank, []):
                units_of_rank[rank].append(unit)
        for rank, units in units_of_rank.items():
            if len(units) > 1:
                raise ValueError(
                    f"parameter {' = '.join(names)} is used by {' and '.join(units)}, which "
                    "data_parallel='fsdp' would shard as separate units on "
                    f"{dims.names.many([ranks[rank] for ranks in dims.pipelines])}, untying "
                    "the copies; use data_parallel='replicate', or put "
                    "its uses on different pipeline ranks with balance=[...] (a tie across "
                    "ranks is supported), or untie it")


def keep_unsharded_after(actions: Sequence[schedules.Action]) -> Set[Tuple[int, int]]:
    """The forwards ``(stage, microbatch)`` after which the stage must stay unsharded.

    Those whose stage's next backward action in the rank's list is a ``W``: ``W``
    runs the weight branches from saved activations and fires no pre-backward hook,
    so the weights a later forward resharded would not be gathered again.

    Args:
        actions: this rank's compute actions in order (``Schedule.actions(rank, comm=False)``).
    """
    keep: Set[Tuple[int, int]] = set()
    for k, a in enumerate(actions):
        if a.kind != schedules.ActionKind.F:
            continue
        after = next((b.kind for b in actions[k + 1:] if b.stage == a.stage and b.is_backward_like), None)
        if after == schedules.ActionKind.W:
            keep.add((a.stage, a.microbatch))
    return keep



class FsdpStages(DataParallel):
    """FSDP2 over ``mesh["dp"]``: each top-level layer with parameters a unit, each
    stage a root; gradient sync deferred to the end of the step.

    Args:
        keep_unsharded: :func:`keep_unsharded_after` of this rank's list.
        (the rest as :class:`DataParallel`)
    """

    def __init__(self, dims: ParallelDims, average_over_dp: bool,
                 keep_unsharded: Set[Tuple[int, int]]) -> None:
        super().__init__(dims, average_over_dp)
        self.keep_unsharded = keep_unsharded
        self.units = 0

    def _shard(self, module: nn.Module, experts: bool = False) -> Any:
        # torch's fully_shard: imported at call time so that torch.distributed.fsdp (and
        # its import cost) is only paid by pipelines that shard.
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - optional, see above

        # Expert shards (DTensors over ep): over the ranks holding the same ones.
        mesh = self.dims.expert_dp_mesh if experts else self.dims.dp_mesh
        kwargs: Dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.dims.reshard_after_forward}
        if self.dims.mp_policy is not None:
            kwargs["mp_policy"] = self.dims.mp_policy
        sharded = fully_shard(module, **kwargs)
        if not self.average_over_dp or experts:
            # Summed over the dp ranks as their losses are; an expert shard's gradient
            # already holds every ep rank's tokens' part, so a mean divides by dp x ep.
            sharded.set_gradient_divide_factor(float(self.dims.dp_size) if self.average_over_dp else 1.0)
            # A plain SUM (then the division): Gloo has no PREMUL_SUM. Not on a mesh of
            # one rank (experts with dp 1): there torch 2.13 applies the factor twice.
            if mesh.size() > 1:
                sharded.set_force_sum_reduction_for_comms(True)
        return sharded

    @property
    def after_layer(self) -> Optional[Callable[[nn.Module], None]]:
        # With tensor or expert parallelism the plan comes first (torchtitan's order): in attach.
        return None if self.dims.tp_enabled or self.dims.ep_enabled else self.shard_layer

    def _shard_unit(self, unit: nn.Module) -> None:
        """One unit, its expert modules (those holding expert shards themselves) first,
        each a unit of its own over the expert mesh."""
        if self.dims.ep_enabled:
            for module in list(unit.modules()):
                if module is not unit and split_experts(list(module.parameters(recurse=False)), self.dims)[1]:
                    self._shard(module, experts=True)
                    self.units += 1
        experts_only = self.dims.ep_enabled and not split_experts(list(unit.parameters()), self.dims)[0]
        self._shard(unit, experts=experts_only)
        self.units += 1

    def shard_layer(self, layer: nn.Module) -> None:
        """Shards one top-level layer (``LocalStages(after_layer=...)``) right after it
        is materialised, before the next one is, from dp rank 0's values."""
        broadcast_from_first(layer, self.dims)
        if any(True for _ in layer.parameters()):
            self._shard_unit(layer)

    def attach(self, stages: LocalStages) -> None:
        """Makes each stage module an FSDP root over its sharded layers; a traced
        stage's units (:func:`graph_units`), or with tensor or expert parallelism every
        top-level layer, are sharded here, from dp rank 0's values."""
        self.stages = stages
        if (self.dims.tp_enabled or self.dims.ep_enabled) and not stages.traced:
            for j in stages:  # after the plan (parallelize_stages)
                for layer in stages[j].children():
                    self.shard_layer(layer)
        for j in stages:
            if stages.traced:
                broadcast_from_first(stages[j], self.dims)
                for unit in graph_units(stages[j]):
                    self._shard_unit(unit)
            self._shard(stages[j])
            stages[j].set_reshard_after_forward(self.dims.reshard_after_forward)
        stages.remerge()  # a traced stage's parameters are new (sharded) objects

    def _roots(self) -> List[Any]:
        return [self.stages[j] for j in self.stages]

    def before_forward(self, stage: int, microbatch: int, training: bool) -> None:
        if not self.dims.reshard_after_forward:
            return
        keep = training and (stage, microbatch) in self.keep_unsharded
        self.stages[stage].set_reshard_after_forward(not keep)

    def before_step(self) -> None:
        for root in self._roots():
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)

    def after_step(self) -> None:
        """Every stage's last backward ran: one reduce-scatter per unit, as
        ``_PipelineStageBase.perform_reduce_grad`` does in torch."""
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - optional, see _shard

        for root in self._roots():
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
            # torch offers no public call for this: stage.py's perform_reduce_grad makes
            # the same private ones (each unit's post-backward, then the root's final
            # callback, which waits on the reductions).
            state = fully_shard.state(root)
            for unit in state._state_ctx.all_states:  # noqa: SLF001 - see above
                for group in _param_groups(unit):
                    group.post_backward()
            state._root_post_backward_final_callback()  # noqa: SLF001 - see above

    def after_evaluation(self) -> None:
        for root in self._roots():
            root.reshard()


def graph_units(stage: nn.Module) -> List[nn.Module]:
    """The submodules of a traced stage (a ``GraphModule`` holding the model's modules
    at their paths) that can be FSDP units of their own.

    A unit's parameters are gathered by its forward hooks, so only a module that the
    graph calls (``call_module``) exactly once, whose parameters it does not also read
    directly (``get_attr``: a module traced through reads its weights so) and that
    shares no parameter with another module of the stage qualifies; every other
    parameter belongs to the stage's root unit, gathered before the stage's forward.
    A graph without ``call_module`` nodes (``torch.export``) has no units: one root.

    Args:
        stage: a traced stage.

    Returns:
        The units, in graph order.
    """
    graph = getattr(stage, "graph", None)
    if graph is None:
        return []
    calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    read = [str(n.target) for n in graph.nodes if n.op == "get_attr"]
    uses: Dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    units = []
    for target, count in calls.items():
        module = stage.get_submodule(target)
        params = [p for _, p in module.named_parameters(remove_duplicate=False)]
        if count != 1 or not params or any(uses[id(p)] > 1 for p in params):
            continue
        if any(r == target or r.startswith(target + ".") for r in read):
            continue
        units.append(module)
    return units


def _param_groups(state: Any) -> List[Any]:
    """An FSDP state's parameter groups (a list since torch 2.10, one group before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []

