"""A traced model's inputs and outputs as the user gives and gets them.

Owns the two translations between the user's structures and the runtime's tuples
of tensors, for traced models (``split_points``): a dict of named tensor inputs
(``{"input_ids": x, "attention_mask": m}``) becomes the traced graph's positional
tuple (``positional_inputs``), and the flat tensors a ``torch.export`` graph's last
stage returns become the model's own output structure again (``restore_output``,
e.g. a Hugging Face ``ModelOutput``), before ``loss_fn`` and after ``forward_only``.
The runtime (the C++ executor) only ever sees tuples of tensors. Before tracing, a
sample's inputs get memory of their own (``distinct_inputs``): tracing must not
confuse two inputs, or an input and a weight, because they were one tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["positional_inputs", "distinct_inputs", "restore_output", "RestoredLoss"]


def positional_inputs(input_names: Optional[Sequence[str]], inputs: Any, call: str) -> Any:
    """``inputs`` in the traced graph's input order.

    Args:
        input_names: the names of the graph's tensor inputs, in order, when the model
            was traced on a dict of named inputs; ``None`` when it took them positionally.
        inputs: what the user passed (``None`` on ranks without stage 0 is kept).
        call: ``"step()"`` or ``"forward_only()"``, for messages.

    Returns:
        ``inputs`` unchanged (positional tracing, or ``None``), or the dict's tensors as
        one tuple in the graph's order (a single input as itself).

    Raises:
        ValueError: a dict missing an input or holding one the model was not traced with
            (naming the key), or a dict where positional inputs were traced (or the reverse).
    """
    if inputs is None:
        return None
    if input_names is None:
        if isinstance(inputs, Mapping):
            raise ValueError(f"{call} got a dict of inputs ({', '.join(map(repr, inputs))}) but the "
                             "model was traced on positional inputs (sample=(x, y) or ((x, mask), y)); "
                             "pass them the same way, or trace with sample=({'name': x, ...}, y)")
        return inputs
    if not isinstance(inputs, Mapping):
        raise ValueError(f"{call} got {type(inputs).__name__} inputs but the model was traced on a "
                         f"dict of named inputs {list(input_names)}; pass a dict with those keys")
    missing = [n for n in input_names if n not in inputs]
    if missing:
        raise ValueError(f"{call} inputs lack {', '.join(map(repr, missing))}: the model was traced "
                         f"with the inputs {list(input_names)}; pass every one of them (every "
                         "batch has the same keys as sample)")
    unexpected = [k for k in inputs if k not in input_names]
    if unexpected:
        raise ValueError(f"{call} inputs hold {', '.join(map(repr, unexpected))}, which the model "
                         f"was not traced with (its inputs: {list(input_names)}); drop "
                         f"{'it' if len(unexpected) == 1 else 'them'} or trace with "
                         f"{'it' if len(unexpected) == 1 else 'them'} in sample (non-tensor "
                         "arguments go in concrete_args)")
    values = tuple(inputs[n] for n in input_names)
    for name, value in zip(input_names, values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{call} input {name!r} is a {type(value).__name__}, not a tensor; "
                             "fix non-tensor arguments with concrete_args={...}")
    return values[0] if len(values) == 1 else values


def _memory_of(t: torch.Tensor) -> Optional[Tuple[str, int]]:
    """Where ``t``'s elements live (device and storage address); ``None`` for a tensor
    without storage of its own to compare (meta, fake or a wrapper subclass)."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def distinct_inputs(inputs: Any, model: nn.Module) -> Any:
    """``inputs`` where no tensor shares memory with another input or with a parameter
    or buffer of ``model``: each later sharer is replaced by a copy (``clone``).

    A sample is what tracing sees of the batches to come, which are distinct tensors.
    Given one tensor twice (``z = zeros(...); sample=((z, z), z)``: ``idx`` and
    ``targets`` of a nanoGPT model), ``torch.export`` records one input used in both
    places, and a weight passed as an input becomes that input in the graph; the
    pipeline would then train on the wrong values without an error. Copies make
    every input its own value, whatever the tracer does with identity.

    Args:
        inputs: the sample's inputs: a tensor, or tuples, lists and dicts of them
            (other values are kept as they are).
        model: the model they are traced with.

    Returns:
        ``inputs`` in the same structure, the aliasing tensors copied (no gradient
        history); ``inputs`` itself when nothing aliases.
    """
    taken: Set[Tuple[str, int]] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        where = _memory_of(t)
        if where is not None:
            taken.add(where)
    copied = False

    def own(value: Any) -> Any:
        nonlocal copied
        if not isinstance(value, torch.Tensor):
            return value
        where = _memory_of(value)
        if where is None:
            return value
        if where in taken:
            copied = True
            return value.detach().clone()
        taken.add(where)
        return value

    result = pytree.tree_map(own, inputs)
    return result if copied else inputs


def restore_output(spec: Optional[pytree.TreeSpec], out: Any) -> Any:
    """The model's output structure from the last stage's flat tensors.

    Args:
        spec: the output's pytree structure (``None``: ``out`` is the structure already).
        out: one tensor or a tuple of tensors, the leaves in ``spec``'s order.
    """
    if spec is None or out is None:
        return out
    leaves = list(out) if isinstance(out, (tuple, list)) else [out]
    return pytree.tree_unflatten(leaves, spec)


class RestoredLoss:
    """``loss_fn`` called on the model's output structure (``restore_output``), so the
    same ``loss_fn`` works for the unsplit model and the pipeline.

    Args:
        loss_fn: the user's ``loss_fn(output, target)``.
        spec: the output's pytree structure.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], spec: pytree.TreeSpec) -> None:
        self.loss_fn = loss_fn
        self.spec = spec

    def __call__(self, out: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(restore_output(self.spec, out), target)
