"""Runners: how a family of schedules is driven step by step.

One runner per family, chosen by the schedule's traits:

* :class:`FlushRunner` (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1``, ``zbv``,
  ``dualpipev``, ``interleaved-zb``): every
  ``step`` runs the rank's whole action list once (one batch, then a flush); the
  gradients of parameters shared by stages are summed over them (``_shared``);
  the user steps the optimizer; the batch loss is all-reduced to every rank.
* :class:`AsyncRunner` (``pipedream``, ``pipedream-2bw``): every ``step`` appends
  one minibatch's actions (``AsyncActionFeed``) to a long-lived executor and runs up
  to its forward; the runtime steps the optimizer at every ``U``; ``flush``
  drains the pipeline.

Both own their C++ executors (and release them at interpreter exit, before the
process group goes) and evaluate with ``forward_only`` on a GPipe list over one
replica per stage where their own list cannot (replicas, asynchronous schedules).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import schedules
from .._dist import collectives, faults
from .._dist.groups import PipelineGroups, RankNames, p2p_protocol
from .._extension import _C
from .._frontend import compiled
from .._frontend.local_stages import LocalStages
from .._parallel.data_parallel import DataParallel
from .._parallel.tensor_parallel import check_sequence_length
from . import optimizer_check
from .config import PipelineConfig
from .eval_outputs import check_output_batch_dim, merge_microbatch_outputs, microbatch_rows
from .grad_clip import GradientClipper, check_max_norm, check_norm_type
from .loss_reduction import no_tokens, returned_mismatch
from .mesh_steps import MeshSteps, PipelineSteps, StepMismatch
from .observe import Observer
from .overlap import PairCallback
from .stage_call import (
    NonFiniteError,
    StageFunction,
    StepCallback,
    StepContext,
    StepSettings,
    Targets,
    Tensors,
    as_tuple,
    check_batch,
    split_microbatches,
)
from .step_loss import StepLoss
from .tied_grads import SharedGradients

__all__ = ["Runner", "FlushRunner", "AsyncRunner", "make_runner"]

_log = logging.getLogger("pipedream_ext._pipe")

# Live runners, to release their C++ executors (which hold the process group) at
# interpreter exit: a process group destroyed during Python's finalization,
# after its creator's module state is gone, can abort the process ("terminate
# called without an active exception").
_LIVE: "weakref.WeakSet[Runner]" = weakref.WeakSet()


@atexit.register
def _release_executors_at_exit() -> None:
    for runner in list(_LIVE):
        runner.release()
    gc.collect()


class _OptimizerStep:
    """The executor's update callback: steps the optimizer of the current ``step``.

    A separate object (not a bound method of the runner) so that the executor,
    which holds it, does not hold the runner: no reference cycle through C++,
    which the cycle collector cannot see.

    Args:
        clip: clips the update's gradients first (``clip_grad_norm=``; collective:
            every rank updates as often, so every rank calls it); ``None``: no clipping.
    """

    def __init__(self, clip: Optional[Callable[[], Any]] = None) -> None:
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.clip = clip

    def __call__(self, stage: int, version: int) -> None:
        del stage, version  # one stage per rank: the optimizer holds exactly its parameters
        if self.clip is not None:  # after the replicas' all-reduce, before the step
            self.clip()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class Runner:
    """What the two families share: executors, evaluation, stats plumbing.

    Args:
        config: the checked arguments.
        schedule: the lowered schedule of this pipeline.
        stages: this rank's stages.
        groups: the pipeline's process groups.
        stage_fn: runs each forward; the executor calls it through a :class:`StepCallback`
            with the context of the call being run (:meth:`_context`).
        observer: stats and trace.
        device: the stages' device.
        data_parallel: data parallelism's policy, whose hooks the runner calls around
            each step (they do nothing with ``dp = 1``); on a mesh the batch loss is
            reduced over every rank.
        shared_gradients: sums the gradients of parameters shared by stages
            (flush schedules; ``None`` or empty: none).
        input_names: a traced model's named inputs, in the order the runner gets them
            (for messages), else ``None``.
    """

    def __init__(self, config: PipelineConfig, schedule: "schedules.Schedule",
                 stages: LocalStages, groups: PipelineGroups, stage_fn: StageFunction,
                 observer: Observer, device: torch.device, data_parallel: DataParallel,
                 shared_gradients: Optional[SharedGradients] = None,
                 input_names: Optional[List[str]] = None) -> None:
        self.config = config
        self.schedule = schedule
        self.stages = stages
        self.groups = groups
        self.stage_fn = stage_fn
        #: Targets and loss shares by microbatch, until their backward (``StepContext.targets``).
        self.targets = Targets(config.loss_reduction)
        #: What every call's StepContext starts from (``pipe.autocast``, ``pipe.grad_scaler()``,
        #: data parallelism's hook before each forward).
        self.settings = StepSettings(config.autocast, None, data_parallel.before_forward)
        # The executors' forward callback: stage_fn with the context bound for each call.
        self._forward = StepCallback(stage_fn)
        self.observer = observer
        self.device = device
        self.shared_gradients = shared_gradients
        self.data_parallel = data_parallel
        self.dims = dims = data_parallel.dims
        # The batch loss (and the end-of-step checks) over every pipeline of a mesh:
        # the dp ranks' losses, divided to the global batch's mean.
        self.step_group = dims.world_group
        self.loss_divisor = config.loss_reduction.divisor(dims.dp_size, dims.tp_size)
        #: How messages name ranks: on a mesh global ranks with their coordinates.
        self.names: RankNames = dims.names
        #: The batch loss's all-reduce; on a mesh it checks every step's ranks and batch sizes.
        self.steps = MeshSteps(self.names, dist.get_rank()) if dims.on_mesh else PipelineSteps()
        self.num_stages = schedule.num_stages
        self.steps_run = 0  # steps run (flush) or admitted (asynchronous), for messages
        #: A traced model's named inputs, in the order the runner gets them (for messages).
        self.input_names = input_names
        # With a mesh the norm covers every pipeline: the whole world, plain (replicated)
        # gradients counted on dp rank 0 only, FSDP shards on every rank.
        self.clipper = GradientClipper(
            stages, [schedule.stage_ranks(j) for j in range(self.num_stages)], groups.rank,
            self.step_group, device, config.timeout,
            shared_gradients.counted_elsewhere() if shared_gradients is not None else (),
            count_plain=dims.copy == 0, coordinates=dims.coordinates,
            name=self.names.of_group(groups.rank))
        # The clipper, not the runner: the executor holding the callback must not hold the runner.
        self._update = _OptimizerStep(None if config.clip_grad_norm is None else
                                      functools.partial(self.clipper.clip, *config.clip_grad_norm))
        self.executor: Optional["_C.PipelineExecutor"] = self._make_executor(
            schedule.lowered, overlap=config.overlap is not False)
        self._eval_executor: Optional["_C.PipelineExecutor"] = None
        _LIVE.add(self)

    def queue_sizes(self) -> Dict[str, int]:
        """The queues ``PipeDream.stats`` reports: targets held for their backward, the
        executor's list and its next action's index."""
        return {"held_targets": len(self.targets), "executor_actions": self.executor.size,
                "executor_position": self.executor.position}

    # -- executors ----------------------------------------------------------------
    def _make_executor(self, lowered: "_C.Schedule", rank: Optional[int] = None,
                       group: Optional[dist.ProcessGroup] = None,
                       side: Optional[dist.ProcessGroup] = None,
                       overlap: bool = False) -> "_C.PipelineExecutor":
        traits = schedules.traits(lowered.name)
        group = self.groups.group if group is None else group
        pair = None
        if overlap:  # dualpipev's F&B pairs made adjacent, run together (docs/runtime.md)
            lowered = _C.pair_forward_backward(lowered)
            if callable(self.config.overlap):
                pair = PairCallback(self.config.overlap, self._forward,
                                    {j: self.stages[j] for j in self.stages}, self.stage_fn.recompute)
        executor = _C.PipelineExecutor(
            lowered, self.groups.rank if rank is None else rank, group,
            self.groups.side if side is None else side, self.config.timeout,
            self._forward, self.stages.parameters_by_stage(), str(self.device),
            update=self._update if traits.stash_weights else None,
            replica_groups=self.groups.replica_groups, recompute=self.stage_fn.recompute,
            protocol=p2p_protocol(group, self.device, traits.streaming), overlap=overlap, pair=pair)
        # PIPEDREAM_LOG=debug (or a DEBUG level on this logger) logs every action.
        executor.action_logging = self.observer.tracing
        return executor

    def release(self) -> None:
        """Drops the executors (and their hold on the process group)."""
        self.executor = None
        self._eval_executor = None

    @property
    def is_first(self) -> bool:
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def _split(self, value: Tensors, what: str, count: int) -> List[Tuple[torch.Tensor, ...]]:
        return split_microbatches(value, count, self.device, what, self.input_names)

    def validate(self, call: str, inputs: Any, targets: Any) -> None:
        """Checks a call's arguments on this rank without running anything (what the
        call itself would refuse first), so the first calls can fail on every rank.

        Raises:
            ValueError: inputs or targets missing where needed, or a batch that cannot
                be cut into microbatches (``_stage_fn.check_batch``).
        """
        per_call = self.config.microbatches if call == "forward_only" else \
            self.config.microbatches_per_step
        self._require(inputs, self.is_first, "inputs", f"{call}()")
        if inputs is not None and self.is_first:
            check_batch(inputs, per_call, "inputs", self.input_names)
        if call == "step":
            self._require(targets, self.is_last, "targets")
            if targets is not None and self.is_last:
                check_batch(targets, per_call, "targets")
                if self.config.loss_reduction.counts_tokens:  # tokens_fn on these targets
                    self.targets.count(targets, per_call, self.device)
            self._check_dp_batch(inputs, targets)

    def _check_dp_batch(self, inputs: Any, targets: Any) -> None:
        """On a mesh: this rank's inputs and targets split into equal microbatches, and
        with tensor parallelism the inputs' sequence over tp."""
        if self.is_first:
            if self.dims.tp_enabled:
                check_sequence_length(self.dims.tensor_parallel, self.dims.tp_size, inputs)
            self.data_parallel.check_batch(inputs, self.config.microbatches, "inputs")
        if self.is_last:
            self.data_parallel.check_batch(targets, self.config.microbatches, "targets")

    def _run_executor(self, run: Callable[[], Any]) -> Any:
        """``run()`` (an executor call), its error naming ranks as :attr:`names` does: on a
        mesh the executor's numbers (its pipeline group's) become global ranks, and an
        error from the stages' Python (FSDP's collectives: Gloo names no rank) says which
        rank it is."""
        try:
            return run()
        except Exception as exc:
            if self.dims.on_mesh and exc.args and isinstance(exc.args[0], str):
                me = self.names.of_group(self.groups.rank)
                text = self.names.translate(exc.args[0])
                exc.args = (text if text.startswith(me) else f"{me}: {text}",) + tuple(exc.args[1:])
            raise

    def _require(self, value: Any, needed: bool, what: str, call: str = "step()") -> None:
        if needed and value is None:
            where = "stage 0" if what == "inputs" else "the last stage"
            raise ValueError(f"{self.names.of_group(self.groups.rank)} holds {where}: {call} "
                             f"needs the {what}")

    def _loss_in_background(self, value: Union[float, torch.Tensor], group: dist.ProcessGroup,
                            describe: Callable[[], str],
                            check: Optional[Callable[[torch.Tensor], None]] = None) -> StepLoss:
        """Starts summing ``value`` (the loss, or a vector starting with it) over ``group``;
        the StepLoss waits when read (and calls ``check`` on the sum), or at once while
        ``torch.profiler`` records this thread (:meth:`StepLoss.finish_reduction`).

        Raises:
            RuntimeError: the all-reduce could not start (``describe()`` says which).
        """
        try:
            total, work = collectives.all_reduce_start(value, group)
        except RuntimeError as exc:
            raise RuntimeError(f"{describe()} failed: {exc}") from exc
        loss = StepLoss(total, work, self.config.timeout, describe, check)
        if torch.autograd._profiler_enabled():  # noqa: SLF001 - torch has no public name for it
            # A collective the profiler recorded must not outlive it (benchmarks/README.md, "heap").
            loss.finish_reduction()
        return loss

    def _context(self, evaluating: bool = False) -> StepContext:
        """A new context for the call about to run (its step: the steps run so far)."""
        return self.settings.context(self.steps_run, self.targets, evaluating)

    def _finish_step(self) -> None:
        self.steps_run += 1
        self.observer.after_step(self.executor, self.steps_run - 1)

    # -- evaluation ------------------------------------------------------------------
    def _evaluates_on_leaders(self) -> bool:
        return any(r > 1 for r in self.schedule.replicas)

    def _evaluation_executor(self) -> Optional["_C.PipelineExecutor"]:
        """This rank's executor for ``forward_only``; ``None`` if it sits it out."""
        if not self._evaluates_on_leaders():
            return self.executor
        # Forwards of a plain GPipe list over one replica (the leader) of each stage,
        # on the live weights; the other replicas sit this out.
        leaders = self.groups.leaders
        if self.groups.rank not in leaders:
            return None
        if self._eval_executor is None:
            evaluation = schedules.build("gpipe", stages=self.num_stages,
                                         microbatches=self.config.microbatches)
            self._eval_executor = self._make_executor(
                evaluation.lowered, rank=leaders.index(self.groups.rank),
                group=self.groups.leader_group, side=self.groups.leader_side)
        return self._eval_executor

    def forward_only(self, inputs: Optional[Tensors], output_batch_dim: Any = 0,
                     restore: Optional[Callable[[Any], Any]] = None) -> Any:
        """Runs a batch forward without gradients; the outputs on the last stage's rank.

        One bounded all-reduce first brings stage 0's batch size to every rank (and
        fails every rank together if the batch cannot be cut); the last stage's
        outputs are then combined over microbatches (``eval_outputs``: tensors along
        ``output_batch_dim`` where it has each microbatch's rows, 0-d tensors as the
        rows-weighted mean; anything else refused). A failure on one rank after its
        part ran (combining the outputs; a stage's inputs whose placements disagree with
        its tensor-parallel plan) is raised on every rank: one flag all-reduce.

        Args:
            inputs: the batch (stage 0's ranks).
            output_batch_dim: the outputs' batch dimension, or ``None`` for the list of
                each microbatch's output.
            restore: turns the last stage's output into the model's own structure
                (a traced model's output spec), per microbatch, before combining.
        """
        executor = self._evaluation_executor()
        rows, chunks = self._cut_for_evaluation(inputs, executor is not None, output_batch_dim)
        result, error = None, None
        if executor is not None:
            with self._forward.bound(self._context(evaluating=True)) as context:
                outputs = self._run_executor(lambda: executor.run_forward([list(c) for c in chunks]))
            error = context.deferred_error
            if self.is_last and error is None:
                try:
                    per_microbatch = self.stage_fn.take_eval_outputs(context, outputs)
                    if restore is not None:
                        per_microbatch = [restore(out) for out in per_microbatch]
                    if per_microbatch:
                        result = merge_microbatch_outputs(per_microbatch, rows, output_batch_dim)
                except Exception as exc:  # noqa: BLE001 - reported to every rank
                    error = exc
        self.data_parallel.after_evaluation()
        self._agree_on_error(error, "forward_only()")
        return result

    def _cut_for_evaluation(self, inputs: Optional[Tensors], runs: bool, output_batch_dim: Any
                            ) -> Tuple[List[int], List[Tuple[torch.Tensor, ...]]]:
        """``forward_only``'s microbatches on stage 0 and every microbatch's rows on
        every rank (the last stage checks its outputs against them): one bounded
        all-reduce of stage 0's batch size and of a failure flag.

        Raises:
            ValueError: a bad ``output_batch_dim``, missing inputs, a batch that cannot
                be cut or a sequence length tp cannot split, on any rank (raised on every rank).
        """
        error: Optional[BaseException] = None
        chunks: List[Tuple[torch.Tensor, ...]] = []
        batch = 0
        try:
            self._require(inputs, self.is_first, "inputs", "forward_only()")
            check_output_batch_dim(output_batch_dim)
            if self.is_first and self.dims.tp_enabled:  # before Gloo's uneven all-gather
                check_sequence_length(self.dims.tensor_parallel, self.dims.tp_size, inputs)
            if runs and self.is_first:
                chunks = self._split(inputs, "inputs", self.config.microbatches)  # type: ignore[arg-type]
                batch = sum(c[0].shape[0] for c in chunks)
        except ValueError as exc:
            error = exc
        agreed = collectives.all_reduce_bounded(
            torch.tensor([float(batch), 1.0 if error is not None else 0.0], dtype=torch.float64),
            self.groups.group, dist.ReduceOp.MAX, self.config.timeout)
        if agreed[1].item():
            collectives.raise_if_any_failed(error, self.groups.group, self.config.timeout, "forward_only()")
        return microbatch_rows(int(agreed[0].item()), self.config.microbatches), chunks

    def _agree_on_error(self, error: Optional[BaseException], what: str) -> None:
        """Raises ``error`` on every rank if any rank has one (one flag all-reduce)."""
        failed = collectives.all_reduce([1.0 if error is not None else 0.0],
                                         self.groups.group)[0]
        if failed:
            collectives.raise_if_any_failed(error, self.groups.group, self.config.timeout, what,
                                            self.dims.world_names)

    # -- the family's contract -------------------------------------------------------------
    def clip_grad_norm(self, max_norm: Any, norm_type: Any, error_if_nonfinite: bool,
                       foreach: Optional[bool]) -> torch.Tensor:
        """``pd.clip_grad_norm_``: this family's gradients clipped by the pipeline's norm.

        Raises:
            ValueError: bad ``max_norm`` / ``norm_type``, or an asynchronous schedule.
        """
        return self.clipper.clip(check_max_norm(max_norm), check_norm_type(norm_type),
                                 bool(error_if_nonfinite), foreach)

    def step(self, inputs: Optional[Tensors], targets: Optional[Any],
             optimizer: Optional[torch.optim.Optimizer], call: int) -> Optional[float]:
        """One ``PipeDream.step``; ``call``: its number, calls that raised included (a
        mesh compares every rank's)."""
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    @property
    def peak_weight_versions(self) -> Dict[int, int]:
        return {}


class FlushRunner(Runner):
    """One batch per ``step``, flushed; the user steps the optimizer afterwards."""

    def step(self, inputs: Optional[Tensors], targets: Optional[Any],
             optimizer: Optional[torch.optim.Optimizer], call: int) -> Union[StepLoss, float]:
        """Runs forward and backward of one batch through the pipeline.

        Leaves on every local parameter the gradient of ``loss_fn(model(inputs),
        targets)`` of the unsplit model over the whole batch.

        Args:
            inputs: the batch (stage 0's ranks).
            targets: its targets (the last stage's ranks).
            optimizer: must be ``None`` (the user steps it after the flush).
            call: this ``step()`` call's number (a mesh compares every rank's).

        Returns:
            The batch's mean loss, on every rank, as a :class:`StepLoss` whose all-reduce
            finishes in the background (``nan`` for a skipped step).

        Raises:
            ValueError: an optimizer passed, inputs or targets missing where needed,
                or a batch smaller than ``microbatches``.
        """
        if optimizer is not None:
            raise ValueError(f"schedule {self.config.schedule!r} flushes every step: call "
                             "optimizer.step() yourself after pipe.step(x, y)")
        self.steps.check_before_step()  # on a mesh: the step before the last was in step everywhere
        self._require(inputs, self.is_first, "inputs")
        self._require(targets, self.is_last, "targets")
        self._check_dp_batch(inputs, targets)
        self._hold_targets(targets)
        self.data_parallel.before_step()
        context = self._context()
        loss_scale = context.loss_scale()
        losses = self._run_batch(inputs, context)
        self._check_returned_tokens(context)
        self._synchronize_gradients()
        self._finish_step()
        # Each last-stage replica holds the scaled losses of its microbatches.
        local = sum(float(l) for l in losses if l is not None) / loss_scale if self.is_last else 0.0
        self.steps.note_batch(inputs if self.is_first else None, targets if self.is_last else None)
        rows = int(as_tuple(inputs)[0].shape[0]) if self.is_first else None
        return self._batch_loss(context, local / self.loss_divisor, call, rows)

    def _hold_targets(self, targets: Any) -> None:
        """The last stage's targets, held by microbatch until their backward; with
        ``loss_reduction="tokens"`` divided by the batch's token count (every rank)."""
        if self.is_last:
            self.targets.clear()
        if self.config.loss_reduction.counts_tokens:  # on every rank, before anything runs
            self.targets.divide_by_tokens(self._batch_tokens(targets))
        elif self.is_last:
            self.targets.add(targets, self.config.microbatches, 0, self.device)

    def _run_batch(self, inputs: Optional[Tensors], context: StepContext) -> List[Optional[torch.Tensor]]:
        """The executor's run of this rank's action list over the batch's microbatches.

        Returns:
            The last stage's (scaled) loss of each microbatch (``None`` elsewhere).
        """
        chunks = self._split(inputs, "inputs", self.config.microbatches) if self.is_first else []
        # A split backward keeps the graph for W: compiled stages without donated buffers.
        split = compiled.split_backward_compiles() if self.config.traits.split_backward \
            else contextlib.nullcontext()
        with self._forward.bound(context), split:
            return self._run_executor(lambda: self.executor.run([list(c) for c in chunks]))

    def _check_returned_tokens(self, context: StepContext) -> None:
        """A loss that returned its token counts must match ``tokens_fn``'s: a mismatch is
        raised by every rank, as a bad loss is (:meth:`_batch_loss`)."""
        if context.returned_tokens and context.deferred_error is None:
            mismatch = returned_mismatch(self.targets.token_counts, context.returned_tokens)
            if mismatch is not None:  # raised by every rank, as a bad loss (_batch_loss)
                context.deferred_error = ValueError(mismatch)

    def _synchronize_gradients(self) -> None:
        """Every stage's last backward ran: gradients synchronised over dp once, then the
        gradients of parameters shared by stages summed (after the replicas' all-reduce
        inside the executor's run, before the user's ``opt.step()``).

        Raises:
            RuntimeError: an all-reduce failed or timed out, naming the ranks and step.
        """
        try:
            self.data_parallel.after_step()
        except RuntimeError as exc:  # Gloo names an address: say which ranks and step
            raise RuntimeError(
                f"{self.names.of_group(self.groups.rank)}: the gradient synchronisation over "
                f"mesh['dp'] ({self.dims.data_parallel}, with "
                f"{self.names.many([p[self.groups.rank] for p in self.dims.pipelines])}) in step "
                f"{self.steps_run} failed or timed out: {exc}") from exc
        if self.shared_gradients:
            try:
                start = time.perf_counter()
                self.shared_gradients.reduce()
                self.observer.record_wait("TIED_ALLREDUCE", time.perf_counter() - start)
            except RuntimeError as exc:
                raise RuntimeError(f"{self.names.of_group(self.groups.rank)}: the gradient "
                                   "all-reduce of shared "
                                   f"parameters in step {self.steps_run} failed or timed out: "
                                   f"{exc}") from exc

    def _batch_tokens(self, targets: Any) -> int:
        """``loss_reduction="tokens"``: the batch's token count, known to every rank before
        anything runs (one small all-reduce over the step's ranks per step).

        The last stages count their targets (``tokens_fn``, held in :attr:`targets`); the
        all-reduce sums them over the dp ranks, each dp part counted once (a replicated
        last stage and the tp ranks hold the same targets), and carries a failure flag,
        so a ``tokens_fn`` refused on one rank, or a batch without tokens, raises the
        same error on every rank and no rank is left waiting on another's forward.

        Raises:
            ValueError: ``tokens_fn`` refused on a rank (naming it), or 0 tokens in the
                whole batch; on every rank, with nothing run (gradients as before).
            RuntimeError: the all-reduce failed or timed out, naming the rank and step.
        """
        error: Optional[BaseException] = None
        local = 0.0
        if self.is_last:
            try:
                self.targets.add(targets, self.config.microbatches, 0, self.device)
                copies = len(self.schedule.stage_ranks(self.num_stages - 1)) * self.dims.tp_size
                local = self.targets.local_tokens() / copies
            except ValueError as exc:
                error = exc
        step = self.steps_run
        try:
            total = collectives.all_reduce_bounded(
                torch.tensor([local, 1.0 if error is not None else 0.0], dtype=torch.float64),
                self.step_group, dist.ReduceOp.SUM, self.config.timeout)
        except RuntimeError as exc:  # Gloo names an address: say which rank and step
            raise RuntimeError(
                f"{self.names.of_group(self.groups.rank)}: the all-reduce of the token count "
                f"before step {step} failed or timed out: {exc}") from exc
        if total[1] > 0:
            self.targets.clear()
            collectives.raise_if_any_failed(error, self.step_group, self.config.timeout,
                                            f"step() number {step}", self.dims.world_names)
        tokens = int(round(float(total[0])))
        if tokens == 0:  # every rank sees the same sum: all raise, none runs
            self.targets.clear()
            raise ValueError(f"step() number {step}: {no_tokens()}")
        return tokens

    def _batch_loss(self, context: StepContext, local: float, call: int, rows: Optional[int] = None
                    ) -> Union[StepLoss, float]:
        """The batch's mean loss on every rank: ``local`` summed over the group.

        The first ``check_agreement`` steps (and every step with ``check_finite``) wait
        for the all-reduce, which also carries a bad loss found on one rank (raised on
        every rank before anybody's optimizer steps). Later steps only start it: a
        :class:`StepLoss` waits when read; a bad loss then raises on its rank alone and
        its peers fail naming that rank when they next need it. On a mesh the all-reduce
        also carries every rank's call and every dp rank's ``rows`` (``MeshSteps``).

        Args:
            context: the step's context (a bad loss it found, where NaN/inf appeared).
            local: this rank's share of the loss.
            call: this ``step()`` call's number.
            rows: the batch's rows on stage 0's rank, else ``None``.
        """
        rank, step = self.names.of_group(self.groups.rank), self.steps_run - 1
        describe = lambda: f"{rank}: the all-reduce of the batch loss after step {step}"  # noqa: E731
        deferred = context.deferred_error
        steps = self.steps
        if step < self.config.check_agreement or self.config.check_finite:
            values = steps.values(local, deferred is not None, call, rows)
            try:
                total = collectives.all_reduce_bounded(values, self.step_group, dist.ReduceOp.SUM,
                                                       self.config.timeout)
            except RuntimeError as exc:  # Gloo names an address; say which rank and step
                raise RuntimeError(f"{describe()} failed or timed out: {exc}") from exc
            try:
                steps.check(total)
            except StepMismatch:
                self._drop_gradients()
                raise
            if total[1] > 0:
                self._drop_gradients()  # the zero loss's gradients: not the model's
                collectives.raise_if_any_failed(deferred, self.step_group, self.config.timeout,
                                                 f"step() number {step}", self.dims.world_names)
            if self.config.check_finite and self._check_finite_step(context):
                return float("nan")
            return StepLoss.of(float(total[0]))
        if deferred is not None:
            self._drop_gradients()
            raise deferred
        values, check = steps.in_background(local, call, rows)
        return steps.track(self._loss_in_background(values, self.step_group, describe, check))

    def _drop_gradients(self) -> None:
        """Sets every local gradient to ``None`` (a step whose gradients are not the model's)."""
        for t in self.stages.module.parameters():
            t.grad = None

    def flush(self) -> None:
        """Nothing to drain: every step ends flushed."""

    def _check_finite_step(self, context: StepContext) -> bool:
        """Agrees on every rank where non-finite values first appeared this step
        (``context``: the step's, which holds the first non-finite forward output found here).

        Returns:
            True when the step was skipped (``check_finite="skip"``).

        Raises:
            NonFiniteError: ``check_finite="raise"`` and a NaN or inf was found.
        """
        p = self.num_stages
        forward = context.nonfinite_forward
        forward = p if forward is None else forward
        backward = -1
        if context.grad_scaler is None:  # with loss scaling, overflows are the scaler's
            for j in self.stages:
                if any(t.grad is not None and not bool(torch.isfinite(_local(t.grad)).all())
                       for t in self.stages.parameters_of(j)):
                    backward = max(backward, j)
        flags = collectives.all_reduce([-forward, backward], self.step_group,
                                        op=dist.ReduceOp.MAX, dtype=torch.int64)
        forward, backward = int(-flags[0]), int(flags[1])
        if forward == p and backward < 0:
            return False
        layers = self.stages.partition.layer_range
        if forward < p:
            where = (f"the {'loss' if forward == p - 1 else 'forward output'} of stage {forward} "
                     f"(layers {layers(forward)})")
        else:
            where = f"the gradients of stage {backward} (layers {layers(backward)}) in the backward"
        message = f"step {self.steps_run - 1}: NaN or inf first appeared in {where}"
        if self.config.check_finite == "raise":
            raise NonFiniteError(message)
        _log.warning("%s; skipping the step (gradients set to None)", message)
        for t in self.stages.module.parameters():
            t.grad = None
        return True


class AsyncRunner(Runner):
    """Asynchronous PipeDream: minibatches flow through one long-lived executor.

    Args:
        feed: the schedule's per-step action source (``_C.AsyncActionFeed``).
        (the rest as :class:`Runner`)
    """

    def __init__(self, feed: "_C.AsyncActionFeed", *args: Any, **kwargs: Any) -> None:
        self.feed = feed
        self.admitted = 0  # minibatches (2bw: batches) admitted since the last flush
        self._peak_weight_versions: Dict[int, int] = {}
        super().__init__(*args, **kwargs)
        self._unflushed = faults.watch_unflushed()  # an exit without flush() is named

    @property
    def peak_weight_versions(self) -> Dict[int, int]:
        """Most weight versions held per local stage, as of the last flush."""
        return self._peak_weight_versions

    def _evaluates_on_leaders(self) -> bool:
        return True  # the feed's list has no forward-only form

    def clip_grad_norm(self, max_norm: Any, norm_type: Any, error_if_nonfinite: bool,
                       foreach: Optional[bool]) -> torch.Tensor:
        raise ValueError(f"schedule {self.config.schedule!r} steps the optimizer inside the pipeline, "
                         "after pd.clip_grad_norm_ could run; clip there instead: PipeDream(..., "
                         f"clip_grad_norm={max_norm!r}) (or (max_norm, norm_type)) clips every update")

    def forward_only(self, inputs: Optional[Tensors], output_batch_dim: Any = 0,
                     restore: Optional[Callable[[Any], Any]] = None) -> Any:
        self._require(inputs, self.is_first, "inputs", "forward_only()")
        if self.admitted:
            raise RuntimeError(f"{self.admitted} minibatches are still in the pipeline; call "
                               "pipe.flush() before forward_only()")
        return super().forward_only(inputs, output_batch_dim, restore)

    def step(self, inputs: Optional[Tensors], targets: Optional[Any],
             optimizer: Optional[torch.optim.Optimizer], call: int) -> Optional[float]:
        """Admits one minibatch (2bw: one batch of ``microbatches``) into the pipeline.

        Runs this rank's actions up to the forward of that minibatch: the backwards
        and updates of earlier minibatches that come first, then its forward.
        Weight stashing keeps every backward on the version its forward read.

        Returns:
            On the rank of the last stage, the loss of the minibatch (2bw: batch)
            whose forward just completed there (with a replicated last stage: on
            the replica that ran it; 2bw: on every last-stage replica); ``None`` on
            other ranks and while the pipeline fills. Losses are not broadcast so
            that ranks never wait for each other per step.

        Raises:
            ValueError: no optimizer, or inputs/targets missing where needed.
        """
        del call  # no mesh with asynchronous schedules (check_schedule)
        if optimizer is None and any(True for _ in self.stages.module.parameters()):
            raise ValueError(f"schedule {self.config.schedule!r} updates weights inside the "
                             "pipeline: pass your optimizer, pipe.step(x, y, optimizer=opt)")
        if optimizer is not None:  # before anything runs, rather than in the first update
            optimizer_check.check(optimizer)
        self._update.optimizer = optimizer
        per_step = self.config.microbatches_per_step
        first = self.admitted * per_step
        self._require(inputs, self.is_first, "inputs")
        self._require(targets, self.is_last, "targets")
        inputs_by_microbatch: Dict[int, List[torch.Tensor]] = {}
        if self.is_first:
            chunks = self._split(inputs, "inputs", per_step)
            inputs_by_microbatch = {first + i: list(c) for i, c in enumerate(chunks)}
        if self.is_last:
            self.targets.add(targets, per_step, first, self.device)
        self.executor.append_actions(self.feed.step_actions(self.groups.rank, self.admitted))
        # Raised at once (raise_at_once): nothing found is read back from the context.
        with self._forward.bound(self._context()):
            losses = self.executor.run_until(self.executor.size, inputs_by_microbatch)
        self.admitted += 1
        self._unflushed[0] = self.admitted
        self._finish_step()
        # Targets stay until their backward (a recomputed forward needs them):
        # at most 2 pipeline depths of steps behind.
        self.targets.drop_before(first - 2 * (self.groups.world_size + 1) * per_step)
        return self._step_loss(losses, per_step) if self.is_last else None

    def _step_loss(self, losses: Dict[int, torch.Tensor], per_step: int
                   ) -> Union[StepLoss, float, None]:
        total = float(sum(float(l) for l in losses.values()))
        last_group = self.groups.replica_groups.get(self.num_stages - 1)
        if per_step > 1 and last_group is not None:
            # The step's microbatches are split over the last stage's replicas: their
            # sum finishes in the background; reading the loss waits for it.
            rank, step = self.groups.rank, self.admitted - 1
            describe = lambda: (f"rank {rank}: the all-reduce of the batch loss among the last "  # noqa: E731
                                f"stage's replicas after step {step}")
            return self._loss_in_background(total, last_group, describe)
        return total if losses else None

    def flush(self) -> None:
        """Drains the pipeline: every admitted minibatch finishes its backward and update.

        Raises:
            ValueError: replicated stages whose round of minibatches is incomplete.
        """
        if self.admitted == 0:
            return
        period = self.feed.period
        if self.admitted % period:
            raise ValueError(
                f"replicated stages {self.schedule.replicas} take minibatches in rounds of "
                f"{period}; flush after a multiple of {period} steps (now {self.admitted})")
        self.executor.append_actions(self.feed.drain_actions(self.groups.rank, self.admitted))
        with self._forward.bound(self._context()):  # recompute=True: backwards run forwards again
            self.executor.run_until(self.executor.size, {})
        self.executor.wait_sends()
        self._peak_weight_versions = dict(self.executor.stats().peak_weight_versions)
        # The next admitted minibatch starts from version 0 = the current live weights.
        self.targets.clear()
        self.admitted = 0
        self._unflushed[0] = 0
        self.observer.retire(self.executor)
        self.executor = self._make_executor(self.schedule.lowered)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (a sharded DTensor's local shard under FSDP)."""
    return t.to_local() if hasattr(t, "to_local") else t


def make_runner(config: PipelineConfig, schedule: "schedules.Schedule",
                feed: Optional["_C.AsyncActionFeed"], *args: Any, **kwargs: Any) -> Runner:
    """The runner of ``config``'s schedule family (``feed`` for streaming schedules)."""
    if config.traits.streaming:
        return AsyncRunner(feed, config, schedule, *args, **kwargs)
    return FlushRunner(config, schedule, *args, **kwargs)
