"""What a ``tensor_parallel=`` dict plan adds to the cost model: :func:`plan_traffic`.

The cost model (``csrc/core/configure.h``) divides a layer's compute by tp; the
collectives the plan adds are per microbatch, forward and backward, and do not shrink
with tp. A ``ColwiseParallel`` module all-reduces its input gradient in backward (when
its input needs one) and, with a replicated output, all-gathers its output in forward;
a ``RowwiseParallel`` module reduces its output in forward and, with a replicated input,
all-gathers its input gradient in backward (Megatron's pattern). A sequence-sharded
layout (``Shard(1)``) turns an all-reduce into an all-gather and a reduce-scatter that
move as much: counted as two calls. The bytes are the module's input or output on the
sample, per row. A callable plan cannot be inspected: ``None``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._planning.timing import preserved, tensor_bytes
from .tensor_parallel import pattern_matches

__all__ = ["plan_traffic", "run_once"]

#: Per top-level layer: (collective calls per microbatch forward + backward, bytes per sample).
Traffic = List[Tuple[float, float]]


def _calls(layouts: Any) -> float:
    """One all-reduce, or an all-gather and a reduce-scatter (as many bytes) when the
    layout is sharded along the sequence (``Shard(1)``)."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415 - only with tp

    return 2.0 if any(isinstance(p, Shard) and p.dim != -1 for p in layouts or ()) else 1.0


def _module_traffic(style: Any, inputs: Any, output: Any, rows: int) -> Tuple[float, float]:
    """``(calls, bytes per sample)`` of one planned module's forward and backward."""
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - only with tp
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415

    calls = bytes_ = 0.0
    in_bytes, out_bytes = tensor_bytes(inputs) / rows, tensor_bytes(output) / rows
    needs_grad = any(t.is_floating_point() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
    if isinstance(style, ColwiseParallel):
        if needs_grad:  # the input gradient, summed over the output columns' ranks
            calls += _calls(style.input_layouts)
            bytes_ += in_bytes
        if any(isinstance(p, Replicate) for p in style.output_layouts or ()):
            calls += 1.0  # the output gathered
            bytes_ += out_bytes
    elif isinstance(style, RowwiseParallel):
        calls += _calls(style.output_layouts)  # partial sums reduced
        bytes_ += out_bytes
        if needs_grad and any(isinstance(p, Replicate) for p in style.input_layouts or ()):
            calls += 1.0  # the input gradient gathered
            bytes_ += in_bytes
    return calls, bytes_


def run_once(module: nn.Module, inputs: Any, handles: List[Any]) -> None:
    """One forward of ``module`` on ``inputs`` for its hooks to record (no gradients;
    modes, buffers and the RNG put back), the ``handles`` removed after it."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    try:
        with preserved([module], device), torch.no_grad():
            module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)
    finally:
        for handle in handles:
            handle.remove()


def plan_traffic(plan: Any, module: nn.Sequential, inputs: Any) -> Optional[Traffic]:
    """The collectives ``plan`` adds to each top-level layer of ``module`` at ``tp > 1``
    (module docstring), measured on one forward of ``inputs`` (no gradients; modes,
    buffers and the RNG put back).

    Args:
        plan: the ``tensor_parallel`` value.
        module: the whole model (its children are the chain the planner cuts).
        inputs: the sample's inputs (first dimension: rows).

    Returns:
        Per child of ``module``: ``(calls per microbatch, bytes per sample)``, or ``None``
        for a callable plan.
    """
    if not isinstance(plan, Mapping):
        return None
    traffic: Traffic = [(0.0, 0.0)] * len(module)
    rows = max(1, int(tree_leaves(inputs)[0].shape[0]))
    seen: Dict[str, Tuple[float, float]] = {}
    handles = []
    for name, sub in module.named_modules():
        style = next((s for p, s in plan.items() if name and pattern_matches(p, name)), None)
        if style is None:
            continue

        def record(_m: nn.Module, args: Any, output: Any, name: str = name, style: Any = style) -> None:
            seen[name] = _module_traffic(style, args, output, rows)
        handles.append(sub.register_forward_hook(record))
    run_once(module, inputs, handles)
    children = [n for n, _ in module.named_children()]
    for name, (calls, size) in seen.items():
        index = children.index(name.split(".")[0])
        before = traffic[index]
        traffic[index] = (before[0] + calls, before[1] + size)
    return traffic
