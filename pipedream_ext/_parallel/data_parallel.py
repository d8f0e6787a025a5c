"""Data parallelism inside pipeline stages: a ``("pp", "dp")`` DeviceMesh (with
``tensor_parallel``, ``("pp", "dp", "tp")``: one pipeline per ``(dp, tp)``
coordinate, the plan applied by ``_runtime.tensor_parallel`` before the dp policy).

Owns ``PipeDream(mesh=..., data_parallel=...)``: the mesh's ``pp`` dimension is the
pipeline's group, its ``dp`` dimension runs one copy of the pipeline per rank, each
on its own part of the batch.

* ``data_parallel="fsdp"`` (:class:`FsdpStages`): FSDP2's ``fully_shard`` over
  ``mesh["dp"]``, one unit per top-level layer with parameters and one root per
  stage, applied while the stages are built (``LocalStages(after_layer=...)``), so a
  meta-device layer is sharded right after it is materialised and before the
  executor (or the split backward) ever sees a parameter. A traced stage's units
  are the modules its graph calls once (:func:`graph_units`); a parameter tied
  between two units of one rank is refused (:func:`refuse_split_ties`).
* ``data_parallel="replicate"`` (:class:`ReplicatedStages`): every rank keeps whole
  stages; gradients are all-reduced over ``dp`` at the end of each step.

Gradient synchronisation waits for each stage's last backward, as torch's
``torch/distributed/pipelining/stage.py`` does: during the step every unit runs
without gradient sync, without resharding after backward and not as the last
backward (its post-backward only accumulates the unsharded gradient); after the
executor's run, which ends with every stage's last ``B`` or ``W``, the flags are
set and every parameter group's ``post_backward`` and the root's final callback run:
one reduce-scatter per unit per step. With ``reshard_after_forward=True`` and a
split-backward schedule, a forward is not resharded when the next backward action
of its stage is a ``W`` (:func:`keep_unsharded_after`): ``W`` runs from saved
activations without the pre-backward hook that would all-gather the weights again
(the built-in schedules never need it: each ``W`` follows an ``I`` of its stage
after the stage's last forward; it guards other action lists).
docs/runtime.md ("Pipeline + FSDP") has the details.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import schedules
from .._dist import collectives
from .._dist.groups import RankNames, bounded_group, checkpoint_group, side_group
from .._frontend.local_stages import LocalStages
from .._runtime.config import PipelineConfig
from .._runtime.stage_call import as_tuple
from .tensor_parallel import TensorParallel, check_sequence_length, local
from .tp_init import materialize_sharded
from .tp_tied import Ties

__all__ = ["DATA_PARALLEL", "MeshPlan", "mesh_pipelines", "resolve_mesh", "check_schedule", "DataParallel",
           "FsdpStages", "ReplicatedStages", "keep_unsharded_after", "make_data_parallel",
           "refuse_split_ties", "graph_units"]

#: The values of ``data_parallel``.
DATA_PARALLEL = ("fsdp", "replicate")


@dataclasses.dataclass
class MeshPlan:
    """What a ``("pp", "dp")`` mesh means for this rank.

    torch numbers the ranks of each mesh dimension by its process group, in ascending
    global rank (``mesh["pp"].get_local_rank()``), whatever their order in the mesh
    tensor; so does the pipeline: stage ``j`` runs on the ranks whose pp rank is ``j``.
    :func:`resolve_mesh` accepts a mesh whose rows and columns keep together under
    that numbering (any ascending mesh, or one with its rows or columns permuted).

    Attributes:
        mesh: the 2-D mesh.
        data_parallel: ``"fsdp"`` or ``"replicate"``.
        reshard_after_forward: FSDP's ``reshard_after_forward``.
        mp_policy: FSDP's ``MixedPrecisionPolicy``, or ``None``.
        pipelines: the global ranks of every pipeline (the pp group of each dp rank,
            or with tp of each ``(dp, tp)`` coordinate, index ``dp * tp_size + tp``), each
            in pp rank order (ascending).
        pp_group: this rank's pipeline's group (the ranks of ``mesh["pp"]``), bounded by
            the pipeline's timeout (:meth:`create_groups`), for the executor and every
            exchange within the pipeline.
        dp_mesh: the 1-D mesh over this rank's dp group that FSDP and the replicas use,
            on a group bounded by the pipeline's timeout (:meth:`create_groups`).
        world_group: a group over every rank bounded by the pipeline's timeout, for
            what every pipeline does together each step (the batch loss, the first
            steps' agreement, clipping, the finite checks).
        tp_size: the mesh's tp size (1 without a ``"tp"`` dimension).
        tensor_parallel: the plan (``PipeDream(tensor_parallel=...)``), or ``None``.
        tp_mesh: the 1-D mesh over this rank's tp group, on a group bounded by the
            pipeline's timeout (:meth:`create_groups`; with ``tensor_parallel`` only).
        timeout: the pipeline's timeout in seconds (:meth:`create_groups`).
        plan_group: with ``tensor_parallel``, a group over every rank bounded by twice
            the timeout, on which applying the plan is agreed (``TensorParallel.apply``).
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
        return len(self.pipelines) // self.tp_size

    @property
    def names(self) -> RankNames:
        """How messages name this pipeline's ranks: global, with mesh coordinates."""
        return RankNames(self.pipelines[self.copy], self.pipelines, self.tp_size)

    def describe(self) -> Dict[str, Any]:
        """The mesh's shape and the data-parallel settings, for the construction agreement."""
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
        me = dist.get_rank()
        self.timeout = timeout
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
        if self.tensor_parallel is None:
            return
        # Applying the plan is agreed on over the world with twice the timeout: a rank
        # whose tp peer's plan raised before its collective waits that long in it first.
        self.plan_group = bounded_group(self.world_ranks, 2 * timeout)
        tp_group = None
        for pp in range(len(self.pipelines[0])):
            for d in range(self.dp_size):
                row = [ranks[pp] for ranks in self.pipelines[d * tp:(d + 1) * tp]]
                group = bounded_group(row, timeout)
                if me in row:
                    tp_group = group
        # One (dp, tp) mesh over this rank's two groups: FSDP2 over TP needs the dp and
        # tp meshes to share their root.
        pp = self.pipelines[self.copy].index(me)
        layout = [[self.pipelines[d * tp + t][pp] for t in range(tp)] for d in range(self.dp_size)]
        both = DeviceMesh.from_group([self.dp_mesh.get_group(), tp_group], self.mesh.device_type,
                                     mesh=layout, mesh_dim_names=("dp", "tp"))
        self.dp_mesh, self.tp_mesh = both["dp"], both["tp"]

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
            (global ranks, in pipeline order ``dp * tp_size + tp``), ``checkpoint_group``
            and ``tp_size``.
        """
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "group": dist.group.WORLD,
                "stage_ranks": [[ranks[r] for ranks in self.pipelines for r in local]
                                for local in stage_ranks],
                "checkpoint_group": checkpoint_group(self.world_ranks, timeout),
                "tp_size": self.tp_size}


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


def resolve_mesh(mesh: Any, data_parallel: str, process_group: Optional[dist.ProcessGroup],
                 replicas: Optional[Sequence[int]], reshard_after_forward: bool,
                 mp_policy: Any, tensor_parallel: Any = None) -> Optional[MeshPlan]:
    """Checks ``mesh`` and the data-parallel arguments (needs the default group).

    Returns:
        The mesh's meaning, or ``None`` without a mesh.

    Raises:
        ValueError: a bad ``data_parallel``; ``mp_policy`` or ``reshard_after_forward``
            without a mesh; a mesh that is not ``("pp", "dp")`` (or, with
            ``tensor_parallel``, ``("pp", "dp", "tp")`` or ``("pp", "tp")``) over every
            rank, or whose rank order gives no stage order (:func:`mesh_pipelines`);
            ``replicas`` or ``process_group`` together with a mesh; ``tensor_parallel``
            without a tp dimension (or a tp dimension without it).
    """
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r}; use 'fsdp' (FSDP2 over mesh['dp']) "
                         "or 'replicate' (gradients all-reduced over mesh['dp'])")
    if mesh is None:
        if tensor_parallel is not None:
            raise ValueError("tensor_parallel= needs a mesh with a 'tp' dimension: pass mesh="
                             "init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=('pp', "
                             "'dp', 'tp'))")
        if mp_policy is not None or reshard_after_forward:
            raise ValueError("mp_policy and reshard_after_forward configure FSDP over a mesh's "
                             "'dp' dimension: pass mesh=init_device_mesh(device_type, (pp, dp), "
                             "mesh_dim_names=('pp', 'dp')), or drop them")
        return None
    names = tuple(mesh.mesh_dim_names or ())
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
        return MeshPlan(mesh, data_parallel, bool(reshard_after_forward), mp_policy, pipelines)
    return _tensor_parallel_plan(mesh, data_parallel, bool(reshard_after_forward), mp_policy,
                                 tensor_parallel, tp_size)


def _tensor_parallel_plan(mesh: Any, data_parallel: str, reshard_after_forward: bool,
                          mp_policy: Any, tensor_parallel: Any, tp_size: int) -> MeshPlan:
    """A mesh with a ``"tp"`` dimension: one pipeline per ``(dp, tp)`` coordinate.

    Raises:
        ValueError: a mesh not in ascending rank order.
    """
    shape = [int(n) for n in mesh.shape]
    ascending = torch.arange(mesh.size()).reshape(shape)
    if not torch.equal(mesh.mesh.cpu(), ascending):
        raise ValueError(f"mesh {mesh.mesh.tolist()} with a 'tp' dimension must number ranks in "
                         "ascending order (not supported yet otherwise); use init_device_mesh("
                         f"device_type, {tuple(shape)}, mesh_dim_names={tuple(mesh.mesh_dim_names)})")
    pp, copies = shape[0], mesh.size() // shape[0]
    pipelines = [[p * copies + c for p in range(pp)] for c in range(copies)]
    return MeshPlan(mesh, data_parallel, reshard_after_forward, mp_policy, pipelines,
                    tp_size=tp_size, tensor_parallel=tensor_parallel)


def check_schedule(plan: MeshPlan, config: PipelineConfig, planned: bool) -> None:
    """Refuses what data parallelism over a mesh does not support, naming it.

    Raises:
        ValueError: an asynchronous schedule; a plan of a traced model (an
            ``nn.Sequential``'s is planned for the pp dimension).
    """
    how = f"mesh= with data_parallel={plan.data_parallel!r}"
    if config.asynchronous:
        raise ValueError(f"schedule {config.schedule!r} updates weights inside the pipeline, "
                         f"but {how} synchronises gradients at the end of a flushed step; use a "
                         "flush schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev, "
                         "interleaved-zb) or replicas= without a mesh")
    if planned:
        raise ValueError(f"balance='auto' or a plan of a traced model (not an nn.Sequential) with "
                         f"{how} is not supported; give split_points, an nn.Sequential, or drop mesh")


def refuse_split_ties(plan: Optional[MeshPlan],
                      tied: Sequence[Tuple[Sequence[str], Sequence[Tuple[str, int]]]]) -> None:
    """FSDP shards each unit's parameters on its own: one Parameter in two units of a
    rank would become two sharded parameters, silently untied.

    A tie across ranks is fine (each rank's copy is one parameter of one unit, its
    gradient summed over the copies by ``SharedGradients``); a tie between two units
    on one rank (two top-level layers, or two stages of one rank) is refused.

    Args:
        plan: the mesh, or ``None``.
        tied: per tied parameter, its names and the ``(unit, pp rank)`` of every use.

    Raises:
        ValueError: with ``data_parallel="fsdp"``, naming the parameter, the units and
            the fix.
    """
    if plan is None or plan.data_parallel != "fsdp":
        return
    for names, uses in tied:
        units_of_rank: Dict[int, List[str]] = {}
        for unit, rank in uses:
            if unit not in units_of_rank.setdefault(rank, []):
                units_of_rank[rank].append(unit)
        for rank, units in units_of_rank.items():
            if len(units) > 1:
                raise ValueError(
                    f"parameter {' = '.join(names)} is used by {' and '.join(units)}, which "
                    "data_parallel='fsdp' would shard as separate units on "
                    f"{plan.names.many([ranks[rank] for ranks in plan.pipelines])}, untying "
                    "the copies; use data_parallel='replicate', or put "
                    "its uses on different pipeline ranks with balance=[...] (a tie across "
                    "ranks is supported), or untie it")


def keep_unsharded_after(actions: Sequence[schedules.Action]) -> Set[Tuple[int, int]]:
    """The forwards ``(stage, microbatch)`` after which the stage must stay unsharded.

    Those whose stage's next backward action in the rank's list is a ``W``: ``W``
    runs the weight branches from saved activations and fires no pre-backward hook,
    so the weights a later forward resharded would not be gathered again.

    Args:
        actions: this rank's compute actions in order (``Schedule.actions(rank, comm=False)``).
    """
    keep: Set[Tuple[int, int]] = set()
    for k, a in enumerate(actions):
        if a.kind != schedules.ActionKind.F:
            continue
        after = next((b.kind for b in actions[k + 1:] if b.stage == a.stage and b.is_backward_like), None)
        if after == schedules.ActionKind.W:
            keep.add((a.stage, a.microbatch))
    return keep


def _apply_tensor_parallel(plan: MeshPlan, stages: LocalStages) -> None:
    """The plan applied to this rank's stages, parameters tied on this rank tied again
    (``tp_tied.Ties``); meta layers (``stages.pending``) are parallelized on the meta
    device, then materialised shard by shard (``tp_init``)."""
    ties = Ties(stages[j] for j in stages)
    TensorParallel(plan.tensor_parallel, plan.tp_mesh, plan.plan_group, plan.names,
                   plan.timeout).apply(
        {j: stages[j] for j in stages})
    ties.restore()  # before materialisation: a tie's later use keeps the first's values
    if stages.pending:
        materialize_sharded(stages)


class DataParallel:
    """What a runner calls around each step (both modes).

    Args:
        plan: the mesh.
        stages: this rank's stages.
        loss_reduction: ``"mean"``, ``"sum"`` or ``"tokens"`` (how dp ranks' losses and
            gradients add up: averaged for ``"mean"``; summed otherwise, a token mean's
            losses being already divided by the whole batch's tokens).
    """

    def __init__(self, plan: MeshPlan, stages: LocalStages, loss_reduction: str) -> None:
        self.plan = plan
        self.stages = stages
        self.loss_reduction = loss_reduction

    @property
    def loss_divisor(self) -> int:
        """What the sum of the pipelines' losses is divided by: the global batch's mean
        (each tp rank of a dp coordinate computes the same loss: counted once)."""
        return self.plan.tp_size * (self.plan.dp_size if self.loss_reduction == "mean" else 1)

    def check_batch(self, value: Any, microbatches: int, what: str) -> None:
        """Each dp rank's batch must split evenly into microbatches (the global mean
        weights every dp rank alike), and with sequence parallelism its sequence over tp.

        Raises:
            ValueError: naming the batch size and the fix; a sequence length sequence
                parallelism cannot split (``check_sequence_length``).
        """
        if what == "inputs" and self.plan.tensor_parallel is not None:
            check_sequence_length(self.plan.tensor_parallel, self.plan.tp_size, value)
        rows = as_tuple(value)[0].shape[0]
        if rows % microbatches:
            raise ValueError(f"{what} of this data-parallel rank have batch size {rows}, which "
                             f"does not split into microbatches={microbatches} equal parts; "
                             "with mesh= every dp rank's batch must be a multiple of "
                             f"microbatches (e.g. {max(1, rows // microbatches) * microbatches})")

    @property
    def after_layer(self) -> Optional[Callable[[nn.Module], None]]:
        """What ``LocalStages`` calls on each layer it materialises (``None``: nothing)."""
        return None

    def attach(self, stages: LocalStages) -> None:
        """Takes this rank's built stages; with tp, applies the plan
        (``TensorParallel.apply``); replicas start from dp rank 0's weights (as DDP
        broadcasts rank 0's), one broadcast per tensor (local shard), once."""
        self.stages = stages
        if self.plan.tp_mesh is not None:
            _apply_tensor_parallel(self.plan, stages)
        for j in stages:
            self._broadcast(stages[j])

    def _broadcast(self, module: nn.Module) -> None:
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                collectives.broadcast_data(local(t.detach()), 0, self.plan.dp_group)

    def before_forward(self, stage: int, microbatch: int, training: bool) -> None:
        """Called before each forward of a stage (through each step's StepContext.before_forward)."""

    def before_step(self) -> None:
        """Called before the executor runs a step."""

    def after_step(self) -> None:
        """Called after the executor's run: gradients synchronised over dp."""

    def after_evaluation(self) -> None:
        """Called after ``forward_only``."""


class FsdpStages(DataParallel):
    """FSDP2 over ``mesh["dp"]``: each top-level layer with parameters a unit, each
    stage a root; gradient sync deferred to the end of the step.

    Args:
        keep_unsharded: :func:`keep_unsharded_after` of this rank's list.
        (the rest as :class:`DataParallel`)
    """

    def __init__(self, plan: MeshPlan, stages: Optional[LocalStages], loss_reduction: str,
                 keep_unsharded: Set[Tuple[int, int]]) -> None:
        super().__init__(plan, stages, loss_reduction)  # type: ignore[arg-type]
        self.keep_unsharded = keep_unsharded
        self.units = 0

    def _shard(self, module: nn.Module) -> Any:
        # torch's fully_shard: imported at call time so that torch.distributed.fsdp (and
        # its import cost) is only paid by pipelines that shard.
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - optional, see above

        kwargs: Dict[str, Any] = {"mesh": self.plan.dp_mesh,
                                  "reshard_after_forward": self.plan.reshard_after_forward}
        if self.plan.mp_policy is not None:
            kwargs["mp_policy"] = self.plan.mp_policy
        sharded = fully_shard(module, **kwargs)
        if self.loss_reduction != "mean":  # dp ranks' gradients add up, as their losses do
            sharded.set_gradient_divide_factor(1.0)
            # A plain SUM (then a division by 1): Gloo has no PREMUL_SUM.
            sharded.set_force_sum_reduction_for_comms(True)
        return sharded

    @property
    def after_layer(self) -> Optional[Callable[[nn.Module], None]]:
        # With tensor parallelism the plan comes first (torchtitan's order), in attach.
        return self.shard_layer if self.plan.tensor_parallel is None else None

    def shard_layer(self, layer: nn.Module) -> None:
        """Shards one top-level layer (``LocalStages(after_layer=...)``) right after it
        is materialised, before the next one is, from dp rank 0's values."""
        self._broadcast(layer)
        if any(True for _ in layer.parameters()):
            self._shard(layer)
            self.units += 1

    def attach(self, stages: LocalStages) -> None:
        """Makes each stage module an FSDP root over its sharded layers; a traced
        stage's units (:func:`graph_units`) are sharded here, from dp rank 0's values."""
        self.stages = stages
        if self.plan.tensor_parallel is not None:
            self._shard_after_tensor_parallel(stages)
        for j in stages:
            if stages.traced:
                self._broadcast(stages[j])
                for unit in graph_units(stages[j]):
                    self._shard(unit)
                    self.units += 1
            self._shard(stages[j])
            stages[j].set_reshard_after_forward(self.plan.reshard_after_forward)
        stages.remerge()  # a traced stage's parameters are new (sharded) objects

    def _shard_after_tensor_parallel(self, stages: LocalStages) -> None:
        """The plan applied to each stage, then every top-level layer with parameters
        sharded over dp (its DTensors' local shards broadcast from dp rank 0 first):
        FSDP2 over TP, each parameter a 2-D DTensor over the ``(dp, tp)`` mesh."""
        _apply_tensor_parallel(self.plan, stages)
        if stages.traced:  # its units are the modules the graph calls (attach)
            return
        for j in stages:
            for layer in stages[j].children():
                self.shard_layer(layer)

    def _roots(self) -> List[Any]:
        return [self.stages[j] for j in self.stages]

    def before_forward(self, stage: int, microbatch: int, training: bool) -> None:
        if not self.plan.reshard_after_forward:
            return
        keep = training and (stage, microbatch) in self.keep_unsharded
        self.stages[stage].set_reshard_after_forward(not keep)

    def before_step(self) -> None:
        for root in self._roots():
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)

    def after_step(self) -> None:
        """Every stage's last backward ran: one reduce-scatter per unit, as
        ``_PipelineStageBase.perform_reduce_grad`` does in torch."""
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - optional, see _shard

        for root in self._roots():
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
            # torch offers no public call for this: stage.py's perform_reduce_grad makes
            # the same private ones (each unit's post-backward, then the root's final
            # callback, which waits on the reductions).
            state = fully_shard.state(root)
            for unit in state._state_ctx.all_states:  # noqa: SLF001 - see above
                for group in _param_groups(unit):
                    group.post_backward()
            state._root_post_backward_final_callback()  # noqa: SLF001 - see above

    def after_evaluation(self) -> None:
        for root in self._roots():
            root.reshard()


def graph_units(stage: nn.Module) -> List[nn.Module]:
    """The submodules of a traced stage (a ``GraphModule`` holding the model's modules
    at their paths) that can be FSDP units of their own.

    A unit's parameters are gathered by its forward hooks, so only a module that the
    graph calls (``call_module``) exactly once, whose parameters it does not also read
    directly (``get_attr``: a module traced through reads its weights so) and that
    shares no parameter with another module of the stage qualifies; every other
    parameter belongs to the stage's root unit, gathered before the stage's forward.
    A graph without ``call_module`` nodes (``torch.export``) has no units: one root.

    Args:
        stage: a traced stage.

    Returns:
        The units, in graph order.
    """
    graph = getattr(stage, "graph", None)
    if graph is None:
        return []
    calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    read = [str(n.target) for n in graph.nodes if n.op == "get_attr"]
    uses: Dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    units = []
    for target, count in calls.items():
        module = stage.get_submodule(target)
        params = [p for _, p in module.named_parameters(remove_duplicate=False)]
        if count != 1 or not params or any(uses[id(p)] > 1 for p in params):
            continue
        if any(r == target or r.startswith(target + ".") for r in read):
            continue
        units.append(module)
    return units


def _param_groups(state: Any) -> List[Any]:
    """An FSDP state's parameter groups (a list since torch 2.10, one group before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


class ReplicatedStages(DataParallel):
    """Whole stages on every dp rank; gradients all-reduced over ``dp`` after each step
    (averaged for ``loss_reduction="mean"``, summed for ``"sum"`` and ``"tokens"``), one flat
    all-reduce per stage."""

    def after_step(self) -> None:
        group = self.plan.dp_group
        if self.plan.dp_size == 1:  # ("pp", "tp"): nothing to average
            return
        for j in self.stages:
            params = [p for p in self.stages.parameters_of(j) if p.requires_grad]
            if not params:
                continue
            with torch.no_grad():
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                # A DTensor's gradient (tensor parallelism): its local shard, in place.
                grads = [local(p.grad) for p in params]
                flat = torch.cat([g.reshape(-1) for g in grads])
                collectives.all_reduce_data(flat, group)
                if self.loss_reduction == "mean":
                    flat /= self.plan.dp_size
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()


def make_data_parallel(plan: Optional[MeshPlan], loss_reduction: str,
                       actions: Callable[[], Sequence[schedules.Action]]
                       ) -> Optional[DataParallel]:
    """The data-parallel policy of ``plan`` before the stages exist (FSDP shards them
    as they are built), or ``None`` without a mesh.

    Args:
        actions: this rank's compute actions (for :func:`keep_unsharded_after`).
    """
    if plan is None:
        return None
    if plan.data_parallel == "fsdp" and (plan.tensor_parallel is None or plan.dp_size > 1):
        keep = keep_unsharded_after(actions()) if plan.reshard_after_forward else set()
        return FsdpStages(plan, None, loss_reduction, keep)
    return ReplicatedStages(plan, None, loss_reduction)  # type: ignore[arg-type]
