"""Clipping gradients by their norm over the whole pipeline: ``GradientClipper``.

Owns ``pd.clip_grad_norm_`` (flush schedules: after ``pipe.step``, before your
``opt.step()``) and ``PipeDream(clip_grad_norm=...)`` (``pipedream-2bw``: before
every weight update the runtime makes; ``check_updates_aligned``). Both equal
``torch.nn.utils.clip_grad_norm_`` on the unsplit model: the norm over every
gradient of the model, each counted exactly once, then every gradient scaled by
``clamp(max_norm / (total + 1e-6), max=1)``.

Which rank counts which gradient:

* a parameter of one stage: the stage's leader (replica 0) only; after the
  replicas' all-reduce every replica holds the same gradient;
* a parameter tied across stages: the leader of the stage of its first use only
  (``SharedGradients`` has summed every copy's gradient into each copy); a ``DTensor``
  copy (FSDP or tensor-parallel shards): on the ranks of its first use's stage only;
* a parameter of two stages on one rank (chunks): once (``parameters()``);
* a ``DTensor`` gradient (``mesh=``, ``data_parallel="fsdp"``: FSDP2 ``fully_shard``
  over ``mesh["dp"]``): its local shard (``to_local()``) on every rank holding one,
  once per replicated mesh dimension (coordinate 0). Shards are disjoint, so their
  p-th powers add up to the whole tensor's within the same all-reduce;
* with a mesh, a plain gradient (``data_parallel="replicate"``: every dp rank holds
  the same averaged gradient) on dp rank 0 only, as a replica's leader counts it;
  with tensor parallelism on the pipeline of ``(dp, tp) = (0, 0)`` only (every tp rank
  holds the same plain gradient);
* a ``DTensor`` gradient with a ``Partial`` placement (a ``SequenceParallel()`` norm's
  weight: each tp rank holds its sequence shard's part of the sum) is reduced to
  ``Replicate`` first (:func:`reduce_partial_gradients`, one all-reduce over its mesh),
  as torch's ``clip_grad_norm_`` reduces it (its norm redistributes a ``Partial``
  input); the optimizer then reads the reduced gradient;
* with tensor parallelism, a ``DTensor`` whose mesh lacks one of the ``dp`` and ``tp``
  dimensions is replicated along it (a tp DTensor over dp with ``"replicate"``, an
  FSDP shard of a plain parameter over tp): only coordinate 0 of that dimension
  counts it (:meth:`GradientClipper._first_outside`); likewise with expert
  parallelism an expert shard (over ``ep``) on dp coordinate 0 only, every ep rank its own.

Each rank computes ``L = torch.nn.utils.get_total_norm`` of the gradients it counts
(torch's own arithmetic: per-tensor norms, foreach, the norm of the norms); one
all-reduce over the pipeline's group (with a mesh: the whole world, every
pipeline's ranks, pp x dp (x tp)), of a 6-number float64 vector on the metadata
device (``_dist.collectives``' device rule, waited for within the pipeline's
timeout), sums ``L ** p`` (max of ``L`` for ``p = inf``) and carries a NaN flag and
which gradient dtypes exist anywhere (the norm takes their promoted dtype, as
torch's ``stack`` of per-tensor norms does, the same on every rank). The total is
``(sum L ** p) ** (1 / p)``. Every local gradient, counted or not (replicas and tied
copies must stay equal), is then scaled by the same coefficient.
"""
from __future__ import annotations

import collections
import math
import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._dist.collectives import is_dtensor
from .._extension import _C
from .._frontend.local_stages import LocalStages

__all__ = ["GradientClipper", "check_max_norm", "check_norm_type", "check_updates_aligned",
           "parse_clip_option", "reduce_partial_gradients"]

# Gradient dtypes the all-reduce flags (the norm takes their promotion).
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_max_norm(max_norm: Any, what: str = "max_norm") -> float:
    """``max_norm`` as a float.

    Raises:
        ValueError: not a real number, NaN, or ``<= 0``.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or \
            math.isnan(max_norm) or max_norm <= 0:
        raise ValueError(f"{what}={max_norm!r}: the largest gradient norm must be a number > 0 "
                         "(e.g. 1.0; float('inf') measures the norm without clipping)")
    return float(max_norm)


def check_norm_type(norm_type: Any, what: str = "norm_type") -> float:
    """``norm_type`` as a float (``'inf'`` and ``float('inf')`` allowed, as in torch).

    Raises:
        ValueError: not a number, NaN, ``<= 0`` or ``-inf``.
    """
    try:
        p = float(norm_type) if not isinstance(norm_type, bool) else math.nan
    except (TypeError, ValueError):
        p = math.nan
    if math.isnan(p) or p <= 0:
        raise ValueError(f"{what}={norm_type!r}: use a p-norm with p > 0 (2.0, the default, or "
                         "1.0) or float('inf') for the largest absolute value")
    return p


def parse_clip_option(value: Any) -> Optional[Tuple[float, float]]:
    """``PipeDream(clip_grad_norm=...)``: ``None``, ``max_norm`` or ``(max_norm, norm_type)``.

    Returns:
        ``None`` or ``(max_norm, norm_type)``.

    Raises:
        ValueError: anything else, or a bad number (naming it).
    """
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"clip_grad_norm={value!r}: give max_norm or (max_norm, norm_type), "
                             "e.g. 1.0 or (1.0, float('inf'))")
        return (check_max_norm(value[0], "clip_grad_norm max_norm"),
                check_norm_type(value[1], "clip_grad_norm norm_type"))
    return check_max_norm(value, "clip_grad_norm"), 2.0


def check_updates_aligned(feed: Any, schedule: str, microbatches: int,
                          replicas: Sequence[int]) -> None:
    """``clip_grad_norm=`` in an asynchronous pipeline: every rank's k-th update must
    run inside the same ``step()`` call, since the k-th updates of all ranks meet in one
    all-reduce. Otherwise the last stage's ``step()`` would wait inside an update for a
    later ``step()`` of stage 0, and any exchange between the two calls (the first
    steps' agreement check, a collective of the user's loop) would deadlock.

    Args:
        feed: the schedule's ``_C.AsyncActionFeed``.
        schedule, microbatches, replicas: for the message.

    Raises:
        ValueError: ranks whose updates fall in different ``step()`` calls (``pipedream``
            with more than one rank, ``pipedream-2bw`` with fewer microbatches than ranks).
    """
    world = sum(replicas)
    steps = 2 * world + 2 * int(feed.period) + 2  # the fill, then whole periods
    per_rank = {tuple(sum(a.kind == _C.ActionKind.UPDATE for a in feed.step_actions(r, t))
                      for t in range(steps)) for r in range(world)}
    if len(per_rank) == 1:
        return
    raise ValueError(
        f"clip_grad_norm with schedule {schedule!r}, microbatches={microbatches} and replicas "
        f"{list(replicas)}: the ranks make their k-th weight update in different step() calls "
        "(the last stage first), but clipping by the whole model's norm joins every rank's k-th "
        "update in one all-reduce; use schedule='pipedream-2bw' with microbatches >= the number "
        f"of ranks ({world}), or a flush schedule and pd.clip_grad_norm_")


def reduce_partial_gradients(parameters: Any) -> None:
    """Replaces every ``DTensor`` gradient with a ``Partial`` placement by its reduced
    value (``Replicate`` on that mesh dimension): collective over the gradient's mesh,
    in parameter order, the same on every rank of it (one stage, one model).

    Args:
        parameters: the parameters whose gradients to reduce (in one order on every rank).
    """
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - only with DTensors

    for p in parameters:
        grad = p.grad
        if grad is None or not is_dtensor(grad) or not any(pl.is_partial() for pl in grad.placements):
            continue
        p.grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl
                                                      for pl in grad.placements])


def _counted_shard(grad: Any) -> bool:
    """Whether this rank counts its local shard of a DTensor gradient: on every mesh
    dimension the gradient is replicated along, only coordinate 0 does.

    Raises:
        ValueError: a ``Partial`` placement (a gradient not reduced yet).
    """
    coordinate = grad.device_mesh.get_coordinate() or []
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate():
            if coordinate and coordinate[dim] != 0:
                return False
        elif not placement.is_shard() and not hasattr(placement, "split_factor"):
            # (_StridedShard, FSDP2's dp placement over a tp Shard(0), has split_factor)
            raise ValueError(f"a DTensor gradient with placement {placement} is not reduced yet; "
                             "clip after the gradients are reduced (Shard or Replicate)")
    return True


class GradientClipper:
    """This rank's part of clipping by the pipeline's total gradient norm.

    Args:
        stages: this rank's stages.
        stage_ranks: every stage's ranks (within ``group``), leader first.
        rank: this rank within ``group``.
        group: the pipeline's group (every rank takes part in every call).
        device: where the returned norm lives (the stages' device).
        timeout: seconds the all-reduce may take.
        counted_elsewhere: tied parameters whose gradient another rank counts
            (``SharedGradients.counted_elsewhere``).
        count_plain: whether this rank counts its plain (not ``DTensor``) gradients at
            all: ``False`` on a mesh's dp ranks other than 0, which hold the same
            gradients as dp rank 0 (``group`` is then the whole world).
        name: how messages name this rank (default ``"rank {rank}"``; on a mesh its
            global rank and coordinates).
        coordinates: with tensor parallelism, this rank's ``{"dp": ..., "tp": ...}``
            coordinates: a DTensor gradient whose mesh lacks one of these dimensions is
            replicated along it (a tp DTensor over dp with ``"replicate"``, an FSDP shard
            of a plain parameter over tp), so only coordinate 0 counts its shard.
    """

    def __init__(self, stages: LocalStages, stage_ranks: Sequence[Sequence[int]], rank: int,
                 group: dist.ProcessGroup, device: torch.device, timeout: float,
                 counted_elsewhere: Sequence[nn.Parameter] = (), count_plain: bool = True,
                 name: Optional[str] = None, coordinates: Optional[Dict[str, int]] = None) -> None:
        self.module, self.group, self.device, self.timeout = stages.module, group, device, timeout
        self.rank = rank
        self.name = name if name is not None else f"rank {rank}"
        self._skip = {id(p) for p in counted_elsewhere}
        self.coordinates = dict(coordinates or {})
        self._counted = {id(p) for j in stages if stage_ranks[j][0] == rank and count_plain
                         for p in stages.parameters_of(j) if id(p) not in self._skip}

    def local_gradients(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(the gradients this rank counts, every local gradient), as plain tensors
        (a DTensor's local shard, which aliases it)."""
        counted: List[torch.Tensor] = []
        local: List[torch.Tensor] = []
        for p in self.module.parameters():
            grad = p.grad
            if grad is None:
                continue
            if is_dtensor(grad):  # a tied copy's shards: counted on its first use's stage
                piece = grad.to_local()
                counts = id(p) not in self._skip and self._first_outside(grad) and _counted_shard(grad)
            else:
                piece, counts = grad, id(p) in self._counted
            local.append(piece)
            if counts:
                counted.append(piece)
        return counted, local

    def _first_outside(self, grad: Any) -> bool:
        """Whether this rank is coordinate 0 of every dimension ``grad``'s mesh lacks."""
        inside = set(grad.device_mesh.mesh_dim_names or ())
        return all(c == 0 for dim, c in self.coordinates.items() if dim not in inside)

    @torch.no_grad()
    def clip(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
             foreach: Optional[bool] = None) -> torch.Tensor:
        """Scales every local gradient so that the pipeline's total norm is at most
        ``max_norm``; collective over the group (checked arguments: ``check_*``).

        Returns:
            The total norm before clipping (the same on every rank).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and a NaN or inf norm (torch's
                message, every rank, nothing scaled), or the all-reduce failed.
        """
        reduce_partial_gradients(self.module.parameters())
        counted, local = self.local_gradients()
        total = self.total_norm(counted, norm_type, foreach)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`")
        # torch's _clip_grads_with_norm_: the coefficient in the norm's dtype, always applied
        # (a factor of 1 leaves the gradients bit for bit).
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: Dict[torch.device, List[torch.Tensor]] = collections.defaultdict(list)
        for g in local:
            by_device[g.device].append(g)
        for device, grads in by_device.items():
            if foreach is False or (foreach is None and device.type not in ("cpu", "cuda")):
                for g in grads:
                    g.mul_(coef.to(device))
            else:
                torch._foreach_mul_(grads, coef.to(device))
        return total

    def total_norm(self, counted: List[torch.Tensor], norm_type: float,
                   foreach: Optional[bool]) -> torch.Tensor:
        """The pipeline's total norm from this rank's counted gradients (one all-reduce)."""
        infinite = math.isinf(norm_type)
        values = torch.zeros(2 + len(_DTYPES), dtype=torch.float64)
        # An FSDP shard may be empty (more dp ranks than rows): it adds nothing, and
        # torch's inf norm refuses an empty tensor.
        nonempty = [g for g in counted if g.numel()]
        if nonempty:
            norm = torch.nn.utils.get_total_norm(nonempty, norm_type, False, foreach)
            norm = norm.detach().to("cpu", torch.float64)
            if bool(norm.isnan()):
                values[1] = 1.0
            else:  # float64: no overflow where torch's own arithmetic has none
                values[0] = norm if infinite else norm ** norm_type
            for g in counted:
                if g.dtype in _DTYPES:
                    values[2 + _DTYPES.index(g.dtype)] = 1.0
        try:
            reduced = collectives.all_reduce_bounded(
                values, self.group, dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM,
                self.timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: the all-reduce of the gradient norm failed or "
                               f"timed out: {exc}") from exc
        dtypes = [d for d, flag in zip(_DTYPES, reduced[2:].tolist()) if flag > 0]
        dtype = torch.get_default_dtype()
        for i, d in enumerate(dtypes):
            dtype = d if i == 0 else torch.promote_types(dtype, d)
        total = reduced[0] if infinite else reduced[0] ** (1.0 / norm_type)
        if reduced[1] > 0:
            total = torch.tensor(math.nan, dtype=torch.float64)
        return total.to(self.device, dtype)
