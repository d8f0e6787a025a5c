"""Summing the gradients of parameters tied across stages: ``SharedGradients``.

A parameter shared by layers on different stages (found by
``_frontend.tied_params``) has a copy on every stage using it; each step, the copies'
gradients are summed over those stages (one process group per set of ranks), so every
copy steps with the gradient of the unsplit model's single parameter.

Over a ``("pp", "dp")`` mesh every pipeline has its own copies: each set of ranks
gets one group per pipeline, all created on every rank in mesh order. With FSDP
each copy is a DTensor sharded over ``mesh["dp"]`` the same way (one shape, one dp
mesh), so the copies' local shards line up: summing the local gradient shards (after
FSDP's reduce-scatter) gives the shard of the summed gradient, and the values are
made equal shard by shard. With tensor parallelism (one pipeline per ``(dp, tp)``
coordinate) the same holds over tp when every copy has the same placements
(``tp_tied.refuse_split_ties``); a gradient placed otherwise than its parameter is
redistributed to the parameter's placements first.
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._dist.collectives import is_dtensor
from .._frontend.local_stages import LocalStages
from .._frontend.tied_params import SharedParameter

__all__ = ["SharedGradients"]


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
        pipelines: over a mesh, the global ranks of every pipeline (``group``'s among
            them), mesh order: each set of ranks gets a group in every pipeline, made on
            every rank; ``None``: ``group`` is the only pipeline.
    """

    def __init__(self, shared: Sequence[SharedParameter], stages: LocalStages,
                 stage_ranks: Sequence[Sequence[int]], group: dist.ProcessGroup,
                 timeout: float, pipelines: Optional[Sequence[Sequence[int]]] = None) -> None:
        rank = dist.get_rank(group)
        span = datetime.timedelta(seconds=timeout)
        mine = [int(r) for r in dist.get_process_group_ranks(group)]
        every = [list(p) for p in pipelines] if pipelines is not None else [mine]
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
                by_ranks[ranks] = None
                for pipeline in every:  # new_group is collective over the default group
                    new = dist.new_group([pipeline[r] for r in ranks], timeout=span)
                    if pipeline == mine and rank in ranks:
                        by_ranks[ranks] = new
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
            local = _local(param)
            value = local.detach().clone() if source else torch.zeros_like(local)
            collectives.all_reduce_data(value, group)
            local.copy_(value)

    def counted_elsewhere(self) -> List[nn.Parameter]:
        """This rank's copies of shared parameters whose gradient another rank counts in a
        global norm (``GradientClipper``): every copy but the first use's leader's."""
        return [param for _, param, source in self._values if not source]

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
                elif is_dtensor(p.grad) and tuple(p.grad.placements) != tuple(p.placements):
                    # tensor parallelism: a row-wise embedding's weight (Shard(0)) gets a
                    # Replicate gradient; the copies' shards line up as the weights do.
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [_local(p.grad) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not leader:
                flat.zero_()
            collectives.all_reduce_data(flat, group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter or gradient (a DTensor), else ``t``.

    Under ``no_grad`` ``to_local()`` is the DTensor's own local tensor, so writing into
    it writes the parameter or gradient."""
    return t.to_local() if hasattr(t, "to_local") else t
