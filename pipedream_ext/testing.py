"""Testing a pipeline on CPU as it would run on NCCL.

NCCL's point-to-point rules differ from Gloo's: no message tags (the k-th send
from rank a to rank b meets the k-th receive at b from a) and one stream per
pair of ranks on which operations run one at a time in issue order. Code that
works on Gloo can hang on NCCL at step 1, and one GPU cannot host two NCCL
ranks to show it. The ``nccl_rules`` backend keeps those rules on the CPU
(``csrc/runtime/nccl_rules_backend.h``: what it imitates and what it does not);
collectives go to an inner Gloo group unchanged::

    import pipedream_ext.testing as pdt
    pdt.register_nccl_rules_backend()
    dist.init_process_group("nccl_rules")       # under torchrun, CPU tensors
    pipe = pd.PipeDream(model, loss_fn, schedule="1f1b", microbatches=4)

A pipeline on such a group exchanges its metadata over a Gloo group it creates
itself, as it does on a group the user created with NCCL alone.

Also a few looks at the C++ core for benchmarks and tests (public, so that they
need no private import): :func:`asynchronous_layout_error` (the runtime's own check
of a ``pipedream``/``pipedream-2bw`` layout), :func:`count_antichain_states` (the
size of PipeDream's planning state space) and :class:`SplitBackward` (a backward
run as its input pass then its weight pass, as zero-bubble schedules run it).
"""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

from ._extension import _C

__all__ = ["NCCL_RULES", "SplitBackward", "asynchronous_layout_error", "count_antichain_states",
           "register_nccl_rules_backend"]

NCCL_RULES = "nccl_rules"


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> "_C.NcclRulesBackend":
    inner = dist.ProcessGroupGloo(dist.PrefixStore(f"{NCCL_RULES}/gloo", store), rank, size, timeout)
    return _C.NcclRulesBackend(inner, rank, size, timeout.total_seconds())


def register_nccl_rules_backend() -> str:
    """Registers the ``nccl_rules`` backend with torch.distributed (idempotent).

    Returns:
        The backend's name, for ``init_process_group`` and ``new_group``.
    """
    if NCCL_RULES not in dist.Backend.backend_list:
        dist.Backend.register_backend(NCCL_RULES, _create, devices=["cpu"])
    return NCCL_RULES


#: A backward in two passes: ``input_pass(outputs, grads, inputs, weights)`` computes
#: the inputs' gradients (I), then ``weight_pass()`` the weights' (W). One object per
#: backward.
SplitBackward = _C.SplitBackward


def asynchronous_layout_error(schedule: str, stages: int, microbatches: int, replicas: Sequence[int],
                              vertical_sync: bool = False) -> Optional[str]:
    """The runtime's own check of an asynchronous schedule's layout, without a process group.

    ``PipeDream`` runs ``pipedream`` and ``pipedream-2bw`` from an action feed whose
    construction checks the layout; this builds that feed alone.

    Args:
        schedule: ``pipedream`` or ``pipedream-2bw``.
        stages: pipeline stages.
        microbatches: microbatches per step.
        replicas: replica count per stage.
        vertical_sync: ``pipedream`` only: vertical weight synchronisation.

    Returns:
        None if the runtime accepts the layout, else its error message.
    """
    try:
        _C.AsyncActionFeed(schedule, stages=stages, microbatches=microbatches, replicas=list(replicas),
                       vertical_sync=vertical_sync)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def count_antichain_states(graph: "_C.ProfileGraph", limit: int) -> int:
    """The number of antichain states PipeDream's planner would search on ``graph``.

    Args:
        graph: a profile, e.g. from :func:`pipedream_ext.load_profile`.
        limit: stop counting past this many.

    Returns:
        The count, or a negative number when it exceeds ``limit``.
    """
    return int(_C.count_antichain_states(graph, limit))
