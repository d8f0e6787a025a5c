"""``PipeDream``'s options, each written once: :class:`PipelineOptions`.

Every option is one field: its default and type, and in its :func:`option` metadata
its group, its documentation, the check it needs no process group for, the value the
runtime reads (``PipelineConfig``) and whether ranks compare it at construction
(``_dist.agreement``). What reads the fields instead of repeating them:
``PipeDream``'s signature and its docstring's Args (:func:`signature`,
:func:`document`), the keywords it accepts (:func:`from_call`: a deprecation for the
old positional use, the closest name for a misspelt one), ``PipelineConfig`` and the
agreement (:func:`agreed_values`), and the ``schedule`` CLI's help (:func:`summary`).
Adding an option is adding one field here. Pure: tested in one process.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
import reprlib
import textwrap
import typing
import warnings
from typing import Any, Callable, Concatenate, Dict, List, Mapping, Optional, ParamSpec, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import schedules
from .._extension import _C
from .._frontend import deferred_init
from .._parallel.expert_parallel import check_option as _check_expert_parallel
from .._parallel.tensor_parallel import check_option as _check_tensor_parallel
from .._parallel.tensor_parallel import describe_plan
from ..planner import Plan
from .grad_clip import parse_clip_option
from .loss_reduction import LossReduction, from_option, reduction_type
from .stage_call import Tensors

__all__ = ["AUTO", "SEARCHED", "ClipOption", "Option", "PipelineOptions", "agreed_values", "checked",
           "document", "from_call", "keyword_options", "option", "provisional", "searched", "signature",
           "summary"]

#: ``PipeDream(clip_grad_norm=...)``: ``max_norm`` or ``(max_norm, norm_type)``.
ClipOption = Optional[Union[float, Tuple[float, float]]]

_P = ParamSpec("_P")

#: The groups of the docstring's Args, in its order.
GROUPS = {"schedule": "what runs: the schedule", "split": "where the model is cut",
          "placement": "ranks, devices and data parallelism", "numerics": "precision and the loss",
          "initialisation": "a meta-device model's weights", "debugging": "checks and traces"}


@dataclasses.dataclass(frozen=True)
class Option:
    """What one field of :class:`PipelineOptions` says besides its default and type.

    Attributes:
        doc: its documentation (the docstring's Args entry; first sentence: the CLI's help).
        group: one of :data:`GROUPS`.
        position: its index in the signature that took options positionally (``PipeDream(m,
            f, "1f1b", 4)``, deprecated), or ``None`` (keyword only).
        check: ``check(value, options)`` raises ``ValueError`` (naming the value and the fix)
            for a value that needs no process group to refuse; run in field order, so a check
            may read the options checked before it (``options.schedule``).
        convert: the value ``PipelineConfig`` holds, ``convert(value, *others)`` (``others``:
            the options named in ``reads``), or ``None``: the runtime does not read it itself.
        agreed: the JSON value every rank compares at construction (of the converted value),
            or ``None``: not compared.
        reads: the other options ``convert`` takes after the value, by name
            (``loss_reduction``'s object holds ``tokens_fn``).
    """

    doc: str
    group: str
    position: Optional[int] = None
    check: Optional[Callable[[Any, "PipelineOptions"], None]] = None
    convert: Optional[Callable[..., Any]] = None
    agreed: Optional[Callable[[Any], Any]] = None
    reads: Tuple[str, ...] = ()


def option(default: Any, doc: str, **spec: Any) -> Any:
    """A :class:`PipelineOptions` field: ``default`` and an :class:`Option` of ``doc`` and ``spec``."""
    return dataclasses.field(default=default, metadata={"option": Option(textwrap.dedent(doc).strip(),
                                                                         **spec)})


def _same(value: Any) -> Any:
    return value


def _names_with(flag: str) -> str:
    return " or ".join(f"schedule={t.name!r}" for t in _C.all_schedule_traits()
                       if getattr(t, flag))


# -- the checks: each field's, in field order ---------------------------------------------
def _check_schedule(schedule: str, _: "PipelineOptions") -> None:
    runnable = schedules.synchronous_names() + schedules.asynchronous_names()
    if schedule not in runnable:
        raise ValueError(f"schedule {schedule!r} is not supported by the runtime; choose one "
                         f"of {', '.join(runnable)}, or 'auto' to let the planner choose a flush "
                         "schedule")


def _check_microbatches(microbatches: int, _: "PipelineOptions") -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer or 'auto' (got {microbatches!r})")


def _check_chunks(chunks: int, options: "PipelineOptions") -> None:
    traits = schedules.traits(options.schedule)
    if chunks != 1 and not traits.multi_chunk:
        raise ValueError(f"chunks={chunks} needs {_names_with('multi_chunk')} "
                         f"(got {options.schedule!r})")
    if traits.fixed_chunks and chunks != traits.fixed_chunks:
        raise ValueError(f"schedule {options.schedule!r} places exactly {traits.fixed_chunks} chunks "
                         f"per rank in a V (rank r holds stages r and 2p-1-r; got "
                         f"chunks={chunks}); use chunks={traits.fixed_chunks}")


def _check_vertical_sync(vertical_sync: bool, options: "PipelineOptions") -> None:
    if vertical_sync and not schedules.traits(options.schedule).supports_vertical_sync:
        raise ValueError(f"vertical_sync=True needs {_names_with('supports_vertical_sync')} "
                         f"(got {options.schedule!r})")


def _check_overlap(overlap: Any, options: "PipelineOptions") -> None:
    if not isinstance(overlap, bool) and not callable(overlap):
        raise ValueError(f"overlap={overlap!r} must be True, False or a function "
                         "overlapped_forward_backward(module0, inputs0, module1, outputs1, output_grads1)")
    if overlap is not False and options.schedule != "dualpipev":
        raise ValueError(f"overlap runs the F&B pairs of schedule='dualpipev' together; schedule "
                         f"{options.schedule!r} has none: give schedule='dualpipev' (chunks=2) or "
                         "overlap=False")


def _overlap_json(overlap: Any) -> Any:
    return overlap if isinstance(overlap, bool) else "hook"


def _check_timeout(timeout: float, _: "PipelineOptions") -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0 (got {timeout!r}): "
                         "every wait on another rank needs a bound so that a dead or stuck "
                         "rank fails the others instead of hanging them; e.g. timeout=600")


def _check_autocast(autocast: Optional[torch.dtype], options: "PipelineOptions") -> None:
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast={autocast!r} is not a reduced-precision dtype; use "
                         "torch.bfloat16 or torch.float16 (or None for full precision)")
    if autocast == torch.float16 and schedules.traits(options.schedule).asynchronous:
        raise ValueError(f"autocast=torch.float16 needs loss scaling, which schedule "
                         f"{options.schedule!r} does not support; use autocast=torch.bfloat16")


def _check_loss_reduction(loss_reduction: str, options: "PipelineOptions") -> None:
    reduction_type(loss_reduction).check_schedule(options.schedule)


def _check_tokens_fn(tokens_fn: Optional[Callable[[Any], Any]], options: "PipelineOptions") -> None:
    from_option(options.loss_reduction, tokens_fn)  # the reduction refuses a tokens_fn it cannot use


def _reduction_name(reduction: LossReduction) -> str:
    return reduction.name


def _check_finite(check_finite: Optional[str], options: "PipelineOptions") -> None:
    if check_finite not in (None, "raise", "skip"):
        raise ValueError(f"check_finite={check_finite!r}; use None, 'raise' or 'skip'")
    if check_finite == "skip" and schedules.traits(options.schedule).asynchronous:
        raise ValueError(f"check_finite='skip' needs a flush schedule (got {options.schedule!r}); "
                         "use check_finite='raise'")


def _check_clip(clip_grad_norm: ClipOption, options: "PipelineOptions") -> None:
    if parse_clip_option(clip_grad_norm) is not None and \
            not schedules.traits(options.schedule).asynchronous:
        raise ValueError(f"clip_grad_norm={clip_grad_norm!r} is for asynchronous schedules, which "
                         f"step the optimizer themselves; with schedule {options.schedule!r} you step "
                         "it: call pd.clip_grad_norm_(pipe, max_norm) between pipe.step(x, y) and "
                         "opt.step()")


def _check_memory(memory: Optional[float], _: "PipelineOptions") -> None:
    if memory is None:
        return
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or \
            not math.isfinite(memory) or memory <= 0:
        raise ValueError(f"memory must be bytes per rank > 0, or None for no limit (got "
                         f"{memory!r}); e.g. memory=8e9")


def _check_agreement(check_agreement: int, _: "PipelineOptions") -> None:
    if isinstance(check_agreement, bool) or not isinstance(check_agreement, int) or \
            check_agreement < 0:
        raise ValueError(f"check_agreement must be a number of steps >= 0 (got "
                         f"{check_agreement!r}); 0 turns the check of the first steps off")


def _clip_json(clip: Optional[Tuple[float, float]]) -> Optional[List[float]]:
    return None if clip is None else list(clip)


def _check_recompute(recompute: Union[bool, Sequence[bool]], _: "PipelineOptions") -> None:
    """A bool, or one bool per stage (their count is checked once the stages are known:
    ``PipelineConfig.recompute_stages``)."""
    if isinstance(recompute, bool):
        return
    if not isinstance(recompute, (list, tuple)) or not recompute or \
            not all(isinstance(r, bool) for r in recompute):
        raise ValueError(f"recompute={recompute!r} must be True, False or a list of one bool per "
                         "stage (e.g. recompute=[True, False] for 2 stages: stage 0 recomputes)")


def _recompute_value(recompute: Union[bool, Sequence[bool]]) -> Union[bool, Tuple[bool, ...]]:
    return recompute if isinstance(recompute, bool) else tuple(recompute)


def _recompute_json(recompute: Union[bool, Tuple[bool, ...]]) -> Union[bool, List[bool]]:
    return recompute if isinstance(recompute, bool) else list(recompute)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """``PipeDream``'s options as the user gave them, keyword-only, grouped as its
    docstring shows them; each field's :class:`Option` holds the rest."""

    # -- schedule ---------------------------------------------------------------------------
    schedule: str = option("1f1b", """
        one of :data:`SYNCHRONOUS_SCHEDULES` or :data:`ASYNCHRONOUS_SCHEDULES` (what each means:
        ``schedules.traits(name)``), or ``"auto"``: the planner chooses among the flush schedules (with
        ``sample``; docs/planner.md, "Choosing the whole configuration"). With ``pipedream`` every
        ``step`` is one minibatch and one weight update per stage (weight stashing); with
        ``pipedream-2bw`` one batch of ``microbatches`` and one update (at most 2 weight versions). Both
        take the optimizer in ``step(x, y, optimizer=opt)`` and need ``flush()``.""", group="schedule",
        position=0, check=_check_schedule, convert=_same, agreed=_same)
    microbatches: Union[int, str] = option(4, """
        microbatches per ``step`` (the batch is split on dim 0), or ``"auto"``: chosen by the planner
        (with ``sample``).""",
        group="schedule", position=1, check=_check_microbatches, convert=_same, agreed=_same)
    chunks: int = option(1, """
        model chunks per rank (``interleaved-1f1b``, ``interleaved-zb``; exactly 2 for ``zbv`` and
        ``dualpipev``); with ``schedule="auto"`` the planner chooses them (a value above 1 keeps only
        the schedules that run that many).""", group="schedule", position=3, check=_check_chunks,
        convert=_same, agreed=_same)
    vertical_sync: bool = option(False, """
        ``pipedream`` only: every stage uses, for a minibatch, the weight version stage 0 used.""",
        group="schedule", position=7, check=_check_vertical_sync, convert=bool, agreed=_same)
    overlap: Union[bool, Callable[..., Any]] = option(False, """
        ``dualpipev`` only: run each F&B pair's forward and backward together, so that one's
        all_to_all hides behind the other's compute. ``True``: on two threads taking turns at each
        asynchronous collective (``RoutedExpertParallel`` yields at its exchanges; the model class's
        own ``overlapped_forward_backward``, if it defines one, runs the pair instead); a function
        ``fn(module0, inputs0, module1, outputs1, output_grads1) -> outputs0`` (DualPipe's shape)
        runs every pair. Same result as without (docs/guide/expert_parallel.md, "Overlapping F&B
        pairs").""", group="schedule", check=_check_overlap, convert=_same, agreed=_overlap_json)

    # -- split ------------------------------------------------------------------------------
    balance: Optional[Union[Sequence[int], str, os.PathLike, Plan]] = option(None, """
        layers per stage (``None``: an even split); ``"auto"`` to profile the model on rank 0 with
        ``sample`` and plan stages and replicas for this world with the planner; or a saved plan (a
        ``plan.json`` path or a :class:`~pipedream_ext.Plan`). Stages are ordered as in the module; stage
        ``j`` runs on rank ``j``, or on consecutive ranks when replicated; with several chunks per rank the
        schedule's layout places them: ``j mod world`` (``interleaved-1f1b``, ``interleaved-zb``) or a V
        (``zbv``, ``dualpipev``: rank ``r`` holds stages ``r`` and ``2 * world - 1 - r``). For a model that
        is not an ``nn.Sequential`` (no ``split_points``), ``"auto"`` traces it, profiles its graph on rank
        0 (groups of operations, real edges) and plans; a plan must come from that model's graph profile
        (docs/tracing.md).""", group="split", position=2)
    replicas: Optional[Sequence[int]] = option(None, """
        replica count per stage, e.g. ``[2, 1, 1]`` on 4 ranks (hybrid pipeline and data parallelism;
        gpipe, 1f1b, pipedream, pipedream-2bw). Stage j runs on ``replicas[j]`` consecutive ranks;
        microbatch i runs on replica ``i mod replicas[j]``; replicas all-reduce gradients before each update
        (summed for flush schedules and 2bw, where they are parts of one batch; averaged for ``pipedream``,
        where each replica ran its own minibatch).""", group="split", position=9)
    split_points: Optional[Sequence[str]] = option(None, """
        for a model that is not an ``nn.Sequential``: qualified module names (``["layer3",
        "decoder.up1"]``); the model is traced with torch.fx on ``sample`` (``torch.export``, non-strict
        with dynamic shapes, where fx cannot) and stage ``j + 1`` starts at the first operation running in
        ``split_points[j]``. Tensors live across a cut (inputs, skip connections) travel as a tuple; names
        stay the original model's. One fewer than the stages (ranks x chunks, or ``len(replicas)``). See
        docs/tracing.md.""", group="split", position=17)
    sample: Optional[Tuple[Tensors, Any]] = option(None, """
        ``(inputs, targets)`` of one batch, for ``balance="auto"`` and for tracing a model that is not
        an ``nn.Sequential``.""", group="split", position=10)
    concrete_args: Optional[Mapping[str, Any]] = option(None, """
        for a traced model: non-tensor ``forward`` arguments fixed for tracing, e.g.
        ``{"use_cache": False}``; tensor inputs go in ``sample`` and in every ``step``: a tuple
        (positionally) or a dict of named tensors (keyword arguments; every other argument then takes its
        default).""", group="split", position=18)
    bandwidth: Optional[Sequence[float]] = option(None, """
        bytes/s per topology level (within a node, then between nodes) for ``balance="auto"``;
        measured with a short probe if omitted.""", group="split", position=11)
    memory: Optional[float] = option(None, """
        bytes per rank the planner's choice must fit (weights, gradients, optimizer state and the
        activations in flight), with ``schedule``, ``microbatches``, ``recompute``, ``mesh`` or
        ``data_parallel`` ``"auto"``; ``None``: no limit.""", group="split", check=_check_memory, agreed=_same)

    # -- placement --------------------------------------------------------------------------
    process_group: Optional[dist.ProcessGroup] = option(None, """
        the group to run on (default: the default group, which is created from the torchrun
        environment if needed: Gloo on CPU, NCCL on GPU).""", group="placement", position=4)
    device: Optional[Union[str, torch.device]] = option(None, """
        where this rank's layers live (default: ``cuda:LOCAL_RANK`` if CUDA is available, else CPU).""",
        group="placement", position=5)
    timeout: float = option(300.0, """
        seconds any wait on another rank may take before failing.""",
        group="placement", position=6, check=_check_timeout, convert=float)
    mesh: Optional[Any] = option(None, """
        a ``("pp", "dp")`` DeviceMesh over every rank: the pipeline runs on ``mesh["pp"]``, one copy per
        ``dp`` rank, each ``step`` given that rank's part; ``("pp", "dp", "tp")`` or ``("pp", "tp")`` with
        ``tensor_parallel``. ``"auto"``: the planner factors the world into ``(pp, dp, tp)`` and builds the
        mesh (with ``sample``, then one step's batch of the whole run; each dp rank feeds its part,
        ``pipe.data_parallel_rank`` of ``pipe.data_parallel_size``; docs/planner.md, "Choosing the
        mesh").""", group="placement", position=21)
    data_parallel: str = option("fsdp", """
        with ``mesh``: ``"fsdp"`` (FSDP2 ``fully_shard`` of each layer over ``mesh["dp"]``) or
        ``"replicate"`` (gradients averaged over it after each step); ``"auto"``: the planner chooses
        (with ``sample``; what fits ``memory`` and runs fastest).""", group="placement", position=22)
    reshard_after_forward: bool = option(False, """
        ``"fsdp"``: free the gathered weights after each forward.""", group="placement", position=23)
    mp_policy: Optional[Any] = option(None, """
        ``"fsdp"``: FSDP's ``MixedPrecisionPolicy`` (docs/guide/fsdp_2d.md).""",
        group="placement", position=24)
    tensor_parallel: Optional[Any] = option(None, """
        with a ``("pp", "dp", "tp")`` (or ``("pp", "tp")``) ``mesh``: tensor parallelism inside each
        stage over ``mesh["tp"]``, a dict ``{pattern: ParallelStyle}`` (fnmatch patterns over the original
        model's module names, ``*`` one name component, as ``parallelize_module`` reads them; each stage's
        modules get what ``parallelize_module(model, mesh["tp"], plan)`` gives them) or a callable
        ``fn(stage_module, tp_mesh)`` (with ``split_points``: ``fn(model, tp_mesh)`` of the whole model,
        torchtitan's parallelize function, recorded as the dict it applies). Every tp rank of a dp
        coordinate is given the same batch. An ``nn.Sequential`` with a flush schedule;
        docs/guide/tensor_parallel.md lists what is refused.""",
        group="placement", check=_check_tensor_parallel, agreed=describe_plan)
    expert_parallel: Optional[Any] = option(None, """
        with a ``("pp", "ep")`` or ``("pp", "dp", "ep")`` ``mesh`` (with ``tensor_parallel``: ``("pp", "ep",
        "tp")`` or ``("pp", "dp", "ep", "tp")``, the experts replicated over tp): expert parallelism inside each stage
        over ``mesh["ep"]``, a dict ``{pattern: ParallelStyle}`` (torchtitan's ``ExpertParallel()`` on
        the experts, e.g. ``{"layers.*.moe.experts": ExpertParallel()}``; patterns as ``tensor_parallel``
        reads them), ``"auto"`` (a transformers model's own ``ep_plan``: ``RoutedExpertParallel()`` on its
        experts) or a callable ``fn(stage_module, ep_mesh)``. The ep ranks are data ranks for
        everything else: one pipeline per ``(dp, ep)`` coordinate, each given its own part of the batch;
        dense gradients averaged over dp x ep, the experts' shards over dp (with ``data_parallel="fsdp"``
        the dense layers sharded over dp x ep, the experts over dp); docs/guide/expert_parallel.md lists
        what is refused.""",
        group="placement", check=_check_expert_parallel, agreed=describe_plan)

    # -- numerics ---------------------------------------------------------------------------
    autocast: Optional[torch.dtype] = option(None, """
        run every stage's forward (and the loss) under ``torch.autocast(device_type,
        dtype=autocast)``, e.g. ``torch.bfloat16``; boundary tensors then travel in that dtype (half the
        bytes). With ``torch.float16`` on a flush schedule, scale the loss with :meth:`grad_scaler` (all
        ranks skip an overflowing step together).""",
        group="numerics", position=13, check=_check_autocast, convert=_same, agreed=str)
    loss_reduction: str = option("mean", """
        ``"mean"`` (default): ``loss_fn`` averages over the batch and each microbatch's loss is
        scaled by its share of the batch; ``"sum"``: it adds, unscaled. A ``loss_fn`` that reduces otherwise
        is refused at once. ``"tokens"`` (flush schedules): ``loss_fn`` returns ``(loss_sum, n_tokens)``
        and the pipeline trains on the global token mean, every microbatch's (and with a ``mesh`` every dp
        rank's) ``loss_sum`` over the whole batch's tokens, counted from the targets before the step runs
        (``tokens_fn``).""",
        group="numerics", position=19, check=_check_loss_reduction, convert=from_option,
        agreed=_reduction_name, reads=("tokens_fn",))
    tokens_fn: Optional[Callable[[Any], Any]] = option(None, """
        ``loss_reduction="tokens"``: ``tokens_fn(target)`` counts the tokens of a microbatch's targets
        (a number or a 0-d tensor); default: a target tensor's elements other than ``-100`` (PyTorch's and
        transformers' ``ignore_index``). Each microbatch's count must equal the ``n_tokens`` its
        ``loss_fn`` returns (checked every step).""",
        group="numerics", check=_check_tokens_fn)
    check_finite: Optional[str] = option(None, """
        ``"raise"`` or ``"skip"``: after every step, find the first stage whose forward output
        (or, in the backward, the last stage whose gradients) holds NaN or inf and report it with the step
        number; ``"raise"`` raises :class:`NonFiniteError` on every rank, ``"skip"`` (flush schedules) logs
        a warning, sets this step's gradients to ``None`` so ``optimizer.step()`` leaves the weights alone,
        and returns ``nan``. Costs one ``isfinite`` per stage output and one small all-reduce per step.
        Asynchronous schedules support ``"raise"`` only (the rank that finds it raises; the others fail
        naming it).""", group="numerics", position=14, check=_check_finite, convert=_same, agreed=_same)
    clip_grad_norm: ClipOption = option(None, """
        ``pipedream-2bw``: ``max_norm`` or ``(max_norm, norm_type)``: clip each update's
        gradients by the whole model's norm (flush: :func:`clip_grad_norm_`).""",
        group="numerics", position=25, check=_check_clip, convert=parse_clip_option, agreed=_clip_json)
    recompute: Union[bool, Sequence[bool], str] = option(False, """
        keep only each stage's inputs during the forward and recompute its activations in the
        backward (same result, with the CPU and CUDA RNG states restored so dropout draws the same masks).
        A list of one bool per stage recomputes only the stages marked ``True`` (``[True, False]``: stage 0);
        the stages one rank runs (``chunks`` > 1) must agree. ``"auto"``: the planner chooses per stage
        (with ``sample``; what fits ``memory`` and runs fastest).""",
        group="numerics", position=8, check=_check_recompute, convert=_recompute_value,
        agreed=_recompute_json)

    # -- initialisation ---------------------------------------------------------------------
    init_seed: int = option(deferred_init.DEFAULT_INIT_SEED, """
        base seed of deferred initialisation (default 0), an integer in ``[0, 2**16)``: top-level
        layer ``l`` built on the meta device is initialised under a forked RNG seeded with ``init_seed *
        2**16 + l``, so it gets the same weights on any partition or world size; your global RNG state is
        left as it was. ``pd.materialize(model, seed=...)`` gives the same weights to a whole model in one
        process. A traced model (``split_points``) is seeded per unit instead: the ``u``-th module owning
        meta tensors gets ``init_seed * 2**16 + u`` (docs/tracing.md#starting-from-the-meta-device).""",
        group="initialisation", position=15)
    init_fn: Optional[deferred_init.InitFn] = option(None, """
        ``init_fn(layer)`` initialises one top-level layer built on the meta device in place (called
        once per layer this rank keeps, after its storage is allocated, under the seeded RNG and
        ``no_grad``), instead of each module's ``reset_parameters()``. Needed for modules with meta tensors
        and no ``reset_parameters()``, and for buffers computed in ``__init__`` (a causal mask) that
        ``reset_parameters()`` does not set. A traced model calls ``init_fn(module)`` once per module
        owning meta tensors (instead of the model's ``_init_weights`` or ``reset_parameters()``).""",
        group="initialisation", position=16)

    # -- debugging --------------------------------------------------------------------------
    trace: Optional[Union[str, os.PathLike]] = option(None, """
        record every action each rank runs and write them, merged by rank 0, as one Chrome trace at this
        path (Perfetto) in :meth:`write_trace` or :meth:`close`. Default: the ``PIPEDREAM_TRACE``
        environment variable.""", group="debugging", position=12)
    check_agreement: int = option(3, """
        the first ``check_agreement`` calls of ``step()`` and of ``forward_only()`` start with
        one small exchange in which every rank says which call it is in and fingerprints the batch it was
        given: ranks in different calls, or a first and a last stage given different batches (a
        ``DistributedSampler`` kept from a DDP script) fail on every rank before anything is sent. ``0``
        turns it off; later calls cost nothing.""",
        group="debugging", position=20, check=_check_agreement, convert=_same, agreed=_same)


# -- what the planner chooses ----------------------------------------------------------------
#: The value that leaves an option to the planner.
AUTO = "auto"
#: The options the configuration search may choose (``_planning/choose.py``).
SEARCHED = ("schedule", "microbatches", "recompute", "mesh", "data_parallel")


def searched(options: "PipelineOptions") -> List[str]:
    """The options of :data:`SEARCHED` left to the planner (``"auto"``), in that order."""
    return [name for name in SEARCHED if isinstance(getattr(options, name), str)
            and getattr(options, name) == AUTO]


def provisional(options: "PipelineOptions") -> "PipelineOptions":
    """``options`` with every ``"auto"`` replaced by a value of the kind the planner may
    choose, so that the other options' checks run before any communication: a flush
    schedule (one that runs ``chunks`` chunks when above 1), 1 microbatch, no recompute.
    The chosen values are checked again once known."""
    left = searched(options)
    if not left:
        return options
    values: Dict[str, Any] = {"microbatches": 1, "recompute": False}
    if "schedule" in left:
        values["schedule"] = next(
            name for name in schedules.synchronous_names()
            if (options.chunks == 1 and not schedules.traits(name).multi_chunk) or
            (options.chunks != 1 and schedules.traits(name).multi_chunk and
             schedules.traits(name).fixed_chunks in (0, options.chunks)))
    return dataclasses.replace(options, **{k: v for k, v in values.items() if k in left})


# -- reading the fields ---------------------------------------------------------------------
def _options() -> List[Tuple["dataclasses.Field[Any]", Option]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(PipelineOptions)]


def checked(options: PipelineOptions) -> Dict[str, Any]:
    """Runs every field's check, in field order, and returns the values the runtime
    reads (``PipelineConfig``'s), by name.

    Raises:
        ValueError: the first bad value, named with its fix.
    """
    for f, spec in _options():
        if spec.check is not None:
            spec.check(getattr(options, f.name), options)
    return {f.name: _converted(f, spec, options) for f, spec in _options()
            if spec.convert is not None}


def _converted(field: "dataclasses.Field[Any]", spec: Option, options: PipelineOptions) -> Any:
    """The value of option ``field`` the runtime reads (as given, without a convert)."""
    value = getattr(options, field.name)
    if spec.convert is None:
        return value
    return spec.convert(value, *(getattr(options, name) for name in spec.reads))


def agreed_values(options: PipelineOptions) -> Dict[str, Any]:
    """The options every rank compares at construction, as JSON values, by name (checked ones)."""
    return {f.name: spec.agreed(_converted(f, spec, options))
            for f, spec in _options() if spec.agreed is not None}


def summary(name: str) -> str:
    """The first sentence of option ``name``'s documentation, as plain text (the CLI's help)."""
    spec = PipelineOptions.__dataclass_fields__[name].metadata["option"]
    return " ".join(re.split(r"\.\s+(?=[A-Z])", spec.doc.replace("``", ""))[0].split()).rstrip(".")


def from_call(owner: str, positional: Sequence[Any], keywords: Mapping[str, Any]) -> Dict[str, Any]:
    """The options of a call, by name: ``keywords``, and ``positional`` (the old signature's
    order) with a ``DeprecationWarning`` naming their keyword spelling.

    Raises:
        TypeError: an unknown keyword (naming the closest option), too many positional
            options, or an option given both ways, as Python words them.
    """
    names = [f.name for f in dataclasses.fields(PipelineOptions)]
    for name in keywords:
        if name not in names:
            closest = difflib.get_close_matches(name, names, n=1, cutoff=0.0)
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}; did you mean "
                            f"{closest[0]!r}? (options: {', '.join(sorted(names))})")
    by_position = sorted((spec.position, f.name) for f, spec in _options() if spec.position is not None)
    if len(positional) > len(by_position):
        raise TypeError(f"{owner}() takes module, loss_fn and at most {len(by_position)} options "
                        f"positionally ({len(positional)} given); pass options as keywords")
    given = dict(keywords)
    spelled = []
    for value, (_, name) in zip(positional, by_position):
        if name in given:
            raise TypeError(f"{owner}() got multiple values for argument {name!r}")
        given[name] = value
        spelled.append(f"{name}={reprlib.repr(value)}")
    if spelled:
        warnings.warn(f"{owner}(): options after loss_fn are keyword-only; pass "
                      f"{', '.join(spelled)} as {'a keyword' if len(spelled) == 1 else 'keywords'} "
                      "(positional options will be refused in a later release)",
                      DeprecationWarning, stacklevel=3)
    return given


def signature(options: Any, *leading: inspect.Parameter) -> inspect.Signature:
    """``leading`` parameters, then every field of the dataclass ``options`` keyword-only,
    with its default and type."""
    hints = typing.get_type_hints(options)
    return inspect.Signature([*leading] + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                          annotation=hints[f.name]) for f in dataclasses.fields(options)])


def document(docstring: str) -> str:
    """``docstring`` with its marker lines filled in, indented as each marker is:
    ``{option_groups}`` by the groups and their options, ``{options}`` (a line of its
    Args) by every option's entry, group by group."""
    def fill(marker: str, paragraphs: List[str], hanging: str) -> None:
        nonlocal docstring
        line = next(text for text in docstring.splitlines() if text.strip() == marker)
        indent = line[:len(line) - len(line.lstrip())]
        docstring = docstring.replace(line, "\n".join(
            textwrap.fill(" ".join(text.split()), width=100, initial_indent=indent,
                          subsequent_indent=indent + hanging, break_on_hyphens=False,
                          break_long_words=False) for text in paragraphs))

    by_group = [(f, spec) for group in GROUPS for f, spec in _options() if spec.group == group]
    groups = "; ".join(f"{title} ({', '.join(f'``{f.name}``' for f, spec in by_group if spec.group == group)})"
                       for group, title in GROUPS.items())
    fill("{option_groups}", [f"Options (keyword-only; given positionally after ``loss_fn`` they still work, "
                             f"with a ``DeprecationWarning``), by group: {groups}."], "")
    fill("{options}", [f"{f.name}: {spec.doc}" for f, spec in by_group], "    ")
    return docstring


def keyword_options(options: Callable[_P, Any]) -> Callable[
        [Callable[..., None]], Callable[Concatenate[Any, nn.Module, Callable[..., torch.Tensor], _P], None]]:
    """Gives ``__init__(self, module, loss_fn, *args, **options)`` the options' signature:
    ``inspect.signature`` and ``help()`` read its ``__signature__``, type checkers this
    decorator's type, which is ``options``' own constructor's (:class:`PipelineOptions`,
    keyword-only) after ``self, module, loss_fn``."""
    def decorate(init: Callable[..., None]) -> Any:
        hints = typing.get_type_hints(init)
        leading = [p.replace(annotation=hints.get(p.name, p.annotation))
                   for p in list(inspect.signature(init).parameters.values())[:3]]
        init.__signature__ = signature(options, *leading)  # type: ignore[attr-defined]
        return init
    return decorate
