"""``loss_reduction="tokens"``: the global token mean of an LLM batch with padding.

``loss_fn(output, target)`` returns ``(loss_sum, n_tokens)``; the pipeline trains on
the sum of every microbatch's ``loss_sum`` (with a mesh: over every dp rank) divided
by the token count of the whole batch, as the unsplit model does with
``reduction="sum"`` divided by its non-padding tokens (torchtitan#1759).

The last stage runs a microbatch's backward right after its forward (1F1B), before
later microbatches' ``loss_fn`` ran, so the count cannot come from what ``loss_fn``
returns: it depends only on the targets, so the runner counts every microbatch's
tokens (``tokens_fn``) when the step starts, sums them over the dp ranks, and each
microbatch's loss is ``loss_sum / total``. After the step each ``n_tokens`` that
``loss_fn`` returned is compared with its microbatch's count (one read for the
step), so a ``tokens_fn`` that counts otherwise than ``loss_fn`` (a loss that
shifts its labels) is refused instead of training on a wrong divisor.

Dividing the gradients after the step instead (summing as ``"sum"`` does, then
scaling by ``1 / total``) would need no ``tokens_fn``, but it would also scale
gradients accumulated over earlier ``step()`` calls, hold every rank for the count
at the end of every step, and run the backward on sums (an fp16 overflow sooner).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["IGNORE_INDEX", "count_tokens", "microbatch_tokens", "split_loss", "returned_mismatch",
           "no_tokens"]

#: The target value the default count skips: PyTorch's and transformers' ``ignore_index``.
IGNORE_INDEX = -100

_EXAMPLE = ("(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='sum'), "
            "(labels != -100).sum())")


def count_tokens(target: Any) -> torch.Tensor:
    """The default ``tokens_fn``: a target tensor's elements other than :data:`IGNORE_INDEX`.

    Raises:
        ValueError: targets that are not one tensor (which of them holds the tokens?).
    """
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"loss_reduction='tokens' counts the tokens of a target tensor (its "
                         f"elements other than {IGNORE_INDEX}), but the targets are a "
                         f"{type(target).__name__}; pass tokens_fn=lambda target: ... counting "
                         "the tokens loss_fn sums over")
    return (target != IGNORE_INDEX).sum()


def microbatch_tokens(tokens_fn: Callable[[Any], Any], targets: Sequence[Any]) -> List[int]:
    """Each microbatch's token count, read in one go (one device sync for the step).

    Args:
        tokens_fn: counts one microbatch's targets (a number or a 0-d tensor).
        targets: the microbatches' targets.

    Raises:
        ValueError: a count that is not a whole number >= 0, naming it.
    """
    counts = [tokens_fn(t) for t in targets]
    for i, n in enumerate(counts):
        if not _is_count(n):
            raise ValueError(f"tokens_fn returned {_show(n)} for microbatch {i}; it must return the "
                             "microbatch's token count, a number or a 0-d tensor")
    tensors = [n.detach().reshape(()) for n in counts if isinstance(n, torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist()
                if tensors else [])
    values = [next(read) if isinstance(n, torch.Tensor) else float(n) for n in counts]
    for i, v in enumerate(values):
        # inf and NaN first: int() of them raises OverflowError / ValueError naming neither.
        if not math.isfinite(v) or v < 0 or v != int(v):
            raise ValueError(f"tokens_fn counted {v:g} tokens in microbatch {i}; a token count is "
                             "a whole number >= 0 (a tokens_fn dividing by 0 or summing a float "
                             "mask gives inf/NaN or fractions: count the tokens, e.g. "
                             f"(target != {IGNORE_INDEX}).sum())")
    return [int(v) for v in values]


def split_loss(result: Any) -> Tuple[Optional[Tuple[torch.Tensor, Any]], Optional[str]]:
    """``(loss_sum, n_tokens)`` from what ``loss_fn`` returned, or what is wrong with it.

    Returns:
        ``((loss_sum, n_tokens), None)``, or ``(None, problem)``.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        what = f"a {type(result).__name__}" + (f" of shape {tuple(result.shape)}"
                                               if isinstance(result, torch.Tensor) else
                                               f" ({_show(result)})")
        return None, (f"loss_reduction='tokens' needs loss_fn to return (loss_sum, n_tokens): the "
                      "sum of the microbatch's token losses (reduction='sum') and how many tokens "
                      f"it summed; it returned {what}. Return e.g. {_EXAMPLE}")
    loss_sum, n_tokens = result
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
        return None, (f"loss_fn's loss_sum is {_show(loss_sum)}; with loss_reduction='tokens' it "
                      "must be a scalar tensor that autograd can differentiate, the sum over the "
                      f"microbatch's tokens (reduction='sum'): e.g. {_EXAMPLE}")
    if not _is_count(n_tokens):
        return None, (f"loss_fn's n_tokens is {_show(n_tokens)}; with loss_reduction='tokens' it "
                      "must be the microbatch's token count, a number or a 0-d tensor")
    return (loss_sum, n_tokens), None


def returned_mismatch(counted: Dict[int, int], returned: Dict[int, Any]) -> Optional[str]:
    """The first microbatch whose ``n_tokens`` from ``loss_fn`` is not the count
    ``tokens_fn`` gave (one read of the returned tensors), or ``None``."""
    microbatches = sorted(returned)
    tensors = [returned[i].detach().reshape(()).to(torch.float64) for i in microbatches
               if isinstance(returned[i], torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    for i in microbatches:
        value = next(read) if isinstance(returned[i], torch.Tensor) else float(returned[i])
        if value != counted[i]:
            return (f"loss_fn returned n_tokens={value:g} for microbatch {i}, but tokens_fn counted "
                    f"{counted[i]} tokens in its targets (default: the elements other than "
                    f"{IGNORE_INDEX}); the losses were divided by the batch's tokens_fn count, so "
                    "the two must agree: pass tokens_fn= counting as loss_fn does (a loss_fn that "
                    "shifts its labels counts labels[:, 1:]: tokens_fn=lambda t: (t[:, 1:] != "
                    "-100).sum())")
    return None


def no_tokens() -> str:
    """The problem of a batch whose token count is 0 (every rank raises it before the
    step runs: the unsplit model's ``loss_sum / 0`` would be NaN and its gradients too)."""
    return ("the batch holds no tokens: tokens_fn counted 0 in every microbatch (with a mesh: "
            f"of every dp rank; by default every target is {IGNORE_INDEX}), and "
            "loss_reduction='tokens' divides by the batch's token count (0/0: NaN); nothing ran "
            "on any rank and every gradient is as before this call: skip batches without tokens "
            "(or catch this ValueError on every rank and go on with the next batch)")


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__} ({f'{value!r}'[:60]})"
