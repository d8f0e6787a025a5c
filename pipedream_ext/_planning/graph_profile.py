"""Any ``nn.Module`` -> PipeDream's profile graph with its real edges, and plans back.

Owns the planner's view of a traced model (``balance="auto"`` without
``split_points``, and ``profile`` / ``python -m pipedream_ext profile`` of a model
that is not an ``nn.Sequential``): the torch.fx graph's computing nodes are cut
into *groups*, each group is one profile node (timed forward and backward on its
own, output activation bytes, parameter bytes), and every data dependency between
two groups is an edge of ``graph.txt``, so a skip connection is an edge and the
planner's antichain DP partitions the model's real DAG. A plan made from such a
profile maps back to a stage per fx node (:func:`plan_stage_of`), which
``_trace.split_model`` cuts.

Groups (docs/tracing.md, "Planning a traced model"):

1. A group is one call of a module at depth ``d`` (``layer1`` is depth 1,
   ``layer1.0`` depth 2, ...) together with the functional operations that follow
   it in the same or an enclosing module (``torch.flatten`` after ``layer2``,
   ``out + skip`` and ``relu`` after a block's last convolution). ``d`` is the
   deepest at which the model has at most ``max_groups`` groups (default 128; the
   leaf modules, ``Conv2d``, ``BatchNorm2d``, ..., when they fit), so the planner
   has every cut it can use and stays fast.
2. Groups are contiguous runs of the graph's order, so their graph is a DAG.
3. Runs are merged (all groups between them) where a cut could not run: a value
   that is not a tensor (``x.size(0)``, a tuple) is in the group of every user;
   a parameter, or a called module's buffers, in one group (a module with state
   called twice keeps both calls together, like ``_trace`` requires).

Attribute reads (parameters and buffers read in a forward, constants fx made
while tracing) are no group's: every stage using one reads it itself. Model
inputs are ``Input`` nodes (the planner puts them in stage 0).

Index legend: ``g`` group, ``j`` stage.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import os
import statistics
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
from torch import nn
from tqdm import tqdm

from .._extension import _C
from .._frontend.fx_graph import compute_nodes, value_kinds
from .._frontend.graph_split import trace_model
from .timing import Timer, preserved

__all__ = ["Group", "GraphGroups", "group_graph", "trace_groups", "group_boundaries", "group_module",
           "profile_groups", "profile_traced", "plan_stage_of", "plan_split_labels"]

log = logging.getLogger(__name__)

#: Default bound on the number of groups (profile nodes) the depth is chosen for.
MAX_GROUPS = 128

# (key, path) of each module call a node runs in, outermost first; the key tells
# two calls of one module apart (torch.fx names the second ``path@1``).
Calls = Tuple[Tuple[str, str], ...]


@dataclasses.dataclass
class Group:
    """One profile node: a contiguous run of the traced graph's computing nodes.

    Attributes:
        id: the profile node id (``node3``).
        nodes: the fx nodes, in graph order.
        path: the module its first node runs in (``""``: the model's own forward).
        description: graph.txt's description (``layer1.0.conv1 (Conv2d)``,
            ``layer2.0.bn2 [layer2_0_bn2, add_2, relu_6]``).
        parameters: names of the parameters it uses (each once).
        parameter_bytes: their bytes.
    """

    id: str
    nodes: List[fx.Node]
    path: str
    description: str
    parameters: List[str]
    parameter_bytes: float


@dataclasses.dataclass
class GraphGroups:
    """A traced model cut into groups for the planner.

    Attributes:
        gm: the traced model.
        inputs: its placeholders (the tensor inputs), one ``Input`` node each.
        input_ids: their profile node ids (``node1`` ...).
        groups: the groups in graph order.
        edges: ``(producer id, consumer id)`` for every data dependency between
            profile nodes, without repeats.
        depth: the module depth of the groups (``None``: the leaf modules).
        group_of: computing node -> index into ``groups``.
        kinds: each node's value type on the sample (``fx_graph.value_kinds``), kept so
            the model is not run again when the plan's stages are cut from ``gm``.
    """

    gm: fx.GraphModule
    inputs: List[fx.Node]
    input_ids: List[str]
    groups: List[Group]
    edges: List[Tuple[str, str]]
    depth: Optional[int]
    group_of: Dict[fx.Node, int]
    kinds: Mapping[fx.Node, str]


def _calls(node: fx.Node) -> Calls:
    stack = [(key, value[0]) for key, value in (node.meta.get("nn_module_stack") or {}).items()]
    if node.op == "call_module" and (not stack or stack[-1][1] != str(node.target)):
        stack.append((str(node.target), str(node.target)))
    return tuple(stack)


def _starts(calls: Sequence[Calls], depth: Optional[int]) -> List[int]:
    """Positions where a group starts: a node whose module calls (cut at ``depth``) are
    not those of the node before it or an enclosing part of them."""
    starts: List[int] = []
    prev: Calls = ()
    for i, c in enumerate(calls):
        anchor = c if depth is None else c[:depth]
        if i == 0 or anchor != prev[:len(anchor)]:
            starts.append(i)
        prev = anchor
    return starts


def _choose_depth(calls: Sequence[Calls], max_groups: int) -> Optional[int]:
    """The deepest module depth with at most ``max_groups`` groups (``None``: the leaves
    fit), else depth 1."""
    deepest = max((len(c) for c in calls), default=0)
    if len(_starts(calls, None)) <= max_groups:
        return None
    for depth in range(deepest - 1, 0, -1):
        if len(_starts(calls, depth)) <= max_groups:
            return depth
    return 1


def _state_names(gm: fx.GraphModule, node: fx.Node) -> List[str]:
    """Parameters and called modules' buffers ``node`` uses (which one stage must hold)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return [f"{node.target}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)] + \
            [f"{node.target}.{n}" for n, _ in module.named_buffers(remove_duplicate=False)]
    names = []
    for a in node.all_input_nodes:
        if a.op == "get_attr" and isinstance(_attribute(gm, str(a.target)), nn.Parameter):
            names.append(str(a.target))
    return names


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    return operator.attrgetter(target)(gm)


def _merge_intervals(num: int, spans: Sequence[Tuple[int, int]]) -> List[int]:
    """For ``num`` runs and spans ``[lo, hi]`` that must be one group: the group of each run."""
    joined = [False] * num  # joined[g]: run g is in the group of run g - 1
    for lo, hi in spans:
        for g in range(lo + 1, hi + 1):
            joined[g] = True
    group, out = -1, []
    for g in range(num):
        group += 0 if joined[g] and g > 0 else 1
        out.append(group)
    return out


def _describe(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> Tuple[str, str]:
    """``(path, description)`` of a group; ``path`` is the module its first node runs in."""
    calls = _calls(nodes[0])
    path = calls[-1][1] if calls else ""
    if len(nodes) == 1 and nodes[0].op == "call_module":
        text = f"{path} ({type(gm.get_submodule(path)).__name__})"
    else:
        names = ", ".join(n.name for n in nodes) if len(nodes) <= 4 else \
            f"{nodes[0].name} .. {nodes[-1].name}: {len(nodes)} ops"
        text = f"{path or '(forward)'} [{names}]"
    if text.startswith(("Input", "__getitem__")):  # the planner treats those prefixes apart
        text = "op " + text
    return path, " ".join(text.replace(" -- ", " - ").split())


def group_graph(gm: fx.GraphModule, kinds: Mapping[fx.Node, str],
                max_groups: int = MAX_GROUPS, depth: Optional[int] = None) -> GraphGroups:
    """Cuts ``gm``'s computing nodes into groups (the module docstring's rules).

    Args:
        gm: the traced model (``_trace.trace_model``).
        kinds: each node's value type on the sample (``fx_graph.value_kinds``).
        max_groups: the most groups the automatic depth may give.
        depth: the module depth to group at (1: the model's children); ``None``
            chooses the deepest with at most ``max_groups`` groups.

    Returns:
        The groups, their ids and edges.

    Raises:
        ValueError: ``max_groups`` or ``depth`` below 1, or a graph without operations.
    """
    if max_groups < 1 or (depth is not None and depth < 1):
        raise ValueError(f"max_groups={max_groups} and depth={depth} must be >= 1 (depth "
                         "None: chosen automatically)")
    nodes = compute_nodes(gm.graph)
    if not nodes:
        raise ValueError("the traced model has no operations to profile")
    calls = [_calls(n) for n in nodes]
    if depth is None:
        depth = _choose_depth(calls, max_groups)
    starts = _starts(calls, depth)
    run_of: Dict[fx.Node, int] = {}
    for r, (lo, hi) in enumerate(zip(starts, starts[1:] + [len(nodes)])):
        for n in nodes[lo:hi]:
            run_of[n] = r
    last = len(starts) - 1
    spans: List[Tuple[int, int]] = []
    # A value that is not a tensor stays with every user (the output: the last group).
    for n in nodes:
        if kinds.get(n, "Tensor") != "Tensor" and n.users:
            users = [run_of.get(u, last) for u in n.users]
            spans.append((run_of[n], max(users)))
    # A parameter, or a called module's buffer, in one group.
    holders: Dict[str, List[int]] = {}
    for n in nodes:
        for name in _state_names(gm, n):
            holders.setdefault(name, []).append(run_of[n])
    spans.extend((min(rs), max(rs)) for rs in holders.values() if min(rs) != max(rs))
    group_index = _merge_intervals(len(starts), spans)
    members: List[List[fx.Node]] = [[] for _ in range(group_index[-1] + 1)]
    for n in nodes:
        members[group_index[run_of[n]]].append(n)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_ids = [f"node{i + 1}" for i in range(len(inputs))]
    group_of = {n: g for g, ns in enumerate(members) for n in ns}
    groups = []
    for g, ns in enumerate(members):
        params: Dict[str, torch.Tensor] = {}
        for n in ns:
            for name in _state_names(gm, n):
                value = _attribute(gm, name)
                if isinstance(value, nn.Parameter):
                    params.setdefault(name, value)
        distinct = {id(p): p for p in params.values()}
        path, description = _describe(gm, ns)
        groups.append(Group(f"node{len(inputs) + g + 1}", ns, path, description, list(params),
                            float(sum(p.numel() * p.element_size() for p in distinct.values()))))
    source = {p: input_ids[i] for i, p in enumerate(inputs)}
    edges: Dict[Tuple[str, str], None] = {}
    for g, ns in enumerate(members):
        for n in ns:
            for a in n.all_input_nodes:
                if a in source:
                    edges[(source[a], groups[g].id)] = None
                elif a in group_of and group_of[a] != g:
                    edges[(groups[group_of[a]].id, groups[g].id)] = None
    return GraphGroups(gm, inputs, input_ids, groups, list(edges), depth, group_of, kinds)


def trace_groups(model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                 concrete_args: Optional[Mapping[str, Any]] = None,
                 max_groups: int = MAX_GROUPS, depth: Optional[int] = None,
                 input_names: Optional[Sequence[str]] = None) -> GraphGroups:
    """Traces ``model`` (``_trace.trace_model``) and groups its graph.

    The model runs once on ``inputs`` in eval mode (value types; no state changes).

    Args:
        inputs: the tensor inputs, positionally; with ``input_names``, in the graph's
            input order (``forward``'s), each passed by that name.

    Raises:
        ValueError: what ``trace_model`` and :func:`group_graph` refuse.
    """
    gm = trace_model(model, len(inputs), concrete_args, input_names=input_names)
    return group_graph(gm, value_kinds(gm, inputs), max_groups, depth)


def group_module(gm: fx.GraphModule, nodes: Sequence[fx.Node], ins: Sequence[fx.Node],
                  outs: Sequence[fx.Node]) -> fx.GraphModule:
    """``ins`` -> the group's operations -> the tuple of ``outs`` (the model's own modules)."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {v: graph.placeholder(v.name) for v in ins}

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:  # an attribute read: the group reads it itself
            env[a] = graph.node_copy(a)
        return env[a]

    for n in nodes:
        env[n] = graph.node_copy(n, lookup)
    graph.output(tuple(env[o] for o in outs))
    return fx.GraphModule(gm, graph)


def _leaf(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    d = value.detach()
    if d.is_floating_point() or d.is_complex():
        d.requires_grad_(True)
    return d


def _bytes(values: Sequence[Any]) -> float:
    return float(sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)))


def profile_groups(grouped: GraphGroups, inputs: Tuple[torch.Tensor, ...],
                   loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                   target: Any = None, steps: int = 20, warmup: int = 5,
                   progress: bool = False) -> "_C.ProfileGraph":
    """Times every group forward and backward on its own and builds the profile graph.

    Each group runs on detached copies of its inputs (``requires_grad`` for floating
    ones) in graph order; the backward runs the groups in reverse order, each with
    the sum of the gradients its outputs got from their users. Times are the median
    over ``steps`` steps after ``warmup`` (wall clock on CPU, CUDA events on GPU:
    ``timing.Timer``); the loss (or the output's sum) is timed with the last
    group. The model is left as it was (modes, buffers, gradients, RNG).

    Args:
        grouped: from :func:`trace_groups`.
        inputs: the sample's tensor inputs, on the model's device.
        loss_fn: ``loss_fn(output, target)``; ``None`` backpropagates the output's sum.
        target: the loss target.
        steps: measured steps (the median is reported).
        warmup: unmeasured steps first.
        progress: show a tqdm progress bar.

    Returns:
        ``Input`` nodes, one node per group (in graph order) and the groups' edges.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    gm, groups = grouped.gm, grouped.groups
    ins, outs = group_boundaries(grouped)
    modules = [group_module(gm, group.nodes, ins[g], outs[g]) for g, group in enumerate(groups)]
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    timer = Timer(device)
    fwd: List[List[float]] = [[] for _ in groups]
    bwd: List[List[float]] = [[] for _ in groups]
    act_bytes = [0.0] * len(groups)
    params = list(gm.parameters())
    iterator: Any = range(warmup + steps)
    if progress:
        iterator = tqdm(iterator, desc="profile", unit="step")
    with preserved([gm], device):
        for step in iterator:
            for p in params:
                p.grad = None
            values: Dict[fx.Node, Any] = dict(zip(grouped.inputs, inputs))
            xs, ys, f_thunks = _forward_groups(modules, ins, outs, values, timer, act_bytes)
            grads, loss_f, loss_b = _loss_backward(gm, values, loss_fn, target, timer)
            b_thunks = _backward_groups(ins, outs, xs, ys, grads, timer)
            timer.sync()
            if step >= warmup:
                for g in range(len(groups)):
                    extra = (loss_f(), loss_b()) if g == len(groups) - 1 else (0.0, 0.0)
                    fwd[g].append(f_thunks[g]() + extra[0])
                    bwd[g].append(b_thunks[g]() + extra[1])
        for p in params:
            p.grad = None
    return _profile_graph(grouped, inputs, fwd, bwd, act_bytes)


Nodes = List[List[fx.Node]]
Thunks = List[Callable[[], float]]


def group_boundaries(grouped: GraphGroups) -> Tuple[Nodes, Nodes]:
    """Each group's inputs (placeholders and other groups' values) and outputs (values a
    node outside the group uses)."""
    ins: Nodes = []
    outs: Nodes = []
    for group in grouped.groups:
        members = set(group.nodes)
        used = {a: None for n in group.nodes for a in n.all_input_nodes
                if a.op == "placeholder" or (a in grouped.group_of and a not in members)}
        ins.append(list(used))
        outs.append([n for n in group.nodes if any(u not in members for u in n.users)])
    return ins, outs


def _forward_groups(modules: Sequence[nn.Module], ins: Nodes, outs: Nodes,
                    values: Dict[fx.Node, Any], timer: Timer,
                    act_bytes: List[float]) -> Tuple[List[Any], List[Any], Thunks]:
    """Every group's forward on detached copies of its inputs, in graph order."""
    xs, ys, f_thunks = [], [], []
    for g, module in enumerate(modules):
        x = [_leaf(values[a]) for a in ins[g]]
        t0 = timer.start()
        y = module(*x)
        f_thunks.append(timer.stop(t0))
        values.update(zip(outs[g], y))
        act_bytes[g] = _bytes(y)
        xs.append(x)
        ys.append(y)
    return xs, ys, f_thunks


def _loss_backward(gm: fx.GraphModule, values: Dict[fx.Node, Any],
                   loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], target: Any,
                   timer: Timer) -> Tuple[Dict[fx.Node, torch.Tensor], Callable[[], float],
                                          Callable[[], float]]:
    """The loss (or the output's sum) on detached outputs and its backward, timed; returns
    the gradient of every output value and the two times."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves: Dict[fx.Node, Any] = {}

    def leaf(n: fx.Node) -> Any:
        if n not in leaves:
            leaves[n] = _leaf(values[n] if n in values else _attribute(gm, str(n.target)))
        return leaves[n]

    t0 = timer.start()
    result = fx.map_arg(output.args[0], leaf)
    root = loss_fn(result, target) if loss_fn is not None else sum(
        t.float().sum() for t in leaves.values()
        if isinstance(t, torch.Tensor) and t.requires_grad)
    loss_f = timer.stop(t0)
    t0 = timer.start()
    if isinstance(root, torch.Tensor) and root.requires_grad:
        root.backward()
    loss_b = timer.stop(t0)
    grads = {n: t.grad for n, t in leaves.items()
             if isinstance(t, torch.Tensor) and t.grad is not None}
    return grads, loss_f, loss_b


def _backward_groups(ins: Nodes, outs: Nodes, xs: List[Any], ys: List[Any],
                     grads: Dict[fx.Node, torch.Tensor], timer: Timer) -> Thunks:
    """Every group's backward in reverse order, each fed the sum of the gradients its
    outputs got from their users."""
    b_thunks: Thunks = [lambda: 0.0] * len(ins)
    for g in reversed(range(len(ins))):
        pairs = [(y, grads[o]) for o, y in zip(outs[g], ys[g])
                 if o in grads and isinstance(y, torch.Tensor) and y.requires_grad]
        t0 = timer.start()
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [d for _, d in pairs])
        b_thunks[g] = timer.stop(t0)
        for a, x in zip(ins[g], xs[g]):
            if a.op != "placeholder" and isinstance(x, torch.Tensor) and x.grad is not None:
                grads[a] = grads[a] + x.grad if a in grads else x.grad
    return b_thunks


def _profile_graph(grouped: GraphGroups, inputs: Tuple[torch.Tensor, ...],
                   fwd: List[List[float]], bwd: List[List[float]],
                   act_bytes: List[float]) -> "_C.ProfileGraph":
    graph = _C.ProfileGraph()
    for i, (node, nid) in enumerate(zip(grouped.inputs, grouped.input_ids)):
        graph.add_node(nid, f"Input{i} {node.name}", 0.0, 0.0, _bytes([inputs[i]]), 0.0)
    for g, group in enumerate(grouped.groups):
        graph.add_node(group.id, group.description, statistics.median(fwd[g]),
                       statistics.median(bwd[g]), act_bytes[g], group.parameter_bytes)
    for a, b in grouped.edges:
        graph.add_edge(a, b)
    return graph


def profile_traced(model: nn.Module, sample_input: Union[torch.Tensor, Sequence[torch.Tensor]],
                   loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                   target: Any = None, steps: int = 20, warmup: int = 5,
                   output: Optional[Union[str, "os.PathLike[str]"]] = None,
                   progress: bool = False, concrete_args: Optional[Mapping[str, Any]] = None,
                   max_groups: int = MAX_GROUPS, depth: Optional[int] = None) -> "_C.ProfileGraph":
    """Traces, groups and profiles any ``nn.Module`` (``pipedream_ext.profile`` of a model
    that is not an ``nn.Sequential``).

    Args:
        model: the model, on its device.
        sample_input: one minibatch (a tensor or a tuple of tensors, positionally).
        loss_fn, target, steps, warmup, progress: as :func:`profile_groups`.
        output: where to write ``graph.txt`` (optional).
        concrete_args: non-tensor ``forward`` arguments fixed for tracing.
        max_groups, depth: as :func:`group_graph`. A plan runs on a traced model only
            with the default grouping (``PipeDream`` regroups with it).

    Returns:
        The profile graph: ``Input`` nodes, one node per group, real edges.
    """
    inputs = tuple(sample_input) if isinstance(sample_input, (tuple, list)) else (sample_input,)
    grouped = trace_groups(model, inputs, concrete_args, max_groups, depth)
    graph = profile_groups(grouped, inputs, loss_fn, target, steps, warmup, progress)
    log.info("profiled %s as %d groups (%s) over %d steps", type(model).__name__,
             len(grouped.groups), "leaf modules" if grouped.depth is None else
             f"module depth {grouped.depth}", steps)
    if output is not None:
        graph.save(os.fspath(output))
    return graph


def plan_stage_of(grouped: GraphGroups, plan: Any) -> Dict[str, int]:
    """The stage of every computing node (by fx name) under ``plan``.

    Args:
        grouped: this model's groups (the default grouping, as the profile had).
        plan: a :class:`~pipedream_ext.Plan` made from this model's graph profile.

    Returns:
        fx node name -> stage (``_trace.split_model(stage_of=...)`` checks the data flow).

    Raises:
        ValueError: the plan names nodes this profile does not have, misses some,
            lists one twice, or its stages' parameter bytes differ from this model's
            groups' (it was made from another model or grouping).
    """
    index = {group.id: g for g, group in enumerate(grouped.groups)}
    stage_of_group: Dict[int, int] = {}
    hint = ("; make the plan from this model's profile (pipedream_ext.profile or `python -m "
            "pipedream_ext profile` with the default grouping) or use balance='auto'")
    for j, stage in enumerate(plan.stages):
        for nid in stage.nodes:
            if nid in grouped.input_ids:
                continue  # model inputs enter at stage 0 whatever the plan says
            if nid not in index:
                raise ValueError(f"plan stage {j} lists node {nid!r}, which this model's graph "
                                 f"profile does not have (its groups are {grouped.groups[0].id}.."
                                 f"{grouped.groups[-1].id}){hint}")
            if index[nid] in stage_of_group:
                raise ValueError(f"plan lists node {nid!r} in stages {stage_of_group[index[nid]]} "
                                 f"and {j}{hint}")
            stage_of_group[index[nid]] = j
    missing = [group.id for g, group in enumerate(grouped.groups) if g not in stage_of_group]
    if missing:
        raise ValueError(f"plan puts nodes {missing[:5]} of this model's graph profile in no "
                         f"stage ({len(grouped.groups)} groups){hint}")
    if any(stage.parameter_bytes for stage in plan.stages):
        for j, stage in enumerate(plan.stages):
            here = sum(grouped.groups[g].parameter_bytes
                       for g, s in stage_of_group.items() if s == j)
            if abs(here - stage.parameter_bytes) > 0.5:
                raise ValueError(f"plan stage {j} has {stage.parameter_bytes:.0f} parameter bytes "
                                 f"but this model's groups in it have {here:.0f}{hint}")
    return {n.name: stage_of_group[g] for n, g in grouped.group_of.items()}


def plan_split_labels(grouped: GraphGroups, stage_of: Mapping[str, int]) -> List[str]:
    """For stages 1.., the module (or operation) where the stage's first operation runs."""
    labels: Dict[int, str] = {}
    for group in grouped.groups:
        j = stage_of[group.nodes[0].name]
        labels.setdefault(j, group.path or group.nodes[0].name)
    return [labels[j] for j in sorted(labels) if j > 0]
