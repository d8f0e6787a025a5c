"""pipedream_ext.diagnostics: fingerprints, the agreement checks and the timed split, in
this process (the checks on a 1-rank Gloo group; several ranks disagreeing are covered by
tests/test_agreement.py through PipeDream)."""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from test_traced import Chain, ExportedChain  # the fx and the torch.export path
from torch import nn

import pipedream_ext.diagnostics as pdd


def layers(activation: type = nn.Tanh) -> List[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 8), activation(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)]


def test_time_split_times_every_phase_of_the_fx_path() -> None:
    model = Chain(layers())
    x = torch.randn(4, 6)
    timing = pdd.time_split(model, ["2"], (x,))
    assert set(timing.phases_s) == set(pdd.PHASES) - {"export"}, timing.phases_s
    assert all(seconds > 0 for seconds in timing.phases_s.values()), timing.phases_s
    assert timing.total_s >= sum(timing.phases_s.values()) and timing.other_s >= 0
    assert timing.graph_nodes == 7  # x, five layers, output
    assert timing.split.tracer == "fx" and len(timing.split.stages) == 2
    plain = pdd.trace_split(Chain(layers()), ["2"], (x,))
    assert timing.split.fingerprint.stages == plain.fingerprint.stages
    with torch.no_grad():
        out = timing.split.stages[1](timing.split.stages[0](x))
        assert torch.equal(out, model(x))


def test_time_split_times_the_export_path_and_restores_what_it_wrapped() -> None:
    import pipedream_ext._frontend.export as export
    import pipedream_ext._frontend.graph_split as graph_split

    before = (graph_split.trace_model, graph_split.value_kinds, export.export_model)
    timing = pdd.time_split(ExportedChain(layers()), ["2"], (torch.randn(4, 6),))
    assert timing.split.tracer == "export"
    assert {"trace", "export", "cut", "value_check", "build"} <= set(timing.phases_s)
    assert (graph_split.trace_model, graph_split.value_kinds, export.export_model) == before
    with pytest.raises(ValueError, match="split_points"):
        pdd.time_split(Chain(layers()), [], (torch.randn(4, 6),))
    assert (graph_split.trace_model, graph_split.value_kinds, export.export_model) == before


def test_fingerprints_tell_what_differs() -> None:
    x = torch.randn(4, 6)
    split = pdd.trace_split(Chain(layers()), ["2"], (x,))
    again = pdd.fingerprint_split(split)
    assert again.stages == split.fingerprint.stages and again.cuts == split.fingerprint.cuts
    other = pdd.fingerprint_split(pdd.trace_split(Chain(layers(nn.Sigmoid)), ["2"], (x,)))
    # Digests are Merkle hashes: stage 1 differs too, through the value it receives.
    assert other.stages[0] != again.stages[0] and other.cuts != again.cuts
    ours, theirs = pdd.describe_stage(again, 0), pdd.describe_stage(other, 0)
    assert any("tanh" in line.lower() for line in set(ours) - set(theirs)), ours
    assert any("sigmoid" in line.lower() for line in set(theirs) - set(ours)), theirs
    with pytest.raises(IndexError):
        pdd.describe_stage(again, 2)

    seq = pdd.fingerprint_layers(nn.Sequential(*layers()), [2, 3])
    assert seq.kind == "layers" and len(seq.stages) == 2
    assert pdd.fingerprint_layers(nn.Sequential(*layers()), [2, 3]).stages == seq.stages
    assert pdd.fingerprint_layers(nn.Sequential(*layers()), [3, 2]).stages != seq.stages
    assert any("Tanh" in line for line in pdd.describe_stage(seq, 0))
    with pytest.raises(ValueError, match="summing to the model's 5 layers"):
        pdd.fingerprint_layers(nn.Sequential(*layers()), [2, 2])


def test_agreement_checks_on_one_rank(group: dist.ProcessGroup) -> None:
    split = pdd.trace_split(Chain(layers()), ["2"], (torch.randn(4, 6),))
    assert pdd.check_stages_agree(split.fingerprint, {"schedule": "1f1b"}) is None
    seq = pdd.fingerprint_layers(nn.Sequential(*layers()), [2, 3])
    assert pdd.check_stages_agree(seq, group=group) is None
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    pdd.check_batches_agree(x, y)
    pdd.check_batches_agree(x, y, group=group, first_ranks=[0], last_ranks=[0])


class Masked(nn.Module):
    """torchtitan's Llama signature: optional arguments that default to None."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, attention_masks: Any = None, positions: Any = None,
                scale: float = 2.0) -> torch.Tensor:
        h = self.inp(tokens) * scale
        if attention_masks is not None:
            h = h * attention_masks
        if positions is not None:
            h = h + positions
        return self.out(h)


def test_positional_inputs_leave_other_parameters_at_their_defaults() -> None:
    """``model(x)`` takes forward's defaults for the rest, so tracing on ``(x,)`` does too
    (fx: fixed while tracing), without concrete_args; a value given in concrete_args wins."""
    model, x = Masked(), torch.randn(4, 6)
    split = pdd.trace_split(model, ["out"], (x,))
    assert split.tracer == "fx"
    with torch.no_grad():
        assert torch.equal(split.stages[1](split.stages[0](x)), model(x))
        fixed = pdd.trace_split(model, ["out"], (x,), concrete_args={"scale": 3.0})
        assert torch.equal(fixed.stages[1](fixed.stages[0](x)), model(x, scale=3.0))
