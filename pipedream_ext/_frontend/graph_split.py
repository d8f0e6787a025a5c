"""Any ``nn.Module`` -> pipeline stages: trace with torch.fx, cut at named modules.

Owns turning a model that is not an ``nn.Sequential`` into a list of stage
modules the runtime runs like layers (``split_model``): the model is traced
with ``torch.fx.symbolic_trace`` into one graph of module calls and operations,
cut where each split point's module is first called, and every value produced
before a cut and used at or after it (the cut's *live set*: the model's
inputs, skip connections, masks) travels across it as one tuple of tensors.
A value that jumps over several stages is relayed through the stages between
(they return it unchanged), so autograd sends its gradient back along the same
edges. Stage ``j`` is a ``torch.fx.GraphModule`` built from the traced root, so
it holds the original submodules at their original paths and its parameter
names are the unsplit model's. A forward fx cannot trace (a Hugging Face model) is
exported with ``torch.export`` instead (``_export``) into the same kind of graph.
Design and limits: docs/tracing.md.

Index legend: ``j`` stage, ``k`` cut (between stage ``k - 1`` and stage ``k``).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import linecache
import logging
import operator
import os
import traceback
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.fx as fx
from torch import nn

from .._dist.fingerprint import StagesFingerprint, graph_fingerprint
from . import export, model_io
from .fx_graph import (
    CONSTANT_OPS,
    Stages,
    compute_nodes,
    count_stages,
    install_attribute,
    node_stages,
    paths_of,
    tensor_paths,
    value_kinds,
)

__all__ = ["TracedSplit", "UntraceableError", "trace_model", "stage_starts", "stage_assignment",
           "live_sets", "build_stages", "check_one_stage_per_state", "split_model", "reorder_cuts",
           "merge_stage_modules"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class TracedSplit:
    """A model traced and cut into stages.

    Attributes:
        stages: one ``GraphModule`` per stage; stage ``j`` takes the live set of
            cut ``j`` (stage 0: the model's tensor inputs), one tensor as itself and
            several as one tuple, and returns the live set of cut ``j + 1`` the same
            way (the last stage: the model's output).
        live: for each cut ``k = 1 .. S-1``, the names of the graph values crossing it.
        split_points: the module names the stages start at (stage ``j + 1`` at
            ``split_points[j]``); for a plan's stages (``balance="auto"``), where each
            later stage's first operation runs, for messages and checkpoints only.
        input_names: for a model traced on a dict of named inputs, their names in the
            graph's input order (``_model_io.positional_inputs``); ``None``: positional.
        output_spec: for an exported model (``torch.export``), the pytree structure of
            its output, whose leaves the last stage returns flat
            (``_model_io.restore_output``); ``None``: the last stage returns the output.
        tracer: ``"fx"`` or ``"export"``.
        fingerprint: what every stage computes, independent of node names and of the
            order of independent operations (``_fingerprint``); ranks compare it at
            construction (``_agree``).
        cut: how the stages were cut (for :func:`reorder_cuts`); ``None`` when built
            from parts.
    """

    stages: List[fx.GraphModule]
    live: List[List[str]]
    split_points: List[str]
    input_names: Optional[List[str]] = None
    output_spec: Optional[Any] = None
    tracer: str = "fx"
    fingerprint: Optional[StagesFingerprint] = None
    cut: Optional["_Cut"] = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class _Cut:
    """What :func:`split_model` cut, kept to build the stages again with the values
    crossing each cut in another order (:func:`reorder_cuts`)."""

    model: nn.Module
    gm: fx.GraphModule
    starts: Any
    live: List[List[fx.Node]]
    kinds: Mapping[fx.Node, str]
    digests: Dict[fx.Node, str]


class UntraceableError(ValueError):
    """torch.fx cannot trace the forward (``split_model`` then tries ``torch.export``).

    Attributes:
        reason: what failed where.
        advice: what to do about it.
    """

    def __init__(self, reason: str, advice: str) -> None:
        super().__init__(f"{reason}. {advice}")
        self.reason = reason
        self.advice = advice


class _KeepCalls(fx.Tracer):
    """fx's tracer, keeping the calls of the modules named in ``keep`` as calls
    (``call_module``) instead of tracing through them."""

    def __init__(self, keep: Sequence[str]) -> None:
        super().__init__()
        self.keep = frozenset(keep)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.keep or super().is_leaf_module(m, module_qualified_name)


def trace_model(model: nn.Module, num_inputs: int,
                concrete_args: Optional[Mapping[str, Any]] = None,
                input_names: Optional[Sequence[str]] = None,
                keep_calls: Sequence[str] = ()) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with the guards of ``concrete_args`` removed.

    Args:
        model: the whole model.
        num_inputs: how many leading parameters of ``forward`` are tensors given per batch.
        concrete_args: non-tensor arguments of ``forward`` fixed for tracing
            (``{"use_cache": False}``); fx bakes their branch into the graph.
        input_names: the tensor inputs by parameter name instead (a dict of named
            inputs). Every other parameter is fixed to its value in ``concrete_args``
            or to its default, as ``model(**inputs)`` (``model(*inputs)``) would.
        keep_calls: qualified names of modules whose calls stay calls (fx traces
            through every module outside ``torch.nn`` by default); their hooks (a
            tensor-parallel style's) then run as in the model.

    Returns:
        A graph module whose placeholders are the tensor inputs (in ``forward``'s order).

    Raises:
        UntraceableError: the forward cannot be traced (data-dependent control flow,
            naming the operation).
        ValueError: a parameter of ``forward`` is neither among the inputs nor in
            ``concrete_args`` (nor has a default, for named inputs).
    """
    concrete = dict(concrete_args or {})
    if input_names is not None:
        concrete.update(_defaults(model, input_names, concrete))
    else:
        concrete.update(_positional_defaults(model, num_inputs, concrete))
    try:
        tracer = _KeepCalls(keep_calls)
        traced_graph = tracer.trace(model, concrete_args=concrete or None)
        gm = fx.GraphModule(tracer.root, traced_graph, type(model).__name__)
    except Exception as exc:  # any failure means fx has no graph of it
        raise UntraceableError(
            f"{type(model).__name__} cannot be traced with torch.fx{_where(exc, model)}: {exc}",
            "Python control flow on a tensor's value (if/while on it, bool(), int()) has no "
            "graph: fix non-tensor flags with concrete_args={...}, write the branch with "
            "tensor operations (torch.where), or wrap the model's layers in an nn.Sequential "
            "and use balance= (docs/tracing.md)") from exc
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if input_names is not None:
        given = [n for n in placeholders if n.target in input_names]
        absent = [name for name in input_names if name not in {str(n.target) for n in given}]
        if absent:
            raise ValueError(f"inputs {absent} name no parameter of {type(model).__name__}.forward "
                             f"(its parameters: {[str(n.target) for n in placeholders]})")
    elif len(placeholders) < num_inputs:
        raise ValueError(f"sample gives {num_inputs} inputs but {type(model).__name__}.forward "
                         f"takes {len(placeholders)}; pass one tensor per positional parameter")
    else:
        given = placeholders[:num_inputs]
    # Other placeholders are concrete arguments (or unused defaults): fx guards them
    # with eq/_assert nodes that only check the value traced with.
    derived: Set[fx.Node] = set(placeholders) - set(given)
    for node in graph.nodes:
        if node.op != "placeholder" and node.all_input_nodes and \
                all(a in derived for a in node.all_input_nodes):
            derived.add(node)
    for node in reversed(list(graph.nodes)):
        if node not in derived:
            continue
        outside = [u for u in node.users if u not in derived]
        if outside:
            raise ValueError(
                f"forward parameter {node.name!r} of {type(model).__name__} is used by "
                f"{outside[0].format_node()}; give it as a tensor input (in sample) or fix "
                "its value with concrete_args={...}")
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _defaults(model: nn.Module, input_names: Sequence[str], concrete: Mapping[str, Any],
              required: bool = True) -> Dict[str, Any]:
    """The defaults of ``forward``'s parameters that are neither inputs nor fixed
    (``required``: a parameter without one is an error; else it is left out)."""
    fixed: Dict[str, Any] = {}
    for name, param in inspect.signature(model.forward).parameters.items():
        if name in input_names or name in concrete or \
                param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is not param.empty:
            fixed[name] = param.default
        elif required:
            raise ValueError(f"{type(model).__name__}.forward parameter {name!r} has no default "
                             "and is not among the inputs; add it to the inputs dict (a tensor) "
                             "or fix it with concrete_args={...}")
    return fixed


def _positional_defaults(model: nn.Module, num_inputs: int,
                         concrete: Mapping[str, Any]) -> Dict[str, Any]:
    """:func:`_defaults` of the parameters after the ``num_inputs`` positional tensors, as
    ``model(*inputs)`` would take them (torchtitan's ``attention_masks=None``); none past
    a ``*args``, which takes the inputs; one without a default stays a placeholder."""
    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params[:num_inputs + 1]):
        return {}
    return _defaults(model, [p.name for p in params[:num_inputs]], concrete, required=False)


def _where(exc: BaseException, model: nn.Module) -> str:
    """`` in module 'blocks.0' (Block.forward, file.py:12: if h.sum() > 0:)`` for the
    innermost forward of ``model``'s modules in ``exc``'s traceback, else ``""``."""
    names = {id(m): name for name, m in model.named_modules()}
    found = ""
    for frame, line in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and id(owner) in names:
            code = linecache.getline(frame.f_code.co_filename, line).strip()
            found = (f" in module {names[id(owner)] or '(the root)'!r} "
                     f"({type(owner).__name__}.forward, {os.path.basename(frame.f_code.co_filename)}"
                     f":{line}: {code})")
    return found


def stage_starts(gm: fx.GraphModule, model: nn.Module, split_points: Sequence[str]) -> List[int]:
    """Position (among the graph's computing nodes) of the first node of each split point.

    Args:
        gm: the traced model (from :func:`trace_model`).
        model: the model it was traced from (to resolve names).
        split_points: qualified module names, in the order their stages run.

    Returns:
        One position per split point, strictly increasing, each above 0.

    Raises:
        ValueError: a name that is no submodule (with the closest names), one the
            forward never calls, names out of graph order or repeated, or one
            that leaves a stage without operations.
    """
    modules = dict(model.named_modules())
    nodes = compute_nodes(gm.graph)
    starts: List[int] = []
    for k, point in enumerate(split_points):
        if not isinstance(point, str) or point == "" or point not in modules:
            close = difflib.get_close_matches(str(point), [m for m in modules if m], n=3)
            raise ValueError(f"split point {point!r} names no submodule of "
                             f"{type(model).__name__}; give a qualified name from "
                             f"model.named_modules(){' such as ' + ', '.join(close) if close else ''}")
        first = next((i for i, n in enumerate(nodes)
                      if any(p == point or p.startswith(point + ".") for p in paths_of(n))), None)
        if first is None:
            raise ValueError(f"split point {point!r} is never called by "
                             f"{type(model).__name__}.forward (no operation of the traced graph "
                             "runs in it); split at a module the forward uses")
        if first == 0:
            raise ValueError(f"split point {point!r} starts at the forward's first operation, "
                             "which leaves stage 0 empty; drop it or split at a later module")
        if starts and first < starts[-1]:
            raise ValueError(f"split point {point!r} runs before {split_points[k - 1]!r} "
                             f"(operation {nodes[first].name!r} before {nodes[starts[-1]].name!r});"
                             " list split points in the order the forward runs them")
        if starts and first == starts[-1]:
            raise ValueError(f"split points {split_points[k - 1]!r} and {point!r} start at the "
                             f"same operation {nodes[first].name!r}, which leaves stage {k} empty; "
                             "drop one of them")
        starts.append(first)
    return starts


#: Where stages come from: the positions of split points among the computing nodes
#: (:func:`stage_starts`), or a stage per computing node (:func:`stage_assignment`).
def stage_assignment(gm: fx.GraphModule, stage_of: Mapping[str, int]) -> Dict[fx.Node, int]:
    """A stage for every computing node of ``gm``, by node name, checked to be runnable.

    The generalisation of split points (which give each stage a contiguous run of
    the graph's order): any assignment where every value flows forward
    (a producer's stage <= each user's stage) and every stage has an operation.
    Placeholders are in stage 0 and the output in the last stage; attribute reads
    are made by every stage using them.

    Args:
        gm: the traced model.
        stage_of: fx node name -> stage, for every computing node (e.g. from a plan:
            ``_graph_profile.plan_stage_of``).

    Returns:
        Node -> stage, for :func:`live_sets` and :func:`build_stages`.

    Raises:
        ValueError: a computing node without a stage, a name that is no node, a stage
            number out of range or without operations, or a value used in an
            earlier stage than the one producing it (naming both nodes).
    """
    nodes = compute_nodes(gm.graph)
    by_name = {n.name: n for n in nodes}
    unknown = sorted(set(stage_of) - set(by_name))
    if unknown:
        raise ValueError(f"the stage assignment names {unknown[:5]}, which are no operations of "
                         "the traced graph; was it made for another model?")
    missing = [n.name for n in nodes if n.name not in stage_of]
    if missing:
        raise ValueError(f"operations {missing[:5]}{' ...' if len(missing) > 5 else ''} have no "
                         "stage; every operation of the traced graph needs one")
    result = {n: int(stage_of[n.name]) for n in nodes}
    num_stages = count_stages(result)
    used = set(result.values())
    empty = [j for j in range(num_stages) if j not in used]
    if min(used, default=0) < 0 or empty:
        raise ValueError(f"stage {empty[0] if empty else min(used)} has no operations; every "
                         f"stage 0..{num_stages - 1} needs at least one (stages {sorted(used)})")
    for node in nodes:
        for a in node.all_input_nodes:
            if a in result and result[a] > result[node]:
                raise ValueError(
                    f"operation {node.name!r} (stage {result[node]}) uses {a.name!r}, which "
                    f"stage {result[a]} computes later; stages must follow the data flow "
                    "(every producer in the same or an earlier stage than its users)")
    return result


def live_sets(gm: fx.GraphModule, starts: Stages) -> List[List[fx.Node]]:
    """For each cut ``k = 1 .. S-1``: the values produced before it and used at or after it.

    A value used two stages later is in both cuts' sets (relayed), in graph order.

    Args:
        gm: the traced model.
        starts: from :func:`stage_starts` or :func:`stage_assignment`.

    Returns:
        ``S - 1`` lists of nodes (placeholders and computing nodes; never attribute
        reads, which every stage makes itself).
    """
    stage_of = node_stages(gm, starts)
    producers = [n for n in gm.graph.nodes if n.op != "output" and n.op not in CONSTANT_OPS]
    last_use = {n: max((stage_of[u] for u in n.users), default=-1) for n in producers}
    return [[n for n in producers if stage_of[n] < k <= last_use[n]]
            for k in range(1, count_stages(starts))]


def build_stages(gm: fx.GraphModule, starts: Stages,
                 live: Sequence[Sequence[fx.Node]],
                 kinds: Optional[Mapping[fx.Node, str]] = None) -> List[fx.GraphModule]:
    """One ``GraphModule`` per stage: live-in tuple -> its operations -> live-out tuple.

    Args:
        gm: the traced model.
        starts: from :func:`stage_starts` or :func:`stage_assignment`.
        live: from :func:`live_sets`.
        kinds: each node's value type on the sample (checked: only tensors cross a cut).

    Returns:
        The stages; each holds the submodules and attributes it uses at their
        original paths (``GraphModule(gm, graph)``).

    Raises:
        ValueError: a value that is not a tensor would cross a cut (naming the node),
            or nothing crosses one.
    """
    stage_of = node_stages(gm, starts)
    num_stages = count_stages(starts)
    for k, values in enumerate(live, start=1):
        if not values:
            raise ValueError(f"stage {k} uses nothing stage {k - 1} or the inputs produce (it "
                             "computes from constants only); move the split point starting "
                             f"stage {k} to a module that takes data")
        for v in values:
            kind = (kinds or {}).get(v, "Tensor")
            if kind != "Tensor":
                user = min((u for u in v.users if stage_of[u] >= k), key=lambda u: stage_of[u])
                raise ValueError(
                    f"value {v.name!r} ({v.format_node()}) is a {kind}, produced in stage "
                    f"{stage_of[v] if v.op != 'placeholder' else 0} and used by {user.name!r} in "
                    f"stage {stage_of[user]}; only tensors can cross a stage boundary: move the "
                    "split point so both are in one stage")
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stages = []
    for j in range(num_stages):
        ins = inputs if j == 0 else list(live[j - 1])
        graph = fx.Graph()
        env: Dict[fx.Node, fx.Node] = {}
        if len(ins) == 1:
            env[ins[0]] = graph.placeholder(ins[0].name)
        else:  # the runtime passes several tensors as one tuple (nn.Sequential semantics)
            packed = graph.placeholder("inputs")
            for i, v in enumerate(ins):
                env[v] = graph.call_function(operator.getitem, (packed, i))
                env[v].name = v.name

        def lookup(a: fx.Node) -> fx.Node:
            if a not in env:
                if a.op in CONSTANT_OPS:  # an attribute: every stage using it reads its own
                    env[a] = graph.node_copy(a)
                else:
                    raise AssertionError(f"stage {j}: {a.name} is not live (bug in live_sets)")
            return env[a]

        for node in compute_nodes(gm.graph):
            if stage_of[node] == j:
                env[node] = graph.node_copy(node, lookup)
        if j == num_stages - 1:
            graph.output(fx.map_arg(output.args[0], lookup))
        else:
            outs = [lookup(v) for v in live[j]]
            graph.output(outs[0] if len(outs) == 1 else tuple(outs))
        graph.lint()
        stages.append(fx.GraphModule(gm, graph, class_name=f"Stage{j}"))
    return stages


def merge_stage_modules(stages: Sequence[fx.GraphModule]) -> nn.Module:
    """One module holding every submodule, parameter and buffer of ``stages`` at their
    paths (this rank's stages as one module, named as in the original model).

    Modules are installed whole, as the stages hold them, so ``train()`` / ``eval()``
    of the merged module reaches the same BatchNorm or Dropout objects.
    """
    merged = nn.Module()
    for stage in stages:
        for node in stage.graph.nodes:
            if node.op in ("call_module", "get_attr"):
                install_attribute(stage, merged, str(node.target))
        held = tensor_paths(merged)
        for name in sorted(tensor_paths(stage) - held):  # tensors the forward never reads
            install_attribute(stage, merged, name)
    return merged


def check_one_stage_per_state(stages: Sequence[fx.GraphModule]) -> None:
    """Refuses a buffer of a called module held by two stages.

    A called module's buffers (BatchNorm's running statistics) change as it runs, so
    they need one stage. A parameter used by several stages (a module called on both
    sides of a cut, or a tensor read by several: a tied weight) is a shared parameter
    (``_shared``: every stage keeps it, gradients summed before the update). A buffer
    only read as an attribute (a constant mask) may be read by several stages.

    Raises:
        ValueError: naming the buffer and both stages.
    """
    holder: Dict[str, int] = {}
    for j, stage in enumerate(stages):
        names = set()
        for node in stage.graph.nodes:
            if node.op == "call_module":
                names.update(f"{node.target}.{n}" for n, _ in
                             stage.get_submodule(str(node.target)).named_buffers())
        for name in sorted(names):
            if holder.setdefault(name, j) != j:
                raise ValueError(
                    f"{name!r} is used by stage {holder[name]} and stage {j} (its module is "
                    "called on both sides of a split point and updates it); move the split "
                    "points so every call is in one stage")


def split_model(model: nn.Module, split_points: Sequence[str],
                inputs: Union[Tuple[torch.Tensor, ...], Mapping[str, torch.Tensor]],
                concrete_args: Optional[Mapping[str, Any]] = None,
                stage_of: Optional[Mapping[str, int]] = None,
                traced: Optional[Tuple[fx.GraphModule, Mapping[fx.Node, str]]] = None,
                keep_calls: Sequence[str] = (), enclosing_calls: Sequence[str] = ()) -> TracedSplit:
    """Traces ``model`` on ``inputs`` and cuts it at ``split_points`` (or as ``stage_of`` says).

    torch.fx first (module calls stay calls: BatchNorm keeps its running statistics,
    the graph is the model's own autograd); if fx cannot trace the forward,
    ``torch.export`` (non-strict, dynamic shapes: ``_export``).

    Args:
        model: any module whose forward torch.fx or torch.export can trace.
        split_points: qualified module names; stage ``j + 1`` starts at the first
            operation running in ``split_points[j]`` or a submodule of it. With
            ``stage_of``: only recorded (where each later stage's first operation runs).
        inputs: one batch of the model's tensor inputs: a tuple (positional) or a
            dict of named tensors (keyword arguments).
        concrete_args: non-tensor ``forward`` arguments to fix while tracing.
        stage_of: instead of split points, the stage of every computing node by fx
            name (a plan's stages: ``_graph_profile.plan_stage_of``), checked by
            :func:`stage_assignment`.
        traced: the fx graph of ``model`` already traced on these ``inputs`` and its
            value types (``_graph_profile.trace_groups`` made them
            for a plan): neither traced nor run again.
        keep_calls: qualified names of modules that stay module calls in the stages,
            holding their original objects at their original paths (the modules a
            tensor-parallel plan matches: their styles' hooks must run); fx keeps them
            as leaves, the torch.export path puts the calls back
            (``export.keep_module_calls``).
        enclosing_calls: modules enclosing those of ``keep_calls`` (an attention around
            its ``wq``), kept as calls too when torch.fx cannot trace the model otherwise
            and can with them: their own operations (a rotary embedding's reshape of
            the heads) then run as in the model, where torch.export would record them
            with the unsplit sizes a tensor-parallel rank does not have.

    Returns:
        The stages and the live set of every cut.

    Raises:
        ValueError: a forward neither can trace, bad split points or a stage
            assignment that cannot run, a non-tensor value crossing a cut, or a called
            module's buffer used by two stages (naming it).
    """
    if stage_of is None and (isinstance(split_points, str) or not split_points):
        raise ValueError(f"split_points must be a non-empty list of module names (got "
                         f"{split_points!r}); e.g. split_points=['layer3'] for 2 stages")
    split_points = list(split_points)
    named = isinstance(inputs, Mapping)
    if traced is not None:
        (gm, kinds), output_spec, tracer = traced, None, "fx"
        input_names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    else:  # a sample of distinct tensors, as every batch is (model_io.distinct_inputs)
        inputs = model_io.distinct_inputs(inputs, model)
        gm, input_names, output_spec, tracer = _trace_or_export(model, inputs, concrete_args,
                                                                keep_calls, enclosing_calls)
        kinds = None
    if stage_of is not None:
        if tracer != "fx":
            raise ValueError(f"{type(model).__name__} traces only with torch.export, and plans "
                             "(balance='auto' or a plan file) cut torch.fx graphs; give "
                             "split_points=[module names] instead")
        starts: Any = stage_assignment(gm, stage_of)
    else:
        starts = stage_starts(gm, model, split_points)
    if tracer == "export":  # sizes are symbolic integers there: each stage makes its own
        starts = export.localize_sizes(gm, starts)
    live = live_sets(gm, starts)
    if kinds is None:
        positional = tuple(inputs[n] for n in input_names) if named else tuple(inputs)
        kinds = value_kinds(gm, positional)
    stages = _finished_stages(model, gm, starts, live, kinds)
    fingerprint = graph_fingerprint(gm, model, node_stages(gm, starts), live, count_stages(starts))
    digests = {n: d for values, cut in zip(live, fingerprint.cuts) for n, d in zip(values, cut)}
    return TracedSplit(stages, [[n.name for n in values] for values in live], split_points,
                       input_names if named else None, output_spec, tracer, fingerprint,
                       _Cut(model, gm, starts, live, kinds, digests))


def _finished_stages(model: nn.Module, gm: fx.GraphModule, starts: Any,
                     live: Sequence[Sequence[fx.Node]],
                     kinds: Mapping[fx.Node, str]) -> List[fx.GraphModule]:
    """:func:`build_stages`, checked, with the model's constants kept out of state dicts
    and the tensors the forward never reads in the last stage."""
    stages = build_stages(gm, starts, live, kinds)
    check_one_stage_per_state(stages)
    # Tensors fx computed while tracing (``torch.full((8,), 0.1)``) are attributes of the
    # traced root (``_tensor_constant0``), not of the model, and so are the model's
    # non-persistent buffers: kept out of state dicts.
    own = set(model.state_dict())
    for stage in stages:
        for node in stage.graph.nodes:
            if node.op == "get_attr" and str(node.target) not in own:
                *prefix, field = str(node.target).split(".")
                owner = stage.get_submodule(".".join(prefix))
                if field in owner._buffers:  # noqa: SLF001 - torch internal
                    owner.register_buffer(field, owner._buffers[field], persistent=False)  # noqa: SLF001 - torch internal
    # Parameters and buffers the forward never reads still belong to the model (its
    # state_dict): the last stage keeps them so checkpoints hold the whole model.
    held = set().union(*(tensor_paths(stage) for stage in stages))
    for name in sorted(tensor_paths(model) - held):
        install_attribute(model, stages[-1], name)
    return stages


def reorder_cuts(split: TracedSplit, orders: Sequence[Sequence[str]]) -> TracedSplit:
    """The same stages with the values crossing cut ``k`` in the order of ``orders[k - 1]``
    (digests: another rank's ``fingerprint.cuts``), built again.

    Two ranks whose Python traced independent operations in another order (a ``set``
    iterated under another ``PYTHONHASHSEED``) compute the same values but list them
    in another graph order; values travel by position, so every rank must send and
    expect them in one order.

    Raises:
        ValueError: a cut's values are not those of ``orders`` (other computations).
    """
    cut = split.cut
    assert cut is not None and split.fingerprint is not None
    if [list(o) for o in orders] == split.fingerprint.cuts:
        return split
    live: List[List[fx.Node]] = []
    for k, (values, order) in enumerate(zip(cut.live, orders), start=1):
        pool = list(values)
        chosen = []
        for digest in order:
            match = next((n for n in pool if cut.digests[n] == digest), None)
            if match is None:
                raise ValueError(f"cut {k}: no value of this rank's graph has fingerprint "
                                 f"{digest} (its values: {[n.name for n in values]})")
            pool.remove(match)
            chosen.append(match)
        if pool:
            raise ValueError(f"cut {k}: {[n.name for n in pool]} cross it here but not there")
        live.append(chosen)
    stages = _finished_stages(cut.model, cut.gm, cut.starts, live, cut.kinds)
    fingerprint = dataclasses.replace(split.fingerprint,
                                      cuts=[[cut.digests[n] for n in values] for values in live])
    return dataclasses.replace(split, stages=stages, live=[[n.name for n in v] for v in live],
                               fingerprint=fingerprint,
                               cut=dataclasses.replace(cut, live=live))


def _trace_or_export(model: nn.Module, inputs: Union[Tuple[torch.Tensor, ...], Mapping[str, Any]],
                     concrete_args: Optional[Mapping[str, Any]], keep_calls: Sequence[str] = (),
                     enclosing_calls: Sequence[str] = ()
                     ) -> Tuple[fx.GraphModule, List[str], Optional[Any], str]:
    """The model's graph: torch.fx, else torch.fx keeping ``enclosing_calls`` too, else
    torch.export (``keep_calls``, ``enclosing_calls``: as :func:`split_model`).

    Returns:
        The graph, the input names in its order (named inputs), the output structure
        (export: the last stage returns its leaves flat), and ``"fx"`` or ``"export"``.

    Raises:
        ValueError: neither can trace it (both reasons, with the module and line).
    """
    named = isinstance(inputs, Mapping)
    fx_error: Optional[UntraceableError] = None
    for keep in [list(keep_calls)] + ([list(keep_calls) + list(enclosing_calls)] if enclosing_calls else []):
        try:
            gm = trace_model(model, len(inputs), concrete_args,
                             input_names=list(inputs) if named else None, keep_calls=keep)
        except UntraceableError as exc:
            fx_error = fx_error or exc
            continue
        if fx_error is not None:
            _log.info("torch.fx traces %s with %s kept as module calls (%s)", type(model).__name__,
                      list(enclosing_calls), fx_error.reason)
        return gm, [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"], None, "fx"
    assert fx_error is not None
    try:
        gm, export_names, spec = export.export_model(model, inputs, concrete_args, keep_calls)
    except export.ExportRefused as exc:
        raise ValueError(f"{fx_error.reason}; torch.export (non-strict) exports it, but "
                         f"{exc}. To trace it with torch.fx: {fx_error.advice}") from exc
    except Exception as exc:  # reported with fx's reason
        raise ValueError(
            f"{fx_error.reason}; torch.export (non-strict) cannot export it either: "
            f"{type(exc).__name__}{_where(exc, model)}: {_first_line(exc).rstrip('.')}. "
            f"{fx_error.advice} (the whole forward is traced, whatever the split "
            "points)") from exc
    return gm, export_names or [], spec, "export"


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).strip().split("\n")[0].split())
    return (text[:limit] + "...") if len(text) > limit else text
