"""Creating the default process group so that torchrun restarts work.

Under ``torchrun`` the workers share the agent's TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default), and that store lives
across restarts: ``init_process_group`` in a restarted worker writes and reads
the same keys as the failed attempt, so Gloo can pick up a dead process's
address and fail ("Gloo connectFullMesh failed ... Connection refused") or hang
(torch 2.13, reproduced with a plain init_process_group + barrier script; setting
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun also avoids it).
:func:`init_process_group` puts every key of the attempt under its own prefix,
``pipedream_ext/attempt_<TORCHELASTIC_RESTART_COUNT>/``; outside torchrun's
agent store it is plain ``init_process_group(backend, timeout=...)``.
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["init_process_group", "uses_agent_store"]


def uses_agent_store() -> bool:
    """Whether this process is a torchrun worker on the agent's (long-lived) store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """Initialises the default group from the torchrun / env:// environment.

    Under the agent's store, the attempt's keys get their own prefix (see the
    module docstring), so a restarted job never reads a previous attempt's keys.
    """
    if not uses_agent_store():
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"pipedream_ext/attempt_{attempt}/", store)
    dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world_size,
                            timeout=timeout)
