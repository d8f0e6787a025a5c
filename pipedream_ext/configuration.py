"""Choosing the whole configuration of a run, and predicting what it will cost.

Schedule, chunks, microbatches, balance, recomputation per stage and the mesh
``(pp, dp, tp)`` are scored by one cost model (``csrc/core/configure.h``): the
simulated makespan of the schedule with per-layer costs, measured transfer and
collective costs, per-action and per-step overheads, cores shared by ranks, and
the memory of every rank. :func:`search` returns the best configuration under
that model (the same one an exhaustive enumeration finds) with its runners-up;
:func:`predict` scores one configuration. docs/planner.md, "Choosing the whole
configuration", explains the terms.

Example:
    >>> from pipedream_ext.configuration import LayerCost, MachineCosts, search
    >>> layers = [LayerCost(forward_per_sample=1e-3, backward_per_sample=2e-3,
    ...                     stash_bytes_per_sample=1e6)] * 4
    >>> best = search(layers, MachineCosts(), world_size=2, batch_size=8,
    ...               schedules=["gpipe", "1f1b"], microbatches=[2, 4, 8], memory=8e6)
    >>> best.schedule, best.microbatches, best.balance  # GPipe keeps 8 stashes, 1F1B 2
    ('1f1b', 8, [2, 2])
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ._extension import _C

__all__ = ["ACTION_TERMS", "Configuration", "LayerCost", "MachineCosts", "Prediction", "flush_schedules",
           "measured_breakdown", "microbatch_candidates", "predict", "search"]

RecomputeSpec = Union[str, Sequence[bool]]


def _strict_fields(cls: type, d: Any, where: str) -> Dict[str, Any]:
    """``d``'s keys checked against ``cls``'s fields (a ValueError names an unknown one)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a dict (got {type(d).__name__})")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    return dict(d)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer of the chain stages are cut from: affine compute costs in the
    microbatch's samples ``b`` (``fixed + per_sample * b`` seconds) and its bytes.

    ``output_bytes_per_sample`` is what a cut after this layer sends;
    ``stash_bytes_per_sample`` what its backward keeps (autograd's saved tensors);
    ``input_bytes_per_sample`` what recomputation keeps instead; ``weight_share`` the
    part of the backward that is the weight gradient (split-backward schedules);
    ``parameter_tensors`` how many tensors its parameters are (the optimizer pays per
    tensor) and ``largest_parameter_bytes`` the largest one (Adam's step and a fresh
    gradient are transients of that size); ``optimizer_seconds`` the optimizer's step
    over its parameters, measured (``measure_layer_costs`` times Adam's; 0: the
    machine's per-byte and per-tensor estimate alone). ``tp_collectives`` and
    ``tp_collective_bytes_per_sample``: the all-reduces a ``tensor_parallel=`` plan adds to
    one microbatch's forward and backward of this layer at ``tp > 1`` and the bytes per
    sample they reduce (0: the plan leaves the layer whole). ``expert_parameter_bytes``:
    the part of ``parameter_bytes`` an ``expert_parallel=`` plan shards over ep (each ep
    rank holds ``1 / ep``; its gradients reduce over the copies holding the same experts),
    ``all_to_all_calls`` the exchanges the plan adds per microbatch (forward and backward)
    and ``all_to_all_bytes_per_sample`` the routed rows' bytes per sample of each of the 4
    that move rows (``_parallel.ep_costs``).
    """

    forward_fixed: float = 0.0
    forward_per_sample: float = 0.0
    backward_fixed: float = 0.0
    backward_per_sample: float = 0.0
    weight_share: float = 0.5
    output_bytes_per_sample: float = 0.0
    stash_bytes_per_sample: float = 0.0
    input_bytes_per_sample: float = 0.0
    parameter_bytes: float = 0.0
    parameter_tensors: float = 0.0
    largest_parameter_bytes: float = 0.0
    optimizer_seconds: float = 0.0
    tp_collectives: float = 0.0
    tp_collective_bytes_per_sample: float = 0.0
    expert_parameter_bytes: float = 0.0
    all_to_all_calls: float = 0.0
    all_to_all_bytes_per_sample: float = 0.0

    def to_dict(self) -> Dict[str, float]:
        """Returns the fields by name (the binding's layer dict; JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "LayerCost":
        """Reads :meth:`to_dict`'s form back.

        Raises:
            ValueError: an unknown key.
        """
        return cls(**{k: float(v) for k, v in _strict_fields(cls, d, "layer cost").items()})


@dataclasses.dataclass(frozen=True)
class MachineCosts:
    """What the machine adds to the layers' compute (measured at start-up by
    ``_planning.calibration``): per-action, per-send (and per byte sent) and per-step
    overheads, point-to-point and all-reduce latency and bandwidth, the optimizer's
    seconds per parameter byte and per parameter tensor (added to the layers' measured
    ``optimizer_seconds``), and the cores the ranks of one node share (0: one core per
    rank); ``fsdp_call_seconds``: one FSDP collective call of one unit in a step (its
    all-gather or reduce-scatter with the hooks and copies around it) and
    ``replicate_call_seconds`` one replicated stage's gradient all-reduce in a step, also
    the price of a tensor-parallel collective call (0: an all-reduce's latency)."""

    action_seconds: float = 0.0
    send_seconds: float = 0.0
    send_seconds_per_byte: float = 0.0
    step_seconds: float = 0.0
    latency_seconds: float = 0.0
    bandwidth: float = 1e10
    all_reduce_latency_seconds: float = 0.0
    all_reduce_bandwidth: float = 1e10
    optimizer_seconds_per_byte: float = 0.0
    optimizer_seconds_per_tensor: float = 0.0
    cores: int = 0
    ranks_per_node: int = 0
    fsdp_call_seconds: float = 0.0
    replicate_call_seconds: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        """Returns the fields by name (the binding's machine dict; JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "MachineCosts":
        """Reads :meth:`to_dict`'s form back.

        Raises:
            ValueError: an unknown key.
        """
        fields = _strict_fields(cls, d, "machine costs")
        return cls(**{k: int(v) if k in ("cores", "ranks_per_node") else float(v)
                      for k, v in fields.items()})


#: The runtime's span kinds (``pipe.stats()["seconds_by_kind"]``: the executor's actions,
#: csrc/core/action.cpp, its SEND_WAIT, and the tied weights' all-reduce outside it, where
#: the first rank to finish waits for the last) by term of :meth:`Prediction.breakdown`;
#: the rest of a step is overhead.
ACTION_TERMS: Dict[str, Tuple[str, ...]] = {
    "compute": ("F", "B", "I", "W"), "waits": ("RECV_F", "RECV_B", "SEND_WAIT", "TIED_ALLREDUCE"),
    "transfers": ("SEND_F", "SEND_B", "RECV_POST"), "all-reduce": ("ALLREDUCE",)}


def measured_breakdown(seconds_by_kind: Dict[str, float], steps: int,
                       step_seconds: float) -> Dict[str, float]:
    """Where a rank's measured steps went, in the terms of :meth:`Prediction.breakdown`.

    Args:
        seconds_by_kind: seconds per span kind over the measured steps (``pipe.stats()``).
        steps: how many steps they cover.
        step_seconds: the measured step time; ``overhead`` is what the other terms leave
            of it (never below zero).

    Returns:
        ``{"compute", "waits", "transfers", "all-reduce", "overhead"}``, seconds per step.

    Raises:
        ValueError: ``steps`` below 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (got {steps})")
    terms = {term: sum(seconds_by_kind.get(k, 0.0) for k in kinds) / steps
             for term, kinds in ACTION_TERMS.items()}
    terms["overhead"] = max(0.0, step_seconds - sum(terms.values()))
    return terms


@dataclasses.dataclass
class Prediction:
    """What one configuration will cost per step. Per-rank lists have one entry per rank
    of a pipeline (every data- or tensor-parallel copy predicts the same)."""

    step_seconds: float
    pipeline_seconds: float
    overhead_seconds: float
    all_reduce_seconds: float
    compute_seconds: List[float]
    wait_seconds: List[float]
    transfer_seconds: List[float]
    peak_bytes: List[float]
    bubble_fraction: float
    fits: bool

    def breakdown(self, rank: int) -> Dict[str, float]:
        """Where ``rank``'s step goes, in seconds (they sum to :attr:`step_seconds`).

        Args:
            rank: a rank of the pipeline, ``0 <= rank < len(peak_bytes)``.

        Returns:
            ``{"compute", "waits", "transfers", "all-reduce", "overhead"}``.

        Raises:
            ValueError: ``rank`` out of range.
        """
        if not 0 <= rank < len(self.compute_seconds):
            raise ValueError(f"rank {rank} is not a rank of this pipeline "
                             f"(0..{len(self.compute_seconds) - 1})")
        return {"compute": self.compute_seconds[rank], "waits": self.wait_seconds[rank],
                "transfers": self.transfer_seconds[rank],
                "all-reduce": self.all_reduce_seconds, "overhead": self.overhead_seconds}

    def to_dict(self) -> Dict[str, Any]:
        """Returns the fields by name (JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Prediction":
        """Reads :meth:`to_dict`'s form (or the binding's) back.

        Raises:
            ValueError: an unknown or missing key.
        """
        fields = _strict_fields(cls, d, "prediction")
        missing = sorted({f.name for f in dataclasses.fields(cls)} - set(fields))
        if missing:
            raise ValueError(f"prediction: missing key(s) {missing}")
        return cls(**{k: ([float(x) for x in v] if isinstance(v, (list, tuple)) else
                          bool(v) if k == "fits" else float(v)) for k, v in fields.items()})


@dataclasses.dataclass
class Configuration:
    """One whole configuration: what the planner chose (or the user fixed) and what it
    predicts. ``recompute`` has one flag per stage, ``balance`` the layers per stage
    (``pp * chunks`` stages), ``mesh`` is ``(pp, dp, tp)``, ``ep`` how many of the dp
    copies share each stage's experts (``expert_parallel=``; 1: none); ``data_parallel`` how dp
    holds the stages (``"fsdp"`` or ``"replicate"``; ``None`` with ``dp = 1`` or in a plan
    file written before it was recorded); ``candidates`` are the runners-up of a search,
    best first, each with its prediction."""

    schedule: str
    microbatches: int
    balance: List[int]
    chunks: int = 1
    replicas: List[int] = dataclasses.field(default_factory=list)
    recompute: List[bool] = dataclasses.field(default_factory=list)
    mesh: Tuple[int, int, int] = (1, 1, 1)
    prediction: Optional[Prediction] = None
    candidates: List["Configuration"] = dataclasses.field(default_factory=list)
    data_parallel: Optional[str] = None
    ep: int = 1

    @property
    def predicted_step_seconds(self) -> Optional[float]:
        """The predicted seconds of one step (None without a prediction)."""
        return None if self.prediction is None else self.prediction.step_seconds

    @property
    def predicted_peak_bytes(self) -> List[float]:
        """The predicted peak bytes of every rank of a pipeline (empty without a prediction)."""
        return [] if self.prediction is None else list(self.prediction.peak_bytes)

    def to_dict(self) -> Dict[str, Any]:
        """Returns a JSON-able dict (what plan files store under ``"configuration"``)."""
        return {"schedule": self.schedule, "chunks": self.chunks,
                "microbatches": self.microbatches, "balance": list(self.balance),
                "replicas": list(self.replicas), "recompute": list(self.recompute),
                "mesh": list(self.mesh), "data_parallel": self.data_parallel,
                "prediction": None if self.prediction is None else self.prediction.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates], "ep": self.ep}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Configuration":
        """Reads :meth:`to_dict`'s form back.

        Raises:
            ValueError: an unknown or missing key, a mesh that is not three counts, or a
                ``data_parallel`` other than ``"fsdp"``, ``"replicate"`` or ``None``.
        """
        fields = _strict_fields(cls, d, "configuration")
        for key in ("schedule", "microbatches", "balance"):
            if key not in fields:
                raise ValueError(f"configuration: missing key {key!r}")
        mesh = tuple(int(x) for x in fields.get("mesh", (1, 1, 1)))
        if len(mesh) != 3:
            raise ValueError(f"configuration: mesh must be (pp, dp, tp) (got {list(mesh)})")
        data_parallel = fields.get("data_parallel")
        if data_parallel not in (None, "fsdp", "replicate"):
            raise ValueError(f"configuration: data_parallel must be 'fsdp', 'replicate' or null "
                             f"(got {data_parallel!r})")
        prediction = fields.get("prediction")
        return cls(schedule=str(fields["schedule"]), microbatches=int(fields["microbatches"]),
                   balance=[int(x) for x in fields["balance"]],
                   chunks=int(fields.get("chunks", 1)),
                   replicas=[int(x) for x in fields.get("replicas", [])],
                   recompute=[bool(x) for x in fields.get("recompute", [])],
                   mesh=(mesh[0], mesh[1], mesh[2]), data_parallel=data_parallel,
                   prediction=None if prediction is None else Prediction.from_dict(prediction),
                   candidates=[cls.from_dict(c) for c in fields.get("candidates", [])],
                   ep=int(fields.get("ep", 1)))

    def table(self) -> str:
        """The best configuration and its runners-up, one line each, as a text table."""
        header = ["", "schedule", "chunks", "m", "pp x dp x tp", "balance", "recompute",
                  "step ms", "bubble", "peak MiB"]
        rows = [["best"] + _row(self)] + [[f"#{k + 2}"] + _row(c)
                                           for k, c in enumerate(self.candidates)]
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
                         for r in [header] + rows)

    def summary(self) -> str:
        """A few lines for the start-up log: the choice, the predicted step and memory."""
        pp, dp, tp = self.mesh
        recompute = [j for j, r in enumerate(self.recompute) if r]
        lines = [f"configuration: schedule {self.schedule} (chunks {self.chunks}), "
                 f"{self.microbatches} microbatches, mesh pp={pp} dp={dp} tp={tp}"
                 + (f" (ep={self.ep} of the dp copies share their experts)" if self.ep > 1 else "")
                 + (f" ({self.data_parallel})" if self.data_parallel else ""),
                 f"  balance {self.balance}, recompute stages {recompute or 'none'}"]
        if self.prediction is not None:
            p = self.prediction
            lines.append(f"  predicted step {p.step_seconds * 1e3:.3f} ms (pipeline "
                         f"{p.pipeline_seconds * 1e3:.3f}, bubble {p.bubble_fraction:.2f}, "
                         f"all-reduce {p.all_reduce_seconds * 1e3:.3f}, overhead "
                         f"{p.overhead_seconds * 1e3:.3f}); peak MiB per rank "
                         f"{[round(b / 2**20, 1) for b in p.peak_bytes]}")
        if self.candidates and self.candidates[0].prediction is not None:
            lines.append(f"  runner-up: {self.candidates[0].schedule}, "
                         f"{self.candidates[0].microbatches} microbatches, predicted "
                         f"{self.candidates[0].prediction.step_seconds * 1e3:.3f} ms")
        return "\n".join(lines)


def _binding_dict(config: Configuration) -> Dict[str, Any]:
    """``config`` as the binding's configuration dict."""
    pp, dp, tp = config.mesh
    return {"schedule": config.schedule, "chunks": config.chunks,
            "microbatches": config.microbatches, "pp": pp, "dp": dp, "tp": tp, "ep": config.ep,
            "balance": list(config.balance), "replicas": list(config.replicas),
            "recompute": [int(bool(r)) for r in config.recompute]}


def _from_binding(d: Dict[str, Any]) -> Configuration:
    """The binding's configuration dict (with its prediction) as a Configuration."""
    return Configuration(schedule=d["schedule"], microbatches=int(d["microbatches"]),
                         balance=[int(x) for x in d["balance"]], chunks=int(d["chunks"]),
                         replicas=[int(x) for x in d["replicas"]],
                         recompute=[bool(x) for x in d["recompute"]],
                         mesh=(int(d["pp"]), int(d["dp"]), int(d["tp"])), ep=int(d.get("ep", 1)),
                         prediction=Prediction.from_dict(d["prediction"]))


def _row(config: Configuration) -> List[str]:
    """One line of :meth:`Configuration.table`."""
    p = config.prediction
    recompute = "".join("1" if r else "0" for r in config.recompute) or "-"
    return [config.schedule, str(config.chunks), str(config.microbatches),
            "x".join(str(x) for x in config.mesh) + (f" ep{config.ep}" if config.ep > 1 else "") +
            (f" {config.data_parallel}" if config.data_parallel else ""), ",".join(str(x) for x in config.balance),
            recompute,
            "-" if p is None else f"{p.step_seconds * 1e3:.3f}",
            "-" if p is None else f"{p.bubble_fraction:.2f}",
            "-" if p is None else f"{max(p.peak_bytes, default=0.0) / 2**20:.1f}"]


def _memory_bytes(memory: Optional[float]) -> float:
    if memory is None:
        return 0.0
    if not (isinstance(memory, (int, float)) and math.isfinite(memory) and memory > 0):
        raise ValueError(f"memory must be a positive number of bytes per rank or None "
                         f"(got {memory!r})")
    return float(memory)


def predict(layers: Sequence[LayerCost], machine: MachineCosts, config: Configuration,
            batch_size: int, memory: Optional[float] = None,
            optimizer_state_factor: float = 2.0, fsdp: bool = False) -> Prediction:
    """Predicts one configuration's step time and memory per rank.

    Args:
        layers: the chain's per-layer costs.
        machine: the machine's costs.
        config: schedule, chunks, microbatches, mesh, balance (layers per stage),
            replicas (PipeDream replicas per stage, or empty) and recompute (per stage,
            or empty: none); its ``prediction`` is ignored.
        batch_size: samples per step of one pipeline.
        memory: bytes per rank (sets ``fits``), or None: unlimited.
        optimizer_state_factor: optimizer state bytes per weight byte (Adam: 2).
        fsdp: data parallelism shards weights, gradients and optimizer state.

    Returns:
        The :class:`Prediction`.

    Raises:
        ValueError: a bad value (named): unknown schedule, balance not summing to the
            layers, microbatches above the batch, a schedule refusing the point, ...
    """
    raw = _C.predict_configuration([layer.to_dict() for layer in layers], int(batch_size),
                                   machine.to_dict(), _binding_dict(config),
                                   _memory_bytes(memory), float(optimizer_state_factor),
                                   bool(fsdp))
    return Prediction.from_dict(raw)


def _recompute_space(recompute: RecomputeSpec) -> Dict[str, Any]:
    if isinstance(recompute, str):
        if recompute not in ("never", "always", "search"):
            raise ValueError(f"recompute must be 'never', 'always', 'search' or a list of "
                             f"bools per stage (got {recompute!r})")
        return {"recompute": recompute}
    return {"recompute": "never", "recompute_stages": [int(bool(r)) for r in recompute]}


def _space(world_size: int, batch_size: int, schedules: Sequence[str],
           microbatches: Sequence[int], meshes: Optional[Sequence[Sequence[int]]],
           balance: Optional[Sequence[int]], recompute: RecomputeSpec, memory: Optional[float],
           interleaved_chunks: Sequence[int], optimizer_state_factor: float, fsdp: bool,
           candidates: int, ep: int = 1) -> Dict[str, Any]:
    space = {"world_size": int(world_size), "batch_size": int(batch_size),
             "schedules": list(schedules), "microbatches": [int(m) for m in microbatches],
             "meshes": [[int(x) for x in mesh] for mesh in (meshes or [])],
             "balance": [int(x) for x in (balance or [])],
             "memory_bytes": _memory_bytes(memory),
             "interleaved_chunks": [int(v) for v in interleaved_chunks],
             "optimizer_state_factor": float(optimizer_state_factor), "fsdp": bool(fsdp),
             "candidates": int(candidates), "ep": int(ep)}
    for mesh in space["meshes"]:
        if len(mesh) != 3:
            raise ValueError(f"meshes: each mesh is (pp, dp, tp) (got {mesh})")
    space.update(_recompute_space(recompute))
    return space


def search(layers: Sequence[LayerCost], machine: MachineCosts, *, world_size: int,
           batch_size: int, schedules: Sequence[str], microbatches: Sequence[int],
           meshes: Optional[Sequence[Sequence[int]]] = None,
           balance: Optional[Sequence[int]] = None, recompute: RecomputeSpec = "never",
           memory: Optional[float] = None, interleaved_chunks: Sequence[int] = (2,),
           optimizer_state_factor: float = 2.0, fsdp: bool = False,
           candidates: int = 5, ep: int = 1) -> Configuration:
    """The best configuration of the space under the cost model (exactly what scoring
    every point would find), with its runners-up.

    Args:
        layers: the chain's per-layer costs.
        machine: the machine's costs.
        world_size: ranks in all.
        batch_size: samples per step of one pipeline.
        schedules: candidate schedules (ties go to the earlier one).
        microbatches: candidate microbatch counts, each <= ``batch_size``.
        meshes: candidate ``(pp, dp, tp)`` with ``pp * dp * tp == world_size``; None:
            ``(world_size, 1, 1)``.
        balance: fixed layers per stage, or None: searched.
        recompute: ``"never"``, ``"always"``, ``"search"`` (per stage; per rank for
            multi-chunk schedules) or a fixed flag per stage.
        memory: bytes per rank, or None: unlimited.
        interleaved_chunks: chunk counts tried for interleaved schedules.
        optimizer_state_factor: optimizer state bytes per weight byte (Adam: 2).
        fsdp: data parallelism shards weights, gradients and optimizer state.
        candidates: runners-up to keep (the best of other schedule/microbatch/mesh points).
        ep: of each mesh's dp copies, how many share each stage's experts
            (``expert_parallel=``; it must divide dp, with tp 1).

    Returns:
        The best :class:`Configuration`, its prediction filled, with ``candidates``.

    Raises:
        ValueError: an invalid space (named), or no configuration fits ``memory``
            (the message names the limit and the smallest peak found).
    """
    space = _space(world_size, batch_size, schedules, microbatches, meshes, balance, recompute,
                   memory, interleaved_chunks, optimizer_state_factor, fsdp, candidates, ep)
    raw = _C.search_configurations([layer.to_dict() for layer in layers], machine.to_dict(),
                                   space)
    best = _from_binding(raw["best"])
    if not raw["feasible"]:
        peak = max(best.predicted_peak_bytes, default=0.0)
        raise ValueError(
            f"no configuration fits memory={space['memory_bytes']:.0f} bytes per rank: the "
            f"smallest peak found is {peak:.0f} bytes ({best.schedule}, {best.microbatches} "
            f"microbatches, mesh {best.mesh}, balance {best.balance}); raise memory, allow "
            "recompute='search', use more ranks or more microbatches")
    best.candidates = [_from_binding(c) for c in raw["candidates"]]
    return best


def microbatch_candidates(batch_size: int, limit: int = 12) -> List[int]:
    """Microbatch counts worth trying for a batch: powers of two, the batch itself and
    its divisors, each leaving at least one sample per microbatch.

    Args:
        batch_size: samples per step of one pipeline.
        limit: at most this many counts (powers of two and the batch come first).

    Returns:
        Ascending counts in ``1..batch_size``.

    Raises:
        ValueError: ``batch_size`` or ``limit`` below 1.
    """
    if batch_size < 1 or limit < 1:
        raise ValueError(f"batch_size and limit must be >= 1 (got {batch_size}, {limit})")
    preferred = [1 << k for k in range(batch_size.bit_length()) if 1 << k <= batch_size]
    preferred.append(batch_size)
    divisors = [d for d in range(2, batch_size) if batch_size % d == 0]
    chosen: List[int] = []
    for m in preferred + divisors:
        if m not in chosen and len(chosen) < limit:
            chosen.append(m)
    return sorted(chosen)


def flush_schedules() -> List[str]:
    """The synchronous (flush) schedules: the ones ``schedule="auto"`` chooses among."""
    return [t.name for t in _C.all_schedule_traits() if not t.asynchronous]
