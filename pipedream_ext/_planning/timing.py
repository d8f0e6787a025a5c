"""Timing a layer's forward and backward, and leaving the model as it was.

Owns the clock profiling reads (wall clock on CPU, CUDA events on GPU) and the
context that puts back every module's mode, buffers, gradients and RNG state after
profiling, so the rank that profiled holds the model every other rank holds.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["Timer", "leaf_inputs", "preserved", "stage_input", "tensor_bytes"]


class Timer:
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


def leaf_inputs(value: Any) -> Any:
    """``value`` with every tensor detached, floating and complex ones as new autograd
    leaves: a layer timed on them runs its own backward only, not its producers'."""
    def one(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        if d.is_floating_point() or d.is_complex():
            d.requires_grad_(True)
        return d
    return pytree.tree_map_only(torch.Tensor, one, value)


def stage_input(value: Any) -> Any:
    """``value`` as a layer of the first stage receives it: what carries a gradient (made
    by parameters upstream) as fresh leaves (:func:`leaf_inputs`: the layer runs its own
    backward only); the rest (the model's data, what only data made) detached and
    without gradient, as stage 0 runs on the user's batch: its first layer computes no
    input gradient there (a ``Linear``'s backward is one matmul, not two), and no
    profile should count one."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value)):
        return leaf_inputs(value)
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def tensor_bytes(value: Any) -> float:
    """The bytes of every tensor in ``value`` (any nesting of containers)."""
    return float(sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
                     if isinstance(t, torch.Tensor)))


@contextlib.contextmanager
def preserved(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
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
