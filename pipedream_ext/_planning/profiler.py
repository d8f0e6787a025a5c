"""Per-layer profiling of an ``nn.Sequential`` on stock PyTorch.

Each layer runs on a detached copy of its input, so autograd can replay every
layer's backward on its own and time it (PipeDream needed a patched PyTorch for
this). Times are wall clock on CPU and CUDA events on GPU, the median over
``steps`` measured iterations after ``warmup`` unmeasured ones.

The result is a chain in PipeDream's ``graph.txt`` format: ``node1`` is the
Input, ``node{i+2}`` is layer ``i``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from .. import _C

__all__ = ["profile"]

log = logging.getLogger(__name__)

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return list(x)
    raise ValueError(
        f"layer output of type {type(x).__name__} is not supported; layers of the "
        "nn.Sequential must return a tensor or a tuple of tensors"
    )


def _detach(x: Any) -> Any:
    def one(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        if d.is_floating_point() or d.is_complex():
            d.requires_grad_(True)
        return d

    if isinstance(x, torch.Tensor):
        return one(x)
    return type(x)(one(t) for t in x)


def _bytes(x: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(x)))


class _Timer:
    """Wall clock on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: List[Any] = []

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> Callable[[], float]:
        """Returns a thunk giving milliseconds (valid after :meth:`sync`)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return lambda: float(start.elapsed_time(end))
        elapsed = (time.perf_counter() - start) * 1e3
        return lambda: elapsed

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@contextlib.contextmanager
def _preserved(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Runs the body with ``modules`` in train mode and puts back every module's mode,
    buffers (BatchNorm's running statistics), gradients and the RNG state (dropout), so
    profiling on rank 0 leaves its model as every other rank has it."""
    mods = list({id(m): m for root in modules for m in root.modules()}.values())
    modes = [(m, m.training) for m in mods]
    buffers = {id(b): (b, b.detach().clone()) for m in mods for b in m.buffers(recurse=False)}
    params = {id(p): p for m in mods for p in m.parameters(recurse=False)}.values()
    grads = [(p, p.grad) for p in params]
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            for m in mods:
                m.training = True
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers.values():
                b.copy_(saved)
        for m, mode in modes:
            m.training = mode
        for p, g in grads:
            p.grad = g


def profile(
    module: nn.Module,
    sample_input: Tensors,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    target: Any = None,
    steps: int = 20,
    warmup: int = 5,
    output: Optional[Union[str, "os.PathLike[str]"]] = None,
    progress: bool = False,
    **traced: Any,
) -> "_C.ProfileGraph":
    """Measures every layer of ``module`` and returns its profile graph.

    An ``nn.Sequential`` is profiled child by child (a chain). Any other module is
    traced with torch.fx and profiled as a DAG of groups of operations, with an edge
    for every value one group passes another (skip connections included):
    ``_graph_profile.profile_traced``, docs/tracing.md.

    Args:
        module: the model, already on its device.
        sample_input: one minibatch (a tensor or tuple of tensors) on that device.
        loss_fn: ``loss_fn(output, target)``; ``None`` backpropagates
            ``output.sum()``. Its time is added to the last layer.
        target: the loss target.
        steps: measured iterations (the median is reported).
        warmup: unmeasured iterations first.
        output: where to write ``graph.txt`` (optional).
        progress: show a tqdm progress bar.
        **traced: for a traced model only: ``concrete_args``, ``max_groups``, ``depth``.

    Returns:
        The profile: an Input node then one node per layer (or group) with forward
        and backward milliseconds, output activation bytes and weight bytes. The
        model's modes, buffers (BatchNorm statistics), gradients and RNG state are
        left as they were.

    Raises:
        ValueError: bad arguments, a layer output that is not tensors, or a model
            torch.fx cannot trace.
    """
    if not isinstance(module, nn.Sequential):
        from .graph_profile import profile_traced

        return profile_traced(module, sample_input, loss_fn, target, steps, warmup, output,
                              progress, **traced)
    if traced:
        raise ValueError(f"{sorted(traced)} only apply to traced models (not an nn.Sequential)")
    if len(module) == 0:
        raise ValueError("the nn.Sequential is empty; give it at least one layer")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    first = _tensors(sample_input)[0]
    device = first.device
    timer = _Timer(device)
    layers = list(module)
    fwd: List[List[float]] = [[] for _ in layers]
    bwd: List[List[float]] = [[] for _ in layers]
    act_bytes = [0.0] * len(layers)
    iterator: Any = range(warmup + steps)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="profile", unit="step")
    with _preserved([module], device):
        for step in iterator:
            measure = step >= warmup
            for p in module.parameters():
                p.grad = None
            inputs: List[Any] = []
            outputs: List[Any] = []
            f_thunks: List[Callable[[], float]] = []
            h: Any = sample_input
            for i, layer in enumerate(layers):
                x = _detach(h)
                t0 = timer.start()
                y = layer(*x) if isinstance(x, (tuple, list)) else layer(x)
                if i == len(layers) - 1:
                    loss = loss_fn(y, target) if loss_fn is not None else None
                f_thunks.append(timer.stop(t0))
                act_bytes[i] = _bytes(y)
                inputs.append(x)
                outputs.append(y)
                h = y
            b_thunks: List[Optional[Callable[[], float]]] = [None] * len(layers)
            grads: Optional[List[Optional[torch.Tensor]]] = None
            for i in reversed(range(len(layers))):
                outs = _tensors(outputs[i])
                t0 = timer.start()
                if i == len(layers) - 1:
                    root = loss if loss is not None else sum(o.float().sum() for o in outs if o.requires_grad)
                    if isinstance(root, torch.Tensor) and root.requires_grad:
                        root.backward()
                else:
                    pairs = [
                        (o, g) for o, g in zip(outs, grads or []) if o.requires_grad and g is not None
                    ]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                b_thunks[i] = timer.stop(t0)
                grads = [t.grad for t in _tensors(inputs[i])]
            timer.sync()
            if measure:
                for i in range(len(layers)):
                    fwd[i].append(f_thunks[i]())
                    bwd[i].append(b_thunks[i]() if b_thunks[i] is not None else 0.0)

    graph = _C.ProfileGraph()
    graph.add_node("node1", "Input", 0.0, 0.0, _bytes(sample_input), 0.0)
    prev = "node1"
    for i, layer in enumerate(layers):
        desc = " ".join(str(layer).split()).replace(" -- ", " - ")
        params = float(sum(p.numel() * p.element_size() for p in layer.parameters()))
        node = f"node{i + 2}"
        graph.add_node(
            node, desc, statistics.median(fwd[i]), statistics.median(bwd[i]), act_bytes[i], params
        )
        graph.add_edge(prev, node)
        prev = node
    log.info("profiled %d layers over %d steps on %s", len(layers), steps, device)
    if output is not None:
        graph.save(os.fspath(output))
    return graph
