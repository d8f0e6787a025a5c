"""The user-facing pipeline: ``PipeDream(module, loss_fn, schedule, ...)``.

A facade: it checks the arguments (``_config``), resolves the partition
(``_stages``, ``_startup_plan``), creates the process groups (``_groups``),
keeps this rank's stages (``_stages.LocalStages``) and hands the schedule's
family to its runner (``_runners``), which drives the C++ executor with the
stage function (``_stage_fn``) and reports through ``_observe``. The data flow
of one step: docs/architecture.md.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import os
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist
from torch import nn

from . import _C, schedules
from ._checkpoint import reshard
from ._dist import collectives, faults, signals
from ._dist.agreement import StepAgreement, agree_at_construction
from ._dist.fingerprint import layers_fingerprint
from ._dist.groups import PipelineGroups, init_default_group
from ._frontend import deferred_init, export, model_io
from ._frontend.graph_split import TracedSplit, reorder_cuts, split_model
from ._frontend.tied_params import (
    SharedGradients,
    describe,
    find_shared,
    find_shared_in_stages,
)
from ._planning.startup import auto_plan, check_plan_world, partition_from_plan
from ._runtime.config import PipelineConfig
from ._runtime.local_stages import LocalStages, even_balance, resolve_partition
from ._runtime.observe import Observer
from ._runtime.runners import make_runner
from ._runtime.stage_call import NonFiniteError, StageFunction, Tensors
from ._runtime.step_loss import StepLoss
from .planner import Plan

__all__ = ["PipeDream", "NonFiniteError", "SYNCHRONOUS_SCHEDULES", "ASYNCHRONOUS_SCHEDULES",
           "even_balance"]

_log = logging.getLogger(__name__)

#: Flush schedules (gradients equal the unsplit model's; you step the optimizer).
SYNCHRONOUS_SCHEDULES = tuple(schedules.synchronous_names())
#: Asynchronous schedules (weight stashing; the runtime steps your optimizer).
ASYNCHRONOUS_SCHEDULES = tuple(schedules.asynchronous_names())


class PipeDream:
    """Pipeline-parallel training of a model over the ranks of a process group.

    An ``nn.Sequential`` is cut between its children (``balance``); any other
    ``nn.Module`` is traced with torch.fx (or, where fx cannot, ``torch.export``) on
    ``sample`` and cut where the modules named by ``split_points`` start
    (docs/tracing.md)::

        pipe = PipeDream(resnet, F.cross_entropy, split_points=["layer3"], sample=(x, y))
        pipe = PipeDream(gpt2, loss_fn, split_points=["transformer.h.6"],
                         sample=({"input_ids": x, "attention_mask": m}, y),
                         concrete_args={"use_cache": False})

    Example (under ``torchrun --nproc-per-node 4``)::

        pipe = PipeDream(model, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in loader:
            loss = pipe.step(x, y)
            opt.step(); opt.zero_grad()

    Big models: build the model on the meta device and every rank allocates and
    initialises only its own layers (deferred initialisation, ``_materialize``)::

        with torch.device("meta"):
            model = make_model()
        pipe = PipeDream(model, loss_fn=F.cross_entropy)   # reset_parameters(), seeded per layer
        pipe.load_state_dict(torch.load("model.pt", mmap=True))   # optional: pretrained weights

    Args:
        module: the whole model, identically initialised on every rank, or built
            on the meta device (then see ``init_seed`` and ``init_fn``): an
            ``nn.Sequential``, or any ``nn.Module`` with ``split_points`` or with
            ``balance="auto"`` / a plan (traced, cut as the plan's stages say).
        loss_fn: ``loss_fn(output, target)``, a scalar tensor: the mean over the batch
            (or the sum, with ``loss_reduction="sum"``; checked once, on the first
            microbatch).
        schedule: one of :data:`SYNCHRONOUS_SCHEDULES` or :data:`ASYNCHRONOUS_SCHEDULES`
            (what each means: ``schedules.traits(name)``).
            With ``pipedream`` every ``step`` is one minibatch and one weight update
            per stage (weight stashing); with ``pipedream-2bw`` one batch of
            ``microbatches`` and one update (at most 2 weight versions). Both take
            the optimizer in ``step(x, y, optimizer=opt)`` and need ``flush()``.
        microbatches: microbatches per ``step`` (the batch is split on dim 0).
        balance: layers per stage (``None``: an even split); ``"auto"`` to profile
            the model on rank 0 with ``sample`` and plan stages and replicas for this
            world with the planner; or a saved plan (a ``plan.json`` path or a
            :class:`~pipedream_ext.Plan`). Stages are ordered as in the module; stage
            ``j`` runs on rank ``j``, or on consecutive ranks when replicated; with
            several chunks per rank the schedule's layout places them: ``j mod world``
            (``interleaved-1f1b``, ``interleaved-zb``) or a V (``zbv``, ``dualpipev``:
            rank ``r`` holds stages ``r`` and ``2 * world - 1 - r``). For a model that
            is not an ``nn.Sequential`` (no ``split_points``), ``"auto"`` traces it,
            profiles its graph on rank 0 (groups of operations, real edges) and plans;
            a plan must come from that model's graph profile (docs/tracing.md).
        chunks: model chunks per rank (``interleaved-1f1b``, ``interleaved-zb``;
            exactly 2 for ``zbv`` and ``dualpipev``).
        process_group: the group to run on (default: the default group, which is
            created from the torchrun environment if needed: Gloo on CPU, NCCL on GPU).
        device: where this rank's layers live (default: ``cuda:LOCAL_RANK`` if CUDA
            is available, else CPU).
        timeout: seconds any wait on another rank may take before failing.
        vertical_sync: ``pipedream`` only: every stage uses, for a minibatch, the
            weight version stage 0 used.
        replicas: replica count per stage, e.g. ``[2, 1, 1]`` on 4 ranks (hybrid
            pipeline and data parallelism; gpipe, 1f1b, pipedream, pipedream-2bw).
            Stage j runs on ``replicas[j]`` consecutive ranks; microbatch i runs on
            replica ``i mod replicas[j]``; replicas all-reduce gradients before each
            update (summed for flush schedules and 2bw, where they are parts of one
            batch; averaged for ``pipedream``, where each replica ran its own minibatch).
        sample: ``(inputs, targets)`` of one batch, for ``balance="auto"`` and for
            tracing a model that is not an ``nn.Sequential``.
        bandwidth: bytes/s per topology level (within a node, then between
            nodes) for ``balance="auto"``; measured with a short probe if omitted.
        recompute: keep only each stage's inputs during the forward and recompute
            its activations in the backward (same result, with the CPU and CUDA RNG
            states restored so dropout draws the same masks).
        trace: record every action each rank runs (F/B/I/W, waits on receives,
            sends, updates, all-reduces) and write them, merged by rank 0, as one
            Chrome trace at this path (open it in Perfetto) when :meth:`write_trace`
            or :meth:`close` is called. Default: the ``PIPEDREAM_TRACE``
            environment variable, if set.
        autocast: run every stage's forward (and the loss) under
            ``torch.autocast(device_type, dtype=autocast)``, e.g. ``torch.bfloat16``;
            boundary tensors then travel in that dtype (half the bytes). With
            ``torch.float16`` on a flush schedule, scale the loss with
            :meth:`grad_scaler` (all ranks skip an overflowing step together).
        check_finite: ``"raise"`` or ``"skip"``: after every step, find the first
            stage whose forward output (or, in the backward, the last stage whose
            gradients) holds NaN or inf and report it with the step number;
            ``"raise"`` raises :class:`NonFiniteError` on every rank, ``"skip"``
            (flush schedules) logs a warning, sets this step's gradients to ``None``
            so ``optimizer.step()`` leaves the weights alone, and returns ``nan``.
            Costs one ``isfinite`` per stage output and one small all-reduce per
            step. Asynchronous schedules support ``"raise"`` only (the rank that
            finds it raises; the others fail naming it).
        init_seed: base seed of deferred initialisation (default 0), an integer in
            ``[0, 2**16)``: top-level layer ``l`` built on the meta device is
            initialised under a forked RNG seeded with ``init_seed * 2**16 + l``,
            so it gets the same weights on any partition or world size; your
            global RNG state is left as it was. ``pd.materialize(model, seed=...)``
            gives the same weights to a whole model in one process.
        init_fn: ``init_fn(layer)`` initialises one top-level layer built on the
            meta device in place (called once per layer this rank keeps, after its
            storage is allocated, under the seeded RNG and ``no_grad``), instead of
            each module's ``reset_parameters()``. Needed for modules with meta
            tensors and no ``reset_parameters()``, and for buffers computed in
            ``__init__`` (a causal mask) that ``reset_parameters()`` does not set.

        split_points: for a model that is not an ``nn.Sequential``: qualified module
            names (``["layer3", "decoder.up1"]``); the model is traced with torch.fx on
            ``sample`` (``torch.export``, non-strict with dynamic shapes, where fx
            cannot) and stage ``j + 1`` starts at the first operation running in
            ``split_points[j]``. Tensors live across a cut (inputs, skip connections)
            travel as a tuple; names stay the original model's. One fewer than the
            stages (ranks x chunks, or ``len(replicas)``). See docs/tracing.md.
        concrete_args: for a traced model: non-tensor ``forward`` arguments fixed
            for tracing, e.g. ``{"use_cache": False}``; tensor inputs go in ``sample``
            and in every ``step``: a tuple (positionally) or a dict of named tensors
            (keyword arguments; every other argument then takes its default).
        loss_reduction: ``"mean"`` (default): ``loss_fn`` averages over the batch and
            each microbatch's loss is scaled by its share of the batch; ``"sum"``: it
            adds, and microbatch losses are added unscaled. Either way the gradients
            are the unsplit model's. A ``loss_fn`` that reduces otherwise than said is
            refused at the first step, on every rank.
        check_agreement: the first ``check_agreement`` calls of ``step()`` and of
            ``forward_only()`` start with one small exchange in which every rank says
            which call it is in and fingerprints the batch it was given: ranks in
            different calls, or a first and a last stage given different batches (a
            ``DistributedSampler`` kept from a DDP script) fail on every rank before
            anything is sent. ``0`` turns it off; later calls cost nothing.

    Every rank compares, at construction, the arguments above and a fingerprint of
    every stage (its graph or layers; docs/tracing.md#one-graph-on-every-rank), and
    replicas of a stage start from their leader's weights (broadcast, as DDP does).

    Raises:
        ValueError: bad schedule, balance, chunks or world size; a model that cannot
            be traced or bad split points (naming the module or operation); a meta module that
            cannot be initialised (no ``reset_parameters()`` and no ``init_fn``), or
            a tensor left unset (the message names the value and the fix); ranks that
            disagree on an argument or built a different stage (naming it, every rank).
        RuntimeError: no process group and no torchrun environment.
    """

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor],
                 schedule: str = "1f1b", microbatches: int = 4,
                 balance: Optional[Union[Sequence[int], str, os.PathLike, Plan]] = None,
                 chunks: int = 1, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[str, torch.device]] = None,
                 timeout: float = 300.0, vertical_sync: bool = False,
                 recompute: bool = False, replicas: Optional[Sequence[int]] = None,
                 sample: Optional[Tuple[Tensors, Any]] = None,
                 bandwidth: Optional[Sequence[float]] = None,
                 trace: Optional[Union[str, os.PathLike]] = None,
                 autocast: Optional[torch.dtype] = None,
                 check_finite: Optional[str] = None,
                 init_seed: int = deferred_init.DEFAULT_INIT_SEED,
                 init_fn: Optional[deferred_init.InitFn] = None,
                 split_points: Optional[Sequence[str]] = None,
                 concrete_args: Optional[Mapping[str, Any]] = None,
                 loss_reduction: str = "mean", check_agreement: int = 3) -> None:
        #: The traced model's stages (``split_points`` or a plan), else None (an nn.Sequential).
        self.traced: Optional[TracedSplit]
        self.traced, planned, deferred, init_seed = _prepare_model(
            module, split_points, sample, balance, concrete_args, init_seed, init_fn)
        #: Every state_dict key of the whole model and its shape (for load_state_dict).
        self._model_shapes = reshard.key_shapes(module)
        self.config = PipelineConfig.checked(schedule, microbatches, chunks, timeout,
                                             vertical_sync, recompute, autocast, check_finite,
                                             loss_reduction, check_agreement)
        self.device = _default_device() if device is None else torch.device(device)
        if self.device.type == "cuda":  # NCCL and metadata on NCCL-only groups use it
            torch.cuda.set_device(self.device)
        init_default_group(self.device, datetime.timedelta(seconds=timeout))
        signals.install()  # SIGTERM / Ctrl-C: clean exit on every rank, with a deadline
        group = process_group if process_group is not None else dist.group.WORLD
        self.loss_fn = loss_fn
        #: The plan the stages come from (balance="auto" or a saved plan), else None.
        self.plan: Optional[Plan] = None
        if planned is not None:  # a traced model cut as a plan of its graph profile says
            self.plan = self._load_plan(module, group, balance, replicas, sample, bandwidth,
                                        planned.profile_fn(loss_fn))
            self.traced = planned.split(self.plan)
        if self.traced is not None:
            partition = self._traced_partition(group, replicas)
            num_layers = partition.num_stages
        else:
            partition = self._partition(module, group, balance, replicas, sample, bandwidth)
            num_layers = len(module)
        #: Parameters used by layers of several stages (tied weights), each kept by
        #: every stage that uses it; see _shared.
        self.shared_parameters = (find_shared(module, partition) if self.traced is None
                                  else find_shared_in_stages(module, self.traced.stages))
        self._refuse_shared_if_asynchronous()
        self._agree_everywhere(module, group, num_layers, partition,
                               init_seed if deferred else None)
        self._action_feed, self._schedule = self._build_schedule(partition)
        stage_ranks = [self._schedule.stage_ranks(j) for j in range(self._schedule.num_stages)]
        self._groups = PipelineGroups.create(group, stage_ranks, self.config.timeout)
        self._stages = self._local_stages(module, partition, deferred, init_seed, init_fn)
        self._broadcast_replicas()
        if self.traced is not None and self.traced.tracer == "export":
            for j in self._stages:  # tensors the graph creates: on this rank's device
                export.retarget_devices(self._stages[j], self.device)
        shared_gradients = SharedGradients(self.shared_parameters, self._stages, stage_ranks,
                                           self._groups.group, self.config.timeout)
        # Every copy starts as the first use's stage has it (meta layers are
        # initialised per rank, each from its own layer's seed).
        shared_gradients.synchronize_values()
        if trace is None:
            trace = os.environ.get("PIPEDREAM_TRACE") or None
        self._observer = Observer(self.rank, self.local_stages, self.group, schedule,
                                  os.fspath(trace) if trace is not None else None, self.device)
        # An exported model's last stage returns its output's tensors flat; loss_fn gets
        # the model's own structure (a ModelOutput) back.
        spec = self.traced.output_spec if self.traced is not None else None
        stage_loss = loss_fn if spec is None else model_io.RestoredLoss(loss_fn, spec)
        self._stage_fn = StageFunction(self._stages, stage_loss, self.num_stages, self.device,
                                       self.config.autocast, self.config.check_finite,
                                       raise_at_once=self.asynchronous, rank=self.rank,
                                       recompute=self.config.recompute,
                                       loss_reduction=self.config.loss_reduction)
        self._runner = make_runner(self.config, self._schedule, self._action_feed, self._stages,
                                   self._groups, self._stage_fn, self._observer, self.device,
                                   shared_gradients=shared_gradients)
        if self.traced is not None and self.traced.input_names is not None:
            self._runner.input_names = list(self.traced.input_names)
        self._agreement = StepAgreement(self.group, stage_ranks[0], stage_ranks[-1],
                                        self.config.check_agreement)
        _log.info("rank %d: stages %s (layers %s) of %d, schedule %s, %d microbatches",
                  self.rank, self.local_stages, [self.stage_layers[j] for j in self.local_stages],
                  self.num_stages, schedule, microbatches)

    # -- construction ---------------------------------------------------------------
    def _traced_partition(self, group: dist.ProcessGroup,
                          replicas: Optional[Sequence[int]]) -> Any:
        """One "layer" per traced stage; the split points (or the plan) fix the stage count."""
        assert self.traced is not None
        world = dist.get_world_size(group)
        stages = len(self.traced.stages)
        if self.plan is not None:
            return resolve_partition(stages, world, 1, [1] * stages,
                                     check_plan_world(self.plan, world))
        needed = len(replicas) if replicas is not None else world * self.config.chunks
        if stages != needed:
            raise ValueError(
                f"split_points {self.traced.split_points} make {stages} stages but "
                + (f"replicas {list(replicas)} list {needed}" if replicas is not None else
                   f"the world has {world} ranks x {self.config.chunks} chunks = {needed} stages")
                + f"; give {needed - 1} split points")
        return resolve_partition(stages, world, self.config.chunks, [1] * stages, replicas)

    def _partition(self, module: nn.Sequential, group: dist.ProcessGroup, balance: Any,
                   replicas: Optional[Sequence[int]], sample: Optional[Tuple[Tensors, Any]],
                   bandwidth: Optional[Sequence[float]]) -> Any:
        """Layers and replicas per stage, from ``balance`` (counts, a plan, or "auto")."""
        world = dist.get_world_size(group)
        if _is_plan(balance):
            self.plan = self._load_plan(module, group, balance, replicas, sample, bandwidth)
            balance, replicas = partition_from_plan(self.plan, len(module), world)
        return resolve_partition(len(module), world, self.config.chunks, balance, replicas)

    def _load_plan(self, module: nn.Module, group: dist.ProcessGroup, balance: Any,
                   replicas: Optional[Sequence[int]], sample: Optional[Tuple[Tensors, Any]],
                   bandwidth: Optional[Sequence[float]],
                   profile_fn: Optional[Callable[[], Any]] = None) -> Plan:
        """The plan ``balance`` names: given, read from a file, or made at start-up
        (``"auto"``: rank 0 profiles, with ``profile_fn`` for a traced model, and plans)."""
        if self.config.chunks != 1 or replicas is not None:
            raise ValueError("a plan sets balance and replicas itself; drop chunks/replicas")
        if isinstance(balance, Plan):
            plan = balance
        elif str(balance) == "auto":
            plan = auto_plan(module, self.loss_fn, sample, bandwidth, self.config.traits, group,
                             profile_fn)
        else:
            plan = Plan.load(balance)
        if dist.get_rank(group) == 0:
            _log.info("pipeline plan (%s cost model, predicted %.2fx over data parallelism):"
                      "\n%s", plan.cost_model, plan.speedup_over_dp, plan.table())
        return plan

    def _refuse_shared_if_asynchronous(self) -> None:
        """Shared parameters need one update of all their copies per step.

        Raises:
            ValueError: an asynchronous schedule and a parameter shared by stages.
        """
        if not self.asynchronous or not self.shared_parameters:
            return
        sp = self.shared_parameters[0]
        raise ValueError(
            f"parameter {describe(sp)} is shared by layers on different stages, but schedule "
            f"{self.config.schedule!r} updates each stage's weights inside the pipeline at "
            "different times, so its copies would drift apart; shared parameters need a flush "
            f"schedule ({', '.join(SYNCHRONOUS_SCHEDULES)}), or put every layer using it on "
            "one stage with balance=...")

    def _local_stages(self, module: nn.Sequential, partition: Any, deferred: bool,
                      init_seed: int, init_fn: Optional[deferred_init.InitFn]) -> LocalStages:
        """This rank's layers; with meta layers, every rank raises if any rank's
        initialisation failed (it runs user code), so no rank waits on a dead peer."""
        def build() -> LocalStages:
            return LocalStages(module, partition, self._schedule.stages_of_rank(self.rank),
                               self.device, init_seed, init_fn,
                               traced=self.traced.stages if self.traced is not None else None)

        if not deferred:
            return build()
        stages: Optional[LocalStages] = None
        error: Optional[BaseException] = None
        try:
            stages = build()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        collectives.raise_if_any_failed(error, self.group, self.timeout,
                                         "initialising the meta-device layers")
        assert stages is not None
        return stages

    def _broadcast_replicas(self) -> None:
        """Every replica of a stage starts from its leader's weights and buffers, as DDP
        broadcasts rank 0's at construction: models built from other seeds would otherwise
        train different weights under one stage. One broadcast per tensor, once."""
        for j in self._stages:
            group = self._groups.replica_groups.get(j)
            if group is None:
                continue
            module = self._stages[j]
            tensors = [t for _, t in module.named_parameters()] + \
                [t for _, t in module.named_buffers()]
            with torch.no_grad():
                for t in tensors:
                    collectives.broadcast_data(t.detach(), 0, group)

    def _agree_everywhere(self, module: nn.Module, group: dist.ProcessGroup, num_layers: int,
                          partition: Any, init_seed: Optional[int] = None) -> None:
        """Fails on every rank if ranks disagree on the arguments or on what any stage
        computes (``_agree``); a traced model whose ranks list the values crossing a cut in
        another order takes rank 0's order.

        Raises:
            ValueError: naming the argument, or the first operation (module) that differs.
        """
        c = self.config
        config: Dict[str, Any] = {
            "schedule": c.schedule, "microbatches": c.microbatches, "chunks": c.chunks,
            "balance": list(partition.balance), "layers": num_layers,
            "replicas": list(partition.replicas),
            # Shared parameters too: ranks that disagree would create different groups.
            "shared parameters": [list(sp.names) for sp in self.shared_parameters],
            "split_points": self.split_points, "vertical_sync": c.vertical_sync,
            "recompute": c.recompute, "autocast": str(c.autocast),
            "check_finite": c.check_finite, "loss_reduction": c.loss_reduction,
            "check_agreement": c.check_agreement,
            "tracer": None if self.traced is None else self.traced.tracer,
            "input names": None if self.traced is None else self.traced.input_names}
        if init_seed is not None:  # a meta model: replicas would get different weights
            config["init_seed"] = init_seed
        if self.traced is not None:
            assert self.traced.fingerprint is not None
            fingerprint = self.traced.fingerprint
        else:
            fingerprint = layers_fingerprint(module, partition.bounds())
        orders = agree_at_construction(group, config, fingerprint)
        if orders is not None and self.traced is not None:
            self.traced = reorder_cuts(self.traced, orders)

    def _build_schedule(self, partition: Any) -> Tuple[Optional["_C.AsyncActionFeed"],
                                                       "schedules.Schedule"]:
        c = self.config
        if c.traits.streaming:
            # Steps are served one at a time in constant memory (csrc/core/action_feed.h).
            feed = _C.AsyncActionFeed(c.schedule, stages=partition.num_stages,
                                      microbatches=c.microbatches_per_step,
                                      replicas=partition.replicas, vertical_sync=c.vertical_sync)
            return feed, schedules.Schedule(_C.strip_communication(feed.base), feed.base)
        return None, schedules.build(
            c.schedule, stages=partition.num_stages // c.chunks,
            microbatches=c.microbatches, chunks=c.chunks,
            replicas=partition.replicas if partition.replicated else None)

    # -- what the pipeline is ----------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        return self._groups.group

    @property
    def rank(self) -> int:
        return self._groups.rank

    @property
    def world_size(self) -> int:
        return self._groups.world_size

    @property
    def schedule_name(self) -> str:
        return self.config.schedule

    @property
    def asynchronous(self) -> bool:
        return self.config.asynchronous

    @property
    def microbatches(self) -> int:
        return self.config.microbatches

    @property
    def chunks(self) -> int:
        return self.config.chunks

    @property
    def timeout(self) -> float:
        return self.config.timeout

    @property
    def vertical_sync(self) -> bool:
        return self.config.vertical_sync

    @property
    def recompute(self) -> bool:
        return self.config.recompute

    @property
    def autocast(self) -> Optional[torch.dtype]:
        """Compute dtype of autocast (None: full precision); may be changed between
        steps, e.g. to evaluate in full precision (boundary headers carry the dtype)."""
        return self._stage_fn.autocast

    @autocast.setter
    def autocast(self, dtype: Optional[torch.dtype]) -> None:
        self._stage_fn.autocast = dtype

    @property
    def check_finite(self) -> Optional[str]:
        return self.config.check_finite

    @property
    def balance(self) -> List[int]:
        return self._stages.partition.balance

    @property
    def replicas(self) -> List[int]:
        return self._stages.partition.replicas

    @property
    def num_stages(self) -> int:
        return self._schedule.num_stages

    @property
    def split_points(self) -> Optional[List[str]]:
        """The module names a traced model's stages start at (None: an nn.Sequential); for
        a plan's stages, the module each later stage's first operation runs in."""
        return None if self.traced is None else list(self.traced.split_points)

    @property
    def local_stages(self) -> List[int]:
        return self._stages.indices

    @property
    def stage_index(self) -> int:
        return self._stages.indices[0]

    @property
    def stage_layers(self) -> Dict[int, Tuple[int, int]]:
        return self._stages.layers

    @property
    def module(self) -> nn.Module:
        """This rank's layers as one module, named as in the original model."""
        return self._stages.module

    @property
    def schedule(self) -> "schedules.Schedule":
        """The schedule this pipeline runs (for asynchronous ones: one period of it)."""
        return self._schedule

    @property
    def trace_path(self) -> Optional[str]:
        """Where :meth:`write_trace` writes the merged Chrome trace (None: not tracing)."""
        return self._observer.trace_path

    @property
    def peak_weight_versions(self) -> Dict[int, int]:
        """Most weight versions held per local stage (asynchronous schedules, after a flush)."""
        return self._runner.peak_weight_versions

    @property
    def is_first(self) -> bool:
        return self._runner.is_first

    @property
    def is_last(self) -> bool:
        return self._runner.is_last

    @property
    def last_rank(self) -> int:
        return self._schedule.stage_ranks(self.num_stages - 1)[0]

    # -- module-like API ------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stages (give these to your optimizer)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the original model."""
        return self.module.named_parameters()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """This rank's weights keyed by the original model's names."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor],
                        strict: bool = True) -> "reshard.IncompatibleKeys":
        """Loads this rank's entries of the whole model's state dict, in place.

        Collective: call it on every rank with the full (unsplit) state dict, e.g.
        ``torch.load("model.pt", mmap=True)`` or ``pd.consolidate("ckpt")``; each
        rank keeps the keys of its own stages' layers and ignores the others'. An
        asynchronous pipeline is flushed first; gradients are cleared; nothing
        changes unless every rank succeeded.

        Args:
            state_dict: keyed by the original model's names (``"3.weight"``).
            strict: refuse keys the model does not have and keys this rank's
                stages need that the dict lacks (shapes are always checked).

        Returns:
            ``(missing_keys, unexpected_keys)`` of this rank (empty when strict).

        Raises:
            ValueError: on every rank: unexpected keys, missing keys (naming the
                stage), or a shape that differs (naming the key and both shapes).
        """
        return reshard.load_state_dict(self, state_dict, strict)

    def train(self, mode: bool = True) -> "PipeDream":
        self.module.train(mode)
        return self

    def eval(self) -> "PipeDream":
        return self.train(False)

    # -- training -----------------------------------------------------------------------
    @faults.names_first_failure
    def step(self, inputs: Optional[Tensors], targets: Optional[Any],
             optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Union[StepLoss, float]]:
        """Runs one batch (flush schedules) or admits one minibatch (asynchronous ones).

        Flush schedules (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1``, ``zbv``,
        ``dualpipev``, ``interleaved-zb``): runs
        forward and backward of the whole batch and leaves on every local parameter
        the unsplit model's gradient; returns the batch's mean loss on every rank as a
        :class:`StepLoss`, a number whose all-reduce finishes in the background
        (reading it, ``float(loss)`` or ``loss.item()``, waits; a loop that never reads
        it never waits); you step your optimizer afterwards. Asynchronous schedules (``pipedream``,
        ``pipedream-2bw``): admits one minibatch (2bw: a batch of ``microbatches``),
        the runtime steps ``optimizer`` at every weight update, and the loss comes
        back on the last stage's rank only (``None`` elsewhere and while the
        pipeline fills). Details: ``_runners.FlushRunner`` / ``AsyncRunner``.

        Args:
            inputs: the batch (tensor or tuple of tensors; a dict of named tensors for
                a model traced on one), needed on stage 0's rank.
            targets: the targets, needed on the last stage's rank.
            optimizer: asynchronous schedules only: the optimizer of this rank's stage.

        Raises:
            ValueError: inputs or targets missing where needed, a batch smaller than
                ``microbatches``, or an optimizer missing (asynchronous) or passed (flush).
        """
        given = self._positional(inputs, "step()")
        self._agreement.check("step", given, targets,
                              lambda: self._runner.validate("step", given, targets))
        return self._runner.step(given, targets, optimizer)

    @faults.names_first_failure
    def flush(self) -> None:
        """Drains an asynchronous pipeline: every admitted minibatch finishes its
        backward and update. Call it before evaluation, checkpointing and at the end.
        A no-op for flush schedules."""
        self._runner.flush()

    @faults.names_first_failure
    @torch.no_grad()
    def forward_only(self, inputs: Optional[Tensors]) -> Optional[Tensors]:
        """Runs the batch forward through the pipeline without gradients.

        Returns:
            The model's outputs for the whole batch on the rank of the last stage
            (concatenated over microbatches; an exported model's own structure, e.g.
            a ``ModelOutput``), ``None`` elsewhere.

        Raises:
            ValueError: no inputs on stage 0's rank.
            RuntimeError: an asynchronous pipeline that was not flushed.
        """
        given = self._positional(inputs, "forward_only()")
        self._agreement.check("forward_only", given, None,
                              lambda: self._runner.validate("forward_only", given, None))
        out = self._runner.forward_only(given)
        return out if self.traced is None else model_io.restore_output(self.traced.output_spec, out)

    def _positional(self, inputs: Any, call: str) -> Optional[Tensors]:
        """A traced model's dict of named inputs as its graph's tuple (else unchanged)."""
        if self.traced is None:
            return inputs
        return model_io.positional_inputs(self.traced.input_names, inputs, call)

    def grad_scaler(self, **kwargs: Any) -> Any:
        """A loss scaler for ``autocast=torch.float16`` on a flush schedule.

        A :class:`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` over this
        pipeline's group: ``scaler.step(optimizer)`` skips an overflowing step on every
        rank together (each rank only sees its own stage's gradients). ``pipe.step``
        scales the loss with it and returns the unscaled loss. Use it like
        ``torch.amp.GradScaler``::

            scaler = pipe.grad_scaler()
            loss = pipe.step(x, y)
            scaler.step(opt); scaler.update(); opt.zero_grad()

        Every rank must call ``scaler.step`` each step, so every stage needs parameters.

        Args:
            **kwargs: passed on (``init_scale``, ``growth_interval``, ...).

        Raises:
            ValueError: an asynchronous schedule (their updates happen inside the pipeline).
        """
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if self.asynchronous:
            raise ValueError(f"schedule {self.schedule_name!r} updates inside the pipeline; loss "
                             "scaling needs a flush schedule (or use autocast=torch.bfloat16)")
        if not any(True for _ in self.parameters()):
            raise ValueError(f"rank {self.rank}'s stages have no parameters, so it cannot step a "
                             "scaler; give every stage parameters (balance=...)")
        scaler = ShardedGradScaler(device=self.device.type, process_group=self.group, **kwargs)
        # The scale is created lazily by scale(), which only the last stage calls;
        # every rank's step()/update() needs it.
        scaler.scale(torch.ones((), device=self.device))
        self._stage_fn.grad_scaler = scaler
        return scaler

    # -- seeing what happens ----------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's communication engine has sent so far."""
        return int(self.stats()["bytes_sent"])

    def stats(self) -> Dict[str, Any]:
        """What this rank's runtime did since construction (or :meth:`reset_stats`).

        Returns:
            A dict with ``rank``, ``stages``, ``steps`` (executor runs), ``compute_s``
            (forward/backward/update work), ``wait_s`` (blocked on other ranks:
            receives, sends, all-reduces), ``busy_s`` (wall time inside the runtime),
            ``bubble_fraction`` (``1 - compute_s / busy_s``: the share of the
            runtime's time this rank did no work), ``bytes_sent``/``bytes_received``,
            ``peak_activations`` (most microbatches stashed at once),
            ``peak_sends_in_flight`` (most sends whose buffers were held at once),
            ``peak_weight_versions`` (per stage; asynchronous schedules),
            ``seconds_by_kind`` (``F``, ``B``, ``RECV_F`` waits, ...), and the transfer
            counts ``sends``, ``receives``, ``messages_sent`` (on the wire, data and
            side channel), ``preposted_receives`` (receives whose data was posted
            before their consumer waited), ``redirected_sends`` (larger than their
            slot's capacity: payload on the side channel), ``padding_bytes`` and
            ``host_syncs`` (device-to-host copies of Gloo carrying CUDA tensors); see
            docs/runtime.md, "Communication engine".
            On a CUDA device also ``cuda_memory_allocated`` and
            ``cuda_peak_memory_allocated`` (bytes held by this rank's stages, now and
            at most since construction or :meth:`reset_stats`).
            Local to this rank: no communication.
        """
        return self._observer.stats(self._runner.executor)

    def reset_stats(self) -> None:
        """Starts :meth:`stats` from zero (e.g. after warm-up steps): times, counts,
        bytes, transfers, weight copies and peaks."""
        self._observer.reset(self._runner.executor)

    def write_trace(self, path: Optional[Union[str, os.PathLike]] = None) -> Optional[str]:
        """Merges every rank's recorded spans into one Chrome trace on rank 0.

        Collective: every rank of the group must call it (``close()`` does). Spans
        travel as UTF-8 JSON in uint8 tensors (no pickle). The trace has one process
        per rank (``rank r: stages [...]``) with threads ``compute`` (F/B/I/W/U),
        ``comm`` (sends posted, waits on receives and sends) and ``allreduce``;
        times are wall-clock microseconds, so ranks on different hosts are only as
        aligned as their clocks.

        Args:
            path: where to write (default: the ``trace`` given to the constructor).

        Returns:
            The path written, on rank 0; ``None`` on other ranks.

        Raises:
            ValueError: tracing was not enabled (no ``trace=`` / ``PIPEDREAM_TRACE``).
        """
        return self._observer.write_trace(self._runner.executor, path)

    def close(self) -> None:
        """Ends the pipeline: drains an asynchronous one and writes the trace if on.
        Collective (every rank calls it)."""
        self.flush()
        if self.trace_path is not None:
            self.write_trace()

    def __enter__(self) -> "PipeDream":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()


def _trace_stages(module: nn.Module, split_points: Sequence[str],
                  sample: Optional[Tuple[Tensors, Any]], balance: Any,
                  concrete_args: Optional[Mapping[str, Any]]) -> TracedSplit:
    """Checks the arguments of a traced pipeline and traces ``module`` on ``sample``.

    Raises:
        ValueError: no sample, a balance, a meta-device model, or what
            ``_trace.split_model`` refuses.
    """
    if balance is not None:
        raise ValueError(f"balance={balance!r} cannot be combined with split_points: the split "
                         "points fix the stages; drop balance, or drop split_points and give "
                         "balance='auto' to let the planner cut the model")
    if sample is None or not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError("split_points needs sample=(inputs, targets), one batch to trace the "
                         "model on (inputs: a tensor, a tuple of tensors or a dict of named "
                         "tensors)")
    if deferred_init.has_meta_tensors(module):
        raise ValueError("split_points traces the model by running it on sample, which the meta "
                         "device cannot; build the model on a real device")
    first = sample[0]
    if isinstance(first, Mapping):  # keyword inputs: traced by name, passed by name
        model_io.positional_inputs(list(first), first, "sample")  # tensors only
        return split_model(module, split_points, dict(first), concrete_args)
    inputs = tuple(first) if isinstance(first, (tuple, list)) else (first,)
    return split_model(module, split_points, inputs, concrete_args)



def _prepare_model(module: nn.Module, split_points: Optional[Sequence[str]],
                   sample: Optional[Tuple[Tensors, Any]], balance: Any,
                   concrete_args: Optional[Mapping[str, Any]], init_seed: int,
                   init_fn: Optional[deferred_init.InitFn]
                   ) -> Tuple[Optional[TracedSplit], Optional["_PlannedTrace"], bool, int]:
    """Checks what kind of model this is before any communication.

    Returns:
        The traced stages (``split_points``) or None, the traced and grouped model
        waiting for its plan (a model that is not an ``nn.Sequential`` with
        ``balance="auto"`` or a plan) or None, whether the model is on the meta device
        (deferred initialisation), and the checked ``init_seed``.

    Raises:
        ValueError: not an ``nn.Sequential`` without split points, ``concrete_args``
            without split points, a bad seed, a meta module that cannot be
            initialised, or ``balance="auto"`` on the meta device.
    """
    traced = planned = None
    if split_points is not None:
        traced = _trace_stages(module, split_points, sample, balance, concrete_args)
    elif not isinstance(module, nn.Sequential) and _is_plan(balance):
        planned = _PlannedTrace.trace(module, sample, concrete_args)
    elif not isinstance(module, nn.Sequential):
        raise ValueError(f"module must be an nn.Sequential (got {type(module).__name__}); "
                         "wrap your layers in torch.nn.Sequential, or give "
                         "split_points=[module names] and sample=(inputs, targets) to trace "
                         "it with torch.fx, or balance='auto' and sample=(inputs, targets) to "
                         "trace, profile and plan it (docs/tracing.md)")
    elif concrete_args is not None:
        raise ValueError("concrete_args fixes forward arguments for tracing, which an "
                         "nn.Sequential never needs; drop concrete_args")
    if isinstance(balance, (str, os.PathLike)) and str(balance) != "auto" and \
            not os.path.isfile(balance):
        raise ValueError(f"balance={os.fspath(balance)!r} is neither 'auto' nor a plan file (no such "
                         "file); give layer counts as a list (balance=[4, 4]), 'auto' to plan at "
                         "start-up, or the path of a plan.json")
    init_seed = deferred_init.check_seed(init_seed)
    deferred = deferred_init.has_meta_tensors(module)
    if deferred:
        deferred_init.check_initialisable(module, init_fn)
        if isinstance(balance, str) and balance == "auto":
            raise ValueError("balance='auto' profiles the model, which cannot run on the meta "
                             "device; plan once from a real model (python -m pipedream_ext "
                             "plan) and pass balance='plan.json', or give layer counts")
    return traced, planned, deferred, init_seed


def _is_plan(balance: Any) -> bool:
    """``balance`` names a plan: ``"auto"``, a plan file or a :class:`Plan`."""
    return isinstance(balance, (Plan, str, os.PathLike))


class _PlannedTrace:
    """A traced model grouped for the planner (``_graph_profile``), waiting for its plan.

    Tracing and grouping run on every rank before any communication; rank 0 also
    profiles the groups for ``balance="auto"``; every rank then cuts the model as
    the plan's stages say (and the ranks compare what they cut: ``_agree``).

    Args:
        inputs: the sample's tensor inputs in the graph's order.
        named: the sample's inputs by name (a dict), or ``None`` (positional).
    """

    def __init__(self, module: nn.Module, grouped: Any, inputs: Tuple[torch.Tensor, ...],
                 targets: Any, concrete_args: Optional[Mapping[str, Any]],
                 named: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self.module, self.grouped = module, grouped
        self.inputs, self.targets, self.concrete_args = inputs, targets, concrete_args
        self.named = named

    @classmethod
    def trace(cls, module: nn.Module, sample: Optional[Tuple[Tensors, Any]],
              concrete_args: Optional[Mapping[str, Any]]) -> "_PlannedTrace":
        """Traces and groups ``module`` on the inputs of ``sample`` (no communication):
        a tensor, a tuple of tensors (positional) or a dict of named tensors (keywords).

        Raises:
            ValueError: no sample, a meta-device model, or one torch.fx cannot trace
                (naming split_points for a model only torch.export traces).
        """
        from ._frontend.graph_split import UntraceableError
        from ._planning.graph_profile import trace_groups

        if sample is None or not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise ValueError(f"{type(module).__name__} is not an nn.Sequential, so a plan runs on "
                             "its traced graph: pass sample=(inputs, targets), one batch to trace "
                             "(and profile) it on (inputs: a tensor, a tuple of tensors or a dict "
                             "of named tensors)")
        if deferred_init.has_meta_tensors(module):
            raise ValueError("a plan for a model that is not an nn.Sequential needs its traced "
                             "graph, which runs the sample, which the meta device cannot; build "
                             "the model on a real device")
        first, names = sample[0], None
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
        from ._planning.graph_profile import profile_groups

        return lambda: profile_groups(self.grouped, self.inputs, loss_fn, self.targets,
                                      steps=10, warmup=3)

    def split(self, plan: Plan) -> TracedSplit:
        """The stages of ``plan`` (every rank, the same plan).

        Raises:
            ValueError: a plan of another model or grouping, or one that cannot run
                (a value flowing backwards, an empty stage, a non-tensor crossing).
        """
        from ._planning.graph_profile import plan_split_labels, plan_stage_of

        stage_of = plan_stage_of(self.grouped, plan)
        return split_model(self.module, plan_split_labels(self.grouped, stage_of),
                           self.named if self.named is not None else self.inputs,
                           self.concrete_args, stage_of=stage_of,
                           traced=(self.grouped.gm, self.grouped.kinds))


def _default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")
