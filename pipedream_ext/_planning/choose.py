"""Choosing the whole configuration at start-up: ``schedule="auto"``, ``microbatches="auto"``,
``recompute="auto"`` and ``memory=``, and the prediction of a configuration the user fixed.

Collective, as ``startup.auto_plan`` is: every rank joins the calibration
(``calibration.calibrate``: the machine's per-action, per-step and transfer costs),
rank 0 measures the layers' affine costs on the sample (``layer_costs``) and either
searches (``configuration.search``) or predicts the configuration the user fixed
(``configuration.predict``); every rank gets the same result as JSON bytes (no pickle),
and an error on rank 0 is raised on every rank. A search's result comes as a
:class:`~pipedream_ext.planner.Plan` holding the whole configuration (``Plan.configuration``),
so that ``pipe.plan.save`` writes what ``balance="plan.json"`` fixes again.
What the user fixed enters the search space as its only value (:class:`Request`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from .. import configuration, schedules
from .._dist import collectives
from ..configuration import Configuration, LayerCost, MachineCosts
from ..planner import Plan, Stage, Topology
from .calibration import calibrate
from .graph_profile import GraphGroups
from .layer_costs import LayerCosts, balance_bounds, default_microbatch_sizes, measure_layer_costs
from .mesh_calibration import mesh_costs
from .profile_chain import ProfileChain

__all__ = ["COST_MODEL", "Measuring", "Request", "best_of", "choose",
           "microbatch_sizes", "plan_of", "predict_fixed", "sample_rows", "schedule_candidates",
           "search_profile", "unsearchable"]

_log = logging.getLogger(__name__)

#: The plan's ``cost_model`` for a configuration the search chose.
COST_MODEL = "configuration"


Mesh = Tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Request:
    """What the user left to the planner and what they fixed, as a search space.

    Attributes:
        schedules: candidate schedule names (one: fixed).
        microbatches: candidate counts (one: fixed), or ``None``: the counts worth trying
            for each pipeline's batch (``configuration.microbatch_candidates``).
        chunks: chunk counts tried for multi-chunk schedules.
        balance: fixed layers per stage, or ``None`` (searched).
        recompute: ``"never"``, ``"always"``, ``"search"`` or one bool per stage.
        memory: bytes per rank, or ``None`` (no limit).
        meshes: candidate ``(pp, dp, tp)`` (one: fixed).
        fsdp: how data parallelism holds the stages, each tried where ``dp > 1``
            (``(False, True)``: ``data_parallel="auto"``): sharded (FSDP) or replicated.
        global_batch: the sample is the whole run's batch, each of the ``dp`` pipelines
            getting ``rows / dp`` of it (``mesh="auto"``); else one pipeline's batch.
        on_mesh: the meshes that run on a DeviceMesh, whose every dp rank's batch must
            split into equal microbatches (the others run without one: any count).
        tp_traffic: per layer of the chain, the collectives a ``tensor_parallel`` plan
            adds at ``tp > 1`` (``(calls per microbatch, bytes per sample)``,
            ``_parallel.tp_costs``), or empty (none).
        eps: the expert-parallel sizes tried (``expert_parallel=``; ``(1,)``: none): of
            each mesh's dp copies, how many share each stage's experts (each ``ep``
            dividing dp is a search of its own).
        ep_traffic: per layer of the chain, what an ``expert_parallel`` plan adds
            (``(expert bytes, all_to_all calls per microbatch, bytes per sample)``,
            ``_parallel.ep_costs``), or empty (none).
    """

    schedules: List[str]
    microbatches: Optional[List[int]]
    chunks: Tuple[int, ...]
    balance: Optional[List[int]]
    recompute: Union[str, List[bool]]
    memory: Optional[float]
    meshes: List[Mesh]
    fsdp: Tuple[bool, ...] = (False,)
    global_batch: bool = False
    on_mesh: Sequence[Mesh] = ()
    tp_traffic: Sequence[Tuple[float, float]] = ()
    eps: Tuple[int, ...] = (1,)
    ep_traffic: Sequence[Tuple[float, float, float]] = ()

    def batch_of(self, rows: int, dp: int) -> int:
        """Samples per step of one pipeline: ``rows`` of the sample, split over ``dp``
        when it is the whole run's batch."""
        return rows // dp if self.global_batch else rows

    def searches(self, rows: int) -> List[Tuple[int, bool, Dict[str, Any]]]:
        """One search per pipeline batch, microbatch rule and data parallelism: each
        ``(batch, fsdp, keywords of configuration.search)``; a mesh whose batch no
        candidate count fits is left out.

        Raises:
            ValueError: no mesh left (:func:`unsearchable`).
        """
        out = []
        groups: Dict[Tuple[int, bool], List[Mesh]] = {}
        for mesh in self.meshes:
            even = tuple(mesh) in {tuple(m) for m in self.on_mesh}
            groups.setdefault((mesh[1], even), []).append(mesh)
        for (dp, even), meshes in groups.items():
            batch = self.batch_of(rows, dp)
            counts = [m for m in (self.microbatches or configuration.microbatch_candidates(batch))
                      if m <= batch and (not even or batch % m == 0)]
            if batch < 1 or not counts:
                continue
            for fsdp in (self.fsdp if dp > 1 else (False,)):
                for ep in (e for e in self.eps if dp % e == 0):
                    pp, _, tp = meshes[0]
                    out.append((batch, fsdp, dict(
                        world_size=pp * dp * tp, batch_size=batch, schedules=list(self.schedules),
                        microbatches=counts, meshes=meshes, balance=self.balance,
                        recompute=self.recompute, memory=self.memory,
                        interleaved_chunks=self.chunks, fsdp=fsdp, ep=ep)))
        if not out:
            raise unsearchable(self, rows)
        return out


def best_of(layers: Sequence[LayerCost], machine: MachineCosts,
            searches: Sequence[Tuple[int, bool, Dict[str, Any]]],
            candidates: int = 5) -> Tuple[Configuration, int]:
    """The best configuration of every search (:meth:`Request.searches`: one per pipeline
    batch and data parallelism, ``configuration.search`` scores one batch and one
    sharding), by predicted step time, each search's runners-up merged.

    Returns:
        The best configuration (``data_parallel`` recorded where ``dp > 1``) with the
        ``candidates`` best others, and its pipeline's batch.

    Raises:
        ValueError: nothing fits ``memory`` in any search (each one's smallest peak named).
    """
    found: List[Tuple[Configuration, int]] = []
    errors = []
    for batch, fsdp, arguments in searches:
        try:
            best = configuration.search(layers, machine, **arguments)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        for c in [best] + best.candidates:
            c.candidates = []
            c.data_parallel = ("fsdp" if fsdp else "replicate") if c.mesh[1] > 1 else None
            found.append((c, batch))
    if not found:
        raise ValueError(errors[0] if len(errors) == 1 else
                         "no configuration fits on any mesh or data parallelism: " + "; ".join(errors))
    found.sort(key=lambda cb: cb[0].predicted_step_seconds or 0.0)  # stable: search order on ties
    best, batch = found[0]
    best.candidates = [c for c, _ in found[1:candidates + 1]]
    return best, batch


def with_tp_traffic(layers: Sequence[LayerCost],
                    traffic: Sequence[Tuple[float, float]]) -> List[LayerCost]:
    """``layers`` with a tensor-parallel plan's collectives (:attr:`Request.tp_traffic`;
    empty: ``layers`` as they are)."""
    if not traffic:
        return list(layers)
    return [dataclasses.replace(layer, tp_collectives=calls, tp_collective_bytes_per_sample=size)
            for layer, (calls, size) in zip(layers, traffic)]


def with_ep_traffic(layers: Sequence[LayerCost],
                    traffic: Sequence[Tuple[float, float, float]]) -> List[LayerCost]:
    """``layers`` with an expert-parallel plan's experts and exchanges
    (:attr:`Request.ep_traffic`; empty: ``layers`` as they are)."""
    if not traffic:
        return list(layers)
    return [dataclasses.replace(layer, expert_parameter_bytes=min(experts, layer.parameter_bytes),
                                all_to_all_calls=calls, all_to_all_bytes_per_sample=size)
            for layer, (experts, calls, size) in zip(layers, traffic)]


def unsearchable(request: Request, rows: int) -> ValueError:
    """The error of a request with no search (:meth:`Request.searches` finds none): its
    fixed microbatch count fits no candidate pipeline's batch."""
    split = " split over dp" if request.global_batch else ""
    return ValueError(
        f"microbatches={request.microbatches} fits no pipeline's batch of the candidate meshes "
        f"{[list(m) for m in request.meshes]} (the sample's {rows} rows{split}): a count must "
        "be at most a pipeline's rows and, on a mesh, divide them; give microbatches='auto' or "
        "such a count")


def schedule_candidates(schedule: str, chunks: int, num_layers: int, pp: int,
                        multi_chunk: bool = True) -> List[str]:
    """The flush schedules ``schedule="auto"`` tries (``[schedule]`` when one is named):
    with ``chunks`` above 1 only those running that many chunks per rank; multi-chunk ones
    only when the model has a layer for each of their ``pp * chunks`` stages (and
    ``multi_chunk``: a traced model's plan places one stage per rank)."""
    if schedule != "auto":
        return [schedule]
    names = []
    for name in configuration.flush_schedules():
        traits = schedules.traits(name)
        runs = traits.fixed_chunks or (chunks if chunks != 1 else 2)
        if not traits.multi_chunk:
            if chunks == 1:
                names.append(name)
        elif multi_chunk and (traits.fixed_chunks in (0, chunks) or chunks == 1):
            if num_layers >= pp * runs:
                names.append(name)
    return names


def sample_rows(sample: Any) -> int:
    """Rows of the sample's inputs (their first tensor's dim 0): the batch one pipeline gets.

    Raises:
        ValueError: no tensor in the sample's inputs.
    """
    leaves = [t for t in pytree.tree_leaves(sample[0]) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves:
        raise ValueError("sample=(inputs, targets) holds no tensor with a batch dimension in its "
                         "inputs; the planner sizes microbatches from it: pass one batch")
    return int(leaves[0].shape[0])


def microbatch_sizes(searches: Sequence[Tuple[int, Sequence[int]]]) -> List[int]:
    """The microbatch sizes the layers are timed at (the affine fit needs two): the
    smallest and the largest microbatch any ``(batch, counts)`` makes, or with one size
    that one and ``layer_costs``' default pair."""
    sizes = {min(max(1, batch // max(counts)) for batch, counts in searches),
             max(-(-batch // min(counts)) for batch, counts in searches)}
    if len(sizes) == 1:
        sizes.update(default_microbatch_sizes(max(batch for batch, _ in searches)))
    return sorted(sizes)


@dataclasses.dataclass(frozen=True)
class Measuring:
    """What measuring the model (rank 0) and the machine (every rank) needs.

    Attributes:
        module: the whole model (an ``nn.Sequential``).
        loss_fn: the pipeline's loss.
        sample: ``(inputs, targets)`` of one batch of one pipeline.
        group: every rank of the run (a mesh's every rank).
        device: this rank's device.
        timeout: seconds any wait may take.
        pipeline: ``PipeDream``'s constructor (the calibration times our runtime).
        concrete_args: a traced model's fixed non-tensor ``forward`` arguments.
        grouped: a traced model's groups (the chain the search cuts), else ``None``.
    """

    module: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    sample: Tuple[Any, Any]
    group: dist.ProcessGroup
    device: torch.device
    timeout: float
    pipeline: Callable[..., Any]
    concrete_args: Optional[Mapping[str, Any]] = None
    grouped: Optional[GraphGroups] = None

    def costs(self, searches: Sequence[Tuple[int, Sequence[int]]]) -> LayerCosts:
        """The layers' costs on the sample, timed at the microbatch sizes the ``(batch,
        microbatch counts)`` of ``searches`` make (:func:`microbatch_sizes`)."""
        return measure_layer_costs(self.module, self.sample, self.loss_fn,
                                   microbatch_sizes=microbatch_sizes(searches),
                                   concrete_args=self.concrete_args, grouped=self.grouped)


def _on_rank_zero(measuring: Measuring, what: str, compute: Callable[[MachineCosts], str],
                  shardings: Sequence[bool] = ()) -> str:
    """Every rank calibrates (with ``shardings``, the data parallelism scored: each a
    ``Request.fsdp`` value, its in-step calls too, ``mesh_calibration``); rank 0 runs
    ``compute(machine)`` (JSON text); every rank gets that text, or raises rank 0's error.

    Raises:
        ValueError: what ``compute`` raised on rank 0 (the original exception there).
    """
    group = measuring.group
    machine = calibrate(group, measuring.device, timeout=measuring.timeout,
                        pipeline=measuring.pipeline)
    if shardings:
        machine = mesh_costs(group, measuring.device, machine, timeout=measuring.timeout,
                             pipeline=measuring.pipeline, fsdp=any(shardings))
    return collectives.from_rank_zero(lambda: compute(machine), group, f"{what}: rank 0 failed")


def choose(measuring: Measuring, request: Request) -> Tuple[Configuration, Plan]:
    """Searches the best configuration of ``request`` (collective over ``measuring.group``).

    Returns:
        The chosen configuration (with its prediction and runners-up), the same on every
        rank, and the plan recording it.

    Raises:
        ValueError: on every rank: nothing fits ``memory`` (naming the smallest peak),
            or what measuring or searching raised on rank 0.
    """
    rows = sample_rows(measuring.sample)

    def search(machine: MachineCosts) -> str:
        started = time.perf_counter()
        searches = request.searches(rows)
        costs = measuring.costs([(batch, arguments["microbatches"])
                                 for batch, _, arguments in searches])
        measured = time.perf_counter()
        layers = with_ep_traffic(with_tp_traffic(costs.layers, request.tp_traffic), request.ep_traffic)
        best, batch = best_of(layers, machine, searches)
        _log.info("measured %d layers in %.2f s, searched in %.3f s", len(costs.layers),
                  measured - started, time.perf_counter() - measured)
        return plan_of(best, costs, batch, machine).to_json(indent=None)

    # A mesh with dp or tp > 1: its in-step calls measured.
    meshes = any(dp * tp > 1 for _, dp, tp in request.meshes)
    plan = Plan.from_json(_on_rank_zero(measuring, "choosing the configuration", search,
                                        request.fsdp if meshes else ()))
    assert plan.configuration is not None
    return Configuration.from_dict(plan.configuration), plan


def predict_fixed(measuring: Measuring, fixed: Configuration, memory: Optional[float],
                  fsdp: bool, ep_traffic: Sequence[Tuple[float, float, float]] = ()) -> Configuration:
    """The prediction of a configuration the user fixed (collective over ``measuring.group``),
    with an expert-parallel plan's ``ep_traffic`` (:attr:`Request.ep_traffic`).

    Returns:
        ``fixed`` with its prediction, the same on every rank.

    Raises:
        ValueError: on every rank, what measuring or predicting raised on rank 0.
    """
    batch = sample_rows(measuring.sample)

    def predict(machine: MachineCosts) -> str:
        costs = measuring.costs([(batch, [fixed.microbatches])])
        prediction = configuration.predict(with_ep_traffic(costs.layers, ep_traffic), machine, fixed,
                                           batch, memory=memory, fsdp=fsdp)
        return json.dumps(dataclasses.replace(fixed, prediction=prediction).to_dict())

    text = _on_rank_zero(measuring, "predicting the configuration", predict,
                         (fsdp,) if fixed.mesh[1] * fixed.mesh[2] > 1 else ())
    return Configuration.from_dict(json.loads(text))


def plan_of(chosen: Configuration, costs: LayerCosts, batch: int, machine: MachineCosts,
            stage_nodes: Optional[List[List[str]]] = None) -> Plan:
    """The plan file of a chosen configuration (``batch``: its pipeline's samples per
    step): a stage per pipeline stage (its layers, ranks, compute per step and the peak
    bytes of its rank) and the whole configuration. ``stage_nodes``: the profile node
    ids of each stage where the chain is a branching profile's (``profile_chain``).

    ``data_parallel_time`` is plain data parallelism without its communication (the
    layers' compute over every rank): a bound, not a prediction.
    """
    pp, dp, tp = chosen.mesh
    layers = costs.layers
    sched = schedules.build(chosen.schedule, stages=pp, microbatches=chosen.microbatches,
                            chunks=chosen.chunks)
    size = batch / chosen.microbatches
    assert chosen.prediction is not None
    peaks = chosen.prediction.peak_bytes
    # An nn.Sequential's stages list its children; a traced model's or a branching
    # profile's, its nodes.
    chain = costs.group_of is None and stage_nodes is None
    nodes = stage_nodes
    if nodes is None:
        bounds = balance_bounds(chosen.balance, len(layers))
        nodes = [[str(l) for l in range(lo, hi)] for lo, hi in zip(bounds, bounds[1:])] if chain \
            else costs.stage_nodes(chosen.balance)
    stages, start = [], 0
    for j, count in enumerate(chosen.balance):
        part = layers[start:start + count]
        compute = chosen.microbatches * sum(
            c.forward_fixed + c.backward_fixed + size * (c.forward_per_sample + c.backward_per_sample)
            for c in part) / tp
        ranks = list(sched.stage_ranks(j))
        stages.append(Stage(nodes=nodes[j], replicas=1, ranks=ranks, time=compute,
                            compute_seconds=compute,
                            parameter_bytes=sum(c.parameter_bytes for c in part),
                            memory_bytes=max(peaks[r] for r in ranks),
                            layers=(start, start + count) if chain else None))
        start += count
    single = sum(c.forward_fixed + c.backward_fixed +
                 batch * (c.forward_per_sample + c.backward_per_sample) for c in layers)
    bottleneck = max(s.time for s in stages)
    ideal_dp = single / (pp * dp * tp)
    mesh = {} if dp * tp == 1 else {"data_parallel": dp,
                                    "sharding": chosen.data_parallel or "replicate",
                                    "tensor_parallel": tp if tp > 1 else None}
    return Plan(stages=stages, time_per_stage=bottleneck, data_parallel_time=ideal_dp,
                speedup_over_dp=ideal_dp / bottleneck if bottleneck > 0 else 0.0,
                single_worker_time=single, num_workers=pp, used_workers=pp, cost_model=COST_MODEL,
                topology=Topology(workers=(pp,), bandwidth=(machine.bandwidth,)), chain=chain,
                configuration=chosen.to_dict(), **mesh)


def search_profile(chain: ProfileChain, machine: MachineCosts, request: Request,
                   batch_size: int) -> Tuple[Configuration, Plan]:
    """The best configuration of ``request`` for a profile's chain (the CLI's
    ``plan --auto``), and its plan.

    Raises:
        ValueError: nothing fits ``memory``, or a bad search space.
    """
    best, batch = best_of(chain.costs.layers, machine, request.searches(batch_size))
    return best, plan_of(best, chain.costs, batch, machine,
                         None if chain.nodes is None else chain.stage_nodes(best.balance))
