"""The stage function: the one call the C++ executor makes into Python for compute.

Owns what happens inside ``F(j, i)``: running stage ``j``'s layers on microbatch
``i``'s inputs (on a stashed weight version when the executor passes one),
autocast, the loss on the last stage (scaled by the microbatch's share of the
batch, and by the loss scaler when there is one) and the finite check of every
output. Also owns the targets the loss needs (``Targets``) and how a batch is
split into microbatches (``split_microbatches``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._stages import LocalStages

__all__ = ["NonFiniteError", "Tensors", "as_tuple", "split_microbatches", "Targets",
           "StageFunction"]

_log = logging.getLogger(__name__)

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


class NonFiniteError(RuntimeError):
    """NaN or inf appeared in a stage's output or gradients (``check_finite="raise"``)."""


def as_tuple(value: Tensors) -> Tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def split_microbatches(value: Tensors, count: int, device: torch.device,
                       what: str) -> List[Tuple[torch.Tensor, ...]]:
    """Splits a batch (tensor or tuple of tensors) into ``count`` parts on dim 0.

    Raises:
        ValueError: the batch is smaller than ``count``.
    """
    batch = as_tuple(value)[0].shape[0]
    if batch < count:
        raise ValueError(f"{what} has batch size {batch}, smaller than microbatches="
                         f"{count}; use a batch of at least {count}")
    parts = [torch.tensor_split(t.to(device), count, dim=0) for t in as_tuple(value)]
    return [tuple(p[i] for p in parts) for i in range(count)]


class Targets:
    """Targets and loss scales by microbatch id, kept until the backward that needs
    them (a recomputed forward computes the loss again)."""

    def __init__(self) -> None:
        self._by_microbatch: Dict[int, Tuple[Any, float]] = {}

    def add(self, targets: Any, count: int, first: int, device: torch.device) -> None:
        """Splits ``targets`` into ``count`` microbatches numbered from ``first``; each
        one's scale is its share of the batch (the loss is a mean over the batch)."""
        chunks = split_microbatches(targets, count, device, "targets")
        total = sum(c[0].shape[0] for c in chunks)
        for i, c in enumerate(chunks):
            self._by_microbatch[first + i] = (c[0] if len(c) == 1 else c, c[0].shape[0] / total)

    def __getitem__(self, microbatch: int) -> Tuple[Any, float]:
        return self._by_microbatch[microbatch]

    def __len__(self) -> int:
        return len(self._by_microbatch)

    def drop_before(self, microbatch: int) -> None:
        for i in [i for i in self._by_microbatch if i < microbatch]:
            del self._by_microbatch[i]

    def clear(self) -> None:
        self._by_microbatch.clear()


class StageFunction:
    """``forward(stage, microbatch, inputs, weights) -> outputs`` for the executor.

    On the last stage the output is ``[loss * share]`` (a scalar) in training and
    the model's outputs in evaluation (:attr:`evaluating`).

    Args:
        stages: this rank's stages.
        loss_fn: ``loss_fn(output, target)`` with mean reduction.
        num_stages: stages in the whole pipeline.
        device: the stages' device.
        autocast: compute dtype under ``torch.autocast``, or ``None``.
        check_finite: record (``"skip"``/``"raise"``) the first stage whose output is
            not finite; ``raise_at_once`` raises :class:`NonFiniteError` right there.
        raise_at_once: raise in the callback instead of after the step
            (asynchronous schedules, which have no end of step to agree at).
        recompute: the executor runs each training forward twice, first without
            autograd, then again (with it) before the backward; the second run must
            not update running statistics a second time (see :meth:`_run_again`).
    """

    def __init__(self, stages: LocalStages, loss_fn: Callable[..., torch.Tensor],
                 num_stages: int, device: torch.device, autocast: Optional[torch.dtype],
                 check_finite: Optional[str], raise_at_once: bool, rank: int,
                 recompute: bool = False) -> None:
        self.stages = stages
        self.loss_fn = loss_fn
        self.num_stages = num_stages
        self.device = device
        self.autocast = autocast
        self.check_finite = check_finite
        self.raise_at_once = raise_at_once
        self.rank = rank
        self.recompute = recompute
        self.targets = Targets()
        #: Scales the loss (``autocast=torch.float16``), set by ``PipeDream.grad_scaler``.
        self.grad_scaler: Optional[Any] = None
        #: Evaluation: the last stage returns the model's outputs, not a loss.
        self.evaluating = False
        #: The first stage whose forward output held NaN/inf in this step, or None.
        self.nonfinite_forward: Optional[int] = None
        #: The step being run, for messages.
        self.step_index = 0

    def __call__(self, stage: int, microbatch: int, inputs: List[torch.Tensor],
                 weights: List[torch.Tensor]) -> List[torch.Tensor]:
        # With recompute the first forward runs without autograd; a forward with it
        # in training is the recomputation before the backward.
        again = self.recompute and torch.is_grad_enabled() and not self.evaluating
        run = self._run_again if again else self._run
        if self.autocast is None:
            outputs = run(stage, microbatch, inputs, weights)
        else:
            with torch.autocast(device_type=self.device.type, dtype=self.autocast):
                outputs = run(stage, microbatch, inputs, weights)
        if self.check_finite and not self.evaluating:
            self._check_finite(stage, microbatch, outputs)
        return outputs

    def _check_finite(self, stage: int, microbatch: int, outputs: Sequence[torch.Tensor]) -> None:
        if all(bool(torch.isfinite(t).all()) for t in outputs if t.is_floating_point()):
            return
        if self.nonfinite_forward is None or stage < self.nonfinite_forward:
            self.nonfinite_forward = stage
        if self.raise_at_once:
            raise NonFiniteError(
                f"rank {self.rank}: step {self.step_index}: the "
                f"{'loss' if stage == self.num_stages - 1 else 'forward output'} of stage "
                f"{stage} (layers {self.stages.partition.layer_range(stage)}), microbatch "
                f"{microbatch}, holds NaN or inf")

    def _run(self, stage: int, microbatch: int, inputs: List[torch.Tensor],
             weights: List[torch.Tensor]) -> List[torch.Tensor]:
        # nn.Sequential semantics: a tuple output reaches the next layer as one tuple.
        arg = inputs[0] if len(inputs) == 1 else tuple(inputs)
        if weights:  # a stashed weight version: run the stage functionally on it
            named = dict(zip(self.stages.parameter_names(stage), weights))
            out = torch.func.functional_call(self.stages[stage], named, (arg,))
        else:
            out = self.stages[stage](arg)
        if stage == self.num_stages - 1 and not self.evaluating:
            return [self._loss(out, microbatch)]
        return list(as_tuple(out))

    def _run_again(self, stage: int, microbatch: int, inputs: List[torch.Tensor],
                   weights: List[torch.Tensor]) -> List[torch.Tensor]:
        """A recomputed forward: BatchNorm layers in training mode normalise with the
        batch's statistics as before but do not move their running statistics again
        (momentum 0 for this call, ``num_batches_tracked`` put back), so those advance
        once per microbatch, as in the unsplit model.

        Raises:
            ValueError: another buffer changed in the recomputed forward (it would
                change twice per microbatch), naming it.
        """
        module = self.stages[stage]
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
                 and m.training and m.track_running_stats]
        held = {id(b) for m in norms for b in m.buffers(recurse=False) if b is not None}
        versions = [(name, b, b._version) for name, b in module.named_buffers()
                    if id(b) not in held]
        momenta = [m.momentum for m in norms]
        try:
            for m in norms:
                m.momentum = 0.0  # running = running * 1 + batch * 0: unchanged, exactly
            outputs = self._run(stage, microbatch, inputs, weights)
        finally:
            for m, momentum in zip(norms, momenta):
                m.momentum = momentum
        with torch.no_grad():
            for m in norms:
                if m.num_batches_tracked is not None:
                    m.num_batches_tracked.sub_(1)
        changed = [name for name, b, version in versions if b._version != version]
        if changed:
            raise ValueError(
                f"recompute=True runs stage {stage}'s forward twice per microbatch, and it "
                f"updates buffer {changed[0]!r} in place, which would then change twice "
                "(BatchNorm statistics are handled; this buffer is not): use recompute=False")
        return outputs

    def _loss(self, out: Any, microbatch: int) -> torch.Tensor:
        target, share = self.targets[microbatch]
        loss = self.loss_fn(out, target)
        if loss.numel() != 1:
            raise ValueError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must "
                             "return a scalar (use reduction='mean')")
        loss = loss.float() * share
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        return loss
