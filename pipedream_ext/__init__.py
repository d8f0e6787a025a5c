"""pipedream_ext: pipeline-parallel training in the style of PipeDream."""
import torch  # noqa: F401  (loads libc10/libtorch that _C links against)

from . import _C  # noqa: F401  (fail early if the extension is not built)
from . import schedules
from ._checkpoint import CheckpointError, CheckpointInfo, consolidate, load_checkpoint, save_checkpoint
from ._pipe import NonFiniteError, PipeDream
from ._profiler import profile
from .planner import Plan, ProfileGraph, Stage, Topology, load_profile, plan

__all__ = [
    "schedules",
    "PipeDream",
    "NonFiniteError",
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
    "CheckpointError",
    "CheckpointInfo",
]
__version__ = "0.1.0"
