"""The whole batch's output of ``forward_only`` from the last stage's per-microbatch outputs.

The batch is cut into microbatches along dim 0 (``stage_call.split_microbatches``:
``torch.tensor_split``, so the first ``B % m`` microbatches have one row more), and
each microbatch's output comes back separately. Only an output that holds one entry
per row along a batch dimension can be put back together into the unsplit model's
output, by concatenating along that dimension; anything else concatenated would be
a different tensor (a ``[10]`` output from 4 microbatches would come back ``[40]``,
a sequence-first ``[3, 16, 10]`` as ``[12, 4, 10]``). So each leaf of the output
(``torch.utils._pytree``) is combined by what it is:

* a tensor whose ``output_batch_dim`` (default 0) has each microbatch's rows, in
  every microbatch: concatenated along it; so is one that has each microbatch's rows
  times one factor ``k > 1`` there while no dim has the rows themselves (a batch-major
  flattened output: logits ``[rows * T, V]`` flattened for the loss);
* a 0-d tensor (a loss, an auxiliary loss): the mean of the microbatches' values
  weighted by their rows, as ``step()`` combines the loss;
* a number or string (``bool``, ``bytes``): kept if every microbatch returned the
  same; any other value (an object the model passes through) is the first
  microbatch's;
* anything else is refused, naming the leaf, its shape and the option:
  ``output_batch_dim=<the dim that holds the rows>``, or ``output_batch_dim=None``
  for the list of the microbatches' outputs, combined by the caller.

This is ``torch.distributed.pipelining``'s ``output_merge_spec`` with one
``TensorChunkSpec(output_batch_dim)`` for every tensor, checked against the rows.
"""
from __future__ import annotations

import numbers
from typing import Any, List, Optional, Sequence

import torch
import torch.utils._pytree as pytree

__all__ = ["check_output_batch_dim", "microbatch_rows", "merge_microbatch_outputs"]


def check_output_batch_dim(value: Any) -> Optional[int]:
    """``forward_only(output_batch_dim=...)`` checked.

    Raises:
        ValueError: neither an int nor ``None``.
    """
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return None if value is None else int(value)
    raise ValueError(f"output_batch_dim={value!r}: use the dim of the outputs that holds the batch's "
                     "rows (an int: 0, the default, for batch-first outputs; 1 for sequence-first "
                     "[T, B, ...] ones), or None for the list of each microbatch's output")


def microbatch_rows(batch: int, count: int) -> List[int]:
    """The rows of each of ``count`` microbatches of a ``batch``-row batch, as
    ``torch.tensor_split`` cuts it (the first ``batch % count`` have one more)."""
    return [batch // count + (1 if i < batch % count else 0) for i in range(count)]


_PLAIN = (numbers.Number, str, bytes)


def _rows_dim(values: Sequence[torch.Tensor], rows: Sequence[int]) -> Optional[int]:
    """A dim that has each microbatch's rows in every microbatch's output, if one does."""
    dims = min(v.dim() for v in values)
    return next((d for d in range(dims) if all(v.shape[d] == r for v, r in zip(values, rows))), None)


def _flattened_rows(values: Sequence[torch.Tensor], rows: Sequence[int], dim: int) -> bool:
    """Whether ``dim`` holds each microbatch's rows times one common factor ``k > 1``
    while no dim holds the rows themselves: a batch-major flattened output (logits
    ``[rows * T, V]`` flattened for the loss), whose concatenation along ``dim`` is the
    whole batch's flattened output."""
    if _rows_dim(values, rows) is not None or any(not -v.dim() <= dim < v.dim() or r == 0
                                                  for v, r in zip(values, rows)):
        return False
    factors = {v.shape[dim] / r for v, r in zip(values, rows)}
    return len(factors) == 1 and float(next(iter(factors))).is_integer() and next(iter(factors)) > 1


def _concatenated(name: str, values: Sequence[torch.Tensor], rows: Sequence[int], dim: int) -> torch.Tensor:
    """The microbatches' ``values`` concatenated along ``dim``, after checking that it is
    the batch dimension of each.

    Raises:
        ValueError: a microbatch's output lacks ``dim`` or has another size there than
            its rows, naming the leaf, the shapes and what to pass instead.
    """
    bad = next((i for i, (v, r) in enumerate(zip(values, rows))
                if not -v.dim() <= dim < v.dim() or v.shape[dim] != r), None)
    if bad is None or _flattened_rows(values, rows, dim):
        return torch.cat(list(values), dim=dim)
    shape, count = list(values[bad].shape), len(rows)
    cut = (f"the batch of {sum(rows)} rows is cut into {count} microbatches of "
           f"{', '.join(map(str, rows))} rows along dim 0")
    found = _rows_dim(values, rows)
    as_list = f"output_batch_dim=None for the list of the {count} microbatches' outputs, to combine yourself"
    fix = (f"its dim {found} has each microbatch's rows: pass forward_only(..., output_batch_dim={found}), "
           f"or {as_list}" if found is not None else
           f"no dim of it has each microbatch's rows: pass {as_list}")
    raise ValueError(
        f"forward_only(): {name} has shape {shape} in microbatch {bad} of {rows[bad]} rows "
        f"({cut}), so its dim {dim} is not a batch dimension and the microbatches' outputs cannot "
        f"be concatenated into the whole batch's output; {fix}")


def _combined(name: str, values: Sequence[Any], rows: Sequence[int], dim: int) -> Any:
    """One leaf over the microbatches (module docstring)."""
    first = values[0]
    if not isinstance(first, torch.Tensor):
        other = next((i for i, v in enumerate(values) if type(v) is not type(first) or v != first), None) \
            if isinstance(first, _PLAIN) else None
        if other is not None:
            raise ValueError(f"forward_only(): {name} is {first!r} in microbatch 0 but {values[other]!r} in "
                             f"microbatch {other}; a number or string cannot be combined over microbatches: "
                             "return it as a tensor with a batch dimension, or pass output_batch_dim=None "
                             "for the list of the microbatches' outputs")
        return first
    if first.dim() == 0:  # a mean over rows (a loss): the rows-weighted mean is the batch's
        total = float(sum(rows))
        return sum(v.double() * (r / total) for v, r in zip(values, rows)).to(first.dtype)
    return _concatenated(name, values, rows, dim)


def merge_microbatch_outputs(outputs: Sequence[Any], rows: Sequence[int],
                             output_batch_dim: Optional[int]) -> Any:
    """The whole batch's output from each microbatch's (module docstring).

    Args:
        outputs: each microbatch's output, in order, all of one structure.
        rows: each microbatch's rows (:func:`microbatch_rows`).
        output_batch_dim: the outputs' batch dimension, or ``None`` for ``list(outputs)``.

    Returns:
        The output's structure with every leaf combined, or the list of ``outputs``.

    Raises:
        ValueError: a leaf that cannot be combined, named by its path in the output
            (``output[1]``, ``output['logits']``).
    """
    if output_batch_dim is None:
        return list(outputs)
    flat = [pytree.tree_flatten_with_path(out) for out in outputs]
    spec = flat[0][1]
    combined = []
    for k, (path, _) in enumerate(flat[0][0]):
        values = [leaves[k][1] for leaves, _ in flat]
        combined.append(_combined(f"output{pytree.keystr(path)}", values, rows, output_batch_dim))
    return pytree.tree_unflatten(combined, spec)
