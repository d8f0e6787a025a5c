"""A callable tensor-parallel plan as the dict it amounts to: :func:`recorded_plan`.

A traced model's stages call only the modules a plan names (everything else is traced
through, so a style applied to it would never run), and a torchtitan-style parallelize
function (``apply_tp(model, tp_mesh)``) walks the whole model's structure, which a stage
does not have. So a callable plan given with ``split_points`` is run once, before
tracing, on a copy of the model whose tensors are on the meta device (no memory, no
data), with every ``ParallelStyle``'s ``_apply`` recording ``(module, style)`` instead
of applying it: no communication, nothing changed. What it recorded, by the modules'
qualified names, is a dict plan that ``parallelize_module`` applies per stage exactly as
the callable would have applied it to the whole model.

Refused, naming the callable and what it did: a plan that applies no style, one that
applies a style to the whole model or to a module it created, two styles to one module,
or that changes anything else of the model (hooks of its own, attributes, submodules):
the recording could not replay that per stage.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

from .tensor_parallel import qualified_name

__all__ = ["recorded_plan"]


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device
    (their data is never copied)."""
    memo: Dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _state(module: nn.Module) -> Dict[str, Any]:
    """What a plan may not change besides its styles: per module, its type, hooks,
    children, tensors and plain attributes."""
    out: Dict[str, Any] = {}
    for name, m in module.named_modules():
        plain = {k: repr(v) for k, v in vars(m).items()
                 if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, type(None)))}
        hooks = [len(getattr(m, h)) for h in ("_forward_pre_hooks", "_forward_hooks",
                                              "_backward_hooks", "_backward_pre_hooks")]
        tensors = {k: (type(t).__name__, tuple(t.shape)) for k, t in
                   list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))}
        children = [n for n, _ in m.named_children()]
        out[name or "(the model)"] = (type(m).__qualname__, hooks, children, tensors, plain)
    return out


def _styles() -> List[type]:
    """Every ``ParallelStyle`` class defined so far."""
    from torch.distributed.tensor.parallel import ParallelStyle  # noqa: PLC0415 - only with tp

    found, todo = [], [ParallelStyle]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@contextlib.contextmanager
def _recording(calls: List[Tuple[nn.Module, Any]]) -> Iterator[None]:
    """Every ``ParallelStyle._apply`` (of classes defined before or during the block)
    appends ``(module, style)`` to ``calls`` and leaves the module as it is."""
    from torch.distributed.tensor.parallel import ParallelStyle  # noqa: PLC0415 - only with tp

    def record(self: Any, module: nn.Module, device_mesh: Any) -> nn.Module:
        calls.append((module, self))
        return module

    patched: List[Tuple[type, Any]] = []

    def patch(cls: type) -> None:
        if "_apply" in vars(cls):
            patched.append((cls, vars(cls)["_apply"]))
            cls._apply = record  # type: ignore[attr-defined]

    original_init_subclass = vars(ParallelStyle).get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:  # a style the plan defines as it runs
        super(ParallelStyle, cls).__init_subclass__(**kwargs)
        patch(cls)

    try:
        for cls in _styles():
            patch(cls)
        ParallelStyle.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        yield
    finally:
        for cls, method in reversed(patched):
            cls._apply = method  # type: ignore[attr-defined]
        if original_init_subclass is None:
            del ParallelStyle.__init_subclass__
        else:
            ParallelStyle.__init_subclass__ = original_init_subclass  # type: ignore[assignment]


def recorded_plan(plan: Callable[[nn.Module, Any], Any], module: nn.Module,
                  tp_mesh: Any) -> Dict[str, Any]:
    """The dict plan a callable amounts to (module docstring).

    Args:
        plan: ``fn(model, tp_mesh)``, e.g. torchtitan's ``apply_tp`` with its other
            arguments bound.
        module: the whole (unsplit) model; not changed.
        tp_mesh: the tp mesh the plan is given.

    Returns:
        ``{qualified module name: ParallelStyle}``, in the order the plan applied them.

    Raises:
        ValueError: the plan applied no style, a style to the whole model or to a module
            not in it, two styles to one module, or changed the model otherwise.
    """
    name = qualified_name(plan)
    clone = _meta_copy(module)
    names = {id(m): n for n, m in clone.named_modules()}
    before = _state(clone)
    calls: List[Tuple[nn.Module, Any]] = []
    with _recording(calls), torch.no_grad():
        plan(clone, tp_mesh)
    fix = ("a traced model's stages replay a callable plan's styles module by module; give a dict "
           "{module name pattern: ParallelStyle} instead (docs/guide/tensor_parallel.md)")
    after = _state(clone)
    changed = [k for k in after if before.get(k) != after[k]] + [k for k in before if k not in after]
    if changed:
        raise ValueError(f"tensor_parallel={name} changed {changed[:3]} of the model besides "
                         f"applying ParallelStyles (hooks, attributes, submodules or tensors); {fix}")
    if not calls:
        raise ValueError(f"tensor_parallel={name} applied no ParallelStyle to the model (given "
                         "the whole model, as torchtitan's parallelize functions are); give a plan "
                         "that calls parallelize_module, or drop tensor_parallel")
    recorded: Dict[str, Any] = {}
    for target, style in calls:
        where = names.get(id(target))
        if not where:
            what = "the whole model" if where == "" else f"a {type(target).__name__} not in the model"
            raise ValueError(f"tensor_parallel={name} applies {type(style).__name__} to {what}; {fix}")
        if where in recorded:
            raise ValueError(f"tensor_parallel={name} applies two styles to {where!r} "
                             f"({type(recorded[where]).__name__}, then {type(style).__name__}); {fix}")
        recorded[where] = style
    return recorded
