"""Loss scaling for ``autocast=torch.float16`` on a flush schedule: ``attach_grad_scaler``.

Each rank sees only its own stages' gradients, so the scaler is a
``ShardedGradScaler`` over the pipeline's group: an overflow on any rank skips
the step on every rank. The runner hands it to every step's context (``StepSettings``),
and the stage function scales the last stage's loss with it.
"""
from __future__ import annotations

from typing import Any, Iterable, Union

import torch
import torch.distributed as dist

from .config import PipelineConfig
from .stage_call import StepSettings

__all__ = ["attach_grad_scaler"]


def attach_grad_scaler(config: PipelineConfig, settings: StepSettings,
                       parameters: Iterable[torch.Tensor], group: dist.ProcessGroup,
                       device: torch.device, rank: Union[int, str], **kwargs: Any) -> Any:
    """Makes the pipeline's loss scaler and puts it in the runner's step settings.

    Args:
        config: the pipeline's checked arguments.
        settings: the runner's step settings; every later step's context scales the
            loss with the scaler.
        parameters: this rank's parameters.
        group: the pipeline's group.
        device: this rank's device.
        rank: this rank, for messages (or its name: ``"rank 3 (pp 1, dp 1)"``).
        **kwargs: passed on to ``ShardedGradScaler`` (``init_scale``, ...).

    Returns:
        The :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`.

    Raises:
        ValueError: an asynchronous schedule, or a rank without parameters.
    """
    # Imported here: torch.distributed.fsdp takes ~0.6 s to import (every rank, every
    # run), and only float16 training needs it.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415 - heavy, optional

    if config.asynchronous:
        raise ValueError(f"schedule {config.schedule!r} updates inside the pipeline; loss "
                         "scaling needs a flush schedule (or use autocast=torch.bfloat16)")
    if not any(True for _ in parameters):
        name = rank if isinstance(rank, str) else f"rank {rank}"
        raise ValueError(f"{name}'s stages have no parameters, so it cannot step a "
                         "scaler; give every stage parameters (balance=...)")
    scaler = ShardedGradScaler(device=device.type, process_group=group, **kwargs)
    # The scale is created lazily by scale(), which only the last stage calls;
    # every rank's step()/update() needs it.
    scaler.scale(torch.ones((), device=device))
    settings.grad_scaler = scaler
    return scaler
