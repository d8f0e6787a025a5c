"""``pipedream_ext.profile``: one call for any model.

An ``nn.Sequential`` is profiled child by child (``sequential``); any other module is
traced and profiled as a DAG of groups of operations (``graph_profile``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from .._extension import _C
from .graph_profile import profile_traced
from .sequential import profile_sequential

__all__ = ["profile"]

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def profile(
    module: nn.Module,
    sample_input: Tensors,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    target: Any = None,
    steps: int = 20,
    warmup: int = 5,
    output: Optional[Union[str, "os.PathLike[str]"]] = None,
    progress: bool = False,
    **traced: Any,
) -> "_C.ProfileGraph":
    """Measures every layer of ``module`` and returns its profile graph.

    An ``nn.Sequential`` is profiled child by child (a chain). Any other module is
    traced with torch.fx and profiled as a DAG of groups of operations, with an edge
    for every value one group passes another (skip connections included):
    ``graph_profile.profile_traced``, docs/tracing.md.

    Args:
        module: the model, already on its device.
        sample_input: one minibatch (a tensor or tuple of tensors) on that device.
        loss_fn: ``loss_fn(output, target)``; ``None`` backpropagates
            ``output.sum()``. Its time is added to the last layer.
        target: the loss target.
        steps: measured iterations (the median is reported).
        warmup: unmeasured iterations first.
        output: where to write ``graph.txt`` (optional).
        progress: show a tqdm progress bar.
        **traced: for a traced model only: ``concrete_args``, ``max_groups``, ``depth``.

    Returns:
        The profile: an Input node then one node per layer (or group) with forward
        and backward milliseconds, output activation bytes and weight bytes. The
        model's modes, buffers (BatchNorm statistics), gradients and RNG state are
        left as they were.

    Raises:
        ValueError: bad arguments, a layer output that is not tensors, or a model
            torch.fx cannot trace.
    """
    if not isinstance(module, nn.Sequential):
        return profile_traced(module, sample_input, loss_fn, target, steps, warmup, output,
                              progress, **traced)
    if traced:
        raise ValueError(f"{sorted(traced)} only apply to traced models (not an nn.Sequential)")
    return profile_sequential(module, sample_input, loss_fn, target, steps, warmup, output, progress)
