"""The user-facing pipeline: ``PipeDream(module, loss_fn, schedule=..., ...)``.

A facade: ``_build.build_pipeline`` checks the arguments, resolves the partition,
creates the process groups, this rank's stages and the runner; ``PipeDream``
holds what it built and hands each call to the runner (``_runtime/runners.py``),
the observer (``_runtime/observe.py``) or the checkpoint code. The data flow of
one step: docs/architecture.md.
"""
from __future__ import annotations

import functools
import os
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist
from torch import nn

from . import _checkpoint, schedules
from ._build import PipelineArguments, build_pipeline
from ._checkpoint import reshard
from ._checkpoint.pending import finish_pending
from ._checkpoint.view import PipelineView
from ._dist import faults
from ._frontend import model_io
from ._frontend.graph_split import TracedSplit
from ._frontend.partition import even_balance
from ._parallel.dims import ParallelDims
from ._runtime.loss_scaling import attach_grad_scaler
from ._runtime.options import ClipOption, PipelineOptions, document, from_call, keyword_options
from ._runtime.stage_call import NonFiniteError, Tensors
from ._runtime.step_loss import StepLoss
from ._runtime.unset_check import UnsetCheck
from .configuration import Configuration
from .planner import Plan

__all__ = ["ASYNCHRONOUS_SCHEDULES", "SYNCHRONOUS_SCHEDULES", "ClipOption", "NonFiniteError", "PipeDream",
           "clip_grad_norm_", "even_balance"]

#: Flush schedules (gradients equal the unsplit model's; you step the optimizer).
SYNCHRONOUS_SCHEDULES = tuple(schedules.synchronous_names())
#: Asynchronous schedules (weight stashing; the runtime steps your optimizer).
ASYNCHRONOUS_SCHEDULES = tuple(schedules.asynchronous_names())


class _DataParallelPart:
    """Which part of each global batch this rank feeds: with a mesh's ``dp`` ranks (given,
    or chosen by ``mesh="auto"``) every pipeline copy trains on its own rows of the batch.
    Read by ``PipeDream`` from the run's ``ParallelDims`` (``_dims``)."""

    _dims: ParallelDims

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank, ``0 <= rank < data_parallel_size`` (0 without
        dp): it feeds rows ``[rank * n / size, (rank + 1) * n / size)`` of an ``n``-row
        global batch, e.g. ``DistributedSampler(..., num_replicas=pipe.data_parallel_size,
        rank=pipe.data_parallel_rank)``; every pp and tp rank of one copy feeds the same
        (with ``expert_parallel`` the copies are the ``(dp, ep)`` coordinates, ``dp * ep_size +
        ep``)."""
        return self._dims.dp_rank

    @property
    def data_parallel_size(self) -> int:
        """Copies of the pipeline over which each global batch is split (``mesh["dp"]``'s
        size, times ``mesh["ep"]``'s with ``expert_parallel``; 1 without a mesh)."""
        return self._dims.dp_size

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks running this rank's stages in every copy of the pipeline (its dp
        ranks, with ``expert_parallel`` its dp x ep ranks), bounded by ``timeout=``: the
        group to sum what each copy counted over, e.g. a router's tokens per expert
        before an aux-loss-free bias update (docs/guide/expert_parallel.md); ``None``
        without a mesh."""
        return self._dims.dp_group if self._dims.dp_mesh is not None else None


class PipeDream(_DataParallelPart):
    """Pipeline-parallel training of a model over the ranks of a process group.

    An ``nn.Sequential`` is cut between its children (``balance``); any other
    ``nn.Module`` is traced with torch.fx (or, where fx cannot, ``torch.export``) on
    ``sample`` and cut where the modules named by ``split_points`` start
    (docs/tracing.md)::

        pipe = PipeDream(resnet, F.cross_entropy, split_points=["layer3"], sample=(x, y))
        pipe = PipeDream(gpt2, loss_fn, split_points=["transformer.h.6"],
                         sample=({"input_ids": x, "attention_mask": m}, y),
                         concrete_args={"use_cache": False})

    {option_groups}

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
            ``loss_reduction="sum"``; checked once, on the first microbatch); with
            ``loss_reduction="tokens"`` the pair ``(loss_sum, n_tokens)``.
        {options}

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

    @keyword_options(PipelineOptions)
    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor], *args: Any,
                 **options: Any) -> None:
        # Options given positionally (the old signature) still work, with a DeprecationWarning.
        given = from_call("PipeDream", args, options)
        built = build_pipeline(PipelineArguments(module=module, loss_fn=loss_fn, given=frozenset(given),
                                                 pipeline=type(self), **given))
        self.config, self.device, self.loss_fn = built.config, built.device, loss_fn
        #: A transformers model's ``config``/``generation_config`` (else None): what save_pretrained writes.
        self.model_config = _saveable(getattr(module, "config", None))
        self.generation_config = _saveable(getattr(module, "generation_config", None))
        #: The traced model's stages (``split_points`` or a plan), else None (an nn.Sequential).
        self.traced: Optional[TracedSplit] = built.traced
        #: The plan the stages come from (balance="auto", a saved plan or the configuration chosen), else None.
        self.plan: Optional[Plan] = built.plan
        #: The configuration run, with its prediction (planner.md#choosing-the-whole-configuration), or None.
        self.configuration: Optional[Configuration] = built.configuration
        #: Parameters used by layers of several stages (tied weights), kept by each: _frontend/tied_params.py.
        self.shared_parameters = built.shared_parameters
        #: Every state_dict key of the whole model and its shape (for load_state_dict).
        self._model_shapes = built.model_shapes
        self._schedule, self._groups, self._stages = built.schedule, built.groups, built.stages
        self._observer, self._stage_fn = built.observer, built.stage_fn
        self._runner, self._agreement, self._dims = built.runner, built.agreement, built.dims
        #: ``step()`` calls made, those that raised included (the runner's mesh check compares them).
        self._step_calls = 0
        # A meta-built model: the first call refuses tensors nothing set (init_fn, partial loads).
        self._unset = UnsetCheck(lambda: self.module, built.agreement.group, built.config.timeout,
                                 built.deferred, built.agreement.names)

    # -- what the pipeline is: read-only, from what build_pipeline made ------------------
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
    def recompute(self) -> Union[bool, Tuple[bool, ...]]:
        """``recompute`` as given: a bool, or one per stage."""
        return self.config.recompute

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
    def local_stages(self) -> List[int]:
        return self._stages.indices

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
                                self._dims)

    # -- module-like API ------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stages (give these to your optimizer)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the original model."""
        return self.module.named_parameters()

    def buffers(self) -> Iterator[torch.Tensor]:
        """Buffers of this rank's stages."""
        return self.module.buffers()

    def named_buffers(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """This rank's buffers, named as in the original model."""
        return self.module.named_buffers()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """This rank's weights keyed by the original model's names."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Union[Dict[str, torch.Tensor], str, "os.PathLike[str]"],
                        strict: bool = True) -> "reshard.IncompatibleKeys":
        """Loads this rank's entries of the whole model's state dict, in place.

        Collective: call it on every rank with the full (unsplit) state dict, e.g.
        ``torch.load("model.pt", mmap=True)`` or ``pd.consolidate("ckpt")``, or with
        a path: a Hugging Face model directory (``model.safetensors``, or shards with
        ``model.safetensors.index.json``) or a ``.safetensors`` file, of which each
        rank opens only the files holding its tensors and reads only those tensors
        (memory-mapped; with ``mesh=`` only its shards; a tied weight under any of its
        names, as transformers stores it once), or a ``torch.save`` file
        (``.pt``/``.pth``/``.bin``, memory-mapped; ``pd.detect(path)`` tells); each
        rank keeps the keys of its own stages' layers and ignores the others'; with
        ``mesh=`` a DTensor parameter (FSDP, ``tensor_parallel``) takes this rank's
        shard of the whole value, cut by its placements. An asynchronous pipeline is
        flushed first; gradients are cleared; nothing
        changes unless every rank succeeded.

        Args:
            state_dict: keyed by the original model's names (``"3.weight"``), or a path.
            strict: refuse keys the model does not have and keys this rank's
                stages need that the dict lacks (shapes are always checked).

        Returns:
            ``(missing_keys, unexpected_keys)`` of this rank (empty when strict).

        Raises:
            ValueError: on every rank: unexpected keys, missing keys (naming the
                stage), or a shape that differs (naming the key and both shapes); values
                on the meta device (naming them); a path of another format (a
                checkpoint directory: ``pd.load_checkpoint``). A load that leaves tensors of a
                meta-built model unset logs a warning naming them (the first step refuses them).
        """
        # _checkpoint.load_path imports the file formats on first use, not at start-up.
        loaded = _checkpoint.load_path(self, state_dict, strict) if isinstance(state_dict, (str, os.PathLike)) \
            else reshard.load_state_dict(self, state_dict, strict)
        self._unset.after_load("load_state_dict")
        return loaded

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
                ``microbatches``, or an optimizer missing (asynchronous) or passed (flush);
                on every rank, a model built on the meta device with tensors nothing set
                (naming each rank's).
        """
        call = self._step_calls
        self._step_calls += 1  # every call, those that raise too (a mesh compares them)
        return self._runner.step(self._agreed("step", inputs, targets), targets, optimizer, call)

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
        self._agreement.check(call, given, targets)
        self._unset.check(call)
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
            ``seconds_by_kind`` (``F``, ``B``, ``RECV_F``, ``RECV_POST``, ``TIED_ALLREDUCE``, ...), and the transfer
            counts ``sends``, ``receives``, ``messages_sent`` (on the wire, data and
            side channel), ``preposted_receives`` (receives whose data was posted
            before their consumer waited), ``redirected_sends`` (larger than their
            slot's capacity: payload on the side channel), ``padding_bytes`` and
            ``host_syncs`` (device-to-host copies of Gloo carrying CUDA tensors); see
            docs/runtime.md, "Communication engine"; ``overlap_yields`` (``overlap=True``).
            On a CUDA device also ``cuda_memory_allocated`` and
            ``cuda_peak_memory_allocated`` (bytes held by this rank's stages, now and
            at most since construction or :meth:`reset_stats`).
            Queues, now: ``held_targets``, ``executor_actions``, ``executor_position``. With a
            prediction (:attr:`configuration`): ``predicted_step_seconds`` and
            ``measured_step_seconds`` (steps 3-7's median, ``None`` before). Local: no communication.
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



if PipeDream.__doc__:  # None under python -OO
    PipeDream.__doc__ = document(PipeDream.__doc__)



def _saveable(value: Any) -> Any:
    """``value`` where it can write itself into a directory (``save_pretrained``), else None."""
    return value if callable(getattr(value, "save_pretrained", None)) else None


def _checkpoint_view(pipe: PipeDream, groups: Any, schedule: Any, stages: Any,
                     model_shapes: Dict[str, Tuple[int, ...]], dims: ParallelDims) -> PipelineView:
    """:attr:`PipeDream.checkpoint_view`, built from the pipeline's parts."""
    fields = _view_ranks(pipe.rank, pipe.world_size, pipe.group, groups.checkpoint, pipe.timeout,
                         [schedule.stage_ranks(j) for j in range(pipe.num_stages)], dims)
    return PipelineView(
        timeout=pipe.timeout, device=pipe.device, module=pipe.module,
        stages={j: stages[j] for j in pipe.local_stages}, stage_layers=pipe.stage_layers,
        model_shapes=model_shapes, shared_parameters=pipe.shared_parameters,
        split_points=pipe.split_points, schedule_name=pipe.schedule_name,
        microbatches=pipe.microbatches, chunks=pipe.chunks, balance=pipe.balance,
        replicas=pipe.replicas, asynchronous=pipe.asynchronous, **fields)


def _view_ranks(rank: int, world_size: int, group: Any, checkpoint: Any, timeout: float,
                stage_ranks: List[List[int]], dims: ParallelDims) -> Dict[str, Any]:
    """``PipelineView``'s ranks and groups: the pipeline's, or with a mesh every
    pipeline's (``ParallelDims.checkpoint_layout``)."""
    fields = dict(rank=rank, world_size=world_size, group=group, stage_ranks=stage_ranks,
                  checkpoint_group=checkpoint, data_parallel=None)
    if dims.on_mesh:
        fields.update(dims.checkpoint_layout(stage_ranks, timeout), data_parallel=dims.data_parallel)
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
