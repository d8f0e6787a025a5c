"""Auxiliary losses a layer adds in its own backward (mixture-of-experts load balancing):
``add_aux_loss`` and ``aux_loss_scale``.

A router's load-balancing loss is computed inside a stage, but the pipeline's loss is
computed on the last stage. Megatron's ``MoEAuxLossAutoScaler`` avoids sending the aux
loss across the cuts: the layer returns its output through an autograd function whose
backward passes the output's gradient through unchanged and gives the aux loss the
gradient ``scale``, so the aux loss's gradient reaches the router's weights (and the
layer's input) in that layer's own backward, whichever stage and schedule runs it (the
split backward's input-gradient action runs it; the weight-gradient action reads what
it left).

``scale`` is what one microbatch's loss weighs in the step: the pipeline sets it around
every training forward of a stage to ``1 / microbatches`` (``loss_reduction="mean"`` and
``"tokens"``; 1 for ``"sum"``) times the grad scaler's scale, as Megatron sets
``loss_scale / num_microbatches``; data-parallel copies then average it with the other
gradients. Outside a pipeline it is 1 unless :func:`aux_loss_scale` says otherwise, so
the unsplit model trains ``main + aux`` with the same code; gradient accumulation over
``m`` microbatches gives the pipeline's weights with ``aux_loss_scale(1 / m)``.

Traced models: under torch.fx the call stays one ``call_function`` node (the stage runs
the function itself); torch.export would inline the forward and drop the injected
gradient, so it is refused there.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch

__all__ = ["add_aux_loss", "aux_loss_scale", "current_scale"]

_local = threading.local()


def current_scale() -> float:
    """The weight an aux loss registered now gets (1 outside :func:`aux_loss_scale`)."""
    scale, grad_scaler = getattr(_local, "scale", (1.0, None))
    # Read only when an aux loss is registered: get_scale() waits for the device.
    return scale * float(grad_scaler.get_scale()) if grad_scaler is not None else scale


@contextlib.contextmanager
def aux_loss_scale(scale: float, grad_scaler: Optional[Any] = None) -> Iterator[None]:
    """Aux losses registered in this block (:func:`add_aux_loss`) weigh ``scale``: their
    gradient in the backward is ``scale`` (Megatron's ``set_loss_scale``), times
    ``grad_scaler``'s scale if one is given. The pipeline sets it around each
    microbatch's forward; use it in a reference loop of gradient accumulation
    (``1 / microbatches``).

    Args:
        scale: a finite number.
        grad_scaler: a ``GradScaler`` whose current scale multiplies ``scale``, or ``None``.
    """
    previous = getattr(_local, "scale", (1.0, None))
    _local.scale = (float(scale), grad_scaler)
    try:
        yield
    finally:
        _local.scale = previous


class _AuxLossScaler(torch.autograd.Function):
    """``output`` unchanged; in the backward the aux loss's gradient is ``scale``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, grad_aux, None


def add_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """Returns ``output``; ``aux_loss`` (a scalar computed from this layer's tensors, e.g.
    a router's load-balancing loss times its coefficient) is added to the training
    objective: its gradient, weighted by :func:`current_scale`, is injected when the
    backward reaches ``output``. Nothing crosses a pipeline cut but ``output``.

    Args:
        output: the layer's output (a tensor the rest of the model uses).
        aux_loss: a tensor with a gradient to give (usually a scalar).

    Returns:
        ``output`` (a new autograd node: use the returned tensor).

    Raises:
        ValueError: under torch.export, which would lose the injected gradient.
    """
    if isinstance(output, torch.fx.Proxy) or isinstance(aux_loss, torch.fx.Proxy):
        proxy = output if isinstance(output, torch.fx.Proxy) else aux_loss
        return proxy.tracer.create_proxy("call_function", add_aux_loss, (output, aux_loss), {})
    if torch.compiler.is_exporting():
        raise ValueError("add_aux_loss cannot be traced by torch.export (it would keep the forward "
                         "and drop the aux loss's gradient); make the model traceable by torch.fx "
                         "(docs/tracing.md), or wrap its layers in an nn.Sequential")
    if not torch.is_grad_enabled() or not aux_loss.requires_grad:
        return output  # evaluation, or the first pass of a recomputed forward
    return _AuxLossScaler.apply(output, aux_loss, current_scale())
