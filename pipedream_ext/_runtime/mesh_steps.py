"""Keeps a mesh's pipelines in step: every ``step()`` call and every dp rank's batch size.

On a ``("pp", "dp")`` mesh each pipeline runs its own ``step()`` calls, joined to the
others only by FSDP's (or the replicas') collectives and the batch-loss all-reduce,
which pair by order, not by step. A pipeline that skips a call (a ``step()`` that
raised on its ranks, caught and passed over) would pair its step ``k + 1`` with the
other pipelines' step ``k`` from then on, and dp ranks given batches of different
sizes would average their means as if equal; both train silently wrong.

So the batch-loss all-reduce, which runs over every rank after every step anyway,
carries two more things: each rank's ``step()`` call number (one slot per rank) and
the rows of each pipeline's batch (one slot per dp rank, from its stage 0), a few
float64 values. Their sums name every rank's call and every dp rank's rows, so a rank
that reads them needs no other exchange to say who differs. The first
``check_agreement`` steps (and every step with ``check_finite``) wait for the
all-reduce and raise before ``step()`` returns; later steps check it when the loss is
read, and at the latest at the start of the next step but one (by then it has long
finished: the wait costs nothing).

With tensor parallelism every tp rank of a dp coordinate must be given the same batch
(the first ``check_agreement`` steps compare fingerprints in ``StepAgreement``); the
same all-reduce then also carries each pipeline's batch fingerprint (its inputs' on
stage 0, its targets' on the last stage: 52 bits of the batch's digest each, exact in
float64), so a later step given different batches on its tp ranks fails as well, naming
the step and the ranks, instead of training each tp rank's shards on another batch.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Deque, List, Optional, Tuple, Union

import torch

from .._dist.agreement import batch_fingerprint, unequal_dp_rows
from .._dist.groups import RankNames
from .step_loss import StepLoss

__all__ = ["MeshSteps", "PipelineSteps", "StepMismatch"]


class StepMismatch(RuntimeError):
    """The mesh's ranks were in different ``step()`` calls, or its dp ranks were given
    batches of different sizes, in a step that ran (found after it ran)."""


class PipelineSteps:
    """The batch loss's all-reduce of one pipeline (no mesh): the loss and a failure flag,
    nothing else to keep in step; :class:`MeshSteps` adds the mesh's checks."""

    def values(self, loss: float, failed: bool, call: int, rows: Optional[int]) -> torch.Tensor:
        """What this rank adds to the all-reduce: its loss share and whether it failed.

        Args:
            loss: this rank's share of the batch loss.
            failed: a bad loss found on this rank.
            call: this rank's ``step()`` call number (unused: one pipeline).
            rows: the batch's rows on stage 0's rank (unused: one pipeline).
        """
        return torch.tensor([loss, 1.0 if failed else 0.0], dtype=torch.float64)

    def in_background(self, loss: float, call: int, rows: Optional[int]
                      ) -> Tuple[Union[float, torch.Tensor], Optional[Callable[[torch.Tensor], None]]]:
        """What a step whose loss is summed in the background all-reduces, and the check
        of the sum when read: the loss alone, unchecked."""
        return loss, None

    def check(self, total: torch.Tensor) -> None:
        """Nothing to check: one pipeline."""

    def track(self, loss: StepLoss) -> StepLoss:
        return loss

    def note_batch(self, inputs: Any, targets: Any) -> None:
        """Nothing to note: one pipeline."""

    def check_before_step(self) -> None:
        """Nothing to check: one pipeline."""


class MeshSteps(PipelineSteps):
    """This rank's part of the check: the values it adds and the test of the sums.

    Args:
        names: the mesh's pipelines and how messages name ranks.
        rank: this rank's global rank.
    """

    def __init__(self, names: RankNames, rank: int) -> None:
        assert names.pipelines is not None
        self.names = names
        self.pipelines = names.pipelines
        self.rank = rank
        self.world = sum(len(p) for p in self.pipelines)
        self.dp = len(self.pipelines)
        self.dp_rank = next(d for d, p in enumerate(self.pipelines) if rank in p)
        #: Losses whose all-reduce is not checked yet (oldest first).
        self.pending: Deque[StepLoss] = collections.deque()
        self.tp_size = names.tp_size
        #: This step's batch fingerprints (inputs, targets) where this rank saw them.
        self._batch: List[Optional[float]] = [None, None]

    def note_batch(self, inputs: Any, targets: Any) -> None:
        """Keeps this step's fingerprints of what this rank was given (``None``: not
        given here) for :meth:`values`; with tensor parallelism only (free without).

        Args:
            inputs: the batch's inputs on stage 0's rank, else ``None``.
            targets: the batch's targets on the last stage's rank, else ``None``.
        """
        if self.tp_size > 1:
            seen = batch_fingerprint(inputs, targets)
            self._batch = [None if seen[k] is None else float(int(seen[k]["digest"][:13], 16))
                           for k in ("inputs", "targets")]

    def values(self, loss: float, failed: bool, call: int, rows: Optional[int]) -> torch.Tensor:
        """What this rank adds to the sum: ``[loss, failed, call per rank..., rows per dp
        rank...]`` and with tensor parallelism ``[inputs' fingerprint per pipeline...,
        targets' fingerprint per pipeline...]`` (float64; its own slots only, zeros elsewhere).

        Args:
            loss: this rank's share of the batch loss.
            failed: a bad loss was found on this rank.
            call: this ``step()`` call's number (counting calls that raised).
            rows: the batch's rows on stage 0's rank, else ``None``.
        """
        prints = 2 * self.dp if self.tp_size > 1 else 0
        t = torch.zeros(2 + self.world + self.dp + prints, dtype=torch.float64)
        t[0], t[1] = loss, 1.0 if failed else 0.0
        t[2 + self.rank] = call
        if rows is not None:
            t[2 + self.world + self.dp_rank] = rows
        for k, value in enumerate(self._batch if prints else ()):
            if value is not None:
                t[2 + self.world + (k + 1) * self.dp + self.dp_rank] = value
        self._batch = [None, None]
        return t

    def check(self, total: torch.Tensor) -> None:
        """Raises unless every rank was in one call with equal batches per dp rank.

        Args:
            total: the all-reduced values (:meth:`values` summed over every rank).

        Raises:
            StepMismatch: naming each rank's call or each dp rank's rows, and the fix.
        """
        calls = [int(c) for c in total[2:2 + self.world].tolist()]
        rows = [int(n) for n in total[2 + self.world:2 + self.world + self.dp].tolist()]
        me = self.names.of_global(self.rank)
        if len(set(calls)) > 1:
            raise StepMismatch(
                f"{me}: the ranks of the mesh are in different step() calls: "
                f"{self._by_value(calls, lambda c: f'step() number {c}')}. Every pipeline of a "
                "mesh pairs its collectives (FSDP's, the replicas', the batch loss's) with the "
                "others' by order, so from the step where one pipeline made a call the others did "
                "not (a step() that raised on some ranks and was caught), its batches met other "
                "steps' batches and the gradients were not the unsplit model's; a step() that "
                "raises on any rank must end the run, or be caught on every rank alike (the "
                "first check_agreement steps raise argument errors on every rank)")
        if len(set(rows)) > 1:
            raise StepMismatch(
                f"{me}: step() number {calls[0]} ran with batches of different sizes on the "
                "data-parallel ranks, so its gradients are not the unsplit model's: "
                + unequal_dp_rows(self.names, [p[0] for p in self.pipelines], rows))
        if self.tp_size > 1:
            self._check_tp_batches(total[2 + self.world + self.dp:].tolist(), calls[0])

    def _check_tp_batches(self, prints: List[float], call: int) -> None:
        """Every tp rank of a dp coordinate was given one batch: equal fingerprints of
        stage 0's inputs and of the last stage's targets over its pipelines.

        Raises:
            StepMismatch: naming the step, the dp coordinate and each rank's fingerprint.
        """
        tp = self.tp_size
        for kind, offset in (("inputs", 0), ("targets", self.dp)):
            for d in range(0, self.dp, tp):
                seen = [(c - d, prints[offset + c]) for c in range(d, d + tp)]
                if len({value for _, value in seen}) > 1:
                    each = ", ".join(f"tp {t} ({self.names.many(self.pipelines[d + t])}) {int(v):013x}"
                                     for t, v in seen)
                    raise StepMismatch(
                        f"{self.names.of_global(self.rank)}: step() number {call}: the tp ranks of "
                        f"dp coordinate {d // tp} were given different {kind} (fingerprints: "
                        f"{each}), so each tp rank trained its shards on another batch and the "
                        "weights are no longer the unsplit model's; tensor parallelism splits the "
                        "weights, not the batch: give every tp rank of a dp coordinate the same "
                        "batch (DistributedSampler(dataset, num_replicas=pipe.data_parallel_size, "
                        "rank=pipe.data_parallel_rank), which counts dp x ep on an expert-parallel mesh)")

    def _by_value(self, values: List[int], word: Callable[[int], str]) -> str:
        groups: "collections.OrderedDict[int, List[int]]" = collections.OrderedDict()
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        return "; ".join(f"{self.names.many(ranks)} in {word(value)}"
                         for value, ranks in groups.items())

    def in_background(self, loss: float, call: int, rows: Optional[int]
                      ) -> Tuple[Union[float, torch.Tensor], Optional[Callable[[torch.Tensor], None]]]:
        """The loss with this rank's call and rows, checked when the sum is read."""
        return self.values(loss, False, call, rows), self.check

    def track(self, loss: StepLoss) -> StepLoss:
        """Keeps ``loss`` (its all-reduce still running) to check before later steps."""
        self.pending.append(loss)
        return loss

    def check_before_step(self) -> None:
        """Checks every tracked loss but the newest (waiting, within the timeout, for
        an all-reduce a step older than the last: finished in any run that is in step).

        Raises:
            StepMismatch: what :meth:`check` raises.
            RuntimeError: the all-reduce failed or timed out.
        """
        while len(self.pending) > 1:
            self.pending.popleft().wait()
