"""The split backward (csrc/runtime/split_backward.h) in one process.

I computes the input gradients and W the weight gradients; together they must
equal one full backward, and W must not run the input path again. A counting
identity (``Probe``) placed on the activation path counts how often autograd runs
that part of the graph in each pass: on the input path only I may run it, on a
weight branch only W.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import nn

from pipedream_ext import _C

Stage = Callable[[Sequence[torch.Tensor]], Tuple[torch.Tensor, ...]]


class Probe(torch.autograd.Function):
    """Identity whose backward counts its calls under ``name``."""

    calls: Dict[str, int] = {}

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        Probe.calls[ctx.name] = Probe.calls.get(ctx.name, 0) + 1
        return grad, None


def probe(x: torch.Tensor, name: str) -> torch.Tensor:
    return Probe.apply(x, name)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        h = probe(torch.relu(self.a(x)), "path1")
        h = probe(torch.tanh(self.b(h)), "path2")
        return (self.c(h),)


class Branches(nn.Module):
    """Two branches with their own weights joined in the stage, a weight on a
    branch behind a probe, and a parameter added directly (a bias-like leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(6, 6), nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6))
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        weighted = probe(self.scale * 2.0, "weight-branch")
        h = torch.relu(self.left(x)) * torch.sigmoid(self.right(x)) + weighted
        return (self.out(probe(h, "path")),)


class Tied(nn.Module):
    """One Linear used twice on the input path: its weight's branches leave the
    input path at two nested frontier nodes; in W the upper one must not pass
    gradient down to the lower one again (its edges into the input path are cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.mid = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        h = torch.tanh(self.shared(x))
        h = torch.relu(self.mid(h))
        return (self.shared(h),)


class TupleOut(nn.Module):
    """Two outputs with their own gradients, one of them independent of the input
    (a positional-embedding-like parameter passed downstream)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.pos = nn.Parameter(torch.randn(3, 6))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        h = torch.relu(self.body(x))
        return h, self.head(probe(self.pos, "param-only")) * 1.5


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        h = torch.relu(self.bn(self.conv1(x)))
        return (torch.flatten(h + self.conv2(h), 1),)


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    "chain": (Chain, (3, 6)),
    "branches": (Branches, (3, 6)),
    "tied": (Tied, (3, 6)),
    "tuple": (TupleOut, (3, 6)),
    "conv": (Conv, (2, 2, 5, 5)),
}


def run(model: nn.Module, shape: Tuple[int, ...], input_grad: bool, split: bool,
        seed: int = 0, autocast: Optional[torch.dtype] = None
        ) -> Tuple[List[Optional[torch.Tensor]], List[torch.Tensor], Dict[str, Dict[str, int]]]:
    """Input gradients, weight gradients and probe calls per pass ("I", "W" or "B")."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).requires_grad_(input_grad)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        outs = model(x)
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    weights = [p for p in model.parameters()]
    calls: Dict[str, Dict[str, int]] = {}
    if split:
        state = _C.SplitBackward()
        Probe.calls = {}
        dx = state.input_pass(list(outs), grads, [x], weights)
        calls["I"], Probe.calls = Probe.calls, {}
        state.weight_pass()
        calls["W"] = Probe.calls
    else:
        Probe.calls = {}
        torch.autograd.backward(list(outs), grads)
        calls["B"] = Probe.calls
        dx = [x.grad]
    return list(dx), [p.grad.clone() for p in weights], calls


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("input_grad", [True, False], ids=["middle-stage", "first-stage"])
def test_split_backward_equals_the_full_backward(name: str, input_grad: bool) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(1)
    model = make()
    full_dx, full_dw, full_calls = run(model, shape, input_grad, split=False)
    dx, dw, calls = run(model, shape, input_grad, split=True)
    if input_grad:
        assert torch.equal(dx[0], full_dx[0])
    else:
        assert dx == [None]
    for (pname, _), a, b in zip(model.named_parameters(), dw, full_dw):
        assert torch.equal(a, b), (pname, (a - b).abs().max())
    # Every probe ran as often as in one full backward, all passes together ...
    total = {k: calls["I"].get(k, 0) + calls["W"].get(k, 0) for k in full_calls["B"]}
    assert total == full_calls["B"], calls
    # ... and the input path in I only, when there is one.
    for probe_name in full_calls["B"]:
        on_path = probe_name.startswith("path")
        if input_grad and on_path:
            assert calls["W"].get(probe_name, 0) == 0, (probe_name, calls)
        if not on_path:
            assert calls["I"].get(probe_name, 0) == 0, (probe_name, calls)


def test_first_stage_w_is_the_whole_backward() -> None:
    """No input gradient wanted: I runs nothing, W everything, in one group."""
    torch.manual_seed(2)
    model = Chain()
    _, _, calls = run(model, (3, 6), input_grad=False, split=True)
    assert calls["I"] == {} and calls["W"] == {"path1": 1, "path2": 1}


def test_autocast_split_equals_full() -> None:
    torch.manual_seed(3)
    model = Branches()
    full_dx, full_dw, _ = run(model, (3, 6), True, split=False, autocast=torch.bfloat16)
    dx, dw, _ = run(model, (3, 6), True, split=True, autocast=torch.bfloat16)
    assert torch.equal(dx[0], full_dx[0])
    for a, b in zip(dw, full_dw):
        assert torch.equal(a, b)


def test_w_starts_at_the_frontier() -> None:
    """A chain of three Linear layers: each layer's addmm node is where its weight
    and bias branches leave the input path, so W starts at those three nodes."""
    torch.manual_seed(4)
    model = Chain()
    x = torch.randn(3, 6, requires_grad=True)
    (out,) = model(x)
    state = _C.SplitBackward()
    state.input_pass([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert state.num_frontier_nodes == 3
    state.weight_pass()
    assert all(p.grad is not None for p in model.parameters())


def test_w_finds_the_weights_its_graph_used() -> None:
    """Weights not passed to I (FSDP2 runs the forward on unsharded copies of the
    parameters the executor holds) still get their gradients in W, equal to a full
    backward's, and the input gradient is unchanged."""
    torch.manual_seed(5)
    model = Chain()
    x = torch.randn(3, 6, requires_grad=True)
    (out,) = model(x)
    g = torch.randn_like(out)
    full_dx, *full_dw = torch.autograd.grad(out, [x, *model.parameters()], g, retain_graph=True)
    state = _C.SplitBackward()
    (dx,) = state.input_pass([out], [g], [x], [])
    assert all(p.grad is None for p in model.parameters())  # I accumulates nothing
    state.weight_pass()
    assert torch.equal(dx, full_dx)
    for p, expected in zip(model.parameters(), full_dw):
        assert torch.equal(p.grad, expected)
    assert x.grad is None  # the input is not a weight


class TwoLayers(nn.Module):
    """Linear, tanh, Linear: the input path runs through both addmm nodes (frontier
    nodes) and the tanh node between them (an input-path node W never runs). The
    first layer's weight passes through ``Check`` on its way to the weight, which W
    runs after that layer's addmm node."""

    def __init__(self, check: Callable[[], None]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5)
        self.check = check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.linear(x, Check.apply(self.a.weight, self.check), self.a.bias)
        self.hidden = hidden
        return self.b(torch.tanh(hidden))


class Check(torch.autograd.Function):
    """Identity whose backward first calls ``check()``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, check: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.check = check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.check()
        return grad, None


def test_i_frees_the_saved_tensors_of_input_path_nodes_w_does_not_run() -> None:
    """A full backward frees each node's saved tensors once it has run, so the
    gradients computed after it reuse that memory; I must do the same for the
    input-path nodes W never runs (here tanh's output), keeping only what W needs
    (the addmm nodes' inputs), or the rest of I and W take fresh pages instead."""
    torch.manual_seed(6)
    model = TwoLayers(lambda: None)
    x = torch.randn(3, 6, requires_grad=True)
    out = model(x)
    second = out.grad_fn  # the second layer's addmm: a frontier node
    tanh = second.next_functions[1][0]
    assert type(tanh).__name__ == "TanhBackward0"
    tanh._saved_result  # noqa: B018 - held before I
    state = _C.SplitBackward()
    state.input_pass([out], [torch.ones_like(out)], [x], list(model.parameters()))
    with pytest.raises(RuntimeError, match="freed"):
        tanh._saved_result  # noqa: B018
    assert second._saved_mat1 is not None  # W still needs it
    state.weight_pass()
    with pytest.raises(RuntimeError, match="freed"):
        second._saved_mat1  # noqa: B018 - W frees what it ran


def test_w_frees_each_captured_gradient_once_its_frontier_node_has_run() -> None:
    """The gradient I captured at a frontier node must go once W has run that node,
    as in a full backward, not at the end of W: the weight gradients computed after
    it reuse its memory. ``Check`` runs in W after the first layer's addmm node and
    looks whether the gradient captured there still exists."""
    torch.manual_seed(7)
    captured: List[weakref.ref] = []
    alive_in_w: List[bool] = []
    model = TwoLayers(lambda: alive_in_w.append(captured[0]() is not None))
    x = torch.randn(3, 6, requires_grad=True)
    out = model(x)
    model.hidden.register_hook(lambda grad: captured.append(weakref.ref(grad)) and None)
    state = _C.SplitBackward()
    state.input_pass([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert len(captured) == 1 and captured[0]() is not None  # held for W
    state.weight_pass()
    assert alive_in_w == [False]
    assert model.a.weight.grad is not None
