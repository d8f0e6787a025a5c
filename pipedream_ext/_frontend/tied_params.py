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
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from .partition import Partition

__all__ = ["SharedParameter", "find_shared", "find_shared_in_stages", "alias_names", "canonical_names", "describe"]


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
