"""Tensors of a meta-built pipeline nothing set: refused at the first step, on every rank.

Deferred initialisation (``_frontend.deferred_init``) fills every new tensor with a
sentinel (NaN; integers: the byte ``0xA5``). With ``init_fn``, parameters and
persistent buffers it leaves alone keep it until a state dict sets them; a tensor
that no ``load_state_dict`` set (``strict=False``, a partial file) would make the
first step's loss NaN and train on it. So the first ``step()`` or ``forward_only()``
of such a pipeline looks for the sentinel in this rank's stages and, if any rank
finds one, every rank raises the same error naming every such tensor per rank (one
bounded exchange, ``collectives.gather_outcomes``); after it passed once, nothing is
checked again. A ``load_state_dict`` that leaves some unset logs a warning at once.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch.distributed as dist
from torch import nn

from .._dist import collectives
from .._dist.groups import RankNames
from .._frontend.deferred_init import unset_tensors

__all__ = ["UnsetCheck"]

_log = logging.getLogger("pipedream_ext._pipe")

_MESSAGE = (
    "{call}(): tensors built on the meta device were never set (they still hold the NaN, "
    "for integers the 0xA5 bytes, every new tensor starts as): {found}; nothing set them: "
    "not init_fn (it may leave parameters and persistent buffers to a state dict), nor a load "
    "(load_state_dict(strict=False) lists what it did not bring in missing_keys). Set them "
    "before training: in init_fn, with pipe.load_state_dict(a state dict holding them), or in "
    "place through pipe.named_parameters() / pipe.named_buffers()")


class UnsetCheck:
    """The first call's check that no tensor of a meta-built pipeline is still unset.

    Args:
        module: returns this rank's stages as one module (``pipe.module``).
        group: the ranks that raise together (the first calls' agreement group).
        timeout: seconds a rank waits for the others.
        pending: whether to check at all (the model was built on the meta device).
        names: how messages name ranks (a mesh's), else ``group``'s ranks as they are.
    """

    def __init__(self, module: Callable[[], nn.Module], group: dist.ProcessGroup, timeout: float,
                 pending: bool, names: Optional[RankNames] = None) -> None:
        self.module, self.group, self.timeout, self.names = module, group, timeout, names
        #: Still to be checked (until a call found every tensor set on every rank).
        self.pending = pending

    def _rank(self, rank: int) -> str:
        """How messages name global rank ``rank``."""
        return self.names.of_global(rank) if self.names is not None else f"rank {rank}"

    def check(self, call: str) -> None:
        """Collective while pending: every rank raises if any rank's stages hold an unset
        tensor; afterwards free.

        Args:
            call: ``"step"`` or ``"forward_only"``, for the message.

        Raises:
            ValueError: on every rank, naming each rank's unset tensors and the fix.
            RuntimeError: a rank failed looking, or a peer did not arrive within the timeout.
        """
        if not self.pending:
            return
        error: Optional[BaseException] = None
        unset: List[str] = []
        try:
            unset = unset_tensors(self.module())
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        gathered = collectives.gather_outcomes(error, self.group, self.timeout, f"{call}()",
                                               payload=unset, names=self.names)
        found = [f"{self._rank(dist.get_global_rank(self.group, r))}: {', '.join(map(repr, names))}"
                 for r, names in enumerate(gathered) if names]
        if found:
            raise ValueError(_MESSAGE.format(call=call, found="; ".join(found)))
        self.pending = False

    def after_load(self, what: str) -> None:
        """Warns (this rank) about tensors a load left unset; the first call refuses them.

        Args:
            what: the load, for the message (``"load_state_dict"``).
        """
        if not self.pending:
            return
        unset = unset_tensors(self.module())
        if unset:
            _log.warning("%s left tensors of this rank unset; step() and forward_only() refuse "
                         "them until they are set: %s", what,
                         _MESSAGE.format(call=what, found=", ".join(map(repr, unset))))
