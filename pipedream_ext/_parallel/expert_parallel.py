"""Expert parallelism inside the stages: a plan (torchtitan's ``ExpertParallel`` on the
experts) applied over ``mesh["ep"]``, the ep ranks data ranks for everything else.

On a ``("pp", "ep")`` or ``("pp", "dp", "ep")`` mesh every ``(dp, ep)`` coordinate runs
its own copy of the pipeline on its own part of the batch (``ParallelDims``). The plan
shards the matched modules' parameters over the stage's ep group (``Shard(0)``: each ep
rank its experts) and dispatches tokens to them and back with ``all_to_all``
(the style's hooks, which run because a traced stage keeps those modules as calls).
Gradients then differ by kind (``ReplicatedStages``):

* dense parameters: every copy holds them whole; averaged over all ``dp x ep`` copies;
* expert shards: a shard's gradient already sums the contributions of every ep rank's
  tokens (the combine's all_to_all carries them back), so it is all-reduced over the
  ranks holding the same shard (``expert_dp_group``, the dp coordinates) and divided by
  the same ``dp x ep`` (pytorch issue 160285: dividing by dp alone leaves them ``ep``
  times too large).
"""
from __future__ import annotations

from typing import Any, Iterable, List, Tuple

import torch

from .._dist.collectives import is_dtensor
from .._dist.turns import FORWARD, yield_turn
from .._frontend.local_stages import LocalStages
from .dims import ParallelDims
from .tensor_parallel import TensorParallel, check_plan, kept_calls, pattern_matches

#: ``expert_parallel="auto"``: the plan a transformers model's own ``ep_plan`` gives.
AUTO = "auto"

__all__ = ["apply_expert_parallel", "check_option", "check_plan_matches", "meta_tracing_refused", "resolve_auto",
           "split_experts"]


def check_option(plan: Any, options: Any) -> None:
    """``PipelineOptions.expert_parallel``'s check (no process group needed).

    Raises:
        ValueError: a plan that is neither a dict of ``ParallelStyle`` nor a callable, or
            what it does not support yet, naming the value and the fix.
    """
    check_plan({} if _is_auto(plan) else plan, options, "expert_parallel", "'layers.*.moe.experts'",
               "torchtitan's ExpertParallel(), RoutedExpertParallel()", "ep_mesh")


def resolve_auto(plan: Any, module: torch.nn.Module) -> Any:
    """``expert_parallel="auto"`` as the plan it stands for: :class:`RoutedExpertParallel`
    on the experts a transformers model's ``ep_plan`` names (``routed_experts``); any
    other plan as it is.

    Raises:
        ValueError: ``"auto"`` for a model without a usable ``ep_plan`` (naming why).
    """
    if not _is_auto(plan):
        return plan
    from .routed_experts import transformers_plan  # noqa: PLC0415 - DTensor only with a plan

    return transformers_plan(module)


def _is_auto(plan: Any) -> bool:
    return isinstance(plan, str) and plan == AUTO


def check_plan_matches(plan: Any, module: torch.nn.Module) -> None:
    """Every pattern of a dict plan names some module of the model, checked before the
    model is traced (the experts it should keep as calls would fail the tracer first).

    Raises:
        ValueError: naming the patterns that match nothing.
    """
    if plan is None:
        return
    if not isinstance(plan, dict):
        return
    names = [n for n, _ in module.named_modules() if n]
    missing = [k for k in plan if not any(pattern_matches(k, n) for n in names)]
    if missing:
        raise ValueError(
            f"expert_parallel pattern{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(k) for k in missing)} match{'es' if len(missing) == 1 else ''} no "
            "module of the model; patterns are fnmatch patterns over model.named_modules() names "
            "('*' one name component), e.g. 'layers.*.moe.experts'")


def meta_tracing_refused(module: torch.nn.Module, error: Exception) -> ValueError:
    """Why tracing a model on the meta device with ``expert_parallel=`` failed: tracing
    runs the model on meta values, which routing code that needs the tokens' values
    (``bincount``, ``tolist()``: torchtitan's MoE) or a kernel without a float32 meta path
    (transformers' default ``grouped_mm``) cannot.

    Returns:
        The error to raise (``error`` as its cause).
    """
    return ValueError(
        f"expert_parallel= with this model ({type(module).__name__}) on the meta device is not "
        f"supported yet: tracing runs it on meta values and failed ({type(error).__name__}: "
        f"{str(error)[:300]}); routing that needs the tokens' values (bincount, tolist()) cannot "
        "run there. Build the model for real, or make its experts' forward run on meta "
        "(transformers: experts_implementation='batched_mm' in the config)")


def apply_expert_parallel(stages: LocalStages, dims: ParallelDims) -> None:
    """The plan applied to this rank's stages over its ep group (each stage's modules
    as ``parallelize_module(model, mesh["ep"], plan)`` gives them), agreed over the mesh.

    Args:
        stages: this rank's stages (materialised).
        dims: the run's dims (its plan, ep mesh and groups).

    Raises:
        ValueError: on every rank: a pattern that names no module of any stage, a stage
            split differently on its ranks, or a plan that raised on some rank
            (``TensorParallel.apply``).
    """
    TensorParallel(dims.expert_parallel, dims.ep_mesh, dims.plan_group, dims.names, dims.timeout,
                   option="expert_parallel").apply({j: stages[j] for j in stages})
    for j in stages:
        _yield_around(stages[j], dims.expert_parallel)


def _yield_around(stage: torch.nn.Module, plan: Any) -> None:
    """Each module a dict plan parallelizes with a style that does not yield itself
    (torchtitan's ``ExpertParallel``) yields an overlapped F&B pair's turn after the
    style's input hook (its token dispatch, an asynchronous functional collective, in
    flight) and after its output hook (the combine): the other half computes meanwhile.
    Registered after the style's own hooks, so they run after them; nothing outside a pair."""
    from .routed_experts import RoutedExpertParallel  # noqa: PLC0415 - DTensor, with a plan

    modules = dict(stage.named_modules())
    for name in kept_calls(plan, stage):
        styles = [style for pattern, style in plan.items() if pattern_matches(pattern, name)]
        if all(isinstance(style, RoutedExpertParallel) for style in styles):
            continue  # yields at each of its exchanges itself
        modules[name].register_forward_pre_hook(_yield_forward)
        modules[name].register_forward_hook(_yield_forward)


def _yield_forward(*_: Any) -> None:
    yield_turn(FORWARD)


def split_experts(params: Iterable[torch.nn.Parameter], dims: ParallelDims
                  ) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
    """``params`` as (dense, expert shards): an expert shard is a ``DTensor`` over the ep
    mesh (what the plan made of the experts' parameters); without expert parallelism
    every parameter is dense.

    Returns:
        The two lists, each in ``params``' order.
    """
    dense: List[torch.nn.Parameter] = []
    experts: List[torch.nn.Parameter] = []
    for p in params:
        on_ep = dims.ep_enabled and is_dtensor(p) and \
            "ep" in (p.device_mesh.mesh_dim_names or ())
        (experts if on_ep else dense).append(p)
    return dense, experts
