"""The loss reduction: how the microbatches' losses add up to the batch's loss.

``PipeDream(loss_reduction=...)`` names one of three reductions; the options turn the
name into one :class:`LossReduction` object, once (``PipelineConfig.loss_reduction``),
and the runtime asks that object instead of comparing names: each microbatch's share
of the loss (:meth:`LossReduction.shares`), the divisor of the batch loss over a
mesh's dp and tp ranks (:meth:`LossReduction.divisor`), whether dp ranks' gradients
are averaged (:attr:`LossReduction.averages_over_dp`), what ``loss_fn`` must return
(:meth:`LossReduction.read`) and the check that it reduces as declared
(:meth:`LossReduction.check_reduction`).

- :class:`MeanLoss` (``"mean"``, the default): ``loss_fn`` averages over its
  microbatch, whose loss is scaled by its share of the batch's rows.
- :class:`SumLoss` (``"sum"``): ``loss_fn`` adds; losses are added unscaled.
- :class:`TokenMeanLoss` (``"tokens"``): the global token mean of an LLM batch with
  padding, below.

``loss_reduction="tokens"``: ``loss_fn(output, target)`` returns ``(loss_sum,
n_tokens)``; the pipeline trains on the sum of every microbatch's ``loss_sum`` (with
a mesh: over every dp rank) divided by the token count of the whole batch, as the
unsplit model does with ``reduction="sum"`` divided by its non-padding tokens
(torchtitan#1759).

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

import abc
import math
import numbers
from typing import Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type

import torch
import torch.utils._pytree as pytree

from .. import schedules

__all__ = ["IGNORE_INDEX", "TokensFn", "ReadLoss", "LossReduction", "MeanLoss", "SumLoss",
           "TokenMeanLoss", "reduction_type", "from_option", "count_tokens", "microbatch_tokens",
           "split_loss", "returned_mismatch", "no_tokens"]

#: The target value the default count skips: PyTorch's and transformers' ``ignore_index``.
IGNORE_INDEX = -100

#: ``tokens_fn(target)``: a microbatch's token count (a number or a 0-d tensor).
TokensFn = Callable[[Any], Any]

_EXAMPLE = ("(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='sum'), "
            "(labels != -100).sum())")


class ReadLoss(NamedTuple):
    """What :meth:`LossReduction.read` found in what ``loss_fn`` returned.

    Attributes:
        loss: the scalar loss tensor to scale by the microbatch's share (``None`` on a problem).
        n_tokens: the token count ``loss_fn`` returned (:class:`TokenMeanLoss`), else ``None``.
        problem: what is wrong with the returned value, or ``None``.
    """

    loss: Optional[torch.Tensor]
    n_tokens: Any
    problem: Optional[str]


class LossReduction(abc.ABC):
    """How microbatch losses add up to the batch's loss: one subclass per value of
    the ``loss_reduction`` option, built once from it (:func:`from_option`).

    Attributes:
        name: the option's value (``"mean"``, ``"sum"``, ``"tokens"``), for messages.
        averages_over_dp: the dp ranks' losses and gradients are averaged (else added).
        counts_tokens: every step counts the batch's tokens before it runs
            (``FlushRunner._batch_tokens``) and divides the losses by that count.

    Args:
        tokens_fn: refused (``None`` only): only :class:`TokenMeanLoss` counts tokens.

    Raises:
        ValueError: a ``tokens_fn`` given, naming the reduction and the fix.
    """

    name: ClassVar[str]
    averages_over_dp: ClassVar[bool] = False
    counts_tokens: ClassVar[bool] = False

    def __init__(self, tokens_fn: Optional[TokensFn] = None) -> None:
        if tokens_fn is not None:
            raise ValueError(f"tokens_fn={tokens_fn!r} counts the tokens loss_reduction='tokens' "
                             f"divides by, but loss_reduction={self.name!r}; pass "
                             "loss_reduction='tokens' or drop tokens_fn")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @classmethod
    def check_schedule(cls, schedule: str) -> None:
        """Refuses a schedule this reduction cannot train with (none, here)."""
        return None

    def divisor(self, dp_size: int, tp_size: int) -> int:
        """What the sum of the pipelines' losses is divided by: the global batch's mean
        (each tp rank of a dp coordinate computes the same loss: counted once).

        Args:
            dp_size: the mesh's dp ranks (1 without a mesh).
            tp_size: the mesh's tp ranks (1 without tensor parallelism).

        Returns:
            ``tp_size``, times ``dp_size`` where dp ranks' losses are averaged.
        """
        return tp_size * (dp_size if self.averages_over_dp else 1)

    def shares(self, rows: Sequence[int]) -> List[float]:
        """The factor each microbatch's loss is multiplied by, from the rows of each
        (a token mean's until the step's count divides them, ``Targets.divide_by_tokens``).

        Returns:
            1 for each microbatch: the losses add up unscaled.
        """
        return [1.0] * len(rows)

    def count_tokens(self, targets: Sequence[Any]) -> Optional[List[int]]:
        """Each microbatch's token count, or ``None``: this reduction counts none."""
        return None

    def read(self, returned: Any) -> ReadLoss:
        """The loss in what ``loss_fn`` returned: a scalar tensor.

        Returns:
            ``ReadLoss(returned, None, None)``, or its problem (not a tensor, not a scalar).
        """
        problem = _scalar_problem(returned)
        return ReadLoss(returned if problem is None else None, None, problem)

    def check_reduction(self, loss_fn: Callable[..., Any], out: Any, target: Any,
                        loss: torch.Tensor) -> Optional[str]:
        """Whether ``loss_fn`` reduces as this reduction says, from its value on the
        microbatch repeated twice (a mean stays, a sum doubles); no grad. Run once per
        pipeline, on the first microbatch whose loss is computed.

        Args:
            loss_fn: the user's loss function.
            out: the last stage's output for the microbatch.
            target: the microbatch's targets.
            loss: the loss :meth:`read` found in ``loss_fn(out, target)``.

        Returns:
            The problem, or ``None``: as declared, or inconclusive (no tensor target, a
            loss of 0, a ``loss_fn`` that cannot take the doubled microbatch, another ratio).
        """
        rows = next((t.shape[0] for t in pytree.tree_leaves(target)
                     if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if rows is None:
            return None

        def twice(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
                return torch.cat([value, value])
            return value

        with torch.no_grad():
            try:
                doubled = loss_fn(pytree.tree_map(twice, out), pytree.tree_map(twice, target))
            except Exception:  # noqa: BLE001 - a loss_fn that cannot take it: no verdict
                return None
        doubled = self._summed_part(doubled)
        base = float(loss.detach())
        if not isinstance(doubled, torch.Tensor) or doubled.numel() != 1 or abs(base) < 1e-12:
            return None
        # A loss_fn returning the model's own loss (nanoGPT's ``out[1]``) gives a tensor
        # that requires grad, even under no_grad: float() of it warns.
        return self._ratio_problem(float(doubled.detach()) / base)

    def _summed_part(self, returned: Any) -> Any:
        """The part of ``loss_fn``'s value that :meth:`check_reduction` compares."""
        return returned

    @abc.abstractmethod
    def _ratio_problem(self, ratio: float) -> Optional[str]:
        """The problem of a ``loss_fn`` whose value on a microbatch repeated twice is
        ``ratio`` times its value, or ``None``."""


class MeanLoss(LossReduction):
    """``loss_reduction="mean"``: ``loss_fn`` averages over its microbatch; each
    microbatch's loss is scaled by its share of the batch's rows, and dp ranks'
    losses and gradients are averaged."""

    name = "mean"
    averages_over_dp = True

    def shares(self, rows: Sequence[int]) -> List[float]:
        """Each microbatch's rows over the batch's (the mean of the unsplit model).

        Returns:
            ``rows[i] / sum(rows)`` for each microbatch.
        """
        total = sum(rows)
        return [r / total for r in rows]

    def _ratio_problem(self, ratio: float) -> Optional[str]:
        if abs(ratio - 2.0) < 1e-3:
            return (f"loss_fn sums over the batch (its value on a microbatch repeated twice is "
                    f"{ratio:.3f}x its value), but the pipeline takes a mean-reduced loss and "
                    "scales each microbatch's loss by its share of the batch, which would give "
                    "gradients 1/microbatches of the unsplit model's: use reduction='mean', or "
                    "pass loss_reduction='sum' to PipeDream")
        return None


class SumLoss(LossReduction):
    """``loss_reduction="sum"``: ``loss_fn`` adds over its microbatch; microbatch losses
    add up unscaled, and so do dp ranks' losses and gradients."""

    name = "sum"

    def _ratio_problem(self, ratio: float) -> Optional[str]:
        if abs(ratio - 1.0) < 1e-3:
            return ("loss_fn averages over the batch (its value on a microbatch repeated twice "
                    "is its value), but loss_reduction='sum' adds the microbatches' losses "
                    "unscaled, which would give gradients microbatches times the unsplit "
                    "model's: drop loss_reduction='sum' (the default is 'mean')")
        return None


class TokenMeanLoss(LossReduction):
    """``loss_reduction="tokens"``: the batch's token mean (the module's docstring):
    ``loss_fn`` returns ``(loss_sum, n_tokens)``, every microbatch's ``loss_sum`` is
    divided by the whole batch's token count; dp ranks' losses and gradients add up.

    Args:
        tokens_fn: counts a microbatch's tokens (default :func:`count_tokens`).

    Raises:
        ValueError: a ``tokens_fn`` that is not callable.
    """

    name = "tokens"
    counts_tokens = True

    def __init__(self, tokens_fn: Optional[TokensFn] = None) -> None:
        super().__init__()
        if tokens_fn is not None and not callable(tokens_fn):
            raise ValueError(f"tokens_fn={tokens_fn!r} is not callable; pass tokens_fn(target) -> the "
                             "number of tokens in the targets of a microbatch")
        self.tokens_fn: TokensFn = tokens_fn if tokens_fn is not None else count_tokens

    def __repr__(self) -> str:
        return f"TokenMeanLoss(tokens_fn={self.tokens_fn!r})"

    @classmethod
    def check_schedule(cls, schedule: str) -> None:
        """Refuses an asynchronous schedule: the count divides the whole batch's losses
        before their backwards, and those schedules update inside the batch.

        Raises:
            ValueError: naming the schedule and the flush schedules.
        """
        if schedules.traits(schedule).asynchronous:
            raise ValueError(f"loss_reduction='tokens' divides by the token count of the whole batch "
                             f"before its backwards, but schedule {schedule!r} updates the "
                             "weights inside the pipeline, minibatch by minibatch; use a flush "
                             f"schedule ({', '.join(schedules.synchronous_names())})")

    def count_tokens(self, targets: Sequence[Any]) -> Optional[List[int]]:
        """Each microbatch's token count (``tokens_fn``), read in one go.

        Raises:
            ValueError: what :func:`microbatch_tokens` refuses.
        """
        return microbatch_tokens(self.tokens_fn, targets)

    def read(self, returned: Any) -> ReadLoss:
        """``loss_sum`` and ``n_tokens`` of the pair ``loss_fn`` returned.

        Returns:
            ``ReadLoss(loss_sum, n_tokens, None)``, or the problem (:func:`split_loss`).
        """
        pair, problem = split_loss(returned)
        if pair is None:
            return ReadLoss(None, None, problem)
        return ReadLoss(pair[0], pair[1], None)

    def _summed_part(self, returned: Any) -> Any:
        return returned[0] if isinstance(returned, (tuple, list)) and returned else None

    def _ratio_problem(self, ratio: float) -> Optional[str]:
        if abs(ratio - 1.0) < 1e-3:
            return ("loss_fn's loss_sum averages over the batch (its value on a microbatch "
                    "repeated twice is its value), but loss_reduction='tokens' adds the "
                    "microbatches' loss_sum and divides by the batch's token count, so a mean "
                    "would shrink each microbatch's loss and gradients by its token count: return "
                    "the sum over the tokens (reduction='sum')")
        return None


#: The reductions by the option's value.
_BY_NAME: Dict[str, Type[LossReduction]] = {kind.name: kind
                                            for kind in (MeanLoss, SumLoss, TokenMeanLoss)}


def reduction_type(name: Any) -> Type[LossReduction]:
    """The reduction class the option ``loss_reduction=name`` names.

    Raises:
        ValueError: another value, naming the three.
    """
    kind = _BY_NAME.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"loss_reduction={name!r}; use 'mean' (loss_fn averages over "
                         "the batch, the default), 'sum' (it adds) or 'tokens' (it returns "
                         "(loss_sum, n_tokens))")
    return kind


def from_option(name: Any, tokens_fn: Optional[TokensFn] = None) -> LossReduction:
    """The reduction of the options ``loss_reduction=name`` and ``tokens_fn``.

    Raises:
        ValueError: an unknown name, or a ``tokens_fn`` the reduction refuses.
    """
    return reduction_type(name)(tokens_fn)


def _scalar_problem(loss: Any) -> Optional[str]:
    """What is wrong with the loss ``loss_fn`` returned (a scalar tensor), or ``None``."""
    if not isinstance(loss, torch.Tensor):
        value = f"{loss!r}"[:80]
        return (f"loss_fn returned a {type(loss).__name__} ({value}); it must return a "
                "scalar tensor that autograd can differentiate (return the loss tensor, not "
                "loss.item() or a tuple of values)")
    if loss.numel() != 1:
        return (f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return a "
                "scalar (use reduction='mean')")
    return None


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
    values = _read_numbers(counts)
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
    for i, value in zip(microbatches, _read_numbers([returned[i] for i in microbatches])):
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


def _read_numbers(values: Sequence[Any]) -> List[float]:
    """Numbers and 0-d tensors as floats, the tensors read in one go (one device sync)."""
    tensors = [v.detach().reshape(()) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist()
                if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__} ({f'{value!r}'[:60]})"
