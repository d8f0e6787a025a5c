"""The ``torch.export`` path of tracing: models torch.fx cannot trace.

Owns turning a model that ``torch.fx.symbolic_trace`` refuses (a Hugging Face
transformer, whose forward inspects its arguments, builds masks and returns a
``ModelOutput``) into the same kind of graph ``_trace`` cuts: an fx
``GraphModule`` whose placeholders are the tensor inputs, whose attribute reads
(``get_attr``) are the model's *own* ``Parameter`` and buffer objects at their
original names, and whose output is a flat tuple of tensors (the structure is
returned separately, for ``_model_io.restore_output``).

``torch.export.export(..., strict=False)`` runs the forward in Python on fake
tensors and records ATen operations, with every dimension of every tensor input
dynamic (``Dim.AUTO``: microbatches have a smaller batch than the sample, and the
sequence length may change between steps). Its graph differs from fx's in three
ways this module handles:

* tied parameters are one tensor read under one of its names: each read is
  renamed to the name of the module that uses it (``transformer.wte.weight`` in
  the embedding, ``lm_head.weight`` in the head), so the stages hold the names
  fx stages would and the shared-parameter rule (``_shared``) applies;
* the graph is fixed in the mode the model had (``aten.dropout(x, p, True)``,
  ``aten.batch_norm(..., training=True, ...)`` updating the running statistics in
  place): dropout is turned back into ``nn.Dropout`` module calls (the model's own
  where it has one), which follow ``pipe.train()`` / ``pipe.eval()``; a graph that
  changes a buffer or an input in place (BatchNorm in training mode) is refused,
  fx handles such models (BatchNorm stays a module call there);
* tensors the forward creates (``torch.arange``, masks) are created on the device
  the model was exported on, a constant of the graph: :func:`retarget_devices`
  points them at the stage's device;
* sizes are symbolic integers (``sym_size``) computed once, near the inputs, and
  used everywhere: :func:`localize_sizes` recomputes them in every stage that
  uses them from a tensor available there, so only tensors cross a cut.

Design and limits: docs/tracing.md. Index legend: ``j`` stage.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim
from torch.utils._python_dispatch import TorchDispatchMode

from .fx_graph import compute_nodes, install_attribute, node_stages, paths_of

__all__ = ["ExportRefused", "export_model", "keep_module_calls", "localize_sizes", "retarget_devices"]


class ExportRefused(ValueError):
    """The model exports, but its graph is one the pipeline cannot run right."""

# Nodes that only check what the export assumed (dtypes, devices, value ranges):
# dropped with the input guards; the stages run on the shapes they are given.
_ASSERTIONS = {
    torch.ops.aten._assert_tensor_metadata.default,  # noqa: SLF001 - torch internal
    torch.ops.aten._assert_scalar.default,  # noqa: SLF001 - torch internal
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}
_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
# The stand-in export writes into nn_module_stack for nodes it created outside any module.
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


def _dynamic_shapes(model: nn.Module, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """``Dim.AUTO`` for every dimension of every tensor argument, by parameter name."""
    def auto(value: Any) -> Any:
        return tuple(Dim.AUTO for _ in value.shape) if isinstance(value, torch.Tensor) else None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(auto, value) for name, value in bound.arguments.items()}


def _tensor_of(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by every name (ties under each)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    return own


def _set_tensor(root: nn.Module, path: str, value: torch.Tensor) -> None:
    """Puts ``value`` itself at ``path`` in ``root`` (as a parameter or a buffer)."""
    *prefix, field = path.split(".")
    owner = root.get_submodule(".".join(prefix))
    if isinstance(value, nn.Parameter):
        owner._parameters[field] = value  # noqa: SLF001 - torch internal
    else:
        owner._buffers[field] = value  # noqa: SLF001 - torch internal


def _owner_path(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _rename_tied_reads(gm: fx.GraphModule, model: nn.Module) -> None:
    """Each read of a tensor that has several names in ``model`` uses the name of the
    module using it (the innermost one in the user's ``nn_module_stack``)."""

    own = _tensor_of(model)
    names: Dict[int, List[str]] = {}
    for name, tensor in own.items():
        names.setdefault(id(tensor), []).append(name)
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        tensor = own.get(str(node.target))
        aliases = names.get(id(tensor), []) if tensor is not None else []
        if len(aliases) < 2:
            continue
        for user in list(node.users):
            stack = paths_of(user)
            best = max((a for a in aliases if _owner_path(a) in stack),
                       key=lambda a: len(_owner_path(a)), default=str(node.target))
            if best == str(node.target):
                continue
            install_attribute(model, gm, best)
            with graph.inserting_after(node):
                read = graph.get_attr(best)
            read.meta = dict(node.meta)
            user.replace_input_with(node, read)


def _clean(gm: fx.GraphModule, inputs: Sequence[fx.Node]) -> None:
    """Drops the input guards, assertions, non-tensor input placeholders and unused
    attribute reads; the output becomes the flat tuple of leaves, plain codegen."""
    graph = gm.graph
    keep = set(inputs)
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        if (node.op == "call_module" and str(node.target) == "_guards_fn") or \
                (node.op == "call_function" and node.target in _ASSERTIONS) or \
                node.op == "get_attr" or (node.op == "placeholder" and node not in keep):
            graph.erase_node(node)
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack and any(path == _NO_MODULE for path, _ in stack.values()):
            node.meta["nn_module_stack"] = {}
    leftover = [n for n in graph.nodes if n.op == "placeholder" and n not in keep]
    if leftover:
        raise ExportRefused(f"the exported graph uses the non-tensor argument {leftover[0].name!r} "
                         "as a value; give it as a tensor input or fix it with concrete_args")
    output = next(n for n in graph.nodes if n.op == "output")
    flat = output.args[0]
    output.args = (tuple(flat) if isinstance(flat, (list, tuple)) else (flat,),)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs, flat outputs  # noqa: SLF001 - torch internal
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for name in ("train", "eval"):  # ep.module() refuses them (the graph's modes are fixed)
        gm.__dict__.pop(name, None)
    gm._forward_pre_hooks.clear()  # ep.module()'s check of the (args, kwargs) structure  # noqa: SLF001 - torch internal
    gm._forward_pre_hooks_with_kwargs.clear()  # noqa: SLF001 - torch internal
    graph.lint()
    gm.recompile()


def export_model(model: nn.Module, inputs: Any, concrete_args: Optional[Mapping[str, Any]],
                 keep_calls: Sequence[str] = ()
                 ) -> Tuple[fx.GraphModule, Optional[List[str]], pytree.TreeSpec]:
    """``torch.export`` (non-strict, dynamic shapes) -> a graph ``_trace`` can cut.

    Args:
        model: the whole model (not modified).
        inputs: a tuple of tensors (positional) or a dict of named tensors (keywords).
        concrete_args: non-tensor keyword arguments, fixed for every step.
        keep_calls: qualified names of modules whose calls the graph keeps as calls
            (:func:`keep_module_calls`).

    Returns:
        The graph module (placeholders: the tensor inputs; get_attr: the model's own
        tensors under the names of the modules using them; output: a flat tuple of
        tensors), the input names in placeholder order (``None`` for positional
        inputs), and the output's pytree structure.

    Raises:
        ExportRefused: the graph updates a buffer or an input in place (BatchNorm's
            running statistics: naming them), or the batch dimension of an input was
            fixed while exporting, or a module of ``keep_calls`` whose call is not one
            tensor in and one value out.
        Exception: what torch.export raises when it cannot export the forward.
    """
    named = isinstance(inputs, Mapping)
    args: Tuple[Any, ...] = () if named else tuple(inputs)
    kwargs: Dict[str, Any] = dict(inputs) if named else {}
    clash = sorted(set(kwargs) & set(concrete_args or {}))
    if clash:
        raise ExportRefused(f"{clash} given both as inputs and in concrete_args; give each once")
    # A fixed argument that only **kwargs takes (``use_cache`` of a BERT) cannot be given to
    # export as an input (its dynamic_shapes entry is refused): a pre-hook passes it instead.
    explicit, hooked = _explicit_arguments(model, concrete_args or {})
    kwargs.update(explicit)
    hook = model.register_forward_pre_hook(lambda _m, a, k: (a, {**k, **hooked}),
                                           with_kwargs=True) if hooked else None
    try:
        ep = torch.export.export(model, args, kwargs,
                                 dynamic_shapes=_dynamic_shapes(model, args, kwargs), strict=False,
                                 preserve_module_call_signature=tuple(keep_calls))
    finally:
        if hook is not None:
            hook.remove()
    signature = ep.graph_signature
    _refuse_updates(model, sorted(set(signature.buffers_to_mutate.values()) |
                                  set(signature.user_inputs_to_mutate.values())))
    gm = ep.module()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_argument = pytree.tree_unflatten(placeholders, gm._in_spec)  # noqa: SLF001 - torch internal
    graph_args, graph_kwargs = by_argument if len(by_argument) == 2 and \
        isinstance(by_argument[1], dict) else (by_argument, {})
    if named:
        name_of = {graph_kwargs[k]: k for k in inputs}
    else:
        name_of = {graph_args[i]: str(i) for i in range(len(args))}
    tensor_inputs = [p for p in placeholders if p in name_of]
    # The stages must hold the model's own tensors (optimizers, state_dict, checkpoints).
    own = _tensor_of(model)
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op == "get_attr" and target in own and \
                _get_attr(gm, target) is not own[target]:
            _set_tensor(gm, target, own[target])
    _rename_tied_reads(gm, model)
    _clean(gm, tensor_inputs)
    lifted = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
              **signature.inputs_to_lifted_tensor_constants}
    keep_module_calls(gm, model, keep_calls, ep.module_call_graph, lifted)
    _dropout_as_modules(gm, model)
    positional = tuple(inputs[name_of[p]] for p in tensor_inputs) if named else args
    _refuse_updates(model, _updated_in_place(gm, model, positional))
    for p in tensor_inputs:
        value = p.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() > 0 and \
                not isinstance(value.shape[0], torch.SymInt):
            raise ExportRefused(
                f"torch.export fixed dimension 0 (the batch) of input {name_of[p]!r} to "
                f"{value.shape[0]}, but microbatches have other batch sizes; give a sample whose "
                "batch is at least 2 and make the forward independent of the batch size")
    return gm, ([name_of[p] for p in tensor_inputs] if named else None), gm._out_spec  # noqa: SLF001 - torch internal


def _explicit_arguments(model: nn.Module, fixed: Mapping[str, Any]
                        ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``fixed`` split into the arguments ``forward`` names and those only its
    ``**kwargs`` takes."""
    parameters = inspect.signature(model.forward).parameters
    named = {k: v for k, v in fixed.items() if k in parameters and
             parameters[k].kind is not inspect.Parameter.VAR_KEYWORD}
    return named, {k: v for k, v in fixed.items() if k not in named}


def _refuse_updates(model: nn.Module, names: Sequence[str]) -> None:
    if names:
        raise ExportRefused(
            f"its graph changes {', '.join(map(repr, names[:4]))}"
            f"{' and more' if len(names) > 4 else ''} in place (running statistics such as "
            "BatchNorm's in training mode), which the torch.export path cannot keep right (its "
            "graph is fixed in one mode); make the forward traceable by torch.fx, which keeps "
            "BatchNorm a module call, or give the layers as an nn.Sequential (docs/tracing.md)")


class _Writes(TorchDispatchMode):
    """Records the storage of every tensor an operation writes (its schema's ``a!``
    arguments): what a run changes in place, without values (the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):  # noqa: SLF001 - torch internal
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor):
                    self.written.add(value.untyped_storage()._cdata)  # noqa: SLF001
        return func(*args, **kwargs)


@torch.no_grad()
def _written_on_meta(gm: fx.GraphModule, model: nn.Module,
                     inputs: Sequence[torch.Tensor]) -> List[str]:
    """:func:`_updated_in_place` for a model on the meta device: the buffers and inputs
    whose storage an operation of one run writes (there are no values to compare)."""
    tensors = [(name, t) for name, t in model.named_buffers()] + \
        [(f"input {i}", t) for i, t in enumerate(inputs)]
    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with _Writes() as writes:
            gm(*inputs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return [name for name, t in tensors if t.untyped_storage()._cdata in writes.written]  # noqa: SLF001


@torch.no_grad()
def _updated_in_place(gm: fx.GraphModule, model: nn.Module,
                      inputs: Sequence[torch.Tensor]) -> List[str]:
    """The model's buffers (and inputs) one run of ``gm`` on ``inputs`` changes; put back.

    Export's training graph keeps in-place updates (``add_`` on a counter,
    ``aten.batch_norm(..., training=True, ...)`` on the running statistics) on the
    model's own buffers, whatever ``pipe.eval()`` says. Run in eval mode (dropout
    off) with the RNG state restored afterwards. (Parameters are not copied: a
    forward changing its weights in place is not something to check for at the
    cost of a second copy of the model.) On the meta device: :func:`_written_on_meta`.
    """
    if any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers()):
        return _written_on_meta(gm, model, inputs)
    own = {id(t): (name, t) for name, t in model.named_buffers(remove_duplicate=False)}
    tensors = [(name, t) for name, t in own.values()] + \
        [(f"input {i}", t) for i, t in enumerate(inputs)]
    before = [t.detach().clone() for _, t in tensors]
    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            gm(*inputs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    changed = []
    for (name, t), old in zip(tensors, before):
        if not torch.equal(t, old):
            changed.append(name)
            t.copy_(old)
    return changed


def keep_module_calls(gm: fx.GraphModule, model: nn.Module, keep: Sequence[str],
                      signatures: Sequence[Any] = (), lifted: Optional[Mapping[str, str]] = None) -> None:
    """Puts the calls of the modules named in ``keep`` back into an exported graph.

    Export records the operations a module runs, never its call. Every call of a kept
    module (the nodes whose ``nn_module_stack`` holds that call's entry) becomes one
    ``call_module`` of the model's own module at its path, so hooks registered on it
    later (a parallel style's) run as in the model. The call's arguments and results
    are the ones export recorded for it (``preserve_module_call_signature``: which
    graph value is which argument, in the forward's own order, keywords included);
    without a signature only a call with one tensor in and one value out can be put
    back (its input is then the module's argument).

    Args:
        gm: the exported graph (modified in place).
        model: the model it was exported from.
        keep: qualified module names.
        signatures: the exported program's ``module_call_graph`` entries.
        lifted: the exported program's input names of the model's tensors (``b_freqs``),
            by their names in the model (read by ``get_attr`` in ``gm``).

    Raises:
        ExportRefused: a kept call whose arguments or results the graph cannot give
            (naming the module and them).
    """
    graph = gm.graph
    replaced: Dict[str, fx.Node] = {}  # results of calls put back, by the exported names
    for path in sorted(keep, key=lambda p: p.count(".")):  # an enclosing module first
        calls: Dict[str, List[fx.Node]] = {}
        for node in graph.nodes:
            for key, (where, _) in (node.meta.get("nn_module_stack") or {}).items():
                if where == path:
                    calls.setdefault(key, []).append(node)
        if calls:
            install_attribute(model, gm, path)
        own = [e.signature for e in signatures
               if e.signature is not None and e.fqn.split("@")[0] == path]
        for key, region in calls.items():
            _outline(gm, path, key, _without_sizes(region), own, lifted or {}, replaced)
        for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users and
                     str(n.target).startswith(path + ".")]:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _without_sizes(region: List[fx.Node]) -> List[fx.Node]:
    """``region`` less its size arithmetic on sizes from outside it (``2 * s0``, which
    export computes once, where first needed, and shares with later users)."""
    inside, sizes = set(region), set()
    for node in region:
        if not isinstance(node.meta.get("val"), torch.Tensor) and node.op == "call_function" and \
                all(a not in inside or a in sizes for a in node.all_input_nodes) and \
                not isinstance(node.meta.get("val"), (tuple, list)):
            sizes.add(node)
    return [n for n in region if n not in sizes]


def _refuse_call(gm: fx.GraphModule, path: str, why: str) -> ExportRefused:
    module = gm.get_submodule(path)
    return ExportRefused(
        f"expert_parallel / tensor_parallel keeps {path!r} ({type(module).__name__}) as a module "
        f"call, but the torch.export path cannot put this call back: {why} (torch.export "
        "records a module's operations, not its call); match modules called with tensors and "
        "returning tensors, or make the forward traceable by torch.fx, which keeps any module "
        "as a call")


def _call_values(gm: fx.GraphModule, path: str, region: List[fx.Node], signatures: Sequence[Any],
                 lifted: Mapping[str, str], replaced: Mapping[str, fx.Node]
                 ) -> Tuple[Tuple[Any, ...], Dict[str, Any], List[Optional[fx.Node]], Any]:
    """The recorded call of ``region``: its arguments (graph nodes and constants), its
    result nodes (``None`` for a constant result, such as attention weights not
    returned) and the result's structure (``None``: one value)."""
    inside, by_name = set(region), {n.name: n for n in gm.graph.nodes}
    reads = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    by_name.update({name: reads[target] for name, target in lifted.items() if target in reads})
    by_name.update(replaced)
    names = {n.name for n in region}
    def tensors(s: Any) -> List[str]:  # its results that are graph values (not a constant None)
        return [a.name for a in s.outputs if not hasattr(a, "value") and hasattr(a, "name")]

    signature = next((s for s in signatures if tensors(s) and all(n in names for n in tensors(s))), None)
    if signature is None:
        def internal(a: fx.Node) -> bool:  # the call's own nodes and its module's tensors
            return a in inside or (a.op == "get_attr" and str(a.target).startswith(path + "."))

        inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if not internal(a)))
        outputs = [n for n in region if any(u not in inside for u in n.users)]
        if len(inputs) != 1 or not isinstance(inputs[0].meta.get("val"), torch.Tensor) or \
                len(outputs) != 1:
            raise _refuse_call(gm, path, f"no call signature was recorded and it takes "
                               f"{[a.name for a in inputs]} and returns {[n.name for n in outputs]}")
        return (inputs[0],), {}, outputs, None
    leaves = []
    for a in signature.inputs:
        if hasattr(a, "value"):  # ConstantArgument
            leaves.append(a.value)
        elif getattr(a, "name", None) in by_name:
            leaves.append(by_name[a.name])
        else:
            raise _refuse_call(gm, path, f"its argument {a!r} is not a value of the graph")
    for leaf in leaves:  # a tensor of the model read inside the call, given to it
        if isinstance(leaf, fx.Node) and leaf in inside and leaf.op == "get_attr":
            region.remove(leaf)
            inside.discard(leaf)
    args, kwargs = pytree.tree_unflatten(leaves, signature.in_spec)
    outputs = [None if hasattr(a, "value") else by_name.get(a.name) for a in signature.outputs]
    escaping = [n.name for n in region if n not in outputs and any(u not in inside for u in n.users)]
    if escaping:
        raise _refuse_call(gm, path, f"the graph uses {escaping} computed inside the call")
    spec = signature.out_spec
    if not spec.is_leaf() and not (spec.type in (tuple, list) and
                                   all(c.is_leaf() for c in spec.children_specs)):
        raise _refuse_call(gm, path, f"it returns a {spec.type.__name__}, not a tensor or a tuple")
    return tuple(args), dict(kwargs), outputs, None if spec.is_leaf() else spec


def _outline(gm: fx.GraphModule, path: str, key: str, region: List[fx.Node],
             signatures: Sequence[Any], lifted: Mapping[str, str], replaced: Dict[str, fx.Node]) -> None:
    """Replaces the nodes of one call of the module at ``path`` by a call of it (its
    results recorded in ``replaced`` under the names of the nodes they replace)."""
    graph, inside = gm.graph, set(region)
    args, kwargs, outputs, structure = _call_values(gm, path, region, signatures, lifted, replaced)
    nodes = [n for n in outputs if n is not None]
    last = max(nodes, key=lambda n: region.index(n))
    stack: Dict[str, Any] = {}
    for k, entry in (last.meta.get("nn_module_stack") or {}).items():
        stack[k] = entry
        if k == key:
            break
    with graph.inserting_after(last):
        call = graph.call_module(path, args, kwargs)
    values = [None if n is None else n.meta.get("val") for n in outputs]
    call.meta = {"nn_module_stack": stack, "val": values[0] if structure is None else tuple(values)}
    pairs = [(outputs[0], call)]
    if structure is not None:
        pairs, previous = [], call
        for i, out in enumerate(outputs):
            if out is None:  # a constant result: nothing of the graph uses it
                continue
            with graph.inserting_after(previous):
                previous = graph.call_function(operator.getitem, (call, i))
            previous.meta = {"nn_module_stack": stack, "val": values[i]}
            pairs.append((out, previous))
    made = {call, *(result for _, result in pairs)}
    for out, result in pairs:
        out.replace_all_uses_with(result, delete_user_cb=lambda u: u not in inside and u not in made)
        replaced[out.name] = result
    for node in reversed(region):
        graph.erase_node(node)


class DropoutRate(nn.Module):
    """``p`` in training mode, ``0.0`` in eval mode: the ``dropout_p`` of an exported
    attention call (``dropout_p=self.p if self.training else 0.0`` in the model's code,
    fixed to ``p`` while exporting in training mode)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self) -> float:
        return self.p if self.training else 0.0


def _dropout_as_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Makes the graph's dropout follow ``train()`` / ``eval()``, as module calls do.

    ``aten.dropout(x, p, train)`` -> a call of an ``nn.Dropout(p)`` module: the model's
    own where the operation runs in one (``transformer.h.0.attn.resid_dropout``), else
    a new one on the root (``_dropout0``, functional dropout), starting in the mode the
    graph had. The ``dropout_p`` of ``scaled_dot_product_attention`` comes from a
    :class:`DropoutRate` module (``_dropout_rate0``).
    """

    modules = dict(model.named_modules())
    graph = gm.graph
    count = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and
                 n.target is torch.ops.aten.dropout.default]:
        x, p, train = (list(node.args) + [node.kwargs.get("p"), node.kwargs.get("train")])[:3]
        stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        owner = modules.get(stack[-1]) if stack else None
        if isinstance(owner, nn.Dropout) and type(owner) is nn.Dropout and owner.p == p and \
                owner.training == bool(train):
            path = stack[-1]
            install_attribute(model, gm, path)
        else:
            path = f"_dropout{count}"
            count += 1
            gm.add_module(path, nn.Dropout(float(p)).train(bool(train)))
        with graph.inserting_before(node):
            call = graph.call_module(path, (x,))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for k, node in enumerate(n for n in list(graph.nodes)
                             if n.op == "call_function" and n.target is sdpa):
        positional = len(node.args) > 4
        p = node.args[4] if positional else node.kwargs.get("dropout_p", 0.0)
        if not isinstance(p, float) or p == 0.0:
            continue
        path = f"_dropout_rate{k}"
        gm.add_module(path, DropoutRate(p))
        with graph.inserting_before(node):
            rate = graph.call_module(path, ())
        rate.meta = {"nn_module_stack": dict(node.meta.get("nn_module_stack") or {})}
        if positional:
            node.args = node.args[:4] + (rate,) + node.args[5:]
        else:
            node.kwargs = dict(node.kwargs, dropout_p=rate)
    graph.lint()
    gm.recompile()


def _get_attr(root: nn.Module, path: str) -> Any:
    value: Any = root
    for item in path.split("."):
        value = getattr(value, item)
    return value


def localize_sizes(gm: fx.GraphModule, starts: Sequence[int]) -> List[int]:
    """Recomputes, in every stage that uses it, a symbolic size computed in an earlier one.

    ``torch.export`` computes ``sym_size(input, 1)`` (the sequence length) once and
    every layer's reshapes use it; an integer cannot cross a cut, so each stage
    using one gets its own ``sym_size`` of a tensor it has (one crossing into it or
    computed in it) whose dimension has the same symbolic value. Arithmetic on sizes
    is copied the same way. A size no such tensor carries is read from the tensor it
    came from, which then travels to that stage like any other live value.

    Args:
        gm: the exported graph (modified in place).
        starts: from ``_trace.stage_starts``.

    Returns:
        The stage starts in the modified graph (the same first nodes, or a size
        computed just before a stage's first node).
    """

    graph = gm.graph
    nodes = compute_nodes(graph)
    first_nodes = [nodes[s] for s in starts]
    stage_of = node_stages(gm, starts)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_use = {n: max((stage_of[u] for u in n.users), default=-1) for n in graph.nodes
                if n.op not in ("output", "get_attr")}
    added: Dict[int, List[fx.Node]] = {}
    # Keyed by the node it is made before too, so a copy always precedes its users.
    made: Dict[Tuple[fx.Node, int, fx.Node], fx.Node] = {}

    def is_size(n: fx.Node) -> bool:
        return isinstance(n.meta.get("val"), torch.SymInt)

    def sources(j: int, before: fx.Node) -> List[fx.Node]:
        """Tensors stage ``j`` has at ``before``: its own (latest first), then those crossing into it."""
        mine = [n for n in graph.nodes if stage_of.get(n) == j and n.op != "output" and
                order[n] < order[before]]
        crossing = [n for n in graph.nodes if n in last_use and stage_of[n] < j <= last_use[n]]
        return [n for n in mine[::-1] + crossing
                if isinstance(n.meta.get("val"), torch.Tensor)]

    def remake(value: fx.Node, j: int, before: fx.Node) -> fx.Node:
        if (value, j, before) in made:
            return made[(value, j, before)]
        expr = value.meta["val"].node.expr
        found = next(((t, d) for t in sources(j, before)
                      for d, size in enumerate(t.meta["val"].shape)
                      if isinstance(size, torch.SymInt) and size.node.expr == expr), None)
        with graph.inserting_before(before):
            if found is not None:
                new = graph.call_function(torch.ops.aten.sym_size.int, found)
            elif value.op == "call_function" and all(is_size(a) for a in value.all_input_nodes):
                new = graph.node_copy(value, lambda a: remake(a, j, before))
            else:  # read it from where it came from: that tensor travels
                new = graph.node_copy(value)
        new.meta = {"val": value.meta["val"]}
        stage_of[new] = j
        order[new] = order[before] - 0.5  # between the nodes around it, for later lookups
        added.setdefault(j, []).append(new)
        made[(value, j, before)] = new
        return new

    for value in [n for n in nodes if is_size(n)]:
        later = sorted((u for u in value.users if stage_of[u] > stage_of[value]), key=order.get)
        for user in later:
            j = stage_of[user]
            first_use = min((u for u in later if stage_of[u] == j), key=order.get)
            user.replace_input_with(value, remake(value, j, first_use))
    for node in reversed(nodes):  # sizes now only computed again where they are used
        if is_size(node) and not node.users and node not in first_nodes:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    position = {n: i for i, n in enumerate(compute_nodes(graph))}
    return [min([position[first_nodes[k]]] + [position[n] for n in added.get(k + 1, [])])
            for k in range(len(starts))]


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Points the device constants of an exported stage at ``device``.

    The export records ``torch.arange(n, device=x.device)`` with the sample's device
    written in; a stage moved to another device (``cuda:LOCAL_RANK``), or traced on the
    meta device, creates those tensors there instead. The bodies of higher-order
    operations (an ``autocast(enabled=False)`` region: ``wrap_with_autocast``) are
    graph modules of their own, with their own constants and device assertions.
    """
    for graph_module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        changed = False

        def swap(value: Any) -> Any:
            nonlocal changed
            if isinstance(value, torch.device) and value != device:
                changed = True
                return device
            return value

        for node in graph_module.graph.nodes:
            if node.op == "call_function":
                node.args = fx.node.map_aggregate(node.args, swap)
                node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if node.target is _AUTOCAST and node.args and node.args[0] == "meta":
                node.args = (device.type, *node.args[1:])  # traced on meta: the stage's device type
                changed = True
        if changed:
            graph_module.recompile()
