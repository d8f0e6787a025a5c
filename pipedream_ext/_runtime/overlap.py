"""An F&B pair's two halves run together (``PipeDream(overlap=...)``, ``dualpipev``).

dualpipev pairs the forward of one microbatch on one chunk with the full backward of
another on the other chunk (csrc/core/pairs.h). With ``overlap=True`` the executor runs
the two on two threads taking turns (csrc/runtime/overlap.h): each half runs until it has
issued an asynchronous collective and calls ``_dist.turns.yield_turn``, so that one half's
all_to_all travels while the other computes. :class:`~pipedream_ext.RoutedExpertParallel`
yields at each of its exchanges; a model's own collectives can too.

A model may run a pair itself, DualPipe's ``overlapped_forward_backward`` shape
(:data:`OverlapHook`): ``overlap=fn``, or ``overlap=True`` on a model whose class defines
``overlapped_forward_backward``. :class:`PairCallback` checks that it ran the forward once
and the backward.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

__all__ = ["OverlapHook", "PairCallback", "StageCall", "hook_of"]

class StageCall:
    """One stage as an :data:`OverlapHook` sees it (DualPipe's ``module0`` / ``module1``):
    calling it runs the stage's forward on this microbatch (on the last stage: its loss,
    scaled for the backward) and returns the outputs as a list.

    Attributes:
        index: the stage.
        microbatch: the microbatch of the pair's half this stage runs.
        module: the stage's module (for a hook that runs its parts itself).
    """

    def __init__(self, index: int, microbatch: int, module: nn.Module,
                 forward: Optional[Callable[..., List[torch.Tensor]]] = None) -> None:
        self.index, self.microbatch, self.module = index, microbatch, module
        self._forward = forward
        self.calls = 0

    def __call__(self, *inputs: torch.Tensor) -> List[torch.Tensor]:
        if self._forward is None:
            raise RuntimeError(f"stage {self.index} runs the pair's backward (microbatch "
                               f"{self.microbatch}): call the forward of module0, and run "
                               "torch.autograd.backward(outputs1, output_grads1) for this one")
        self.calls += 1
        return list(self._forward(*inputs))


#: ``hook(module0, inputs0, module1, outputs1, output_grads1) -> outputs0``: runs
#: ``module0(*inputs0)`` once and ``torch.autograd.backward(outputs1, output_grads1)``
#: (``output_grads1`` is ``[None]`` when ``outputs1`` is the loss), in any order or
#: interleaving, and returns module0's outputs. DualPipe's shape, with the criterion and
#: labels inside ``module0`` on the last stage.
OverlapHook = Callable[[StageCall, List[torch.Tensor], StageCall, List[torch.Tensor],
                        List[Optional[torch.Tensor]]], Sequence[torch.Tensor]]


def hook_of(overlap: Any, model: nn.Module) -> Optional[OverlapHook]:
    """The hook ``overlap=`` asks for: the callable given, the model class's own
    ``overlapped_forward_backward`` with ``overlap=True``, else ``None`` (the executor's
    turns)."""
    if callable(overlap):
        return overlap
    if overlap is True:
        return getattr(type(model), "overlapped_forward_backward", None)
    return None


class PairCallback:
    """The executor's pair callback (``_C.PipelineExecutor(pair=...)``): runs ``hook`` and
    checks it ran the forward once, returned its outputs, and ran the backward to every
    root.

    Args:
        hook: the model's :data:`OverlapHook`.
        forward: the executor's forward callback (``StepCallback``).
        modules: this rank's stage modules, by stage.
        recompute: this rank's stages recompute: ``module0`` runs without autograd, as
            the executor's own forward then does (the backward recomputes it).
    """

    def __init__(self, hook: OverlapHook, forward: Callable[..., List[torch.Tensor]],
                 modules: Dict[int, nn.Module], recompute: bool = False) -> None:
        self.hook, self.forward, self.modules, self.recompute = hook, forward, modules, recompute

    def _forward(self, stage: int, microbatch: int, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.recompute):
            return self.forward(stage, microbatch, list(inputs), [])

    def __call__(self, f_stage: int, f_microbatch: int, inputs: List[torch.Tensor], b_stage: int,
                 b_microbatch: int, roots: List[torch.Tensor], grads: List[torch.Tensor]
                 ) -> List[torch.Tensor]:
        module0 = StageCall(f_stage, f_microbatch, self.modules[f_stage],
                            lambda *xs: self._forward(f_stage, f_microbatch, xs))
        module1 = StageCall(b_stage, b_microbatch, self.modules[b_stage])
        reached: set = set()
        handles = [root.register_hook(lambda g, k=k: reached.add(k))
                   for k, root in enumerate(roots) if root.requires_grad]
        try:
            outputs = self.hook(module0, list(inputs), module1, list(roots),
                                [g if g is not None and g.numel() else None for g in grads])
        finally:
            for handle in handles:
                handle.remove()
        name = getattr(self.hook, "__qualname__", repr(self.hook))
        what = f"overlapped_forward_backward {name} (forward: stage {f_stage} microbatch {f_microbatch}, " \
               f"backward: stage {b_stage} microbatch {b_microbatch})"
        if module0.calls != 1:
            raise RuntimeError(f"{what} ran module0 {module0.calls} times; run it exactly once")
        if len(reached) != len(handles):
            raise RuntimeError(f"{what} returned without the backward reaching outputs1; call "
                               "torch.autograd.backward(outputs1, output_grads1)")
        if isinstance(outputs, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in outputs):
            raise RuntimeError(f"{what} returned {type(outputs).__name__}; return module0's outputs "
                               "(the list it gave)")
        return list(outputs)
