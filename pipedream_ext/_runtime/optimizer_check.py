"""An optimizer built from the model before ``PipeDream`` wrapped it, found at its first step.

A pipeline trains its own tensors: this rank's stages, which are the model's layers
moved to the stage's device, materialised from the meta device or sharded by FSDP.
An optimizer built before the pipeline (nanoGPT's order: ``opt =
model.configure_optimizers(...)`` then ``PipeDream(model, ...)``) holds the model's
parameters instead: those of other ranks' layers, which never get a gradient here,
and tensors the pipeline replaced, which it never updates. ``opt.step()`` then skips
them without a word (a parameter without a gradient is left alone), and the
checkpoint is the first to notice.

:func:`watch` remembers, for each pipeline built in this process, the parameters of
the model it was given (weak references: nothing is kept alive); a global
optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
checks every optimizer at its first ``step()`` (``check``): one that holds any of
them that this rank's pipeline does not train is refused, naming the parameter and
the fix. Each optimizer is checked once; the hook then costs one set lookup per step.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["original_parameters", "watch", "check"]

#: A parameter of the model given to ``PipeDream``: its id -> (weak reference, name).
Originals = Dict[int, Tuple["weakref.ref[torch.Tensor]", str]]


@dataclasses.dataclass
class _Watched:
    rank: int
    originals: Originals


#: This process's pipelines (their ``pipe.module``) and the parameters of their models.
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, _Watched]" = weakref.WeakKeyDictionary()
#: Optimizers that passed their check.
_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOK: Optional[Any] = None


def original_parameters(model: nn.Module) -> Originals:
    """The parameters of ``model`` as the user gave it, before the pipeline replaced
    any (call before building)."""
    return {id(p): (weakref.ref(p), name)
            for name, p in model.named_parameters(remove_duplicate=False)}


def watch(module: nn.Module, originals: Originals, rank: int) -> None:
    """Checks every optimizer's first step against this pipeline from now on.

    Args:
        module: the pipeline's module on this rank (``pipe.module``: what
            ``pipe.parameters()`` yields).
        originals: :func:`original_parameters` of the model given to ``PipeDream``.
        rank: this rank, for messages.
    """
    global _HOOK
    _WATCHED[module] = _Watched(rank, originals)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(
            lambda optimizer, _args, _kwargs: check(optimizer))


def check(optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer holding a parameter of a pipelined model that this rank's
    pipeline does not train (once per optimizer; passes are remembered).

    Raises:
        ValueError: naming the parameter, why the pipeline does not train it, and
            ``opt = torch.optim.AdamW(pipe.parameters(), ...)``.
    """
    if optimizer in _CHECKED:
        return
    held = [p for group in optimizer.param_groups for p in group["params"]]
    pipelines = list(_WATCHED.items())
    # Trained by any pipeline of this process (two pipelines may share a model).
    trained = {id(p) for module, _ in pipelines for p in module.parameters()}
    for module, watched in pipelines:
        foreign = [(p, watched.originals[id(p)][1]) for p in held
                   if id(p) in watched.originals and id(p) not in trained and
                   watched.originals[id(p)][0]() is p]
        if foreign:
            raise ValueError(_message(foreign, watched.rank, module, len(held)))
    _CHECKED.add(optimizer)


def _message(foreign: List[Tuple[torch.Tensor, str]], rank: int, module: nn.Module,
             held: int) -> str:
    p, name = foreign[0]
    names = {n for n, _ in module.named_parameters()}
    why = ("a meta-device tensor, which the pipeline replaced when it initialised this "
           "rank's layers" if p.is_meta else
           "replaced by the pipeline's own tensor (moved, materialised or sharded)"
           if name in names else "a layer of another rank's stage, trained there")
    return (f"rank {rank}: the optimizer holds {len(foreign)} of its {held} parameters from the "
            f"model given to PipeDream that this rank's pipeline does not train, e.g. {name!r} "
            f"({why}); opt.step() would leave them and the pipeline's weights alone. Build the "
            "optimizer after PipeDream from the pipeline's parameters: opt = "
            "torch.optim.AdamW(pipe.parameters(), ...) (param groups: pipe.named_parameters())")
