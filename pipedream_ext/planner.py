"""The planner: PipeDream's partitioning (stages, replicas, ranks) in C++.

A profile graph (PipeDream's ``graph.txt``, written by :func:`pipedream_ext.profile`)
and a cluster :class:`Topology` go in; a :class:`Plan` comes out, which the
runtime reads back from ``plan.json``. The search and both cost models live in
``csrc/core/planner.cpp``; docs/planner.md gives the formulas.

Example:
    >>> from pipedream_ext import plan
    >>> p = plan("graph.txt", workers=[4, 4], bandwidth=[16e9, 1.25e9])  # doctest: +SKIP
    >>> p.time_per_stage, [s.replicas for s in p.stages]  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import reprlib
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

from ._extension import _C

__all__ = ["MESH_DIMS", "SHARDINGS", "Plan", "ProfileGraph", "Stage", "Topology", "load_profile",
           "plan"]

log = logging.getLogger(__name__)

ProfileGraph = _C.ProfileGraph
PLAN_FORMAT = "pipedream_ext.plan"
PLAN_VERSION = 1

ProfileLike = Union[str, "os.PathLike[str]", "_C.ProfileGraph"]

# The plan schema. Every field of Topology, Stage and Plan carries a _Spec in its
# dataclass metadata; to_dict, from_dict and the construction from the C++
# planner's dict (whose keys are the field names) are all derived from it, so a
# field is declared once. Every malformed field is a ValueError naming it.
_SCHEMA = "pipedream_ext.plan_schema"
_REQUIRED = object()
_PLAN_HINT = "; write plans with `plan -o plan.json`"


def _as_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            isinstance(v, float) and not v.is_integer()):
        raise TypeError("expected an integer")
    return int(v)


def _as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("expected a number")
    return float(v)


def _as_str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("expected a string")
    return v


def _as_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError("expected true or false")
    return v


def _optional(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def as_optional(v: Any) -> Any:
        return None if v is None else conv(v)
    return as_optional


def _as_dict(v: Any) -> Dict[str, Any]:
    if not isinstance(v, dict):
        raise TypeError("expected an object")
    return dict(v)


def _list_of(conv: Callable[[Any], Any]) -> Callable[[Any], List[Any]]:
    def as_list(v: Any) -> List[Any]:
        if not isinstance(v, list):
            raise TypeError("expected a list")
        return [conv(x) for x in v]
    return as_list


def _same(v: Any) -> Any:
    return v


def _as_layers(v: Any) -> Optional[Tuple[int, int]]:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 2:
        raise TypeError("expected null or [start, end]")
    return (_as_int(v[0]), _as_int(v[1]))


def _as_layers_from_planner(v: Any) -> Optional[Tuple[int, int]]:
    # The C++ planner hands layers over as a tuple, which JSON never holds.
    return _as_layers(list(v) if isinstance(v, tuple) else v)


def _dump_layers(v: Optional[Tuple[int, int]]) -> Optional[List[int]]:
    return list(v) if v is not None else None


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one dataclass field crosses the JSON / C++ boundary.

    Attributes:
        load: JSON value -> attribute value; raises TypeError or ValueError
            (the caller names the field).
        dump: attribute value -> JSON-ready value (a copy, so callers may edit it).
        nested: then ``(value, where, from_planner) -> attribute value`` for fields
            holding schema dataclasses; runs outside the field's error wrapping,
            so the nested object's own messages (which name its fields) pass through.
        from_planner: replaces ``load`` for the C++ planner's dict.
        position: place of the key in the JSON object (default: declaration order).
    """

    load: Callable[[Any], Any]
    dump: Callable[[Any], Any] = copy.deepcopy
    nested: Optional[Callable[[Any, str, bool], Any]] = None
    from_planner: Optional[Callable[[Any], Any]] = None
    position: Optional[int] = None


def _schema_field(load: Callable[[Any], Any], *, default: Any = dataclasses.MISSING,
                  default_factory: Any = dataclasses.MISSING, **spec: Any) -> Any:
    """A dataclass field carrying its :class:`_Spec` (``spec``: the other _Spec attributes)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_SCHEMA: _Spec(load, **spec)})


def _spec(f: "dataclasses.Field[Any]") -> _Spec:
    return f.metadata[_SCHEMA]


def _schema_fields(cls: type) -> List["dataclasses.Field[Any]"]:
    """The fields of a schema dataclass in JSON key order."""
    fields = dataclasses.fields(cls)
    return sorted(fields, key=lambda f: (_spec(f).position if _spec(f).position is not None
                                         else fields.index(f)))


def _field(d: Dict[str, Any], key: str, conv: Any, where: str, default: Any = _REQUIRED,
           hint: str = _PLAN_HINT) -> Any:
    """``conv(d[key])``; a missing (without default) or malformed field raises ValueError."""
    if key not in d:
        if default is _REQUIRED:
            raise ValueError(f"{where} lacks the field {key!r}{hint}")
        return default
    try:
        return conv(d[key])
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where} field {key!r} is {reprlib.repr(d[key])}: {exc}") from None


def _as_object(d: Any, where: str) -> Dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(d).__name__}")
    return d


def _to_dict(obj: Any) -> Dict[str, Any]:
    """A schema dataclass as its JSON object (keys in schema order)."""
    return {f.name: _spec(f).dump(getattr(obj, f.name)) for f in _schema_fields(type(obj))}


_T = TypeVar("_T")


def _from_dict(cls: Type[_T], d: Any, where: str, from_planner: bool = False, **given: Any) -> _T:
    """Builds a schema dataclass from its JSON object (or the C++ planner's dict).

    Fields are read in declaration order, so the first bad one is reported.

    Args:
        cls: Topology, Stage or Plan.
        d: the object to read.
        where: what ``d`` is, for messages (``"plan stage 0"``).
        from_planner: ``d`` is the C++ planner's output: every field is required
            and read with ``_Spec.from_planner`` where one is set.
        given: field values that do not come from ``d``.

    Returns:
        The instance.

    Raises:
        ValueError: ``d`` is not an object, or a field is missing or malformed
            (the message names it and ``where``).
    """
    d = _as_object(d, where)
    values: Dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in given:
            continue
        spec = _spec(f)
        if from_planner:
            value = _field(d, f.name, spec.from_planner or spec.load, where, hint="")
        else:
            default: Any = _REQUIRED
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            value = _field(d, f.name, spec.load, where, default)
        values[f.name] = spec.nested(value, where, from_planner) if spec.nested else value
    try:
        return cls(**values)
    except ValueError as exc:  # Topology's own range checks
        raise ValueError(f"{where}: {exc}") from None


def load_profile(path: Union[str, "os.PathLike[str]"]) -> "_C.ProfileGraph":
    """Reads a PipeDream ``graph.txt``.

    Args:
        path: file to read.

    Returns:
        The profile graph.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is malformed (the message names file, line and field).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"profile {path!r} does not exist; write one with `profile`")
    return _C.ProfileGraph.load(path)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A cluster: levels innermost first, plus memory per worker.

    Attributes:
        workers: units per level, innermost first (``(4, 4)``: 4 GPUs per
            server, 4 servers).
        bandwidth: bytes/s between the units of each level.
        memory: bytes per worker; 0 means no memory limit.
    """

    workers: Tuple[int, ...] = _schema_field(_list_of(_as_int), dump=list)
    bandwidth: Tuple[float, ...] = _schema_field(_list_of(_as_float), dump=list)
    memory: float = _schema_field(_as_float, default=0.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(int(w) for w in self.workers))
        object.__setattr__(self, "bandwidth", tuple(float(b) for b in self.bandwidth))
        if not self.workers:
            raise ValueError("topology needs at least one level, e.g. workers=[4], bandwidth=[16e9]")
        if len(self.workers) != len(self.bandwidth):
            raise ValueError(
                f"got {len(self.workers)} worker counts {list(self.workers)} but "
                f"{len(self.bandwidth)} bandwidths {list(self.bandwidth)}; give one bandwidth per level"
            )
        if any(w < 1 for w in self.workers):
            raise ValueError(f"worker counts {list(self.workers)} must all be >= 1")
        if any(not b > 0 for b in self.bandwidth):
            raise ValueError(f"bandwidths {list(self.bandwidth)} must all be > 0 bytes/s")
        if not self.memory >= 0:
            raise ValueError(f"memory per worker {self.memory} must be >= 0 bytes (0: no limit)")

    @property
    def num_workers(self) -> int:
        """Workers in all (the product of the level sizes)."""
        total = 1
        for w in self.workers:
            total *= w
        return total

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form.

        Returns:
            ``{"workers": [...], "bandwidth": [...], "memory": ...}``.
        """
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "topology") -> "Topology":
        """Inverse of :meth:`to_dict`.

        Args:
            d: the JSON object.
            where: what ``d`` is, for messages.

        Returns:
            The topology.

        Raises:
            ValueError: a missing or malformed field (named in the message), or
                values :class:`Topology` rejects.
        """
        return _from_dict(cls, d, where)


@dataclasses.dataclass
class Stage:
    """One pipeline stage of a plan.

    Attributes:
        nodes: profile node ids in the stage (Input nodes sit in stage 0).
        replicas: workers running the stage data-parallel.
        ranks: those workers' global ranks (rank = server * gpus_per_server + gpu).
        time: predicted seconds per minibatch of the stage.
        compute_seconds: forward + backward seconds of its layers on one worker.
        parameter_bytes: weight bytes of the stage.
        activation_bytes: output activation bytes of its layers (per minibatch).
        memory_bytes: predicted bytes per rank: ``model_state_bytes +
            stashed_activation_bytes``.
        model_state_bytes: per rank: the weight versions; in a data-parallel plan
            the weights, gradients and optimizer state, divided by ``data_parallel``
            under ``sharding="fsdp"`` and by ``tensor_parallel``.
        stashed_activation_bytes: per rank: activations of the minibatches in flight
            (divided by ``tensor_parallel`` with ``sequence_parallel``).
        tensor_parallel_seconds: seconds of tensor-parallel all-reduces one minibatch
            costs the stage's tp ranks, as charged in ``time`` (``time = (compute /
            tp + this + dp synchronisation) / dp``); 0 without tensor parallelism.
        layers: for a chain profile (an ``nn.Sequential``), the layer index range
            ``(start, end)`` of the stage; ``None`` for branching graphs.
    """

    nodes: List[str] = _schema_field(_list_of(_as_str))
    replicas: int = _schema_field(_as_int)
    ranks: List[int] = _schema_field(_list_of(_as_int))
    time: float = _schema_field(_as_float)
    compute_seconds: float = _schema_field(_as_float, default=0.0)
    parameter_bytes: float = _schema_field(_as_float, default=0.0)
    activation_bytes: float = _schema_field(_as_float, default=0.0)
    memory_bytes: float = _schema_field(_as_float, default=0.0)
    model_state_bytes: float = _schema_field(_as_float, default=0.0)
    stashed_activation_bytes: float = _schema_field(_as_float, default=0.0)
    tensor_parallel_seconds: float = _schema_field(_as_float, default=0.0)
    layers: Optional[Tuple[int, int]] = _schema_field(
        _as_layers, default=None, dump=_dump_layers, from_planner=_as_layers_from_planner)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form.

        Returns:
            One key per field, ``layers`` as ``[start, end]`` or ``None``.
        """
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "stage") -> "Stage":
        """Inverse of :meth:`to_dict`.

        Args:
            d: the JSON object.
            where: what ``d`` is, for messages (``"plan stage 0"``).

        Returns:
            The stage.

        Raises:
            ValueError: a missing or malformed field (named in the message).
        """
        return _from_dict(cls, d, where)


def _nested_stages(stages: List[Any], where: str, from_planner: bool) -> List[Stage]:
    return [_from_dict(Stage, s, f"{where} stage {i}", from_planner) for i, s in enumerate(stages)]


def _nested_topology(topology: Dict[str, Any], where: str, from_planner: bool) -> Topology:
    return _from_dict(Topology, topology, f"{where} topology", from_planner)


@dataclasses.dataclass
class Plan:
    """A partition of a model over a cluster, as the runtime consumes it.

    Attributes:
        stages: the pipeline stages in order.
        time_per_stage: the pipeline's bottleneck seconds per minibatch
            (PipeDream's "time per stage in pipeline").
        data_parallel_time: seconds per minibatch of plain data parallelism on
            all workers under the same cost model.
        speedup_over_dp: ``data_parallel_time / time_per_stage``.
        single_worker_time: forward + backward seconds of the model on one worker.
        num_workers: workers in the topology.
        used_workers: workers the plan uses (fewer only with ``fewer_workers``).
        cost_model: ``"pipedream"`` or ``"default"``.
        topology: the cluster planned for.
        state_kind: ``"antichain"`` (PipeDream's states) or ``"topological_cut"``.
        num_states: planning states the DP ran over.
        coarsened: topological cuts were thinned to meet the work budget.
        chain: the profile is a chain; stages then carry ``layers``.
        options: the planner options used.
        data_parallel: data-parallel ranks inside every stage (a ``(pp, dp)`` mesh;
            stages are then straight over ``used_workers`` pipeline ranks), or
            ``None`` for a plan without them (stages may have PipeDream replicas).
        sharding: with ``data_parallel``: ``"fsdp"`` (each rank keeps 1/dp of a
            stage's weights, gradients and optimizer state) or ``"replicate"``.
        tensor_parallel: tensor-parallel ranks inside each data-parallel rank of a
            stage (a ``(pp, dp, tp)`` mesh), or ``None`` for a plan without them.
        sequence_parallel: with ``tensor_parallel``: activations are sharded too.
        configuration: the whole configuration of the run the plan was made or predicted
            for (``pipedream_ext.configuration.Configuration.to_dict``: schedule, chunks,
            microbatches, balance, replicas, recompute per stage, mesh, prediction), or
            ``None`` (a plan of stages and replicas only). ``balance="plan.json"`` then fixes
            all of it.
    """

    # from_dict reads (and reports the first bad field) in declaration order;
    # ``position`` is plan.json's key order, which the file format fixes and
    # which differs from the constructor's argument order.
    stages: List[Stage] = _schema_field(
        _list_of(_same), nested=_nested_stages, position=17,
        dump=lambda stages: [s.to_dict() for s in stages])
    time_per_stage: float = _schema_field(_as_float, position=4)
    data_parallel_time: float = _schema_field(_as_float, position=5)
    speedup_over_dp: float = _schema_field(_as_float, position=6)
    single_worker_time: float = _schema_field(_as_float, position=7)
    num_workers: int = _schema_field(_as_int, position=2)
    used_workers: int = _schema_field(_as_int, position=3)
    cost_model: str = _schema_field(_as_str, position=0)
    topology: Topology = _schema_field(
        _as_dict, nested=_nested_topology, position=1, dump=lambda t: t.to_dict())
    state_kind: str = _schema_field(_as_str, default="antichain", position=8)
    num_states: int = _schema_field(_as_int, default=0, position=9)
    coarsened: bool = _schema_field(_as_bool, default=False, position=10)
    chain: bool = _schema_field(_as_bool, default=False, position=11)
    options: Dict[str, Any] = _schema_field(_as_dict, default_factory=dict, position=12, dump=dict)
    data_parallel: Optional[int] = _schema_field(_optional(_as_int), default=None, position=13)
    sharding: Optional[str] = _schema_field(_optional(_as_str), default=None, position=14)
    tensor_parallel: Optional[int] = _schema_field(_optional(_as_int), default=None, position=15)
    sequence_parallel: bool = _schema_field(_as_bool, default=False, position=16)
    configuration: Optional[Dict[str, Any]] = _schema_field(_optional(_as_dict), default=None,
                                                            position=18)

    @property
    def layers(self) -> Optional[List[Tuple[int, int]]]:
        """``[start, end)`` per stage for chain profiles, else ``None``."""
        if not self.chain:
            return None
        return [s.layers for s in self.stages]  # type: ignore[misc]

    @property
    def replicas(self) -> List[int]:
        """Replica count per stage."""
        return [s.replicas for s in self.stages]

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: pipeline workers times data-parallel ranks per stage
        times tensor-parallel ranks per data-parallel rank."""
        return self.used_workers * (self.data_parallel or 1) * (self.tensor_parallel or 1)

    @property
    def mesh_shape(self) -> Optional[Tuple[int, int, int]]:
        """``(pp, dp, tp)`` of the device mesh a mesh plan (one with ``data_parallel``)
        runs on, dims named :data:`MESH_DIMS`; ``None`` for other plans."""
        if self.data_parallel is None:
            return None
        return (self.used_workers, self.data_parallel, self.tensor_parallel or 1)

    @property
    def mesh_ranks(self) -> Optional[List[List[int]]]:
        """Global ranks of each stage on the mesh (``init_device_mesh(dev, mesh_shape,
        mesh_dim_names=MESH_DIMS)``: rank = (pp * dp_size + dp) * tp_size + tp), its dp
        x tp ranks consecutive; ``None`` for plans without a mesh."""
        shape = self.mesh_shape
        if shape is None:
            return None
        block = shape[1] * shape[2]
        return [[r for w in sorted(s.ranks) for r in range(w * block, (w + 1) * block)]
                for s in self.stages]

    def to_dict(self) -> Dict[str, Any]:
        """The ``plan.json`` object.

        Returns:
            ``format`` and ``version``, one key per field, then ``ranks`` (and
            ``layers`` for chains) per stage and, for mesh plans, ``mesh`` (its
            dims, shape and each stage's global ranks): views that readers of
            plan.json use without walking the stages, never read back.
        """
        d: Dict[str, Any] = {"format": PLAN_FORMAT, "version": PLAN_VERSION}
        d.update(_to_dict(self))
        d["ranks"] = [list(s.ranks) for s in self.stages]
        if self.chain:
            d["layers"] = [list(s.layers) for s in self.stages if s.layers is not None]
        if self.mesh_shape is not None:
            d["mesh"] = {"dims": list(MESH_DIMS), "shape": list(self.mesh_shape),
                         "stage_ranks": self.mesh_ranks}
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`.

        Args:
            d: the ``plan.json`` object.

        Returns:
            The plan.

        Raises:
            ValueError: the object is not a plan of a known version, or a field
                is missing or malformed (the message names it).
        """
        d = _as_object(d, "plan JSON")
        version = d.get("version")
        if d.get("format") != PLAN_FORMAT or isinstance(version, bool) or version != PLAN_VERSION:
            raise ValueError(
                f"not a {PLAN_FORMAT} v{PLAN_VERSION} object (format={d.get('format')!r}, "
                f"version={d.get('version')!r}); write plans with `plan -o plan.json`"
            )
        return _from_dict(cls, d, "plan")

    def to_json(self, indent: Optional[int] = 2) -> str:
        """Serializes to JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parses JSON text written by :meth:`to_json`.

        Raises:
            ValueError: malformed JSON or not a plan.
        """
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError; nesting too deep
            raise ValueError(f"plan JSON is malformed: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("plan JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes ``plan.json``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"]) -> "Plan":
        """Reads ``plan.json``.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a plan.
        """
        with open(path, encoding="utf-8") as f:
            try:
                return cls.from_json(f.read())
            except ValueError as exc:  # also UnicodeDecodeError
                raise ValueError(f"{os.fspath(path)}: {exc}") from exc

    def table(self) -> str:
        """A human-readable table of the stages and the predicted speedup.

        Memory is per rank: the total, then its model state (weights, gradients
        and optimizer state in data-parallel plans; weight versions otherwise)
        and stashed activations. Mesh plans end with each stage's global ranks.
        """
        topo = "x".join(str(w) for w in self.topology.workers)
        tp = "" if self.tensor_parallel is None else (
            f" x {self.tensor_parallel} tensor-parallel ranks"
            f"{' (sequence parallel)' if self.sequence_parallel else ''}")
        dp = "" if self.data_parallel is None else (
            f" x {self.data_parallel} data-parallel ranks per stage ({self.sharding}){tp}, "
            f"{self.world_size} ranks in all")
        lines = [
            f"{len(self.stages)} stage(s) on {self.used_workers}/{self.num_workers} workers "
            f"(levels {topo}){dp}, cost model {self.cost_model}, "
            f"{self.num_states} {self.state_kind} states{' (coarsened)' if self.coarsened else ''}",
            f"{'stage':>5}  {'layers' if self.chain else 'nodes':>12}  {'replicas':>8}  "
            f"{'ranks':<16}  {'time (ms)':>10}  {'memory/rank (MB)':>16}  {'state (MB)':>10}  "
            f"{'activations (MB)':>16}",
        ]
        for i, s in enumerate(self.stages):
            where = f"[{s.layers[0]}, {s.layers[1]})" if s.layers is not None else str(len(s.nodes))
            ranks = _rank_ranges(s.ranks)
            lines.append(
                f"{i:>5}  {where:>12}  {s.replicas:>8}  {ranks:<16}  {s.time * 1e3:>10.3f}  "
                f"{s.memory_bytes / 1e6:>16.1f}  {s.model_state_bytes / 1e6:>10.1f}  "
                f"{s.stashed_activation_bytes / 1e6:>16.1f}"
            )
        lines.append(
            f"time per stage: {self.time_per_stage * 1e3:.3f} ms; data parallel: "
            f"{self.data_parallel_time * 1e3:.3f} ms; speedup over data parallelism: "
            f"{self.speedup_over_dp:.3f}x"
        )
        return "\n".join(lines + self._mesh_lines())

    def _mesh_lines(self) -> List[str]:
        """The table's mesh layout: each stage's global ranks and TP's share of its time."""
        shape, ranks = self.mesh_shape, self.mesh_ranks
        if shape is None or ranks is None:
            return []
        pp, dp, tp = shape
        lines = [f"mesh (pp {pp}, dp {dp}, tp {tp}), dims {MESH_DIMS}: "
                 f"rank = (pp * {dp} + dp) * {tp} + tp"]
        for i, (s, r) in enumerate(zip(self.stages, ranks)):
            comm = (f"; tensor-parallel all-reduces {s.tensor_parallel_seconds * 1e3:.3f} ms"
                    if self.tensor_parallel is not None else "")
            lines.append(f"  stage {i}: ranks {_rank_ranges(r)} (dp {dp} x tp {tp}){comm}")
        return lines


def _rank_ranges(ranks: Sequence[int]) -> str:
    parts: List[str] = []
    start = prev = None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


SHARDINGS = ("fsdp", "replicate")
MESH_DIMS = ("pp", "dp", "tp")


@dataclasses.dataclass(frozen=True)
class _DataParallel:
    """Data-parallel ranks inside every stage, as ``plan`` checked them."""

    degree: int
    sharding: str
    bandwidth: Optional[float]  # None: degree 1 and no bandwidth given
    pipeline_bandwidth: Tuple[float, ...]


def _data_parallel(data_parallel: Any, sharding: Optional[str], straight: Optional[bool],
                   workers: Sequence[int], bandwidth: Sequence[float]) -> _DataParallel:
    """Checks ``plan``'s data-parallel arguments and splits off the dp bandwidth.

    Raises:
        ValueError: naming the bad value and the fix.
    """
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel={data_parallel!r} must be an integer >= 1 (data-parallel "
                         "ranks per stage, the dp size of a (pp, dp) mesh); leave it None to plan "
                         "without data parallelism inside stages")
    chosen = "replicate" if sharding is None else sharding
    if chosen not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is unknown; use 'fsdp' (each data-parallel rank "
                         "keeps 1/data_parallel of a stage's weights, gradients and optimizer "
                         "state) or 'replicate' (each keeps them whole)")
    if straight is False:
        raise ValueError(f"data_parallel={data_parallel} puts data-parallel ranks inside every "
                         "stage, which replaces PipeDream's replicas, so stages are straight over "
                         "the pipeline workers; drop straight=False, or leave data_parallel out "
                         "to plan replicas")
    if len(bandwidth) == len(workers) + 1:
        return _DataParallel(data_parallel, chosen, float(bandwidth[0]), tuple(bandwidth[1:]))
    if data_parallel > 1 or len(bandwidth) != len(workers):
        raise ValueError(
            f"data_parallel={data_parallel} with pipeline workers {list(workers)} needs "
            f"{len(workers) + 1} bandwidths, got {len(bandwidth)} ({list(bandwidth)}): first the "
            "bytes/s among a stage's data-parallel ranks (the innermost level: in a (pp, dp) "
            "mesh they are consecutive ranks), then one per pipeline level, e.g. "
            "bandwidth=[16e9, 1.25e9] for workers=4")
    return _DataParallel(data_parallel, chosen, None, tuple(bandwidth))


@dataclasses.dataclass(frozen=True)
class _TensorParallel:
    """Tensor-parallel ranks inside every data-parallel rank of a stage, as ``plan``
    checked them."""

    degree: int
    sequence_parallel: bool
    bandwidth: float
    all_reduces: float


def _tensor_parallel(tensor_parallel: Any, sequence_parallel: bool, bandwidth: Optional[float],
                     all_reduces: Optional[float], plan_args: Tuple[Optional[bool], str, bool],
                     all_bandwidths: Sequence[float]) -> Optional[_TensorParallel]:
    """Checks ``plan``'s tensor-parallel arguments; ``None`` without ``tensor_parallel``.

    Args:
        plan_args: ``(straight, cost_model, two_bw)`` as ``plan`` got them.
        all_bandwidths: every bandwidth ``plan`` got (dp's included): the fastest is
            the default tp bandwidth, as TP runs inside a node.

    Raises:
        ValueError: naming the bad value and the fix.
    """
    if tensor_parallel is None:
        extra = {"sequence_parallel": sequence_parallel or None,
                 "tensor_parallel_bandwidth": bandwidth,
                 "tensor_parallel_all_reduces": all_reduces}
        given = [f"{k}={v!r}" for k, v in extra.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} applies to tensor-parallel ranks inside stages; "
                             "pass tensor_parallel=T (the tp size of the mesh) too")
        return None
    name = f"tensor_parallel={tensor_parallel!r}"
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or \
            not 1 <= tensor_parallel <= 65536:
        raise ValueError(f"{name} must be an integer >= 1 (tensor-parallel ranks per data-parallel "
                         "rank of a stage, the tp size of a (pp, dp, tp) mesh); leave it None "
                         "to plan without tensor parallelism")
    refusals = {
        "straight": (False, "stages are straight over the pipeline workers on a (pp, dp, tp) "
                            "mesh; drop straight=False"),
        "cost_model": ("pipedream", "it is planned with the default cost model (PipeDream's "
                                    "optimizer knows no tensor parallelism); use "
                                    "cost_model='default'"),
        "two_bw": (True, "a (pp, dp, tp) mesh runs flush schedules (one weight version); "
                         "drop two_bw"),
    }
    for (arg, (bad, why)), value in zip(refusals.items(), plan_args):
        if value is bad or (isinstance(bad, str) and value == bad):
            raise ValueError(f"{name} with {arg}={bad!r}: {why}")
    chosen = max(all_bandwidths) if bandwidth is None else bandwidth
    if isinstance(chosen, bool) or not isinstance(chosen, (int, float)) or \
            not 0 < chosen < float("inf"):
        raise ValueError(f"tensor_parallel_bandwidth={bandwidth!r} must be a positive number of "
                         "bytes/s among a stage's tp ranks, e.g. 1e11 for NVLink inside a node; "
                         "leave it None for the fastest level of bandwidth")
    reduces = 4.0 if all_reduces is None else all_reduces
    if isinstance(reduces, bool) or not isinstance(reduces, (int, float)) or \
            not 0 <= reduces < float("inf"):
        raise ValueError(f"tensor_parallel_all_reduces={all_reduces!r} must be a number >= 0 of "
                         "all-reduces of each layer's output per minibatch: 4 for a transformer "
                         "block (2 forward, 2 backward, Megatron's), 0 to leave TP's "
                         "communication out")
    return _TensorParallel(tensor_parallel, bool(sequence_parallel), float(chosen), float(reduces))


def _options(straight: bool, fewer_workers: bool, ratio: Optional[float], two_bw: bool,
             dp: Optional[_DataParallel], optimizer_state: float,
             tp: Optional[_TensorParallel]) -> Dict[str, Any]:
    """``Plan.options``: what ``plan`` was asked (the dp bandwidth only with data
    parallelism, the tp bandwidth and all-reduces only with tensor parallelism)."""
    options: Dict[str, Any] = {"straight": straight, "fewer_workers": fewer_workers,
                               "activation_compression_ratio": ratio, "two_bw": two_bw}
    if dp is not None:
        options.update(data_parallel_bandwidth=dp.bandwidth, optimizer_state=float(optimizer_state))
    if tp is not None:
        options.update(tensor_parallel_bandwidth=tp.bandwidth,
                       tensor_parallel_all_reduces=tp.all_reduces)
    return options


def _mesh_data_parallel(data_parallel: Any, sharding: Optional[str], straight: Optional[bool],
                        workers: Sequence[int], bandwidth: Sequence[float],
                        tp: Optional[_TensorParallel]) -> Optional[_DataParallel]:
    """``plan``'s data parallelism: as given, 1 with tensor parallelism alone (a missing
    mesh dim has size 1), else ``None``.

    Raises:
        ValueError: naming the bad value and the fix.
    """
    if tp is not None and data_parallel is None:
        data_parallel = 1
    if data_parallel is not None:
        return _data_parallel(data_parallel, sharding, straight, workers, bandwidth)
    if sharding is not None:
        raise ValueError(f"sharding={sharding!r} applies to data-parallel ranks inside stages; "
                         "pass data_parallel=N (the dp size of the mesh) too")
    return None


def _check_cost_model(cost_model: str, ratio: Optional[float]) -> None:
    """Raises ValueError for an unknown cost model or a compression ratio <= 0."""
    if cost_model not in ("pipedream", "default"):
        raise ValueError(f"unknown cost model {cost_model!r}; use 'pipedream' or 'default'")
    if ratio is not None and not ratio > 0:
        raise ValueError(f"activation compression ratio {ratio} must be > 0 (or None)")


def _mesh_arguments(dp: Optional[_DataParallel], tp: Optional[_TensorParallel]) -> Dict[str, Any]:
    """``_C.plan_graph``'s keyword arguments for the dp and tp dimensions (its defaults,
    which plan without them, for those absent)."""
    args: Dict[str, Any] = {}
    if dp is not None:
        args.update(data_parallel=dp.degree, sharding=dp.sharding,
                    data_parallel_bandwidth=dp.bandwidth or 0.0)
    if tp is not None:
        args.update(tensor_parallel=tp.degree, sequence_parallel=tp.sequence_parallel,
                    tensor_parallel_bandwidth=tp.bandwidth,
                    tensor_parallel_all_reduces=tp.all_reduces)
    return args


def plan(
    profile: ProfileLike,
    workers: Union[int, Sequence[int]],
    bandwidth: Union[float, Sequence[float]],
    memory: Optional[float] = None,
    straight: Optional[bool] = None,
    fewer_workers: bool = False,
    cost_model: str = "default",
    activation_compression_ratio: Optional[float] = None,
    two_bw: bool = False,
    max_antichain_states: int = 4096,
    work_budget: float = 1.5e8,
    data_parallel: Optional[int] = None,
    sharding: Optional[str] = None,
    optimizer_state: float = 2.0,
    tensor_parallel: Optional[int] = None,
    sequence_parallel: bool = False,
    tensor_parallel_bandwidth: Optional[float] = None,
    tensor_parallel_all_reduces: Optional[float] = None,
) -> Plan:
    """Partitions a profiled model over a cluster.

    Args:
        profile: a ``graph.txt`` path or a :class:`ProfileGraph`.
        workers: workers per level, innermost first (an int for one level); with
            ``data_parallel``, the pipeline (pp) workers only.
        bandwidth: bytes/s per level, innermost first; with ``data_parallel`` > 1,
            first the bytes/s among a stage's data-parallel ranks, then one per
            level of ``workers``.
        memory: bytes per worker (per rank with ``data_parallel``); ``None`` or 0
            for no limit.
        straight: one worker per stage (no replication); ``None``: no, unless
            ``data_parallel`` is given.
        fewer_workers: allow plans that leave workers unused.
        cost_model: ``"pipedream"`` (PipeDream's optimizer) or ``"default"``.
        activation_compression_ratio: PipeDream's ratio; ``None`` makes
            boundary transfers free in the pipedream model (the default model
            always pays them, uncompressed unless a ratio is given).
        two_bw: default model only: 2 weight versions per stage (2BW) instead
            of PipeDream's one per in-flight minibatch.
        max_antichain_states: above this many PipeDream states, plan over
            topological cuts instead.
        work_budget: DP updates allowed before states are coarsened.
        data_parallel: data-parallel ranks inside every stage (the dp size of a
            ``(pp, dp)`` mesh); stages are then straight over ``workers`` and each
            stage's time and memory per rank follow docs/planner.md ("Planning
            with data parallelism and sharding"). ``None``: none (the plan may
            replicate stages PipeDream's way instead).
        sharding: with ``data_parallel``: ``"fsdp"`` (weights, gradients and
            optimizer state divided among the stage's ranks) or ``"replicate"``
            (the default: each rank holds them whole).
        optimizer_state: with ``data_parallel``: optimizer state bytes per weight
            byte (AdamW 2, SGD with momentum 1, plain SGD 0).
        tensor_parallel: tp ranks inside every dp rank of a stage (a ``(pp, dp, tp)``
            mesh, ``data_parallel`` default 1): ``pp * dp * tp`` ranks, ``workers``
            being pp (docs/planner.md, "Planning with tensor parallelism").
        sequence_parallel: with ``tensor_parallel``: activations sharded too (SP).
        tensor_parallel_bandwidth: bytes/s among a stage's tp ranks; ``None``: the
            fastest of ``bandwidth`` (TP runs inside a node).
        tensor_parallel_all_reduces: all-reduces of each profiled layer's output per
            minibatch, forward and backward; ``None``: 4 (a transformer block's).

    Returns:
        The optimal :class:`Plan` under the cost model.

    Raises:
        ValueError: bad arguments, a malformed profile, or no plan fits memory.
        FileNotFoundError: the profile path does not exist.
    """
    if isinstance(workers, int):
        workers = [workers]
    if isinstance(bandwidth, (int, float)):
        bandwidth = [float(bandwidth)]
    tp = _tensor_parallel(tensor_parallel, sequence_parallel, tensor_parallel_bandwidth,
                          tensor_parallel_all_reduces, (straight, cost_model, two_bw), bandwidth)
    dp = _mesh_data_parallel(data_parallel, sharding, straight, list(workers), list(bandwidth), tp)
    if dp is not None:
        bandwidth = dp.pipeline_bandwidth
    topo = Topology(tuple(workers), tuple(bandwidth), float(memory or 0.0))
    _check_cost_model(cost_model, activation_compression_ratio)
    straight = bool(straight) or dp is not None
    graph = profile if isinstance(profile, _C.ProfileGraph) else load_profile(profile)
    raw = _C.plan_graph(
        graph, list(topo.workers), list(topo.bandwidth), memory=topo.memory, straight=straight,
        fewer_workers=fewer_workers, cost_model=cost_model,
        compression=float(activation_compression_ratio or 0.0), two_bw=two_bw,
        max_antichain_states=max_antichain_states, work_budget=work_budget,
        optimizer_state=float(optimizer_state), **_mesh_arguments(dp, tp))
    log.debug("planned over %d %s states", raw["num_states"], raw["state_kind"])
    options = _options(straight, fewer_workers, activation_compression_ratio, two_bw, dp,
                       optimizer_state, tp)
    # The planner's dict (csrc/bindings/planner.cpp planToDict) is keyed by the field
    # names; the topology, options and data parallelism are ours, not the planner's.
    return _from_dict(
        Plan, raw, "the C++ planner's result", from_planner=True, topology=topo, options=options,
        data_parallel=dp.degree if dp else None, sharding=dp.sharding if dp else None,
        tensor_parallel=tp.degree if tp else None,
        sequence_parallel=bool(tp and tp.sequence_parallel), configuration=None)
