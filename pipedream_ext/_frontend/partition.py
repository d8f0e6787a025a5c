"""How an ``nn.Sequential`` is cut into stages: ``Partition`` and its arithmetic.

Owns the balance (layers per stage), the chunks (stages per rank, interleaved), the
replicas (ranks per stage) and the checks that they fit the world size.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

__all__ = ["even_balance", "Partition", "resolve_partition"]


def even_balance(num_layers: int, num_stages: int) -> List[int]:
    """Splits ``num_layers`` into ``num_stages`` contiguous parts differing by at most one."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if j < extra else 0) for j in range(num_stages)]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Layers and replicas per stage.

    Attributes:
        balance: layers per stage, in model order.
        replicas: ranks per stage (all 1 without data parallelism).
        replicated: whether ``replicas`` was given (the schedule is then built
            with a replicated layout, even if every count is 1).
    """

    balance: List[int]
    replicas: List[int]
    replicated: bool

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    def bounds(self) -> List[int]:
        """``[0, end of stage 0, end of stage 1, ...]`` in layers."""
        out = [0]
        for count in self.balance:
            out.append(out[-1] + count)
        return out

    def layer_range(self, stage: int) -> str:
        """``"first-last"`` layer indices of ``stage`` (inclusive), for messages."""
        start = sum(self.balance[:stage])
        return f"{start}-{start + self.balance[stage] - 1}"


def _check_replicas(replicas: Sequence[int], chunks: int, world_size: int) -> List[int]:
    replicas = [int(r) for r in replicas]
    if chunks != 1:
        raise ValueError("replicas cannot be combined with chunks > 1 (several stages per rank)")
    if any(r < 1 for r in replicas):
        raise ValueError(f"replicas {replicas} has a count below 1; every stage needs >= 1")
    if sum(replicas) != world_size:
        raise ValueError(f"replicas {replicas} need {sum(replicas)} ranks but the world has "
                         f"{world_size}; launch {sum(replicas)} ranks or change replicas")
    return replicas


def resolve_partition(num_layers: int, world_size: int, chunks: int = 1,
                      balance: Optional[Sequence[int]] = None,
                      replicas: Optional[Sequence[int]] = None) -> Partition:
    """Checks and completes a partition of ``num_layers`` over ``world_size`` ranks.

    Args:
        num_layers: children of the ``nn.Sequential``.
        world_size: ranks of the pipeline's group.
        chunks: stages per rank (which stages a rank holds is the schedule's layout,
            ``schedules.Schedule.stages_of_rank``; nothing here assumes a placement).
        balance: layers per stage, or ``None`` for an even split.
        replicas: ranks per stage, or ``None`` for one each.

    Returns:
        The partition.

    Raises:
        ValueError: counts that do not fit the model or the world (the message
            names the value and the fix).
    """
    num_stages = world_size * chunks
    stage_replicas = [1] * num_stages
    if replicas is not None:
        stage_replicas = _check_replicas(replicas, chunks, world_size)
        num_stages = len(stage_replicas)
    if balance is None:
        if num_layers < num_stages:
            raise ValueError(
                f"the model has {num_layers} layers but {num_stages} stages are needed "
                f"({world_size} ranks x {chunks} chunks); use fewer ranks or chunks")
        balance = even_balance(num_layers, num_stages)
    balance = [int(b) for b in balance]
    if len(balance) != num_stages:
        fix = (f"launch {len(balance) // chunks} ranks" if len(balance) % chunks == 0
               else f"give a multiple of chunks={chunks} counts")
        raise ValueError(
            f"balance lists {len(balance)} stages but the world has {world_size} ranks "
            f"x {chunks} chunks = {num_stages} stages; give one layer count per stage or {fix}")
    if any(b < 1 for b in balance):
        raise ValueError(f"balance {balance} has a stage with no layers; every stage needs >= 1")
    if sum(balance) != num_layers:
        raise ValueError(f"balance {balance} sums to {sum(balance)} but the model has "
                         f"{num_layers} layers; make the counts add up to {num_layers}")
    return Partition(balance, stage_replicas, replicas is not None)
