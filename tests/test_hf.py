"""Hugging Face GPT-2 (``transformers``) pipelined through the torch.export path.

torch.fx cannot trace ``GPT2LMHeadModel`` in transformers 5, so ``split_points``
exports it (non-strict, dynamic shapes). Runs under pytest, which launches the
worker side with torchrun, or standalone:

    PDHF_DIR=/tmp/h torchrun --standalone --nproc-per-node 3 tests/test_hf.py

A small random GPT-2 (no download) whose head is tied to its token embedding, built
from a config. On 2, 3 and 4 ranks, every flush schedule (``synchronous_names()``;
those with several chunks per rank with 2; dualpipev, which needs 2p microbatches,
on 2 ranks only) is compared with the unsplit model after SGD-momentum and Adam
steps: every step's loss and every weight (rtol 1e-5; see ``make_reference`` and
``tied_order`` for the tied weight). Inputs are a dict of named tensors
(``input_ids`` and a right-padding ``attention_mask``) or one tensor given
positionally; the batch size and the sequence length change between steps;
``loss_fn`` gets the model's own ``CausalLMOutputWithCrossAttentions``. Then
``forward_only`` against the unsplit model in eval mode, a checkpoint consolidated
into the unmodified ``GPT2LMHeadModel`` and loaded into another split.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
MICROBATCHES = 4
VOCAB = 96
LAYERS = 6
NO_CACHE = {"use_cache": False}
# Stage count -> split points (7 is the most: h.0 .. h.5 and ln_f).
SPLITS = {2: ["transformer.h.3"], 3: ["transformer.h.2", "transformer.h.4"],
          4: ["transformer.h.1", "transformer.h.3", "transformer.h.5"],
          6: ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.4",
              "transformer.ln_f"],
          8: ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3",
              "transformer.h.4", "transformer.h.5", "transformer.ln_f"]}
OTHER_SPLITS = {2: ["transformer.ln_f"], 3: ["transformer.h.0", "lm_head"],
                4: ["transformer.h.2", "transformer.h.4", "lm_head"]}


def make_gpt2(dropout: float = 0.0) -> nn.Module:
    """A small random GPT-2 (its lm_head tied to transformer.wte), the same on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(n_layer=LAYERS, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                        use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """The same loss for the unsplit model and the pipeline (out: the model's ModelOutput)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def make_batch(n: int, length: int, seed: int, mask: bool) -> Tuple[Any, torch.Tensor]:
    """Token ids and next-token targets; with ``mask``, rows right-padded (their padded
    targets ignored) and the inputs a dict with an ``attention_mask``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, length + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if not mask:
        return {"input_ids": x}, y
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    attention = (torch.arange(length) < lengths[:, None]).long()
    y = y.masked_fill(attention == 0, -100)
    return {"input_ids": x, "attention_mask": attention}, y


def make_reference() -> nn.Module:
    """The unsplit GPT-2 whose tied weight's gradient is summed as the pipeline sums it.

    The pipeline's gradient of the tied weight is (the embedding's part, summed over
    microbatches on stage 0) + (the head's part, on the last stage); the tied model's
    autograd adds the two per microbatch. Equal in exact arithmetic, they round
    differently (1e-7 relative), and Adam's first steps, which divide by the gradient's
    magnitude, turn that into 1e-5 in a few weights. So the reference keeps the head's
    weight as a separate copy of the embedding's and gives both ``embedding grad + head
    grad`` (``reference_step``): the tied model's gradient, added in the pipeline's
    order; weights then match bit for bit. ``check_schedule`` also compares the first
    step's loss and gradients with the tied model itself.
    """
    model = make_gpt2()
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model


def tied_order(schedule: str, world: int) -> Optional[List[Tuple[str, int]]]:
    """When one rank holds both the embedding's stage and the head's (a V), the order
    in which that rank's actions add the two parts of the tied weight's gradient, per
    microbatch (``("emb", i)`` / ``("head", i)``); else ``None``."""
    import pipedream_ext as pd

    if pd.schedules.traits(schedule).chunk_placement != "v":
        return None
    built = pd.schedules.build(schedule, stages=world, microbatches=MICROBATCHES, chunks=2)
    last, order = 2 * world - 1, []
    for a in built.actions(0, comm=False):
        if a.kind in (pd.schedules.ActionKind.B, pd.schedules.ActionKind.W) and a.stage in (0, last):
            order.append(("emb" if a.stage == 0 else "head", a.microbatch))
    return order


def reference_step(model: nn.Module, inputs: Dict[str, torch.Tensor], y: torch.Tensor,
                   order: Optional[List[Tuple[str, int]]] = None) -> float:
    """The unsplit model on the pipeline's microbatches: share-weighted loss, backward
    (a ``make_reference`` model: the tied weight's two parts summed into both copies,
    in ``order`` (:func:`tied_order`) if given, else the embedding's total plus the head's)."""
    parts = {k: torch.tensor_split(v, MICROBATCHES) for k, v in inputs.items()}
    ys = torch.tensor_split(y, MICROBATCHES)
    head, embedding = model.lm_head.weight, model.transformer.wte.weight
    pieces: Dict[Tuple[str, int], torch.Tensor] = {}
    total = 0.0
    for i in range(MICROBATCHES):
        out = model(**{k: p[i] for k, p in parts.items()}, **NO_CACHE)
        loss = lm_loss(out, ys[i]) * (ys[i].shape[0] / y.shape[0])
        if order is not None:
            head.grad = embedding.grad = None
        loss.backward()
        if order is not None:
            pieces[("emb", i)], pieces[("head", i)] = embedding.grad, head.grad
        total += loss.item()
    if head is not embedding:
        if order is None:
            both = head.grad + embedding.grad
        else:  # the pipeline's AccumulateGrad: the first part is taken, the others added
            both = pieces[order[0]].clone()
            for key in order[1:]:
                both += pieces[key]
        head.grad, embedding.grad = both.clone(), both.clone()
    return total


def assert_same_state(pipe_state: Dict[str, torch.Tensor], ref: nn.Module, what: str) -> None:
    expected = ref.state_dict()
    for name, value in pipe_state.items():
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


# --------------------------------------------------------------------------- worker checks
def build(schedule: str, stages: int, mask: bool, positional: bool = False,
          split_points: Optional[List[str]] = None) -> Tuple[Any, nn.Module]:
    """A pipeline of a fresh GPT-2, and that model."""
    import pipedream_ext as pd

    chunks = stages // dist.get_world_size()
    inputs, y = make_batch(8, 12, 99, mask)
    sample = (inputs["input_ids"], y) if positional else (inputs, y)
    model = make_gpt2()
    pipe = pd.PipeDream(model, lm_loss, schedule=schedule, microbatches=MICROBATCHES,
                        chunks=chunks, timeout=60, split_points=split_points or SPLITS[stages],
                        sample=sample, concrete_args=NO_CACHE)
    return pipe, model


def check_schedule(schedule: str, mask: bool, positional: bool = False) -> Tuple[Any, ...]:
    """Two SGD-momentum then two Adam steps, other batch sizes and sequence lengths
    than the sample's: every loss and weight equal to the unsplit model's.

    Returns:
        The pipeline, its Adam optimizer, the reference and its Adam optimizer.
    """
    import pipedream_ext as pd

    world = dist.get_world_size()
    stages = world * (2 if pd.schedules.traits(schedule).multi_chunk else 1)
    pipe, model = build(schedule, stages, mask, positional)
    assert pipe.traced.tracer == "export", pipe.traced.tracer
    ref, tied = make_reference(), make_gpt2()
    # The stages hold the model's own Parameter objects under their original names,
    # and the tied weight under the name of the module using it on each stage.
    own = dict(model.named_parameters(remove_duplicate=False))
    names = {n for n, _ in pipe.named_parameters()}
    assert all(p is own[n] for n, p in pipe.named_parameters()), names - set(own)
    if pipe.is_first and not pipe.is_last:
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names, names
    if pipe.is_last and not pipe.is_first:
        assert "lm_head.weight" in names, names
    if pipe.is_first and pipe.is_last:  # a V puts both ends on rank 0: one object, listed once
        assert "transformer.wte.weight" in names, names
    assert [sp.names for sp in pipe.shared_parameters] == \
        [("transformer.wte.weight", "lm_head.weight")], pipe.shared_parameters
    step = 0
    shapes = [(8, 12), (8, 9), (12, 16), (4, 7)]  # batch 4: microbatches of one row
    ref_opts, opts = optimizers(list(ref.parameters())), optimizers(list(pipe.parameters()))
    for ref_opt, opt in zip(ref_opts, opts):
        for _ in range(2):
            n, length = shapes[step]
            inputs, y = make_batch(n, length, 10 + step, mask)
            expected = reference_step(ref, inputs, y, tied_order(schedule, world))
            given = inputs["input_ids"] if positional else inputs
            loss = pipe.step(given if pipe.is_first else None, y if pipe.is_last else None)
            assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), \
                f"{schedule} step {step}: loss {loss} != {expected}"
            if step == 0:  # the tied model itself: same loss, same gradients
                assert abs(reference_step(tied, inputs, y) - loss) <= 1e-5 * max(1.0, abs(loss))
                grads = dict(tied.named_parameters(remove_duplicate=False))
                for name, p in pipe.named_parameters():
                    torch.testing.assert_close(p.grad, grads[name].grad, rtol=RTOL, atol=ATOL,
                                               msg=lambda m, n=name: f"{schedule} grad {n}: {m}")
            ref_opt.step(); ref_opt.zero_grad()
            opt.step(); opt.zero_grad()
            step += 1
    assert_same_state(pipe.state_dict(), ref, f"{schedule} after {step} steps")
    if schedule == "1f1b":  # evaluation: the model's own output structure, other shapes
        inputs, _ = make_batch(8, 10, 50, mask)
        pipe.eval(); ref.eval()
        out = pipe.forward_only(inputs if pipe.is_first else None)
        if pipe.is_last:
            with torch.no_grad():
                want = ref(**inputs, **NO_CACHE)
            assert type(out) is type(want), type(out)
            torch.testing.assert_close(out.logits, want.logits, rtol=RTOL, atol=ATOL)
        else:
            assert out is None
        pipe.train(); ref.train()
    return pipe, opts[-1], ref, ref_opts[-1]


def optimizers(params: List[nn.Parameter]) -> List[torch.optim.Optimizer]:
    return [torch.optim.SGD(params, lr=0.05, momentum=0.9), torch.optim.Adam(params, lr=0.01)]


def check_bad_inputs(pipe: Any) -> None:
    """A dict missing a key or holding an unexpected one: every rank raises, naming it,
    before any communication (the pipeline stays usable)."""
    inputs, y = make_batch(8, 12, 1, True)
    with pytest.raises(ValueError, match=r"step\(\) inputs lack 'attention_mask'"):
        pipe.step({"input_ids": inputs["input_ids"]}, y)
    with pytest.raises(ValueError, match=r"'token_type_ids', which the model was not traced "
                                         r"with \(its inputs: \['input_ids', 'attention_mask'\]\)"):
        pipe.forward_only(dict(inputs, token_type_ids=inputs["input_ids"]))
    with pytest.raises(ValueError, match="traced on a dict of named inputs"):
        pipe.step(inputs["input_ids"], y)


def check_checkpoint(root: str, pipe: Any, opt: torch.optim.Optimizer, ref: nn.Module,
                     ref_opt: torch.optim.Optimizer) -> None:
    """Save the trained 1f1b pipeline; consolidate into the unmodified GPT2LMHeadModel;
    load into another split (weights and Adam state) and take one more equal step."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    path = os.path.join(root, f"gpt2-{world}")
    pd.save_checkpoint(path, pipe, opt, step=2)
    if dist.get_rank() == 0:
        whole = make_gpt2()
        whole.load_state_dict(pd.consolidate(path), strict=True)  # the unmodified model
        assert whole.lm_head.weight is whole.transformer.wte.weight  # still tied
        assert_same_state(whole.state_dict(), ref, "consolidated")
    other, _ = build("gpipe", world, mask=True, split_points=OTHER_SPLITS[world])
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()  # the checkpoint must restore every weight
    info = pd.load_checkpoint(path, other, other_opt)
    assert info.step == 2
    assert_same_state(other.state_dict(), ref, f"loaded into {OTHER_SPLITS[world]}")
    inputs, y = make_batch(8, 14, 30, True)
    expected = reference_step(ref, inputs, y)
    loss = other.step(inputs if other.is_first else None, y if other.is_last else None)
    assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), (loss, expected)
    ref_opt.step(); other_opt.step()
    assert_same_state(other.state_dict(), ref, "Adam step after loading")


# The 1f1b case's pipeline, reference and optimizers, which the checkpoint and bad-input
# cases continue from (this rank's).
_TRAINED: Dict[str, Any] = {}


def check_schedule_case(schedule: str) -> None:
    # Inputs: a dict with a padding mask, a dict of input_ids alone, or one tensor.
    result = check_schedule(schedule, mask=schedule in ("1f1b", "zb-h1"), positional=schedule == "gpipe")
    if schedule == "1f1b":
        _TRAINED["1f1b"] = result


def trained_1f1b() -> Any:
    assert "1f1b" in _TRAINED, "the 1f1b case did not pass: nothing to continue from"
    return _TRAINED["1f1b"]


def hf_cases(world: int) -> Cases:
    import pipedream_ext as pd

    cases = Cases()
    for schedule in pd.schedules.synchronous_names():
        if schedule == "dualpipev" and 2 * world > MICROBATCHES:
            continue  # needs m >= 2p microbatches, more than the 4-row batches have rows
        cases.add(check_schedule_case, schedule, name=schedule)
    cases.add(lambda: check_checkpoint(os.environ.get("PDHF_DIR", f"/tmp/pdhf-{os.environ.get('MASTER_PORT', 'x')}"),
                                       *trained_1f1b()), name="checkpoint")
    cases.add(lambda: check_bad_inputs(trained_1f1b()[0]), name="bad_inputs")
    return cases


# `make test` runs 2 ranks (every flush schedule, V layouts included); `make test-all` 3 and 4.
LAUNCHES = [Launch(HERE, world, hf_cases, dirs=("PDHF_DIR",), marks=(pytest.mark.slow,) if world > 2 else ())
            for world in (2, 3, 4)]


# --------------------------------------------------------------------------- pytest side
@parametrize_cases(*LAUNCHES)
def test_gpt2_pipelines_match_the_unsplit_model(case: CaseRef) -> None:
    """Every flush schedule exact against the unsplit GPT-2 (dict and positional inputs,
    padding mask, changing shapes), forward_only, bad input keys, checkpoints."""
    case.check()


# --------------------------------------------------------------------------- one process
def chain(split: Any, inputs: Any) -> Any:
    """Runs the stages one after another, as the runtime passes values between them."""
    from pipedream_ext._frontend.model_io import positional_inputs, restore_output

    value = positional_inputs(split.input_names, inputs, "test")
    for stage in split.stages:
        value = stage(value)
    return restore_output(split.output_spec, value)


def test_export_path_keeps_parameters_names_and_runs_at_other_shapes() -> None:
    """fx cannot trace GPT-2; the exported stages hold the model's own tensors, cross
    cuts with tensors only, and run at other batch sizes and sequence lengths."""
    from pipedream_ext._frontend.graph_split import split_model

    model = make_gpt2()
    inputs, _ = make_batch(8, 12, 0, True)
    split = split_model(model, SPLITS[3], inputs, NO_CACHE)
    assert split.tracer == "export" and split.input_names == ["input_ids", "attention_mask"]
    own = dict(model.named_parameters(remove_duplicate=False))
    for stage in split.stages:
        for name, p in stage.named_parameters():
            assert p is own[name], name
    names = [{n for n, _ in stage.named_parameters()} for stage in split.stages]
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" in names[-1]
    keys = {k for stage in split.stages for k in stage.state_dict()}
    assert keys == set(model.state_dict()), keys ^ set(model.state_dict())
    for n, length in [(8, 12), (2, 12), (3, 5), (1, 30)]:
        batch, _ = make_batch(n, length, n + length, True)
        got = chain(split, batch)
        with torch.no_grad():
            want = model(**batch, **NO_CACHE)
        assert type(got).__name__ == "CausalLMOutputWithCrossAttentions"
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
    # Tensors the graph creates (positions, masks) follow the stage to its device.
    from pipedream_ext._frontend.export import retarget_devices

    devices = lambda stage: {a for n in stage.graph.nodes for a in n.kwargs.values()  # noqa: E731
                             if isinstance(a, torch.device)}
    assert devices(split.stages[0]) == {torch.device("cpu")}
    retarget_devices(split.stages[0], torch.device("meta"))
    assert devices(split.stages[0]) == {torch.device("meta")}


def test_export_dropout_follows_train_and_eval() -> None:
    """The exported graph's dropout calls the model's own nn.Dropout modules, so
    pipe.eval() turns it off as in the unsplit model."""
    from pipedream_ext._frontend.graph_split import split_model
    from pipedream_ext._frontend.local_stages import LocalStages
    from pipedream_ext._frontend.partition import resolve_partition

    model = make_gpt2(dropout=0.3)
    inputs, _ = make_batch(4, 8, 0, False)
    split = split_model(model, SPLITS[2], inputs, NO_CACHE)
    calls = [n.target for s in split.stages for n in s.graph.nodes if n.op == "call_module"]
    assert "transformer.h.0.attn.resid_dropout" in calls and "transformer.drop" in calls, calls
    stages = LocalStages(model, resolve_partition(2, 1, chunks=2, balance=[1, 1]), [0, 1],
                         torch.device("cpu"), traced=split.stages)
    stages.module.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(chain(split, inputs).logits,
                                   model(**inputs, **NO_CACHE).logits, rtol=RTOL, atol=ATOL)
    stages.module.train()
    with torch.no_grad():
        first, second = chain(split, inputs).logits, chain(split, inputs).logits
    assert not torch.equal(first, second)  # dropout is on again


def test_named_inputs_map_to_the_graph_order() -> None:
    from pipedream_ext._frontend.model_io import positional_inputs

    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    assert positional_inputs(["input_ids", "mask"], {"mask": m, "input_ids": x}, "step()") == (x, m)
    assert positional_inputs(["input_ids"], {"input_ids": x}, "step()") is x
    assert positional_inputs(None, (x, m), "step()") == (x, m)
    assert positional_inputs(["input_ids"], None, "step()") is None
    with pytest.raises(ValueError, match=r"step\(\) inputs lack 'mask'"):
        positional_inputs(["input_ids", "mask"], {"input_ids": x}, "step()")
    with pytest.raises(ValueError, match=r"inputs hold 'labels', which the model was not traced"):
        positional_inputs(["input_ids"], {"input_ids": x, "labels": x}, "step()")
    with pytest.raises(ValueError, match=r"input 'input_ids' is a int, not a tensor"):
        positional_inputs(["input_ids"], {"input_ids": 3}, "step()")
    with pytest.raises(ValueError, match="traced on positional inputs"):
        positional_inputs(None, {"input_ids": x}, "forward_only()")


class _BatchNormBranch(nn.Module):
    """fx cannot trace it (a branch on a tensor's value) and its exported graph updates
    BatchNorm's running statistics in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x))
        h = torch.cond(h.sum() > 0, lambda t: t + 1, lambda t: t - 1, (h,))
        return self.b(h)


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent: neither fx nor export has a graph for it
            h = -h
        return self.b(h)


def test_what_neither_path_can_run_is_refused_naming_it() -> None:
    from pipedream_ext._frontend.graph_split import split_model

    model = _BatchNormBranch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"_BatchNormBranch cannot be traced with torch.fx .*"
                                         r"torch.export \(non-strict\) exports it, but its graph "
                                         r"changes 'norm.running_mean'.*in place"):
        split_model(model, ["b"], (torch.randn(4, 4),))
    for k, v in model.state_dict().items():  # the check ran the graph and put them back
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match=r"cannot export it either: \w+ in module '\(the root\)' "
                                         r"\(_Untraceable.forward, test_hf.py:\d+: if h.sum\(\) > 0:"):
        split_model(_Untraceable(), ["b"], (torch.randn(4, 4),))


if __name__ == "__main__":
    worker_main(LAUNCHES)
