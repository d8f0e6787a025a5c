"""The user-facing pipeline wrapper: ``PipeDream(module, loss_fn, schedule, ...)``.

Thin by design: it splits an ``nn.Sequential`` into stages, keeps this rank's
layers, builds the schedule (C++), and hands the rank's lowered action list to
the C++ executor, whose only call back into Python is a stage's forward.
"""
from __future__ import annotations

import atexit
import collections
import datetime
import gc
import json
import logging
import os
import time
import weakref
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from . import _C, _elastic, _faults, _signals, schedules
from .planner import Plan

__all__ = ["PipeDream", "NonFiniteError", "SYNCHRONOUS_SCHEDULES", "ASYNCHRONOUS_SCHEDULES"]

_log = logging.getLogger(__name__)

#: Flush schedules (gradients equal the unsplit model's; you step the optimizer).
SYNCHRONOUS_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
#: Asynchronous schedules (weight stashing; the runtime steps your optimizer).
ASYNCHRONOUS_SCHEDULES = ("pipedream", "pipedream-2bw")

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def _as_tuple(value: Tensors) -> Tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def even_balance(num_layers: int, num_stages: int) -> List[int]:
    """Splits ``num_layers`` into ``num_stages`` contiguous parts differing by at most one."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if j < extra else 0) for j in range(num_stages)]


def _init_default_group(device: torch.device, timeout: datetime.timedelta) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "no torch.distributed process group and no torchrun environment (RANK, WORLD_SIZE); "
            "launch with `torchrun --nproc-per-node N script.py` or call "
            "torch.distributed.init_process_group() first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    _elastic.init_process_group(backend, timeout)


# Live pipelines, to release their C++ executors (which hold the process group)
# at interpreter exit: a process group destroyed during Python's finalization,
# after its creator's module state is gone, can abort the process ("terminate
# called without an active exception").
_LIVE: "weakref.WeakSet[PipeDream]" = weakref.WeakSet()


@atexit.register
def _release_executors_at_exit() -> None:
    for pipe in list(_LIVE):
        pipe._executor = None  # noqa: SLF001
        pipe._eval_executor = None  # noqa: SLF001
    gc.collect()


def _weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a bound method for the C++ executor without keeping its object alive.

    A bound method held by a C++ ``std::function`` is a reference the cycle
    collector cannot see: the pipeline would hold its executor, the executor the
    pipeline, and neither would ever be freed (nor the process group).
    """
    ref = weakref.WeakMethod(method)
    name = method.__name__

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise RuntimeError(f"PipeDream.{name} called after its pipeline was freed")
        return bound(*args)

    return call


class NonFiniteError(RuntimeError):
    """NaN or inf appeared in a stage's output or gradients (``check_finite="raise"``)."""


def _gather_bytes(payload: bytes, group: dist.ProcessGroup, world: int,
                  rank: int) -> Optional[List[bytes]]:
    """Gathers one byte string per rank on rank 0 of ``group`` (uint8 tensors, no pickle)."""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    size = int(max(l.item() for l in lengths))
    buffer = torch.zeros(size, dtype=torch.uint8)
    buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload \
        else buffer[:0]
    gathered = [torch.zeros(size, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
    dist.gather(buffer, gathered, dst=dist.get_global_rank(group, 0), group=group)
    if gathered is None:
        return None
    return [g[:int(l.item())].numpy().tobytes() for g, l in zip(gathered, lengths)]


class PipeDream:
    """Pipeline-parallel training of an ``nn.Sequential`` over the ranks of a process group.

    Example (under ``torchrun --nproc-per-node 4``)::

        pipe = PipeDream(model, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in loader:
            loss = pipe.step(x, y)
            opt.step(); opt.zero_grad()

    Args:
        module: the whole model, identically initialised on every rank.
        loss_fn: ``loss_fn(output, target)`` with mean reduction over the batch.
        schedule: one of :data:`SYNCHRONOUS_SCHEDULES` or :data:`ASYNCHRONOUS_SCHEDULES`.
            With ``pipedream`` every ``step`` is one minibatch and one weight update
            per stage (weight stashing); with ``pipedream-2bw`` one batch of
            ``microbatches`` and one update (at most 2 weight versions). Both take
            the optimizer in ``step(x, y, optimizer=opt)`` and need ``flush()``.
        microbatches: microbatches per ``step`` (the batch is split on dim 0).
        balance: layers per stage (``None``: an even split); ``"auto"`` to profile
            the model on rank 0 with ``sample`` and plan stages and replicas for this
            world with the planner; or a saved plan (a ``plan.json`` path or a
            :class:`~pipedream_ext.Plan`). Stages are ordered as in the module; stage
            ``j`` runs on rank ``j`` (``j mod world`` for interleaved schedules), or on
            consecutive ranks when replicated.
        chunks: model chunks per rank (``interleaved-1f1b``).
        process_group: the group to run on (default: the default group, which is
            created from the torchrun environment if needed: Gloo on CPU, NCCL on GPU).
        device: where this rank's layers live (default: ``cuda:LOCAL_RANK`` if CUDA
            is available, else CPU).
        timeout: seconds any wait on another rank may take before failing.
        vertical_sync: ``pipedream`` only: every stage uses, for a minibatch, the
            weight version stage 0 used.
        replicas: replica count per stage, e.g. ``[2, 1, 1]`` on 4 ranks (hybrid
            pipeline and data parallelism; gpipe, 1f1b, pipedream, pipedream-2bw).
            Stage j runs on ``replicas[j]`` consecutive ranks; microbatch i runs on
            replica ``i mod replicas[j]``; replicas all-reduce gradients before each
            update (summed for flush schedules and 2bw, where they are parts of one
            batch; averaged for ``pipedream``, where each replica ran its own minibatch).
        sample: ``(inputs, targets)`` of one batch, for ``balance="auto"``.
        bandwidth: bytes/s per topology level (within a node, then between
            nodes) for ``balance="auto"``; measured with a short probe if omitted.
        recompute: keep only each stage's inputs during the forward and recompute
            its activations in the backward (same result, with the CPU RNG state
            restored so dropout draws the same masks).
        trace: record every action each rank runs (F/B/I/W, waits on receives,
            sends, updates, all-reduces) and write them, merged by rank 0, as one
            Chrome trace at this path (open it in Perfetto) when :meth:`write_trace`
            or :meth:`close` is called. Default: the ``PIPEDREAM_TRACE``
            environment variable, if set.
        autocast: run every stage's forward (and the loss) under
            ``torch.autocast(device_type, dtype=autocast)``, e.g. ``torch.bfloat16``;
            boundary tensors then travel in that dtype (half the bytes). With
            ``torch.float16`` on a flush schedule, scale the loss with
            :meth:`grad_scaler` (all ranks skip an overflowing step together).
        check_finite: ``"raise"`` or ``"skip"``: after every step, find the first
            stage whose forward output (or, in the backward, the last stage whose
            gradients) holds NaN or inf and report it with the step number;
            ``"raise"`` raises :class:`NonFiniteError` on every rank, ``"skip"``
            (flush schedules) logs a warning, sets this step's gradients to ``None``
            so ``optimizer.step()`` leaves the weights alone, and returns ``nan``.
            Costs one ``isfinite`` per stage output and one small all-reduce per
            step. Asynchronous schedules support ``"raise"`` only (the rank that
            finds it raises; the others fail naming it).

    Raises:
        ValueError: bad schedule, balance, chunks or world size (the message names
            the value and the fix).
        RuntimeError: no process group and no torchrun environment.
    """

    def __init__(self, module: nn.Sequential, loss_fn: Callable[..., torch.Tensor],
                 schedule: str = "1f1b", microbatches: int = 4,
                 balance: Optional[Sequence[int]] = None, chunks: int = 1,
                 process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[str, torch.device]] = None,
                 timeout: float = 300.0, vertical_sync: bool = False,
                 recompute: bool = False, replicas: Optional[Sequence[int]] = None,
                 sample: Optional[Tuple[Tensors, Any]] = None,
                 bandwidth: Optional[Sequence[float]] = None,
                 trace: Optional[Union[str, os.PathLike]] = None,
                 autocast: Optional[torch.dtype] = None,
                 check_finite: Optional[str] = None) -> None:
        if not isinstance(module, nn.Sequential):
            raise ValueError(f"module must be an nn.Sequential (got {type(module).__name__}); "
                             "wrap your layers in torch.nn.Sequential")
        if schedule not in SYNCHRONOUS_SCHEDULES + ASYNCHRONOUS_SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not supported by the runtime; choose one of "
                             f"{', '.join(SYNCHRONOUS_SCHEDULES + ASYNCHRONOUS_SCHEDULES)}")
        if vertical_sync and schedule != "pipedream":
            raise ValueError(f"vertical_sync=True needs schedule='pipedream' (got {schedule!r})")
        self.asynchronous = schedule in ASYNCHRONOUS_SCHEDULES
        if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast={autocast!r} is not a reduced-precision dtype; use "
                             "torch.bfloat16 or torch.float16 (or None for full precision)")
        if autocast == torch.float16 and self.asynchronous:
            raise ValueError(f"autocast=torch.float16 needs loss scaling, which schedule "
                             f"{schedule!r} does not support; use autocast=torch.bfloat16")
        if check_finite not in (None, "raise", "skip"):
            raise ValueError(f"check_finite={check_finite!r}; use None, 'raise' or 'skip'")
        if check_finite == "skip" and self.asynchronous:
            raise ValueError(f"check_finite='skip' needs a flush schedule (got {schedule!r}); "
                             "use check_finite='raise'")
        #: Compute dtype of autocast (None: full precision).
        self.autocast: Optional[torch.dtype] = autocast
        self.check_finite = check_finite
        self._grad_scaler: Optional[Any] = None
        self._nonfinite_forward: Optional[int] = None  # first stage with a non-finite output
        self._step_count = 0  # steps run (flush) or admitted (async), for messages
        self.vertical_sync = bool(vertical_sync)
        self.recompute = bool(recompute)
        if chunks != 1 and schedule != "interleaved-1f1b":
            raise ValueError(f"chunks={chunks} needs schedule='interleaved-1f1b' (got {schedule!r})")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer (got {microbatches!r})")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds (got {timeout})")
        if device is None:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        _init_default_group(self.device, datetime.timedelta(seconds=timeout))
        _signals.install()  # SIGTERM / Ctrl-C: clean exit on every rank, with a deadline
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.timeout = float(timeout)

        num_layers = len(module)
        #: The plan the stages come from (balance="auto" or a saved plan), else None.
        self.plan: Optional[Plan] = None
        if isinstance(balance, Plan) or isinstance(balance, (str, os.PathLike)):
            if chunks != 1 or replicas is not None:
                raise ValueError("a plan sets balance and replicas itself; drop chunks/replicas")
            if isinstance(balance, Plan):
                self.plan = balance
            elif str(balance) == "auto":
                self.plan = self._auto_plan(module, loss_fn, sample, bandwidth, schedule)
            else:
                self.plan = Plan.load(balance)
            balance, replicas = self._stages_from_plan(self.plan, num_layers)
            if self.rank == 0:
                _log.info("pipeline plan (%s cost model, predicted %.2fx over data parallelism):\n%s",
                          self.plan.cost_model, self.plan.speedup_over_dp, self.plan.table())
            if all(r == 1 for r in replicas):
                replicas = None
        num_stages = self.world_size * chunks
        self.replicas = [1] * num_stages
        if replicas is not None:
            replicas = [int(r) for r in replicas]
            if chunks != 1:
                raise ValueError("replicas cannot be combined with chunks > 1 (interleaved stages)")
            if any(r < 1 for r in replicas):
                raise ValueError(f"replicas {replicas} has a count below 1; every stage needs >= 1")
            if sum(replicas) != self.world_size:
                raise ValueError(f"replicas {replicas} need {sum(replicas)} ranks but the world has "
                                 f"{self.world_size}; launch {sum(replicas)} ranks or change replicas")
            num_stages = len(replicas)
            self.replicas = replicas
        if balance is None:
            if num_layers < num_stages:
                raise ValueError(
                    f"the model has {num_layers} layers but {num_stages} stages are needed "
                    f"({self.world_size} ranks x {chunks} chunks); use fewer ranks or chunks")
            balance = even_balance(num_layers, num_stages)
        balance = [int(b) for b in balance]
        if len(balance) != num_stages:
            fix = (f"launch {len(balance) // chunks} ranks" if len(balance) % chunks == 0
                   else f"give a multiple of chunks={chunks} counts")
            raise ValueError(
                f"balance lists {len(balance)} stages but the world has {self.world_size} ranks "
                f"x {chunks} chunks = {num_stages} stages; give one layer count per stage or {fix}")
        if any(b < 1 for b in balance):
            raise ValueError(f"balance {balance} has a stage with no layers; every stage needs >= 1")
        if sum(balance) != num_layers:
            raise ValueError(f"balance {balance} sums to {sum(balance)} but the model has "
                             f"{num_layers} layers; make the counts add up to {num_layers}")
        self.balance = balance
        self._check_same_config_everywhere(num_layers)

        if self.asynchronous:
            # Steps are served one at a time in constant memory (csrc/core/stream.h).
            self._stream = _C.AsyncStream(schedule, stages=num_stages,
                                          microbatches=microbatches if schedule == "pipedream-2bw" else 1,
                                          replicas=self.replicas, vertical_sync=self.vertical_sync)
            self._schedule = schedules.Schedule(_C.strip_communication(self._stream.base),
                                                self._stream.base)
        else:
            self._schedule = schedules.build(schedule, stages=self.world_size if chunks > 1 else num_stages,
                                             microbatches=microbatches, chunks=chunks,
                                             replicas=self.replicas if replicas is not None else None)
        self.num_stages = self._schedule.num_stages
        self.local_stages = self._schedule.stages_of_rank(self.rank)
        bounds = [0]
        for b in balance:
            bounds.append(bounds[-1] + b)
        children = list(module.named_children())
        # Each local stage keeps the original child names, so parameter names
        # ("3.weight") match the unsplit model's.
        self._stages: Dict[int, nn.Sequential] = {}
        for j in self.local_stages:
            layers = collections.OrderedDict(children[bounds[j]:bounds[j + 1]])
            self._stages[j] = nn.Sequential(layers).to(self.device)
        self.stage_layers = {j: (bounds[j], bounds[j + 1]) for j in self.local_stages}
        merged = collections.OrderedDict()
        for j in self.local_stages:
            merged.update(self._stages[j].named_children())
        #: This rank's layers as one module, named as in the original model.
        self.module: nn.Module = self._stages[self.local_stages[0]] if len(self.local_stages) == 1 \
            else nn.Sequential(merged)
        self.stage_index = self.local_stages[0]
        self._targets: List[Any] = []
        self._scales: List[float] = []
        self._forward_only = False
        stage_parameters = {j: [p for p in self._stages[j].parameters()] for j in self.local_stages}
        self._param_names = {j: [n for n, _ in self._stages[j].named_parameters()]
                             for j in self.local_stages}
        self._stage_parameters = stage_parameters
        # One process group per replicated stage, and one of the stage leaders
        # (replica 0) for evaluation. Every rank creates every group, in order.
        self._replica_groups: Dict[int, dist.ProcessGroup] = {}
        self._leaders = [self._schedule.stage_ranks(j)[0] for j in range(self.num_stages)]
        self._leader_group = self.group
        if any(r > 1 for r in self.replicas):
            for j in range(self.num_stages):
                ranks = self._schedule.stage_ranks(j)
                if len(ranks) > 1:
                    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
                    if self.rank in ranks:
                        self._replica_groups[j] = group
            self._leader_group = dist.new_group(self._leaders, timeout=datetime.timedelta(seconds=timeout))
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._steps = 0  # minibatches (2bw: batches) admitted since the last flush
        self._pending_targets: Dict[int, Any] = {}
        if trace is None:
            trace = os.environ.get("PIPEDREAM_TRACE") or None
        #: Where :meth:`write_trace` writes the merged Chrome trace (None: not tracing).
        self.trace_path: Optional[str] = os.fspath(trace) if trace is not None else None
        self._trace_events: List[Tuple[str, str, int, int]] = []
        # Stats of executors already replaced (async flush starts a new stream).
        self._retired_stats = _C.RuntimeStats()
        self._executor = self._make_executor(self._schedule)
        self._eval_executor: Optional["_C.PipelineExecutor"] = None
        _LIVE.add(self)
        self.peak_weight_versions: Dict[int, int] = {}
        _log.info("rank %d: stages %s (layers %s) of %d, schedule %s, %d microbatches",
                  self.rank, self.local_stages, [self.stage_layers[j] for j in self.local_stages],
                  self.num_stages, schedule, microbatches)

    # -- planning at start-up ---------------------------------------------------------
    def _measure_bandwidth(self, a: int, b: int, size: int = 4 << 20, rounds: int = 3) -> float:
        """Bytes/s between ranks ``a`` and ``b`` (ping-pong); every rank must call it."""
        seconds = torch.zeros(1, dtype=torch.float64)
        if self.rank in (a, b):
            buffer = torch.zeros(size // 4, dtype=torch.float32)
            peer = b if self.rank == a else a
            start = time.perf_counter()
            for _ in range(rounds):
                if self.rank == a:
                    dist.send(buffer, peer, group=self.group)
                    dist.recv(buffer, peer, group=self.group)
                else:
                    dist.recv(buffer, peer, group=self.group)
                    dist.send(buffer, peer, group=self.group)
            seconds += time.perf_counter() - start
        dist.broadcast(seconds, src=a, group=self.group)
        return 2 * rounds * size / max(seconds.item(), 1e-9)

    def _auto_plan(self, module: nn.Sequential, loss_fn: Callable[..., torch.Tensor],
                   sample: Optional[Tuple[Tensors, Any]], bandwidth: Optional[Sequence[float]],
                   schedule: str) -> Plan:
        """Profiles on rank 0, plans for this world, and gives every rank the same plan."""
        from ._profiler import profile
        from .planner import plan as make_plan

        if sample is None:
            raise ValueError('balance="auto" profiles the model: pass sample=(inputs, targets) '
                             "with one batch")
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if per_node < 1 or self.world_size % per_node:
            per_node = self.world_size
        nodes = self.world_size // per_node
        workers = [per_node] if nodes == 1 else [per_node, nodes]
        if bandwidth is None:
            measured = [self._measure_bandwidth(0, 1) if per_node > 1 else 1e10]
            if nodes > 1:
                measured.append(self._measure_bandwidth(0, per_node))
            bandwidth = measured
        bandwidth = [float(b) for b in bandwidth]
        if len(bandwidth) != len(workers):
            raise ValueError(f"bandwidth lists {len(bandwidth)} levels but the cluster has "
                             f"{len(workers)} ({workers}); give one bytes/s value per level")
        payload = torch.zeros(0, dtype=torch.uint8)
        length = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            inputs, targets = sample
            graph = profile(module, inputs, loss_fn=loss_fn, target=targets, steps=10, warmup=3)
            chosen = make_plan(graph, workers=workers, bandwidth=bandwidth, cost_model="default",
                               straight=schedule in ("interleaved-1f1b", "zb-h1"),
                               two_bw=schedule == "pipedream-2bw")
            payload = torch.tensor(list(chosen.to_json(indent=None).encode()), dtype=torch.uint8)
            length[0] = payload.numel()
        # The plan travels as UTF-8 JSON bytes in a tensor (no pickle).
        dist.broadcast(length, src=0, group=self.group)
        if self.rank != 0:
            payload = torch.zeros(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return Plan.from_json(bytes(payload.tolist()).decode())

    def _stages_from_plan(self, plan: Plan, num_layers: int) -> Tuple[List[int], List[int]]:
        """Balance and replicas of a plan for this model and world; clear errors otherwise."""
        layers = plan.layers
        if layers is None:
            raise ValueError("the plan is for a branching graph (no layer ranges); plan a "
                             "profile of this nn.Sequential (pipedream_ext.profile)")
        if plan.used_workers != self.world_size or sum(plan.replicas) != self.world_size:
            raise ValueError(f"the plan uses {plan.used_workers} workers but the world has "
                             f"{self.world_size} ranks; re-plan for {self.world_size} workers")
        bounds = [0]
        for start, end in layers:
            if start != bounds[-1] or end <= start:
                raise ValueError(f"the plan's layer ranges {layers} are not contiguous")
            bounds.append(end)
        if bounds[-1] != num_layers:
            raise ValueError(f"the plan covers {bounds[-1]} layers but the model has {num_layers}; "
                             "was it made for another model?")
        return [end - start for start, end in layers], list(plan.replicas)

    # -- configuration consistency ------------------------------------------------
    def _check_same_config_everywhere(self, num_layers: int) -> None:
        """Fails on every rank if ranks disagree on schedule, balance or model size."""
        text = f"{self.schedule_name}|{self.microbatches}|{self.balance}|{num_layers}|{self.replicas}"
        digest = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64)
        low, high = digest.clone(), digest.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        if low.item() != high.item():
            raise ValueError(f"rank {self.rank}: ranks disagree on the pipeline configuration "
                             f"(this rank: schedule, microbatches, balance, layers = {text}); "
                             "every rank must build PipeDream with the same arguments and model")

    # -- schedule and executor ------------------------------------------------------
    def _make_executor(self, schedule: "schedules.Schedule") -> "_C.PipelineExecutor":
        executor = _C.PipelineExecutor(
            schedule._lowered, self.rank, self.group, self.timeout,
            _weak_method(self._stage_forward), self._stage_parameters, str(self.device),
            update=_weak_method(self._update) if self.asynchronous else None,
            replica_groups=self._replica_groups, recompute=self.recompute)
        # PIPEDREAM_LOG=debug (or a DEBUG level on this logger) logs every action.
        executor.tracing = self.trace_path is not None or _log.isEnabledFor(logging.DEBUG)
        return executor

    def _after_step(self) -> None:
        """Moves the step's recorded spans to the trace and/or the debug log."""
        if not self._executor.tracing:
            return
        events = self._executor.take_trace()
        if _log.isEnabledFor(logging.DEBUG):
            for name, category, _start, duration in events:
                _log.debug("rank %d step %d: %-14s %-9s %8.3f ms", self.rank, self._step_count - 1,
                           name, category, duration / 1e3)
        if self.trace_path is not None:
            self._trace_events.extend(events)

    def _retire_executor(self) -> None:
        """Keeps the stats and trace of the executor about to be replaced."""
        self._retired_stats = self._retired_stats.merge(self._executor.stats())
        if self.trace_path is not None:
            self._trace_events.extend(self._executor.take_trace())

    def _update(self, stage: int, version: int) -> None:
        """Called by the executor at every UPDATE action (asynchronous schedules)."""
        del stage, version  # one stage per rank: the optimizer holds exactly its parameters
        if self._optimizer is not None:
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)

    # -- module-like API ------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stages (give these to your optimizer)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the original model."""
        return self.module.named_parameters()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """This rank's weights keyed by the original model's names."""
        return self.module.state_dict()

    def train(self, mode: bool = True) -> "PipeDream":
        self.module.train(mode)
        return self

    def eval(self) -> "PipeDream":
        return self.train(False)

    @property
    def is_first(self) -> bool:
        return 0 in self.local_stages

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.local_stages

    @property
    def last_rank(self) -> int:
        return self._schedule.stage_ranks(self.num_stages - 1)[0]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's communication engine has sent so far."""
        return int(self.stats()["bytes_sent"])

    # -- seeing what happens ----------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        """What this rank's runtime did since construction (or :meth:`reset_stats`).

        Returns:
            A dict with ``rank``, ``stages``, ``steps`` (executor runs), ``compute_s``
            (forward/backward/update work), ``wait_s`` (blocked on other ranks:
            receives, sends, all-reduces), ``busy_s`` (wall time inside the runtime),
            ``bubble_fraction`` (``1 - compute_s / busy_s``: the share of the
            runtime's time this rank did no work), ``bytes_sent``/``bytes_received``,
            ``peak_activations`` (most microbatches stashed at once),
            ``peak_sends_in_flight`` (most sends whose buffers were held at once),
            ``peak_weight_versions`` (per stage; asynchronous schedules),
            ``seconds_by_kind`` (``F``, ``B``, ``RECV_F`` waits, ...), and the transfer
            counts ``sends``, ``receives``, ``preposted_receives`` (data buffers
            posted before the peer sent; see docs/runtime.md) and ``redirected_sends``.
            Local to this rank: no communication.
        """
        merged = self._retired_stats.merge(self._executor.stats()).as_dict()
        merged["rank"] = self.rank
        merged["stages"] = list(self.local_stages)
        return merged

    def reset_stats(self) -> None:
        """Starts :meth:`stats` from zero (e.g. after warm-up steps)."""
        self._retired_stats = _C.RuntimeStats()
        self._executor.reset_stats()

    def write_trace(self, path: Optional[Union[str, os.PathLike]] = None) -> Optional[str]:
        """Merges every rank's recorded spans into one Chrome trace on rank 0.

        Collective: every rank of the group must call it (``close()`` does). Spans
        travel as UTF-8 JSON in uint8 tensors (no pickle). The trace has one process
        per rank (``rank r: stages [...]``) with threads ``compute`` (F/B/I/W/U),
        ``comm`` (sends posted, waits on receives and sends) and ``allreduce``;
        times are wall-clock microseconds, so ranks on different hosts are only as
        aligned as their clocks.

        Args:
            path: where to write (default: the ``trace`` given to the constructor).

        Returns:
            The path written, on rank 0; ``None`` on other ranks.

        Raises:
            ValueError: tracing was not enabled (no ``trace=`` / ``PIPEDREAM_TRACE``).
        """
        if self.trace_path is None:
            raise ValueError("tracing is off: pass PipeDream(..., trace='run.json') or set "
                             "PIPEDREAM_TRACE=run.json before building the pipeline")
        target = os.fspath(path) if path is not None else self.trace_path
        self._trace_events.extend(self._executor.take_trace())
        threads = {"compute": 0, "update": 0, "send": 1, "wait": 1, "allreduce": 2}
        events = [{"name": name, "cat": cat, "ph": "X", "ts": start, "dur": max(duration, 1),
                   "pid": self.rank, "tid": threads.get(cat, 1)}
                  for name, cat, start, duration in self._trace_events]
        label = f"rank {self.rank}: stages {list(self.local_stages)}"
        events.append({"name": "process_name", "ph": "M", "pid": self.rank,
                       "args": {"name": label}})
        for thread, tid in (("compute", 0), ("comm", 1), ("allreduce", 2)):
            events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                           "args": {"name": thread}})
        self._trace_events = []
        gathered = _gather_bytes(json.dumps(events).encode(), self.group, self.world_size,
                                 self.rank)
        if gathered is None:
            return None
        merged = [e for blob in gathered for e in json.loads(blob.decode())]
        origin = min((e["ts"] for e in merged if "ts" in e), default=0)
        for e in merged:
            if "ts" in e:
                e["ts"] -= origin
        tmp = f"{target}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": merged, "displayTimeUnit": "ms",
                       "otherData": {"schedule": self.schedule_name, "ranks": self.world_size,
                                     "origin_unix_us": origin}}, f)
        os.replace(tmp, target)
        _log.info("wrote the execution trace of %d ranks to %s", self.world_size, target)
        return target

    def close(self) -> None:
        """Ends the pipeline: drains an asynchronous one and writes the trace if on.
        Collective (every rank calls it)."""
        if self.asynchronous and self._steps:
            self.flush()
        if self.trace_path is not None:
            self.write_trace()

    def __enter__(self) -> "PipeDream":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()

    # -- the callback the C++ executor makes ------------------------------------------
    def _stage_forward(self, stage: int, microbatch: int, inputs: List[torch.Tensor],
                       weights: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.autocast is None:
            outputs = self._stage_forward_impl(stage, microbatch, inputs, weights)
        else:
            with torch.autocast(device_type=self.device.type, dtype=self.autocast):
                outputs = self._stage_forward_impl(stage, microbatch, inputs, weights)
        if self.check_finite and not self._forward_only:
            if not all(bool(torch.isfinite(t).all()) for t in outputs if t.is_floating_point()):
                if self._nonfinite_forward is None or stage < self._nonfinite_forward:
                    self._nonfinite_forward = stage
                if self.asynchronous:
                    raise NonFiniteError(
                        f"rank {self.rank}: step {self._step_count}: the "
                        f"{'loss' if stage == self.num_stages - 1 else 'forward output'} of stage "
                        f"{stage} (layers {self._layer_range(stage)}), microbatch {microbatch}, "
                        "holds NaN or inf")
        return outputs

    def _layer_range(self, stage: int) -> str:
        start = sum(self.balance[:stage])
        return f"{start}-{start + self.balance[stage] - 1}"

    def _stage_forward_impl(self, stage: int, microbatch: int, inputs: List[torch.Tensor],
                            weights: List[torch.Tensor]) -> List[torch.Tensor]:
        # nn.Sequential semantics: a tuple output reaches the next layer as one tuple.
        arg = inputs[0] if len(inputs) == 1 else tuple(inputs)
        if weights:  # a stashed weight version: run the stage functionally on it
            names = self._param_names[stage]
            out = torch.func.functional_call(self._stages[stage], dict(zip(names, weights)), (arg,))
        else:
            out = self._stages[stage](arg)
        if stage == self.num_stages - 1 and not self._forward_only:
            if self.asynchronous:
                target, scale = self._pending_targets[microbatch]
                loss = self.loss_fn(out, target)
                if loss.numel() != 1:
                    raise ValueError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it "
                                     "must return a scalar (use reduction='mean')")
                return [loss * scale]
            loss = self.loss_fn(out, self._targets[microbatch])
            if loss.numel() != 1:
                raise ValueError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must "
                                 "return a scalar (use reduction='mean')")
            loss = loss.float() * self._scales[microbatch]
            if self._grad_scaler is not None:
                loss = self._grad_scaler.scale(loss)
            return [loss]
        return list(_as_tuple(out))

    # -- training ---------------------------------------------------------------------
    def _split(self, value: Tensors, what: str, count: Optional[int] = None) -> List[Tuple[torch.Tensor, ...]]:
        count = self.microbatches if count is None else count
        batch = _as_tuple(value)[0].shape[0]
        if batch < count:
            raise ValueError(f"{what} has batch size {batch}, smaller than microbatches="
                             f"{count}; use a batch of at least {count}")
        parts = [torch.tensor_split(t.to(self.device), count, dim=0) for t in _as_tuple(value)]
        return [tuple(p[i] for p in parts) for i in range(count)]

    def step(self, inputs: Optional[Tensors], targets: Optional[Any],
             optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
        """Runs one batch (flush schedules) or admits one minibatch (asynchronous ones).

        Flush schedules (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1``): see
        :meth:`_step_flush`; you step your optimizer afterwards. Asynchronous
        schedules (``pipedream``, ``pipedream-2bw``): the runtime steps
        ``optimizer`` at every weight update; see :meth:`_step_async`.
        """
        if self.asynchronous:
            return self._step_async(inputs, targets, optimizer)
        if optimizer is not None:
            raise ValueError(f"schedule {self.schedule_name!r} flushes every step: call "
                             "optimizer.step() yourself after pipe.step(x, y)")
        return self._step_flush(inputs, targets)

    def _step_async(self, inputs: Optional[Tensors], targets: Optional[Any],
                    optimizer: Optional[torch.optim.Optimizer]) -> Optional[float]:
        """Admits one minibatch (2bw: one batch of ``microbatches``) into the pipeline.

        Runs this rank's actions up to the forward of that minibatch: the
        backwards and updates of earlier minibatches that come first, then its
        forward. Weight stashing keeps every backward on the version its forward
        read.

        Returns:
            On the rank of the last stage, the loss of the minibatch (2bw: batch)
            whose forward just completed there (with a replicated last stage: on the
            replica that ran it; 2bw: on every last-stage replica); ``None`` on
            other ranks. Losses are
            not broadcast so that ranks never wait for each other per step.

        Raises:
            ValueError: no optimizer, or inputs/targets missing where needed.
        """
        if optimizer is None and any(True for _ in self.parameters()):
            raise ValueError(f"schedule {self.schedule_name!r} updates weights inside the pipeline: "
                             "pass your optimizer, pipe.step(x, y, optimizer=opt)")
        self._optimizer = optimizer
        t = self._steps
        per_step = self.microbatches if self.schedule_name == "pipedream-2bw" else 1
        first = t * per_step
        inputs_by_microbatch: Dict[int, List[torch.Tensor]] = {}
        if self.is_first:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds stage 0: step() needs the inputs")
            chunks = self._split(inputs, "inputs", per_step)
            inputs_by_microbatch = {first + i: list(c) for i, c in enumerate(chunks)}
        if self.is_last:
            if targets is None:
                raise ValueError(f"rank {self.rank} holds the last stage: step() needs the targets")
            chunks = self._split(targets, "targets", per_step)
            total = sum(c[0].shape[0] for c in chunks)
            for i, c in enumerate(chunks):
                self._pending_targets[first + i] = (c[0] if len(c) == 1 else c, c[0].shape[0] / total)
        self._executor.append_actions(self._stream.step_actions(self.rank, t))
        losses = self._executor.run_until(self._executor.size, inputs_by_microbatch)
        self._steps += 1
        self._step_count += 1
        self._after_step()
        # Targets stay until their backward (a recomputed forward needs them):
        # at most 2 pipeline depths of steps behind.
        horizon = first - 2 * (self.world_size + 1) * per_step
        for i in [i for i in self._pending_targets if i < horizon]:
            del self._pending_targets[i]
        if not self.is_last:
            return None
        total = float(sum(float(l) for l in losses.values()))
        last_group = self._replica_groups.get(self.num_stages - 1)
        if self.schedule_name == "pipedream-2bw" and last_group is not None:
            # The batch's microbatches are split over the last stage's replicas.
            partial = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(partial, group=last_group)
            return float(partial.item())
        return total if losses else None

    def flush(self) -> None:
        """Drains an asynchronous pipeline: every admitted minibatch finishes its
        backward and update. Call it before evaluation, checkpointing and at the end.
        A no-op for flush schedules."""
        if not self.asynchronous or self._steps == 0:
            return
        if self._steps % self._stream.period:
            raise ValueError(
                f"replicated stages {self.replicas} take minibatches in rounds of "
                f"{self._stream.period}; flush after a multiple of {self._stream.period} steps "
                f"(now {self._steps})")
        self._executor.append_actions(self._stream.drain_actions(self.rank, self._steps))
        self._executor.run_until(self._executor.size, {})
        self._executor.wait_sends()
        self.peak_weight_versions = dict(self._executor.stats().peak_weight_versions)
        # A new stream starts from version 0 = the current live weights.
        self._pending_targets.clear()
        self._steps = 0
        self._retire_executor()
        self._executor = self._make_executor(self._schedule)

    def _step_flush(self, inputs: Optional[Tensors], targets: Optional[Any]) -> float:
        """Runs forward and backward of one batch through the pipeline.

        Leaves on every local parameter the gradient of ``loss_fn(model(inputs), targets)``
        of the unsplit model over the whole batch. Call your optimizer afterwards.

        Args:
            inputs: the batch (tensor or tuple of tensors), needed on the rank of stage 0.
            targets: the targets, needed on the rank of the last stage.

        Returns:
            The batch's mean loss, on every rank.

        Raises:
            ValueError: inputs or targets missing where needed, or a batch smaller
                than ``microbatches``.
        """
        input_chunks: List[Tuple[torch.Tensor, ...]] = []
        if self.is_first:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds stage 0: step() needs the inputs")
            input_chunks = self._split(inputs, "inputs")
        if self.is_last:
            if targets is None:
                raise ValueError(f"rank {self.rank} holds the last stage: step() needs the targets")
            chunks = self._split(targets, "targets")
            self._targets = [c[0] if len(c) == 1 else c for c in chunks]
            total = sum(c[0].shape[0] for c in chunks)
            self._scales = [c[0].shape[0] / total for c in chunks]
        self._forward_only = False
        self._nonfinite_forward = None
        loss_scale = float(self._grad_scaler.get_scale()) if self._grad_scaler is not None else 1.0
        losses = self._executor.run([list(c) for c in input_chunks])
        self._step_count += 1
        self._after_step()
        # Each last-stage replica holds the scaled losses of its microbatches.
        loss = torch.zeros(1, dtype=torch.float64)
        if self.is_last:
            loss += sum(float(l) for l in losses if l is not None) / loss_scale
        try:
            dist.all_reduce(loss, group=self.group)
        except RuntimeError as exc:  # Gloo names an address; say which rank and step
            raise RuntimeError(f"rank {self.rank}: the all-reduce of the batch loss after step "
                               f"{self._step_count - 1} failed or timed out: {exc}") from exc
        if self.check_finite and self._check_finite_step():
            return float("nan")
        return float(loss.item())

    def _check_finite_step(self) -> bool:
        """Agrees on every rank where non-finite values first appeared this step.

        Returns:
            True when the step was skipped (``check_finite="skip"``).

        Raises:
            NonFiniteError: ``check_finite="raise"`` and a NaN or inf was found.
        """
        forward = self._nonfinite_forward if self._nonfinite_forward is not None else self.num_stages
        backward = -1
        if self._grad_scaler is None:  # with loss scaling, overflowing gradients are the scaler's job
            for j in self.local_stages:
                if any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                       for p in self._stages[j].parameters()):
                    backward = max(backward, j)
        flags = torch.tensor([-forward, backward], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        forward, backward = int(-flags[0]), int(flags[1])
        if forward == self.num_stages and backward < 0:
            return False
        if forward < self.num_stages:
            where = (f"the {'loss' if forward == self.num_stages - 1 else 'forward output'} of "
                     f"stage {forward} (layers {self._layer_range(forward)})")
        else:
            where = f"the gradients of stage {backward} (layers {self._layer_range(backward)}) in the backward"
        message = f"step {self._step_count - 1}: NaN or inf first appeared in {where}"
        if self.check_finite == "raise":
            raise NonFiniteError(message)
        _log.warning("%s; skipping the step (gradients set to None)", message)
        for p in self.parameters():
            p.grad = None
        return True

    def grad_scaler(self, **kwargs: Any) -> Any:
        """A loss scaler for ``autocast=torch.float16`` on a flush schedule.

        A :class:`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` over this
        pipeline's group: ``scaler.step(optimizer)`` skips an overflowing step on every
        rank together (each rank only sees its own stage's gradients). ``pipe.step``
        scales the loss with it and returns the unscaled loss. Use it like
        ``torch.amp.GradScaler``::

            scaler = pipe.grad_scaler()
            loss = pipe.step(x, y)
            scaler.step(opt); scaler.update(); opt.zero_grad()

        Every rank must call ``scaler.step`` each step, so every stage needs parameters.

        Args:
            **kwargs: passed on (``init_scale``, ``growth_interval``, ...).

        Raises:
            ValueError: an asynchronous schedule (their updates happen inside the pipeline).
        """
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if self.asynchronous:
            raise ValueError(f"schedule {self.schedule_name!r} updates inside the pipeline; loss "
                             "scaling needs a flush schedule (or use autocast=torch.bfloat16)")
        if not any(True for _ in self.parameters()):
            raise ValueError(f"rank {self.rank}'s stages have no parameters, so it cannot step a "
                             "scaler; give every stage parameters (balance=...)")
        self._grad_scaler = ShardedGradScaler(device=self.device.type, process_group=self.group,
                                              **kwargs)
        # The scale is created lazily by scale(), which only the last stage calls;
        # every rank's step()/update() needs it.
        self._grad_scaler.scale(torch.ones((), device=self.device))
        return self._grad_scaler

    @torch.no_grad()
    def forward_only(self, inputs: Optional[Tensors]) -> Optional[torch.Tensor]:
        """Runs the batch forward through the pipeline without gradients.

        Returns:
            The model's outputs for the whole batch on the rank of the last stage
            (concatenated over microbatches), ``None`` elsewhere.
        """
        if self.is_first and inputs is None:
            raise ValueError(f"rank {self.rank} holds stage 0: forward_only() needs the inputs")
        executor = self._executor
        if self.asynchronous and self._steps:
            raise RuntimeError(f"{self._steps} minibatches are still in the pipeline; call "
                               "pipe.flush() before forward_only()")
        if self.asynchronous or any(r > 1 for r in self.replicas):
            # Forwards of a plain GPipe list over one replica (the leader) of each
            # stage, on the live weights; the other replicas sit this out.
            if self.rank not in self._leaders:
                return None
            if self._eval_executor is None:
                evaluation = schedules.build("gpipe", stages=self.num_stages,
                                             microbatches=self.microbatches)
                self._eval_executor = _C.PipelineExecutor(
                    evaluation._lowered, self._leaders.index(self.rank), self._leader_group,
                    self.timeout, _weak_method(self._stage_forward), self._stage_parameters,
                    str(self.device))
            executor = self._eval_executor
        input_chunks = self._split(inputs, "inputs") if self.is_first else []
        self._forward_only = True
        try:
            outputs = executor.run_forward([list(c) for c in input_chunks])
        finally:
            self._forward_only = False
        if not self.is_last:
            return None
        parts = [o for o in outputs if o]
        if len(parts[0]) == 1:
            return torch.cat([p[0] for p in parts], dim=0)
        return tuple(torch.cat([p[k] for p in parts], dim=0) for k in range(len(parts[0])))


# Errors about a peer name the job's first failure and a lost rank (heartbeats).
_faults.ensure_installed(PipeDream)
