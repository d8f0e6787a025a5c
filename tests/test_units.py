"""Single-process tests of the pipeline's pure parts: partitioning, local stages,
argument checks, schedule traits, targets, the stage function, plans -> stages
(stats merging: tests/cpp/test_runtime_stats.cpp). No process group: a change to these is checked in seconds."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import re
import typing
import warnings
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipedream_ext import _C, PipeDream, configuration, schedules
from pipedream_ext._cli import schedule as schedule_cli
from pipedream_ext._dist.groups import RankNames
from pipedream_ext._frontend.local_stages import LocalStages
from pipedream_ext._frontend.partition import even_balance, resolve_partition
from pipedream_ext._frontend.tied_params import (
    alias_names,
    canonical_names,
    describe,
    find_shared,
)
from pipedream_ext._parallel.data_parallel import DataParallel, ReplicatedStages
from pipedream_ext._parallel.dims import ParallelDims, mesh_pipelines
from pipedream_ext._parallel.fsdp import FsdpStages, keep_unsharded_after
from pipedream_ext._parallel.parallelize import data_parallel_policy
from pipedream_ext._parallel.tensor_parallel import CutLayout, LayoutExchange
from pipedream_ext._planning.startup import cluster_shape, partition_from_plan
from pipedream_ext._runtime import options
from pipedream_ext._runtime.config import PipelineConfig
from pipedream_ext._runtime.eval_outputs import merge_microbatch_outputs
from pipedream_ext._runtime.loss_reduction import MeanLoss, SumLoss
from pipedream_ext._runtime.options import PipelineOptions
from pipedream_ext._runtime.stage_call import (
    NonFiniteError,
    StageFunction,
    StepCallback,
    StepContext,
    Targets,
    check_batch,
    split_microbatches,
)
from pipedream_ext.planner import plan


# -- partitioning -----------------------------------------------------------------------
@pytest.mark.parametrize("layers,stages,expected", [
    (10, 4, [3, 3, 2, 2]), (4, 4, [1, 1, 1, 1]), (7, 2, [4, 3]), (5, 1, [5])])
def test_even_balance(layers: int, stages: int, expected: list) -> None:
    assert even_balance(layers, stages) == expected


def test_resolve_partition_defaults_and_bounds() -> None:
    p = resolve_partition(10, 4)
    assert (p.balance, p.replicas, p.replicated) == ([3, 3, 2, 2], [1, 1, 1, 1], False)
    assert p.bounds() == [0, 3, 6, 8, 10]
    assert [p.layer_range(j) for j in range(4)] == ["0-2", "3-5", "6-7", "8-9"]
    interleaved = resolve_partition(8, 2, chunks=2)
    assert interleaved.balance == [2, 2, 2, 2] and interleaved.num_stages == 4
    replicated = resolve_partition(6, 4, balance=[2, 2, 2], replicas=[2, 1, 1])
    assert (replicated.replicas, replicated.replicated) == ([2, 1, 1], True)
    # Replicas of all 1 still mean a replicated layout was asked for.
    assert resolve_partition(4, 2, replicas=[1, 1]).replicated


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_layers=3, world_size=4), "the model has 3 layers but 4 stages are needed"),
    (dict(num_layers=6, world_size=2, balance=[2, 2, 2]), "balance lists 3 stages but the world has 2"),
    (dict(num_layers=6, world_size=2, balance=[6, 0]), "has a stage with no layers"),
    (dict(num_layers=6, world_size=2, balance=[2, 3]), "sums to 5 but the model has 6 layers"),
    (dict(num_layers=6, world_size=3, replicas=[2, 2]), "need 4 ranks but the world has 3"),
    (dict(num_layers=6, world_size=2, replicas=[2, 0]), "has a count below 1"),
    (dict(num_layers=6, world_size=2, chunks=2, replicas=[1, 1]), "cannot be combined with chunks"),
])
def test_resolve_partition_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_partition(**kwargs)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def test_local_stages_keep_original_names_and_parameters() -> None:
    model = _model()
    partition = resolve_partition(5, 2, balance=[2, 3])
    stages = LocalStages(model, partition, [1], torch.device("cpu"))
    assert list(stages) == [1] and 1 in stages and 0 not in stages
    assert stages.layers == {1: (2, 5)}
    assert stages.parameter_names(1) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert [n for n, _ in stages.module.named_parameters()] == ["2.weight", "2.bias", "4.weight",
                                                                 "4.bias"]
    # The kept layers are the model's own modules (same tensors), not copies.
    assert stages.parameters_of(1)[0] is model[2].weight
    both = LocalStages(model, resolve_partition(5, 1, chunks=2, balance=[2, 3]), [0, 1],
                       torch.device("cpu"))
    assert list(both.module.state_dict()) == list(model.state_dict())
    assert set(both.parameters_by_stage()) == {0, 1}


def _tied_model() -> nn.Sequential:
    """0 Embedding, 1 Linear, 2 Linear tied to 1 (same stage or not), 3 head tied to 0."""
    emb, a, b, head = nn.Embedding(7, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 7)
    b.weight = a.weight
    head.weight = emb.weight
    return nn.Sequential(emb, a, b, head)


def test_find_shared_lists_parameters_of_several_stages() -> None:
    model = _tied_model()
    # Stages [0, 1] [2] [3]: both ties cross stages.
    shared = find_shared(model, resolve_partition(4, 3, balance=[2, 1, 1]))
    assert [(sp.names, sp.stages) for sp in shared] == [
        (("0.weight", "3.weight"), (0, 2)), (("1.weight", "2.weight"), (0, 1))]
    assert describe(shared[0]) == "0.weight and 3.weight (stages 0 and 2)"
    assert alias_names(shared) == {"3.weight": "0.weight", "2.weight": "1.weight"}
    assert canonical_names(shared)["3.weight"] == "0.weight"
    # Stages [0] [1, 2] [3]: 1/2 are tied within one stage, as in the unsplit model.
    shared = find_shared(model, resolve_partition(4, 3, balance=[1, 2, 1]))
    assert [(sp.names, sp.stages) for sp in shared] == [(("0.weight", "3.weight"), (0, 2))]
    # Interleaved: stages 0 and 2 are on one rank, still two stages.
    shared = find_shared(model, resolve_partition(4, 2, chunks=2, balance=[1, 1, 1, 1]))
    assert [sp.stages for sp in shared] == [(0, 3), (1, 2)]
    assert find_shared(model, resolve_partition(4, 1)) == []
    # Every stage keeps the same Parameter object; a rank holding two of them lists it once.
    stages = LocalStages(model, resolve_partition(4, 2, chunks=2, balance=[1, 1, 1, 1]), [0, 3],
                         torch.device("cpu"))
    assert stages[0][0].weight is stages[3][0].weight is model[0].weight
    assert [n for n, _ in stages.module.named_parameters()] == ["0.weight", "3.bias"]


def test_a_v_layout_keeps_the_first_and_last_stage_on_rank_0() -> None:
    """The stages a rank keeps come from the schedule's layout (zbv: r and 2p-1-r), not
    from a formula; LocalStages keeps them in model order under the original names."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    partition = resolve_partition(4, 2, chunks=2)
    v = schedules.build("zbv", stages=2, microbatches=2, chunks=2)
    assert [v.stages_of_rank(r) for r in range(2)] == [[0, 3], [1, 2]]
    stages = LocalStages(model, partition, v.stages_of_rank(0), torch.device("cpu"))
    assert list(stages) == [0, 3] and stages.layers == {0: (0, 1), 3: (3, 4)}
    assert [n for n, _ in stages.module.named_parameters()] == ["0.weight", "0.bias", "3.weight",
                                                                 "3.bias"]


# -- arguments and traits ------------------------------------------------------------
def test_schedule_families_come_from_the_traits_table() -> None:
    assert schedules.synchronous_names() == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv",
                                             "dualpipev", "interleaved-zb"]
    assert schedules.asynchronous_names() == ["pipedream", "pipedream-2bw"]
    assert [t.name for t in _C.all_schedule_traits()] == schedules.names()
    pd, bw, zb = (schedules.traits(n) for n in ("pipedream", "pipedream-2bw", "zb-h1"))
    assert (pd.microbatches_per_step(8), bw.microbatches_per_step(8)) == (1, 8)
    assert (pd.replica_reduction, bw.replica_reduction) == ("mean", "sum")
    assert pd.stash_weights and pd.streaming and pd.supports_vertical_sync
    assert zb.split_backward and zb.planner_straight and zb.supports_replicas
    assert not schedules.traits("zbv").supports_replicas
    assert bw.planner_two_versions and not bw.supports_vertical_sync
    with pytest.raises(ValueError, match="gpipe"):
        schedules.traits("nope")


def test_config_checks_name_the_value_and_the_fix() -> None:
    c = PipelineConfig.checked("pipedream-2bw", 4)
    assert c.asynchronous and c.microbatches_per_step == 4
    assert PipelineConfig.checked("pipedream", 4).microbatches_per_step == 1
    cases = [
        (dict(schedule="nope", microbatches=2), "schedule 'nope' is not supported by the runtime"),
        (dict(schedule="1f1b", microbatches=2, vertical_sync=True),
         "vertical_sync=True needs schedule='pipedream'"),
        (dict(schedule="1f1b", microbatches=2, chunks=2),
         "chunks=2 needs schedule='interleaved-1f1b'"),
        (dict(schedule="pipedream", microbatches=2, autocast=torch.float16), "needs loss scaling"),
        (dict(schedule="1f1b", microbatches=2, autocast=torch.float32), "not a reduced-precision"),
        (dict(schedule="pipedream", microbatches=2, check_finite="skip"), "needs a flush schedule"),
        (dict(schedule="1f1b", microbatches=2, check_finite="maybe"), "check_finite='maybe'"),
        (dict(schedule="1f1b", microbatches=0), "microbatches must be a positive integer"),
        (dict(schedule="1f1b", microbatches=2, timeout=0), "timeout must be a finite number of seconds > 0"),
        (dict(schedule="zbv", microbatches=2), r"exactly 2 chunks per rank in a V .*use chunks=2"),
        (dict(schedule="dualpipev", microbatches=4, chunks=3), r"got chunks=3\); use chunks=2"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            PipelineConfig.checked(**kwargs)


def test_signature_docstring_cli_and_agreement_come_from_the_options() -> None:
    # Every option is one PipelineOptions field: PipeDream's signature (keyword-only, with its
    # default and type), its docstring's Args and the schedule CLI's help read the fields.
    fields = dataclasses.fields(PipelineOptions)
    params = inspect.signature(PipeDream).parameters
    assert list(params)[:2] == ["module", "loss_fn"]
    assert list(params)[2:] == [f.name for f in fields]
    for f in fields:
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[f.name].default == f.default
        assert params[f.name].annotation == typing.get_type_hints(PipelineOptions)[f.name]
        doc = " ".join(f.metadata["option"].doc.split())
        assert f"\n        {f.name}: " in PipeDream.__doc__, f.name
        assert doc[:60] in " ".join(PipeDream.__doc__.split()), f.name
    assert "{options}" not in PipeDream.__doc__ and "{option_groups}" not in PipeDream.__doc__
    assert list(inspect.signature(PipeDream.__init__).parameters)[:3] == ["self", "module", "loss_fn"]
    commands = argparse.ArgumentParser().add_subparsers()
    schedule_cli.register(commands)
    text = "".join(commands.choices["schedule"].format_help().split())  # argparse wraps at hyphens
    for name in ("microbatches", "chunks", "replicas", "vertical_sync"):
        assert "".join(options.summary(name).split()) in text, name
    # The runtime's view holds exactly the options with a convert; the agreement those with agreed.
    converted = {f.name for f in fields if f.metadata["option"].convert is not None}
    assert {f.name for f in dataclasses.fields(PipelineConfig)} - {"traits"} == converted
    agreed = options.agreed_values(PipelineOptions(autocast=torch.bfloat16, clip_grad_norm=None))
    assert agreed["autocast"] == "torch.bfloat16" and agreed["clip_grad_norm"] is None
    assert {"schedule", "microbatches", "check_agreement"} <= set(agreed)
    positions = sorted(f.metadata["option"].position for f in fields
                       if f.metadata["option"].position is not None)
    assert positions == list(range(len(positions)))  # the old positional order, without gaps


def test_options_positional_use_warns_and_unknown_names_are_refused() -> None:
    with pytest.warns(DeprecationWarning, match=r"pass schedule='1f1b', microbatches=4 as keywords"):
        given = options.from_call("PipeDream", ("1f1b", 4), {"timeout": 5})
    assert given == {"schedule": "1f1b", "microbatches": 4, "timeout": 5}
    with pytest.warns(DeprecationWarning, match=r"pass schedule='gpipe' as a keyword"):
        options.from_call("PipeDream", ("gpipe",), {})
    # The old signature's 3rd option was balance, its 26th clip_grad_norm.
    with pytest.warns(DeprecationWarning, match=r"balance=\[1, 1\]"):
        assert options.from_call("PipeDream", ("1f1b", 2, [1, 1]), {})["balance"] == [1, 1]
    with pytest.warns(DeprecationWarning):
        assert list(options.from_call("PipeDream", tuple(range(26)), {}))[-1] == "clip_grad_norm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.from_call("PipeDream", (), {"microbatches": 2}) == {"microbatches": 2}
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'microbatch'; did you mean "
                                            r"'microbatches'\?"):
            options.from_call("PipeDream", (), {"microbatch": 2})
        with pytest.raises(TypeError, match=r"'check_agrement'; did you mean 'check_agreement'"):
            PipeDream(nn.Sequential(nn.Linear(2, 2)), F.mse_loss, check_agrement=1)
    with pytest.raises(TypeError, match="multiple values for argument 'schedule'"):
        options.from_call("PipeDream", ("1f1b",), {"schedule": "gpipe"})
    with pytest.raises(TypeError, match="at most 26 options positionally"):
        options.from_call("PipeDream", tuple(range(27)), {})


# -- targets and the stage function -----------------------------------------------------
def test_split_microbatches_and_targets() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    parts = split_microbatches((x, x + 1), 2, torch.device("cpu"), "inputs")
    assert [p[0].shape[0] for p in parts] == [3, 2] and torch.equal(parts[1][1], x[3:] + 1)
    with pytest.raises(ValueError, match="inputs has batch size 5, smaller than microbatches=6"):
        split_microbatches(x, 6, torch.device("cpu"), "inputs")
    t = Targets()
    t.add(torch.arange(5), 2, 4, torch.device("cpu"))
    assert len(t) == 2 and t[4][1] == pytest.approx(3 / 5) and t[5][1] == pytest.approx(2 / 5)
    t.drop_before(5)
    assert len(t) == 1 and torch.equal(t[5][0], torch.tensor([3, 4]))


def test_inputs_without_the_batch_dimension_are_named() -> None:
    x, bank = torch.zeros(6, 2), torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"inputs 1 \('memory'\) has 5 rows in dim 0 but the batch "
                                         r"has 6 rows \(inputs 0 \('x'\): \(6, 2\)\).*register it "
                                         r"as a buffer"):
        check_batch((x, bank), 2, "inputs", ["x", "memory"])
    with pytest.raises(ValueError, match=r"inputs 1 is 0-dimensional"):
        check_batch((x, torch.tensor(1.0)), 2, "inputs")
    with pytest.raises(ValueError, match=r"inputs 1 is a dict, not a tensor"):
        check_batch((x, {"a": x}), 2, "inputs")
    check_batch((x, x), 2, "inputs")


def _stage_fn(model: nn.Sequential, check: str = None, at_once: bool = False) -> StageFunction:
    stages = LocalStages(model, resolve_partition(5, 1, chunks=2, balance=[2, 3]), [0, 1],
                         torch.device("cpu"))
    return StageFunction(stages, F.cross_entropy, 2, torch.device("cpu"), check,
                         raise_at_once=at_once, rank=0)


def _context() -> StepContext:
    return StepContext(0, Targets())


def test_stage_function_loss_is_the_unsplit_models_share() -> None:
    model = _model()
    fn, ctx = _stage_fn(model), _context()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    ctx.targets.add(y, 2, 0, torch.device("cpu"))
    hidden = fn(ctx, 0, 0, [x[:3]], [])
    loss0 = fn(ctx, 1, 0, hidden, [])[0]
    loss1 = fn(ctx, 1, 1, fn(ctx, 0, 1, [x[3:]], []), [])[0]
    assert torch.allclose(loss0 + loss1, F.cross_entropy(model(x), y))
    # On a stashed weight version the stage runs functionally on those tensors.
    zeros = [torch.zeros_like(t) for t in fn.stages.parameters_of(0)]
    assert torch.equal(fn(ctx, 0, 0, [x[:3]], zeros)[0], torch.zeros(3, 5))
    ctx.evaluating = True
    assert fn(ctx, 1, 0, hidden, [])[0].shape == (3, 3)


def test_stage_function_finds_the_first_non_finite_stage() -> None:
    model = _model()
    fn, ctx = _stage_fn(model, check="raise"), _context()
    ctx.targets.add(torch.zeros(2, dtype=torch.long), 1, 0, torch.device("cpu"))
    nan = torch.full((2, 4), math.nan)
    out = fn(ctx, 0, 0, [nan], [])
    fn(ctx, 1, 0, out, [])
    assert ctx.nonfinite_forward == 0
    eager = _stage_fn(model, check="raise", at_once=True)
    with pytest.raises(NonFiniteError, match=r"forward output of stage 0 \(layers 0-1\)"):
        eager(_context(), 0, 0, [nan], [])


def test_stage_function_refuses_bad_losses_and_checks_the_reduction() -> None:
    model = _model()
    y = torch.randint(0, 3, (6,))
    cases = [(lambda out, t: F.cross_entropy(out, t).item(), "returned a float"),
             (lambda out, t: (F.cross_entropy(out, t), out), "returned a tuple"),
             (lambda out, t: F.cross_entropy(out, t, reduction="none"),
              "returned a tensor of shape \\(3,\\)"),
             (lambda out, t: F.cross_entropy(out, t, reduction="sum"), "sums over the batch")]
    for loss_fn, message in cases:
        fn, ctx = _stage_fn(model), _context()
        fn.loss_fn = loss_fn
        ctx.targets.add(y, 2, 0, torch.device("cpu"))
        loss = fn(ctx, 1, 0, fn(ctx, 0, 0, [torch.randn(3, 4)], []), [])[0]
        assert float(loss.detach()) == 0.0 and loss.requires_grad  # the step still ends
        assert re.search(message, str(ctx.deferred_error)), (message, ctx.deferred_error)
        eager, ctx = _stage_fn(model, at_once=True), _context()
        eager.loss_fn = loss_fn
        ctx.targets.add(y, 2, 0, torch.device("cpu"))
        with pytest.raises(ValueError, match=r"rank 0: step 0: loss_fn " + message):
            eager(ctx, 1, 0, eager(ctx, 0, 0, [torch.randn(3, 4)], []), [])
    # A summed loss with loss_reduction="sum": unscaled shares, no complaint.
    stages = LocalStages(model, resolve_partition(5, 1, chunks=2, balance=[2, 3]), [0, 1],
                         torch.device("cpu"))
    fn = StageFunction(stages, lambda out, t: F.cross_entropy(out, t, reduction="sum"), 2,
                       torch.device("cpu"), None, raise_at_once=True, rank=0,
                       loss_reduction=SumLoss())
    ctx = StepContext(0, Targets(SumLoss()))
    ctx.targets.add(y, 2, 0, torch.device("cpu"))
    x = torch.randn(6, 4)
    total = sum(fn(ctx, 1, i, fn(ctx, 0, i, [x[3 * i:3 * i + 3]], []), [])[0] for i in range(2))
    assert torch.allclose(total, F.cross_entropy(model(x), y, reduction="sum"))


def test_each_call_has_its_own_context_and_the_stage_function_keeps_none() -> None:
    """The executor's callback runs forwards with the context bound for the call (none
    outside one); what a call finds stays in its context, the stage function unchanged."""
    model = _model()
    fn = _stage_fn(model, check="skip")
    fn.reduction_unchecked = False
    call = StepCallback(fn)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match=r"forward of stage 0, microbatch 0 outside a runner's "
                                           r"call \(no StepContext bound\)"):
        call(0, 0, [x], [])
    held = dict(vars(fn))
    first, second = _context(), _context()
    for ctx in (first, second):
        ctx.targets.add(torch.zeros(2, dtype=torch.long), 1, 0, torch.device("cpu"))
    with call.bound(first):
        call(1, 0, call(0, 0, [torch.full((2, 4), math.nan)], []), [])
    with call.bound(second):
        loss = call(1, 0, call(0, 0, [x], []), [])[0]
    assert first.nonfinite_forward == 0 and second.nonfinite_forward is None
    assert torch.allclose(loss, F.cross_entropy(model(x), torch.zeros(2, dtype=torch.long)))
    assert vars(fn) == held
    with pytest.raises(RuntimeError, match="no StepContext bound"):
        call(0, 0, [x], [])


class _OwnLoss(nn.Module):
    """The model computes its loss itself (nanoGPT's ``forward(idx, targets) -> (logits, loss)``)."""

    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return h, h.pow(2).mean()


def test_a_loss_fn_returning_the_models_own_loss_does_not_warn() -> None:
    """loss_fn = lambda out, y: out[1]: its value on the doubled microbatch (the reduction
    check, under no_grad) still requires grad, and float() of that warned."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), _OwnLoss())
    stages = LocalStages(model, resolve_partition(3, 1, chunks=2, balance=[1, 2]), [0, 1],
                         torch.device("cpu"))
    fn = StageFunction(stages, lambda out, t: out[1], 2, torch.device("cpu"), None,
                       raise_at_once=True, rank=0)
    ctx = _context()
    ctx.targets.add(torch.zeros(6), 2, 0, torch.device("cpu"))  # rows: the check runs
    x = torch.randn(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = fn(ctx, 1, 0, fn(ctx, 0, 0, [x[:3]], []), [])[0]
    assert loss.requires_grad and not fn.reduction_unchecked and ctx.deferred_error is None
    torch.testing.assert_close(loss, model(x[:3])[1] * 0.5)


def test_evaluation_outputs_are_combined_leaf_by_leaf() -> None:
    fn, ctx = _stage_fn(_model()), _context()
    ctx.evaluating = True
    outs = []
    for i, rows in enumerate([3, 2]):
        h = torch.full((rows, 2), float(i))
        outs.append(fn._flatten_output(ctx, {"h": h, "loss": h.sum() / rows + i, "tag": "x",
                                             "no": None}, i))
    per_microbatch = fn.take_eval_outputs(ctx, outs)
    assert [m["h"].shape[0] for m in per_microbatch] == [3, 2]
    combined = merge_microbatch_outputs(per_microbatch, [3, 2], 0)
    assert combined["tag"] == "x" and combined["no"] is None
    assert torch.equal(combined["h"], torch.cat([torch.zeros(3, 2), torch.ones(2, 2)]))
    # The rows-weighted mean: (3 * 0 + 2 * (2 + 1)) / 5.
    assert combined["loss"].dim() == 0 and float(combined["loss"]) == pytest.approx(6 / 5)
    assert ctx.eval_structure == {}


# -- plans -> stages ----------------------------------------------------------------------
def test_a_plan_that_moves_stages_to_other_ranks_is_refused() -> None:
    from pipedream_ext import profile
    from pipedream_ext._planning.startup import check_plan_world

    graph = profile(_model(), torch.randn(8, 4), steps=1, warmup=0)
    chosen = plan(graph, workers=2, bandwidth=1e9, straight=True)
    assert [list(s.ranks) for s in chosen.stages] == [[0], [1]]
    chosen.stages[0].ranks, chosen.stages[1].ranks = [1], [0]
    with pytest.raises(ValueError, match=r"plan stage 0 lists ranks \[1\], but PipeDream runs stage "
                                         r"j on the next replicas\[j\] ranks in stage order, so "
                                         r"stage 0 runs on ranks \[0\]"):
        check_plan_world(chosen, 2)


def test_a_manifest_with_a_step_that_is_no_integer_is_refused(tmp_path) -> None:
    import json

    from pipedream_ext._checkpoint import (
        FORMAT,
        MANIFEST,
        CheckpointError,
        read_manifest,
    )

    manifest = {"format": FORMAT, "version": 1, "generation": 0, "step": "100",
                "layers": [{"name": "0", "type": "Linear"}], "num_layers": 1,
                "stages": [{"stage": 0, "layers": [0, 1], "model": {}}]}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"is inconsistent: ValueError: 'step' is '100' \(str\); "
                                              r"it must be a non-negative integer or null"):
        read_manifest(str(tmp_path))
    manifest["step"] = 100
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert read_manifest(str(tmp_path))["step"] == 100



def test_partition_from_plan(tmp_path) -> None:
    from pipedream_ext import profile
    graph = profile(_model(), torch.randn(8, 4), steps=1, warmup=0)
    chosen = plan(graph, workers=2, bandwidth=1e9, straight=True)
    balance, replicas = partition_from_plan(chosen, 5, 2)
    assert sum(balance) == 5 and len(balance) == 2 and replicas is None
    with pytest.raises(ValueError, match="re-plan for 3 workers"):
        partition_from_plan(chosen, 5, 3)
    with pytest.raises(ValueError, match="the plan covers 5 layers but the model has 6"):
        partition_from_plan(chosen, 6, 2)


def test_cluster_shape() -> None:
    assert cluster_shape(4, per_node=4) == [4]
    assert cluster_shape(4, per_node=2) == [2, 2]
    assert cluster_shape(6, per_node=4) == [6]  # does not divide: one node


# -- deferred initialisation (pipedream_ext/_frontend/deferred_init.py, _checkpoint/reshard.py) ------------
def _meta(make):
    with torch.device("meta"):
        return make()


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def test_seeding_rule_gives_each_layer_its_own_seed_wherever_it_lands() -> None:
    from pipedream_ext._frontend.deferred_init import layer_seed, materialize

    assert layer_seed(0, 3) == 3 and layer_seed(2, 3) == 2 * 2**16 + 3
    rng = torch.get_rng_state()
    whole = materialize(_meta(_mlp), seed=5)
    assert torch.equal(rng, torch.get_rng_state()), "the caller's RNG state changed"
    by_hand = _mlp()
    for l, layer in enumerate(by_hand):
        torch.manual_seed(5 * 2**16 + l)
        for module in layer.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    # Layer by layer, in any order and any subset: a layer's weights depend only on (seed, l).
    pieces = _meta(_mlp)
    materialize(pieces, seed=5, layers=[3])
    materialize(pieces, seed=5, layers=[1, 0, 2])
    for name, value in by_hand.state_dict().items():
        assert torch.equal(whole.state_dict()[name], value), name
        assert torch.equal(pieces.state_dict()[name], value), name
    assert not torch.equal(materialize(_meta(_mlp), seed=6)[0].weight, by_hand[0].weight)
    # LocalStages materialises only the layers it keeps.
    model = _meta(_mlp)
    stages = LocalStages(model, resolve_partition(4, 2), [1], torch.device("cpu"), init_seed=5)
    assert model[0].weight.is_meta and not model[3].weight.is_meta
    assert torch.equal(stages.module.state_dict()["3.weight"], by_hand[3].weight)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


class _Masked(nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 3)
        self.register_buffer("mask", torch.ones(3, 3).tril(), persistent=False)


def test_meta_modules_without_reset_parameters_or_with_unset_buffers_are_named() -> None:
    from pipedream_ext._frontend.deferred_init import (
        check_initialisable,
        check_seed,
        materialize,
    )

    model = _meta(lambda: nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), _Scale())))
    with pytest.raises(ValueError, match=r"module '1\.1' \(_Scale: gain\) has parameters or buffers "
                                         r"on the meta device but no reset_parameters\(\).*init_fn"):
        check_initialisable(model, None)
    check_initialisable(model, lambda layer: None)                 # init_fn takes over
    check_initialisable(nn.Sequential(_Scale()), None)             # not on meta: nothing to do
    with pytest.raises(ValueError, match=r"init_fn=3 is not callable"):
        check_initialisable(model, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layer 0 \('0'\): '0\.mask' on the meta device were not "
                                         r"set by reset_parameters\(\)"):
        materialize(_meta(lambda: nn.Sequential(_Masked())))
    with pytest.raises(ValueError, match=r"init_fn left the non-persistent buffer\(s\) '0\.mask' unset"):
        materialize(_meta(lambda: nn.Sequential(_Masked())), init_fn=lambda layer: None)
    # init_fn runs under no_grad and the layer's seed; parameters it skips stay NaN until loaded.
    done = materialize(_meta(lambda: nn.Sequential(_Masked())),
                       init_fn=lambda layer: layer.mask.copy_(torch.ones(3, 3).tril()))
    assert torch.equal(done[0].mask, torch.ones(3, 3).tril()) and torch.isnan(done[0].weight).all()
    for bad in (-1, 2**16, 1.5, True):
        with pytest.raises(ValueError, match=r"init_seed=.* is not an integer in \[0, 2\*\*16\)"):
            check_seed(bad)


class _Rotary(nn.Linear):
    """A table computed in ``__init__`` (torchtitan's ``freqs_cis``), non-persistent."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("tab", _table(), persistent=False)


def _table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(8, dtype=dtype).view(2, 4) / 8


def test_initialisation_may_assign_a_buffer_anew() -> None:
    """``layer.tab = table()`` (torchtitan's idiom) or register_buffer again in init_fn, or
    an assignment in reset_parameters(), is kept (not NaN, still non-persistent, on the
    stage's device); a tensor of another shape or dtype, a meta tensor or None is named."""
    from pipedream_ext._frontend.deferred_init import materialize

    def assign(layer: nn.Module) -> None:
        layer.tab = _table()

    def register(layer: nn.Module) -> None:
        layer.register_buffer("tab", _table(), persistent=False)

    class Reassigning(nn.Module):  # torchtitan's init_weights: self.freqs_cis = precompute()
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("tab", _table(), persistent=False)

        def reset_parameters(self) -> None:
            self.tab = _table()

    for build, init_fn in ((_Rotary, assign), (_Rotary, register), (Reassigning, None)):
        model = materialize(_meta(lambda b=build: nn.Sequential(nn.Linear(4, 4), b())),
                            init_fn=None if init_fn is None else lambda layer, f=init_fn: (
                                f(layer) if isinstance(layer, _Rotary) else layer.reset_parameters()))
        assert torch.equal(model[1].tab, _table()) and "1.tab" not in model.state_dict()
        assert model[1].tab.device == torch.device("cpu") and not model[1].tab.is_meta
    bad = [(lambda layer: setattr(layer, "tab", torch.zeros(3, 4)), r"shape \[3, 4\] and dtype torch\.float32, "
            r"but the model built on the meta device has shape \[2, 4\]"),
           (lambda layer: setattr(layer, "tab", _table(torch.float64)), r"dtype torch\.float64"),
           (lambda layer: setattr(layer, "tab", torch.zeros(2, 4, device="meta")), r"on the meta device"),
           (lambda layer: setattr(layer, "tab", None), r"\(set it to None\)")]
    for init_fn, message in bad:
        with pytest.raises(ValueError, match=r"layer 0 \('0'\): init_fn (assigned|removed) the buffer "
                           r"'0\.tab'.*" + message):
            materialize(_meta(lambda: nn.Sequential(_Rotary())), init_fn=init_fn)
    # Tied inside a layer: every holder gets the assigned tensor.
    tied = _meta(lambda: nn.Sequential(nn.Sequential(_Rotary(), _Rotary())))
    tied[0][1].tab = tied[0][0].tab
    materialize(tied, init_fn=lambda layer: setattr(layer[0], "tab", _table()))
    assert tied[0][0].tab is tied[0][1].tab and torch.equal(tied[0][1].tab, _table())


def test_materialize_keeps_ties_and_tensors_not_on_meta() -> None:
    from pipedream_ext._frontend.deferred_init import materialize

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

    model = _meta(lambda: nn.Sequential(Tied()))
    model.add_module("1", nn.Linear(3, 2))  # a real layer beside the meta one
    kept = model[1].weight.detach().clone()
    materialize(model)
    assert model[0].a.weight is model[0].b.weight and isinstance(model[0].a.weight, nn.Parameter)
    assert torch.equal(model[1].weight, kept)
    # Tied across layers (an embedding and its output head) on one rank: still one tensor.
    across = _meta(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    across[1].weight = across[0].weight
    materialize(across)
    assert across[0].weight is across[1].weight


def test_state_dict_split_keeps_this_ranks_keys_and_names_the_wrong_ones() -> None:
    from pipedream_ext._checkpoint.reshard import key_shapes, split_state_dict

    shapes = key_shapes(_meta(_mlp))
    full = _mlp().state_dict()
    model = _mlp()
    stages = LocalStages(model, resolve_partition(4, 2), [1], torch.device("cpu"))
    layers = {1: (2, 4)}
    parts, missing, unexpected = split_state_dict(full, shapes, {1: stages[1]}, layers)
    assert list(parts[1]) == ["3.weight", "3.bias"] and missing == unexpected == []
    # Keys of other ranks' stages may be absent; this rank's may not.
    own_only = {k: v for k, v in full.items() if k.startswith("3.")}
    assert list(split_state_dict(own_only, shapes, {1: stages[1]}, layers)[0][1]) == ["3.weight", "3.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 key\(s\) of stage 1 \(layers 2-3\): '3\.bias' "
                                         r"\(missing keys\)"):
        split_state_dict({"3.weight": full["3.weight"]}, shapes, {1: stages[1]}, layers)
    with pytest.raises(ValueError, match=r"has 1 key\(s\) this model does not have: 'fc\.weight'"):
        split_state_dict(dict(full, **{"fc.weight": torch.zeros(1)}), shapes, {1: stages[1]}, layers)
    with pytest.raises(ValueError, match=r"'0\.weight' has shape \[5, 5\] but this model's is \[5, 4\]"):
        split_state_dict(dict(full, **{"0.weight": torch.zeros(5, 5)}), shapes, {1: stages[1]}, layers)
    loose = split_state_dict({"fc": torch.zeros(1)}, shapes, {1: stages[1]}, layers, strict=False)
    assert loose[1:] == (["3.weight", "3.bias"], ["fc"])


# -- traced models (split_points) ---------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.norm(self.lin(h))) * mask


class _SkipNet(nn.Module):
    """A skip from ``inp`` to ``out`` over every block; ``mask`` used by every block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.out = nn.Linear(8, 2)
        self.unused = nn.Linear(2, 2)  # in the state_dict, never called

    def forward(self, x: torch.Tensor, mask: torch.Tensor, flag: bool = True) -> torch.Tensor:
        skip = self.inp(x)
        h = skip
        for block in self.blocks:
            h = block(h, mask)
        if flag:
            h = h * 2
        return self.out(torch.cat([h, skip], dim=1))


def _split(points, **kwargs):
    from pipedream_ext._frontend.graph_split import split_model

    torch.manual_seed(0)
    model = _SkipNet()
    inputs = (torch.randn(5, 3), torch.ones(5, 4))
    return model, inputs, split_model(model, points, inputs, **kwargs)


def test_live_sets_relay_skips_and_inputs_used_by_every_stage() -> None:
    _, _, split = _split(["blocks.1", "blocks.2", "out"], concrete_args={"flag": False})
    # The mask (an input) and the skip cross every cut up to their last use; the
    # blocks' output only the next; "cat" runs before "out", in the stage before it.
    assert split.live == [["mask", "inp", "add"], ["mask", "inp", "add_1"], ["cat"]]
    # A relayed value is returned unchanged (the stage's placeholder unpacked from its tuple).
    code = split.stages[1].code
    assert "return (mask, inp, add_1)" in code and "inputs[0]" in code


def test_stage_graphs_chained_equal_the_model_and_keep_original_names() -> None:
    model, inputs, split = _split(["blocks.1", "out"], concrete_args={"flag": True})
    model.eval()
    value = inputs
    for stage in split.stages:
        value = stage(value if isinstance(value, tuple) and len(value) > 1 else value)
    torch.testing.assert_close(value, model(*inputs))
    names = [[n for n, _ in stage.named_parameters()] for stage in split.stages]
    assert names[0] == ["inp.weight", "inp.bias", "blocks.0.lin.weight", "blocks.0.lin.bias",
                        "blocks.0.norm.weight", "blocks.0.norm.bias"]
    # The never-called module is kept by the last stage, so every key has a stage.
    assert {"unused.weight", "out.weight"} <= set(names[2])
    keys = [k for stage in split.stages for k in stage.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))
    # Stages hold the model's own modules (same tensors), not copies.
    assert split.stages[1].get_submodule("blocks.1.lin") is model.blocks[1].lin


def test_local_stages_of_a_traced_model_merge_by_original_path() -> None:
    model, _, split = _split(["blocks.1", "blocks.2", "out"], concrete_args={"flag": True})
    stages = LocalStages(model, resolve_partition(4, 2, chunks=2, balance=[1] * 4), [0, 2],
                         torch.device("cpu"), traced=split.stages)
    assert stages.layers == {0: (0, 1), 2: (2, 3)}
    names = [n for n, _ in stages.module.named_parameters()]
    assert names == ["inp.weight", "inp.bias", "blocks.0.lin.weight", "blocks.0.lin.bias",
                     "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.2.lin.weight",
                     "blocks.2.lin.bias", "blocks.2.norm.weight", "blocks.2.norm.bias"]
    assert stages.parameter_names(2) == names[6:]
    assert "blocks.2.norm.running_mean" in stages.module.state_dict()
    stages.module.eval()  # reaches the model's own BatchNorm through the merged paths
    assert not model.blocks[2].norm.training and model.blocks[1].norm.training


def test_tracing_errors_name_the_value_and_the_fix() -> None:
    from pipedream_ext._frontend.graph_split import split_model

    class Sizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.size(0)
            return self.b(self.a(x)).view(n, -1)

    with pytest.raises(ValueError, match=r"value 'size' .* is a int.*only tensors can cross"):
        split_model(Sizes(), ["b"], (torch.randn(2, 4),))

    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(self.a(x)))

    # A module with parameters called on both sides of a cut: its parameters are
    # shared by both stages (the shared-parameter rule, _shared), under one name.
    from pipedream_ext._frontend.tied_params import (
        alias_names,
        describe,
        find_shared_in_stages,
    )

    reused = Reused()
    split = split_model(reused, ["b"], (torch.randn(2, 4),))
    x = torch.randn(3, 4)
    torch.testing.assert_close(split.stages[1](split.stages[0](x)), reused(x))
    assert split.stages[1].get_submodule("a") is reused.a
    shared = find_shared_in_stages(reused, split.stages)
    assert [(sp.names, sp.name_stages) for sp in shared] == [
        (("a.weight", "a.weight"), (0, 1)), (("a.bias", "a.bias"), (0, 1))]
    assert describe(shared[0]) == "a.weight (stages 0 and 1)"
    # Stored by stage 0; stage 1's checkpoint file lists it as the same tensor.
    assert alias_names(shared, stage=0) == {}
    assert alias_names(shared, stage=1) == {"a.weight": "a.weight", "a.bias": "a.bias"}

    class Disconnected(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.a(x)
            return self.b(torch.zeros(2, 4))

    with pytest.raises(ValueError, match="stage 1 uses nothing stage 0 or the inputs produce"):
        split_model(Disconnected(), ["b"], (torch.randn(2, 4),))
    # A flag with a default takes it, as model(x, mask) would.
    net, x, mask = _SkipNet().eval(), torch.randn(2, 3), torch.ones(2, 4)
    split = split_model(net, ["out"], (x, mask))
    with torch.no_grad():
        torch.testing.assert_close(split.stages[1](split.stages[0]((x, mask))), net(x, mask))

    class Flagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
            h = self.a(x)
            if flag:
                h = h * 2
            return self.b(h)

    # A flag without a default left symbolic: the error names the module, the line and concrete_args.
    with pytest.raises(ValueError, match=r"module '\(the root\)' \(Flagged.forward, "
                                         r"test_units.py:\d+: if flag:\).*concrete_args"):
        split_model(Flagged(), ["b"], (torch.randn(2, 4),))


def test_constants_are_made_by_each_stage_and_called_buffers_kept_in_one() -> None:
    from pipedream_ext._frontend.graph_split import split_model

    class Constants(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.register_buffer("gain", torch.full((4,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            offset = torch.ones(4)  # fx computes it while tracing: "_tensor_constant0"
            h = self.a(x) * self.gain + offset
            return self.b(h) * self.gain + offset

    model = Constants()
    split = split_model(model, ["b"], (torch.randn(2, 4),))
    assert split.live == [["add"]]  # neither the buffer nor the tensor made in forward travels
    assert all("gain" in stage.state_dict() for stage in split.stages)
    # The traced constant is a buffer of the stages but not part of the model's state.
    assert all("_tensor_constant0" in dict(stage.named_buffers()) and
               "_tensor_constant0" not in stage.state_dict() for stage in split.stages)
    x = torch.randn(3, 4)
    torch.testing.assert_close(split.stages[1](split.stages[0](x)), model(x))

    class StatsTwice(nn.Module):  # running statistics updated on both sides of the cut
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.b = nn.BatchNorm1d(4, affine=False), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.b(self.norm(x)))

    with pytest.raises(ValueError, match="'norm.num_batches_tracked' is used by stage 0 and "
                                         "stage 1 \\(its module is called on both sides"):
        split_model(StatsTwice(), ["b"], (torch.randn(2, 4),))


def test_named_inputs_are_traced_by_parameter_name_and_the_rest_take_defaults() -> None:
    from pipedream_ext._frontend.graph_split import split_model

    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None, double: bool = False) -> torch.Tensor:
            h = self.a(x) if bias is None else self.a(x) + bias
            h = self.b(h * mask if mask is not None else h)
            return h * 2 if double else h

    model = Keywords()
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    split = split_model(model, ["b"], {"mask": mask, "x": x}, concrete_args={"double": True})
    assert split.tracer == "fx" and split.input_names == ["x", "mask"]  # forward's order
    assert split.live == [["mul"]]  # the mask is used before b, in stage 0
    torch.testing.assert_close(split.stages[1](split.stages[0]((x, mask))),
                               model(x, mask=mask, double=True))
    with pytest.raises(ValueError, match=r"inputs \['nope'\] name no parameter of Keywords.forward"):
        split_model(model, ["b"], {"x": x, "nope": mask})

    class Required(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + y)

    with pytest.raises(ValueError, match=r"Required.forward parameter 'y' has no default"):
        split_model(Required(), ["b"], {"x": x})


def test_export_path_recomputes_sizes_in_the_stages_using_them() -> None:
    """A forward fx cannot trace (a branch on a shape) goes through torch.export, whose
    sizes are symbolic integers: each stage computes the sizes it uses from a tensor it
    has (``b * t`` from its own activation), or the tensor carrying them travels."""
    from pipedream_ext._frontend.graph_split import split_model

    class Sizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != 4:
                raise ValueError("4 features")
            b, t = x.shape[0], x.shape[1]
            h = self.b(self.a(x).reshape(b * t, 4))
            return self.c(h.reshape(b, t, 4)).reshape(b * t, 4)

    model = Sizes()
    split = split_model(model, ["b", "c"], (torch.randn(4, 6, 4),))
    assert split.tracer == "export" and split.output_spec is not None
    # Stage 1 reshapes to (b, t, 4): only x carries b and t alone, so x travels; stage 2
    # takes b * t from its own activation's (b, t) dimensions.
    assert split.live == [["x", "reshape"], ["reshape_1"]], split.live
    assert "sym_size.int(linear_2, 0)" in split.stages[2].code
    for shape in [(4, 6), (2, 6), (3, 5), (1, 9)]:
        x = torch.randn(*shape, 4)
        value: object = x
        for stage in split.stages:
            value = stage(value)
        torch.testing.assert_close(value[0], model(x))


def test_find_shared_in_stages_of_a_traced_model() -> None:
    from pipedream_ext._frontend.graph_split import split_model
    from pipedream_ext._frontend.tied_params import find_shared_in_stages

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(7, 4), nn.Linear(4, 4), nn.Linear(4, 7)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.emb(ids)))

    model = Tied()
    split = split_model(model, ["head"], (torch.tensor([[1, 2]]),))
    shared = find_shared_in_stages(model, split.stages)
    assert [(sp.names, sp.stages) for sp in shared] == [(("emb.weight", "head.weight"), (0, 1))]
    assert find_shared_in_stages(model, split_model(model, ["mid"], (torch.tensor([[1]]),))
                                 .stages)[0].name_stages == (0, 1)


# -- the torch _C was built against ------------------------------------------------------
def test_an_extension_built_for_another_torch_names_both_versions(monkeypatch) -> None:
    import importlib

    from pipedream_ext import _torch_check

    monkeypatch.setattr(_torch_check, "required_torch", lambda: "2.13.0")
    monkeypatch.setattr(_torch_check.torch, "__version__", "2.14.0+cpu")
    real = importlib.import_module

    def fake(name: str, *args, **kwargs):
        if name == "pipedream_ext._C":
            raise ImportError("_C.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_torch_check.importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"pipedream_ext\._C cannot be used with the installed "
                                          r"torch 2\.14\.0: it was built against torch 2\.13\.0 "
                                          r"\(_C\.so: undefined symbol: .*\); rebuild it against "
                                          r"this torch \(pip install --no-build-isolation -e \. .*"
                                          r"or install torch==2\.13\.0"):
        _torch_check.load_extension()
    monkeypatch.setattr(_torch_check.importlib, "import_module", real)
    with pytest.warns(RuntimeWarning, match="installed torch 2.14.0: it was built against torch "
                                            "2.13.0"):
        assert _torch_check.load_extension() is _C


# -- meshes ---------------------------------------------------------------------------------
def test_mesh_pipelines_follow_torchs_local_ranks_and_refuse_orders_without_stages() -> None:
    """A pipeline is a column of the mesh in ascending rank order (torch's
    ``mesh["pp"].get_local_rank()``), the pipelines in a row's ascending order; rows and
    columns permuted give the same pipelines; a mesh whose rows do not keep one
    position in their columns is refused naming a row."""
    assert mesh_pipelines([[0, 1], [2, 3]]) == [[0, 2], [1, 3]]
    for order in ([[2, 3], [0, 1]], [[3, 2], [1, 0]], [[1, 0], [3, 2]]):
        assert mesh_pipelines(order) == [[0, 2], [1, 3]], order
    assert mesh_pipelines([[4, 5, 3], [1, 2, 0]]) == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match=r"mesh \[\[0, 3\], \[2, 1\]\] cannot run a pipeline: .*in "
                                         r"the dp group \[0, 3\] rank 0 is pp rank 0, rank 3 is pp rank 1"):
        mesh_pipelines([[0, 3], [2, 1]])


def test_parallel_dims_without_a_mesh_are_one_pipeline_whose_hooks_do_nothing() -> None:
    """No mesh is not a second code path: a plain group's dims are pp=N, dp=tp=1, and the
    policy the runners call has hooks that do nothing; a mesh's dims pick FSDP, replicas,
    or (a ("pp", "tp") mesh) no data parallelism at all."""
    plain = ParallelDims(None, "fsdp", False, None, [[0, 1, 2]])
    assert (plain.pp_size, plain.dp_size, plain.tp_size) == (3, 1, 1) and plain.pp_enabled
    assert not (plain.on_mesh or plain.dp_enabled or plain.tp_enabled or plain.fsdp_enabled
                or plain.replicate_enabled)
    assert plain.describe() == {} and plain.planner_sizes() == {} and plain.coordinates is None
    assert plain.names.of_group(2) == "rank 2" and plain.world_names is None
    policy = data_parallel_policy(plain, True, lambda: [])
    assert type(policy) is DataParallel and policy.after_layer is None
    assert MeanLoss().divisor(plain.dp_size, plain.tp_size) == 1
    policy.check_batch(torch.zeros(3, 2), 2, "inputs")  # off a mesh: stage_call's check alone
    policy.before_step(), policy.after_step(), policy.after_evaluation()

    pp_dp = ParallelDims(object(), "fsdp", False, None, [[0, 2], [1, 3]])  # 2 x 2 ("pp", "dp")
    assert pp_dp.fsdp_enabled and not pp_dp.replicate_enabled and pp_dp.dp_enabled
    assert pp_dp.planner_sizes() == {"data_parallel": 2, "sharding": "fsdp", "tensor_parallel": None}
    fsdp = data_parallel_policy(pp_dp, True, lambda: [])
    assert type(fsdp) is FsdpStages and fsdp.average_over_dp and fsdp.after_layer == fsdp.shard_layer
    assert MeanLoss().divisor(pp_dp.dp_size, pp_dp.tp_size) == 2
    with pytest.raises(ValueError, match="inputs of this data-parallel rank have batch size 3"):
        fsdp.check_batch(torch.zeros(3, 2), 2, "inputs")
    replicate = dataclasses.replace(pp_dp, data_parallel="replicate")
    assert type(data_parallel_policy(replicate, True, lambda: [])) is ReplicatedStages
    assert not data_parallel_policy(replicate, False, lambda: []).average_over_dp
    assert SumLoss().divisor(replicate.dp_size, replicate.tp_size) == 1
    pp_tp = ParallelDims(object(), "fsdp", False, None, [[0, 2], [1, 3]], tp_size=2, tensor_parallel={})
    assert pp_tp.tp_enabled and not (pp_tp.dp_enabled or pp_tp.fsdp_enabled or pp_tp.replicate_enabled)
    tp_only = data_parallel_policy(pp_tp, True, lambda: [])
    assert type(tp_only) is DataParallel
    assert MeanLoss().divisor(pp_tp.dp_size, pp_tp.tp_size) == 2  # tp ranks' losses count once


def test_fsdp_keeps_a_stage_unsharded_after_a_forward_whose_next_backward_is_a_w() -> None:
    """W fires no pre-backward hook, so the forward before it must leave the stage's
    weights gathered; the next backward-like action (B, I or W) of the same stage decides."""
    order = ["0F0", "0I0", "0F1", "3F0", "3I0", "0W0", "3F1", "3W0", "0I1", "3I1", "0W1", "3W1"]
    actions = [schedules.Action.parse(text) for text in order]
    assert keep_unsharded_after(actions) == {(0, 1), (3, 1)}
    flush = schedules.build("zb-h1", stages=2, microbatches=4).actions(0, comm=False)
    assert keep_unsharded_after(flush) == set()  # I follows every forward


def test_rank_names_say_global_ranks_with_mesh_coordinates() -> None:
    """On a mesh a pipeline group's rank (the executor's number) becomes the global rank
    with its coordinates; names already given, and numbers outside the group, stay."""
    names = RankNames([1, 3], [[0, 2], [1, 3]])  # pipeline dp 1 of mesh [[0, 1], [2, 3]]
    assert names.of_group(1) == "rank 3 (pp 1, dp 1)"
    assert names.many([0, 2]) == "ranks 0 (pp 0, dp 0), 2 (pp 1, dp 0)"
    text = "rank 0: RECV_B of microbatch 0 for stage 0 with rank 1 failed (is rank 1 alive?)"
    assert names.translate(text) == ("rank 1 (pp 0, dp 1): RECV_B of microbatch 0 for stage 0 with "
                                     "rank 3 (pp 1, dp 1) failed (is rank 3 (pp 1, dp 1) alive?)")
    assert names.translate("rank 3 (pp 1, dp 1) and rank 7") == "rank 3 (pp 1, dp 1) and rank 7"
    assert RankNames([0, 1]).translate(text) == text  # no mesh: the pipeline's own numbers


def test_cut_layouts_travel_as_text_once_and_a_missing_one_names_its_stage() -> None:
    """A stage's placements at its cut, as the exchange carries them: every placement
    that can cross comes back equal, is read once, and one that never arrives fails
    after the timeout naming the stage; what cannot cross is refused."""
    from torch.distributed import HashStore
    from torch.distributed.tensor import Partial, Replicate, Shard

    layout = CutLayout((None, Replicate(), Shard(1), Shard(-1), *map(Partial, ("sum", "avg", "max", "min"))))
    assert layout.encode() == "plain,replicate,shard:1,shard:-1,partial:sum,partial:avg,partial:max,partial:min"
    exchange = LayoutExchange(HashStore(), "pipeline/0", timeout=0.1)
    exchange.publish(2, layout)
    assert exchange.take(2) == layout
    with pytest.raises(RuntimeError, match=r"the output layout of stage 2 did not arrive within timeout=0.1 s"):
        exchange.take(2)
    with pytest.raises(ValueError, match=r"placement Partial\(prod\) cannot cross a cut"):
        CutLayout((Partial("prod"),)).encode()
    with pytest.raises(ValueError, match="'shard:x' names no placement"):
        CutLayout.decode("plain,shard:x")


def test_prediction_check_warns_once_naming_the_largest_term(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 3-7 measured (the time between step ends, the executor's kinds per term):
    within 25% no warning; off by more, one warning naming the term that differs most;
    a stats reset restarts the measurement."""
    from pipedream_ext._runtime import prediction_check as pc

    def run(check: "pc.PredictionCheck", step_ms: float, kinds_per_step: dict, steps: int = 10,
            reset_at: Optional[int] = None) -> list:
        clock = [0.0]
        totals: dict = {}
        monkeypatch.setattr(pc.time, "perf_counter", lambda: clock[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                clock[0] += step_ms / 1e3
                for kind, ms in kinds_per_step.items():
                    totals[kind] = totals.get(kind, 0.0) + ms / 1e3
                if step == reset_at:
                    totals.clear()
                    check.restart()
                check.after_step(lambda: dict(totals))
        return [str(w.message) for w in caught]

    predicted = {"compute": 2e-3, "waits": 1e-3, "transfers": 0.0, "all-reduce": 0.0, "overhead": 1e-3}
    close = pc.PredictionCheck(4e-3, predicted, "rank 0")
    assert run(close, 4.5, {"F": 1.0, "B": 1.0, "RECV_F": 1.0}) == []
    assert close.stats() == {"predicted_step_seconds": 4e-3, "measured_step_seconds": pytest.approx(4.5e-3)}
    slow = pc.PredictionCheck(4e-3, predicted, "rank 1")
    messages = run(slow, 10.0, {"F": 1.0, "B": 1.0, "RECV_F": 6.0, "SEND_F": 0.5})
    assert len(messages) == 1, messages
    assert re.search(r"rank 1: measured step time 10\.000 ms differs from the predicted 4\.000 ms by "
                     r"more than 25%; the largest difference is waits: measured 6\.000 ms per step, "
                     r"predicted 1\.000 ms", messages[0]), messages[0]
    assert pc.measured_terms({}, {"F": 2.0, "W": 1.0, "SEND_WAIT": 1.0, "ALLREDUCE": 0.5}, 2, 3.0) == \
        {"compute": 1.5, "waits": 0.5, "transfers": 0.0, "all-reduce": 0.25, "overhead": 0.75}
    # The tied weights' all-reduce outside the executor is a wait (the prediction's idle time).
    assert pc.measured_terms({}, {"F": 2.0, "RECV_B": 1.0, "TIED_ALLREDUCE": 3.0}, 2, 4.0)["waits"] == 2.0
    # Posting a receive is a transfer's cost, like posting a send.
    assert pc.measured_terms({}, {"F": 2.0, "SEND_B": 0.5, "RECV_POST": 0.5}, 2, 3.0)["transfers"] == 0.5
    # Readings subtract per kind; the public count is the same, and refuses an empty window.
    assert pc.measured_terms({"F": 1.0}, {"F": 3.0, "B": 1.0}, 1, 5.0) == \
        configuration.measured_breakdown({"F": 2.0, "B": 1.0}, 1, 5.0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        configuration.measured_breakdown({"F": 1.0}, 0, 1.0)
    reset = pc.PredictionCheck(4e-3, predicted, "rank 0")
    assert run(reset, 4.0, {"F": 2.0}, steps=6, reset_at=3) == [] and reset.measured is None
    assert len(run(reset, 40.0, {"F": 2.0}, steps=6)) == 1 and reset.measured == pytest.approx(0.04)
