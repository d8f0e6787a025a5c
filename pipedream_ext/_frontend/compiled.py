"""A model wrapped by ``torch.compile`` before ``PipeDream``: each stage compiled instead.

``torch.compile(model)`` returns an ``OptimizedModule`` holding the model as its only
child (``_orig_mod``): every name gains the prefix ``_orig_mod.`` and the compiled
function is the whole model's forward, which a pipeline never calls (a rank runs only
its stages, one microbatch at a time). So the pipeline is built on the original
module (:func:`unwrap_compiled`): split points, errors, ``state_dict`` and checkpoints
use the model's own names. Then every stage module this rank keeps is compiled in
place (:func:`compile_stage`) with the wrapper's own dynamo context, i.e. the user's
``torch.compile`` settings (backend, ``mode``, ``options``, ``fullgraph``,
``dynamic``): regional compilation, one compiled region per stage, whose backward
AOTAutograd compiles too. The module objects stay the same, so the optimizer,
checkpoints and the executor see the same parameters as without compilation.

A split backward (zero-bubble schedules: I, then W from the same graph) runs each
compiled region's backward with the graph kept, which AOTAutograd refuses for a
backward compiled with donated buffers (saved tensors it may overwrite, so the W pass
would read clobbered ones): :func:`split_backward_compiles` turns them off around the
step, as torch's error message says, for what compiles in it and for the check.

Design and limits: docs/tracing.md#torchcompile.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["COMPILED_PREFIX", "unwrap_compiled", "strip_compiled_prefix", "compile_stage",
           "split_backward_compiles"]

#: What ``torch.compile``'s wrapper adds in front of every name of the model it wraps.
COMPILED_PREFIX = "_orig_mod."

#: ``context(fn)``: ``fn`` compiled with one ``torch.compile`` call's settings.
CompileContext = Callable[[Callable[..., Any]], Callable[..., Any]]


def unwrap_compiled(module: nn.Module) -> Tuple[nn.Module, Optional[CompileContext]]:
    """The model inside a ``torch.compile`` wrapper, and the wrapper's compile settings.

    Args:
        module: what the user gave ``PipeDream``.

    Returns:
        ``(module, None)`` for a module that is no ``OptimizedModule``; else the
        original module and the dynamo context that compiled it (nested wrappers:
        the innermost module, the outermost settings).

    Raises:
        ValueError: a model compiled in place (``model.compile()``), whose settings
            cannot be read back: naming ``torch.compile(model, ...)``.
    """
    if getattr(module, "_compiled_call_impl", None) is not None:
        raise ValueError(
            f"{type(module).__name__}.compile() compiled the whole model's call, which a pipeline "
            "never makes (each rank runs its stages, one microbatch at a time); compile it with "
            "model = torch.compile(model, ...) instead, and PipeDream compiles every stage with "
            "those settings (docs/tracing.md#torchcompile)")
    # Only a process that called torch.compile has imported dynamo (costly to import).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return module, None
    context = module.dynamo_ctx
    while isinstance(module, eval_frame.OptimizedModule):
        module = module._orig_mod  # noqa: SLF001 - torch.compile's wrapper holds the model here
    return module, context


def strip_compiled_prefix(names: Optional[Sequence[str]]) -> Optional[List[str]]:
    """Split points named inside the wrapper (``"_orig_mod.transformer.h.2"``) as
    the model names them (``"transformer.h.2"``)."""
    if names is None or isinstance(names, str):
        return names  # type: ignore[return-value]  # refused later, naming the value
    return [n[len(COMPILED_PREFIX):] if isinstance(n, str) and n.startswith(COMPILED_PREFIX)
            else n for n in names]


def compile_stage(module: nn.Module, context: CompileContext) -> None:
    """Compiles ``module``'s calls in place with ``context``, as ``module.compile()``
    does with ``torch.compile``'s arguments: the object, its parameters and their
    names stay the same.

    The compiled function is a frame of this file that calls the module: dynamo
    does not trace frames of ``torch.nn`` (``Module._call_impl``, ``nn.Sequential``'s
    forward) unless it inlines them from a frame it traces, which is why
    ``nn.Sequential(...).compile()`` compiles nothing and ``torch.compile``'s wrapper
    calls its module from such a frame too.
    """
    call = module._call_impl  # noqa: SLF001 - hooks included, as module(...) runs them

    def run(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    module._compiled_call_impl = context(run)  # noqa: SLF001 - what nn.Module.compile sets


@contextlib.contextmanager
def split_backward_compiles() -> Iterator[None]:
    """A context in which AOTAutograd compiles no donated buffers and lets a compiled
    backward run with the graph kept (``torch._functorch.config.donated_buffer=False``).

    Wraps a step of a schedule that splits the backward: the stages' forwards compile
    there (a compiled stage's first training call, and every recompile), so their
    backwards keep every saved tensor for the W pass, and the I pass checks the flag
    again. The executor runs the backward through the C++ engine, not
    ``torch.autograd``'s Python entry, so the context is stashed for the engine's
    device threads as that entry does (a CUDA backward runs there and reads it). A graph
    compiled with donated buffers before the pipeline is not recompiled (compile with
    ``torch.compile`` before ``PipeDream``, not after training with it). Without
    torch.compile in the process: nothing is changed.
    """
    # Only a process that called torch.compile has imported AOTAutograd's config.
    config = sys.modules.get("torch._functorch.config")
    if config is None:
        yield
        return
    with config.patch(donated_buffer=False):
        # torch.autograd's _engine_run_backward does the same for its device threads.
        torch._C._stash_obj_in_tls("context", contextvars.copy_context())  # noqa: SLF001 - torch internal
        try:
            yield
        finally:
            torch._C._remove_obj_from_tls("context")  # noqa: SLF001 - torch internal
