"""Traced models built on the meta device (``split_points`` without real weights).

In this process: tracing a meta-built Llama allocates nothing (every tensor of the
model stays on meta), a rank's stages materialise only the units they hold (the
other stage's tensors stay on meta), with the values ``pd.materialize`` gives the
whole model, which are those of a CPU-built model initialised unit by unit with the
documented rule spelled out by hand (``_init_weights`` under ``layer_seed``); the
rotary ``inv_freq`` is computed for real and equals the CPU-built model's; a model
with a module no rule initialises is refused naming it; an fx-traced model works
the same way with ``reset_parameters()``.

One torchrun launch of 2 ranks: meta-built Llama (torch.export), Qwen2 with its head
tied to the embedding across the cut, and an fx-traced model, each pipelined with
``1f1b`` against the same model materialised whole on the CPU and trained unsplit:
every step's loss and every weight after 3 SGD-momentum steps. One launch of 4
ranks: the fx-traced model and the Llama from meta over a pp 2 x dp 2 mesh with FSDP,
against the unsplit model on the global batch.

    torchrun --standalone --nproc-per-node 2 tests/test_traced_meta.py
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from torch import nn

transformers = pytest.importorskip("transformers")

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-5, 1e-6
SEED = 5
VOCAB = 64


# --------------------------------------------------------------------------- models
def llama_config(tied: bool = False) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        return build()


def meta_llama() -> nn.Module:
    from transformers import AutoModelForCausalLM

    return on_meta(lambda: AutoModelForCausalLM.from_config(llama_config()))


def meta_qwen2() -> nn.Module:
    from transformers import AutoModelForCausalLM

    return on_meta(lambda: AutoModelForCausalLM.from_config(qwen2_config()))


class Block(nn.Module):
    """A residual block with a parameter of its own (set by its ``reset_parameters()``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * self.gain


class Net(nn.Module):
    """fx-traceable: a stem, four blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Scale(nn.Module):
    """Owns a parameter but has no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class NetWithScale(Net):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(self.blocks[1](self.blocks[0](self.stem(x)))))


class NetWithTable(Net):
    """A plain tensor attribute (no parameter, no buffer): on meta, fx reads it as a
    constant nothing can give values."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.linspace(0.5, 1.5, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[1](self.blocks[0](self.stem(x))) * self.table)


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, -2), y.flatten())


def lm_batch(step: int, n: int = 8, length: int = 6) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (n, length + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()


def net_batch(step: int, n: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _prepare(model: nn.Module, split_points: List[str], sample: Any, **options: Any) -> Any:
    """What every rank does before any communication: check and trace."""
    from pipedream_ext._build import PipelineArguments, prepare_model

    return prepare_model(PipelineArguments(module=model, loss_fn=lm_loss, split_points=split_points,
                                           sample=sample, init_seed=SEED, **options))


def _stages_of(model: nn.Module, prepared: Any, indices: List[int]) -> Any:
    from pipedream_ext._frontend.local_stages import LocalStages
    from pipedream_ext._frontend.partition import resolve_partition

    count = len(prepared.traced.stages)
    partition = resolve_partition(count, count, 1, [1] * count, None)
    return LocalStages(model, partition, indices, torch.device("cpu"), SEED,
                       traced=prepared.traced.stages)


# --------------------------------------------------------------------------- one process
def test_a_rank_materialises_only_its_stages_with_the_whole_models_values() -> None:
    import pipedream_ext as pd

    model = meta_llama()
    prepared = _prepare(model, ["model.layers.2"], lm_batch(0), concrete_args={"use_cache": False})
    assert prepared.traced.tracer == "export" and prepared.deferred
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # tracing allocates nothing
    last = _stages_of(model, prepared, [1])
    held = dict(last.module.named_parameters())
    assert "lm_head.weight" in held and "model.layers.3.mlp.up_proj.weight" in held
    assert not any(t.is_meta for t in [*last.module.parameters(), *last.module.buffers()])
    others = [n for n, p in model.named_parameters() if n not in held]
    assert others and "model.embed_tokens.weight" in others
    assert all(model.get_parameter(n).is_meta for n in others)  # stage 0's: no storage here
    whole = dict(pd.materialize(meta_llama(), "cpu", seed=SEED).named_parameters())
    for name, p in held.items():
        assert torch.equal(p, whole[name]), name
    first_model = meta_llama()
    first = _stages_of(first_model, _prepare(first_model, ["model.layers.2"], lm_batch(0),
                                             concrete_args={"use_cache": False}), [0])
    assert first_model.lm_head.weight.is_meta
    inv_freq = first.module.get_buffer("model.rotary_emb.inv_freq")
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config(llama_config())
    assert not inv_freq.is_meta and torch.equal(inv_freq, real.model.rotary_emb.inv_freq)
    assert torch.equal(first.module.get_parameter("model.embed_tokens.weight"),
                       whole["model.embed_tokens.weight"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_materialize_is_the_rule_spelled_out_on_a_cpu_built_model(family: str) -> None:
    """Unit ``u`` (the ``u``-th module owning tensors) initialised by the model's
    ``_init_weights`` under ``manual_seed(seed * 2**16 + u)``, then every module holding
    it, nearest first (on these models a parent sets only tensors of units after the
    one it is called for, which those redraw: the rule without the restriction)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    import pipedream_ext as pd

    config = llama_config() if family == "llama" else \
        GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=32)
    by_hand = AutoModelForCausalLM.from_config(config)
    named = dict(by_hand.named_modules())
    units = [name for name, m in by_hand.named_modules()
             if list(m.parameters(recurse=False)) or list(m.buffers(recurse=False))]
    seen: Dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for u, name in enumerate(units):
            own = [*named[name].parameters(recurse=False), *named[name].buffers(recurse=False)]
            tied = [(t, t.clone()) for t in own if id(t) in seen]  # keeps its first unit's values
            torch.manual_seed(SEED * 2**16 + u)
            parts = name.split(".")
            for k in range(len(parts), -1, -1):  # the unit, then its parents up to the model
                by_hand._init_weights(named[".".join(parts[:k])])
            for t, value in tied:
                t.copy_(value)
            seen.update((id(t), t) for t in own)
    meta = pd.materialize(on_meta(lambda: AutoModelForCausalLM.from_config(config)), "cpu", seed=SEED)
    want = by_hand.state_dict()
    assert list(meta.state_dict()) == list(want)
    for name, value in meta.state_dict().items():
        assert torch.equal(value, want[name]), name
    for name, value in by_hand.named_buffers():
        assert torch.equal(meta.get_buffer(name), value), name


def _family(name: str) -> Tuple[Any, Any]:
    """A tiny config of ``name``'s family with tensors large enough for statistics (64..128
    wide), and its auto class."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        BertConfig,
        GPT2Config,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
    )

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "gpt2":
        return GPT2Config(vocab_size=256, n_embd=128, n_layer=6, n_head=4, n_positions=64), \
            AutoModelForCausalLM
    if name == "bert":
        return BertConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=4, max_position_embeddings=64), AutoModelForMaskedLM
    if name == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2), AutoModelForCausalLM
    return (LlamaConfig if name == "llama" else Qwen2Config)(**common), AutoModelForCausalLM


def _same_distribution(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Deterministic tensors (constants, integer buffers, rotary frequencies) equal; random
    ones with the same mean and std within 6 sampling errors."""
    if not theirs.is_floating_point() or theirs.numel() < 2 or float(theirs.std()) == 0.0 \
            or "inv_freq" in name:
        assert torch.equal(ours, theirs), f"{name}: {ours.flatten()[:4]} != {theirs.flatten()[:4]}"
        return
    n, std = theirs.numel(), float(theirs.double().std())
    assert abs(float(ours.double().std()) - std) <= 6 * std / (2 * n) ** 0.5, \
        f"{name}: std {float(ours.std()):.5f}, transformers' from_config {std:.5f}"
    assert abs(float(ours.double().mean()) - float(theirs.double().mean())) <= 6 * 2 ** 0.5 * std / n ** 0.5, \
        f"{name}: mean {float(ours.mean()):.5f}, transformers' {float(theirs.mean()):.5f}"


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "bert", "mixtral"])
def test_meta_initialisation_has_the_statistics_of_from_config(family: str) -> None:
    """Every tensor of a meta-built model materialised with the model's rule (every
    ``_init_weights`` call transformers makes on the whole model, parents included:
    GPT-2's c_proj has std 0.02/sqrt(2 n_layer)) is distributed as from_config's."""
    import pipedream_ext as pd

    config, auto = _family(family)
    ours = pd.materialize(on_meta(lambda: auto.from_config(config)), "cpu", seed=SEED)
    torch.manual_seed(SEED)
    theirs = auto.from_config(config)
    want = theirs.state_dict()
    assert list(ours.state_dict()) == list(want)
    for name, value in ours.state_dict().items():
        _same_distribution(name, value, want[name])
    for name, value in theirs.named_buffers():  # non-persistent ones too
        _same_distribution(name, ours.get_buffer(name), value)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)


class ParentInit(nn.Module):
    """``_init_weights`` as transformers models write it: a parent (``Pair``) re-draws a
    child's weight (``a``), which a later sibling's (``b``'s) turn must not redraw."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs = nn.ModuleList(Pair() for _ in range(2))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=1.0)
            nn.init.zeros_(module.bias)
        if isinstance(module, Pair):
            nn.init.normal_(module.a.weight, std=0.1)


def test_a_parents_init_applies_to_a_units_tensors_whichever_units_are_materialised() -> None:
    import pipedream_ext as pd
    from pipedream_ext._frontend.deferred_init import materialize_traced

    with torch.device("meta"):
        whole, first, second = ParentInit(), ParentInit(), ParentInit()
    pd.materialize(whole, seed=SEED)
    assert 0.08 < float(whole.pairs[1].a.weight.detach().std()) < 0.12  # the parent's rule
    assert 0.8 < float(whole.pairs[1].b.weight.detach().std()) < 1.2
    # Each unit alone (as a rank holding only it): the values of the whole model.
    materialize_traced(first, "cpu", SEED, tensors=[first.pairs[0].a.weight])
    materialize_traced(second, "cpu", SEED, tensors=[second.pairs[0].b.weight])
    assert first.pairs[0].b.weight.is_meta and second.pairs[0].a.weight.is_meta
    assert torch.equal(first.pairs[0].a.weight, whole.pairs[0].a.weight)
    assert torch.equal(second.pairs[0].b.weight, whole.pairs[0].b.weight)


def test_fx_traced_meta_model_materialises_with_reset_parameters() -> None:
    import pipedream_ext as pd

    with torch.device("meta"):
        model = Net()
    prepared = _prepare(model, ["blocks.2"], net_batch(0))
    assert prepared.traced.tracer == "fx"
    stages = _stages_of(model, prepared, [0])
    assert model.head.weight.is_meta and model.blocks[3].gain.is_meta
    with torch.device("meta"):
        whole = dict(pd.materialize(Net(), seed=SEED).named_parameters())
    for name, p in stages.module.named_parameters():
        assert torch.equal(p, whole[name]), name


def test_sequential_cut_by_split_points_keeps_its_per_layer_rule() -> None:
    import pipedream_ext as pd

    def make() -> nn.Sequential:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3))

    model = make()
    stages = _stages_of(model, _prepare(model, ["2"], net_batch(0)), [1])
    assert model[0].weight.is_meta
    whole = dict(pd.materialize(make(), seed=SEED).named_parameters())
    held = dict(stages.module.named_parameters())
    assert sorted(held) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    for name, p in held.items():
        assert torch.equal(p, whole[name]), name


def test_meta_model_without_an_init_rule_is_refused_naming_the_module() -> None:
    with torch.device("meta"):
        model = NetWithScale()
    with pytest.raises(ValueError, match=r"'scale' \(Scale: weight\).*no reset_parameters\(\).*"
                                         r"init_fn"):
        _prepare(model, ["blocks.1"], net_batch(0))
    assert model.scale.weight.is_meta  # nothing was allocated


def test_a_constant_traced_on_meta_is_refused_naming_it() -> None:
    with torch.device("meta"):
        model = NetWithTable()
    prepared = _prepare(model, ["blocks.1"], net_batch(0))
    with pytest.raises(ValueError, match=r"'table' is on the meta device but is no parameter or "
                                         r"buffer of the model"):
        _stages_of(model, prepared, [1])


# --------------------------------------------------------------------------- worker checks
def _train(pipe: Any, ref: nn.Module, loss_fn: Callable[..., torch.Tensor],
           batches: Callable[[int], Tuple[Any, torch.Tensor]], what: str, microbatches: int) -> None:
    """3 SGD-momentum steps of ``pipe`` and of the unsplit ``ref`` on the pipeline's
    microbatches (each loss scaled by its rows' share): losses, then every weight."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        inputs, y = batches(step)
        expected = 0.0
        for rows in torch.tensor_split(torch.arange(y.shape[0]), microbatches):
            part = {k: v[rows] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[rows]
            out = ref(**part) if isinstance(part, dict) else ref(part)
            loss = loss_fn(out, y[rows]) * (len(rows) / y.shape[0])
            loss.backward()
            expected += float(loss)
        loss = pipe.step(inputs, y)
        assert abs(loss - expected) <= RTOL * max(1.0, abs(expected)) + ATOL, \
            f"{what} step {step}: loss {loss} != {expected}"
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    want = ref.state_dict()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} after 3 steps: {name}: {m}")


def _check_hf(build: Callable[[], nn.Module], what: str) -> None:
    import pipedream_ext as pd

    model = build()
    pipe = pd.PipeDream(model, lm_loss, schedule="1f1b", microbatches=2, timeout=120,
                        split_points=["model.layers.2"], sample=lm_batch(0), init_seed=SEED,
                        concrete_args={"use_cache": False})
    assert not any(t.is_meta for t in [*pipe.module.parameters(), *pipe.module.buffers()])
    ref = pd.materialize(build(), "cpu", seed=SEED)
    _train(pipe, ref, lm_loss, lm_batch, what, 2)


def check_llama_from_meta_trains_like_the_unsplit_model() -> None:
    _check_hf(meta_llama, "llama")


def check_tied_qwen2_from_meta_trains_like_the_unsplit_model() -> None:
    _check_hf(meta_qwen2, "qwen2 (tied head)")


def check_fx_model_from_meta_trains_like_the_unsplit_model() -> None:
    import pipedream_ext as pd

    with torch.device("meta"):
        model, ref = Net(), Net()
    pipe = pd.PipeDream(model, F.cross_entropy, schedule="1f1b", microbatches=2, timeout=120,
                        split_points=["blocks.2"], sample=net_batch(0), init_seed=SEED)
    pd.materialize(ref, "cpu", seed=SEED)
    _train(pipe, ref, F.cross_entropy, net_batch, "fx Net", 2)


def _check_fsdp(model: nn.Module, ref: nn.Module, loss_fn: Callable[..., torch.Tensor],
                batches: Callable[[int], Tuple[Any, torch.Tensor]], split_points: List[str],
                what: str, **options: Any) -> None:
    """pp 2 x dp 2, FSDP: each rank materialises its stage's units, then shards them;
    the unsplit ``ref`` sees the global batch (each dp rank steps on its half)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import pipedream_ext as pd

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pipe = pd.PipeDream(model, loss_fn, schedule="1f1b", microbatches=2, timeout=120,
                        split_points=split_points, sample=batches(0), init_seed=SEED,
                        mesh=mesh, data_parallel="fsdp", **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    half = slice(mesh["dp"].get_local_rank() * 4, mesh["dp"].get_local_rank() * 4 + 4)
    for step in range(3):
        inputs, y = batches(step)
        expected = loss_fn(ref(**inputs) if isinstance(inputs, dict) else ref(inputs), y)
        expected.backward()
        mine = {k: v[half] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[half]
        loss = float(pipe.step(mine, y[half]))
        assert abs(loss - expected.item()) <= RTOL * max(1.0, abs(expected.item())) + ATOL, \
            f"{what}: rank {dist.get_rank()} step {step}: loss {loss} != {expected.item()}"
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    want = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        torch.testing.assert_close(full, want[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} after 3 steps: {name}: {m}")


def check_fx_model_from_meta_with_fsdp_mesh() -> None:
    import pipedream_ext as pd

    with torch.device("meta"):
        model, ref = Net(), Net()
    _check_fsdp(model, pd.materialize(ref, "cpu", seed=SEED), F.cross_entropy, net_batch,
                ["blocks.2"], "fx Net, fsdp")


def check_llama_from_meta_with_fsdp_mesh() -> None:
    """torch.export stages: their device constants are pointed at the rank's device
    before FSDP wraps them."""
    import pipedream_ext as pd

    _check_fsdp(meta_llama(), pd.materialize(meta_llama(), "cpu", seed=SEED), lm_loss, lm_batch,
                ["model.layers.2"], "llama, fsdp", concrete_args={"use_cache": False})


def traced_meta_cases(world: int) -> Cases:
    cases = Cases()
    if world == 2:
        cases.add(check_llama_from_meta_trains_like_the_unsplit_model)
        cases.add(check_tied_qwen2_from_meta_trains_like_the_unsplit_model)
        cases.add(check_fx_model_from_meta_trains_like_the_unsplit_model)
    else:
        cases.add(check_fx_model_from_meta_with_fsdp_mesh)
        cases.add(check_llama_from_meta_with_fsdp_mesh)
    return cases


TWO, FOUR = (Launch(HERE, world, traced_meta_cases, timeout=600) for world in (2, 4))


@parametrize_cases(TWO, FOUR)
def test_meta_built_traced_pipelines_train_like_the_unsplit_model(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([TWO, FOUR])
