"""Expert parallelism for experts called with their routing: ``experts(hidden_states,
top_k_index, top_k_weights)``, every parameter stacked along dim 0 by expert (transformers'
MoE experts: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...).

:class:`RoutedExpertParallel` is the ``ParallelStyle`` for them (torchtitan's
``ExpertParallel`` expects ``experts(tokens_sorted_by_expert, counts)`` instead): each ep
rank keeps ``num_experts / ep`` experts (``Shard(0)``); a call sends every ``(token,
expert)`` pair to the rank owning the expert and the results back with
``all_to_all_single``, the experts' own forward running on the received rows with local
expert ids and unit weights, the routing weights applied where the tokens live (so their
gradient stays there). Index legend: ``r`` ep rank, ``e`` expert, ``t`` token.

::

    rank r: pairs (t, e) sorted by e ──all_to_all──▶ rank e // local: rows of its experts
                                                       experts' forward (local ids, weight 1)
    rank r: Σ_k w[t, k] · out[t, k]  ◀──all_to_all── the rows' outputs, in the same order

:func:`transformers_plan` reads a transformers model's own ``ep_plan`` (its
``"ep_dispatch_experts"`` modules): what ``PipeDream(expert_parallel="auto")`` applies.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from .._dist.turns import BACKWARD, FORWARD, yield_turn
from .tensor_parallel import kept_calls

__all__ = ["EXCHANGES", "ExchangeTimes", "RoutedExpertParallel", "transformers_plan"]

# The styles of a transformers ep_plan this plan covers: the experts module's
# dispatch and the sharding of its stacked parameters (which the dispatch style does).
_DISPATCH, _STACKED = "ep_dispatch_experts", "grouped_gemm"


@dataclasses.dataclass
class ExchangeTimes:
    """What this process's ``RoutedExpertParallel`` exchanges cost since :meth:`reset`
    (benchmarks/ep_overlap.py reads them).

    Attributes:
        calls: all_to_all calls.
        wait_seconds: time blocked waiting for them: the exchange time no other work hid.
        yielded: calls during which the other half of an overlapped F&B pair ran.
    """

    calls: int = 0
    wait_seconds: float = 0.0
    yielded: int = 0

    def reset(self) -> None:
        self.calls, self.wait_seconds, self.yielded = 0, 0.0, 0


#: This process's exchanges.
EXCHANGES = ExchangeTimes()


class RoutedExpertParallel(ParallelStyle):
    """Experts ``Shard(0)`` over the ep mesh, tokens dispatched and combined by all_to_all.

    The module must have ``num_experts`` (divisible by the ep size) and parameters whose
    dim 0 is that count; its forward takes ``(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k])`` first, whatever their names (GPT-OSS: ``router_indices``,
    ``routing_weights``), and returns ``[T, H]`` (``Σ_k w · expert(x)``), and accepts
    top-1 routing (``k = 1``). Experts receiving no token are exact (their shard's
    gradient is zero).

    Args:
        replicated_tokens: every rank of the mesh holds the same tokens (a tp mesh:
            ``tensor_parallel={...: RoutedExpertParallel()}``, experts spread over the tp
            ranks), so each rank dispatches its ``1 / size`` of the rows and the results
            are gathered back (transformers' ``AllToAllEP`` over tp); ``None``: when the
            mesh's dimension is named ``"tp"``. Otherwise each rank routes its own tokens
            (``expert_parallel=``'s ep ranks are data ranks).

    Attributes:
        exchanges: what this process's exchanges cost (:class:`ExchangeTimes`, shared by
            every module this style parallelized; ``exchanges.reset()`` starts it over).
    """

    exchanges = EXCHANGES

    def __init__(self, replicated_tokens: Optional[bool] = None) -> None:
        super().__init__()
        self.src_data_rank = 0
        self.replicated_tokens = replicated_tokens

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415 - with a mesh

        experts, ep = _expert_count(module), device_mesh.size()
        arguments = list(inspect.signature(module.forward).parameters)
        if len(arguments) < 3:
            raise ValueError(f"RoutedExpertParallel: {type(module).__name__}.forward takes "
                             f"{arguments}, not (hidden_states, top_k_index, top_k_weights); "
                             "match the experts module a router calls")
        if experts % ep:
            raise ValueError(f"RoutedExpertParallel: {type(module).__name__} has {experts} experts, "
                             f"which the ep size {ep} does not divide; give a mesh whose 'ep' "
                             "dimension divides the expert count")
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0 or param.shape[0] != experts:
                raise ValueError(f"RoutedExpertParallel: {type(module).__name__}.{name} has shape "
                                 f"{tuple(param.shape)}, not one slice per expert ({experts}, ...); "
                                 "match only modules whose parameters are stacked by expert")
            shard = distribute_tensor(param.detach(), device_mesh, [Shard(0)],
                                      src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        module.num_experts = experts // ep
        # transformers' experts drop the rows of ids beyond num_experts only when told they are split.
        if hasattr(module, "_is_expert_parallel"):
            module._is_expert_parallel = True  # noqa: SLF001 - transformers' own switch
        replicated = self.replicated_tokens if self.replicated_tokens is not None else \
            tuple(device_mesh.mesh_dim_names or ()) == ("tp",)
        module.forward = _Dispatching(module, module.forward, device_mesh, replicated)
        return module


def _expert_count(module: nn.Module) -> int:
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int):
        raise ValueError(f"RoutedExpertParallel: {type(module).__name__} has no integer "
                         "num_experts; match the module holding the stacked experts")
    return count


class _Dispatching:
    """The experts' forward behind the dispatch and combine (the module's ``forward``)."""

    def __init__(self, module: nn.Module, forward: Any, mesh: Any, replicated: bool) -> None:
        self.module, self.forward, self.mesh, self.replicated = module, forward, mesh, replicated
        self.local = module.num_experts
        self.signature = inspect.signature(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The experts' own argument names (top_k_index / router_indices, ...), in their order.
        bound = self.signature.bind(*args, **kwargs)
        hidden_states, top_k_index, top_k_weights = list(bound.arguments.values())[:3]
        tokens = hidden_states.shape[0]
        if self.replicated:  # this rank's rows: a local slice, whose backward gathers the gradients
            hidden_states, top_k_index, top_k_weights = (
                _redistribute(t, self.mesh, "Replicate", "Shard") for t in (hidden_states, top_k_index, top_k_weights))
        out = self._experts(hidden_states, top_k_index, top_k_weights)
        if self.replicated:  # every rank's rows again (uneven or empty slices too)
            out = _redistribute(out, self.mesh, "Shard", "Replicate", rows=tokens)
        return out

    def _experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        rows, local_ids, order, splits = self._dispatch(hidden_states, top_k_index)
        with _local_parameters(self.module):
            if rows.shape[0]:
                out = self.forward(rows, local_ids, torch.ones_like(local_ids, dtype=rows.dtype))
            else:  # no rows: an empty result still connected to the dispatch (whose backward
                # all_to_all every ep rank runs) and to the parameters (zero gradients)
                out = rows.new_zeros(0, hidden_states.shape[-1]) + rows.sum() * 0 + \
                    sum(p.sum() * 0 for p in self.module.parameters(recurse=False))
        return self._combine(out, top_k_weights, order, splits)

    def _dispatch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Tuple[List[int], List[int]]]:
        group, ep, k = self.mesh.get_group(), self.mesh.size(), top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # pairs grouped by expert, so by rank
        counts = torch.bincount(expert_ids, minlength=self.local * ep).view(ep, self.local)
        received = _exchange(counts, None, None, group, FORWARD)
        sent_sizes, received_sizes = torch.stack([counts.sum(1), received.sum(1)]).tolist()
        rows = _Exchange.apply(hidden_states[order // k], received_sizes, sent_sizes, group)
        local_ids = torch.arange(self.local, device=rows.device).repeat(ep)
        local_ids = local_ids.repeat_interleave(received.reshape(-1)).unsqueeze(-1)
        return rows, local_ids, order, (sent_sizes, received_sizes)

    def _combine(self, out: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor,
                 splits: Tuple[List[int], List[int]]) -> torch.Tensor:
        sent_sizes, received_sizes = splits
        back = _Exchange.apply(out, sent_sizes, received_sizes, self.mesh.get_group())
        pairs = torch.empty_like(back).index_copy(0, order, back)  # (t, k) order again
        pairs = pairs.view(*top_k_weights.shape, back.shape[-1])
        return (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1).to(out.dtype)


def _exchange(tensor: torch.Tensor, output_sizes: Optional[List[int]],
              input_sizes: Optional[List[int]], group: Any, direction: int) -> torch.Tensor:
    """``all_to_all_single`` issued asynchronously; the other half of an overlapped F&B
    pair runs before it is waited for (``_runtime.overlap.yield_turn``)."""
    import torch.distributed as dist  # noqa: PLC0415 - with a mesh

    tensor = tensor.contiguous()
    rows = tensor.shape[0] if output_sizes is None else sum(output_sizes)
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    work = dist.all_to_all_single(out, tensor, output_sizes, input_sizes, group=group, async_op=True)
    yielded = yield_turn(direction)
    start = time.perf_counter()
    work.wait()
    EXCHANGES.calls += 1
    EXCHANGES.wait_seconds += time.perf_counter() - start
    EXCHANGES.yielded += int(yielded)
    return out


class _Exchange(torch.autograd.Function):
    """Rows to their ranks (``input_sizes`` to each, ``output_sizes`` from each); the
    gradients go back the same way reversed, in the backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, output_sizes: List[int], input_sizes: List[int],
                group: Any) -> torch.Tensor:
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group
        return _exchange(tensor, output_sizes, input_sizes, group, FORWARD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        output_sizes, input_sizes = ctx.sizes
        return _exchange(grad, input_sizes, output_sizes, ctx.group, BACKWARD), None, None, None


def _redistribute(tensor: torch.Tensor, mesh: Any, source: str, target: str,
                  rows: Optional[int] = None) -> torch.Tensor:
    """``tensor`` from ``source`` to ``target`` placement over ``mesh`` (``"Replicate"``
    or ``"Shard"``: rows split as DTensor splits them), as a local tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415 - with a mesh

    placements = {"Replicate": Replicate(), "Shard": Shard(0)}
    shape = None if rows is None else (rows, *tensor.shape[1:])
    stride = None if shape is None else torch.empty(shape, device="meta").stride()
    dt = DTensor.from_local(tensor.contiguous(), mesh, [placements[source]], run_check=False,
                            shape=shape, stride=stride)
    return dt.redistribute(mesh, [placements[target]]).to_local()


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor shards as their local tensors during its forward (the
    experts' code indexes them with local ids); gradients reach the shards through
    ``to_local``."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - with a mesh

    shards = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for name, shard in shards.items():
        module._parameters[name] = shard.to_local()  # noqa: SLF001 - swapped back below
    try:
        yield
    finally:
        for name, shard in shards.items():
            module._parameters[name] = shard  # noqa: SLF001


def transformers_plan(model: nn.Module) -> Dict[str, ParallelStyle]:
    """``{pattern: RoutedExpertParallel()}`` for the ``"ep_dispatch_experts"`` modules of
    a transformers model's ``ep_plan`` (``model.ep_plan``, full module names).

    Raises:
        ValueError: the model has no ``ep_plan``, or it names styles other than the
            experts' dispatch and stacked parameters (naming them), or its patterns match
            no module.
    """
    plan = getattr(model, "ep_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"expert_parallel='auto' reads a transformers model's ep_plan, and "
                         f"{type(model).__name__} has none; give expert_parallel={{pattern: "
                         "RoutedExpertParallel()}} (transformers-style experts) or "
                         "{pattern: ExpertParallel()} (torchtitan's)")
    other = sorted({f"{k}: {v}" for k, v in plan.items() if v not in (_DISPATCH, _STACKED)})
    if other:
        raise ValueError(f"expert_parallel='auto': {type(model).__name__}.ep_plan names {other}, "
                         "which only the experts' dispatch and stacked parameters are supported "
                         "beside; give expert_parallel= as a dict of ParallelStyles instead")
    out = {k: RoutedExpertParallel() for k, v in plan.items() if v == _DISPATCH}
    if not out or not kept_calls(out, model):
        raise ValueError(f"expert_parallel='auto': {type(model).__name__}.ep_plan {plan} names no "
                         "experts module of the model; give expert_parallel= as a dict")
    return out
