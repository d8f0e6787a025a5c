"""Building a pipeline: ``PipeDream``'s arguments -> this rank's runnable parts.

Owns construction, in the order every rank runs it: the checks that need no
process group (the kind of model, ``PipelineConfig``), the default group, the
partition (an ``nn.Sequential``'s layer counts, a traced model's split points, or
a plan: ``balance="auto"`` or a saved one, ``_planning``), the parameters shared
by stages, every rank's agreement at construction (``_dist.agreement``), the
schedule and the process groups, this rank's stages (deferred initialisation,
replicas starting from their leader's weights) and the runner.
:func:`build_pipeline` returns one :class:`BuiltPipeline`, which ``PipeDream`` holds.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import itertools
import logging
import os
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from . import configuration, schedules
from ._checkpoint import reshard
from ._dist import collectives, signals
from ._dist.agreement import StepAgreement, agree_at_construction
from ._dist.fingerprint import layers_fingerprint
from ._dist.groups import PipelineGroups, init_default_group
from ._extension import _C
from ._frontend import compiled, deferred_init, export, model_io
from ._frontend.graph_split import (
    TracedSplit,
    UntraceableError,
    reorder_cuts,
    split_model,
)
from ._frontend.local_stages import LocalStages
from ._frontend.partition import Partition, resolve_partition
from ._frontend.tied_params import (
    SharedParameter,
    describe,
    find_shared,
    find_shared_in_stages,
)
from ._parallel import auto_mesh, ep_costs, tp_costs, tp_record
from ._parallel.data_parallel import DataParallel
from ._parallel.dims import ParallelDims, check_expert_mesh, check_schedule, resolve_dims
from ._parallel.expert_parallel import check_plan_matches, meta_tracing_refused, resolve_auto
from ._parallel.fsdp import refuse_split_ties
from ._parallel.parallelize import data_parallel_policy, parallelize_stages
from ._parallel.tensor_parallel import (
    CutLayouts,
    LayoutExchange,
    check_split_points,
    enclosing_calls,
    kept_calls,
    sequence_parallel,
)
from ._parallel.tp_tied import refuse_split_ties as refuse_split_ties_over_tp
from ._planning import choose
from ._planning.graph_profile import (
    GraphGroups,
    plan_split_labels,
    plan_stage_of,
    profile_groups,
    trace_groups,
)
from ._planning.startup import auto_plan, check_plan_world, partition_from_plan
from ._runtime import optimizer_check, overlap
from ._runtime.config import PipelineConfig
from ._runtime.grad_clip import check_updates_aligned
from ._runtime.observe import Observer
from ._runtime.options import AUTO, PipelineOptions, agreed_values, provisional, searched
from ._runtime.runners import Runner, make_runner
from ._runtime.stage_call import StageFunction, Tensors
from ._runtime.tied_grads import SharedGradients
from .configuration import Configuration
from .planner import Plan

__all__ = ["BuiltPipeline", "CutModel", "PipelineArguments", "PlannedTrace", "PreparedModel",
           "build_pipeline", "default_device", "prepare_model"]

# The pipeline's messages, under the logger name the runners use too.
_log = logging.getLogger("pipedream_ext._pipe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineArguments(PipelineOptions):
    """``PipeDream``'s arguments as the user gave them: the model, the loss and the
    options (``_runtime/options.py``; each one: its docstring)."""

    module: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    #: The options the user gave (the others took their defaults): a saved configuration
    #: fixes those left, and refuses one given otherwise.
    given: FrozenSet[str] = frozenset()
    #: ``PipeDream``'s constructor: the start-up calibration times a pipeline of its own.
    pipeline: Optional[Callable[..., Any]] = None

    def checked_config(self) -> PipelineConfig:
        """The options that need no process group, checked (``PipelineConfig.of``); what
        is left to the planner (``"auto"``) as a value it may choose (``options.provisional``).

        Raises:
            ValueError: a bad value, named with its fix.
        """
        return PipelineConfig.of(provisional(self))


@dataclasses.dataclass
class BuiltPipeline:
    """Everything one rank's ``PipeDream`` holds once built.

    Attributes:
        config: the checked arguments.
        device: where this rank's layers live.
        traced: a traced model's stages (``split_points`` or a plan), else ``None``.
        plan: the plan the stages come from (``balance="auto"`` or saved), else ``None``.
        shared_parameters: parameters used by layers of several stages (tied weights).
        model_shapes: every ``state_dict`` key of the whole model and its shape.
        action_feed: the asynchronous schedule's action feed (streaming schedules), else ``None``.
        schedule: the schedule run (for asynchronous ones: one period of it).
        groups: the pipeline's process groups.
        stages: this rank's stages.
        observer: stats and trace.
        stage_fn: the executor's forward callback.
        runner: drives the executor step by step.
        agreement: the check of the first calls' batches on every rank.
        dims: how the run is split (pp, dp, tp), with or without a mesh.
        data_parallel: data parallelism's policy (its hooks do nothing with ``dp = 1``).
        deferred: the model was built on the meta device (deferred initialisation).
        configuration: the configuration run with its prediction (chosen by the planner,
            read from a plan file, or the user's, predicted when ``sample`` was given), else
            ``None``.
    """

    config: PipelineConfig
    device: torch.device
    traced: Optional[TracedSplit]
    plan: Optional[Plan]
    shared_parameters: List[SharedParameter]
    model_shapes: Dict[str, Tuple[int, ...]]
    action_feed: Optional["_C.AsyncActionFeed"]
    schedule: "schedules.Schedule"
    groups: PipelineGroups
    stages: LocalStages
    observer: Observer
    stage_fn: StageFunction
    runner: Runner
    agreement: StepAgreement
    dims: ParallelDims
    data_parallel: DataParallel
    deferred: bool = False
    configuration: Optional[Configuration] = None


def build_pipeline(args: PipelineArguments) -> BuiltPipeline:
    """Builds this rank's part of the pipeline. Collective: every rank of the group
    calls it with the same arguments (which it checks: ``agree_at_construction``).

    Args:
        args: ``PipeDream``'s arguments.

    Returns:
        What ``PipeDream`` holds.

    Raises:
        ValueError: as ``PipeDream`` documents (every check names the value and the fix).
        RuntimeError: no process group and no torchrun environment.
    """
    args, compile_context = _unwrap_compiled(args)
    args = _recorded_tensor_parallel(args)
    args = dataclasses.replace(args, expert_parallel=resolve_auto(args.expert_parallel, args.module))
    check_expert_mesh(args.mesh, args.expert_parallel)
    check_plan_matches(args.expert_parallel, args.module)
    originals = optimizer_check.original_parameters(args.module)  # before any is replaced
    prepared = prepare_model(args)
    model_shapes = reshard.key_shapes(args.module)
    config = args.checked_config()
    _check_search(args, prepared)
    device = _join_default_group(args.device, config.timeout)
    args, dims, chosen, chosen_plan = _choose_configuration(args, prepared, config, device)
    config = args.checked_config()
    own_hook = overlap.hook_of(True, args.module) if config.overlap is True else None
    if own_hook is not None:  # the model class's own overlapped_forward_backward
        config = dataclasses.replace(config, overlap=own_hook)
    check_schedule(dims, config.schedule, config.asynchronous, planned=False)
    cut = cut_model(args, prepared, config, dims)
    cut.plan = chosen_plan or cut.plan
    if chosen is None:
        chosen, cut.plan = _predict_fixed(args, prepared, config, cut, dims, device)
    _refuse_shared_if_asynchronous(config, cut.shared_parameters)
    cut.traced = _agree_everywhere(args, cut, prepared.init_seed if prepared.deferred else None, dims)
    action_feed, schedule = _build_schedule(config, cut.partition)
    if config.clip_grad_norm is not None:
        check_updates_aligned(action_feed, config.schedule, config.microbatches,
                              list(cut.partition.replicas))
    stage_ranks = [schedule.stage_ranks(j) for j in range(schedule.num_stages)]
    recomputes = config.rank_recomputes([schedule.stages_of_rank(r)
                                         for r in range(schedule.num_ranks)])
    refuse_split_ties(dims, _tied_units(args.module, cut, stage_ranks))
    dims.create_groups(config.timeout)  # on a mesh, pp_group's waits are now bounded by timeout=
    groups = PipelineGroups.create(dims.pp_group, stage_ranks, config.timeout)
    data_parallel = data_parallel_policy(dims, config.loss_reduction.averages_over_dp,
                                         lambda: schedule.actions(groups.rank, comm=False))
    stages = _local_stages(args, prepared, cut, schedule.stages_of_rank(groups.rank), device,
                           config.timeout, dims, data_parallel)
    _broadcast_replicas(stages, groups)
    if dims.tp_enabled:
        refuse_split_ties_over_tp(cut.shared_parameters, stages.module, groups.group)
    if compile_context is not None:
        for j in stages:
            compiled.compile_stage(stages[j], compile_context)
    shared_gradients = SharedGradients(cut.shared_parameters, stages, stage_ranks, groups.group,
                                       config.timeout, dims.pipelines)
    # Every copy starts as the first use's stage has it (meta layers are
    # initialised per rank, each from its own layer's seed).
    shared_gradients.synchronize_values()
    observer = _observer(args.trace, groups, stages, config, device, dims)
    if chosen is not None and chosen.prediction is not None:
        observer.expect(chosen.prediction, _pipeline_rank(groups.rank, cut.partition))
    cuts = CutLayouts(dims.tp_mesh, dims.tensor_parallel, {j: stages[j] for j in stages},
                      LayoutExchange.agree(dims.world_group, dims.copy, config.timeout)
                      ) if dims.tp_enabled else None
    stage_fn = _stage_function(args.loss_fn, cut.traced, stages, schedule, groups, config, device,
                               recomputes[groups.rank], dims.names.of_group(groups.rank), cuts,
                               copies=dims.dp_size)
    input_names = None if cut.traced is None or cut.traced.input_names is None else \
        list(cut.traced.input_names)
    runner = make_runner(config, schedule, action_feed, stages, groups, stage_fn, observer, device,
                         data_parallel, shared_gradients=shared_gradients, input_names=input_names)
    # Over a mesh every pipeline agrees at once: what one refuses, all raise.
    agreement = StepAgreement(dims.world_group, stage_ranks[0], stage_ranks[-1],
                              config.check_agreement, dims.names, dims.tp_size, runner.validate)
    optimizer_check.watch(stages.module, originals, groups.rank)
    _log.info("rank %d: stages %s (layers %s) of %d, schedule %s, %d microbatches",
              groups.rank, stages.indices, [stages.layers[j] for j in stages.indices],
              schedule.num_stages, config.schedule, config.microbatches)
    if chosen is not None and dist.get_rank(dims.world_group) == 0:
        _log.info("configuration:\n%s", chosen.summary())
    return BuiltPipeline(config, device, cut.traced, cut.plan, cut.shared_parameters,
                         model_shapes, action_feed, schedule, groups, stages, observer, stage_fn,
                         runner, agreement, dims, data_parallel, prepared.deferred, chosen)


def _unwrap_compiled(args: PipelineArguments) -> Tuple[PipelineArguments, Optional[Callable[..., Any]]]:
    """A model wrapped by ``torch.compile``: the arguments with the model itself (split
    points as it names them) and the wrapper's compile settings, which compile each
    stage once built (``_frontend.compiled``)."""
    module, context = compiled.unwrap_compiled(args.module)
    if context is None:
        return args, None
    return dataclasses.replace(args, module=module, split_points=compiled.strip_compiled_prefix(
        args.split_points)), context


def _recorded_tensor_parallel(args: PipelineArguments) -> PipelineArguments:
    """A callable ``tensor_parallel`` plan on a traced model, as the dict it applies
    (``tp_record``: the stages replay it module by module); anything else as it is."""
    plan, mesh = args.tensor_parallel, args.mesh
    if args.split_points is None or plan is None or isinstance(plan, Mapping) or \
            "tp" not in (getattr(mesh, "mesh_dim_names", None) or ()):
        return args  # a mesh without tp (or none): refused with the mesh's checks
    return dataclasses.replace(args, tensor_parallel=tp_record.recorded_plan(plan, args.module, mesh["tp"]))


def _parallel_dims(args: PipelineArguments, config: PipelineConfig) -> ParallelDims:
    """``mesh`` (or ``process_group``) and the data-parallel arguments, checked
    (``_parallel.dims``).

    Raises:
        ValueError: what ``resolve_dims`` and ``check_schedule`` refuse.
    """
    dims = resolve_dims(args.mesh, args.data_parallel, args.process_group, args.replicas,
                        args.reshard_after_forward, args.mp_policy, args.tensor_parallel,
                        args.expert_parallel)
    check_schedule(dims, config.schedule, config.asynchronous,
                   planned=_is_plan(args.balance) and not isinstance(args.module, nn.Sequential))
    return dims


# -- before any communication -----------------------------------------------------------
class PlannedTrace:
    """A traced model grouped for the planner (``graph_profile``), waiting for its plan.

    Tracing and grouping run on every rank before any communication; rank 0 also
    profiles the groups for ``balance="auto"``; every rank then cuts the model as
    the plan's stages say (and the ranks compare what they cut: ``agreement``).

    Args:
        module: the whole model.
        grouped: its traced graph cut into groups.
        inputs: the sample's tensor inputs in the graph's order.
        targets: the sample's targets.
        concrete_args: the non-tensor ``forward`` arguments fixed for tracing.
        named: the sample's inputs by name (a dict), or ``None`` (positional).
    """

    def __init__(self, module: nn.Module, grouped: GraphGroups, inputs: Tuple[torch.Tensor, ...],
                 targets: Any, concrete_args: Optional[Mapping[str, Any]],
                 named: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self.module, self.grouped = module, grouped
        self.inputs, self.targets, self.concrete_args = inputs, targets, concrete_args
        self.named = named

    @classmethod
    def trace(cls, module: nn.Module, sample: Optional[Tuple[Tensors, Any]],
              concrete_args: Optional[Mapping[str, Any]]) -> "PlannedTrace":
        """Traces and groups ``module`` on the inputs of ``sample`` (no communication):
        a tensor, a tuple of tensors (positional) or a dict of named tensors (keywords).

        Raises:
            ValueError: no sample, a meta-device model, or one torch.fx cannot trace
                (naming split_points for a model only torch.export traces).
        """
        if sample is None or not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise ValueError(f"{type(module).__name__} is not an nn.Sequential, so a plan runs on "
                             "its traced graph: pass sample=(inputs, targets), one batch to trace "
                             "(and profile) it on (inputs: a tensor, a tuple of tensors or a dict "
                             "of named tensors)")
        if deferred_init.has_meta_tensors(module):
            raise ValueError("a plan for a model that is not an nn.Sequential needs its traced "
                             "graph, which runs the sample, which the meta device cannot; build "
                             "the model on a real device")
        first, names = model_io.distinct_inputs(sample[0], module), None
        if isinstance(first, Mapping):  # keyword tensors, in forward's order
            model_io.positional_inputs(list(first), first, "sample")  # tensors only
            order = list(inspect.signature(module.forward).parameters)
            names = sorted(first, key=lambda k: order.index(k) if k in order else len(order))
            inputs = tuple(first[k] for k in names)
        else:
            inputs = tuple(first) if isinstance(first, (tuple, list)) else (first,)
        try:
            grouped = trace_groups(module, inputs, concrete_args, input_names=names)
        except UntraceableError as exc:
            raise ValueError(
                f"{exc.reason}. balance='auto' and plan files cut torch.fx graphs (docs/tracing.md"
                "#planning-a-traced-model-balanceauto); a model only torch.export traces (a "
                "Hugging Face transformer) takes split_points=[module names] instead, e.g. a "
                "decoder layer per stage boundary; for a forward that neither can trace: "
                f"{exc.advice}") from exc
        return cls(module, grouped, inputs, sample[1], concrete_args,
                   dict(first) if names is not None else None)

    def profile_fn(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        """Rank 0's profile for ``balance="auto"``: the groups timed on the sample."""
        return lambda: profile_groups(self.grouped, self.inputs, loss_fn, self.targets,
                                      steps=10, warmup=3)

    def split(self, plan: Plan) -> TracedSplit:
        """The stages of ``plan`` (every rank, the same plan).

        Raises:
            ValueError: a plan of another model or grouping, or one that cannot run
                (a value flowing backwards, an empty stage, a non-tensor crossing).
        """
        stage_of = plan_stage_of(self.grouped, plan)
        return split_model(self.module, plan_split_labels(self.grouped, stage_of),
                           self.named if self.named is not None else self.inputs,
                           self.concrete_args, stage_of=stage_of,
                           traced=(self.grouped.gm, self.grouped.kinds))


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    """What kind of model this is, checked before any communication.

    Attributes:
        traced: the traced stages (``split_points``), else ``None``.
        planned: the traced and grouped model waiting for its plan (not an
            ``nn.Sequential``, with ``balance="auto"`` or a plan), else ``None``.
        deferred: whether the model is on the meta device (deferred initialisation).
        init_seed: the checked base seed of deferred initialisation.
    """

    traced: Optional[TracedSplit]
    planned: Optional[PlannedTrace]
    deferred: bool
    init_seed: int


def prepare_model(args: PipelineArguments) -> PreparedModel:
    """Checks what kind of model this is and traces it if needed (no communication).

    Args:
        args: ``PipeDream``'s arguments.

    Returns:
        The model's kind, traced where it needs to be.

    Raises:
        ValueError: not an ``nn.Sequential`` without split points, ``concrete_args``
            without split points, a balance that names no file, a bad seed, a meta
            module that cannot be initialised, or ``balance="auto"`` on the meta device.
    """
    module, balance = args.module, args.balance
    traced = planned = None
    deferred = deferred_init.has_meta_tensors(module)
    if args.split_points is not None:
        if deferred:  # before tracing: every unit needs an initialiser
            deferred_init.check_traced_initialisable(module, args.init_fn)
        traced = _trace_stages(args)
    elif not isinstance(module, nn.Sequential) and (_is_plan(balance) or searched(args)):
        planned = PlannedTrace.trace(module, args.sample, args.concrete_args)
    elif not isinstance(module, nn.Sequential):
        raise ValueError(f"module must be an nn.Sequential (got {type(module).__name__}); "
                         "wrap your layers in torch.nn.Sequential, or give "
                         "split_points=[module names] and sample=(inputs, targets) to trace "
                         "it with torch.fx, or balance='auto' and sample=(inputs, targets) to "
                         "trace, profile and plan it (docs/tracing.md)")
    elif args.concrete_args is not None:
        raise ValueError("concrete_args fixes forward arguments for tracing, which an "
                         "nn.Sequential never needs; drop concrete_args")
    if isinstance(balance, (str, os.PathLike)) and str(balance) != "auto" and \
            not os.path.isfile(balance):
        raise ValueError(f"balance={os.fspath(balance)!r} is neither 'auto' nor a plan file (no such "
                         "file); give layer counts as a list (balance=[4, 4]), 'auto' to plan at "
                         "start-up, or the path of a plan.json")
    init_seed = deferred_init.check_seed(args.init_seed)
    if deferred and traced is None:
        deferred_init.check_initialisable(module, args.init_fn)
        if isinstance(balance, str) and balance == "auto":
            raise ValueError("balance='auto' profiles the model, which cannot run on the meta "
                             "device; plan once from a real model (python -m pipedream_ext "
                             "plan) and pass balance='plan.json', or give layer counts")
    return PreparedModel(traced, planned, deferred, init_seed)


def _trace_stages(args: PipelineArguments) -> TracedSplit:
    """Checks the arguments of a traced pipeline and traces the model on ``sample``.

    Raises:
        ValueError: no sample, a balance, a split point inside a module a tensor-parallel
            plan keeps as one call, or what ``graph_split.split_model`` refuses.
    """
    module, sample = args.module, args.sample
    if args.balance is not None:
        raise ValueError(f"balance={args.balance!r} cannot be combined with split_points: the "
                         "split points fix the stages; drop balance, or drop split_points and "
                         "give balance='auto' to let the planner cut the model")
    if sample is None or not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError("split_points needs sample=(inputs, targets), one batch to trace the "
                         "model on (inputs: a tensor, a tuple of tensors or a dict of named "
                         "tensors)")
    assert args.split_points is not None
    # A tensor-parallel plan's modules stay module calls in the stages (their hooks run).
    keep: List[str] = []
    for plan in (args.tensor_parallel, args.expert_parallel):
        check_split_points(plan, module, args.split_points)
        keep += [name for name in kept_calls(plan, module) if name not in keep]
    enclosing = enclosing_calls(keep, module, args.split_points)
    first = sample[0]
    if deferred_init.has_meta_tensors(module):
        # Traced without values: the sample's shapes and dtypes on the meta device, as the
        # model's tensors are (the user's tensors stay as they are).
        first = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), first)
    if isinstance(first, Mapping):  # keyword inputs: traced by name, passed by name
        model_io.positional_inputs(list(first), first, "sample")  # tensors only
        inputs: Any = dict(first)
    else:
        inputs = tuple(first) if isinstance(first, (tuple, list)) else (first,)
    try:
        return split_model(module, args.split_points, inputs, args.concrete_args, keep_calls=keep,
                           enclosing_calls=enclosing)
    except Exception as error:
        if args.expert_parallel is not None and deferred_init.has_meta_tensors(module):
            raise meta_tracing_refused(module, error) from error
        raise


def _is_plan(balance: Any) -> bool:
    """``balance`` names a plan: ``"auto"``, a plan file or a :class:`Plan`."""
    return isinstance(balance, (Plan, str, os.PathLike))


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


def _join_default_group(device: Optional[Union[str, torch.device]],
                        timeout: float) -> torch.device:
    """This rank's device, made current (NCCL and metadata on NCCL-only groups use
    it), the default group (from the torchrun environment if needed) and clean
    exits on SIGTERM / Ctrl-C on every rank."""
    chosen = default_device() if device is None else torch.device(device)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    init_default_group(chosen, datetime.timedelta(seconds=timeout))
    signals.install()
    return chosen


# -- the configuration: chosen, read from a plan file, or predicted ----------------------------
def _check_search(args: PipelineArguments, prepared: PreparedModel) -> None:
    """What the configuration search needs, checked before any communication.

    Raises:
        ValueError: ``"auto"`` without ``sample``, with what it cannot search yet
            (``split_points``, a traced model on a mesh, a meta-device model, replicas, a
            saved plan without a configuration, an asynchronous schedule; with
            ``mesh="auto"``: ``process_group``, ``mp_policy``, ``reshard_after_forward``),
            ``data_parallel="auto"`` without a mesh, or ``memory`` with nothing left to
            search.
    """
    # A plan file recording a configuration fixes what is left to the planner.
    left = [] if _saved_configuration(args.balance) is not None else searched(args)
    refusal = _placement_refusal(args)
    if refusal:
        raise ValueError(refusal)
    if not left:
        if args.memory is not None:
            raise ValueError(f"memory={args.memory!r} limits what the planner chooses, but every "
                             "choice is fixed; pass schedule='auto', microbatches='auto', "
                             "recompute='auto', mesh='auto' or data_parallel='auto' (with sample=) "
                             "to let it search, or drop memory")
        return
    what = " and ".join(f"{name}='auto'" for name in left)
    if args.sample is None:
        batch = ("one step's batch of the whole run (every data-parallel rank's part together)"
                 if args.mesh == AUTO else "one batch of one pipeline")
        raise ValueError(f"{what} measures the model's layers on one batch: pass "
                         f"sample=(inputs, targets), {batch}")
    refusal = _search_refusal(args, prepared)
    if refusal:
        raise ValueError(f"{what}: {refusal}")


def _placement_refusal(args: PipelineArguments) -> str:
    """Why ``mesh="auto"`` or ``data_parallel="auto"`` cannot run with these arguments
    (``""``: they can)."""
    if args.data_parallel == AUTO and args.mesh is None:
        return ("data_parallel='auto' chooses how a mesh's 'dp' ranks hold the stages, but there "
                "is no mesh; pass mesh='auto' (the planner factors the world) or a DeviceMesh, or "
                "drop data_parallel")
    if args.data_parallel == AUTO and args.mp_policy is not None:
        return ("data_parallel='auto' with mp_policy= is not supported: mp_policy configures FSDP, "
                "which the planner may not choose; give data_parallel='fsdp'")
    if args.mesh != AUTO:
        return ""
    if args.process_group is not None:
        return ("mesh='auto' builds its mesh over every rank of the default group; drop "
                "process_group")
    if args.mp_policy is not None or args.reshard_after_forward:
        return ("mesh='auto' with mp_policy or reshard_after_forward is not supported: they "
                "configure FSDP, which the chosen mesh may not run; give a DeviceMesh and "
                "data_parallel='fsdp', or drop them")
    return ""


def _search_refusal(args: PipelineArguments, prepared: PreparedModel) -> str:
    """Why the search cannot run these arguments (``""``: it can)."""
    if not isinstance(args.module, nn.Sequential) and prepared.planned is None:
        return ("the planner cuts an nn.Sequential's layers or a traced model's groups; with "
                "split_points the stages are fixed: drop split_points (and give balance='auto' "
                "or None), or fix schedule, microbatches, recompute, mesh and data_parallel")
    if prepared.planned is not None and args.mesh is not None:
        return ("a traced model's chosen stages run without a mesh (as with balance='auto'); "
                "use an nn.Sequential on a mesh, or drop mesh")
    if prepared.deferred:
        return ("measuring the layers runs them, which the meta device cannot; build the "
                "model on a real device, or fix schedule, microbatches, recompute, mesh and "
                "data_parallel")
    if args.replicas is not None:
        return ("the search runs straight stages (data parallelism: mesh=); drop replicas, "
                "or fix schedule, microbatches and recompute")
    if _is_plan(args.balance) and str(args.balance) != AUTO:
        return ("balance names a saved plan of stages and replicas only; pass balance='auto' "
                "(or layer counts, or None) to search, or a plan that records its configuration "
                "(python -m pipedream_ext plan --auto, or pipe.plan.save after a search)")
    if args.schedule != AUTO and schedules.traits(args.schedule).asynchronous:
        return (f"the planner predicts flush schedules, but schedule={args.schedule!r} is "
                "asynchronous; give microbatches and recompute, or schedule='auto'")
    return ""


def _choose_configuration(args: PipelineArguments, prepared: PreparedModel,
                          config: PipelineConfig, device: torch.device
                          ) -> Tuple[PipelineArguments, ParallelDims, Optional[Configuration],
                                     Optional[Plan]]:
    """The arguments with the planner's choices in place (``mesh="auto"``: the chosen
    mesh built), the run's dims, the configuration and its plan: searched when an option
    is ``"auto"`` (collective: ``choose.choose``), read from a plan file that records one,
    or ``args`` unchanged and ``None``.

    Raises:
        ValueError: nothing fits ``memory``; no mesh ``mesh="auto"`` may build; a saved
            configuration another mesh's or one an option given differs from.
    """
    plan = _saved_configuration(args.balance)
    if plan is not None:
        assert plan.configuration is not None
        saved = configuration.Configuration.from_dict(plan.configuration)
        if saved.data_parallel is None and saved.mesh[1] > 1:  # written before it was recorded
            saved.data_parallel = plan.sharding
        _check_saved_agrees(args, saved)
        args = _placed(_resolved(args, prepared, saved, plan), saved, device)
        dims = _parallel_dims(args, config)
        shape = (dims.pp_size, dims.dp_size, dims.tp_size)
        if tuple(saved.mesh) != shape:
            raise ValueError(f"the plan's configuration runs on a (pp, dp, tp) = "
                             f"{tuple(saved.mesh)} mesh, but this run has {shape}; pass "
                             "mesh='auto' to build the plan's, or re-plan for this world "
                             "(python -m pipedream_ext plan --auto)")
        return args, dims, saved, plan
    if searched(args):
        given = None if args.mesh == AUTO else _parallel_dims(
            dataclasses.replace(args, data_parallel="fsdp") if args.data_parallel == AUTO
            else args, config)
        traced = None if prepared.planned is None else prepared.planned.grouped
        group = dist.group.WORLD if given is None else given.world_group
        chosen, plan = choose.choose(_measuring(args, group, device, config.timeout, traced),
                                     _request(args, given, traced))
        args = _placed(_resolved(args, prepared, chosen, plan), chosen, device)
        return args, _parallel_dims(args, config), chosen, plan
    return args, _parallel_dims(args, config), None, None


def _request(args: PipelineArguments, given: Optional[ParallelDims],
             traced: Optional[GraphGroups]) -> choose.Request:
    """The search space of ``args`` on the mesh ``given`` (``None``: ``mesh="auto"``,
    every factorisation of the world the run supports, the sample the global batch).

    Raises:
        ValueError: ``mesh="auto"`` and no factorisation of the world fits the model's
            layers and the sample's rows.
    """
    assert args.sample is not None
    rows = choose.sample_rows(args.sample)
    layers = len(args.module) if traced is None else len(traced.groups)
    if given is None:
        world = dist.get_world_size()
        tps = auto_mesh.tp_sizes(world, args.tensor_parallel, args.module, args.sample[0])
        eps = auto_mesh.ep_sizes(world, args.expert_parallel, args.module)
        if not eps:
            raise ValueError("expert_parallel= with mesh='auto' and a callable plan is not supported "
                             "yet: the planner cannot see which experts it shards, so it cannot "
                             "choose ep; give a dict plan {pattern: style} or a mesh with an 'ep' "
                             "dimension")
        traffic = _tp_traffic(args, traced, tps)
        if traffic is None and len(tps) > 1:
            _log.info("mesh='auto': tp %s left out: a callable tensor_parallel plan's collectives "
                      "cannot be seen, so the cost model could not price them (a dict plan can "
                      "be; or give a mesh)", tps[1:])
            tps = [1]
        meshes = auto_mesh.mesh_candidates(world, rows, layers, tps)
        if not meshes:
            raise ValueError(
                f"mesh='auto' finds no (pp, dp, tp) for {world} ranks: pp must be at most the "
                f"model's {layers} layers, dp must divide the sample's {rows} rows (the whole "
                f"run's batch), tp must be one of {tps} (1 without tensor_parallel=, else the "
                "sizes its plan splits evenly); give a sample whose rows dp divides, or a mesh")
        on_mesh = [m for m in meshes if auto_mesh.runs_on_device_mesh(m) or args.expert_parallel is not None]
    else:
        meshes = [(given.pp_size, given.dp_size, given.tp_size)]
        on_mesh = meshes if given.on_mesh else []
        traffic = _tp_traffic(args, traced, [given.tp_size])
        eps = [given.ep_size]
    fsdp = (False, True) if args.data_parallel == AUTO else \
        (given.fsdp_enabled,) if given is not None else (args.data_parallel == "fsdp",)
    return choose.Request(
        schedules=choose.schedule_candidates(args.schedule, args.chunks, layers,
                                             min(m[0] for m in meshes), multi_chunk=traced is None),
        microbatches=None if args.microbatches == AUTO else [int(args.microbatches)],
        chunks=(args.chunks,) if args.chunks != 1 else (2,),
        balance=None if args.balance in (None, AUTO) else list(args.balance),
        recompute=_recompute_request(args.recompute), memory=args.memory, meshes=meshes,
        fsdp=fsdp, global_batch=given is None, on_mesh=on_mesh,
        tp_traffic=traffic or (), eps=tuple(eps), ep_traffic=_ep_traffic(args, traced, max(eps)))


def _ep_traffic(args: PipelineArguments, traced: Optional[GraphGroups],
                ep: int) -> List[Tuple[float, float, float]]:
    """The experts and exchanges ``args.expert_parallel`` adds per layer of the chain
    (``ep_costs.plan_traffic``): ``[]`` without ep > 1, for a traced model or a callable
    plan (not priced: logged)."""
    if args.expert_parallel is None or ep == 1 or traced is not None:
        return []
    traffic = ep_costs.plan_traffic(args.expert_parallel, args.module, args.sample[0])
    if traffic is None:
        _log.info("expert_parallel: a callable plan's experts and all_to_all cannot be seen; the "
                  "cost model prices the model as dense (give a dict plan)")
    return traffic or []


def _tp_traffic(args: PipelineArguments, traced: Optional[GraphGroups],
                tps: Sequence[int]) -> Optional[List[Tuple[float, float]]]:
    """The collectives ``args.tensor_parallel`` adds per layer of the chain
    (``tp_costs.plan_traffic``): ``[]`` without tp > 1 or for a traced model (not priced),
    ``None`` for a callable plan."""
    if args.tensor_parallel is None or max(tps) == 1 or traced is not None:
        return []
    return tp_costs.plan_traffic(args.tensor_parallel, args.module, args.sample[0])


def _placed(args: PipelineArguments, chosen: Configuration,
            device: torch.device) -> PipelineArguments:
    """``args`` with the chosen placement: ``mesh="auto"`` built as ``chosen.mesh`` (the
    same shape on every rank; with ``tp = 1`` no tensor parallelism), ``data_parallel``
    left ``"auto"`` with ``dp = 1`` as ``"replicate"`` (nothing to hold)."""
    values: Dict[str, Any] = {}
    if args.mesh == AUTO:
        values["mesh"] = auto_mesh.build_mesh(chosen.mesh, device.type,
                                              chosen.ep if args.expert_parallel is not None else 0)
        if chosen.mesh[2] == 1:
            values["tensor_parallel"] = None
    if args.data_parallel == AUTO:
        values["data_parallel"] = "replicate"
    return dataclasses.replace(args, **values)


def _measuring(args: PipelineArguments, group: dist.ProcessGroup, device: torch.device,
               timeout: float, grouped: Optional[GraphGroups] = None) -> choose.Measuring:
    assert args.sample is not None and args.pipeline is not None
    return choose.Measuring(args.module, args.loss_fn, args.sample, group, device,
                            timeout, args.pipeline, args.concrete_args, grouped)


def _recompute_request(recompute: Any) -> Union[str, List[bool]]:
    """The search's ``recompute``: ``"search"`` for ``"auto"``, a bool for every stage, or the list."""
    if isinstance(recompute, str):
        return "search"
    if isinstance(recompute, bool):
        return "always" if recompute else "never"
    return [bool(r) for r in recompute]


def _saved_configuration(balance: Any) -> Optional[Plan]:
    """The plan ``balance`` names (a :class:`Plan` or a file) when it records a whole
    configuration, else ``None``."""
    plan = balance if isinstance(balance, Plan) else Plan.load(balance) \
        if isinstance(balance, (str, os.PathLike)) and str(balance) != AUTO else None
    return plan if plan is not None and plan.configuration is not None else None


def _chosen_values(chosen: Configuration) -> Dict[str, Any]:
    """The options a configuration sets, as ``PipeDream`` takes them."""
    recompute = [bool(r) for r in chosen.recompute]
    values = {"schedule": chosen.schedule, "microbatches": chosen.microbatches,
              "chunks": chosen.chunks, "balance": list(chosen.balance),
              "replicas": list(chosen.replicas) if any(r != 1 for r in chosen.replicas) else None,
              "recompute": recompute[0] if len(set(recompute)) == 1 else recompute}
    if chosen.data_parallel is not None:
        values["data_parallel"] = chosen.data_parallel
    return values


def _check_saved_agrees(args: PipelineArguments, saved: Configuration) -> None:
    """A saved configuration fixes what the user left; what they gave must agree.

    Raises:
        ValueError: naming the first option given with another value than the plan's.
    """
    for name, value in _chosen_values(saved).items():
        if name == "balance" or name not in args.given:
            continue
        mine = getattr(args, name)
        same = mine == value or (name == "recompute" and isinstance(mine, bool) and
                                 all(bool(r) == mine for r in saved.recompute))
        if mine != AUTO and not same:
            raise ValueError(f"{name}={mine!r} differs from the plan's configuration ({name}="
                             f"{value!r}); drop {name} to run the plan's, or re-plan")


def _resolved(args: PipelineArguments, prepared: PreparedModel, chosen: Configuration,
              plan: Plan) -> PipelineArguments:
    """``args`` with the configuration's schedule, microbatches, chunks, balance, replicas
    and recompute; a traced model is cut as ``plan``'s stages list its groups (as with
    ``balance="auto"``)."""
    values = _chosen_values(chosen)
    if prepared.planned is not None:
        values["balance"] = plan
    return dataclasses.replace(args, **values)


def _predict_fixed(args: PipelineArguments, prepared: PreparedModel, config: PipelineConfig,
                   cut: "CutModel", dims: ParallelDims, device: torch.device
                   ) -> Tuple[Optional[Configuration], Optional[Plan]]:
    """The prediction of the configuration the user fixed, when ``sample`` lets the layers
    be measured (an ``nn.Sequential`` on a real device, a flush schedule; collective), and
    the plan recording it; else ``None`` and the plan unchanged. A configuration the
    cost model cannot predict (a sample smaller than the microbatches) is named in a warning."""
    if args.sample is None or args.pipeline is None or cut.traced is not None or \
            prepared.deferred or config.asynchronous:
        return None, cut.plan
    fixed = Configuration(
        schedule=config.schedule, chunks=config.chunks, microbatches=config.microbatches,
        balance=list(cut.partition.balance), replicas=list(cut.partition.replicas),
        recompute=config.recompute_stages(cut.partition.num_stages),
        mesh=(dims.pp_size, dims.dp_size, dims.tp_size), prediction=None, candidates=[],
        data_parallel=dims.data_parallel if dims.dp_enabled else None, ep=dims.ep_size)
    try:
        predicted = choose.predict_fixed(_measuring(args, dims.world_group, device,
                                                    config.timeout), fixed,
                                         args.memory, dims.fsdp_enabled,
                                         _ep_traffic(args, None, dims.ep_size))
    except ValueError as exc:  # the same on every rank: rank 0's error was broadcast
        warnings.warn(f"no prediction of this configuration: {exc}", stacklevel=4)
        return None, cut.plan
    plan = None if cut.plan is None else dataclasses.replace(cut.plan,
                                                             configuration=predicted.to_dict())
    return predicted, plan


def _pipeline_rank(rank: int, partition: Partition) -> int:
    """The index of a prediction's per-rank entries for this rank: its rank in the
    pipeline, or with replicas its stage (the prediction counts a replicated stage once)."""
    if not partition.replicated:
        return rank
    return next(j for j, end in enumerate(itertools.accumulate(partition.replicas)) if rank < end)


# -- the partition, the same on every rank --------------------------------------------------
@dataclasses.dataclass
class CutModel:
    """How the model is cut into stages (the same on every rank once agreed).

    Attributes:
        partition: layers and replicas per stage (a traced model: one "layer" per stage).
        num_layers: layers of the model (a traced model: its stages).
        traced: a traced model's stages, else ``None``.
        plan: the plan the stages come from, else ``None``.
        shared_parameters: parameters used by layers of several stages.
    """

    partition: Partition
    num_layers: int
    traced: Optional[TracedSplit]
    plan: Optional[Plan]
    shared_parameters: List[SharedParameter]


def cut_model(args: PipelineArguments, prepared: PreparedModel, config: PipelineConfig,
              dims: ParallelDims) -> CutModel:
    """Resolves the partition: layer counts, split points or a plan (collective when
    ``balance="auto"``: rank 0 profiles and plans, every rank gets the plan), over the
    pipeline's group (``dims.pp_group``).

    Raises:
        ValueError: counts, split points or a plan that do not fit the model or the world.
    """
    traced, plan = prepared.traced, None
    if prepared.planned is not None:  # a traced model cut as a plan of its graph profile says
        plan = _load_plan(args, config, dims, prepared.planned.profile_fn(args.loss_fn))
        traced = prepared.planned.split(plan)
    world = dims.pp_size
    if traced is not None:
        partition = _traced_partition(traced, plan, world, args.replicas, config.chunks)
        num_layers = partition.num_stages
        shared = find_shared_in_stages(args.module, traced.stages)
    else:
        balance, replicas = args.balance, args.replicas
        if _is_plan(balance):
            plan = _load_plan(args, config, dims)
            balance, replicas = partition_from_plan(plan, len(args.module), world, **dims.planner_sizes())
        partition = resolve_partition(len(args.module), world, config.chunks, balance, replicas)
        num_layers = len(args.module)
        shared = find_shared(args.module, partition)
    return CutModel(partition, num_layers, traced, plan, shared)


def _traced_partition(traced: TracedSplit, plan: Optional[Plan], world: int,
                      replicas: Optional[Sequence[int]], chunks: int) -> Partition:
    """One "layer" per traced stage; the split points (or the plan) fix the stage count."""
    stages = len(traced.stages)
    if plan is not None:
        return resolve_partition(stages, world, 1, [1] * stages, check_plan_world(plan, world))
    needed = len(replicas) if replicas is not None else world * chunks
    if stages != needed:
        raise ValueError(
            f"split_points {traced.split_points} make {stages} stages but "
            + (f"replicas {list(replicas)} list {needed}" if replicas is not None else
               f"the world has {world} ranks x {chunks} chunks = {needed} stages")
            + f"; give {needed - 1} split points")
    return resolve_partition(stages, world, chunks, [1] * stages, replicas)


def _load_plan(args: PipelineArguments, config: PipelineConfig, dims: ParallelDims,
               profile_fn: Optional[Callable[[], Any]] = None) -> Plan:
    """The plan ``balance`` names: given, read from a file, or made at start-up
    (``"auto"``: rank 0 profiles, with ``profile_fn`` for a traced model, and plans; with
    a mesh, for its pp dimension with ``dp`` ranks per stage and ``tp`` in each, every
    rank of the mesh agreeing on one plan)."""
    if config.chunks != 1 or args.replicas is not None:
        raise ValueError("a plan sets balance and replicas itself; drop chunks/replicas")
    balance = args.balance
    if isinstance(balance, Plan):
        plan = balance
    elif str(balance) == "auto":
        sequence = {"sequence_parallel": sequence_parallel(dims.tensor_parallel)} \
            if dims.tp_enabled else {}
        plan = auto_plan(args.module, args.loss_fn, args.sample, args.bandwidth, config.traits,
                         dims.world_group, profile_fn, **dims.planner_sizes(), **sequence)
    else:
        assert isinstance(balance, (str, os.PathLike))
        plan = Plan.load(balance)
    if dist.get_rank(dims.pp_group) == 0:
        _log.info("pipeline plan (%s cost model, predicted %.2fx over data parallelism):"
                  "\n%s", plan.cost_model, plan.speedup_over_dp, plan.table())
    return plan


def _refuse_shared_if_asynchronous(config: PipelineConfig,
                                   shared: Sequence[SharedParameter]) -> None:
    """Shared parameters need one update of all their copies per step.

    Raises:
        ValueError: an asynchronous schedule and a parameter shared by stages.
    """
    if not config.asynchronous or not shared:
        return
    raise ValueError(
        f"parameter {describe(shared[0])} is shared by layers on different stages, but schedule "
        f"{config.schedule!r} updates each stage's weights inside the pipeline at "
        "different times, so its copies would drift apart; shared parameters need a flush "
        f"schedule ({', '.join(schedules.synchronous_names())}), or put every layer using it "
        "on one stage with balance=...")


def _tied_units(module: nn.Module, cut: CutModel, stage_ranks: Sequence[Sequence[int]]
                ) -> List[Tuple[List[str], List[Tuple[str, int]]]]:
    """Every tied parameter's names and the ``(unit, pp rank)`` of each use, for
    ``refuse_split_ties``: an ``nn.Sequential``'s units are its top-level layers (a
    tie inside one stage counts too), a traced model's its stages."""
    if cut.traced is not None:
        return [(list(dict.fromkeys(sp.names)),
                 [(f"stage {j}", stage_ranks[j][0]) for j in sp.name_stages])
                for sp in cut.shared_parameters]
    stage_of = [j for j, count in enumerate(cut.partition.balance) for _ in range(count)]
    layer_index = {name: l for l, (name, _) in enumerate(module.named_children())}
    names: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = []
    for uses in (u for u in names.values() if len(u) > 1):
        layers = [n.split(".", 1)[0] for n in uses]
        tied.append((uses, [(f"layer {n}", stage_ranks[stage_of[layer_index[n]]][0])
                            for n in layers]))
    return tied


def _agree_everywhere(args: PipelineArguments, cut: CutModel, init_seed: Optional[int],
                      dims: ParallelDims) -> Optional[TracedSplit]:
    """Fails on every rank if ranks disagree on the arguments or on what any stage
    computes (``agree_at_construction``).

    Args:
        init_seed: the seed of a meta model (replicas would get different weights), else
            ``None``.
        dims: the run's dims: on a mesh its shape and data-parallel settings are agreed
            too, over every rank of the mesh (one exchange), so that what one pipeline's
            ranks refuse reaches the other pipelines' ranks too.

    Returns:
        The traced stages, with the values crossing each cut in rank 0's order when
        ranks listed them in another; ``None`` for an ``nn.Sequential``.

    Raises:
        ValueError: naming the argument, or the first operation (module) that differs.
    """
    traced, partition = cut.traced, cut.partition
    agreed: Dict[str, Any] = {
        **agreed_values(args),  # each option's Option.agreed
        "balance": list(partition.balance), "layers": cut.num_layers,
        "replicas": list(partition.replicas),
        # Shared parameters too: ranks that disagree would create different groups.
        "shared parameters": [list(sp.names) for sp in cut.shared_parameters],
        "split_points": None if traced is None else list(traced.split_points),
        "tracer": None if traced is None else traced.tracer,
        "input names": None if traced is None else traced.input_names}
    if init_seed is not None:
        agreed["init_seed"] = init_seed
    agreed.update(dims.describe())
    if traced is not None:
        assert traced.fingerprint is not None
        fingerprint = traced.fingerprint
    else:
        fingerprint = layers_fingerprint(args.module, partition.bounds())
    # The pipelines of a mesh are one pipeline's copies: one exchange, every rank.
    orders = agree_at_construction(dims.world_group, agreed, fingerprint, dims.names)
    if orders is not None and traced is not None:
        return reorder_cuts(traced, orders)
    return traced


# -- this rank's part ---------------------------------------------------------------------
def _build_schedule(config: PipelineConfig, partition: Partition
                    ) -> Tuple[Optional["_C.AsyncActionFeed"], "schedules.Schedule"]:
    """The schedule (and, for an asynchronous one, the action feed serving its steps)."""
    if config.traits.streaming:
        # Steps are served one at a time in constant memory (csrc/core/action_feed.h).
        feed = _C.AsyncActionFeed(config.schedule, stages=partition.num_stages,
                                  microbatches=config.microbatches_per_step,
                                  replicas=partition.replicas, vertical_sync=config.vertical_sync)
        return feed, schedules.Schedule(_C.strip_communication(feed.base), feed.base)
    return None, schedules.build(
        config.schedule, stages=partition.num_stages // config.chunks,
        microbatches=config.microbatches, chunks=config.chunks,
        replicas=partition.replicas if partition.replicated else None)


def _local_stages(args: PipelineArguments, prepared: PreparedModel, cut: CutModel,
                  indices: Sequence[int], device: torch.device, timeout: float,
                  dims: ParallelDims, data_parallel: DataParallel) -> LocalStages:
    """This rank's layers, parallelized (``parallelize_stages``: tensor parallelism, then
    sharded or replicated over a mesh's ``dp``); with meta layers, every rank raises if
    any rank's initialisation failed (it runs user code), so no rank waits on a dead peer."""
    def build() -> LocalStages:
        built = LocalStages(args.module, cut.partition, indices, device, prepared.init_seed,
                            args.init_fn,
                            traced=cut.traced.stages if cut.traced is not None else None,
                            after_layer=data_parallel.after_layer,
                            # with tp the plan shards meta layers before they are materialised
                            defer_meta=prepared.deferred and dims.tp_enabled)
        if cut.traced is not None and cut.traced.tracer == "export":
            # Tensors the graph creates: on this rank's device. Before FSDP wraps the
            # stages: recompiling a GraphModule whose class fully_shard replaced recurses.
            for j in built:
                export.retarget_devices(built[j], device)
        parallelize_stages(built, dims, data_parallel)
        return built

    if not prepared.deferred:
        return build()
    stages: Optional[LocalStages] = None
    error: Optional[BaseException] = None
    try:
        stages = build()
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    # Over a mesh every pipeline raises (the dp peers of a failed rank share its layers).
    collectives.raise_if_any_failed(error, dims.world_group, timeout,
                                    "initialising the meta-device layers", dims.world_names)
    assert stages is not None
    return stages


def _broadcast_replicas(stages: LocalStages, groups: PipelineGroups) -> None:
    """Every replica of a stage starts from its leader's weights and buffers, as DDP
    broadcasts rank 0's at construction: models built from other seeds would otherwise
    train different weights under one stage. One broadcast per tensor, once."""
    for j in stages:
        group = groups.replica_groups.get(j)
        if group is None:
            continue
        module = stages[j]
        tensors = [t for _, t in module.named_parameters()] + \
            [t for _, t in module.named_buffers()]
        with torch.no_grad():
            for t in tensors:
                collectives.broadcast_data(t.detach(), 0, group)


def _observer(trace: Optional[Union[str, os.PathLike]], groups: PipelineGroups,
              stages: LocalStages, config: PipelineConfig, device: torch.device,
              dims: ParallelDims) -> Observer:
    """Stats and, with ``trace`` or ``PIPEDREAM_TRACE``, the Chrome trace: over a mesh one
    trace of every rank (each pipeline's group alone would have each pipeline's rank 0
    write its own trace to the same path)."""
    if trace is None:
        trace = os.environ.get("PIPEDREAM_TRACE") or None
    path = os.fspath(trace) if trace is not None else None
    if not dims.on_mesh:  # the pipeline's own numbers
        return Observer(groups.rank, stages.indices, groups.group, config.schedule, path, device)
    rank = dist.get_rank()
    return Observer(rank, stages.indices, dims.world_group, config.schedule, path, device,
                    rank_name=dims.names.of_global(rank))


def _stage_function(loss_fn: Callable[..., torch.Tensor], traced: Optional[TracedSplit],
                    stages: LocalStages, schedule: "schedules.Schedule",
                    groups: PipelineGroups, config: PipelineConfig,
                    device: torch.device, recompute: bool, rank_name: Optional[str] = None,
                    cuts: Optional[CutLayouts] = None, copies: int = 1) -> StageFunction:
    """The executor's forward callback over this rank's stages (``recompute``: whether
    this rank's stages recompute, ``PipelineConfig.rank_recomputes``; ``rank_name``: how
    its messages name the rank; default ``"rank {rank}"``; ``cuts``: with tensor
    parallelism, what crosses a cut; ``copies``: the pipeline's data-parallel copies)."""
    # An exported model's last stage returns its output's tensors flat; loss_fn gets
    # the model's own structure (a ModelOutput) back.
    spec = traced.output_spec if traced is not None else None
    stage_loss = loss_fn if spec is None else model_io.RestoredLoss(loss_fn, spec)
    return StageFunction(stages, stage_loss, schedule.num_stages, device,
                         config.check_finite, raise_at_once=config.asynchronous,
                         rank=groups.rank, recompute=recompute,
                         loss_reduction=config.loss_reduction, rank_name=rank_name, cuts=cuts,
                         aux_weight=_aux_weight(config, copies))


def _aux_weight(config: PipelineConfig, copies: int) -> float:
    """What one microbatch's aux losses weigh (``_runtime.aux_loss``): as its share of a
    mean (``1 / microbatches``; the copies' gradients are then averaged), of a token mean
    (the copies' gradients add: ``1 / (microbatches x copies)``), or 1 for a sum."""
    reduction = config.loss_reduction
    if not reduction.averages_over_dp and not reduction.counts_tokens:
        return 1.0
    return 1.0 / (config.microbatches * (copies if reduction.counts_tokens else 1))
