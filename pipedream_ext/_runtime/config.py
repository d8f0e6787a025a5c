"""The pipeline's options as the runtime reads them, checked once: ``PipelineConfig``.

The checks that need no process group (schedule, microbatches, chunks, timeout,
precision, finite checks) live with their options (``_runtime/options.py``); what a
schedule permits comes from its traits (``csrc/core/traits.h``), never from comparing
names. Pure: tested in one process.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple, Union

import torch

from .. import schedules
from .loss_reduction import LossReduction
from .options import PipelineOptions, checked

__all__ = ["PipelineConfig"]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The options the runtime reads, checked: typed fields named as the options whose
    ``Option.convert`` gives their value here (``_runtime/options.py`` documents each, as
    ``PipeDream``'s docstring shows it), plus the schedule's traits.

    Attributes:
        traits: what the schedule means (``schedules.traits(schedule)``).
        microbatches: (as every other field: the option, checked) ``pipedream``: per minibatch update.
        timeout: a float.
        clip_grad_norm: ``(max_norm, norm_type)`` (``grad_clip.parse_clip_option``), or ``None``.
        loss_reduction: the options ``loss_reduction`` and ``tokens_fn`` as one object
            (``loss_reduction.from_option``): the runtime asks it, never compares the name.
    """

    schedule: str
    traits: Any
    microbatches: int
    chunks: int
    timeout: float
    vertical_sync: bool
    overlap: Any
    recompute: Union[bool, Tuple[bool, ...]]
    autocast: Optional[torch.dtype]
    check_finite: Optional[str]
    loss_reduction: LossReduction
    check_agreement: int
    clip_grad_norm: Optional[Tuple[float, float]]

    @classmethod
    def checked(cls, schedule: str, microbatches: int, **options: Any) -> "PipelineConfig":
        """Checks the options (each field's check, ``_runtime.options``) and returns the config.

        Args:
            schedule: the schedule's name.
            microbatches: microbatches per batch.
            **options: any other :class:`~pipedream_ext._runtime.options.PipelineOptions`.

        Raises:
            ValueError: a bad value; the message names it and the fix.
        """
        return cls.of(PipelineOptions(schedule=schedule, microbatches=microbatches, **options))

    @classmethod
    def of(cls, options: PipelineOptions) -> "PipelineConfig":
        """The runtime's view of ``options``, checked (see :meth:`checked`)."""
        values = checked(options)
        return cls(traits=schedules.traits(options.schedule), **values)

    def recompute_stages(self, num_stages: int) -> List[bool]:
        """Whether each of the pipeline's ``num_stages`` stages recomputes its forward.

        Raises:
            ValueError: ``recompute`` lists another number of stages.
        """
        if isinstance(self.recompute, bool):
            return [self.recompute] * num_stages
        if len(self.recompute) != num_stages:
            raise ValueError(f"recompute={list(self.recompute)} lists {len(self.recompute)} stages but "
                             f"the pipeline has {num_stages}; give one bool per stage, or True / "
                             "False for all")
        return list(self.recompute)

    def rank_recomputes(self, stages_of_rank: List[List[int]]) -> List[bool]:
        """Whether each rank recomputes (the executor decides per rank), from the stages
        each rank runs.

        Raises:
            ValueError: ``recompute`` lists another number of stages, or the stages one
                rank runs differ (naming the rank, its stages and the fix).
        """
        per_stage = self.recompute_stages(1 + max(j for stages in stages_of_rank for j in stages))
        out = []
        for rank, stages in enumerate(stages_of_rank):
            values = {per_stage[j] for j in stages}
            if len(values) > 1:
                raise ValueError(f"recompute={list(per_stage)} recomputes some but not all of stages "
                                 f"{list(stages)}, which rank {rank} runs (schedule {self.schedule!r}, "
                                 f"chunks={self.chunks}); a rank recomputes all its stages or none: "
                                 f"give the same value to stages {list(stages)}")
            out.append(values.pop() if values else False)
        return out

    @property
    def asynchronous(self) -> bool:
        """The runtime steps the optimizer inside the pipeline (no flush per step)."""
        return bool(self.traits.asynchronous)

    @property
    def microbatches_per_step(self) -> int:
        """Microbatches one ``step`` call admits (``pipedream``: 1)."""
        return int(self.traits.microbatches_per_step(self.microbatches))
