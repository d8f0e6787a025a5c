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
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from . import _C

__all__ = ["NCCL_RULES", "register_nccl_rules_backend"]

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
