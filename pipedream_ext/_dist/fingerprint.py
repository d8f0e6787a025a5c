"""Canonical fingerprints of what a rank will run: stage graphs, layers, tensors.

Owns the digests ranks compare to prove they agree (``_agree``): every rank
traces (or slices) the model on its own, so two ranks can build different
stages from the same script: a forward that iterates a ``set`` of strings
(whose order follows ``PYTHONHASHSEED``, which torchrun leaves random per
process), reads the rank, or a model built differently on one rank. A
fingerprint is independent of everything that may legitimately differ between
ranks (fx node names, the order of independent operations, device indices) and
depends on everything that decides what a stage computes:

* a graph node's digest is a Merkle hash: its operation (a function's qualified
  name, a called module's path, type, configuration and tensor shapes, a read
  parameter's name and shape, a read buffer's or constant's *value*), its
  constant arguments and the digests of the nodes it uses, never its name;
* a stage's digest covers the multiset of its nodes' digests and of the values
  crossing into and out of it, so two ranks agree on a stage exactly when it
  computes the same values from the same inputs, in whatever order their Python
  happened to trace independent operations;
* an ``nn.Sequential``'s layers are described module by module (type,
  ``extra_repr()``, tensor shapes and dtypes), position included.

:class:`StagesFingerprint` holds, per stage, the digest and (on demand, for the
error message) one readable entry per node or module, so that the first
difference can be named. Digests are 16 hex digits of BLAKE2b.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch import nn

__all__ = ["digest_text", "tensor_digest", "Entry", "StagesFingerprint", "node_digests",
           "graph_fingerprint", "layers_fingerprint", "first_difference"]


def digest_text(text: str) -> str:
    """16 hex digits of BLAKE2b over ``text`` (never Python's ``hash``, which is seeded)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a tensor's dtype, shape and bytes (a meta tensor: dtype and shape only)."""
    head = f"{t.dtype}{list(t.shape)}"
    if t.device.type == "meta":
        return digest_text(head + ":meta")
    data = t.detach()
    if data.layout != torch.strided:
        data = data.to_dense()
    data = data.cpu().contiguous().reshape(-1)
    h = hashlib.blake2b(head.encode("utf-8"), digest_size=8)
    if data.numel():
        h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.hexdigest()


def _qualname(fn: Any) -> str:
    """A function's or operator's stable name (``aten.add.Tensor``, ``torch.nn.functional.relu``)."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # noqa: SLF001
        return str(fn)
    if isinstance(fn, torch._ops.HigherOrderOperator):  # noqa: SLF001
        return f"higher_order.{fn.name()}"
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or \
        type(fn).__qualname__
    return f"{module}.{name}"


def _canon(value: Any, digest: Callable[[fx.Node], str]) -> str:
    """A constant argument as text that means the same on every rank (no names, no ids)."""
    if isinstance(value, fx.Node):
        return "%" + digest(value)
    if isinstance(value, (list, tuple)):
        inner = ",".join(_canon(v, digest) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        return "{" + ",".join(f"{k!r}:{_canon(v, digest)}" for k, v in items) + "}"
    if isinstance(value, slice):
        return f"slice({_canon(value.start, digest)},{_canon(value.stop, digest)}," \
               f"{_canon(value.step, digest)})"
    if isinstance(value, torch.device):
        return f"device({value.type})"  # cuda:0 on one rank is cuda:1 on the next
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return "tensor:" + tensor_digest(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if callable(value):
        return _qualname(value)
    text = repr(value)
    return type(value).__qualname__ if (" at 0x" in text or "object at" in text) else text


def _module_text(module: nn.Module, path: str) -> str:
    """A called module as the graph sees it: type, configuration, tensors (buffers by value)."""
    if isinstance(module, fx.GraphModule):
        return f"graph {graph_digest(module)}"
    parts = [f"{type(module).__module__}.{type(module).__qualname__}({module.extra_repr()})"]
    for name, sub in module.named_modules():
        if name:
            parts.append(f"{name}:{type(sub).__qualname__}({sub.extra_repr()})")
    for name, p in module.named_parameters(remove_duplicate=False):
        parts.append(f"param {name}:{p.dtype}{list(p.shape)}")
    for name, b in module.named_buffers(remove_duplicate=False):
        parts.append(f"buffer {name}:{tensor_digest(b)}")
    return f"{path} " + " ".join(parts)


def _fetch(root: nn.Module, target: str) -> Any:
    value: Any = root
    for item in target.split("."):
        value = getattr(value, item)
    return value


def _attr_text(root: nn.Module, target: str, own: Set[str]) -> str:
    """A read attribute: a parameter by name and shape; a buffer by name and value; a
    constant the tracer made (``_tensor_constant0``, numbered in trace order) by value."""
    value = _fetch(root, target)
    if isinstance(value, nn.Parameter):
        return f"param {target}:{value.dtype}{list(value.shape)}"
    if isinstance(value, torch.Tensor):
        return (f"buffer {target}:" if target in own else "constant:") + tensor_digest(value)
    if isinstance(value, fx.GraphModule):
        return f"graph {graph_digest(value)}"
    if isinstance(value, nn.Module):
        return _module_text(value, target if target in own else "")
    return "object " + _canon(value, lambda n: "")


def node_digests(gm: fx.GraphModule, own_tensors: Optional[Set[str]] = None,
                 own_modules: Optional[Set[str]] = None) -> Dict[fx.Node, str]:
    """The Merkle digest of every node of ``gm`` (see the module docstring).

    Args:
        gm: a traced graph.
        own_tensors: the model's parameter and buffer names (others read are
            constants the tracer made, described by value).
        own_modules: the model's module paths (others called, such as the export
            path's ``_dropout0``, are described by type, not by their numbered path).
    """
    own_tensors = own_tensors if own_tensors is not None else set()
    own_modules = own_modules if own_modules is not None else set()
    digests: Dict[fx.Node, str] = {}
    described: Dict[Tuple[str, str], str] = {}  # a module called several times: hashed once
    index = 0
    for node in gm.graph.nodes:
        path = str(node.target)
        if node.op == "placeholder":
            head = f"input {index} {node.target}"
            index += 1
        elif node.op == "get_attr":
            if ("attr", path) not in described:
                described[("attr", path)] = "attr " + _attr_text(gm, path, own_tensors | own_modules)
            head = described[("attr", path)]
        elif node.op == "call_module":
            if ("module", path) not in described:
                described[("module", path)] = "module " + _module_text(
                    gm.get_submodule(path), path if path in own_modules else "")
            head = described[("module", path)]
        elif node.op == "call_function":
            head = "call " + _qualname(node.target)
        elif node.op == "call_method":
            head = f"method {node.target}"
        else:
            head = node.op
        text = head + _canon(node.args, digests.__getitem__) + _canon(node.kwargs,
                                                                       digests.__getitem__)
        digests[node] = digest_text(text)
    return digests


def graph_digest(gm: fx.GraphModule) -> str:
    """One digest for a whole (sub)graph: its output's (a higher-order operator's body)."""
    digests = node_digests(gm)
    output = next(n for n in reversed(list(gm.graph.nodes)) if n.op == "output")
    return digests[output]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One node (or module) of a stage, for naming a difference.

    Attributes:
        digest: its fingerprint.
        text: what it is, readable (``relu = call_module 1 (ReLU())``).
        inputs: the digests of the nodes it uses.
    """

    digest: str
    text: str
    inputs: Tuple[str, ...] = ()

    def to_json(self) -> List[Any]:
        return [self.digest, self.text, list(self.inputs)]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> "Entry":
        return cls(str(value[0]), str(value[1]), tuple(str(v) for v in value[2]))


@dataclasses.dataclass
class StagesFingerprint:
    """What a rank believes every stage of the pipeline computes.

    Attributes:
        kind: ``"graph"`` (a traced model) or ``"layers"`` (an ``nn.Sequential``).
        stages: one digest per stage.
        cuts: for a traced model, the digests of the values crossing each cut
            ``k = 1 .. S-1``, in the order they travel (empty for layers).
        entries_fn: makes the readable entries of stage ``j`` (only on a mismatch).
    """

    kind: str
    stages: List[str]
    cuts: List[List[str]]
    entries_fn: Callable[[int], List[Entry]] = dataclasses.field(repr=False, compare=False)

    def entries(self, stage: int) -> List[Entry]:
        return self.entries_fn(stage)


def _short(target: Any) -> str:
    text = _qualname(target) if callable(target) else str(target)
    for prefix in ("torch._VariableFunctionsClass.", "torch.nn.functional.", "_operator."):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _readable(node: fx.Node, gm: fx.GraphModule) -> str:
    """``name = what(args)  [in module 'path']`` for an error message."""
    def arg(value: Any) -> str:
        if isinstance(value, fx.Node):
            return value.name
        if isinstance(value, (list, tuple)):
            inner = ", ".join(arg(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        return repr(value) if not isinstance(value, torch.Tensor) else \
            f"tensor{list(value.shape)}"

    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        what = f"{node.target} ({type(module).__name__}({module.extra_repr()}))"
    elif node.op == "get_attr":
        value = _fetch(gm, str(node.target))
        what = str(node.target)
        if isinstance(value, nn.Parameter):
            what += f" (parameter {value.dtype}{list(value.shape)})"
        elif isinstance(value, torch.Tensor):  # compared by value: say which
            what += f" (tensor {value.dtype}{list(value.shape)}, value {tensor_digest(value)})"
    else:
        what = _short(node.target)
    args = ", ".join([arg(a) for a in node.args] +
                     [f"{k}={arg(v)}" for k, v in node.kwargs.items()])
    stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    where = f"  [in {stack[-1]!r}]" if stack and stack[-1] else ""
    return f"{node.name} = {node.op} {what}({args}){where}"


def graph_fingerprint(gm: fx.GraphModule, model: nn.Module, stage_of: Mapping[fx.Node, int],
                      live: Sequence[Sequence[fx.Node]], num_stages: int) -> StagesFingerprint:
    """The fingerprint of a traced model cut into stages.

    Args:
        gm: the whole traced graph (after any per-stage rewriting).
        model: the model it was traced from (its parameter, buffer and module names).
        stage_of: the stage of every placeholder, computing node and the output.
        live: the values crossing each cut, in the order they travel.
        num_stages: stages in the pipeline.
    """
    own_tensors = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in model.named_buffers(remove_duplicate=False)}
    own_modules = {n for n, _ in model.named_modules(remove_duplicate=False)}
    digests = node_digests(gm, own_tensors, own_modules)
    cuts = [[digests[n] for n in values] for values in live]
    members: List[List[fx.Node]] = [[] for _ in range(num_stages)]
    for node in gm.graph.nodes:
        if node in stage_of and node.op != "placeholder":
            members[stage_of[node]].append(node)
    stages = []
    for j in range(num_stages):
        ins = sorted(cuts[j - 1]) if j else sorted(digests[n] for n in gm.graph.nodes
                                                  if n.op == "placeholder")
        outs = sorted(cuts[j]) if j < num_stages - 1 else []
        text = f"stage in {ins} ops {sorted(digests[n] for n in members[j])} out {outs}"
        stages.append(digest_text(text))

    def entries(j: int) -> List[Entry]:
        # The attributes a stage reads are made by the stage itself: listed with it.
        reads = {a: None for n in members[j] for a in n.all_input_nodes if a.op == "get_attr"}
        return [Entry(digests[n], _readable(n, gm), tuple(digests[a] for a in n.all_input_nodes))
                for n in list(reads) + members[j]]

    return StagesFingerprint("graph", stages, cuts, entries)


def _layer_entries(l: int, name: str, layer: nn.Module) -> List[Entry]:
    out = []
    for sub_name, sub in layer.named_modules():
        path = f"{name}.{sub_name}" if sub_name else name
        tensors = [f"{n} {p.dtype}{list(p.shape)}" for n, p in sub.named_parameters(recurse=False)]
        values = [f"{n} {b.dtype}{list(b.shape)}" for n, b in sub.named_buffers(recurse=False)]
        text = f"layer {l}, module {path!r}: {type(sub).__name__}({sub.extra_repr()})"
        if tensors or values:
            text += " with " + ", ".join(tensors + values)
        kind = f"{type(sub).__module__}.{type(sub).__qualname__}"
        out.append(Entry(digest_text(f"{text} {kind}"), text))
    return out


def layers_fingerprint(module: nn.Sequential, bounds: Sequence[int]) -> StagesFingerprint:
    """The fingerprint of an ``nn.Sequential`` cut at ``bounds`` (``[0, end0, end1, ...]``):
    every module of every layer by position, type, configuration and tensor shapes and
    dtypes. Values are not compared: a stage's tensors live on its own ranks (replicas
    get their leader's), and with deferred initialisation a rank holds real tensors
    only for its own layers (the others stay on the meta device)."""
    children = list(module.named_children())
    by_stage = [[e for l in range(bounds[j], bounds[j + 1])
                 for e in _layer_entries(l, *children[l])] for j in range(len(bounds) - 1)]
    stages = [digest_text(" ".join(e.digest for e in entries)) for entries in by_stage]
    return StagesFingerprint("layers", stages, [], lambda j: by_stage[j])


def first_difference(mine: Sequence[Entry], reference: Sequence[Entry]
                     ) -> Tuple[Optional[Entry], Optional[Entry]]:
    """Where two ranks' versions of one stage first differ: on each side, the first entry
    the other side lacks whose inputs the other side has (or that come from an earlier,
    agreeing stage), so a difference is named where it starts, not where it propagates.

    Returns:
        ``(mine, theirs)``; either is ``None`` where one side has nothing in its place.
    """
    def root(side: Sequence[Entry], other: Sequence[Entry]) -> Optional[Entry]:
        others = {e.digest for e in other}
        own = {e.digest for e in side}
        for e in side:
            if e.digest not in others and all(i in others or i not in own for i in e.inputs):
                return e
        return next((e for e in side if e.digest not in others), None)

    return root(mine, reference), root(reference, mine)
