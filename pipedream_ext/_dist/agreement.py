"""Every rank agrees, or the run stops: at construction and at the first steps.

Owns the checks that ranks built the same pipeline and feed it the same batch,
as DDP checks (and broadcasts) what it needs. Every rank traces or slices the
model itself, so nothing but a comparison proves the ranks agree:

* **construction** (:func:`agree_at_construction`): one exchange of the
  arguments that must match and of every stage's fingerprint (``_fingerprint``:
  graph or layers, independent of node names and of the order of independent
  operations). A difference raises the same ``ValueError`` on every rank, naming
  the argument and its values per rank, or the first operation (module) of the
  first stage that differs on each side. Ranks whose graphs compute the same
  values but list those crossing a cut in another order (a ``set`` iterated
  under another ``PYTHONHASHSEED``) take rank 0's order instead;
* **the first steps** (:class:`StepAgreement`): for the first ``check_steps``
  calls, every rank says which call it is in (``step()`` number ``k``,
  ``forward_only()`` number ``k``) and fingerprints the batch it was given
  before anything is sent: ranks in different calls, or a first stage and a last
  stage given different batches (a ``DistributedSampler`` kept from a DDP script)
  or batches of different sizes, raise on every rank at once. On a ``(pp, dp)``
  mesh both run over the whole world, so that what one pipeline refuses every
  pipeline raises, and the dp ranks' batch sizes are compared too.

Payloads are JSON in uint8 tensors (``collectives.all_gather_json``): no pickle.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import collectives
from .fingerprint import (
    Entry,
    StagesFingerprint,
    digest_text,
    first_difference,
    tensor_digest,
)
from .groups import RankNames

__all__ = ["agree_at_construction", "batch_fingerprint", "StepAgreement", "unequal_dp_rows"]

_log = logging.getLogger("pipedream_ext._pipe")

_GRAPH_ADVICE = (
    "every rank traces the model itself, so its forward must compute the same thing on every "
    "rank: build the model the same way everywhere (code, config, buffers), and let nothing "
    "that differs between processes decide what the forward computes (the rank, an "
    "environment variable, a set's iteration order beyond the order of independent "
    "operations: run every rank with the same PYTHONHASHSEED to check); see "
    "docs/tracing.md#one-graph-on-every-rank")
_LAYERS_ADVICE = ("every rank must build the same model (the same code, arguments and "
                  "dtypes)")


def _same(values: Sequence[Any]) -> bool:
    texts = {json.dumps(v, sort_keys=True) for v in values}
    return len(texts) == 1


def _per_rank(values: Sequence[Any], names: Optional[RankNames] = None) -> str:
    groups: Dict[str, List[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(json.dumps(value, sort_keys=True), []).append(rank)
    names = names if names is not None else RankNames(list(range(len(values))))
    return "; ".join(f"{text} on {names.many(ranks)}" for text, ranks in groups.items())


_ABSENT = "(absent)"


def _differences(values: Sequence[Any], path: str = "") -> List[Tuple[str, List[Any]]]:
    """Where per-rank JSON values differ: for dicts, the paths (``[key]...``) of the
    differing entries, down to the first values that are not all dicts (an absent key
    reads ``"(absent)"``), a level's own values before those inside its dicts (a
    style's name before its settings); else ``[("", values)]``."""
    if not all(isinstance(v, dict) for v in values):
        return [(path, list(values))]
    leaves: List[Tuple[str, List[Any]]] = []
    nested: List[Tuple[str, List[Any]]] = []
    for key in sorted({k for v in values for k in v}):
        entries = [v.get(key, _ABSENT) for v in values]
        if not _same(entries):
            found = _differences(entries, f"{path}[{key!r}]")
            (nested if all(isinstance(e, dict) for e in entries) else leaves).extend(found)
    return leaves + nested


def _disagreement(key: str, values: Sequence[Any], names: RankNames, shown: int = 3) -> str:
    """``key is X on ranks ...; Y on ranks ...``, naming only the differing entries of a
    dict-valued argument (the first ``shown`` of them)."""
    parts = _differences(values)
    text = "; ".join(f"{key}{path} is {_per_rank(vs, names)}" for path, vs in parts[:shown])
    more = len(parts) - shown
    return text + (f" (and {more} more difference{'s' if more > 1 else ''})" if more > 0 else "")


def agree_at_construction(group: dist.ProcessGroup, config: Mapping[str, Any],
                          fingerprint: StagesFingerprint,
                          names: Optional[RankNames] = None) -> Optional[List[List[str]]]:
    """Checks that every rank of ``group`` built the same pipeline.

    Collective. Costs one all-gather of the arguments and of one 16-digit digest
    per stage and per value crossing a cut; on a mismatch of stages, one more of
    the first differing stage's entries (to name the difference).

    Args:
        group: the pipeline's group.
        config: the arguments that must match (JSON values), by name.
        fingerprint: this rank's fingerprint of every stage.
        names: how messages name ``group``'s ranks (a mesh's: ``group`` is the world,
            its ranks global, named with their mesh coordinates); default: as they are.

    Returns:
        Rank 0's order of the values crossing each cut (digests), where this rank's
        differs from it (the caller rebuilds its stages so; ``_trace.reorder_cuts``),
        else ``None``.

    Raises:
        ValueError: on every rank: the arguments, the number of stages or a stage
            differ between ranks (naming the argument's values per rank, or the
            first differing operation of the first differing stage on both sides).
    """
    rank = dist.get_rank(group)
    names = names if names is not None else RankNames(list(range(dist.get_world_size(group))))
    payload = {"config": dict(config), "kind": fingerprint.kind, "stages": fingerprint.stages,
               "cuts": fingerprint.cuts}
    gathered = collectives.all_gather_json(payload, group)
    for key in config:
        values = [g["config"].get(key) for g in gathered]
        if not _same(values):
            raise ValueError(f"{names.of_global(rank)}: ranks disagree on the pipeline "
                             f"configuration: {_disagreement(key, values, names)}; every rank "
                             "must build PipeDream with the same arguments and model")
    stages = [g["stages"] for g in gathered]
    for j in range(len(stages[0])):
        digests = [s[j] for s in stages]
        if not _same(digests):
            other = next(r for r, d in enumerate(digests) if d != digests[0])
            raise _stage_difference(group, fingerprint, j, other, names)
    if fingerprint.kind == "graph" and gathered[rank]["cuts"] != gathered[0]["cuts"]:
        moved = [k + 1 for k, (a, b) in enumerate(zip(gathered[rank]["cuts"], gathered[0]["cuts"]))
                 if a != b]
        _log.info("rank %d traced the values crossing cut%s %s in another order than rank 0 "
                  "(the same computations: a set or dict iterated in another order); they travel "
                  "in rank 0's order", rank, "s" if len(moved) > 1 else "", moved)
        return gathered[0]["cuts"]
    return None


def _stage_difference(group: dist.ProcessGroup, fingerprint: StagesFingerprint, stage: int,
                      other: int, names: RankNames) -> ValueError:
    """The error naming where ``stage`` first differs between rank 0 and rank ``other``:
    every rank gathers every rank's entries of that stage (collective) and words it alike."""
    details = collectives.all_gather_json([e.to_json() for e in fingerprint.entries(stage)],
                                           group)
    theirs, ours = first_difference([Entry.from_json(e) for e in details[other]],
                                    [Entry.from_json(e) for e in details[0]])
    what = "traced different graphs" if fingerprint.kind == "graph" else "built different models"
    there = f"`{theirs.text}`" if theirs else "nothing in its place"
    here = f"`{ours.text}`" if ours else "nothing in its place"
    if theirs and ours and theirs.text == ours.text:
        here += " (written alike: they differ in a value, a buffer of that module)"
    first, second = names.of_global(0), names.of_global(other)
    return ValueError(
        f"{names.of_global(dist.get_rank(group))}: ranks {what}: stage {stage} differs between "
        f"{first} and {second}: {second} has {there} where {first} has {here}; "
        + (_GRAPH_ADVICE if fingerprint.kind == "graph" else _LAYERS_ADVICE))


def _describe_value(value: Any) -> Dict[str, Any]:
    """Rows (dim 0 of the first tensor) and a digest of every leaf of a batch structure."""
    leaves = pytree.tree_leaves(value)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    rows = int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else None
    parts = [tensor_digest(t) if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    return {"rows": rows, "digest": digest_text(" ".join(parts))}


def batch_fingerprint(inputs: Any, targets: Any) -> Dict[str, Any]:
    """What a rank was given for one step: rows and digests of inputs and targets
    (``None`` for what was not given)."""
    return {"inputs": None if inputs is None else _describe_value(inputs),
            "targets": None if targets is None else _describe_value(targets)}


class StepAgreement:
    """Checks, for the first calls, that every rank is in the same call with the same batch.

    Args:
        group: the ranks that agree: the pipeline's group, or on a ``(pp, dp)`` mesh the
            whole world (every pipeline: what one refuses, all raise; ``names``).
        first_ranks: the ranks holding stage 0 (its replicas), in the pipeline's group.
        last_ranks: the ranks holding the last stage (its replicas), likewise.
        check_steps: how many ``step()`` (and ``forward_only()``) calls are checked
            (0: none).
        names: on a mesh, its pipelines and how messages name ranks (``group`` is then
            the world); ``None``: ``group`` is the one pipeline.
        tp_size: a mesh's tp size (1 without).
        validate: this rank's own checks of a call's arguments, ``validate(call, inputs,
            targets)``; what it raises is raised on every rank (``None``: none).
    """

    def __init__(self, group: dist.ProcessGroup, first_ranks: Sequence[int],
                 last_ranks: Sequence[int], check_steps: int,
                 names: Optional[RankNames] = None, tp_size: int = 1,
                 validate: Optional[Callable[[str, Any, Any], None]] = None) -> None:
        self.group = group
        self.validate = validate
        self.rank = dist.get_rank(group)
        self.first_ranks, self.last_ranks = list(first_ranks), list(last_ranks)
        self.check_steps = check_steps
        self.names = names if names is not None else \
            RankNames(list(range(dist.get_world_size(group))))
        #: Each pipeline's ranks in ``group`` (one pipeline without a mesh).
        self.pipelines = self.names.pipelines or [list(range(dist.get_world_size(group)))]
        self.calls: Dict[str, int] = {"step": 0, "forward_only": 0}
        #: Pipelines per dp coordinate (a mesh's tp size): consecutive pipelines
        #: ``dp * tp_size + tp`` must be given the same batch.
        self.tp_size = tp_size

    def check(self, call: str, inputs: Any, targets: Any) -> None:
        """Agrees on call ``call`` (``"step"`` or ``"forward_only"``) before it runs.

        Collective for the first ``check_steps`` calls of each kind; free after.

        Args:
            call: ``"step"`` or ``"forward_only"``.
            inputs: what this rank was given (``None``: nothing).
            targets: likewise.

        Raises:
            ValueError: on every rank: ranks in different calls, an argument a rank
                refused, a first and a last stage given different batches, or (on a
                mesh) dp ranks given batches of different sizes (naming the ranks, the
                fingerprints or sizes and the fix).
        """
        index = self.calls[call]
        self.calls[call] = index + 1
        if index >= self.check_steps or dist.get_world_size(self.group) == 1:
            return  # the call's own checks raise on this rank
        me = self.names.of_global(self.rank)
        error = None
        if self.validate is not None:
            try:
                self.validate(call, inputs, targets)
            except ValueError as exc:
                error = str(exc) if str(exc).startswith(me) else f"{me}: {exc}"
        mine = {"call": f"{call}() number {index}", "error": error,
                **batch_fingerprint(inputs, targets)}
        gathered = collectives.all_gather_json(mine, self.group)
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:
            raise ValueError("; ".join(dict.fromkeys(errors)))
        calls = [g["call"] for g in gathered]
        if not _same(calls):
            raise ValueError(
                f"{me}: ranks are in different calls: {_per_rank(calls, self.names)}; every "
                "rank must call step() and forward_only() the same number of times, in the "
                "same order (a call on one rank only, or an extra one, leaves its peers waiting)")
        if call == "step":
            for pipeline in self.pipelines:
                self._check_batch([gathered[r] for r in pipeline], pipeline, index)
            if self.tp_size > 1:
                self._check_tp_batches(gathered, index)
            if len(self.pipelines) > 1:
                self._check_dp_rows(gathered, index)

    def _check_tp_batches(self, gathered: List[Dict[str, Any]], index: int) -> None:
        """The tp ranks of each dp coordinate were given one batch: stage 0's inputs and
        the last stage's targets equal on every tp rank (tensor parallelism splits the
        weights, not the batch)."""
        for d in range(0, len(self.pipelines), self.tp_size):
            group = self.pipelines[d:d + self.tp_size]
            for kind, ranks in (("inputs", self.first_ranks), ("targets", self.last_ranks)):
                seen = [(p[ranks[0]], (gathered[p[ranks[0]]][kind] or {}).get("digest"))
                        for p in group]
                if len({digest for _, digest in seen}) > 1:
                    each = ", ".join(f"{self.names.of_global(r)} {digest}" for r, digest in seen)
                    raise ValueError(
                        f"{self.names.of_global(self.rank)}: step() number {index}: the tp ranks "
                        f"of dp coordinate {d // self.tp_size} were given different {kind} "
                        f"(fingerprints: {each}); tensor parallelism splits the weights, not the "
                        "batch: give every tp rank of a dp coordinate the same batch "
                        "(DistributedSampler(dataset, num_replicas=pipe.data_parallel_size, "
                        "rank=pipe.data_parallel_rank), which counts dp x ep on an expert-parallel mesh)")

    def _check_batch(self, gathered: List[Dict[str, Any]], ranks: List[int], index: int) -> None:
        """One pipeline's first and last stages were given one batch (``gathered``: its
        ranks' entries, ``ranks``: their ranks in ``group``)."""
        me = self.names.of_global(self.rank)
        for f in self.first_ranks:
            for l in self.last_ranks:
                a, b = gathered[f], gathered[l]
                first, last = self.names.of_global(ranks[f]), self.names.of_global(ranks[l])
                rows_in = (a["inputs"] or {}).get("rows")
                rows_out = (b["targets"] or {}).get("rows")
                if rows_in is not None and rows_out is not None and rows_in != rows_out:
                    raise ValueError(
                        f"{me}: step() number {index}: stage 0 on {first} was given "
                        f"inputs of {rows_in} rows but the last stage on {last} targets of "
                        f"{rows_out} rows; give every rank the same batch (inputs and targets "
                        "of one batch)")
                if f == l:
                    continue
                for kind in ("targets", "inputs"):
                    if a[kind] is not None and b[kind] is not None:
                        if a[kind]["digest"] != b[kind]["digest"]:
                            raise ValueError(
                                f"{me}: step() number {index}: stage 0 on {first} and the last "
                                f"stage on {last} were given different batches ({kind} "
                                f"fingerprints {a[kind]['digest']} and {b[kind]['digest']}): "
                                "a pipeline needs the same batch on every rank (stage 0 uses "
                                "its inputs, the last stage its targets). A DistributedSampler "
                                f"kept from a DDP script gives each rank other samples: {self._sampler}")
                        break

    @property
    def _sampler(self) -> str:
        if len(self.pipelines) == 1:
            return ("use DistributedSampler(dataset, num_replicas=1, rank=0, seed=...) or the "
                    "same sampler and seed on every rank")
        return (f"on a mesh each pipeline is one data-parallel rank: use DistributedSampler("
                f"dataset, num_replicas={len(self.pipelines)}, rank=mesh['dp'].get_local_rank(), "
                "seed=...), the same seed on every rank")

    def _check_dp_rows(self, gathered: List[Dict[str, Any]], index: int) -> None:
        """Every pipeline (dp rank) of a mesh was given as many rows: each averages its
        own batch and the dp ranks' means are averaged, which is the global batch's mean
        only when the batches are equal."""
        sizes = [(gathered[p[self.first_ranks[0]]]["inputs"] or {}).get("rows")
                 for p in self.pipelines]
        if None in sizes or len(set(sizes)) == 1:
            return
        raise ValueError(
            f"{self.names.of_global(self.rank)}: step() number {index}: the data-parallel ranks "
            "were given batches of different sizes: " + unequal_dp_rows(
                self.names, [p[self.first_ranks[0]] for p in self.pipelines], sizes))


def unequal_dp_rows(names: RankNames, leaders: Sequence[int], rows: Sequence[Any]) -> str:
    """Why dp ranks given batches of different sizes train wrong, and the fix: the message
    of both checks (the first steps' agreement and ``MeshSteps`` after them).

    Args:
        names: the mesh's rank names.
        leaders: each pipeline's stage-0 rank, in ``dp * tp_size + tp`` order.
        rows: each dp rank's rows.
    """
    tp = names.tp_size  # with tensor parallelism, each dp rank's tp pipelines in a row
    each = ", ".join(f"dp {d // tp} ({names.of_global(r)}) {n} rows"
                     for d, (r, n) in enumerate(zip(leaders, rows)))
    return (f"{each}; each pipeline averages its own rows and the dp ranks' means are averaged, which "
            "weights the rows of a smaller batch more than the unsplit model on the global batch would: "
            f"give every dp rank the same number of rows (a DistributedSampler(dataset, num_replicas="
            f"{len(leaders) // tp}, rank=mesh['dp'].get_local_rank()) gives each rank as many, its last batch "
            "included)")
