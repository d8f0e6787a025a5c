"""The stage function: the one call the C++ executor makes into Python for compute.

Owns what happens inside ``F(j, i)``: running stage ``j``'s layers on microbatch
``i``'s inputs (on a stashed weight version when the executor passes one),
autocast, the loss on the last stage (scaled by the microbatch's share of the
batch, and by the loss scaler when there is one) and the finite check of every
output. Also owns the targets the loss needs (``Targets``) and how a batch is
split into microbatches (``split_microbatches``).

What one runner call sets and what its forwards find travel in a per-call
``StepContext`` (made by the runner from its ``StepSettings``, bound to the
executor's callback for the call: ``StepCallback``); ``StageFunction`` itself
holds only what is fixed at construction.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn

from .._frontend.local_stages import LocalStages
from .aux_loss import aux_loss_scale
from .loss_reduction import LossReduction, MeanLoss, no_tokens

if TYPE_CHECKING:
    from .._parallel.tensor_parallel import CutLayouts

__all__ = ["NonFiniteError", "Tensors", "as_tuple", "check_batch", "split_microbatches", "Targets",
           "StepContext", "StepSettings", "StepCallback", "StageFunction"]

_log = logging.getLogger(__name__)

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


#: Where a tensor leaf of an evaluation output was (the executor returns the tensors).
_TENSOR = object()


class NonFiniteError(RuntimeError):
    """NaN or inf appeared in a stage's output or gradients (``check_finite="raise"``)."""


def as_tuple(value: Tensors) -> Tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def check_batch(value: Tensors, count: int, what: str,
                names: Optional[Sequence[str]] = None) -> None:
    """Checks that a batch can be cut into ``count`` microbatches on dim 0.

    Args:
        value: the batch (tensor or tuple of tensors).
        count: microbatches.
        what: ``"inputs"`` or ``"targets"``, for messages.
        names: the tensors' names (a traced model's named inputs), for messages.

    Raises:
        ValueError: a value that is not a tensor, a tensor without the batch dimension
            (0-d, or a dim 0 other than the first tensor's: a memory bank the same for
            every row), naming it; or a batch smaller than ``count``.
    """
    tensors = as_tuple(value)

    def label(k: int) -> str:
        return f"{what} {k}" + (f" ({names[k]!r})" if names and k < len(names) else "")

    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{label(k)} is a {type(t).__name__}, not a tensor; a batch is a tensor "
                             "or a tuple of tensors (fix other arguments with concrete_args)")
    batch = tensors[0].shape[0] if tensors[0].dim() > 0 else None
    for k, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] != batch:
            rows = "is 0-dimensional" if t.dim() == 0 else f"has {t.shape[0]} rows in dim 0"
            raise ValueError(
                f"{label(k)} {rows} but the batch has {batch} rows ({label(0)}: "
                f"{tuple(tensors[0].shape)}); every {what[:-1]} is cut into microbatches along dim "
                "0, so each needs the batch dimension first. A tensor that is the same for every "
                "row (a memory bank, a table) belongs in the model: register it as a buffer or "
                "parameter, or expand it along a batch dimension")
    if batch < count:
        raise ValueError(f"{what} has batch size {batch}, smaller than microbatches="
                         f"{count}; use a batch of at least {count}")


def split_microbatches(value: Tensors, count: int, device: torch.device,
                       what: str, names: Optional[Sequence[str]] = None
                       ) -> List[Tuple[torch.Tensor, ...]]:
    """Splits a batch (tensor or tuple of tensors) into ``count`` parts on dim 0.

    Raises:
        ValueError: what :func:`check_batch` refuses.
    """
    check_batch(value, count, what, names)
    parts = [torch.tensor_split(t.to(device), count, dim=0) for t in as_tuple(value)]
    return [tuple(p[i] for p in parts) for i in range(count)]


class Targets:
    """Targets and loss scales by microbatch id, kept until the backward that needs
    them (a recomputed forward computes the loss again).

    Args:
        loss_reduction: each microbatch's share of the loss and its token count
            (``LossReduction.shares``, ``LossReduction.count_tokens``); default :class:`MeanLoss`.
    """

    def __init__(self, loss_reduction: Optional[LossReduction] = None) -> None:
        self._by_microbatch: Dict[int, Tuple[Any, float]] = {}
        self.loss_reduction = loss_reduction if loss_reduction is not None else MeanLoss()
        #: A token mean's: each held microbatch's token count (``tokens_fn`` of its targets).
        self.token_counts: Dict[int, int] = {}
        #: A token mean's: what the losses are divided by (:meth:`divide_by_tokens`).
        self.total_tokens: Optional[int] = None

    def add(self, targets: Any, count: int, first: int, device: torch.device) -> None:
        """Splits ``targets`` into ``count`` microbatches numbered from ``first``; each
        one's scale is its share of the batch (``LossReduction.shares``: a mean's rows, else
        1, a token mean's until :meth:`divide_by_tokens`).

        Raises:
            ValueError: what :func:`check_batch` refuses; what the reduction's
                ``count_tokens`` refuses.
        """
        chunks = [c[0] if len(c) == 1 else c
                  for c in split_microbatches(targets, count, device, "targets")]
        counts = self.loss_reduction.count_tokens(chunks)
        if counts is not None:
            self.token_counts.update({first + i: n for i, n in enumerate(counts)})
        shares = self.loss_reduction.shares([as_tuple(c)[0].shape[0] for c in chunks])
        for i, (c, share) in enumerate(zip(chunks, shares)):
            self._by_microbatch[first + i] = (c, share)

    def count(self, targets: Any, count: int, device: torch.device) -> Optional[List[int]]:
        """A token mean's token count of each of ``count`` microbatches of ``targets``,
        without holding them (the first calls' check on every rank); ``None`` for a
        reduction that counts no tokens.

        Raises:
            ValueError: what :meth:`add` refuses.
        """
        chunks = split_microbatches(targets, count, device, "targets")
        return self.loss_reduction.count_tokens([c[0] if len(c) == 1 else c for c in chunks])

    def local_tokens(self) -> int:
        """The tokens of the microbatches held (this rank's part of the batch)."""
        return sum(self.token_counts.values())

    def divide_by_tokens(self, total: int) -> None:
        """Every held microbatch's loss becomes ``loss_sum / total`` (``total``: the
        batch's token count over every dp rank; 0 is refused on every rank before the
        step runs, ``FlushRunner._batch_tokens``; the loss refuses it too,
        :meth:`StageFunction._loss`)."""
        self.total_tokens = total
        share = 1.0 / total if total else 0.0
        for i, (target, _) in self._by_microbatch.items():
            self._by_microbatch[i] = (target, share)

    def __getitem__(self, microbatch: int) -> Tuple[Any, float]:
        return self._by_microbatch[microbatch]

    def __len__(self) -> int:
        return len(self._by_microbatch)

    def drop_before(self, microbatch: int) -> None:
        for i in [i for i in self._by_microbatch if i < microbatch]:
            del self._by_microbatch[i]
            self.token_counts.pop(i, None)

    def clear(self) -> None:
        self._by_microbatch.clear()
        self.token_counts.clear()
        self.total_tokens = None


@dataclasses.dataclass
class StepContext:
    """One ``step()``, ``flush()`` or ``forward_only()`` call as its forwards see it.

    The runner makes one per call (:meth:`StepSettings.context`), binds it to the
    executor's callback for that call (:class:`StepCallback`), and reads back what the
    forwards found once the executor returns. Nothing in it outlives the call but the
    ``targets`` store, which is the runner's.

    Attributes:
        step_index: the step being run (steps finished before this call), for messages.
        targets: targets and loss shares by microbatch; the runner's store, since on an
            asynchronous schedule a microbatch's targets outlive the call that added
            them (a recomputed forward before its backward computes the loss again).
        evaluating: ``forward_only``: the last stage returns the model's outputs, not a loss.
        autocast: compute dtype under ``torch.autocast``, or ``None``.
        grad_scaler: scales the last stage's loss (``pipe.grad_scaler()``), or ``None``.
        before_forward: ``before_forward(stage, microbatch, training)`` before each forward
            (a mesh's data parallelism: whether FSDP reshards after it,
            ``sharding.FsdpStages``), or ``None``.
        nonfinite_forward: found: the first stage whose forward output held NaN/inf, or ``None``.
        deferred_error: found: a bad loss (flush schedules; the loss was replaced by a zero
            connected to the graph), or a stage's input whose placement disagrees with
            its plan (the forward went on with zeros in the declared layout), so the
            step ends on every rank, which then raise it.
        eval_structure: found in evaluation on the last stage: per microbatch, the output's
            structure and its leaves that are not tensors (the executor returns the tensors).
        returned_tokens: found with ``loss_reduction="tokens"``: the ``n_tokens`` each
            microbatch's ``loss_fn`` returned (checked against the targets' count after
            the step, ``loss_reduction.returned_mismatch``).
    """

    step_index: int
    targets: Targets
    evaluating: bool = False
    autocast: Optional[torch.dtype] = None
    grad_scaler: Optional[Any] = None
    before_forward: Optional[Callable[[int, int, bool], None]] = None
    nonfinite_forward: Optional[int] = None
    deferred_error: Optional[ValueError] = None
    eval_structure: Dict[int, Tuple[Any, List[Any]]] = dataclasses.field(default_factory=dict)
    returned_tokens: Dict[int, Any] = dataclasses.field(default_factory=dict)

    def loss_scale(self) -> float:
        """The factor the last stage's losses carry (the scaler's scale, else 1)."""
        return float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0


@dataclasses.dataclass
class StepSettings:
    """What the runner copies into every call's :class:`StepContext`: settings that hold
    from one step to the next until changed.

    Attributes:
        autocast: ``pipe.autocast`` (``PipeDream(autocast=...)`` until set).
        grad_scaler: the scaler ``pipe.grad_scaler()`` attached, or ``None``.
        before_forward: data parallelism's hook (``DataParallel.before_forward``), or ``None``.
    """

    autocast: Optional[torch.dtype] = None
    grad_scaler: Optional[Any] = None
    before_forward: Optional[Callable[[int, int, bool], None]] = None

    def context(self, step_index: int, targets: Targets, evaluating: bool = False) -> StepContext:
        """A new call's context with these settings."""
        return StepContext(step_index, targets, evaluating, self.autocast, self.grad_scaler,
                           self.before_forward)


class StepCallback:
    """The executor's forward callback: :class:`StageFunction` with the bound call's context.

    The executor keeps its callback for its whole life while each call has its own
    context, so the runner binds the call's context here for the length of the call
    (:meth:`bound`). A separate object (not a bound method of the runner) so that the
    executor, which holds it, does not hold the runner: no reference cycle through C++.

    Args:
        stage_fn: what runs the forward.
    """

    def __init__(self, stage_fn: "StageFunction") -> None:
        self.stage_fn = stage_fn
        self._context: Optional[StepContext] = None

    @contextlib.contextmanager
    def bound(self, context: StepContext) -> Iterator[StepContext]:
        """Every forward run inside the ``with`` block gets ``context``."""
        self._context = context
        try:
            yield context
        finally:
            self._context = None

    def __call__(self, stage: int, microbatch: int, inputs: List[torch.Tensor],
                 weights: List[torch.Tensor]) -> List[torch.Tensor]:
        if self._context is None:
            raise RuntimeError(f"the executor ran the forward of stage {stage}, microbatch "
                               f"{microbatch} outside a runner's call (no StepContext bound)")
        return self.stage_fn(self._context, stage, microbatch, inputs, weights)


class StageFunction:
    """``forward(context, stage, microbatch, inputs, weights) -> outputs`` for the executor
    (through :class:`StepCallback`, which passes the call's :class:`StepContext`).

    On the last stage the output is ``[loss * share]`` (a scalar) in training and
    the model's outputs in evaluation (``context.evaluating``). Holds only what is
    fixed at construction; what a call sets or finds is in its context.

    Args:
        stages: this rank's stages.
        loss_fn: ``loss_fn(output, target)`` with mean reduction.
        num_stages: stages in the whole pipeline.
        device: the stages' device.
        check_finite: record (``"skip"``/``"raise"``) the first stage whose output is
            not finite; ``raise_at_once`` raises :class:`NonFiniteError` right there.
        raise_at_once: raise in the callback instead of after the step
            (asynchronous schedules, which have no end of step to agree at).
        recompute: this rank's stages recompute (``PipelineConfig.rank_recomputes``):
            the executor runs each training forward twice, first without autograd, then
            again (with it) before the backward; the second run must not update running
            statistics a second time (see :meth:`_run_again`).
        loss_reduction: what ``loss_fn`` returns and how it reduces over a batch (checked
            on the first microbatch, ``LossReduction.check_reduction``); default
            :class:`MeanLoss`.
        rank_name: how messages name this rank (default ``"rank {rank}"``).
        cuts: with ``tensor_parallel``: what crosses a cut (a ``DTensor`` as its local
            shard, wrapped back on the receiving stage by its published ``CutLayout``), else ``None``.
        aux_weight: what one microbatch's aux losses weigh (``aux_loss.add_aux_loss``),
            times the grad scaler's scale: set around every training forward.
    """

    def __init__(self, stages: LocalStages, loss_fn: Callable[..., torch.Tensor],
                 num_stages: int, device: torch.device,
                 check_finite: Optional[str], raise_at_once: bool, rank: int,
                 recompute: bool = False,
                 loss_reduction: Optional[LossReduction] = None,
                 rank_name: Optional[str] = None, cuts: Optional["CutLayouts"] = None,
                 aux_weight: float = 1.0) -> None:
        self.stages = stages
        self.aux_weight = aux_weight
        self.cuts = cuts
        self.loss_fn = loss_fn
        self.num_stages = num_stages
        self.device = device
        self.check_finite = check_finite
        self.raise_at_once = raise_at_once
        self.rank = rank
        #: How messages name this rank (on a mesh: its global rank and coordinates).
        self.rank_name = rank_name if rank_name is not None else f"rank {rank}"
        self.recompute = recompute
        self.loss_reduction = loss_reduction if loss_reduction is not None else MeanLoss()
        #: Whether the loss's reduction over the batch is still to be checked (once per
        #: pipeline, on the first microbatch whose loss is computed).
        self.reduction_unchecked = True

    def __call__(self, context: StepContext, stage: int, microbatch: int,
                 inputs: List[torch.Tensor], weights: List[torch.Tensor]) -> List[torch.Tensor]:
        # With recompute the first forward runs without autograd; a forward with it
        # in training is the recomputation before the backward.
        again = self.recompute and torch.is_grad_enabled() and not context.evaluating
        run = self._run_again if again else self._run
        if context.before_forward is not None:
            context.before_forward(stage, microbatch, not context.evaluating)
        with aux_loss_scale(0.0 if context.evaluating else self.aux_weight, context.grad_scaler):
            if context.autocast is None:
                outputs = run(context, stage, microbatch, inputs, weights)
            else:
                with torch.autocast(device_type=self.device.type, dtype=context.autocast):
                    outputs = run(context, stage, microbatch, inputs, weights)
        if self.check_finite and not context.evaluating:
            self._check_finite(context, stage, microbatch, outputs)
        return outputs

    def _check_finite(self, context: StepContext, stage: int, microbatch: int,
                      outputs: Sequence[torch.Tensor]) -> None:
        if all(bool(torch.isfinite(t).all()) for t in outputs if t.is_floating_point()):
            return
        if context.nonfinite_forward is None or stage < context.nonfinite_forward:
            context.nonfinite_forward = stage
        if self.raise_at_once:
            raise NonFiniteError(
                f"{self.rank_name}: step {context.step_index}: the "
                f"{'loss' if stage == self.num_stages - 1 else 'forward output'} of stage "
                f"{stage} (layers {self.stages.partition.layer_range(stage)}), microbatch "
                f"{microbatch}, holds NaN or inf")

    def _run(self, context: StepContext, stage: int, microbatch: int,
             inputs: List[torch.Tensor], weights: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.cuts is not None and stage > 0:
            inputs, problem = self.cuts.receive(stage, inputs)
            if problem is not None:
                self._defer(context, problem)
        # nn.Sequential semantics: a tuple output reaches the next layer as one tuple.
        arg = inputs[0] if len(inputs) == 1 else tuple(inputs)
        if weights:  # a stashed weight version: run the stage functionally on it
            named = dict(zip(self.stages.parameter_names(stage), weights))
            out = torch.func.functional_call(self.stages[stage], named, (arg,))
        else:
            out = self.stages[stage](arg)
        if stage == self.num_stages - 1:
            if self.cuts is not None:
                self.cuts.refuse_at_end(stage, out)
            if not context.evaluating:
                return [self._loss(context, out, microbatch)]
            return self._flatten_output(context, out, microbatch)
        return self._stage_output(stage, out)

    def _stage_output(self, stage: int, out: Any) -> List[torch.Tensor]:
        """A stage's output as the tensors sent to the next stage.

        Raises:
            ValueError: the stage returned something other than a tensor or a tuple
                (list) of tensors, naming the stage and the type.
        """
        values = as_tuple(out)
        bad = next((v for v in values if not isinstance(v, torch.Tensor)), None) \
            if isinstance(out, (tuple, list, torch.Tensor)) else out
        if bad is not None or out is None:
            kind = "None" if out is None else f"a {type(out).__name__}" \
                if not isinstance(out, (tuple, list)) else \
                f"a {type(out).__name__} holding a {type(bad).__name__}"
            raise ValueError(
                f"{self.rank_name}: stage {stage} (layers {self.stages.partition.layer_range(stage)})"
                f" returned {kind}; a stage before the last must return a tensor or a tuple of "
                "tensors (they are sent to the next stage): return the tensors (e.g. "
                "out['hidden'] instead of the dict), or give the model as a traced module "
                "(split_points=...), which passes any values between its stages")
        return list(values) if self.cuts is None else self.cuts.send(stage, values)

    def _flatten_output(self, context: StepContext, out: Any, microbatch: int
                        ) -> List[torch.Tensor]:
        """The last stage's evaluation output as its tensors; its structure and other
        leaves are kept in ``context`` for :meth:`take_eval_outputs`."""
        leaves, spec = pytree.tree_flatten(out)
        context.eval_structure[microbatch] = (spec, [_TENSOR if isinstance(v, torch.Tensor) else v
                                                  for v in leaves])
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    def take_eval_outputs(self, context: StepContext, outputs: Sequence[Sequence[torch.Tensor]]
                          ) -> List[Any]:
        """Each microbatch's output of the last stage, rebuilt from the executor's tensors
        and the structure :meth:`_flatten_output` kept in ``context`` (``eval_outputs``
        combines them).

        Returns:
            The outputs in microbatch order (empty: this rank ran no last stage).

        Raises:
            ValueError: microbatches returned different structures.
        """
        microbatches = sorted(i for i, o in enumerate(outputs) if i in context.eval_structure)
        structures = [context.eval_structure.pop(i) for i in microbatches]
        context.eval_structure.clear()
        if any(s != structures[0][0] for s, _ in structures):
            raise ValueError(f"{self.rank_name}: the last stage returned different structures for "
                             "the microbatches of one batch; its output's structure must not "
                             "depend on the data")
        per_microbatch = []
        for i, (spec, leaves) in zip(microbatches, structures):
            tensors = iter(outputs[i])
            per_microbatch.append(pytree.tree_unflatten([next(tensors) if v is _TENSOR else v
                                                         for v in leaves], spec))
        return per_microbatch

    def _run_again(self, context: StepContext, stage: int, microbatch: int,
                   inputs: List[torch.Tensor], weights: List[torch.Tensor]) -> List[torch.Tensor]:
        """A recomputed forward: BatchNorm layers in training mode normalise with the
        batch's statistics as before but do not move their running statistics again
        (momentum 0 for this call, ``num_batches_tracked`` put back), so those advance
        once per microbatch, as in the unsplit model.

        Raises:
            ValueError: another buffer changed in the recomputed forward (it would
                change twice per microbatch), naming it.
        """
        module = self.stages[stage]
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)  # noqa: SLF001 - torch internal
                 and m.training and m.track_running_stats]
        held = {id(b) for m in norms for b in m.buffers(recurse=False) if b is not None}
        versions = [(name, b, b._version) for name, b in module.named_buffers()  # noqa: SLF001 - torch internal
                    if id(b) not in held]
        momenta = [m.momentum for m in norms]
        try:
            for m in norms:
                m.momentum = 0.0  # running = running * 1 + batch * 0: unchanged, exactly
            outputs = self._run(context, stage, microbatch, inputs, weights)
        finally:
            for m, momentum in zip(norms, momenta):
                m.momentum = momentum
        with torch.no_grad():
            for m in norms:
                if m.num_batches_tracked is not None:
                    m.num_batches_tracked.sub_(1)
        changed = [name for name, b, version in versions if b._version != version]  # noqa: SLF001 - torch internal
        if changed:
            raise ValueError(
                f"recompute=True runs stage {stage}'s forward twice per microbatch, and it "
                f"updates buffer {changed[0]!r} in place, which would then change twice "
                "(BatchNorm statistics are handled; this buffer is not): use recompute=False")
        return outputs

    def _loss(self, context: StepContext, out: Any, microbatch: int) -> torch.Tensor:
        target, share = context.targets[microbatch]
        loss, problem = self._reduced_loss(context, out, target, microbatch)
        if problem is None and self.reduction_unchecked:
            self.reduction_unchecked = False
            problem = self.loss_reduction.check_reduction(self.loss_fn, out, target, loss)
        if problem is not None:
            # Found on this rank only: the step ends with a zero loss (zero gradients) on
            # every rank, which then raise it together (FlushRunner.step).
            self._defer(context, problem)
            return _zero_loss(out)
        loss = loss.float() * share
        if context.grad_scaler is not None:
            loss = context.grad_scaler.scale(loss)
        return loss

    def _reduced_loss(self, context: StepContext, out: Any, target: Any, microbatch: int
                      ) -> Tuple[Any, Optional[str]]:
        """The loss the reduction reads in ``loss_fn``'s value (a token mean's ``n_tokens``
        kept in ``context``), or what is wrong: the value, or a batch without tokens."""
        if context.targets.total_tokens == 0:  # refused before the step too (_batch_tokens)
            return None, no_tokens()
        read = self.loss_reduction.read(self.loss_fn(out, target))
        if read.n_tokens is not None:
            context.returned_tokens[microbatch] = read.n_tokens
        return read.loss, read.problem

    def _defer(self, context: StepContext, problem: str) -> None:
        """Keeps ``problem`` for the end of the call, when every rank raises it
        (``context.deferred_error``), or raises it now (``raise_at_once``).

        Raises:
            ValueError: ``problem``, with ``raise_at_once``.
        """
        if self.raise_at_once:
            raise ValueError(f"{self.rank_name}: step {context.step_index}: {problem}")
        if context.deferred_error is None:
            context.deferred_error = ValueError(problem)


def _zero_loss(out: Any) -> torch.Tensor:
    """A zero loss on the graph of ``out`` (every floating output, times 0): the backward
    still runs and sends zero gradients, so the step ends on every rank."""
    parts = [t.sum() * 0.0 for t in pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not parts:
        return torch.zeros((), requires_grad=True)
    return torch.stack([p.float() for p in parts]).sum()
