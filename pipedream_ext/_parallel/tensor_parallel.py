"""Tensor parallelism inside pipeline stages: ``PipeDream(tensor_parallel=...)``.

Owns what a ``("pp", "dp", "tp")`` mesh's ``tp`` dimension does to this rank's
stages. A plan is torch's: ``{pattern: ParallelStyle}`` with fnmatch patterns over
the original model's module names (``*`` one name component, as
``torch.distributed.tensor.parallel.parallelize_module`` reads them), or a callable
``fn(stage_module, tp_mesh)``. An ``nn.Sequential``'s stage keeps the original
child names (``"3.attn.wq"``), and so does a traced stage, where every module a
pattern matches stays a module call holding the model's object (:func:`kept_calls`,
given to the tracer), so ``parallelize_module(stage, tp_mesh, plan)`` gives
each stage's modules exactly what ``parallelize_module(model, tp_mesh, plan)`` gives
them in the unsplit model; a pattern matching no module of any stage is refused.

Before the plan is applied every stage's parameters and buffers are broadcast from
tp rank 0 (as DDP broadcasts rank 0's), so the tp ranks start from one model; the
styles then shard (or replicate) from those values, each rank cutting its own shards
(``src_data_rank=None``: nothing is sent). Then one exchange over the mesh agrees on
the outcome (``tp_agree``): a plan that raised on some rank, a stage split differently
on two ranks or a dimension split unevenly fails every rank at construction. With
``SequenceParallel`` styles every step's inputs must have a sequence length tp divides
(:func:`check_sequence_length`).

What a stage returns crosses the cut as it is, never gathered (``CutLayouts``): a
plain tensor (replicated over tp after ``RowwiseParallel()``, a local sequence shard
``[b, s/tp, d]`` with sequence parallelism), or a ``DTensor`` as its local shard, which
the next stage wraps back as a ``DTensor`` with the same placement over its own tp mesh.
The placements travel as metadata, not on the wire: each stage's :class:`CutLayout` is
published once, at its first forward, and read once by the next stage
(:class:`LayoutExchange`); every later forward is checked against it on the host. A
placement the next stage's first module declares otherwise fails the step on every
rank; a ``DTensor`` that cannot cross is refused by name.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import fnmatch
import os
import re
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import schedules
from .._dist import collectives
from .._dist.collectives import is_dtensor
from .._dist.groups import RankNames
from . import tp_agree

__all__ = ["CutLayout", "CutLayouts", "LayoutExchange", "TensorParallel", "check_option", "check_plan",
           "check_sequence_length", "check_split_points", "describe_plan", "enclosing_calls", "kept_calls", "local",
           "matched_patterns", "pattern_matches", "qualified_name", "sequence_parallel", "uneven_split"]

def qualified_name(value: Any) -> str:
    """A function's (or class's) qualified name, else its type's."""
    named = value if hasattr(value, "__qualname__") else type(value)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _setting(value: Any) -> str:
    """``repr(value)`` without memory addresses (a function's differs between processes)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def describe_plan(plan: Any) -> Any:
    """The JSON value ranks compare at construction: each pattern's style class and its
    settings (``repr`` of its attributes but ``src_data_rank``, which the pipeline always
    sets to ``None``: each rank cuts its own shards), or a callable's qualified name.

    Args:
        plan: the ``tensor_parallel`` value (checked), or ``None``.

    Returns:
        ``None``, ``{pattern: {"style": ..., "settings": {...}}}`` or ``{"callable": name}``.
    """
    if plan is None:
        return None
    if isinstance(plan, Mapping):
        return {str(k): {"style": qualified_name(v),
                         "settings": {a: _setting(x) for a, x in sorted(vars(v).items())
                                      if a != "src_data_rank"}}
                for k, v in sorted(plan.items())}
    return {"callable": qualified_name(plan)}


def check_option(plan: Any, options: Any) -> None:
    """``PipelineOptions.tensor_parallel``'s check (no process group needed).

    Raises:
        ValueError: a plan that is neither a dict of ``ParallelStyle`` nor a callable, or
            what it does not support yet (an asynchronous schedule: its weight stashing of
            DTensor shards), naming the value and the fix.
    """
    check_plan(plan, options, "tensor_parallel", "'*.attn.wq'", "ColwiseParallel(), RowwiseParallel(), ...",
               "tp_mesh")


def check_plan(plan: Any, options: Any, option: str, pattern: str, styles: str, mesh: str,
               unsupported: Sequence[Tuple[bool, str, str]] = ()) -> None:
    """A plan option's check: a dict of ``ParallelStyle`` by module-name pattern or a
    callable, with a flush schedule (an asynchronous one would stash DTensor shards).

    Args:
        plan: the option's value (``None``: nothing to check).
        options: the other options (``schedule``).
        option: its name, and for the message an example ``pattern``, example ``styles``
            and the callable's ``mesh`` argument.
        unsupported: more ``(bad, what, fix)`` this option does not support yet.

    Raises:
        ValueError: naming the bad entry, value or combination and the fix.
    """
    if plan is None:
        return
    from torch.distributed.tensor.parallel import ParallelStyle  # noqa: PLC0415 - only with a plan

    if isinstance(plan, Mapping):
        for key, style in plan.items():
            if not isinstance(key, str) or not isinstance(style, ParallelStyle):
                raise ValueError(
                    f"{option}[{key!r}] = {style!r}: a plan maps module-name patterns (str, e.g. "
                    f"{pattern}) to torch ParallelStyles ({styles})")
    elif not callable(plan):
        raise ValueError(f"{option}={plan!r}; give a dict {{pattern: ParallelStyle}} or a callable "
                         f"fn(stage_module, {mesh})")
    refused = [(schedules.traits(options.schedule).asynchronous, f"schedule={options.schedule!r}",
                f"use schedule= one of {', '.join(schedules.synchronous_names())}"), *unsupported]
    for bad, what, fix in refused:
        if bad:
            raise ValueError(f"{option} with {what} is not supported yet; {fix}")


def kept_calls(plan: Any, module: nn.Module) -> List[str]:
    """The modules of ``module`` a dict plan's patterns match, by qualified name: a
    traced model keeps their calls as calls (``graph_split.split_model(keep_calls=)``),
    so their styles' hooks run in the stages; ``[]`` for no plan or a callable."""
    if not isinstance(plan, Mapping):
        return []
    return [n for n, _ in module.named_modules() if n and any(pattern_matches(k, n) for k in plan)]


def enclosing_calls(kept: Sequence[str], module: nn.Module, split_points: Sequence[Any]) -> List[str]:
    """The modules directly enclosing the ``kept`` ones (:func:`kept_calls`; an attention
    around its ``wq``), for the tracer to keep as calls too where torch.fx needs it
    (``graph_split.split_model(enclosing_calls=)``): not the model itself, a container
    (``ModuleList``, ``ModuleDict``), a kept module or one a split point lies inside."""
    named = set(kept)
    modules = dict(module.named_modules())
    out: Dict[str, None] = {}
    for name in named:
        parent = name.rpartition(".")[0]
        if parent and parent not in named and \
                not isinstance(modules[parent], (nn.ModuleList, nn.ModuleDict)) and \
                not any(isinstance(p, str) and p.startswith(parent + ".") for p in split_points):
            out[parent] = None
    return sorted(out)


def check_split_points(plan: Any, module: nn.Module, split_points: Sequence[Any]) -> None:
    """A split point inside a module the plan keeps as one call would cut that call.

    Raises:
        ValueError: naming the split point, the module and its pattern.
    """
    if not isinstance(plan, Mapping):
        return
    for name in kept_calls(plan, module):
        inside = [p for p in split_points if isinstance(p, str) and p.startswith(name + ".")]
        if inside:
            pattern = next(k for k in plan if pattern_matches(k, name))
            raise ValueError(
                f"split point {inside[0]!r} is inside {name!r}, which tensor_parallel pattern "
                f"{pattern!r} keeps as one module call (its style's hooks run on that call, so "
                f"its operations stay in one stage); split at {name!r} or at a module outside it")


def sequence_parallel(plan: Any) -> bool:
    """Whether ``balance="auto"`` plans ``plan`` with sequence parallelism (activations
    divided by tp): a dict plan with torch's ``SequenceParallel`` style (torchtitan's SP
    plans put it on the norms); a callable's styles cannot be seen, so it is planned
    without SP (activations whole: a plan that fits then fits with SP too)."""
    from torch.distributed.tensor.parallel import SequenceParallel  # noqa: PLC0415 - only with tp

    return isinstance(plan, Mapping) and any(isinstance(v, SequenceParallel) for v in plan.values())


def check_sequence_length(plan: Any, tp_size: int, inputs: Any) -> None:
    """A dict plan's ``SequenceParallel`` styles shard the sequence dimension of the
    activations (``sequence_dim``, 1 by default: ``[batch, seq, ...]``) evenly over the tp
    ranks; the inputs' first tensor has that dimension (token ids ``[batch, seq]``). An
    uneven sequence would give the tp ranks shards of different sizes, whose all-gather
    Gloo aborts the process on (SIGABRT). A callable's styles cannot be seen: unchecked.

    Args:
        plan: the ``tensor_parallel`` value.
        tp_size: the mesh's tp size.
        inputs: the batch's inputs on stage 0's ranks (a tensor, tuple or dict).

    Raises:
        ValueError: the sequence length is not divisible by ``tp_size``, naming it and the fix.
    """
    from torch.distributed.tensor.parallel import SequenceParallel  # noqa: PLC0415 - only with tp
    from torch.utils import _pytree  # noqa: PLC0415 - only with tp

    if not isinstance(plan, Mapping) or tp_size == 1:
        return
    dims = sorted({s.sequence_sharding[0].dim for s in plan.values() if isinstance(s, SequenceParallel)
                   and s.sequence_sharding[0].dim >= 0})
    first = next((t for t in _pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
    for dim in dims:
        if first is not None and first.dim() > dim and first.shape[dim] % tp_size:
            length = first.shape[dim]
            raise ValueError(
                f"inputs have sequence length {length} (dim {dim} of shape {list(first.shape)}), "
                f"which does not split evenly over tp={tp_size}: tensor_parallel's SequenceParallel "
                f"styles shard the sequence over the tp ranks in equal parts; use a sequence "
                f"length divisible by {tp_size} (pad it to {-(-length // tp_size) * tp_size})")


def uneven_split(plan: Any, module: nn.Module, tp_size: int) -> Optional[str]:
    """What a dict plan would split unevenly over ``tp_size`` ranks (``mesh="auto"`` keeps
    such a tp out of its candidates): the first ``nn.Linear`` or ``nn.Embedding`` a
    ``ColwiseParallel`` or ``RowwiseParallel`` pattern matches whose split dimension tp
    does not divide (column-wise: a Linear's outputs, an Embedding's width; row-wise: a
    Linear's inputs, an Embedding's rows), as ``"name: size over tp"``; ``None`` when
    every split is even, or for a callable (whose splits cannot be seen: the runtime
    refuses an uneven one at construction, ``tp_agree``).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415 - only with tp

    if not isinstance(plan, Mapping) or tp_size == 1:
        return None
    for name, sub in module.named_modules():
        for pattern, style in plan.items():
            if not name or not pattern_matches(pattern, name):
                continue
            column = isinstance(style, ColwiseParallel)
            if not column and not isinstance(style, RowwiseParallel):
                continue
            if isinstance(sub, nn.Linear):
                size = sub.out_features if column else sub.in_features
            elif isinstance(sub, nn.Embedding):
                size = sub.embedding_dim if column else sub.num_embeddings
            else:
                continue
            if size % tp_size:
                return f"{name} ({type(style).__name__}): {size} over tp={tp_size}"
    return None


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether a plan's ``pattern`` names the module ``name`` (as ``parallelize_module``
    matches them: one fnmatch per name component)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms))


def matched_patterns(plan: Mapping[str, Any], module: nn.Module) -> List[str]:
    """The plan's patterns that name a module of ``module`` (as ``parallelize_module``
    matches them: one fnmatch per name component)."""
    names = [n for n, _ in module.named_modules() if n]
    return [k for k in plan if any(pattern_matches(k, n) for n in names)]


#: ``Partial`` reductions that can cross a cut.
_PARTIAL_OPS = ("sum", "avg", "max", "min")


def _placement_name(placement: Any) -> str:
    return "a plain tensor" if placement is None else repr(placement)


@dataclasses.dataclass(frozen=True)
class CutLayout:
    """What one stage's outputs are at its cut, in order: ``None`` for a plain tensor,
    else the ``DTensor``'s placement over the tp mesh (``Replicate()``, ``Shard(d)``,
    ``Partial(op)``).

    Attributes:
        placements: one entry per output.
    """

    placements: Tuple[Any, ...]

    def encode(self) -> str:
        """The layout as text, one word per output (``"plain,shard:1,partial:sum"``).

        Raises:
            ValueError: a placement that cannot cross a cut.
        """
        words = [_code(p) for p in self.placements]
        bad = [p for p, word in zip(self.placements, words) if word is None]
        if bad:
            raise ValueError(f"placement {bad[0]!r} cannot cross a cut")
        return ",".join(word for word in words if word is not None)

    @classmethod
    def decode(cls, text: str) -> "CutLayout":
        """The layout :meth:`encode` wrote.

        Raises:
            ValueError: a word that names no placement.
        """
        return cls(tuple(_placement_of(word) for word in text.split(",") if word))


class LayoutExchange:
    """Where each stage's :class:`CutLayout` goes, once per pipeline: the sending stage
    publishes it at its first forward, the receiving stage reads (and removes) it at
    its own, from a key/value store (the default group's, as torch's own rendezvous
    metadata travels). The store is out of band: nothing joins the pipeline's
    transfers, whose order NCCL's rules fix. The sender publishes before its first
    output leaves, so the reader, which runs only once that output arrived, finds it.

    Args:
        store: a ``torch.distributed.Store``.
        prefix: this pipeline's keys, unique to the pipeline object and its ``(dp, tp)``
            copy (a layout left by a pipeline that failed is never read by the next).
        timeout: seconds a read waits for its layout.
    """

    def __init__(self, store: Any, prefix: str, timeout: float) -> None:
        self.store, self.prefix, self.timeout = store, prefix, timeout

    @classmethod
    def agree(cls, world: dist.ProcessGroup, pipeline: int, timeout: float) -> "LayoutExchange":
        """The exchange of this rank's pipeline, its keys named by a token rank 0 of
        ``world`` draws (two small broadcasts, collective over ``world``).

        Args:
            world: a group over every rank of the mesh.
            pipeline: this rank's pipeline (its ``(dp, tp)`` copy).
            timeout: seconds a read waits for its layout.
        """
        mine = os.urandom(8) if dist.get_rank(world) == 0 else None
        token = collectives.broadcast_bytes(mine, 0, world).hex()
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor
        return cls(store, f"pipedream_ext/cut_layouts/{token}/{pipeline}", timeout)

    def _key(self, stage: int) -> str:
        return f"{self.prefix}/{stage}"

    def publish(self, stage: int, layout: CutLayout) -> None:
        """Stage ``stage``'s output layout, for the next stage to read."""
        self.store.set(self._key(stage), layout.encode())

    def take(self, stage: int) -> CutLayout:
        """Stage ``stage``'s output layout, removed from the store.

        Raises:
            RuntimeError: it did not arrive within the timeout.
        """
        key = self._key(stage)
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
        except dist.DistStoreError as exc:
            raise RuntimeError(
                f"the output layout of stage {stage} did not arrive within timeout="
                f"{self.timeout:g} s (key {key!r}): its ranks failed or run another pipeline") from exc
        text = self.store.get(key).decode()
        self.store.delete_key(key)
        return CutLayout.decode(text)


class CutLayouts:
    """What a stage's outputs are at a cut: a ``DTensor`` crosses as its local shard and
    arrives as a ``DTensor`` with the same placement over the receiving rank's tp mesh.

    With ``tensor_parallel`` every stage but the last publishes its :class:`CutLayout`
    at its first forward (:class:`LayoutExchange`); every stage but the first reads the
    previous stage's once and wraps each local shard back with
    ``DTensor.from_local(..., run_check=False)`` (autograd passes the gradient back
    through ``from_local`` and ``to_local``). Only tensors cross the wire. The sender
    checks every later forward's placements against its first (host metadata, free),
    the receiver every later forward's tensor count; the receiver also checks the
    layout against what the plan declares for the stage's first module.

    Args:
        tp_mesh: this rank's 1-D tp mesh.
        plan: the ``tensor_parallel`` value (a dict's styles declare input layouts).
        stages: this rank's stages by index.
        exchange: where the layouts go.
    """

    def __init__(self, tp_mesh: Any, plan: Any, stages: Mapping[int, nn.Module],
                 exchange: LayoutExchange) -> None:
        self.tp_mesh, self.exchange = tp_mesh, exchange
        self.tp_size = tp_mesh.size()
        self._tp_ranks = sorted(tp_mesh.mesh.flatten().tolist())
        self._sent: Dict[int, List[Any]] = {}
        self._received: Dict[int, List[Any]] = {}
        self._mismatch: Dict[int, Optional[str]] = {}
        self._declared = {j: _declared_input_layout(plan, m) for j, m in stages.items()}

    # -- the sending side ------------------------------------------------------------------
    def send(self, stage: int, values: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Stage ``stage``'s outputs as they cross the cut: local shards (its layout
        published at its first forward).

        Raises:
            ValueError: a ``DTensor`` over another mesh than the tp mesh, with a placement
                other than ``Replicate``/``Shard``/``Partial`` (sum, avg, max, min), sharded
                unevenly, or whose placements differ from the stage's first forward.
        """
        placements = [self._placement(stage, k, v) for k, v in enumerate(values)]
        if stage not in self._sent:
            self.exchange.publish(stage, CutLayout(tuple(placements)))
            self._sent[stage] = placements
        for k, (was, now) in enumerate(zip(self._sent[stage], placements)):
            if was != now:
                raise ValueError(
                    f"stage {stage} returned output {k} as {_placement_name(now)}, but as "
                    f"{_placement_name(was)} in its first forward; what a stage returns at a cut "
                    "must keep its placements from one microbatch (and step) to the next (its "
                    "receiver wraps it as it first arrived)")
        return [v.to_local() if p is not None else v for v, p in zip(values, placements)]

    def _placement(self, stage: int, k: int, value: torch.Tensor) -> Any:
        """``value``'s placement over the tp mesh, ``None`` for a plain tensor."""
        if not is_dtensor(value):
            return None
        where = f"stage {stage} returns a DTensor (output {k}, placements {tuple(value.placements)}"
        mesh = value.device_mesh
        if mesh.ndim != 1 or sorted(mesh.mesh.flatten().tolist()) != self._tp_ranks:
            raise ValueError(f"{where}, mesh {mesh}) over another mesh than mesh['tp'] (ranks "
                             f"{self._tp_ranks}); a DTensor at a cut must be over the tp mesh: "
                             "end the stage with .to_local() or redistribute it there")
        placement = value.placements[0]
        if _code(placement) is None:
            raise ValueError(f"{where}): a DTensor crosses a cut as Replicate(), Shard(d) or "
                             f"Partial({'|'.join(_PARTIAL_OPS)}); redistribute it to one of them")
        if type(placement).__name__ == "Shard" and value.shape[placement.dim] % self.tp_size:
            raise ValueError(
                f"{where}, shape {tuple(value.shape)}): dim {placement.dim} ({value.shape[placement.dim]}) "
                f"does not split evenly over tp={self.tp_size}; the receiving stage rebuilds the "
                "DTensor from its local shard as torch's sequence parallelism does (even shards): "
                f"use a size divisible by {self.tp_size}")
        return placement

    # -- the receiving side ----------------------------------------------------------------
    def receive(self, stage: int, inputs: Sequence[torch.Tensor]
                ) -> Tuple[List[torch.Tensor], Optional[str]]:
        """Stage ``stage``'s inputs as its modules see them, each local shard of a
        ``DTensor`` wrapped back (the previous stage's layout read at the first call);
        and a problem found, or ``None``.

        The problem (the stage's first module declares another input placement than the
        one that arrived: its style would misread the shard) does not stop the forward,
        which goes on with zeros in the declared layout, so the step ends on every rank
        and every rank raises it (``StepContext.deferred_error``).
        """
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - only with tp

        values = list(inputs)
        if stage not in self._received:
            self._received[stage] = list(self.exchange.take(stage - 1).placements)
            self._mismatch[stage] = self._declared_mismatch(stage, values[0].dim() if values else 0)
        placements, problem = self._received[stage], self._mismatch[stage]
        if len(placements) != len(values):
            raise ValueError(f"stage {stage} received {len(values)} tensors and a layout of "
                             f"{len(placements)}; every rank must run the same model and plan")
        wrapped = [v if p is None else DTensor.from_local(v, self.tp_mesh, (p,), run_check=False)
                   for v, p in zip(values, placements)]
        if problem is not None:
            wrapped[0] = self._stand_in(wrapped[0], self._declared[stage][2])
        return wrapped, problem

    def _stand_in(self, arrived: Any, declared: Any) -> Any:
        """Zeros in the layout the stage's first module declares, for the forward of a
        step that every rank then fails: its style decides from ``declared`` whether to
        redistribute (``PrepareModuleInput`` declaring ``Replicate()`` hands a ``Shard(1)``
        shard on as the whole), so the forward could fail on the shapes before the
        message reaches every rank."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - only with tp

        shape = list(arrived.shape)
        if type(declared).__name__ == "Shard":
            shape[declared.dim % len(shape)] //= self.tp_size
        zeros = torch.zeros(shape, dtype=arrived.dtype, device=arrived.device)
        return DTensor.from_local(zeros, self.tp_mesh, (declared,), run_check=False)

    def _declared_mismatch(self, stage: int, ndim: int) -> Optional[str]:
        declared, arrived = self._declared.get(stage), self._received[stage]
        if declared is None or len(arrived) != 1 or arrived[0] is None:
            return None
        name, style, expected = declared
        if _same_placement(expected, arrived[0], ndim):
            return None
        return (f"stage {stage} receives output 0 of stage {stage - 1} as a DTensor with "
                f"{arrived[0]!r}, but its first module {name!r} has {style} with input_layouts "
                f"{expected!r}: make the plan agree on the cut, either input_layouts={arrived[0]!r} "
                f"for {name!r} or end stage {stage - 1} with {expected!r} (its last style's "
                "output_layouts)")

    def refuse_at_end(self, stage: int, output: Any) -> None:
        """The last stage's output goes to ``loss_fn`` (or back to the caller) as is; a
        ``DTensor`` there (loss parallelism) is not supported yet.

        Raises:
            ValueError: a ``DTensor`` in the last stage's output, naming it and the fix.
        """
        flat = output if isinstance(output, (tuple, list)) else (output,)
        for k, value in enumerate(flat):
            if is_dtensor(value):
                raise ValueError(
                    f"the last stage (stage {stage}) returns a DTensor (output {k}, placements "
                    f"{tuple(value.placements)}): loss_fn and the caller get plain tensors "
                    "(loss parallelism is not supported yet); end the model with a style whose "
                    "output is a local tensor (use_local_output=True, e.g. ColwiseParallel("
                    "output_layouts=Replicate()))")


def _code(placement: Any) -> Optional[str]:
    """A placement's word in a :class:`CutLayout` (``None``: a plain tensor), or ``None``
    for one that cannot cross a cut."""
    if placement is None:
        return "plain"
    kind = type(placement).__name__
    if kind == "Replicate":
        return "replicate"
    if kind == "Shard":
        return f"shard:{placement.dim}"
    if kind == "Partial" and placement.reduce_op in _PARTIAL_OPS:
        return f"partial:{placement.reduce_op}"
    return None


def _placement_of(word: str) -> Any:
    """The placement :func:`_code` named ``word``.

    Raises:
        ValueError: a word that names no placement.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: PLC0415 - only with tp

    kind, _, arg = word.partition(":")
    if kind == "plain" and not arg:
        return None
    if kind == "replicate" and not arg:
        return Replicate()
    if kind == "shard" and arg.lstrip("-").isdigit():
        return Shard(int(arg))
    if kind == "partial" and arg in _PARTIAL_OPS:
        return Partial(arg)
    raise ValueError(f"{word!r} names no placement a cut carries")


def _same_placement(declared: Any, arrived: Any, ndim: int) -> bool:
    """Whether a style's declared placement is the one that arrived (``Shard(-1)`` of a
    3-D tensor is ``Shard(2)``)."""
    if type(declared).__name__ == "Shard" and type(arrived).__name__ == "Shard":
        return declared.dim % ndim == arrived.dim % ndim
    return declared == arrived


def _declared_input_layout(plan: Any, stage: nn.Module) -> Optional[Tuple[str, str, Any]]:
    """What the plan's style on the stage's first module declares its first input to be:
    ``(module name, style, placement)``, or ``None`` (a callable plan, no such style)."""
    if not isinstance(plan, Mapping) or not isinstance(stage, nn.Sequential) or not len(stage):
        return None
    name = next(iter(stage._modules))  # noqa: SLF001 - an nn.Sequential's child names
    for pattern, style in plan.items():
        layouts = getattr(style, "input_layouts", None)
        if pattern_matches(pattern, name) and isinstance(layouts, tuple) and layouts and layouts[0] is not None:
            return name, type(style).__name__, layouts[0]
    return None


class TensorParallel:
    """Applies a plan to this rank's stages over the tp mesh.

    Args:
        plan: the ``tensor_parallel`` value.
        tp_mesh: the 1-D mesh over this rank's tp group.
        world: a group over the whole mesh bounded by twice the timeout (every rank
            agrees on the outcome, ``tp_agree``).
        names: how messages name the mesh's ranks.
        timeout: the pipeline's timeout in seconds (a peer held in a callable plan's
            collective by a rank that raised is released after it: the exchange of
            outcomes waits twice as long).
        option: the option the plan came from, for messages (``expert_parallel.py``
            applies its plan over the ep mesh with this class).
    """

    def __init__(self, plan: Any, tp_mesh: Any, world: dist.ProcessGroup, names: RankNames,
                 timeout: float, option: str = "tensor_parallel") -> None:
        self.plan, self.tp_mesh, self.world = plan, tp_mesh, world
        self.names, self.timeout, self.option = names, timeout, option

    def apply(self, stages: Mapping[int, nn.Module]) -> None:
        """Broadcasts each stage from tp rank 0 and parallelizes it; collective over
        the tp group and the whole mesh.

        Raises:
            ValueError: on every rank: a plan pattern that names no module of any stage;
                a stage split differently on its ranks, or a dimension split unevenly
                (``tp_agree``); the plan raised ``ValueError`` on some rank.
            RuntimeError: on every rank: the plan raised anything else on some rank
                (naming the ranks and their exceptions).
        """
        group = self.tp_mesh.get_group()
        with torch.no_grad():
            for module in stages.values():
                for t in list(module.parameters()) + list(module.buffers()):
                    if not t.is_meta:  # meta layers: equal on every rank as materialised (tp_init)
                        # Another plan's shards (tp's, before the ep plan) are equal along this mesh.
                        collectives.broadcast_data(local(t.detach()), 0, group)
        matched: Dict[str, None] = {}
        error: Optional[BaseException] = None
        try:
            for module in stages.values():
                self._parallelize(module, matched)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        payload = {"matched": list(matched)}
        if error is None:
            payload.update(layouts=tp_agree.layouts(stages), uneven=tp_agree.uneven(stages))
        try:
            gathered = collectives.gather_outcomes(
                error, self.world, 2 * self.timeout, f"applying the {self.option} plan",
                payload=payload, names=self.names)
        except (ValueError, RuntimeError) as exc:
            raise type(exc)(
                f"{exc}; a plan must do the same on every rank: a callable plan that raises or "
                "differs on some ranks leaves its tp peers waiting in its collectives (they fail "
                f"after timeout={self.timeout:g} s, naming them)") from exc
        tp_agree.refuse_differences([g["layouts"] for g in gathered], self.names)
        tp_agree.refuse_uneven(list({tuple(map(str, u)): u for g in gathered
                                     for u in g["uneven"]}.values()))
        if isinstance(self.plan, Mapping):
            self._refuse_unmatched({k for g in gathered for k in g["matched"]})

    def _parallelize(self, module: nn.Module, matched: Dict[str, None]) -> None:
        """The plan applied to one stage: a dict's patterns that match its modules, each
        rank cutting its own shards of the broadcast values (no communication), or the
        callable."""
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415 - only with tp

        if not isinstance(self.plan, Mapping):
            self.plan(module, self.tp_mesh)
            return
        keys = matched_patterns(self.plan, module)
        matched.update(dict.fromkeys(keys))
        if keys:
            with warnings.catch_warnings():
                # "*" is tried against every child; what a pattern matches is
                # checked over every stage (_refuse_unmatched) instead.
                warnings.filterwarnings("ignore", message="Parallelize plan key .* could "
                                        "not be resolved")
                # Copies: parallelize_module writes src_data_rank into the styles it
                # applies, which would leave the user's plan differing between ranks.
                parallelize_module(module, self.tp_mesh, {k: copy.copy(self.plan[k]) for k in keys},
                                   src_data_rank=None)

    def _refuse_unmatched(self, found: Any) -> None:
        missing = [k for k in self.plan if k not in found]
        if missing:
            raise ValueError(
                f"{self.option} pattern{'s' if len(missing) > 1 else ''} "
                f"{', '.join(repr(k) for k in missing)} match{'es' if len(missing) == 1 else ''} no "
                "module of any stage; patterns are fnmatch patterns over the original model's "
                "module names (model.named_modules(), '*' one name component), e.g. '*.attn.wq'")


def local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard, or ``t``."""
    return t.to_local() if is_dtensor(t) else t
