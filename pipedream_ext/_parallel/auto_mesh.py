"""``mesh="auto"``: the ``(pp, dp, tp)`` a run may factor its world into, and the mesh
the planner chose, built on every rank.

The sample of ``mesh="auto"`` is one step's batch of the whole run, so every candidate
trains on the same global batch: each of the ``dp`` pipelines gets ``rows / dp`` of it
(``dp`` must divide the rows). ``tp > 1`` only with a ``tensor_parallel=`` plan, and only
a tp that the plan's column- and row-wise splits (and its sequence parallelism, on the
sample) take evenly. ``pp`` may be 1 (every flush schedule runs on one rank) and at most
the model's layers. A ``(pp, 1, 1)`` choice runs without a mesh (the plain pipeline over
the world); the others on ``init_device_mesh`` with ``("pp", "dp")``, or
``("pp", "dp", "tp")`` when ``tp > 1``. docs/planner.md, "Choosing the mesh".
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from torch import nn

from .tensor_parallel import check_sequence_length, kept_calls, uneven_split

__all__ = ["Mesh", "build_mesh", "ep_sizes", "expert_mesh_dims", "mesh_candidates", "runs_on_device_mesh", "tp_sizes"]

Mesh = Tuple[int, int, int]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_sizes(world: int, plan: Any, module: nn.Module, inputs: Any) -> List[int]:
    """The tensor-parallel sizes ``mesh="auto"`` may choose: 1, and with a plan every
    divisor of ``world`` the plan splits evenly (:func:`tensor_parallel.uneven_split`;
    a dict plan's ``SequenceParallel``: the sample's sequence length too).

    Args:
        world: ranks in all.
        plan: the ``tensor_parallel`` value, or ``None``.
        module: the whole model (its module names are the plan's).
        inputs: the sample's inputs.
    """
    if plan is None:
        return [1]
    sizes = [1]
    for tp in _divisors(world)[1:]:
        if uneven_split(plan, module, tp) is not None:
            continue
        try:
            check_sequence_length(plan, tp, inputs)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def ep_sizes(world: int, plan: Any, module: nn.Module) -> List[int]:
    """The expert-parallel sizes ``mesh="auto"`` may choose with an ``expert_parallel=``
    dict plan.

    Args:
        world: ranks in all.
        plan: the ``expert_parallel`` value, or ``None``.
        module: the whole model (its module names are the plan's).

    Returns:
        Every divisor of ``world`` that divides each matched module's expert count (its
        parameters' dim 0: experts stacked); ``[1]`` without a plan, ``[]`` for a
        callable one (which cannot be inspected: give a mesh).
    """
    if plan is None:
        return [1]
    if not isinstance(plan, dict):
        return []
    firsts = (next(module.get_submodule(name).parameters(), None) for name in kept_calls(plan, module))
    counts = {p.shape[0] for p in firsts if p is not None}
    return [ep for ep in _divisors(world) if all(count % ep == 0 for count in counts)]


def mesh_candidates(world: int, rows: int, layers: int, tps: Sequence[int]) -> List[Mesh]:
    """Every ``(pp, dp, tp)`` with ``pp * dp * tp = world``, ``tp`` in ``tps``, ``dp``
    dividing the global batch's ``rows`` and ``pp`` at most ``layers``; ordered by tp,
    then by pp from the deepest pipeline (the search keeps the first of equal ones).
    """
    meshes = []
    for tp in tps:
        for pp in reversed(_divisors(world // tp)):
            dp = world // (tp * pp)
            if pp <= layers and rows % dp == 0:
                meshes.append((pp, dp, tp))
    return meshes


def runs_on_device_mesh(mesh: Sequence[int]) -> bool:
    """Whether ``mesh="auto"`` builds a DeviceMesh for ``(pp, dp, tp)``: with data or
    tensor parallelism (``(pp, 1, 1)`` runs on the world without one)."""
    return mesh[1] * mesh[2] > 1


def expert_mesh_dims(mesh: Sequence[int], ep: int) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """The shape and dimension names of the expert-parallel mesh of a chosen ``(pp, dp, tp)``
    whose ``dp`` copies share their experts ``ep`` at a time: ``("pp", "dp", "ep", "tp")``
    without a ``dp`` or ``tp`` of size 1 (``dp`` the copies beyond ``ep``).

    Args:
        mesh: ``(pp, dp, tp)``, ``dp`` counting every copy per tp coordinate.
        ep: the ep size (divides ``dp``).
    """
    pp, dp, tp = (int(x) for x in mesh)
    sizes = [("pp", pp), ("dp", dp // ep), ("ep", ep), ("tp", tp)]
    kept = [(name, n) for name, n in sizes if n > 1 or name in ("pp", "ep")]
    return tuple(n for _, n in kept), tuple(name for name, _ in kept)


def build_mesh(mesh: Sequence[int], device_type: str, ep: int = 0) -> Optional[Any]:
    """The DeviceMesh of a chosen ``(pp, dp, tp)``, over every rank in ascending order
    (collective: every rank calls it with the same shape), or ``None`` for ``(pp, 1, 1)``;
    with ``ep`` (``expert_parallel=``; 0: none) ``("pp", "dp", "ep", "tp")`` without the
    dimensions of size 1 (``dp`` the copies beyond ``ep``), ``ep`` of the ``dp`` copies
    sharing their experts.
    """
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - as dims

    pp, dp, tp = (int(x) for x in mesh)
    if ep:
        shape, names = expert_mesh_dims(mesh, ep)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    if not runs_on_device_mesh(mesh):
        return None
    if tp == 1:
        return init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
