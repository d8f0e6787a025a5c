"""Per-layer costs for the whole-configuration search: ``measure_layer_costs``.

Owns what the cost model of ``pipedream_ext.configuration`` needs to know of a model
(csrc/core/configure.h, ``LayerCost``): a chain of layers (an ``nn.Sequential``'s
children, or a traced model's groups (``graph_profile``) in graph order, which is
topological), each with its forward and backward seconds affine in the microbatch's
samples (``fixed + per_sample * b``, fitted from two or more microbatch sizes), the
share of its backward that is the weight gradient (zero-bubble schedules' W), the
bytes a cut after it sends, the bytes its backward keeps, its input's bytes and its
parameters' bytes.

How each number is measured (one process, no communication):

- times: every layer runs forward and backward on its own, on detached copies of
  its inputs (as ``sequential`` and ``graph_profile`` profile; the model's data and
  what only data made carry no gradient, as on stage 0: the first layer's backward
  has no input gradient to compute), the median over
  ``steps`` steps after ``warmup``, gradients accumulating as over a step's
  microbatches; the loss is timed with the last layer. The clock is the thread's CPU
  time when the layers compute on the CPU with one thread (as ranks run: immune to
  other processes on the cores), else ``timing.Timer``'s;
- weight share: each backward first runs for the inputs' gradients alone
  (``torch.autograd.grad`` with the graph kept: the I of split-backward schedules),
  then whole; the share is ``1 - I / B``;
- kept bytes: the storages autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``; the loss's with the last layer),
  each counted once, for the layer that made it (a Linear's input is its producer's; a
  model input is no layer's), never the model's parameters and buffers. A stage keeps,
  per microbatch in flight, its input plus the sum of its layers' kept bytes (exactly,
  but for a stage output no layer saves);
- optimizer: ``torch.optim.Adam``'s step and ``zero_grad`` over copies of each layer's
  parameters, less the per-step part every step pays once (the calibration's
  ``step_seconds``), scaled to Adam over all layers right after a forward and backward
  (colder caches, fresh gradients). Adam is assumed (the user's optimizer does not
  exist yet when the planner runs), as ``optimizer_state_factor=2`` assumes for memory;
- a traced model's output bytes after a group are the bytes of every value made at
  or before it and used after it (the live set ``graph_split`` sends across such a
  cut: model inputs and skip connections included); its input bytes are those of the
  cut before it.

Bytes per sample are the bytes at the largest microbatch size divided by its samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import statistics
import time
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..configuration import LayerCost
from .graph_profile import GraphGroups, group_boundaries, group_module, trace_groups
from .timing import Timer, leaf_inputs, preserved, stage_input, tensor_bytes

__all__ = ["LayerCosts", "balance_bounds", "default_microbatch_sizes", "measure_layer_costs",
           "traced_stage_of"]

log = logging.getLogger(__name__)

LossFn = Optional[Callable[[Any, Any], torch.Tensor]]


@dataclasses.dataclass
class LayerCosts:
    """A model as the chain of layers the configuration search cuts into stages.

    Attributes:
        layers: one cost per layer, in chain order.
        names: a label per layer (``"3 (Linear)"``; a traced group's description).
        group_of: for a traced model, the graph profile's node id of each layer
            (``graph_profile.Group.id``: what a balance over these layers puts in each
            stage, :meth:`stage_nodes`, :func:`traced_stage_of`); ``None`` for an
            ``nn.Sequential`` (layer ``i`` is its child ``i``).
        microbatch_sizes: the samples per microbatch the times were fitted from.
    """

    layers: List[LayerCost]
    names: List[str]
    group_of: Optional[List[str]] = None
    microbatch_sizes: List[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """The costs as a JSON-able dict (:meth:`from_dict` reads it back)."""
        return {"layers": [layer.to_dict() for layer in self.layers], "names": list(self.names),
                "group_of": None if self.group_of is None else list(self.group_of),
                "microbatch_sizes": list(self.microbatch_sizes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerCosts":
        """Reads :meth:`to_dict`'s dict back.

        Raises:
            ValueError: a missing key, a layer that is not a dict or has unknown fields,
                or lists of different lengths.
        """
        try:
            layers, names = list(d["layers"]), [str(n) for n in d["names"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"layer costs need 'layers' and 'names' lists (got keys "
                             f"{sorted(d) if isinstance(d, Mapping) else type(d).__name__})") from exc
        parsed = [LayerCost.from_dict(layer) for layer in layers]  # missing fields: defaults
        group_of = d.get("group_of")
        if len(names) != len(parsed) or (group_of is not None and len(group_of) != len(parsed)):
            raise ValueError(f"layer costs list {len(parsed)} layers but {len(names)} names"
                             + ("" if group_of is None else f" and {len(group_of)} groups"))
        return cls(parsed, names, None if group_of is None else [str(g) for g in group_of],
                   [int(b) for b in d.get("microbatch_sizes", [])])

    def stage_nodes(self, balance: Sequence[int]) -> List[List[str]]:
        """For a traced model, the graph profile node ids each stage of ``balance`` holds
        (what a ``planner.Plan``'s stages list for ``graph_profile.plan_stage_of``).

        Raises:
            ValueError: not a traced model's costs, or a balance that is not positive
                layer counts summing to the layers.
        """
        if self.group_of is None:
            raise ValueError("stage_nodes is for a traced model's layer costs; an "
                             "nn.Sequential's balance counts its children directly")
        bounds = balance_bounds(balance, len(self.layers))
        return [self.group_of[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def balance_bounds(balance: Sequence[int], num_layers: int) -> List[int]:
    """The first layer of each stage of ``balance``, then ``num_layers``.

    Raises:
        ValueError: counts that are not positive ints summing to ``num_layers``.
    """
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in balance) or \
            sum(balance) != num_layers:
        raise ValueError(f"balance={list(balance)} must be positive layer counts summing to the "
                         f"{num_layers} layers of the chain")
    bounds = [0]
    for n in balance:
        bounds.append(bounds[-1] + n)
    return bounds


def traced_stage_of(grouped: GraphGroups, costs: LayerCosts, balance: Sequence[int]) -> Dict[str, int]:
    """The stage of every computing node (by fx name) when ``balance`` cuts the chain
    of ``costs`` (``graph_split.split_model(stage_of=...)``, as ``plan_stage_of`` gives
    for a plan).

    Raises:
        ValueError: the costs were measured on another grouping, or a bad balance.
    """
    ids = [group.id for group in grouped.groups]
    if costs.group_of != ids:
        raise ValueError(f"the layer costs list groups {costs.group_of} but this model's graph "
                         f"has {ids}; measure the costs on this model's default grouping")
    bounds = balance_bounds(balance, len(ids))
    stage = [j for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])) for _ in range(lo, hi)]
    return {n.name: stage[g] for n, g in grouped.group_of.items()}


def default_microbatch_sizes(batch: int) -> List[int]:
    """Two sizes to fit the affine costs from: ``batch // 8`` and ``batch // 2`` (at least 1)."""
    return sorted({max(1, batch // 8), max(1, batch // 2)})


# -- the chain of units ---------------------------------------------------------------------
@dataclasses.dataclass
class _Unit:
    """One layer as it runs: ``call(values of ins) -> values of outs``."""

    call: Callable[[List[Any]], List[Any]]
    ins: List[Hashable]
    outs: List[Hashable]
    name: str
    parameter_bytes: float
    parameter_tensors: float = 0.0
    largest_parameter_bytes: float = 0.0
    parameters: List[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Chain:
    """The units, the model inputs' keys, the keys the loss reads and how it rebuilds
    the model output from them."""

    units: List[_Unit]
    inputs: List[Hashable]
    result_keys: List[Hashable]
    result: Callable[[Dict[Hashable, Any]], Any]
    group_ids: Optional[List[str]]


class _ThreadClock(Timer):
    """This thread's CPU time: what a layer computes, whatever else the cores run (other
    processes sharing them would stretch the wall clock at random; the cost model adds
    the sharing of cores by the ranks itself). Only for one-thread CPU compute."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def start(self) -> Any:
        return time.thread_time()

    def stop(self, start: Any) -> Callable[[], float]:
        elapsed = (time.thread_time() - start) * 1e3
        return lambda: elapsed


def _clock(device: torch.device) -> Timer:
    """The thread's CPU time for one-thread CPU compute, else ``Timer`` (wall clock or
    CUDA events)."""
    return _ThreadClock() if device.type == "cpu" and torch.get_num_threads() == 1 else Timer(device)


def _parameter_bytes(module: nn.Module) -> float:
    return float(sum(p.numel() * p.element_size() for p in module.parameters()))


def _tensor_sizes(parameters: Sequence[torch.Tensor]) -> Tuple[float, float]:
    """How many parameter tensors (the optimizer pays per tensor) and the largest one's bytes
    (Adam's step and a fresh gradient are transients of that size)."""
    sizes = [p.numel() * p.element_size() for p in parameters]
    return float(len(sizes)), float(max(sizes, default=0))


def _sequential_chain(module: nn.Sequential) -> _Chain:
    units = [_Unit(lambda vs, layer=layer: [layer(vs[0])], [i], [i + 1],
                   f"{name} ({type(layer).__name__})", _parameter_bytes(layer),
                   *_tensor_sizes(list(layer.parameters())), list(layer.parameters()))
             for i, (name, layer) in enumerate(module.named_children())]
    n = len(units)
    return _Chain(units, [0], [n], lambda env: env[n], None)


def _traced_chain(grouped: GraphGroups) -> _Chain:
    gm = grouped.gm
    ins, outs = group_boundaries(grouped)
    units = []
    for g, group in enumerate(grouped.groups):
        runner = group_module(gm, group.nodes, ins[g], outs[g])
        tensors = list({id(p): p for p in map(gm.get_parameter, group.parameters)}.values())
        units.append(_Unit(lambda vs, runner=runner: list(runner(*vs)), list(ins[g]), list(outs[g]),
                           group.description, group.parameter_bytes, *_tensor_sizes(tensors),
                           tensors))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    keys = [a for a in output.all_input_nodes if a.op != "get_attr"]

    def result(env: Dict[Hashable, Any]) -> Any:  # an attribute read: the model's own
        return fx.map_arg(output.args[0], lambda a: env[a] if a in env else
                          operator.attrgetter(str(a.target))(gm))

    return _Chain(units, list(grouped.inputs), keys, result, [g.id for g in grouped.groups])


def _flat(value: Any) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _storages(tensors: Sequence[torch.Tensor]) -> Dict[int, int]:
    """data pointer -> bytes of each distinct storage behind ``tensors``."""
    out: Dict[int, int] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass)
            continue
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


# -- one step ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Step:
    """What one forward and backward of the chain kept: each unit's leaf inputs, raw
    outputs and time thunks (forward, whole backward, inputs-only backward)."""

    xs: List[List[Any]]
    ys: List[List[Any]]
    forward: List[Callable[[], float]]
    backward: List[Callable[[], float]]
    inputs_only: List[Callable[[], float]]


def _counted(kept: Optional[Dict[int, int]]) -> Any:
    """A context recording the storages autograd saves into ``kept`` (none: no hooks)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        assert kept is not None
        kept.update(_storages([t]))
        return t
    if kept is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _forward(chain: _Chain, env: Dict[Hashable, Any], timer: Timer,
             kept: Optional[List[Dict[int, int]]]) -> _Step:
    """Every unit's forward on its inputs as ``timing.stage_input`` gives them, in chain order; with ``kept``,
    the storages each unit saves for its backward."""
    step = _Step([], [], [], [], [])
    for g, unit in enumerate(chain.units):
        x = [stage_input(env[k]) for k in unit.ins]
        with _counted(None if kept is None else kept[g]):
            t0 = timer.start()
            y = unit.call(x)
            step.forward.append(timer.stop(t0))
        env.update(zip(unit.outs, y))
        step.xs.append(x)
        step.ys.append(y)
    return step


def _loss(chain: _Chain, env: Dict[Hashable, Any], loss_fn: LossFn, target: Any, timer: Timer,
          kept: Optional[Dict[int, int]]) -> Tuple[Dict[Hashable, List[Any]], Callable[[], float],
                                                   Callable[[], float]]:
    """The loss (or the output's sum) on leaf copies of the outputs, and its backward:
    each output key's gradients and the two times (thunks, as ``Timer.stop``)."""
    leaves = {k: leaf_inputs(env[k]) for k in chain.result_keys}
    with _counted(kept):
        t0 = timer.start()
        root = loss_fn(chain.result({**env, **leaves}), target) if loss_fn is not None else \
            sum(t.float().sum() for t in _flat(list(leaves.values())) if t.requires_grad)
        forward = timer.stop(t0)
    t0 = timer.start()
    if isinstance(root, torch.Tensor) and root.requires_grad:
        root.backward()
    backward = timer.stop(t0)
    grads = {k: [t.grad for t in _flat(v)] for k, v in leaves.items()}
    return grads, forward, backward


def _accumulate(grads: Dict[Hashable, List[Any]], key: Hashable, new: List[Any]) -> None:
    old = grads.get(key)
    grads[key] = new if old is None else [
        a if b is None else b if a is None else a + b for a, b in zip(old, new)]


def _backward(chain: _Chain, step: _Step, grads: Dict[Hashable, List[Any]], timer: Timer) -> None:
    """Every unit's backward, last first, each fed the summed gradients of its outputs:
    timed for the inputs' gradients alone (graph kept), then whole."""
    step.backward = [lambda: 0.0] * len(chain.units)
    step.inputs_only = [lambda: 0.0] * len(chain.units)
    for g in reversed(range(len(chain.units))):
        unit = chain.units[g]
        pairs = [(y, d) for k, value in zip(unit.outs, step.ys[g])
                 for y, d in zip(_flat(value), grads.get(k, [])) if y.requires_grad and d is not None]
        xin = [x for x in _flat(step.xs[g]) if x.requires_grad]
        roots, feeds = [y for y, _ in pairs], [d for _, d in pairs]
        if pairs and xin:
            t0 = timer.start()
            torch.autograd.grad(roots, xin, feeds, retain_graph=True, allow_unused=True)
            step.inputs_only[g] = timer.stop(t0)
        t0 = timer.start()
        if pairs:
            torch.autograd.backward(roots, feeds)
        step.backward[g] = timer.stop(t0)
        for k, x in zip(unit.ins, step.xs[g]):
            _accumulate(grads, k, [t.grad for t in _flat(x)])


# -- per microbatch size ----------------------------------------------------------------------
@dataclasses.dataclass
class _Sized:
    """One microbatch size's medians (milliseconds) and bytes, per unit.

    Attributes:
        live: bytes crossing a cut: ``live[0]`` before the first unit (the model's
            inputs), ``live[g + 1]`` after unit ``g``.
    """

    forward: List[float]
    backward: List[float]
    inputs_only: List[float]
    kept: List[float]
    live: List[float]


def _live_bytes(chain: _Chain, env: Dict[Hashable, Any]) -> List[float]:
    made: Dict[Hashable, int] = {k: -1 for k in chain.inputs}
    used: Dict[Hashable, int] = {}
    for g, unit in enumerate(chain.units):
        made.update((k, g) for k in unit.outs)
        used.update((k, g) for k in unit.ins)
    used.update((k, len(chain.units)) for k in chain.result_keys)
    return [sum(tensor_bytes(env[k]) for k, g in made.items() if g <= cut < used.get(k, -1))
            for cut in range(-1, len(chain.units))]


def _kept_bytes(chain: _Chain, env: Dict[Hashable, Any], inputs: Sequence[Any], loss_fn: LossFn,
                target: Any, timer: Timer, state: Dict[int, int]) -> Tuple[List[float], List[float]]:
    """One untimed forward with autograd's saved tensors recorded: the bytes each unit
    keeps for its backward (module docstring) and the live bytes of every cut."""
    env.update(zip(chain.inputs, inputs))
    saved: List[Dict[int, int]] = [{} for _ in chain.units]
    _forward(chain, env, timer, saved)
    _loss(chain, env, loss_fn, target, timer, saved[-1])  # the loss keeps its own in the last
    # Each storage counts once, for the layer that made it (-1: a model input, which is
    # stage 0's input); what no layer made is the saving layer's own intermediate.
    maker = {ptr: -1 for k in chain.inputs for ptr in _storages(_flat(env[k]))}
    for g, unit in enumerate(chain.units):
        maker.update((ptr, g) for k in unit.outs for ptr in _storages(_flat(env[k])))
    kept = [0.0] * len(chain.units)
    counted = set(state)
    for g, sizes in enumerate(saved):
        for ptr, size in sizes.items():
            owner = maker.get(ptr, g)
            if ptr not in counted and owner >= 0:
                kept[owner] += size
            counted.add(ptr)
    return kept, _live_bytes(chain, env)


def _measure_size(chain: _Chain, inputs: Sequence[Any], loss_fn: LossFn, target: Any,
                  timer: Timer, steps: int, warmup: int, parameters: Sequence[nn.Parameter],
                  state: Dict[int, int]) -> _Sized:
    """The medians over ``steps`` steps after ``warmup`` of every unit's times (the loss's
    with the last unit) and, from one untimed step first, its bytes (``state``: the
    storages of the model's parameters and buffers, never counted)."""
    kept, live = _kept_bytes(chain, {}, inputs, loss_fn, target, timer, state)
    n = len(chain.units)
    times: List[List[List[float]]] = [[[] for _ in range(n)] for _ in range(3)]
    for p in parameters:
        p.grad = None
    for step_index in range(warmup + steps):
        # Gradients accumulate from step to step, as over a step's microbatches.
        env: Dict[Hashable, Any] = dict(zip(chain.inputs, inputs))
        step = _forward(chain, env, timer, None)
        grads, loss_f, loss_b = _loss(chain, env, loss_fn, target, timer, None)
        _backward(chain, step, grads, timer)
        timer.sync()
        if step_index < warmup:
            continue
        for g in range(n):
            extra = (loss_f(), loss_b()) if g == n - 1 else (0.0, 0.0)
            times[0][g].append(step.forward[g]() + extra[0])
            times[1][g].append(step.backward[g]() + extra[1])
            times[2][g].append(step.inputs_only[g]() + extra[1])
    medians = [[statistics.median(ts) for ts in kind] for kind in times]
    return _Sized(medians[0], medians[1], medians[2], kept, live)


def _fit(sizes: Sequence[int], values: Sequence[float]) -> Tuple[float, float]:
    """``(fixed, per_sample)`` of ``value = fixed + per_sample * size`` by least squares,
    both kept >= 0 (one size: all per sample)."""
    if len(set(sizes)) == 1:
        return 0.0, max(0.0, statistics.fmean(values) / sizes[0])
    mean_b, mean_v = statistics.fmean(sizes), statistics.fmean(values)
    slope = sum((b - mean_b) * (v - mean_v) for b, v in zip(sizes, values)) / \
        sum((b - mean_b) ** 2 for b in sizes)
    if slope < 0:  # noise on a layer whose time does not grow with the samples
        return max(0.0, mean_v), 0.0
    fixed = mean_v - slope * mean_b
    if fixed < 0:  # through the origin instead
        return 0.0, max(0.0, sum(b * v for b, v in zip(sizes, values)) / sum(b * b for b in sizes))
    return fixed, slope


def _weight_share(unit: _Unit, backward: float, inputs_only: float) -> float:
    """The share of the backward that is the weight gradient (0: no parameters)."""
    if unit.parameter_bytes == 0:
        return 0.0
    if backward <= 0:
        return 0.5  # too fast to tell apart
    return min(1.0, max(0.0, 1.0 - inputs_only / backward))


def _harness_seconds(timer: Timer, device: torch.device, steps: int) -> Tuple[float, float]:
    """What timing one layer on its own adds to its forward and its backward (a view and its
    backward, in seconds): a stage runs its layers in one forward and one backward call,
    and the runtime's own cost per action is the calibration's."""
    forward, backward = [], []
    for _ in range(steps + 1):
        x = torch.zeros(1, device=device, requires_grad=True)
        t0 = timer.start()
        y = x.view_as(x)
        forward.append(timer.stop(t0))
        t0 = timer.start()
        torch.autograd.backward([y], [torch.ones_like(y)])
        backward.append(timer.stop(t0))
    timer.sync()
    return (statistics.median(f() for f in forward[1:]) / 1e3,
            statistics.median(b() for b in backward[1:]) / 1e3)


def _adam_seconds(parameters: Sequence[torch.Tensor], timer: Timer, steps: int,
                  before: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of ``torch.optim.Adam``'s step and ``zero_grad`` over copies of
    ``parameters``, after one step that creates its state. Each step's gradients are the
    parameters' own after ``before()`` (a forward and backward: the caches and the
    allocator as a training step leaves them), or ones."""
    copies = [nn.Parameter(p.detach().clone()) for p in parameters]
    optimizer = torch.optim.Adam(copies, lr=1e-3)
    times = []
    for _ in range(steps + 1):
        if before is not None:
            before()
        for copy, p in zip(copies, parameters):
            copy.grad = p.grad if before is not None and p.grad is not None else torch.ones_like(copy)
        t0 = timer.start()
        optimizer.step()
        optimizer.zero_grad()
        times.append(timer.stop(t0))
    timer.sync()
    return statistics.median(t() for t in times[1:]) / 1e3


def _optimizer_seconds(chain: _Chain, timer: Timer, steps: int,
                       train_step: Callable[[], None]) -> List[float]:
    """Each unit's share of the optimizer's step: Adam over its parameters less the
    per-step part a rank pays once (the calibration's ``step_seconds`` holds it), scaled
    to Adam over all of them right after a training step (colder caches, fresh
    gradients: what a rank's step sees).

    The per-step part ``fixed`` is what the units' separate steps count once each and
    the step over all of them once: ``(sum of unit steps - all) / (units - 1)``. The
    planner cannot know the user's optimizer before it is made: Adam is assumed, as
    ``optimizer_state_factor=2`` assumes for memory."""
    owners = [g for g, u in enumerate(chain.units) if u.parameters]
    shares = [0.0] * len(chain.units)
    if not owners:
        return shares
    alone = {g: _adam_seconds(chain.units[g].parameters, timer, steps) for g in owners}
    every = [p for g in owners for p in chain.units[g].parameters]
    together = _adam_seconds(every, timer, steps)
    in_step = _adam_seconds(every, timer, steps, before=train_step)
    fixed = (sum(alone.values()) - together) / (len(owners) - 1) if len(owners) > 1 else 0.0
    fixed = min(max(0.0, fixed), min(alone.values()))
    scale = in_step / together if together > 0 else 1.0
    for g in owners:
        shares[g] = (alone[g] - fixed) * scale
    return shares


def _costs(chain: _Chain, sizes: Sequence[int], sized: Sequence[_Sized],
           harness: Tuple[float, float], optimizer: Sequence[float]) -> List[LayerCost]:
    """Each unit's :class:`LayerCost` from the per-size measurements (seconds, bytes),
    less what timing it on its own added (``harness``: forward, backward seconds), with
    its optimizer seconds."""
    top, b = sized[-1], sizes[-1]
    layers = []
    for g, unit in enumerate(chain.units):
        f_fixed, f_per = _fit(sizes, [m.forward[g] / 1e3 for m in sized])
        b_fixed, b_per = _fit(sizes, [m.backward[g] / 1e3 for m in sized])
        layers.append(LayerCost(
            forward_fixed=max(0.0, f_fixed - harness[0]), forward_per_sample=f_per,
            backward_fixed=max(0.0, b_fixed - harness[1]), backward_per_sample=b_per,
            weight_share=_weight_share(unit, top.backward[g], top.inputs_only[g]),
            output_bytes_per_sample=top.live[g + 1] / b, stash_bytes_per_sample=top.kept[g] / b,
            input_bytes_per_sample=top.live[g] / b, parameter_bytes=unit.parameter_bytes,
            parameter_tensors=unit.parameter_tensors,
            largest_parameter_bytes=unit.largest_parameter_bytes, optimizer_seconds=optimizer[g]))
    return layers


# -- the entry point --------------------------------------------------------------------------
def _chain_of(module: nn.Module, inputs: Any, concrete_args: Optional[Mapping[str, Any]],
              grouped: Optional[GraphGroups]) -> Tuple[_Chain, List[Any]]:
    """The chain of ``module`` and the values of its input keys on ``inputs``.

    Raises:
        ValueError: an empty ``nn.Sequential``, ``concrete_args`` or ``grouped`` with one,
            or what tracing refuses.
    """
    if isinstance(module, nn.Sequential):
        if len(module) == 0:
            raise ValueError("the nn.Sequential is empty; give it at least one layer")
        if concrete_args is not None or grouped is not None:
            raise ValueError("concrete_args and grouped are for traced models, not an "
                             "nn.Sequential; drop them")
        # nn.Sequential semantics, as the runtime runs a stage: a tuple is one argument.
        return _sequential_chain(module), [inputs]
    names = None
    if isinstance(inputs, Mapping):  # named inputs, in forward's order (as PlannedTrace)
        order = list(inspect.signature(module.forward).parameters)
        names = sorted(inputs, key=lambda k: order.index(k) if k in order else len(order))
        values = [inputs[k] for k in names]
    else:
        values = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    if grouped is None:
        grouped = trace_groups(module, tuple(values), concrete_args, input_names=names)
    elif names is not None:
        values = [inputs[str(p.target)] for p in grouped.inputs]
    return _traced_chain(grouped), values


def _microbatch(value: Any, size: int, batch: int) -> Any:
    """The first ``size`` samples of every tensor with the batch's leading dimension, as
    tensors of their own (a view would count the whole batch's storage)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t[:size].clone() if t.dim() >= 1 and t.size(0) == batch else t,
        value)


def _checked_sizes(sizes: Optional[Sequence[int]], batch: int) -> List[int]:
    chosen = default_microbatch_sizes(batch) if sizes is None else list(sizes)
    if not chosen or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= batch
                         for b in chosen):
        raise ValueError(f"microbatch_sizes={sizes!r} must be sample counts between 1 and the "
                         f"sample's batch of {batch} (e.g. {default_microbatch_sizes(batch)})")
    return sorted(set(chosen))


def measure_layer_costs(module: nn.Module, sample: Tuple[Any, Any], loss_fn: LossFn, *,
                        microbatch_sizes: Optional[Sequence[int]] = None, steps: int = 5,
                        warmup: int = 2, concrete_args: Optional[Mapping[str, Any]] = None,
                        grouped: Optional[GraphGroups] = None) -> LayerCosts:
    """Measures every layer's costs for the configuration search (module docstring).

    Runs in this process on the model's device, with no communication; the model's
    modes, buffers, gradients and RNG state are left as they were (``preserved``).

    Args:
        module: an ``nn.Sequential`` (a layer per child) or any model torch.fx traces
            (a layer per group of ``graph_profile``, in graph order).
        sample: ``(inputs, targets)`` of one batch, on the model's device; inputs a
            tensor, a tuple of tensors or (traced) a dict of named tensors.
        loss_fn: ``loss_fn(output, targets)``, timed with the last layer; ``None``
            backpropagates the output's sum.
        microbatch_sizes: samples per microbatch to time (each between 1 and the
            sample's batch; two or more fit ``fixed + per_sample * b``); default
            ``batch // 8`` and ``batch // 2``.
        steps: measured steps per size (the median is kept).
        warmup: unmeasured steps first.
        concrete_args: a traced model's fixed non-tensor ``forward`` arguments.
        grouped: a traced model's groups when already made (``PlannedTrace.grouped``:
            the costs then follow that grouping); default: traced here.

    Returns:
        The chain's :class:`LayerCosts` (seconds and bytes).

    Raises:
        ValueError: a sample that is not ``(inputs, targets)`` with a batch dimension,
            bad sizes, steps or warmup, or a model that cannot be traced.
    """
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError("sample must be (inputs, targets), one batch")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    chain, values = _chain_of(module, sample[0], concrete_args, grouped)
    tensors = [t for t in _flat(values) if t.dim() >= 1]
    if not tensors:
        raise ValueError("the sample's inputs hold no tensor with a batch dimension")
    batch, device = tensors[0].size(0), tensors[0].device
    sizes = _checked_sizes(microbatch_sizes, batch)
    timer = _clock(device)
    parameters = list(module.parameters())
    state = _storages(parameters + list(module.buffers()))  # the model's, not a microbatch's
    with preserved([module], device):
        sized = [_measure_size(chain, _microbatch(values, b, batch), loss_fn,
                               _microbatch(sample[1], b, batch), timer, steps, warmup, parameters,
                               state)
                 for b in sizes]
        harness = _harness_seconds(timer, device, max(steps, 5))
        top = sizes[-1]

        def train_step() -> None:  # one step at the largest size, as _measure_size runs it
            env: Dict[Hashable, Any] = dict(zip(chain.inputs, _microbatch(values, top, batch)))
            step = _forward(chain, env, timer, None)
            grads = _loss(chain, env, loss_fn, _microbatch(sample[1], top, batch), timer, None)[0]
            _backward(chain, step, grads, timer)
        optimizer = _optimizer_seconds(chain, timer, max(steps, 5), train_step)
    costs = LayerCosts(_costs(chain, sizes, sized, harness, optimizer), [u.name for u in chain.units],
                       chain.group_ids, sizes)
    log.info("measured %d layers of %s at microbatch sizes %s over %d steps: %.2f ms forward, "
             "%.2f ms backward per sample", len(costs.layers), type(module).__name__, sizes, steps,
             1e3 * sum(c.forward_per_sample for c in costs.layers),
             1e3 * sum(c.backward_per_sample for c in costs.layers))
    return costs
