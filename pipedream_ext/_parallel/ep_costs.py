"""What an ``expert_parallel=`` dict plan adds to the cost model: :func:`plan_traffic`.

Per top-level layer of an ``nn.Sequential`` (the chain the planner cuts): the bytes of
the experts the plan shards (the parameters of its matched modules: each ep rank holds
``1 / ep`` of them, and their gradients reduce over fewer copies), and the all_to_all
exchanges a call adds (``csrc/core/configure.h``): per microbatch the counts, the
dispatch and the combine in forward, the two exchanges of rows in backward (5 calls),
4 of them moving the routed rows. A call routes ``tokens x k`` rows of the hidden size:
``k`` is the last dimension of an integer input with one row per token (transformers'
``top_k_index``: ``RoutedExpertParallel``), else 1 (torchtitan's experts receive their
routed rows already). Measured on one forward of the sample; a callable plan cannot be
inspected: ``None``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .tensor_parallel import kept_calls
from .tp_costs import run_once

__all__ = ["ALL_TO_ALL_CALLS", "plan_traffic"]

#: Exchanges per microbatch of one planned module: counts, dispatch and combine in
#: forward; the dispatch's and the combine's backward.
ALL_TO_ALL_CALLS = 5.0

#: Per top-level layer: (expert parameter bytes, all_to_all calls per microbatch,
#: routed bytes per sample and exchange).
Traffic = List[Tuple[float, float, float]]


def routed_bytes(args: Any) -> float:
    """The bytes one exchange of a planned module's call moves: its rows of hidden states
    (the first floating-point input, as ``[rows, hidden]``) times ``k`` (module docstring)."""
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    hidden = next((t for t in tensors if t.is_floating_point() and t.dim() > 0), None)
    if hidden is None:
        return 0.0
    rows = hidden.numel() // max(1, hidden.shape[-1])
    k = next((t.shape[-1] for t in tensors if not t.is_floating_point() and t.dim() == 2 and
              t.shape[0] == rows), 1)
    return float(hidden.numel() * hidden.element_size() * k)


def plan_traffic(plan: Any, module: nn.Sequential, inputs: Any) -> Optional[Traffic]:
    """The experts and exchanges ``plan`` adds to each top-level layer of ``module``,
    measured on one forward of ``inputs`` (no gradients; modes, buffers and the RNG put
    back).

    Args:
        plan: the ``expert_parallel`` value.
        module: the whole model (its children are the chain the planner cuts).
        inputs: the sample's inputs (first dimension: rows).

    Returns:
        Per child of ``module``: ``(expert bytes, calls per microbatch, bytes per sample
        and exchange)``, or ``None`` for a callable plan.
    """
    if not isinstance(plan, Mapping):
        return None
    children = [n for n, _ in module.named_children()]
    rows = max(1, int(tree_leaves(inputs)[0].shape[0]))
    planned = {name: module.get_submodule(name) for name in kept_calls(plan, module)}
    seen: Dict[str, float] = {}

    def recorder(name: str) -> Any:
        def record(_m: nn.Module, args: Any, _output: Any) -> None:
            seen[name] = seen.get(name, 0.0) + routed_bytes(args) / rows
        return record
    run_once(module, inputs, [sub.register_forward_hook(recorder(name)) for name, sub in planned.items()])
    traffic: Traffic = [(0.0, 0.0, 0.0)] * len(children)
    for name, sub in planned.items():
        index = children.index(name.split(".")[0])
        experts, calls, size = traffic[index]
        called = name in seen
        traffic[index] = (experts + float(sum(p.numel() * p.element_size() for p in sub.parameters())),
                          calls + (ALL_TO_ALL_CALLS if called else 0.0), size + seen.get(name, 0.0))
    return traffic
