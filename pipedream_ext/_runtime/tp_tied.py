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
uses are split differently, or whose uses on one rank the plan replaced by separate
tensors (``parallelize_module`` distributes each module's parameters on its own).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._frontend.tied_params import SharedParameter, describe

__all__ = ["refuse_split_ties"]


def _layout(p: Any) -> str:
    """How a copy is split: a DTensor's placements and mesh, else not at all."""
    if hasattr(p, "placements") and hasattr(p, "device_mesh"):
        return f"{tuple(p.placements)} over mesh {tuple(p.device_mesh.mesh_dim_names or ())}"
    return "not split"


def refuse_split_ties(shared: Sequence[SharedParameter], module: nn.Module,
                      group: dist.ProcessGroup) -> None:
    """Refuses a parameter tied across stages whose copies tensor parallelism splits
    differently. Collective over the pipeline's group; every rank raises alike.

    Args:
        shared: the parameters tied across stages (the same list on every rank).
        module: this rank's stages as one module, named as in the model, the plan applied.
        group: the pipeline's group.

    Raises:
        ValueError: uses split differently (each named with its stage and placements),
            or uses on one rank that are no longer one tensor.
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
        uses: Dict[str, List[Any]] = {}
        for entry in entries:
            for name, stage, layout in entry["uses"]:
                uses.setdefault(name, [stage, layout])
        if not all(entry["one"] for entry in entries):
            raise ValueError(
                f"tensor_parallel replaced the uses of parameter {describe(sp)}, tied across "
                "stages, by separate tensors on one rank (parallelize_module distributes each "
                "module's parameters on its own), so its uses would train apart; put its uses "
                "on different pipeline ranks (balance=[...], chunks=1) or untie it")
        if len({layout for _, layout in uses.values()}) > 1:
            split = ", ".join(f"{name} (stage {stage}) {layout}" for name, (stage, layout) in uses.items())
            raise ValueError(
                f"tensor_parallel splits parameter {describe(sp)}, tied across stages, "
                f"differently on its uses: {split}; its stages sum the tied gradients shard by "
                "shard, so give every use the same placements (e.g. RowwiseParallel() on the "
                "embedding and ColwiseParallel() on the head both split the [vocab, dim] weight "
                "on dim 0, or split neither) or untie it")
