"""Parameters shared by layers on different stages (tied weights).

Owns finding them (``find_shared``: one Parameter object reached from the layers
of two or more stages, e.g. a language model's head tied to its embedding) and
keeping their copies equal (``SharedGradients``): every rank that holds a stage
using the parameter keeps its own copy, identical at construction, and before
each optimizer step the copies' gradients are summed into the unsplit model's
gradient, so every copy takes the same update.

The rule (flush schedules), after the executor's replica all-reduce: the ranks
holding a stage that uses the parameter all-reduce its gradient; a stage leader
(replica 0) contributes its gradient, any other replica contributes zeros. After
the replica all-reduce each replica of a stage holds that stage's whole-batch
gradient, so the leaders alone hold each stage's term exactly once; the zeros
let the other replicas receive the sum in the same collective. Two stages on one
rank (interleaved chunks) hold the same tensor, whose ``.grad`` autograd already
accumulates over both, so the rank contributes it once.

Index legend: ``j`` stage, ``l`` layer (child of the ``nn.Sequential``).
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._runtime.local_stages import LocalStages, Partition

__all__ = ["SharedParameter", "find_shared", "find_shared_in_stages", "alias_names", "canonical_names", "describe",
           "SharedGradients"]


@dataclasses.dataclass(frozen=True)
class SharedParameter:
    """One parameter used by layers of several stages.

    Attributes:
        names: every name of it in the unsplit model (``named_parameters`` with
            duplicates), in model order; ``names[0]`` is its canonical name. In a
            traced model a name read by several stages (a module called on both
            sides of a cut) is listed once per stage.
        name_stages: the stage of each of ``names``.
    """

    names: Tuple[str, ...]
    name_stages: Tuple[int, ...]

    @property
    def stages(self) -> Tuple[int, ...]:
        """The stages whose layers use it, ascending (at least two)."""
        return tuple(sorted(set(self.name_stages)))

    @property
    def canonical(self) -> str:
        """The name it is saved under: its first use in the model."""
        return self.names[0]


def _stage_of_layer(partition: Partition) -> List[int]:
    return [j for j, count in enumerate(partition.balance) for _ in range(count)]


def find_shared(module: nn.Sequential, partition: Partition) -> List[SharedParameter]:
    """The parameters that layers of different stages share.

    A parameter tied within one stage is not listed: one module holds it, as in
    the unsplit model.

    Args:
        module: the whole model.
        partition: its stages.

    Returns:
        One entry per shared parameter, ordered by its canonical name's position
        in the model.
    """
    stage_of = _stage_of_layer(partition)
    layer_index = {name: l for l, (name, _) in enumerate(module.named_children())}
    names: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    shared = []
    for uses in names.values():
        stages = tuple(stage_of[layer_index[n.split(".", 1)[0]]] for n in uses)
        if len(set(stages)) > 1:
            shared.append(SharedParameter(tuple(uses), stages))
    return shared


def find_shared_in_stages(module: nn.Module,
                          stages: Sequence[nn.Module]) -> List[SharedParameter]:
    """:func:`find_shared` for a traced model, whose stages are modules holding the
    original submodules at their original paths (``_trace``).

    Args:
        module: the whole model.
        stages: every stage's module; a parameter name may be held by several
            (a module called, or a tensor read, on both sides of a cut).

    Returns:
        One entry per parameter held by different stages (under one name or several),
        each (name, stage) pair once, names in model order, stages ascending.
    """
    stages_of_name: Dict[str, List[int]] = {}
    for j, stage in enumerate(stages):
        for n in dict(stage.named_parameters(remove_duplicate=False)):
            stages_of_name.setdefault(n, []).append(j)
    names: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    shared = []
    for uses in names.values():
        pairs = [(n, j) for n in uses for j in stages_of_name.get(n, [])]
        if len({j for _, j in pairs}) > 1:
            shared.append(SharedParameter(tuple(n for n, _ in pairs), tuple(j for _, j in pairs)))
    return shared


def alias_names(shared: Sequence[SharedParameter], stage: Optional[int] = None) -> Dict[str, str]:
    """Names of a shared parameter outside its canonical name's stage -> canonical name.

    Those are the names a checkpoint does not store again (the canonical stage's
    file holds the tensor once); a name in the canonical stage is that stage's
    own tie, stored as torch stores it.

    Args:
        shared: from :func:`find_shared`.
        stage: only the names held by this stage (needed when one name is held by
            several stages: it is an alias in all but the canonical one).

    Returns:
        ``{"4.weight": "0.weight", ...}`` (a name read by two stages: ``{"a.weight":
        "a.weight"}`` for the later stage).
    """
    return {n: sp.canonical for sp in shared for n, j in zip(sp.names[1:], sp.name_stages[1:])
            if j != sp.name_stages[0] and (stage is None or j == stage)}


def canonical_names(shared: Sequence[SharedParameter]) -> Dict[str, str]:
    """Every name of a shared parameter -> its canonical name (optimizer state is
    saved once, under the canonical name, by the canonical name's stage).

    Args:
        shared: from :func:`find_shared`.

    Returns:
        ``{"0.weight": "0.weight", "4.weight": "0.weight", ...}``.
    """
    return {n: sp.canonical for sp in shared for n in sp.names}


def describe(sp: SharedParameter) -> str:
    """``"0.weight and 4.weight (stages 0 and 2)"``, for messages."""
    return (f"{' and '.join(dict.fromkeys(sp.names))} (stages "
            f"{' and '.join(str(j) for j in sp.stages)})")


class SharedGradients:
    """Sums the gradients of this rank's shared parameters over the stages using them.

    Every rank of the pipeline constructs it (collective: it creates one process
    group per distinct set of ranks holding a shared parameter, in the same order
    everywhere).

    Args:
        shared: from :func:`find_shared` (the same list on every rank).
        stages: this rank's stages.
        stage_ranks: the ranks (within ``group``) of every stage, replica order.
        group: the pipeline's group.
        timeout: seconds, for the new groups' operations.
    """

    def __init__(self, shared: Sequence[SharedParameter], stages: LocalStages,
                 stage_ranks: Sequence[Sequence[int]], group: dist.ProcessGroup,
                 timeout: float) -> None:
        rank = dist.get_rank(group)
        span = datetime.timedelta(seconds=timeout)
        by_ranks: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        # (group, tensors, whether this rank contributes) per set of ranks this rank is in.
        self._work: List[Tuple[dist.ProcessGroup, List[nn.Parameter], bool]] = []
        # (group, parameter, whether this rank holds the value every copy takes).
        self._values: List[Tuple[dist.ProcessGroup, nn.Parameter, bool]] = []
        local_params = dict(stages.module.named_parameters(remove_duplicate=False))
        for sp in shared:
            ranks = tuple(sorted({r for j in sp.stages for r in stage_ranks[j]}))
            if len(ranks) < 2:
                continue  # every use on this rank: autograd sums into one .grad
            if ranks not in by_ranks:
                new = dist.new_group([dist.get_global_rank(group, r) for r in ranks],
                                     timeout=span)
                by_ranks[ranks] = new if rank in ranks else None
            if rank not in ranks:
                continue
            param = next(local_params[n] for n in sp.names if n in local_params)
            source = stage_ranks[sp.name_stages[0]][0] == rank  # the first use's leader
            self._values.append((by_ranks[ranks], param, source))
            if not param.requires_grad:
                continue  # frozen: no gradient to sum (the group exists anyway, on every rank)
            leader = any(stage_ranks[j][0] == rank for j in sp.stages if j in stages)
            entry = next((w for w in self._work if w[0] is by_ranks[ranks]), None)
            if entry is None:
                self._work.append((by_ranks[ranks], [param], leader))
            else:
                # With replicas a rank holds one stage, so its role is the same
                # for every parameter of the set.
                entry[1].append(param)

    @torch.no_grad()
    def synchronize_values(self) -> None:
        """Makes every copy of each shared parameter equal to the copy of the stage
        of its first use (its leader rank's). Collective over the sharing ranks.

        Copies of a model built whole with the same seed are equal already; layers
        materialised from the meta device are initialised per rank, each from its
        own layer's seed, so a tied weight's copies start different without this.
        """
        for group, param, source in self._values:
            value = param.detach().clone() if source else torch.zeros_like(param)
            collectives.all_reduce_data(value, group)
            param.copy_(value)

    def __bool__(self) -> bool:
        return bool(self._work)

    @torch.no_grad()
    def reduce(self) -> None:
        """Replaces each local shared parameter's gradient by the sum over its stages.

        Call it after the executor's run (replicas already reduced) and before
        the optimizer step; every rank holding a shared parameter must call it.
        """
        for group, params, leader in self._work:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not leader:
                flat.zero_()
            collectives.all_reduce_data(flat, group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
