"""Small helpers over torch.fx graphs shared by fx and ``torch.export`` tracing.

Owns what both tracing paths need to know of a traced graph: the module paths a node
runs in, the computing nodes, which stage each node falls in, the value type of each
node on a sample, and copying a model's attribute into a stage module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple, Union

import torch
import torch.fx as fx
from torch import nn

__all__ = ["CONSTANT_OPS", "Stages", "paths_of", "compute_nodes", "count_stages", "node_stages",
           "value_kinds", "install_attribute", "tensor_paths"]

# Attribute reads never cross a cut: every stage using one reads it itself (a parameter
# or buffer of the model, or a tensor fx computed while tracing, such as
# ``torch.full((8,), 0.1)`` in a forward, which it stores on the root).
CONSTANT_OPS = ("get_attr",)


Stages = Union[Sequence[int], Mapping[fx.Node, int]]


def paths_of(node: fx.Node) -> List[str]:
    """The module paths ``node`` runs in (its call stack of modules, and its target)."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op == "call_module":
        paths.append(str(node.target))
    elif node.op == "get_attr":
        paths.append(str(node.target).rsplit(".", 1)[0] if "." in str(node.target) else "")
    return paths


def compute_nodes(graph: fx.Graph) -> List[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output") + CONSTANT_OPS]


def count_stages(starts: Stages) -> int:
    if isinstance(starts, Mapping):
        return max(starts.values(), default=0) + 1
    return len(starts) + 1


def node_stages(gm: fx.GraphModule, starts: Stages) -> Dict[fx.Node, int]:
    """Stage of every placeholder (0), computing node and the output (last stage)."""
    stage_of: Dict[fx.Node, int] = {}
    if isinstance(starts, Mapping):  # a stage per computing node (a plan)
        stage_of.update((node, starts[node]) for node in compute_nodes(gm.graph))
    else:
        j = 0
        for i, node in enumerate(compute_nodes(gm.graph)):
            while j < len(starts) and i >= starts[j]:
                j += 1
            stage_of[node] = j
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
        elif node.op == "output":
            stage_of[node] = count_stages(starts) - 1
    return stage_of


def value_kinds(gm: fx.GraphModule, inputs: Tuple[torch.Tensor, ...]) -> Dict[fx.Node, str]:
    """The type of each node's value on the sample (modules in eval mode: no state changes)."""
    kinds: Dict[fx.Node, str] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            kinds[n] = "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            return value

    modes = {m: m.training for m in gm.modules()}
    gm.eval()  # BatchNorm would update its running statistics on the sample
    try:
        with torch.no_grad():
            Recorder(gm).run(*inputs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return kinds


def install_attribute(source: nn.Module, target: nn.Module, path: str) -> None:
    """Puts ``source``'s attribute at ``path`` into ``target`` at the same path, creating
    empty containers on the way (as ``GraphModule`` does), and sharing the object."""
    *prefix, field = path.split(".")
    for item in prefix:
        src, dst = getattr(source, item), getattr(target, item, None)
        if src is dst:
            return  # an ancestor is installed whole: the attribute is in it
        if dst is None:
            dst = nn.Module()
            setattr(target, item, dst)
        source, target = src, dst
    value = getattr(source, field)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        target.register_buffer(field, value,
                               persistent=field not in source._non_persistent_buffers_set)  # noqa: SLF001 - torch internal
    else:
        setattr(target, field, value)


def tensor_paths(module: nn.Module) -> Set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in module.named_buffers(remove_duplicate=False)}
