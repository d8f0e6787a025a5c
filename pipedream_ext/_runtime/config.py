"""The pipeline's arguments, checked once: ``PipelineConfig``.

Owns the argument checks of :class:`~pipedream_ext.PipeDream` that need no
process group (schedule, microbatches, chunks, timeout, precision, finite
checks). What a schedule permits comes from its traits (``csrc/core/traits.h``),
never from comparing names. Pure: tested in one process.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

import torch

from .. import _C, schedules
from .grad_clip import parse_clip_option

__all__ = ["PipelineConfig"]


def _names_with(flag: str) -> str:
    return " or ".join(f"schedule={t.name!r}" for t in _C.all_schedule_traits()
                       if getattr(t, flag))


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The checked arguments of a pipeline (see :class:`PipeDream` for each).

    Attributes:
        schedule: the schedule's name.
        traits: what the schedule means (``schedules.traits(schedule)``).
        microbatches: microbatches per batch (``pipedream``: per minibatch update).
        chunks: model chunks per rank.
        timeout: seconds any wait on another rank may take.
        vertical_sync: ``pipedream``'s vertical sync.
        recompute: recompute activations in the backward.
        autocast: reduced-precision compute dtype, or ``None``.
        check_finite: ``None``, ``"raise"`` or ``"skip"``.
        loss_reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over a batch.
        check_agreement: the first calls of ``step()`` and ``forward_only()`` on which
            every rank agrees on the call and the batch (``_agree.StepAgreement``).
        clip_grad_norm: asynchronous schedules (``pipedream-2bw``; construction checks the
            rest): ``(max_norm, norm_type)`` every update's gradients are clipped to
            (``grad_clip.GradientClipper``), or ``None``.
    """

    schedule: str
    traits: Any
    microbatches: int
    chunks: int = 1
    timeout: float = 300.0
    vertical_sync: bool = False
    recompute: bool = False
    autocast: Optional[torch.dtype] = None
    check_finite: Optional[str] = None
    loss_reduction: str = "mean"
    check_agreement: int = 3
    clip_grad_norm: Optional[Tuple[float, float]] = None

    @classmethod
    def checked(cls, schedule: str, microbatches: int, chunks: int = 1, timeout: float = 300.0,
                vertical_sync: bool = False, recompute: bool = False,
                autocast: Optional[torch.dtype] = None,
                check_finite: Optional[str] = None, loss_reduction: str = "mean",
                check_agreement: int = 3, clip_grad_norm: Any = None) -> "PipelineConfig":
        """Checks the arguments and returns the config.

        Raises:
            ValueError: a bad value; the message names it and the fix.
        """
        runnable = schedules.synchronous_names() + schedules.asynchronous_names()
        if schedule not in runnable:
            raise ValueError(f"schedule {schedule!r} is not supported by the runtime; choose one "
                             f"of {', '.join(runnable)}")
        traits = schedules.traits(schedule)
        if vertical_sync and not traits.supports_vertical_sync:
            raise ValueError(f"vertical_sync=True needs {_names_with('supports_vertical_sync')} "
                             f"(got {schedule!r})")
        if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast={autocast!r} is not a reduced-precision dtype; use "
                             "torch.bfloat16 or torch.float16 (or None for full precision)")
        if autocast == torch.float16 and traits.asynchronous:
            raise ValueError(f"autocast=torch.float16 needs loss scaling, which schedule "
                             f"{schedule!r} does not support; use autocast=torch.bfloat16")
        if check_finite not in (None, "raise", "skip"):
            raise ValueError(f"check_finite={check_finite!r}; use None, 'raise' or 'skip'")
        if check_finite == "skip" and traits.asynchronous:
            raise ValueError(f"check_finite='skip' needs a flush schedule (got {schedule!r}); "
                             "use check_finite='raise'")
        if chunks != 1 and not traits.multi_chunk:
            raise ValueError(f"chunks={chunks} needs {_names_with('multi_chunk')} "
                             f"(got {schedule!r})")
        if traits.fixed_chunks and chunks != traits.fixed_chunks:
            raise ValueError(f"schedule {schedule!r} places exactly {traits.fixed_chunks} chunks "
                             f"per rank in a V (rank r holds stages r and 2p-1-r; got "
                             f"chunks={chunks}); use chunks={traits.fixed_chunks}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer (got {microbatches!r})")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a finite number of seconds > 0 (got {timeout!r}): "
                             "every wait on another rank needs a bound so that a dead or stuck "
                             "rank fails the others instead of hanging them; e.g. timeout=600")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' (loss_fn averages over "
                             "the batch, the default) or 'sum' (it adds)")
        if isinstance(check_agreement, bool) or not isinstance(check_agreement, int) or \
                check_agreement < 0:
            raise ValueError(f"check_agreement must be a number of steps >= 0 (got "
                             f"{check_agreement!r}); 0 turns the check of the first steps off")
        clip = parse_clip_option(clip_grad_norm)
        if clip is not None and not traits.asynchronous:
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} is for asynchronous schedules, which "
                             f"step the optimizer themselves; with schedule {schedule!r} you step it: "
                             "call pd.clip_grad_norm_(pipe, max_norm) between pipe.step(x, y) and "
                             "opt.step()")
        return cls(schedule, traits, microbatches, chunks, float(timeout), bool(vertical_sync),
                   bool(recompute), autocast, check_finite, loss_reduction, check_agreement, clip)

    @property
    def asynchronous(self) -> bool:
        """The runtime steps the optimizer inside the pipeline (no flush per step)."""
        return bool(self.traits.asynchronous)

    @property
    def microbatches_per_step(self) -> int:
        """Microbatches one ``step`` call admits (``pipedream``: 1)."""
        return int(self.traits.microbatches_per_step(self.microbatches))
