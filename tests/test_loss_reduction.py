"""The loss reduction objects (``_runtime/loss_reduction.py``), in one process.

What each reduction answers (shares, divisor over a mesh, dp gradient averaging,
reading ``loss_fn``'s value, the check of how it reduces) and how the options become
one object once, its name still what ranks agree on. The pipelines that train with
them are checked against the unsplit model in tests/test_token_loss.py,
tests/test_agreement.py and tests/test_fsdp.py.
"""
from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

from pipedream_ext._runtime import options
from pipedream_ext._runtime.config import PipelineConfig
from pipedream_ext._runtime.loss_reduction import (
    MeanLoss,
    SumLoss,
    TokenMeanLoss,
    count_tokens,
    from_option,
)
from pipedream_ext._runtime.options import PipelineOptions

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pipedream_ext"


def test_each_reduction_owns_its_shares_and_its_divisor_over_the_mesh() -> None:
    mean, summed, tokens = MeanLoss(), SumLoss(), TokenMeanLoss()
    assert mean.shares([3, 2]) == [3 / 5, 2 / 5]
    assert summed.shares([3, 2]) == tokens.shares([3, 2]) == [1.0, 1.0]
    # Each tp rank of a dp coordinate computes the same loss; only a mean averages dp.
    assert (mean.divisor(2, 3), summed.divisor(2, 3), tokens.divisor(2, 3)) == (6, 3, 3)
    assert [r.averages_over_dp for r in (mean, summed, tokens)] == [True, False, False]
    assert [r.counts_tokens for r in (mean, summed, tokens)] == [False, False, True]
    targets = [torch.tensor([1, -100, 2]), torch.tensor([-100, -100])]
    assert mean.count_tokens(targets) is None and tokens.count_tokens(targets) == [2, 0]
    counted = TokenMeanLoss(lambda t: t.numel()).count_tokens(targets)
    assert counted == [3, 2]


def test_the_options_become_one_object_whose_name_ranks_agree_on() -> None:
    def tokens_fn(target: torch.Tensor) -> torch.Tensor:
        return (target >= 0).sum()

    config = PipelineConfig.checked("1f1b", 2, loss_reduction="tokens", tokens_fn=tokens_fn)
    assert isinstance(config.loss_reduction, TokenMeanLoss)
    assert config.loss_reduction.tokens_fn is tokens_fn
    assert isinstance(PipelineConfig.checked("1f1b", 2).loss_reduction, MeanLoss)
    assert TokenMeanLoss().tokens_fn is count_tokens
    agreed = options.agreed_values(PipelineOptions(loss_reduction="sum"))
    assert agreed["loss_reduction"] == "sum"


def test_refusals_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"loss_reduction='max'; use 'mean'"):
        from_option("max")
    with pytest.raises(ValueError, match=r"loss_reduction=\['mean'\]; use 'mean'"):
        from_option(["mean"])
    with pytest.raises(ValueError, match=r"tokens_fn=<built-in function len> counts the tokens "
                                         r"loss_reduction='tokens' divides by, but "
                                         r"loss_reduction='sum'"):
        from_option("sum", len)
    with pytest.raises(ValueError, match=r"tokens_fn=3 is not callable"):
        from_option("tokens", 3)
    with pytest.raises(ValueError, match=r"schedule 'pipedream' updates the weights inside the "
                                         r"pipeline.*use a flush schedule \(gpipe, 1f1b"):
        TokenMeanLoss.check_schedule("pipedream")
    MeanLoss.check_schedule("pipedream")
    SumLoss.check_schedule("pipedream-2bw")


def test_read_finds_the_loss_and_its_problems() -> None:
    loss = torch.tensor(2.0)
    assert MeanLoss().read(loss) == (loss, None, None)
    assert re.search(r"returned a float \(2\.0\)", SumLoss().read(2.0).problem)
    assert re.search(r"returned a tensor of shape \(3,\)", MeanLoss().read(torch.ones(3)).problem)
    n_tokens = torch.tensor(5)
    assert TokenMeanLoss().read((loss, n_tokens)) == (loss, n_tokens, None)
    read = TokenMeanLoss().read(loss)
    assert read.loss is None and re.search(r"needs loss_fn to return \(loss_sum, n_tokens\)",
                                           read.problem)


def test_check_reduction_finds_a_loss_fn_reducing_otherwise_than_declared() -> None:
    torch.manual_seed(0)
    out, target = torch.randn(4, 3), torch.randint(0, 3, (4,))

    def mean_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o, t)

    def sum_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o, t, reduction="sum")

    def pair(fn):  # (loss_sum, n_tokens) around a loss
        return lambda o, t: (fn(o, t), t.numel())

    cases = [(MeanLoss(), mean_fn, None), (MeanLoss(), sum_fn, r"sums over the batch.*2\.000x"),
             (SumLoss(), sum_fn, None), (SumLoss(), mean_fn, "drop loss_reduction='sum'"),
             (TokenMeanLoss(), pair(sum_fn), None),
             (TokenMeanLoss(), pair(mean_fn), "loss_fn's loss_sum averages over the batch")]
    for reduction, loss_fn, problem in cases:
        loss = reduction.read(loss_fn(out, target)).loss
        found = reduction.check_reduction(loss_fn, out, target, loss)
        assert (found is None) if problem is None else re.search(problem, found), \
            (reduction, problem, found)
    # No tensor target with a batch dimension: no verdict.
    assert MeanLoss().check_reduction(sum_fn, out, torch.tensor(1), torch.tensor(1.0)) is None


def test_no_module_compares_the_loss_reduction_name() -> None:
    """The option's value is read once, into the object (loss_reduction.from_option)."""
    compare = re.compile(r"loss_reduction\s*(==|!=|\bin\b|\bnot in\b)")
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "loss_reduction.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if compare.search(line.split("#")[0])]
    assert found == []
