"""Parameters tied across stages with tensor parallelism: checked shard by shard.

A parameter tied across stages (a head sharing the embedding's weight) has a copy on
every stage using it, and ``tied_grads.SharedGradients`` sums the copies' gradients
over those stages, within each pipeline: with ``tensor_parallel`` one pipeline per
``(dp, tp)`` coordinate, so tp rank ``t`` of one stage adds its local shard to tp rank
``t``'s of the other. That is the sum of the unsplit gradients exactly when every use
of the parameter is split the same way (the same placements over the same mesh:
torchtitan's ``RowwiseParallel()`` embedding and ``ColwiseParallel()`` head both split
the ``[vocab, dim]`` weight on dim 0; both unsplit works too). :func:`refuse_split_ties`
checks it after the plan is applied and refuses, naming the parameter, a tie whose
uses are split differently, or whose uses on one rank stay separate tensors.

``parallelize_module`` distributes each module's parameters on its own, so a parameter
reached from several modules of one rank (``zbv``'s first and last stage, or one stage)
becomes one ``DTensor`` per module; :class:`Ties` records those uses before the plan is
applied and ties them to one tensor again where they got the same placements.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._frontend.tied_params import SharedParameter, describe

__all__ = ["Ties", "refuse_split_ties"]

#: Every parameter held under several names on this rank: its ``(module, attribute)`` sites.
Sites = List[Tuple[nn.Module, str]]


def _layout(p: Any) -> str:
    """How a copy is split: a DTensor's placements and mesh, else not at all."""
    if hasattr(p, "placements") and hasattr(p, "device_mesh"):
        return f"{tuple(p.placements)} over mesh {tuple(p.device_mesh.mesh_dim_names or ())}"
    return "not split"


class Ties:
    """The parameters this rank's stages reach under several names, recorded before the
    plan is applied (``parallelize_module`` replaces each module's parameters by
    ``DTensor``s on its own, untying them), to tie them again after.

    Args:
        modules: this rank's stage modules.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        sites: Dict[int, Sites] = {}
        seen = set()
        for root in modules:
            for module in root.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for name, p in module._parameters.items():  # noqa: SLF001 - direct ownership
                    if p is not None:
                        sites.setdefault(id(p), []).append((module, name))
        self.sites = [s for s in sites.values() if len(s) > 1]

    def restore(self) -> None:
        """Ties every use again to the first use's tensor where the plan gave them the
        same placements (equal values: each split from the one tensor they were); uses
        split differently stay apart (:func:`refuse_split_ties` names a tie across stages)."""
        for sites in self.sites:
            first = sites[0][0]._parameters[sites[0][1]]  # noqa: SLF001 - direct ownership
            for module, name in sites[1:]:
                p = module._parameters[name]  # noqa: SLF001
                if p is not first and p.shape == first.shape and _layout(p) == _layout(first):
                    module._parameters[name] = first  # noqa: SLF001


def _uses(entries: Sequence[Any]) -> str:
    """``"0.weight (stage 0) not split, 4.weight (stage 1) (Shard(dim=0),) over ..."``."""
    uses: Dict[str, Tuple[int, str]] = {}
    for entry in entries:
        for name, stage, layout in entry["uses"]:
            uses.setdefault(name, (stage, layout))
    return ", ".join(f"{name} (stage {stage}) {layout}" for name, (stage, layout) in uses.items())


def refuse_split_ties(shared: Sequence[SharedParameter], module: nn.Module,
                      group: dist.ProcessGroup) -> None:
    """Refuses a parameter tied across stages whose copies tensor parallelism splits
    differently. Collective over the pipeline's group; every rank raises alike.

    Args:
        shared: the parameters tied across stages (the same list on every rank).
        module: this rank's stages as one module, named as in the model, the plan applied.
        group: the pipeline's group.

    Raises:
        ValueError: uses split differently (each named with its stage and placements):
            on several ranks, or on one rank, where they stayed separate tensors.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    mine: Dict[str, Any] = {}
    for k, sp in enumerate(shared):
        local = [(n, j) for n, j in zip(sp.names, sp.name_stages) if n in params]
        if local:
            mine[str(k)] = {"uses": [[n, j, _layout(params[n])] for n, j in local],
                            "one": len({id(params[n]) for n, _ in local}) == 1}
    gathered = collectives.all_gather_json(mine, group)
    for k, sp in enumerate(shared):
        entries = [g[str(k)] for g in gathered if str(k) in g]
        layouts = {layout for entry in entries for _, _, layout in entry["uses"]}
        if not all(entry["one"] for entry in entries):
            raise ValueError(
                f"tensor_parallel replaced the uses of parameter {describe(sp)}, tied across "
                "stages, by separate tensors on one rank (parallelize_module distributes each "
                "module's parameters on its own, and its uses got different placements: "
                f"{_uses(entries)}), so its uses would train apart; give every use the same "
                "placements or untie it")
        if len(layouts) > 1:
            raise ValueError(
                f"tensor_parallel splits parameter {describe(sp)}, tied across stages, "
                f"differently on its uses: {_uses(entries)}; its stages sum the tied gradients "
                "shard by shard, so give every use the same placements (e.g. RowwiseParallel() on the "
                "embedding and ColwiseParallel() on the head both split the [vocab, dim] weight "
                "on dim 0, or split neither) or untie it")
