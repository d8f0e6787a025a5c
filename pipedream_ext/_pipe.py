"""The user-facing pipeline: ``PipeDream(module, loss_fn, schedule, ...)``.

A facade: ``_build.build_pipeline`` checks the arguments, resolves the partition,
creates the process groups, this rank's stages and the runner; ``PipeDream``
holds what it built and hands each call to the runner (``_runtime/runners.py``),
the observer (``_runtime/observe.py``) or the checkpoint code. The data flow of
one step: docs/architecture.md.
"""
from __future__ import annotations

import functools
import operator
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

from . import schedules
from ._build import PipelineArguments, build_pipeline
from ._checkpoint import PipelineView, finish_pending, reshard
from ._dist import faults
from ._frontend import deferred_init, model_io
from ._frontend.graph_split import TracedSplit
from ._frontend.partition import even_balance
from ._runtime.loss_scaling import attach_grad_scaler
from ._runtime.stage_call import NonFiniteError, Tensors
from ._runtime.step_loss import StepLoss
from .planner import Plan

__all__ = ["ASYNCHRONOUS_SCHEDULES", "SYNCHRONOUS_SCHEDULES", "ClipOption", "NonFiniteError", "PipeDream",
           "clip_grad_norm_", "even_balance"]

#: Flush schedules (gradients equal the unsplit model's; you step the optimizer).
SYNCHRONOUS_SCHEDULES = tuple(schedules.synchronous_names())
#: Asynchronous schedules (weight stashing; the runtime steps your optimizer).
ASYNCHRONOUS_SCHEDULES = tuple(schedules.asynchronous_names())


#: ``PipeDream(clip_grad_norm=...)``: ``max_norm`` or ``(max_norm, norm_type)``.
ClipOption = Optional[Union[float, Tuple[float, float]]]


def _forward(path: str, doc: Optional[str] = None) -> Any:
    """A read-only property answering ``self.<path>`` (``operator.attrgetter``): the
    facade's attributes that only read what ``build_pipeline`` made. Typed ``Any`` so
    that the class attribute's annotation is what users' type checkers see."""
    return property(operator.attrgetter(path), doc=doc)


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

    Example (under ``torchrun --nproc-per-node 4``; a meta-device model: each rank
    initialises only its own layers, see ``init_seed``)::

        pipe = PipeDream(model, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in loader:
            loss = pipe.step(x, y)
            opt.step(); opt.zero_grad()

    Args:
        module: the whole model, identically initialised on every rank, or built on the meta device (then see
            ``init_seed`` and ``init_fn``): an ``nn.Sequential``, or any ``nn.Module`` with ``split_points`` or
            with ``balance="auto"`` / a plan (traced, cut as the plan's stages say).
        loss_fn: ``loss_fn(output, target)``, a scalar tensor: the mean over the batch (or the sum, with
            ``loss_reduction="sum"``; checked once, on the first microbatch).
        schedule: one of :data:`SYNCHRONOUS_SCHEDULES` or :data:`ASYNCHRONOUS_SCHEDULES` (what each means:
            ``schedules.traits(name)``). With ``pipedream`` every ``step`` is one minibatch and one weight
            update per stage (weight stashing); with ``pipedream-2bw`` one batch of ``microbatches`` and one
            update (at most 2 weight versions). Both take the optimizer in ``step(x, y, optimizer=opt)`` and
            need ``flush()``.
        microbatches: microbatches per ``step`` (the batch is split on dim 0).
        balance: layers per stage (``None``: an even split); ``"auto"`` to profile the model on rank 0 with
            ``sample`` and plan stages and replicas for this world with the planner; or a saved plan (a
            ``plan.json`` path or a :class:`~pipedream_ext.Plan`). Stages are ordered as in the module; stage
            ``j`` runs on rank ``j``, or on consecutive ranks when replicated; with several chunks per rank the
            schedule's layout places them: ``j mod world`` (``interleaved-1f1b``, ``interleaved-zb``) or a V
            (``zbv``, ``dualpipev``: rank ``r`` holds stages ``r`` and ``2 * world - 1 - r``). For a model that
            is not an ``nn.Sequential`` (no ``split_points``), ``"auto"`` traces it, profiles its graph on rank
            0 (groups of operations, real edges) and plans; a plan must come from that model's graph profile
            (docs/tracing.md).
        chunks: model chunks per rank (``interleaved-1f1b``, ``interleaved-zb``; exactly 2 for ``zbv`` and
            ``dualpipev``).
        process_group: the group to run on (default: the default group, which is created from the torchrun
            environment if needed: Gloo on CPU, NCCL on GPU).
        device: where this rank's layers live (default: ``cuda:LOCAL_RANK`` if CUDA is available, else CPU).
        timeout: seconds any wait on another rank may take before failing.
        vertical_sync: ``pipedream`` only: every stage uses, for a minibatch, the weight version stage 0 used.
        replicas: replica count per stage, e.g. ``[2, 1, 1]`` on 4 ranks (hybrid pipeline and data parallelism;
            gpipe, 1f1b, pipedream, pipedream-2bw). Stage j runs on ``replicas[j]`` consecutive ranks;
            microbatch i runs on replica ``i mod replicas[j]``; replicas all-reduce gradients before each update
            (summed for flush schedules and 2bw, where they are parts of one batch; averaged for ``pipedream``,
            where each replica ran its own minibatch).
        sample: ``(inputs, targets)`` of one batch, for ``balance="auto"`` and for tracing a model that is not
            an ``nn.Sequential``.
        bandwidth: bytes/s per topology level (within a node, then between nodes) for ``balance="auto"``;
            measured with a short probe if omitted.
        recompute: keep only each stage's inputs during the forward and recompute its activations in the
            backward (same result, with the CPU and CUDA RNG states restored so dropout draws the same masks).
        trace: record every action each rank runs and write them, merged by rank 0, as one Chrome trace at this
            path (Perfetto) in :meth:`write_trace` or :meth:`close`. Default: the ``PIPEDREAM_TRACE``
            environment variable.
        autocast: run every stage's forward (and the loss) under ``torch.autocast(device_type,
            dtype=autocast)``, e.g. ``torch.bfloat16``; boundary tensors then travel in that dtype (half the
            bytes). With ``torch.float16`` on a flush schedule, scale the loss with :meth:`grad_scaler` (all
            ranks skip an overflowing step together).
        check_finite: ``"raise"`` or ``"skip"``: after every step, find the first stage whose forward output
            (or, in the backward, the last stage whose gradients) holds NaN or inf and report it with the step
            number; ``"raise"`` raises :class:`NonFiniteError` on every rank, ``"skip"`` (flush schedules) logs
            a warning, sets this step's gradients to ``None`` so ``optimizer.step()`` leaves the weights alone,
            and returns ``nan``. Costs one ``isfinite`` per stage output and one small all-reduce per step.
            Asynchronous schedules support ``"raise"`` only (the rank that finds it raises; the others fail
            naming it).
        init_seed: base seed of deferred initialisation (default 0), an integer in ``[0, 2**16)``: top-level
            layer ``l`` built on the meta device is initialised under a forked RNG seeded with ``init_seed *
            2**16 + l``, so it gets the same weights on any partition or world size; your global RNG state is
            left as it was. ``pd.materialize(model, seed=...)`` gives the same weights to a whole model in one
            process.
        init_fn: ``init_fn(layer)`` initialises one top-level layer built on the meta device in place (called
            once per layer this rank keeps, after its storage is allocated, under the seeded RNG and
            ``no_grad``), instead of each module's ``reset_parameters()``. Needed for modules with meta tensors
            and no ``reset_parameters()``, and for buffers computed in ``__init__`` (a causal mask) that
            ``reset_parameters()`` does not set.
        split_points: for a model that is not an ``nn.Sequential``: qualified module names (``["layer3",
            "decoder.up1"]``); the model is traced with torch.fx on ``sample`` (``torch.export``, non-strict
            with dynamic shapes, where fx cannot) and stage ``j + 1`` starts at the first operation running in
            ``split_points[j]``. Tensors live across a cut (inputs, skip connections) travel as a tuple; names
            stay the original model's. One fewer than the stages (ranks x chunks, or ``len(replicas)``). See
            docs/tracing.md.
        concrete_args: for a traced model: non-tensor ``forward`` arguments fixed for tracing, e.g.
            ``{"use_cache": False}``; tensor inputs go in ``sample`` and in every ``step``: a tuple
            (positionally) or a dict of named tensors (keyword arguments; every other argument then takes its
            default).
        loss_reduction: ``"mean"`` (default): ``loss_fn`` averages over the batch and each microbatch's loss is
            scaled by its share of the batch; ``"sum"``: it adds, unscaled. A ``loss_fn`` that reduces otherwise
            is refused at once.
        check_agreement: the first ``check_agreement`` calls of ``step()`` and of ``forward_only()`` start with
            one small exchange in which every rank says which call it is in and fingerprints the batch it was
            given: ranks in different calls, or a first and a last stage given different batches (a
            ``DistributedSampler`` kept from a DDP script) fail on every rank before anything is sent. ``0``
            turns it off; later calls cost nothing.
        mesh: a ``("pp", "dp")`` DeviceMesh over every rank: the pipeline runs on ``mesh["pp"]``, one copy per
            ``dp`` rank, each ``step`` given that rank's part.
        data_parallel: with ``mesh``: ``"fsdp"`` (FSDP2 ``fully_shard`` of each layer over ``mesh["dp"]``) or
            ``"replicate"`` (gradients averaged over it after each step).
        reshard_after_forward: ``"fsdp"``: free the gathered weights after each forward.
        mp_policy: ``"fsdp"``: FSDP's ``MixedPrecisionPolicy`` (README "Pipeline + FSDP").
        clip_grad_norm: ``pipedream-2bw``: ``max_norm`` or ``(max_norm, norm_type)``: clip each update's
            gradients by the whole model's norm (flush: :func:`clip_grad_norm_`).

    Every rank compares, at construction, the arguments above and a fingerprint of
    every stage (its graph or layers; docs/tracing.md#one-graph-on-every-rank), and
    replicas of a stage start from their leader's weights (broadcast, as DDP does).

    Raises:
        ValueError: bad schedule, balance, chunks or world size; a model that cannot be
            traced or bad split points (naming the module or operation); a meta module that
            cannot be initialised (no ``reset_parameters()`` and no ``init_fn``), or a tensor
            left unset (naming the value and the fix); ranks that disagree on an argument
            or built a different stage (naming it, every rank).
        RuntimeError: no process group and no torchrun environment.
    """

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor], schedule: str = "1f1b",
                 microbatches: int = 4, balance: Optional[Union[Sequence[int], str, os.PathLike, Plan]] = None,
                 chunks: int = 1, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[str, torch.device]] = None, timeout: float = 300.0,
                 vertical_sync: bool = False, recompute: bool = False, replicas: Optional[Sequence[int]] = None,
                 sample: Optional[Tuple[Tensors, Any]] = None, bandwidth: Optional[Sequence[float]] = None,
                 trace: Optional[Union[str, os.PathLike]] = None, autocast: Optional[torch.dtype] = None,
                 check_finite: Optional[str] = None, init_seed: int = deferred_init.DEFAULT_INIT_SEED,
                 init_fn: Optional[deferred_init.InitFn] = None, split_points: Optional[Sequence[str]] = None,
                 concrete_args: Optional[Mapping[str, Any]] = None, loss_reduction: str = "mean",
                 check_agreement: int = 3, mesh: Optional[Any] = None, data_parallel: str = "fsdp",
                 reshard_after_forward: bool = False, mp_policy: Optional[Any] = None,
                 clip_grad_norm: ClipOption = None) -> None:
        # PipelineArguments lists its fields in this signature's order (tests/test_units.py).
        built = build_pipeline(PipelineArguments(
            module, loss_fn, schedule, microbatches, balance, chunks, process_group, device, timeout, vertical_sync,
            recompute, replicas, sample, bandwidth, trace, autocast, check_finite, init_seed, init_fn, split_points,
            concrete_args, loss_reduction, check_agreement, mesh, data_parallel, reshard_after_forward, mp_policy,
            clip_grad_norm))
        self.config, self.device, self.loss_fn = built.config, built.device, loss_fn
        #: The traced model's stages (``split_points`` or a plan), else None (an nn.Sequential).
        self.traced: Optional[TracedSplit] = built.traced
        #: The plan the stages come from (balance="auto" or a saved plan), else None.
        self.plan: Optional[Plan] = built.plan
        #: Parameters used by layers of several stages (tied weights), each kept by
        #: every stage that uses it; see _frontend/tied_params.py.
        self.shared_parameters = built.shared_parameters
        #: Every state_dict key of the whole model and its shape (for load_state_dict).
        self._model_shapes = built.model_shapes
        self._schedule, self._groups, self._stages = built.schedule, built.groups, built.stages
        self._observer, self._stage_fn = built.observer, built.stage_fn
        self._runner, self._agreement = built.runner, built.agreement

    # -- what the pipeline is: read from what build_pipeline made ----------------------
    group: dist.ProcessGroup = _forward("_groups.group")
    rank: int = _forward("_groups.rank")
    world_size: int = _forward("_groups.world_size")
    schedule_name: str = _forward("config.schedule")
    asynchronous: bool = _forward("config.asynchronous")
    microbatches: int = _forward("config.microbatches")
    chunks: int = _forward("config.chunks")
    timeout: float = _forward("config.timeout")
    vertical_sync: bool = _forward("config.vertical_sync")
    recompute: bool = _forward("config.recompute")
    check_finite: Optional[str] = _forward("config.check_finite")
    balance: List[int] = _forward("_stages.partition.balance")
    replicas: List[int] = _forward("_stages.partition.replicas")
    num_stages: int = _forward("_schedule.num_stages")
    local_stages: List[int] = _forward("_stages.indices")
    stage_layers: Dict[int, Tuple[int, int]] = _forward("_stages.layers")
    module: nn.Module = _forward(
        "_stages.module", "This rank's layers as one module, named as in the original model.")
    schedule: "schedules.Schedule" = _forward(
        "_schedule", "The schedule this pipeline runs (for asynchronous ones: one period of it).")
    trace_path: Optional[str] = _forward(
        "_observer.trace_path",
        "Where :meth:`write_trace` writes the merged Chrome trace (None: not tracing).")
    peak_weight_versions: Dict[int, int] = _forward(
        "_runner.peak_weight_versions",
        "Most weight versions held per local stage (asynchronous schedules, after a flush).")
    is_first: bool = _forward("_runner.is_first")
    is_last: bool = _forward("_runner.is_last")

    @property
    def autocast(self) -> Optional[torch.dtype]:
        """Compute dtype of autocast (None: full precision); may be changed between
        steps, e.g. to evaluate in full precision (boundary headers carry the dtype)."""
        return self._runner.settings.autocast

    @autocast.setter
    def autocast(self, dtype: Optional[torch.dtype]) -> None:
        self._runner.settings.autocast = dtype

    @property
    def split_points(self) -> Optional[List[str]]:
        """The module names a traced model's stages start at (None: an nn.Sequential); for
        a plan's stages, the module each later stage's first operation runs in."""
        return None if self.traced is None else list(self.traced.split_points)

    @property
    def stage_index(self) -> int:
        return self._stages.indices[0]

    @property
    def last_rank(self) -> int:
        return self._schedule.stage_ranks(self.num_stages - 1)[0]

    @property
    def checkpoint_view(self) -> PipelineView:
        """A frozen, read-only snapshot of what checkpoints and :meth:`load_state_dict`
        read of this pipeline: this rank's stage modules and layer ranges, every
        stage's ranks, the whole model's key shapes, the shared parameters and the
        layout (see ``pipedream_ext/_checkpoint/view.py``)."""
        return _checkpoint_view(self, self._groups, self._schedule, self._stages, self._model_shapes,
                                self._runner.data_parallel)

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
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Refused with the calls to use: each rank runs only its stages, for a whole batch."""
        raise TypeError("a PipeDream pipeline is not called like a module (pipe(x, y)): train on a batch "
                        "with loss = pipe.step(x, y) (forward and backward; then opt.step()), run "
                        "inference with out = pipe.forward_only(x)")

    @faults.names_first_failure
    def step(self, inputs: Optional[Tensors], targets: Optional[Any],
             optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Union[StepLoss, float]]:
        """Runs one batch (flush schedules) or admits one minibatch (asynchronous ones).

        Flush schedules (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1``, ``zbv``,
        ``dualpipev``, ``interleaved-zb``): runs forward and backward of the whole batch and
        leaves on every local parameter the unsplit model's gradient; returns the batch's
        mean loss on every rank as a :class:`StepLoss`, a number whose all-reduce finishes
        in the background (reading it, ``float(loss)`` or ``loss.item()``, waits; a loop
        that never reads it never waits); you step your optimizer afterwards (clip with
        :func:`clip_grad_norm_` first). Asynchronous schedules (``pipedream``,
        ``pipedream-2bw``): admits one minibatch (2bw: a batch of ``microbatches``),
        the runtime steps ``optimizer`` at every weight update, and the loss comes
        back on the last stage's rank only (``None`` elsewhere and while the
        pipeline fills). Details: ``_runtime.runners.FlushRunner`` / ``AsyncRunner``.

        Args:
            inputs: the batch (tensor or tuple of tensors; a dict of named tensors for
                a model traced on one), needed on stage 0's rank.
            targets: the targets, needed on the last stage's rank.
            optimizer: asynchronous schedules only: the optimizer of this rank's stage.

        Raises:
            ValueError: inputs or targets missing where needed, a batch smaller than
                ``microbatches``, or an optimizer missing (asynchronous) or passed (flush).
        """
        self._runner.step_calls += 1  # every call, those that raise too (a mesh compares them)
        return self._runner.step(self._agreed("step", inputs, targets), targets, optimizer)

    @faults.names_first_failure
    def flush(self) -> None:
        """Drains an asynchronous pipeline: every admitted minibatch finishes its
        backward and update. Call it before evaluation, checkpointing and at the end.
        A no-op for flush schedules."""
        self._runner.flush()

    @faults.names_first_failure
    @torch.no_grad()
    def forward_only(self, inputs: Optional[Tensors], output_batch_dim: Optional[int] = 0) -> Any:
        """Runs the batch forward through the pipeline without gradients.

        Each leaf of the microbatches' outputs is combined as in the unsplit model
        (docs/runtime.md): tensors along ``output_batch_dim`` where it has each
        microbatch's rows, 0-d tensors as the rows-weighted mean; others are refused.

        Args:
            inputs: the batch, needed on stage 0's rank.
            output_batch_dim: 0, 1 for sequence-first ``[T, B, ...]`` outputs, or
                ``None`` for the list of the microbatches' outputs.

        Returns:
            The whole batch's output (or that list) on the last stage's rank, else ``None``.

        Raises:
            ValueError: no inputs on stage 0's rank, a bad ``output_batch_dim``, or an
                output that cannot be combined (on every rank).
            RuntimeError: an asynchronous pipeline that was not flushed.
        """
        restore = functools.partial(model_io.restore_output, None if self.traced is None else self.traced.output_spec)
        return self._runner.forward_only(self._agreed("forward_only", inputs, None), output_batch_dim, restore)

    def _agreed(self, call: str, inputs: Any, targets: Any) -> Optional[Tensors]:
        """``inputs`` as the runner takes them (a traced model's dict of named inputs: its
        graph's tuple), once the first calls' agreement check passed on every rank."""
        given = inputs if self.traced is None else \
            model_io.positional_inputs(self.traced.input_names, inputs, f"{call}()")
        self._agreement.check(call, given, targets,
                              lambda: self._runner.validate(call, given, targets))
        return given

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
        return attach_grad_scaler(self.config, self._runner.settings, self.parameters(), self.group,
                                  self.device, self._stage_fn.rank_name, **kwargs)

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
            Queues, now: ``held_targets``, ``executor_actions``, ``executor_position``.
            Local to this rank: no communication.
        """
        return {**self._observer.stats(self._runner.executor), **self._runner.queue_sizes()}

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
        """Ends the pipeline: finishes an asynchronous checkpoint save (its manifest),
        drains an asynchronous schedule and writes the trace if on. Collective."""
        finish_pending(self.checkpoint_view)
        self.flush()
        if self.trace_path is not None:
            self.write_trace()

    def __enter__(self) -> "PipeDream":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()



def _checkpoint_view(pipe: PipeDream, groups: Any, schedule: Any, stages: Any,
                     model_shapes: Dict[str, Tuple[int, ...]], data_parallel: Any) -> PipelineView:
    """:attr:`PipeDream.checkpoint_view`, built from the pipeline's parts."""
    fields = _view_ranks(pipe.rank, pipe.world_size, pipe.group, groups.checkpoint, pipe.timeout,
                         [schedule.stage_ranks(j) for j in range(pipe.num_stages)], data_parallel)
    return PipelineView(
        timeout=pipe.timeout, device=pipe.device, module=pipe.module,
        stages={j: stages[j] for j in pipe.local_stages}, stage_layers=pipe.stage_layers,
        model_shapes=model_shapes, shared_parameters=pipe.shared_parameters,
        split_points=pipe.split_points, schedule_name=pipe.schedule_name,
        microbatches=pipe.microbatches, chunks=pipe.chunks, balance=pipe.balance,
        replicas=pipe.replicas, asynchronous=pipe.asynchronous, **fields)


def _view_ranks(rank: int, world_size: int, group: Any, checkpoint: Any, timeout: float,
                stage_ranks: List[List[int]], data_parallel: Any) -> Dict[str, Any]:
    """``PipelineView``'s ranks and groups: the pipeline's, or with a mesh every
    pipeline's (``MeshPlan.checkpoint_layout``)."""
    fields = dict(rank=rank, world_size=world_size, group=group, stage_ranks=stage_ranks,
                  checkpoint_group=checkpoint, data_parallel=None)
    if data_parallel is not None:
        plan = data_parallel.plan
        fields.update(plan.checkpoint_layout(stage_ranks, timeout), data_parallel=plan.data_parallel)
    return fields


@faults.names_first_failure
def clip_grad_norm_(pipe: PipeDream, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clips the gradients of the whole pipeline by their total norm, in place:
    ``torch.nn.utils.clip_grad_norm_`` of the unsplit model.

    Collective: every rank of the pipeline calls it, after ``pipe.step(x, y)`` and
    before ``opt.step()`` (flush schedules; ``pipedream-2bw`` clips inside the pipeline:
    ``PipeDream(..., clip_grad_norm=max_norm)``)::

        loss = pipe.step(x, y)
        pd.clip_grad_norm_(pipe, 1.0)
        opt.step(); opt.zero_grad()

    The norm covers every stage's gradients, each once (a replicated stage's and a
    tied parameter's copies count once), in one small all-reduce over the pipeline's
    group (``mesh=``: every rank, each FSDP shard and replicated gradient once); every
    local gradient is then scaled by ``min(max_norm / (total + 1e-6), 1)``
    (docs/runtime.md, "Gradient clipping"). With fp16 loss scaling, call
    ``scaler.unscale_(opt)`` first, as with torch.

    Args:
        pipe: the pipeline (a flush schedule).
        max_norm: the largest total norm, a number > 0.
        norm_type: ``p`` of the p-norm, > 0, or ``float('inf')`` (the largest
            absolute value over every rank).
        error_if_nonfinite: raise (on every rank, nothing scaled) if the total norm
            is NaN or inf.
        foreach: as in torch (``None``: foreach kernels where the device has them).

    Returns:
        The total norm before clipping, a scalar tensor on ``pipe.device`` in the
        gradients' dtype, the same on every rank.

    Raises:
        ValueError: ``max_norm`` not a number > 0, a bad ``norm_type``, or an
            asynchronous schedule (naming ``clip_grad_norm=``).
        RuntimeError: a non-finite norm with ``error_if_nonfinite``, or the
            all-reduce failed or timed out.
    """
    if not isinstance(pipe, PipeDream):
        raise ValueError(f"pd.clip_grad_norm_ takes the PipeDream pipeline (got "
                         f"{type(pipe).__name__}); for a plain model use torch.nn.utils.clip_grad_norm_")
    return pipe._runner.clip_grad_norm(max_norm, norm_type, error_if_nonfinite, foreach)  # noqa: SLF001 - its own module's facade
