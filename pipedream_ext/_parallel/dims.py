"""The mesh of one run: how many ranks each parallelism spans, as an object that always
exists (torchtitan's ``ParallelDims``).

A plain process group is ``pp=N, dp=1, tp=1``; ``PipeDream(mesh=...)`` gives a
``("pp", "dp")``, ``("pp", "tp")`` or ``("pp", "dp", "tp")`` DeviceMesh over every rank: one
pipeline per ``(dp, tp)`` coordinate, the mesh's ``pp`` dimension each pipeline's group.
Callers read the sizes and the ``*_enabled`` properties instead of testing for a mesh.
With ``expert_parallel`` the mesh is ``("pp", "ep")`` or ``("pp", "dp", "ep")``: the ep
ranks are data ranks for everything but the experts (torchtitan's dp2ep), so the pipelines
are the ``(dp, ep)`` copies and ``dp_size`` counts them all; ``expert_parallel.py`` applies
the plan over ``ep_mesh`` and the replicas reduce the experts' shards over ``expert_dp_group``.
With ``tensor_parallel`` too the mesh ends in ``"tp"`` (``("pp", "dp", "ep", "tp")``): copy
``(d * ep + e) * tp + t``, so that the tp code reads ``dp * tp + t`` with ``dp`` counting dp x
ep, and the ep groups are taken at fixed ``(d, t)``, the expert-dp groups at fixed ``(e, t)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .._dist.groups import RankNames, bounded_group, checkpoint_group, side_group

__all__ = ["DATA_PARALLEL", "ParallelDims", "check_expert_mesh", "check_schedule", "mesh_pipelines",
           "resolve_dims"]

#: The values of ``data_parallel``.
DATA_PARALLEL = ("fsdp", "replicate")


@dataclasses.dataclass
class ParallelDims:
    """How this rank's run is split: the pipeline (``pp``), data parallelism (``dp``)
    and tensor parallelism (``tp``), with or without a mesh.

    Without a mesh (:meth:`plain`) one pipeline runs on the process group: ``pp`` its
    size, ``dp = tp = 1``, every group the pipeline's own and every hook a no-op.

    torch numbers the ranks of each mesh dimension by its process group, in ascending
    global rank (``mesh["pp"].get_local_rank()``), whatever their order in the mesh
    tensor; so does the pipeline: stage ``j`` runs on the ranks whose pp rank is ``j``.
    :func:`resolve_dims` accepts a mesh whose rows and columns keep together under
    that numbering (any ascending mesh, or one with its rows or columns permuted).

    Attributes:
        mesh: the DeviceMesh, or ``None`` (a plain process group).
        data_parallel: ``"fsdp"`` or ``"replicate"``.
        reshard_after_forward: FSDP's ``reshard_after_forward``.
        mp_policy: FSDP's ``MixedPrecisionPolicy``, or ``None``.
        pipelines: the global ranks of every pipeline (the pp group of each dp rank,
            or with tp of each ``(dp, tp)`` coordinate, index ``dp * tp_size + tp``; with
            ep ``dp`` is ``d * ep_size + e``), each
            in pp rank order (ascending); without a mesh the one pipeline's group.
        pp_group: this rank's pipeline's group: ``mesh["pp"]``'s until
            :meth:`create_groups` bounds it by the pipeline's timeout, for the executor
            and every exchange within the pipeline.
        dp_mesh: the 1-D mesh over this rank's dp group that FSDP and the replicas use,
            on a group bounded by the pipeline's timeout (:meth:`create_groups`).
        world_group: the group of what every pipeline does together each step (the
            batch loss, the first steps' agreement, clipping, the finite checks): the
            world on a mesh (bounded by the timeout after :meth:`create_groups`), else
            the pipeline's group.
        tp_size: the mesh's tp size (1 without a ``"tp"`` dimension).
        tensor_parallel: the plan (``PipeDream(tensor_parallel=...)``), or ``None``.
        tp_mesh: the 1-D mesh over this rank's tp group, on a group bounded by the
            pipeline's timeout (:meth:`create_groups`; with ``tensor_parallel`` only).
        timeout: the pipeline's timeout in seconds (:meth:`create_groups`).
        plan_group: with ``tensor_parallel`` or ``expert_parallel``, a group over every
            rank bounded by twice the timeout, on which applying the plan is agreed
            (``TensorParallel.apply``).
        ep_size: the mesh's ep size (1 without an ``"ep"`` dimension).
        expert_parallel: the plan (``PipeDream(expert_parallel=...)``), or ``None``.
        ep_mesh: the 1-D mesh over this rank's ep group (the ranks of its stage whose dp
            and tp coordinates are its own), bounded by the timeout (:meth:`create_groups`).
        expert_dp_mesh: the 1-D mesh over the ranks of this rank's stage holding the same
            expert shards (its ep and tp coordinates, every dp coordinate), bounded by the
            timeout; with ``ep_mesh``, one ``(dp, ep)`` mesh (FSDP of the experts).
        expert_dp_group: ``expert_dp_mesh``'s group where ``dp > 1``, else ``None``.
    """

    mesh: Any
    data_parallel: str
    reshard_after_forward: bool
    mp_policy: Any
    pipelines: List[List[int]]
    pp_group: Any = None
    dp_mesh: Any = None
    world_group: Any = None
    tp_size: int = 1
    tensor_parallel: Any = None
    tp_mesh: Any = None
    timeout: float = 0.0
    plan_group: Any = None
    ep_size: int = 1
    expert_parallel: Any = None
    ep_mesh: Any = None
    expert_dp_mesh: Any = None
    expert_dp_group: Any = None

    @classmethod
    def plain(cls, group: Optional[dist.ProcessGroup], data_parallel: str) -> "ParallelDims":
        """One pipeline on ``group`` (``None``: the default group): ``dp = tp = 1``.

        Args:
            group: the pipeline's process group (``PipeDream(process_group=...)``).
            data_parallel: the ``data_parallel`` argument (unused without a mesh).
        """
        group = group if group is not None else dist.group.WORLD
        ranks = [int(r) for r in dist.get_process_group_ranks(group)]
        return cls(None, data_parallel, False, None, [ranks], pp_group=group, world_group=group)

    @property
    def on_mesh(self) -> bool:
        """Whether the run has a mesh (the pipelines are its copies, named globally)."""
        return self.mesh is not None

    @property
    def pp_size(self) -> int:
        """Ranks in each pipeline."""
        return len(self.pipelines[0])

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def dp_enabled(self) -> bool:
        """More than one copy of each pipeline, each on its own part of the batch."""
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        """A tensor-parallel plan applied inside every stage (over a ``"tp"`` dimension)."""
        return self.tensor_parallel is not None

    @property
    def ep_enabled(self) -> bool:
        """An expert-parallel plan applied inside every stage (over an ``"ep"`` dimension)."""
        return self.expert_parallel is not None

    @property
    def fsdp_enabled(self) -> bool:
        """Stages sharded by FSDP2 over ``mesh["dp"]``: ``data_parallel="fsdp"`` on a mesh
        with dp ranks (or a ``("pp", "dp")`` mesh of dp 1); a ``("pp", "tp")`` mesh has none."""
        return self.on_mesh and self.data_parallel == "fsdp" and \
            (self.dp_enabled or not self.tp_enabled)

    @property
    def replicate_enabled(self) -> bool:
        """Whole stages on every dp rank, gradients all-reduced over ``mesh["dp"]``."""
        return self.dp_enabled and not self.fsdp_enabled

    @property
    def coordinates(self) -> Optional[Dict[str, int]]:
        """The coordinates along which this rank may hold a replicated DTensor shard (which
        :class:`GradientClipper` counts on coordinate 0 only): with tensor parallelism
        ``{"dp": .., "tp": ..}``; with expert parallelism and replicas ``{"dp": .., "ep": ..}``
        (the mesh's own dp coordinate, not the copy), plus ``"tp"`` with both; under FSDP with
        expert parallelism only ``{"tp": ..}`` (or ``None`` without tp); else ``None``."""
        tp = {"tp": self.tp_rank} if self.tp_enabled else {}
        if self.ep_enabled:
            # Under FSDP the dense shards are distinct over all dp x ep copies and the
            # experts' over (dp, ep): only tp replicates them (the experts, the plain
            # parameters' shards). Replicas hold a DTensor replicated along each dimension
            # its mesh lacks (an expert shard over dp and tp, a tp shard over dp and ep).
            if self.fsdp_enabled:
                return tp or None
            return {"dp": self.dp_rank // self.ep_size, "ep": self.dp_rank % self.ep_size, **tp}
        return {"dp": self.dp_rank, **tp} if self.tp_enabled else None

    def planner_sizes(self) -> Dict[str, Any]:
        """What the planner plans for on a mesh (``partition_from_plan``'s keywords):
        ``dp`` ranks per stage, the sharding and ``tp`` in each; nothing without a mesh."""
        if not self.on_mesh:
            return {}
        return {"data_parallel": self.dp_size, "sharding": self.data_parallel,
                "tensor_parallel": self.tp_size if self.tp_enabled else None}

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The dp group with the pipeline's timeout (after :meth:`create_groups`)."""
        return self.dp_mesh.get_group()

    @property
    def copy(self) -> int:
        """This rank's pipeline's index in :attr:`pipelines` (``dp * tp_size + tp``)."""
        return next(c for c, ranks in enumerate(self.pipelines) if dist.get_rank() in ranks)

    @property
    def dp_rank(self) -> int:
        """This rank's dp rank (``mesh["dp"].get_local_rank()``)."""
        return self.copy // self.tp_size

    @property
    def tp_rank(self) -> int:
        """This rank's tp rank (``mesh["tp"].get_local_rank()``; 0 without tp)."""
        return self.copy % self.tp_size

    @property
    def dp_size(self) -> int:
        """Copies of each pipeline per tp coordinate (``mesh["dp"]``'s size; 1 without)."""
        return len(self.pipelines) // self.tp_size

    @property
    def names(self) -> RankNames:
        """How messages name this pipeline's ranks: on a mesh global, with its
        coordinates; else by their rank in the pipeline's group."""
        if not self.on_mesh:
            return RankNames(list(range(self.pp_size)))
        return RankNames(self.pipelines[self.copy], self.pipelines, self.tp_size, self.ep_size)

    @property
    def world_names(self) -> Optional[RankNames]:
        """How a failure gathered over :attr:`world_group` names ranks
        (``collectives.gather_outcomes``): on a mesh :attr:`names`; without one ``None``,
        the pipeline group's own ranks."""
        return self.names if self.on_mesh else None

    def describe(self) -> Dict[str, Any]:
        """The mesh's shape and the data-parallel settings, for the construction agreement
        (nothing without a mesh: the arguments are agreed on as they are)."""
        if not self.on_mesh:
            return {}
        return {"mesh": [list(self.mesh.mesh_dim_names), list(self.mesh.shape)],
                "data_parallel": self.data_parallel,
                "reshard_after_forward": self.reshard_after_forward,
                "mp_policy": repr(self.mp_policy)}

    def create_groups(self, timeout: float) -> None:
        """Every pipeline's Gloo side group and checkpoint group, and every pipeline
        (``pp_group``), every dp group (``dp_mesh``) and the world (``world_group``) with
        the pipeline's timeout, created on every rank in one order.

        ``new_group`` is collective over the default group: each pipeline creating only
        its own would pair different groups on different ranks. A ``DeviceMesh``'s own
        groups wait the process group's default timeout (30 minutes on Gloo), which
        ``init_device_mesh`` does not let one change.

        Args:
            timeout: seconds, for the checkpoint, pipeline, dp and world groups' operations.
        """
        self.timeout = timeout
        if not self.on_mesh:  # the pipeline's own groups: PipelineGroups.create
            return
        me = dist.get_rank()
        for ranks in self.pipelines:
            side_group(ranks)
            checkpoint_group(ranks, timeout)
            group = bounded_group(ranks, timeout)
            if me in ranks:
                self.pp_group = group
        checkpoint_group(self.world_ranks, timeout)
        self.world_group = bounded_group(self.world_ranks, timeout)
        from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 - as fully_shard

        tp = self.tp_size
        for pp in range(len(self.pipelines[0])):
            for t in range(tp):
                row = [ranks[pp] for ranks in self.pipelines[t::tp]]
                group = bounded_group(row, timeout)
                if me in row:
                    self.dp_mesh = DeviceMesh.from_group(group, self.mesh.device_type, mesh=row,
                                                         mesh_dim_names=("dp",))
        if self.tensor_parallel is None and self.expert_parallel is None:
            return
        # Applying the plan is agreed on over the world with twice the timeout: a rank
        # whose tp peer's plan raised before its collective waits that long in it first.
        self.plan_group = bounded_group(self.world_ranks, 2 * timeout)
        if self.tensor_parallel is not None:
            self._create_tensor_groups(timeout)
        if self.expert_parallel is not None:
            self._create_expert_groups(timeout)

    def _create_tensor_groups(self, timeout: float) -> None:
        """Every stage's tp groups (one per dp coordinate, ``dp * ep`` of them with expert
        parallelism), joined with this rank's dp group as one ``(dp, tp)`` mesh: FSDP2
        over TP needs the dp and tp meshes to share their root."""
        from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 - as fully_shard

        me, tp = dist.get_rank(), self.tp_size
        tp_group = None
        for pp in range(len(self.pipelines[0])):
            for d in range(self.dp_size):
                row = [ranks[pp] for ranks in self.pipelines[d * tp:(d + 1) * tp]]
                group = bounded_group(row, timeout)
                if me in row:
                    tp_group = group
        pp = self.pipelines[self.copy].index(me)
        layout = [[self.pipelines[d * tp + t][pp] for t in range(tp)] for d in range(self.dp_size)]
        both = DeviceMesh.from_group([self.dp_mesh.get_group(), tp_group], self.mesh.device_type,
                                     mesh=layout, mesh_dim_names=("dp", "tp"))
        self.dp_mesh, self.tp_mesh = both["dp"], both["tp"]

    def _create_expert_groups(self, timeout: float) -> None:
        """Every stage's ep groups (one per dp and tp coordinate) and its groups of the ranks
        holding the same expert shards (one per ep and tp coordinate), joined as one (dp, ep)
        mesh per rank: FSDP2 over the experts' ep DTensors needs both meshes to share
        their root, as over tp's (``create_groups``)."""
        from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 - as fully_shard

        me, ep, tp = dist.get_rank(), self.ep_size, self.tp_size
        dp = self.dp_size // ep

        def copy(d: int, e: int, t: int) -> int:  # the pipelines' order: (d * ep + e) * tp + t
            return (d * ep + e) * tp + t
        ep_group = edp_group = None
        for pp in range(len(self.pipelines[0])):
            for d in range(dp):
                for t in range(tp):
                    row = [self.pipelines[copy(d, e, t)][pp] for e in range(ep)]
                    group = bounded_group(row, timeout)
                    if me in row:
                        ep_group = group
            for e in range(ep):
                for t in range(tp):
                    row = [self.pipelines[copy(d, e, t)][pp] for d in range(dp)]
                    group = bounded_group(row, timeout)
                    if me in row:
                        edp_group = group
        pp, t = self.pipelines[self.copy].index(me), self.tp_rank
        layout = [[self.pipelines[copy(d, e, t)][pp] for e in range(ep)] for d in range(dp)]
        both = DeviceMesh.from_group([edp_group, ep_group], self.mesh.device_type, mesh=layout,
                                     mesh_dim_names=("dp", "ep"))
        self.ep_mesh, self.expert_dp_mesh = both["ep"], both["dp"]
        self.expert_dp_group = edp_group if dp > 1 else None

    @property
    def world_ranks(self) -> List[int]:
        """Every rank of the mesh (the whole world), in order."""
        return sorted(r for ranks in self.pipelines for r in ranks)

    def checkpoint_layout(self, stage_ranks: Sequence[Sequence[int]], timeout: float
                          ) -> Dict[str, Any]:
        """What a checkpoint sees of a meshed pipeline: one pipeline over the whole world
        whose stages run on every dp rank (their copies or shards), dp rank 0's copy the
        leader (with tensor parallelism dp rank 0's tp ranks, each with its shards);
        DCP's collectives on a Gloo group over the world.

        Args:
            stage_ranks: every stage's ranks within this pipeline (``mesh["pp"]``).
            timeout: seconds, for the checkpoint group.

        Returns:
            ``PipelineView`` fields: ``rank``, ``world_size``, ``group``, ``stage_ranks``
            (global ranks, in pipeline order ``dp * tp_size + tp``), ``checkpoint_group``,
            ``tp_size`` and ``expert_parallel``.
        """
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "group": dist.group.WORLD,
                "stage_ranks": [[ranks[r] for ranks in self.pipelines for r in local]
                                for local in stage_ranks],
                "checkpoint_group": checkpoint_group(self.world_ranks, timeout),
                # The ranks of a stage that write its shards: dp rank 0's tp ranks, or
                # its ep ranks (each its experts; the dense tensors DCP writes once).
                "tp_size": self.tp_size * self.ep_size, "expert_parallel": self.ep_enabled}


def mesh_pipelines(layout: Sequence[Sequence[int]]) -> List[List[int]]:
    """The pipelines of a ``(pp, dp)`` mesh tensor as torch's process groups number them.

    Each pipeline (a column) in ascending rank order, the pipelines in the order of the
    ranks of a dp group (a row, ascending).

    Args:
        layout: the mesh tensor as nested lists (``mesh.mesh.tolist()``).

    Returns:
        ``pipelines[dp][pp]``: the global rank with those local ranks.

    Raises:
        ValueError: a dp group whose ranks sit at different positions of their
            pipelines (or a pipeline whose ranks sit at different positions of their dp
            groups): no stage order makes each dp group hold copies of one stage.
    """
    columns = [sorted(row[d] for row in layout) for d in range(len(layout[0]))]
    rows = [sorted(row) for row in layout]
    pp_of = {r: col.index(r) for col in columns for r in col}
    dp_of = {r: row.index(r) for row in rows for r in row}
    for what, groups, of, other in (("dp", rows, pp_of, "pp"), ("pp", columns, dp_of, "dp")):
        for ranks in groups:
            if len({of[r] for r in ranks}) > 1:
                where = ", ".join(f"rank {r} is {other} rank {of[r]}" for r in ranks)
                raise ValueError(
                    f"mesh {[list(row) for row in layout]} cannot run a pipeline: torch numbers "
                    "each mesh dimension's ranks by its process group, in ascending order "
                    f"(mesh[{other!r}].get_local_rank()), and in the {what} group {ranks} {where}, "
                    f"so its ranks would not hold the same {'stage' if what == 'dp' else 'copy'}; "
                    "order the mesh so that sorting each row and each column keeps them "
                    "together, e.g. torch.arange(world).reshape(pp, dp)")
    pipelines = [[0] * len(columns[0]) for _ in rows[0]]
    for r, pp in pp_of.items():
        pipelines[dp_of[r]][pp] = r
    return pipelines


def resolve_dims(mesh: Any, data_parallel: str, process_group: Optional[dist.ProcessGroup],
                 replicas: Optional[Sequence[int]], reshard_after_forward: bool,
                 mp_policy: Any, tensor_parallel: Any = None,
                 expert_parallel: Any = None) -> ParallelDims:
    """Checks ``mesh`` and the data-parallel arguments (needs the default group).

    Returns:
        The run's dims: the mesh's, or without a mesh ``process_group``'s one pipeline.

    Raises:
        ValueError: a bad ``data_parallel``; ``mp_policy`` or ``reshard_after_forward``
            without a mesh; a mesh that is not ``("pp", "dp")`` (or, with
            ``tensor_parallel``, ``("pp", "dp", "tp")`` or ``("pp", "tp")``) over every
            rank, or whose rank order gives no stage order (:func:`mesh_pipelines`);
            ``replicas`` or ``process_group`` together with a mesh; ``tensor_parallel``
            without a tp dimension (or a tp dimension without it); the same for
            ``expert_parallel`` and an ep dimension (``("pp", "ep")`` or ``("pp", "dp",
            "ep")``, with ``tensor_parallel`` ending in ``"tp"``).
    """
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r}; use 'fsdp' (FSDP2 over mesh['dp']) "
                         "or 'replicate' (gradients all-reduced over mesh['dp'])")
    check_expert_mesh(mesh, expert_parallel)
    if mesh is None:
        if tensor_parallel is not None:
            raise ValueError("tensor_parallel= needs a mesh with a 'tp' dimension: pass mesh="
                             "init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=('pp', "
                             "'dp', 'tp'))")
        if mp_policy is not None or reshard_after_forward:
            raise ValueError("mp_policy and reshard_after_forward configure FSDP over a mesh's "
                             "'dp' dimension: pass mesh=init_device_mesh(device_type, (pp, dp), "
                             "mesh_dim_names=('pp', 'dp')), or drop them")
        return ParallelDims.plain(process_group, data_parallel)
    names = tuple(mesh.mesh_dim_names or ())
    if "ep" in names or expert_parallel is not None:
        return _expert_parallel_dims(mesh, names, data_parallel, replicas, process_group,
                                     tensor_parallel, expert_parallel, bool(reshard_after_forward),
                                     mp_policy)
    if names not in (("pp", "dp"), ("pp", "tp"), ("pp", "dp", "tp")):
        raise ValueError(f"mesh has dimensions {names or mesh.ndim}; PipeDream takes a 2-D mesh "
                         "init_device_mesh(device_type, (pp, dp), mesh_dim_names=('pp', 'dp')), "
                         "or with tensor_parallel= a 3-D one (pp, dp, tp), mesh_dim_names=('pp', "
                         "'dp', 'tp')")
    tp_size = int(mesh.shape[names.index("tp")]) if "tp" in names else 1
    if "tp" in names and tensor_parallel is None:
        raise ValueError(f"mesh has a 'tp' dimension of size {tp_size} but tensor_parallel= is not "
                         "given; pass tensor_parallel={pattern: ParallelStyle} (or a callable), "
                         "or build the mesh with mesh_dim_names=('pp', 'dp')")
    if tensor_parallel is not None and "tp" not in names:
        raise ValueError(f"tensor_parallel= needs a 'tp' mesh dimension (mesh has {names}); build "
                         "it with init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("
                         "'pp', 'dp', 'tp'))")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"mesh spans {mesh.size()} ranks but the world has "
                         f"{dist.get_world_size()}; build the mesh over every rank")
    if replicas is not None:
        raise ValueError(f"replicas={list(replicas)} and mesh= both ask for data parallelism; "
                         "drop replicas (mesh['dp'] runs every stage on dp ranks) or drop mesh")
    if process_group is not None:
        raise ValueError("process_group= and mesh= both name the pipeline's ranks; drop "
                         "process_group (the pipeline runs on mesh['pp'])")
    if "tp" not in names:
        pipelines = mesh_pipelines([[int(r) for r in row] for row in mesh.mesh.tolist()])
        return ParallelDims(mesh, data_parallel, bool(reshard_after_forward), mp_policy, pipelines,
                            pp_group=mesh["pp"].get_group(), world_group=dist.group.WORLD)
    return _tensor_parallel_dims(mesh, data_parallel, bool(reshard_after_forward), mp_policy,
                                 tensor_parallel, tp_size)


def _tensor_parallel_dims(mesh: Any, data_parallel: str, reshard_after_forward: bool,
                          mp_policy: Any, tensor_parallel: Any, tp_size: int) -> ParallelDims:
    """A mesh with a ``"tp"`` dimension: one pipeline per ``(dp, tp)`` coordinate.

    Raises:
        ValueError: a mesh not in ascending rank order.
    """
    return ParallelDims(mesh, data_parallel, reshard_after_forward, mp_policy,
                        _ascending_pipelines(mesh, "a 'tp'"), pp_group=mesh["pp"].get_group(),
                        world_group=dist.group.WORLD, tp_size=tp_size, tensor_parallel=tensor_parallel)


def _ascending_pipelines(mesh: Any, dimension: str) -> List[List[int]]:
    """The pipelines of a mesh whose ranks ascend in its order (``pp`` first): one per
    coordinate of the other dimensions, in that order.

    Raises:
        ValueError: a mesh in another order, naming ``dimension`` (``"a 'tp'"``).
    """
    shape = [int(n) for n in mesh.shape]
    if not torch.equal(mesh.mesh.cpu(), torch.arange(mesh.size()).reshape(shape)):
        raise ValueError(f"mesh {mesh.mesh.tolist()} with {dimension} dimension must number ranks in "
                         "ascending order (not supported yet otherwise); use init_device_mesh("
                         f"device_type, {tuple(shape)}, mesh_dim_names={tuple(mesh.mesh_dim_names)})")
    pp, copies = shape[0], mesh.size() // shape[0]
    return [[p * copies + c for p in range(pp)] for c in range(copies)]


def check_expert_mesh(mesh: Any, expert_parallel: Any) -> None:
    """An ``"ep"`` mesh dimension without ``expert_parallel`` (or the plan without one),
    refused before the model is traced (tracing would fail first, inside the experts).

    Raises:
        ValueError: naming the mesh's dimensions and the fix.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "ep" in names and expert_parallel is None:
        raise ValueError(f"mesh has an 'ep' dimension of size {int(mesh.shape[names.index('ep')])} "
                         "but expert_parallel= is not given; pass expert_parallel={pattern: "
                         "ParallelStyle} (torchtitan's ExpertParallel() on the experts), or build "
                         "the mesh with mesh_dim_names=('pp', 'dp')")
    if expert_parallel is not None and mesh is None:
        raise ValueError("expert_parallel= needs a mesh with an 'ep' dimension: pass mesh="
                         "init_device_mesh(device_type, (pp, ep), mesh_dim_names=('pp', 'ep')) "
                         "or (pp, dp, ep) with mesh_dim_names=('pp', 'dp', 'ep')")


def _expert_parallel_dims(mesh: Any, names: Sequence[str], data_parallel: str, replicas: Any,
                          process_group: Any, tensor_parallel: Any, expert_parallel: Any,
                          reshard_after_forward: bool, mp_policy: Any) -> ParallelDims:
    """A mesh with an ``"ep"`` dimension: one pipeline per ``(dp, ep)`` coordinate, the ep
    ranks data ranks for the dense layers (torchtitan's dp2ep).

    Raises:
        ValueError: naming what does not fit and the fix.
    """
    if names not in _EXPERT_MESHES:
        raise ValueError(f"expert_parallel= needs mesh_dim_names ('pp', 'ep') or ('pp', 'dp', 'ep'), "
                         "or with tensor_parallel= ('pp', 'ep', 'tp') or ('pp', 'dp', 'ep', 'tp'), "
                         f"not {tuple(names)}; build it with init_device_mesh(device_type, (pp, ep), "
                         "mesh_dim_names=('pp', 'ep'))")
    if ("tp" in names) != (tensor_parallel is not None):
        raise ValueError(f"mesh has a 'tp' dimension of size {int(mesh.shape[names.index('tp')])} but "
                         "tensor_parallel= is not given; pass tensor_parallel={pattern: ParallelStyle} "
                         "(or a callable), or build the mesh without 'tp'" if "tp" in names else
                         f"tensor_parallel= needs a 'tp' mesh dimension, after 'ep' with "
                         f"expert_parallel= (mesh has {tuple(names)}); build it with init_device_mesh(device_type, "
                         "(pp, dp, ep, tp), mesh_dim_names=('pp', 'dp', 'ep', 'tp'))")
    ep = int(mesh.shape[names.index("ep")])
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"mesh spans {mesh.size()} ranks but the world has "
                         f"{dist.get_world_size()}; build the mesh over every rank")
    if replicas is not None or process_group is not None:
        raise ValueError("replicas= and process_group= cannot be combined with mesh=; drop them "
                         "(the pipeline runs on mesh['pp'], one copy per (dp, ep) coordinate)")
    tp = int(mesh.shape[names.index("tp")]) if "tp" in names else 1
    return ParallelDims(mesh, data_parallel, reshard_after_forward, mp_policy,
                        _ascending_pipelines(mesh, "an 'ep'"), pp_group=mesh["pp"].get_group(),
                        world_group=dist.group.WORLD, tp_size=tp, tensor_parallel=tensor_parallel,
                        ep_size=ep, expert_parallel=expert_parallel)


#: The meshes ``expert_parallel=`` runs on (the last two with ``tensor_parallel=``).
_EXPERT_MESHES = (("pp", "ep"), ("pp", "dp", "ep"), ("pp", "ep", "tp"), ("pp", "dp", "ep", "tp"))


def check_schedule(dims: ParallelDims, schedule: str, asynchronous: bool, planned: bool) -> None:
    """Refuses what data parallelism over a mesh does not support, naming it (nothing
    without a mesh).

    Args:
        dims: the run's dims.
        schedule: the schedule's name.
        asynchronous: whether it updates weights inside the pipeline.
        planned: a plan of a traced model (``balance="auto"`` or a saved one).

    Raises:
        ValueError: an asynchronous schedule; a plan of a traced model (an
            ``nn.Sequential``'s is planned for the pp dimension).
    """
    if not dims.on_mesh:
        return
    how = f"mesh= with data_parallel={dims.data_parallel!r}"
    if asynchronous:
        raise ValueError(f"schedule {schedule!r} updates weights inside the pipeline, "
                         f"but {how} synchronises gradients at the end of a flushed step; use a "
                         "flush schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev, "
                         "interleaved-zb) or replicas= without a mesh")
    if planned:
        raise ValueError(f"balance='auto' or a plan of a traced model (not an nn.Sequential) with "
                         f"{how} is not supported; give split_points, an nn.Sequential, or drop mesh")
