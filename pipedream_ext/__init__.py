"""pipedream_ext: pipeline-parallel training in the style of PipeDream."""
import importlib
import logging
import os
from typing import TYPE_CHECKING, Any, List

from . import schedules
from ._extension import _C as _C  # re-exported: tests and users reach the extension as pipedream_ext._C
from ._frontend.deferred_init import layer_seed, materialize
from ._pipe import NonFiniteError, PipeDream, clip_grad_norm_
from ._planning.profiler import profile
from ._runtime.aux_loss import add_aux_loss, aux_loss_scale
from ._runtime.step_loss import StepLoss
from .planner import Plan, ProfileGraph, Stage, Topology, load_profile, plan

if TYPE_CHECKING:
    from ._checkpoint import (
        CheckpointError,
        CheckpointInfo,
        PendingCheckpoint,
        consolidate,
        detect,
        load_checkpoint,
        save_checkpoint,
        save_pretrained,
    )
    from ._parallel.routed_experts import RoutedExpertParallel

__all__ = [
    "schedules",
    "PipeDream",
    "clip_grad_norm_",
    "NonFiniteError",
    "StepLoss",
    "Plan",
    "ProfileGraph",
    "Stage",
    "Topology",
    "load_profile",
    "plan",
    "profile",
    "save_checkpoint",
    "load_checkpoint",
    "consolidate",
    "save_pretrained",
    "detect",
    "CheckpointError",
    "CheckpointInfo",
    "PendingCheckpoint",
    "materialize",
    "layer_seed",
    "add_aux_loss",
    "aux_loss_scale",
    "RoutedExpertParallel",
    "yield_turn",
]
__version__ = "0.1.0"

# The checkpoint calls and the DTensor styles, imported on first use (PEP 562): DCP,
# DTensor and safetensors cost a second of start-up, and a process that never saves
# needs none of them (tests/test_import_cost.py).
_LAZY_NAMES = {
    **dict.fromkeys(("save_checkpoint", "load_checkpoint", "consolidate", "save_pretrained", "detect",
                     "CheckpointError", "CheckpointInfo", "PendingCheckpoint"), "._checkpoint"),
    "RoutedExpertParallel": "._parallel.routed_experts",
    "yield_turn": "._dist.turns",
}


def __getattr__(name: str) -> Any:
    """A checkpoint call or a DTensor style, imported from its module on first use.

    Raises:
        AttributeError: not a public name of this package.
    """
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


def _configure_logging_from_env() -> None:
    """``PIPEDREAM_LOG=debug|info|warning`` sets this package's log level (and adds a
    stderr handler if logging is not configured): ``debug`` logs every action run."""
    level = os.environ.get("PIPEDREAM_LOG")
    if not level:
        return
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"PIPEDREAM_LOG={level!r} is not a logging level; use debug, info, "
                         "warning or error")
    logger = logging.getLogger(__name__)
    logger.setLevel(value)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


_configure_logging_from_env()
