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

import dataclasses
import json
import logging
import os
import reprlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _C

__all__ = ["Plan", "ProfileGraph", "Stage", "Topology", "load_profile", "plan"]

log = logging.getLogger(__name__)

ProfileGraph = _C.ProfileGraph
PLAN_FORMAT = "pipedream_ext.plan"
PLAN_VERSION = 1

ProfileLike = Union[str, "os.PathLike[str]", "_C.ProfileGraph"]

# plan.json field checks: every malformed field is a ValueError naming it.
_REQUIRED = object()


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


def _as_dict(v: Any) -> Dict[str, Any]:
    if not isinstance(v, dict):
        raise TypeError("expected an object")
    return dict(v)


def _list_of(conv: Any) -> Any:
    def as_list(v: Any) -> List[Any]:
        if not isinstance(v, list):
            raise TypeError("expected a list")
        return [conv(x) for x in v]
    return as_list


def _as_layers(v: Any) -> Optional[Tuple[int, int]]:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 2:
        raise TypeError("expected null or [start, end]")
    return (_as_int(v[0]), _as_int(v[1]))


def _field(d: Dict[str, Any], key: str, conv: Any, where: str, default: Any = _REQUIRED) -> Any:
    """``conv(d[key])``; a missing (without default) or malformed field raises ValueError."""
    if key not in d:
        if default is _REQUIRED:
            raise ValueError(f"{where} lacks the field {key!r}; write plans with `plan -o plan.json`")
        return default
    try:
        return conv(d[key])
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where} field {key!r} is {reprlib.repr(d[key])}: {exc}") from None


def _as_object(d: Any, where: str) -> Dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(d).__name__}")
    return d


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

    workers: Tuple[int, ...]
    bandwidth: Tuple[float, ...]
    memory: float = 0.0

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
        """JSON-ready form."""
        return {"workers": list(self.workers), "bandwidth": list(self.bandwidth), "memory": self.memory}

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "topology") -> "Topology":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a missing or malformed field (named in the message).
        """
        d = _as_object(d, where)
        workers = _field(d, "workers", _list_of(_as_int), where)
        bandwidth = _field(d, "bandwidth", _list_of(_as_float), where)
        memory = _field(d, "memory", _as_float, where, 0.0)
        try:
            return cls(tuple(workers), tuple(bandwidth), memory)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


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
        memory_bytes: predicted bytes per worker (weight versions + stashed activations).
        layers: for a chain profile (an ``nn.Sequential``), the layer index range
            ``(start, end)`` of the stage; ``None`` for branching graphs.
    """

    nodes: List[str]
    replicas: int
    ranks: List[int]
    time: float
    compute_seconds: float = 0.0
    parameter_bytes: float = 0.0
    activation_bytes: float = 0.0
    memory_bytes: float = 0.0
    layers: Optional[Tuple[int, int]] = None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form."""
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers) if self.layers is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "stage") -> "Stage":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a missing or malformed field (named in the message).
        """
        d = _as_object(d, where)
        return cls(
            nodes=_field(d, "nodes", _list_of(_as_str), where),
            replicas=_field(d, "replicas", _as_int, where),
            ranks=_field(d, "ranks", _list_of(_as_int), where),
            time=_field(d, "time", _as_float, where),
            compute_seconds=_field(d, "compute_seconds", _as_float, where, 0.0),
            parameter_bytes=_field(d, "parameter_bytes", _as_float, where, 0.0),
            activation_bytes=_field(d, "activation_bytes", _as_float, where, 0.0),
            memory_bytes=_field(d, "memory_bytes", _as_float, where, 0.0),
            layers=_field(d, "layers", _as_layers, where, None),
        )


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
    """

    stages: List[Stage]
    time_per_stage: float
    data_parallel_time: float
    speedup_over_dp: float
    single_worker_time: float
    num_workers: int
    used_workers: int
    cost_model: str
    topology: Topology
    state_kind: str = "antichain"
    num_states: int = 0
    coarsened: bool = False
    chain: bool = False
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)

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

    def to_dict(self) -> Dict[str, Any]:
        """The ``plan.json`` object."""
        d: Dict[str, Any] = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "cost_model": self.cost_model,
            "topology": self.topology.to_dict(),
            "num_workers": self.num_workers,
            "used_workers": self.used_workers,
            "time_per_stage": self.time_per_stage,
            "data_parallel_time": self.data_parallel_time,
            "speedup_over_dp": self.speedup_over_dp,
            "single_worker_time": self.single_worker_time,
            "state_kind": self.state_kind,
            "num_states": self.num_states,
            "coarsened": self.coarsened,
            "chain": self.chain,
            "options": dict(self.options),
            "stages": [s.to_dict() for s in self.stages],
            "ranks": [list(s.ranks) for s in self.stages],
        }
        if self.chain:
            d["layers"] = [list(s.layers) for s in self.stages if s.layers is not None]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`.

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
        where = "plan"
        stages = _field(d, "stages", _list_of(lambda s: s), where)
        return cls(
            stages=[Stage.from_dict(s, f"plan stage {i}") for i, s in enumerate(stages)],
            time_per_stage=_field(d, "time_per_stage", _as_float, where),
            data_parallel_time=_field(d, "data_parallel_time", _as_float, where),
            speedup_over_dp=_field(d, "speedup_over_dp", _as_float, where),
            single_worker_time=_field(d, "single_worker_time", _as_float, where),
            num_workers=_field(d, "num_workers", _as_int, where),
            used_workers=_field(d, "used_workers", _as_int, where),
            cost_model=_field(d, "cost_model", _as_str, where),
            topology=Topology.from_dict(_field(d, "topology", _as_dict, where), "plan topology"),
            state_kind=_field(d, "state_kind", _as_str, where, "antichain"),
            num_states=_field(d, "num_states", _as_int, where, 0),
            coarsened=_field(d, "coarsened", _as_bool, where, False),
            chain=_field(d, "chain", _as_bool, where, False),
            options=_field(d, "options", _as_dict, where, {}),
        )

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
        """A human-readable table of the stages and the predicted speedup."""
        topo = "x".join(str(w) for w in self.topology.workers)
        lines = [
            f"{len(self.stages)} stage(s) on {self.used_workers}/{self.num_workers} workers "
            f"(levels {topo}), cost model {self.cost_model}, "
            f"{self.num_states} {self.state_kind} states{' (coarsened)' if self.coarsened else ''}",
            f"{'stage':>5}  {'layers' if self.chain else 'nodes':>12}  {'replicas':>8}  "
            f"{'ranks':<16}  {'time (ms)':>10}  {'memory/worker (MB)':>18}",
        ]
        for i, s in enumerate(self.stages):
            where = f"[{s.layers[0]}, {s.layers[1]})" if s.layers is not None else str(len(s.nodes))
            ranks = _rank_ranges(s.ranks)
            lines.append(
                f"{i:>5}  {where:>12}  {s.replicas:>8}  {ranks:<16}  {s.time * 1e3:>10.3f}  "
                f"{s.memory_bytes / 1e6:>18.1f}"
            )
        lines.append(
            f"time per stage: {self.time_per_stage * 1e3:.3f} ms; data parallel: "
            f"{self.data_parallel_time * 1e3:.3f} ms; speedup over data parallelism: "
            f"{self.speedup_over_dp:.3f}x"
        )
        return "\n".join(lines)


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


def plan(
    profile: ProfileLike,
    workers: Union[int, Sequence[int]],
    bandwidth: Union[float, Sequence[float]],
    memory: Optional[float] = None,
    straight: bool = False,
    fewer_workers: bool = False,
    cost_model: str = "default",
    activation_compression_ratio: Optional[float] = None,
    two_bw: bool = False,
    max_antichain_states: int = 4096,
    work_budget: float = 1.5e8,
) -> Plan:
    """Partitions a profiled model over a cluster.

    Args:
        profile: a ``graph.txt`` path or a :class:`ProfileGraph`.
        workers: workers per level, innermost first (an int for one level).
        bandwidth: bytes/s per level, innermost first.
        memory: bytes per worker; ``None`` or 0 for no limit.
        straight: one worker per stage (no replication).
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
    topo = Topology(tuple(workers), tuple(bandwidth), float(memory or 0.0))
    if cost_model not in ("pipedream", "default"):
        raise ValueError(f"unknown cost model {cost_model!r}; use 'pipedream' or 'default'")
    if activation_compression_ratio is not None and not activation_compression_ratio > 0:
        raise ValueError(
            f"activation compression ratio {activation_compression_ratio} must be > 0 (or None)"
        )
    graph = profile if isinstance(profile, _C.ProfileGraph) else load_profile(profile)
    raw = _C.plan_graph(
        graph,
        list(topo.workers),
        list(topo.bandwidth),
        memory=topo.memory,
        straight=straight,
        fewer_workers=fewer_workers,
        cost_model=cost_model,
        compression=float(activation_compression_ratio or 0.0),
        two_bw=two_bw,
        max_antichain_states=max_antichain_states,
        work_budget=work_budget,
    )
    log.debug("planned over %d %s states", raw["num_states"], raw["state_kind"])
    stages = [
        Stage(
            nodes=list(s["nodes"]),
            replicas=int(s["replicas"]),
            ranks=list(s["ranks"]),
            time=float(s["time"]),
            compute_seconds=float(s["compute_seconds"]),
            parameter_bytes=float(s["parameter_bytes"]),
            activation_bytes=float(s["activation_bytes"]),
            memory_bytes=float(s["memory_bytes"]),
            layers=tuple(s["layers"]) if s["layers"] is not None else None,  # type: ignore[arg-type]
        )
        for s in raw["stages"]
    ]
    return Plan(
        stages=stages,
        time_per_stage=float(raw["time_per_stage"]),
        data_parallel_time=float(raw["data_parallel_time"]),
        speedup_over_dp=float(raw["speedup_over_dp"]),
        single_worker_time=float(raw["single_worker_time"]),
        num_workers=int(raw["num_workers"]),
        used_workers=int(raw["used_workers"]),
        cost_model=str(raw["cost_model"]),
        topology=topo,
        state_kind=str(raw["state_kind"]),
        num_states=int(raw["num_states"]),
        coarsened=bool(raw["coarsened"]),
        chain=bool(raw["chain"]),
        options={
            "straight": straight,
            "fewer_workers": fewer_workers,
            "activation_compression_ratio": activation_compression_ratio,
            "two_bw": two_bw,
        },
    )
