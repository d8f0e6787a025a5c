"""Tensor parallelism inside pipeline stages: ``PipeDream(tensor_parallel=...)``.

Owns what a ``("pp", "dp", "tp")`` mesh's ``tp`` dimension does to this rank's
stages. A plan is torch's: ``{pattern: ParallelStyle}`` with fnmatch patterns over
the original model's module names (``*`` one name component, as
``torch.distributed.tensor.parallel.parallelize_module`` reads them), or a callable
``fn(stage_module, tp_mesh)``. An ``nn.Sequential``'s stage keeps the original
child names (``"3.attn.wq"``), so ``parallelize_module(stage, tp_mesh, plan)`` gives
each stage's modules exactly what ``parallelize_module(model, tp_mesh, plan)`` gives
them in the unsplit model; a pattern matching no module of any stage is refused.

Before the plan is applied every stage's parameters and buffers are broadcast from
tp rank 0 (as DDP broadcasts rank 0's), so the tp ranks start from one model; the
styles then shard (or replicate) from those values. What crosses a cut must be a
plain tensor replicated over tp (``RowwiseParallel``'s default output): a
``DTensor`` returned by a stage is refused by name (sequence parallelism across cuts
is not supported yet).
"""
from __future__ import annotations

import fnmatch
import re
import warnings
from typing import Any, Dict, List, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import schedules
from .._dist import collectives

__all__ = ["TensorParallel", "check_option", "describe_plan",
           "local", "matched_patterns", "refuse_unsupported", "sequence_parallel"]

def _qualified(value: Any) -> str:
    """A function's (or class's) qualified name, else its type's."""
    named = value if hasattr(value, "__qualname__") else type(value)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _setting(value: Any) -> str:
    """``repr(value)`` without memory addresses (a function's differs between processes)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def describe_plan(plan: Any) -> Any:
    """The JSON value ranks compare at construction: each pattern's style class and its
    settings (``repr`` of its attributes), or a callable's qualified name.

    Args:
        plan: the ``tensor_parallel`` value (checked), or ``None``.

    Returns:
        ``None``, ``{pattern: {"style": ..., "settings": {...}}}`` or ``{"callable": name}``.
    """
    if plan is None:
        return None
    if isinstance(plan, Mapping):
        return {str(k): {"style": _qualified(v),
                         "settings": {a: _setting(x) for a, x in sorted(vars(v).items())}}
                for k, v in sorted(plan.items())}
    return {"callable": _qualified(plan)}


def check_option(plan: Any, options: Any) -> None:
    """``PipelineOptions.tensor_parallel``'s check (no process group needed).

    Raises:
        ValueError: a plan that is neither a dict of ``ParallelStyle`` nor a callable, or
            what it does not support yet (an asynchronous schedule: its weight stashing of
            DTensor shards; ``split_points``, ``recompute``, ``autocast``), naming the value
            and the fix.
    """
    if plan is None:
        return
    from torch.distributed.tensor.parallel import ParallelStyle  # noqa: PLC0415 - only with tp

    if isinstance(plan, Mapping):
        for key, style in plan.items():
            if not isinstance(key, str) or not isinstance(style, ParallelStyle):
                raise ValueError(
                    f"tensor_parallel[{key!r}] = {style!r}: a plan maps module-name patterns "
                    "(str, e.g. '*.attn.wq') to torch ParallelStyles (ColwiseParallel(), "
                    "RowwiseParallel(), ...)")
    elif not callable(plan):
        raise ValueError(f"tensor_parallel={plan!r}; give a dict {{pattern: ParallelStyle}} or a "
                         "callable fn(stage_module, tp_mesh)")
    unsupported = [
        (schedules.traits(options.schedule).asynchronous, f"schedule={options.schedule!r}",
         f"use schedule= one of {', '.join(schedules.synchronous_names())}"),
        (options.split_points is not None, f"split_points={list(options.split_points or [])}",
         "use an nn.Sequential (balance=[...] or an even split)"),
        (bool(options.recompute), "recompute=True", "drop recompute"),
        (options.autocast is not None, f"autocast={options.autocast!r}", "drop autocast"),
    ]
    for bad, what, fix in unsupported:
        if bad:
            raise ValueError(f"tensor_parallel with {what} is not supported yet; {fix}")


def refuse_unsupported(enabled: bool, module: nn.Module, deferred: bool,
                       shared: Sequence[Any]) -> None:
    """What tensor parallelism does not support yet, refused before any stage is built.

    Args:
        enabled: whether ``tensor_parallel`` was given (``False``: nothing to refuse).
        module: the model.
        deferred: whether the model is on the meta device.
        shared: its parameters tied across stages.

    Raises:
        ValueError: a model that is not an ``nn.Sequential``, a meta-device model, or a
            parameter tied across stages, naming it and the fix.
    """
    if not enabled:
        return
    if not isinstance(module, nn.Sequential):
        raise ValueError(f"tensor_parallel with a {type(module).__name__} (a traced model) is not "
                         "supported yet; use an nn.Sequential whose children keep the plan's "
                         "module names")
    if deferred:
        raise ValueError("tensor_parallel with a meta-device model is not supported yet; build "
                         "the model with real tensors")
    if shared:
        raise ValueError(f"tensor_parallel with parameter {shared[0]} tied across stages is not "
                         "supported yet; untie it or put its uses on one stage with balance=[...]")


def sequence_parallel(plan: Any) -> bool:
    """Whether ``balance="auto"`` plans ``plan`` with sequence parallelism (activations
    divided by tp): a dict plan with torch's ``SequenceParallel`` style (torchtitan's SP
    plans put it on the norms); a callable's styles cannot be seen, so it is planned
    without SP (activations whole: a plan that fits then fits with SP too)."""
    from torch.distributed.tensor.parallel import SequenceParallel  # noqa: PLC0415 - only with tp

    return isinstance(plan, Mapping) and any(isinstance(v, SequenceParallel) for v in plan.values())


def _matches(pattern: str, name: str) -> bool:
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms))


def matched_patterns(plan: Mapping[str, Any], module: nn.Module) -> List[str]:
    """The plan's patterns that name a module of ``module`` (as ``parallelize_module``
    matches them: one fnmatch per name component)."""
    names = [n for n, _ in module.named_modules() if n]
    return [k for k in plan if any(_matches(k, n) for n in names)]


def _is_dtensor(value: Any) -> bool:
    return hasattr(value, "device_mesh") and hasattr(value, "placements") and hasattr(value, "to_local")


class _RefuseDTensorOutput:
    """A stage's forward hook: a ``DTensor`` output (a sharded activation) cannot cross
    a cut yet."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> None:
        flat = output if isinstance(output, (tuple, list)) else (output,)
        for k, value in enumerate(flat):
            if _is_dtensor(value):
                raise ValueError(
                    f"stage {self.stage} returns a DTensor (output {k}, placements "
                    f"{tuple(value.placements)}): tensor_parallel sends plain tensors replicated "
                    "over tp across cuts; a DTensor (or sequence-parallel) output at a cut is not "
                    "supported yet; end the stage with a style whose output is a local replicated "
                    "tensor (RowwiseParallel(), or use_local_output=True with "
                    "output_layouts=Replicate())")


class TensorParallel:
    """Applies a plan to this rank's stages over the tp mesh.

    Args:
        plan: the ``tensor_parallel`` value.
        tp_mesh: the 1-D mesh over this rank's tp group.
        pp_group: this rank's pipeline's group (to agree on the matched patterns).
    """

    def __init__(self, plan: Any, tp_mesh: Any, pp_group: dist.ProcessGroup) -> None:
        self.plan, self.tp_mesh, self.pp_group = plan, tp_mesh, pp_group

    def apply(self, stages: Mapping[int, nn.Module]) -> None:
        """Broadcasts each stage from tp rank 0 and parallelizes it; collective over
        the tp and pp groups.

        Raises:
            ValueError: a plan pattern that names no module of any stage (on every rank).
        """
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415 - only with tp

        group = self.tp_mesh.get_group()
        matched: Dict[str, None] = {}
        for j, module in stages.items():
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    collectives.broadcast_data(t.detach(), 0, group)
            if isinstance(self.plan, Mapping):
                keys = matched_patterns(self.plan, module)
                matched.update(dict.fromkeys(keys))
                if keys:
                    with warnings.catch_warnings():
                        # "*" is tried against every child; what a pattern matches is
                        # checked here over every stage (_refuse_unmatched) instead.
                        warnings.filterwarnings("ignore", message="Parallelize plan key .* could "
                                                "not be resolved")
                        parallelize_module(module, self.tp_mesh, {k: self.plan[k] for k in keys})
            else:
                self.plan(module, self.tp_mesh)
            module.register_forward_hook(_RefuseDTensorOutput(j))
        if isinstance(self.plan, Mapping):
            self._refuse_unmatched(list(matched))

    def _refuse_unmatched(self, matched: List[str]) -> None:
        found = {k for keys in collectives.all_gather_json(matched, self.pp_group) for k in keys}
        missing = [k for k in self.plan if k not in found]
        if missing:
            raise ValueError(
                f"tensor_parallel pattern{'s' if len(missing) > 1 else ''} "
                f"{', '.join(repr(k) for k in missing)} match{'es' if len(missing) == 1 else ''} no "
                "module of any stage; patterns are fnmatch patterns over the original model's "
                "module names (model.named_modules(), '*' one name component), e.g. '*.attn.wq'")


def local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard, or ``t``."""
    return t.to_local() if _is_dtensor(t) else t
