"""Per-layer profiling of an ``nn.Sequential`` on stock PyTorch.

Each layer runs on a detached copy of its input, so autograd can replay every
layer's backward on its own and time it (PipeDream needed a patched PyTorch for
this). Times are wall clock on CPU and CUDA events on GPU, the median over
``steps`` measured iterations after ``warmup`` unmeasured ones.

The result is a chain in PipeDream's ``graph.txt`` format: ``node1`` is the
Input, ``node{i+2}`` is layer ``i``.
"""
from __future__ import annotations

import logging
import os
import statistics
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from tqdm import tqdm

from .._extension import _C
from .timing import Timer, preserved, stage_input

__all__ = ["profile_sequential"]

log = logging.getLogger(__name__)

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
LossFn = Optional[Callable[[Any, Any], torch.Tensor]]


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return list(x)
    raise ValueError(
        f"layer output of type {type(x).__name__} is not supported; layers of the "
        "nn.Sequential must return a tensor or a tuple of tensors"
    )


def _bytes(x: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(x)))


def _forward(layers: List[nn.Module], sample_input: Any, loss_fn: LossFn, target: Any,
             timer: Timer, act_bytes: List[float]) -> Tuple[List[Any], List[Any], Any, list]:
    """One forward, layer by layer on detached inputs (``timing.stage_input``); returns
    inputs, outputs, loss, times."""
    inputs: List[Any] = []
    outputs: List[Any] = []
    f_thunks: List[Callable[[], float]] = []
    loss = None
    h: Any = sample_input
    for i, layer in enumerate(layers):
        x = stage_input(h)
        t0 = timer.start()
        y = layer(*x) if isinstance(x, (tuple, list)) else layer(x)
        if i == len(layers) - 1:
            loss = loss_fn(y, target) if loss_fn is not None else None
        f_thunks.append(timer.stop(t0))
        act_bytes[i] = _bytes(y)
        inputs.append(x)
        outputs.append(y)
        h = y
    return inputs, outputs, loss, f_thunks


def _backward(inputs: List[Any], outputs: List[Any], loss: Any, timer: Timer) -> list:
    """The backward of every layer on its own, last first, each fed the next one's input
    gradients; returns the time of each."""
    b_thunks: List[Optional[Callable[[], float]]] = [None] * len(inputs)
    grads: Optional[List[Optional[torch.Tensor]]] = None
    for i in reversed(range(len(inputs))):
        outs = _tensors(outputs[i])
        t0 = timer.start()
        if i == len(inputs) - 1:
            root = loss if loss is not None else sum(o.float().sum() for o in outs if o.requires_grad)
            if isinstance(root, torch.Tensor) and root.requires_grad:
                root.backward()
        else:
            pairs = [(o, g) for o, g in zip(outs, grads or []) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        b_thunks[i] = timer.stop(t0)
        grads = [t.grad for t in _tensors(inputs[i])]
    return b_thunks


def _chain_graph(layers: List[nn.Module], sample_input: Any, fwd: List[List[float]],
                 bwd: List[List[float]], act_bytes: List[float]) -> "_C.ProfileGraph":
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
    return graph


def profile_sequential(module: nn.Sequential, sample_input: Tensors, loss_fn: LossFn = None,
                       target: Any = None, steps: int = 20, warmup: int = 5,
                       output: Optional[Union[str, "os.PathLike[str]"]] = None,
                       progress: bool = False) -> "_C.ProfileGraph":
    """Profiles ``module`` child by child: arguments and result as for
    :func:`pipedream_ext.profile`.

    Raises:
        ValueError: an empty module, bad ``steps``/``warmup``, or a layer output that is
            not tensors.
    """
    if len(module) == 0:
        raise ValueError("the nn.Sequential is empty; give it at least one layer")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    device = _tensors(sample_input)[0].device
    timer = Timer(device)
    layers = list(module)
    fwd: List[List[float]] = [[] for _ in layers]
    bwd: List[List[float]] = [[] for _ in layers]
    act_bytes = [0.0] * len(layers)
    iterator: Any = range(warmup + steps)
    if progress:
        iterator = tqdm(iterator, desc="profile", unit="step")
    with preserved([module], device):
        for step in iterator:
            for p in module.parameters():
                p.grad = None
            inputs, outputs, loss, f_thunks = _forward(layers, sample_input, loss_fn, target,
                                                       timer, act_bytes)
            b_thunks = _backward(inputs, outputs, loss, timer)
            timer.sync()
            if step >= warmup:
                for i in range(len(layers)):
                    fwd[i].append(f_thunks[i]())
                    bwd[i].append(b_thunks[i]() if b_thunks[i] is not None else 0.0)
    graph = _chain_graph(layers, sample_input, fwd, bwd, act_bytes)
    log.info("profiled %d layers over %d steps on %s", len(layers), steps, device)
    if output is not None:
        graph.save(os.fspath(output))
    return graph
