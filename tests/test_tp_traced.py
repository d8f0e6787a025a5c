"""``PipeDream(split_points=[...], tensor_parallel=plan)``: tensor parallelism on a traced model.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=4ranks torchrun --standalone --nproc-per-node 4 tests/test_tp_traced.py

A torchtitan-style Llama that is not an ``nn.Sequential`` (``tok_embeddings``, ``layers``
an ``nn.ModuleDict`` of blocks with GQA attention ``wq/wk/wv/wo`` and a SwiGLU
``feed_forward`` ``w1/w2/w3``, RMSNorms, ``norm``, ``output``) cut by ``split_points``
on pp2 x tp2 (4 ranks, Gloo) with torchtitan's plan written over the model's own names
(``layers.*.attention.wq``), traced by torch.fx and (a variant fx cannot trace) by
torch.export, trains side by side with the unsplit model: the loss of every step,
every gradient of step 0 and every weight after 3 AdamW steps within 1e-4 relative,
with 1f1b and zb-h1, and with sequence parallelism (``PrepareModuleInput`` on
``layers.*.attention`` and ``layers.*.feed_forward``, whose hooks only run if the
traced stages call those modules). The plan really shards (DTensors with the plan's
placements; a style of our own counts the calls of the modules it matched), and what
cannot work is refused by name.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from test_tensor_parallel import close, mesh_of

HERE = os.path.abspath(__file__)
DIM, HEADS, KV_HEADS, VOCAB, SEQ, ROWS, LAYERS = 16, 4, 2, 32, 6, 8, 2
SPLIT = ["layers.1"]  # stage 0: the embedding and block 0; stage 1: block 1, norm, output
STEPS = 3


class Attention(nn.Module):
    """torchtitan's grouped-query attention: ``-1`` heads in the views, so a tp rank's
    column shard of wq/wk/wv runs its own heads; a fixed rotation stands in for RoPE."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def rotate(self, q: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return q * freqs

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.rotate(self.wq(x).view(bs, seqlen, -1, self.head_dim), freqs)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim) * freqs
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama layout: tok_embeddings, layers (a ModuleDict), norm, output."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs", torch.linspace(0.5, 1.5, DIM // HEADS), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.output(self.norm(h))


class ExportedTransformer(Transformer):
    """The same with a check torch.fx cannot trace (a branch on a shape): the pipeline
    takes the torch.export path."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > 1024:
            raise ValueError("sequence too long")
        return super().forward(tokens)


class DictFeedForward(FeedForward):
    """The feed-forward returning ``{"out": y}``: a call the torch.export path cannot put
    back (its result is not a tensor or a tuple of tensors)."""

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        return {"out": super().forward(x)}


class DictBlock(TransformerBlock):
    def __init__(self) -> None:
        super().__init__()
        self.feed_forward = DictFeedForward()

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))["out"]


class DictTransformer(ExportedTransformer):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): DictBlock() for i in range(LAYERS)})


class RotaryAttention(Attention):
    """torchtitan's rotary embedding: ``reshape(*x.shape[:-1], -1, 2)``, which torch.fx
    cannot trace (a shape unpacked) and torch.export records with the unsplit head count."""

    def rotate(self, q: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        pairs = q.reshape(*q.shape[:-1], -1, 2)
        return torch.stack((pairs[..., 0] - pairs[..., 1], pairs[..., 0] + pairs[..., 1]), -1).flatten(3) * freqs


class RotaryTransformer(Transformer):
    """The Llama with torchtitan's rotary reshape in every attention: traced by torch.fx
    only with the attentions kept as calls (they enclose the plan's wq/wk/wv/wo)."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.layers.values():
            rotary = RotaryAttention()
            rotary.load_state_dict(block.attention.state_dict())
            block.attention = rotary


def build(cls: type = Transformer, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = cls()
    with torch.no_grad():  # RMSNorm starts at ones: make its gradients' errors visible
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(seed: int, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def titan_plan(sequence_parallel: bool = False) -> Dict[str, Any]:
    """torchtitan's Llama plan (``parallelize_llama``), its per-block keys under ``layers.*``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: Dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        # The block norms return their local [b, s/tp, d] shard, so that only the
        # PrepareModuleInput hooks of attention and feed_forward gather the sequence (with
        # torchtitan's DTensor output, wq's own ColwiseParallel hook would gather it too,
        # and the test could not tell whether those hooks ran).
        plan.update({
            "norm": SequenceParallel(),
            "layers.*.attention_norm": SequenceParallel(use_local_output=True),
            "layers.*.ffn_norm": SequenceParallel(use_local_output=True),
            "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                     desired_input_layouts=(Replicate(), None)),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
        })
    return plan


def titan_apply_tp(sequence_parallel: bool = False) -> Any:
    """torchtitan's way to hand the plan over: a parallelize function of the whole model
    (``apply_tp(model, tp_mesh)``), walking its structure (``model.layers.values()``),
    which a traced stage does not have."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = titan_plan(sequence_parallel)
    top = {k: v for k, v in plan.items() if not k.startswith("layers.")}
    block = {k.removeprefix("layers.*."): v for k, v in plan.items() if k.startswith("layers.")}

    def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
        parallelize_module(model, tp_mesh, top)
        for transformer_block in model.layers.values():
            parallelize_module(transformer_block, tp_mesh, block)
    return apply_tp


def pipeline(model: nn.Module, plan: Any, schedule: str = "1f1b", **kwargs: Any) -> Any:
    import pipedream_ext as pd

    options = dict(schedule=schedule, microbatches=2, mesh=mesh_of((2, 1, 2)), timeout=60,
                   split_points=SPLIT, sample=batch(0), tensor_parallel=plan)
    options.update(kwargs)
    return pd.PipeDream(model, lm_loss, **options)


def init_unit(unit: nn.Module) -> None:
    """``init_fn`` of a meta-built Transformer: each unit (a module owning tensors) by its
    ``reset_parameters()``, the root's non-persistent ``freqs`` computed anew."""
    if isinstance(unit, Transformer):
        unit.freqs = torch.linspace(0.5, 1.5, DIM // HEADS)
    elif hasattr(unit, "reset_parameters"):
        unit.reset_parameters()


def models(cls: type, meta: bool) -> Tuple[nn.Module, nn.Module]:
    """(the reference, the model to pipeline): built for real, or on the meta device with
    the reference materialised whole by ``pd.materialize`` (the pipeline's init rule)."""
    if not meta:
        return build(cls), build(cls)
    import pipedream_ext as pd

    with torch.device("meta"):
        ref, model = cls(), cls()
    return pd.materialize(ref, init_fn=init_unit), model


def check_training(schedule: str, tracer: str = "fx", sequence_parallel: bool = False,
                   dp: int = 1, data_parallel: str = "replicate", meta: bool = False,
                   callable_plan: bool = False) -> None:
    """STEPS AdamW steps of the pipeline and of the unsplit model agree: the loss of every
    step, every gradient of step 0, every weight after each step (with ``dp`` > 1: on a
    pp2 x dp x tp2 mesh, each dp rank given its part of the unsplit model's batch; with
    ``meta``, the model built on the meta device: each rank materialises only its stages'
    units, which the plan then shards; with ``callable_plan``, the plan handed over as
    torchtitan's parallelize function)."""
    cls = {"export": ExportedTransformer, "fx-enclosing": RotaryTransformer}.get(tracer, Transformer)
    mesh = mesh_of((2, dp, 2))
    ref, model = models(cls, meta)
    plan = titan_apply_tp(sequence_parallel) if callable_plan else titan_plan(sequence_parallel)
    pipe = pipeline(model, plan, schedule, mesh=mesh,
                    data_parallel=data_parallel, init_fn=init_unit if meta else None)
    if meta:  # this rank's shards only; the other stage's tensors were never allocated
        assert not any(p.is_meta for p in pipe.parameters())
        assert any(p.is_meta for n, p in model.named_parameters()
                   if n not in dict(pipe.named_parameters())), "the other stage was materialised"
    dp_rank = mesh["dp"].get_local_rank()
    assert pipe.traced.tracer == tracer.partition("-")[0]
    from torch.distributed.tensor import DTensor

    sharded = sorted(n.split(".")[-2] for n, p in pipe.named_parameters() if isinstance(p, DTensor))
    assert {"wq", "wk", "wv", "wo", "w1", "w2", "w3"} <= set(sharded), sharded  # the plan applied
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, eps=1e-4)  # eps: test_tensor_parallel
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-4)
    refs = dict(ref.named_parameters())
    what = f"{tracer} {schedule}{' SP' if sequence_parallel else ''}"
    for step in range(STEPS):
        x, y = batch(step, ROWS * dp)
        part = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        loss = pipe.step(x[part], y[part])
        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        close(torch.as_tensor(float(loss)), ref_loss, f"{what} loss of step {step}")
        names = [name for name, _ in pipe.named_parameters()]
        assert names and set(names) <= set(refs), names
        if step == 0:
            for name, p in pipe.named_parameters():
                close(p.grad, refs[name].grad, f"{what} step-0 gradient of {name}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        for name, p in pipe.named_parameters():
            close(p, refs[name], f"{what} weight {name} after step {step}")
    pipe.close()


class CountCalls:
    """A ParallelStyle of our own (as users write them): counts its module's calls."""

    calls: Dict[str, int] = {}

    @staticmethod
    def style() -> Any:
        from torch.distributed.tensor.parallel import ParallelStyle

        class Counting(ParallelStyle):
            def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
                key = type(module).__name__
                module.register_forward_pre_hook(
                    lambda *_: CountCalls.calls.__setitem__(key, CountCalls.calls.get(key, 0) + 1))
                return module

        return Counting()


def check_plan_shards(tracer: str) -> None:
    """The plan really shards: wq/wk/wv/w1/w3, output and tok_embeddings are DTensors
    Shard(0) over the tp mesh, wo/w2 Shard(1), each rank holding half; the rest plain.
    The modules a pattern matches stay module calls under their original names: a style
    of our own on ``layers.*.attention`` (not a torch.nn module, which fx would trace
    through) runs once per block and microbatch. Every tp rank starts from tp rank 0's
    weights; forward_only gives the unsplit model's output."""
    from torch.distributed.tensor import DTensor, Shard

    cls = ExportedTransformer if tracer == "export" else Transformer
    # Each tp rank builds other weights: the pipeline starts from tp rank 0's (build()).
    model = build(cls, seed=int(os.environ["RANK"]) % 2)
    plan = titan_plan()
    if tracer == "fx":  # the export path puts back one-tensor calls only (refused below)
        plan["layers.*.attention"] = CountCalls.style()
    pipe = pipeline(model, plan)
    assert pipe.traced.tracer == tracer
    shard_dim = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0,
                 "tok_embeddings": 0, "wo": 1, "w2": 1}  # an embedding row-wise: its rows
    sharded: List[str] = []
    for name, p in pipe.named_parameters():
        leaf = name.split(".")[-2]
        if leaf in shard_dim:
            dim = shard_dim[leaf]
            assert isinstance(p, DTensor), name
            assert p.placements == (Shard(dim),), (name, p.placements)
            assert p.device_mesh.mesh_dim_names == ("tp",), name
            assert p.to_local().shape[dim] * 2 == p.shape[dim], (name, p.to_local().shape)
            sharded.append(leaf)
        else:
            assert not isinstance(p, DTensor), name
    extra = ["tok_embeddings"] if pipe.is_first else ["output"]
    assert sorted(sharded) == sorted(["wq", "wk", "wv", "wo", "w1", "w2", "w3"] + extra), sharded
    modules = dict(pipe.traced.stages[0 if pipe.is_first else 1].named_modules())
    block = "layers.0" if pipe.is_first else "layers.1"
    assert isinstance(modules[f"{block}.attention.wq"], nn.Linear)
    CountCalls.calls.clear()
    x, _ = batch(0)
    out = pipe.forward_only(x)
    if tracer == "fx":
        assert CountCalls.calls == {"Attention": 2}, CountCalls.calls  # 1 block x 2 microbatches
        assert isinstance(modules[f"{block}.attention"], Attention)
    if pipe.is_last:
        with torch.no_grad():
            close(out, build(cls)(x), "forward_only's output")
    pipe.close()


def check_refusals() -> None:
    """A pattern matching nothing, a split point inside a module the plan keeps as one
    call, a callable plan a traced stage cannot replay, and a call the export path
    cannot put back are refused, naming them."""
    from test_bad_input import ROWS
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    def row(row_id: str) -> str:
        return next(r[2] for r in ROWS if r[0] == row_id)

    from torch.distributed.tensor.parallel import parallelize_module

    keep_attention = {**titan_plan(), "layers.*.attention": PrepareModuleInput()}

    def set_heads(model: nn.Module, tp_mesh: Any) -> None:  # what a stage could not replay
        titan_apply_tp()(model, tp_mesh)
        model.layers["0"].attention.n_heads = HEADS // 2
    refused = [  # (row, what the message names, the model, the options)
        ("tp-plan-unmatched", "'layers.*.attention.wz'", Transformer,
         dict(tensor_parallel={**titan_plan(), "layers.*.attention.wz": ColwiseParallel()})),
        ("tp-split-inside", "split point 'layers.1.attention.wq' is inside 'layers.1.attention'",
         Transformer, dict(tensor_parallel=keep_attention, split_points=["layers.1.attention.wq"])),
        ("tp-callable-replay", "changed ['layers.0.attention'] of the model", Transformer,
         dict(tensor_parallel=set_heads)),
        ("tp-callable-replay", "applies ColwiseParallel to the whole model", Transformer,
         dict(tensor_parallel=lambda model, tp_mesh: parallelize_module(model, tp_mesh, ColwiseParallel()))),
        ("tp-export-call", "keeps 'layers.0.feed_forward' (DictFeedForward) as a module call",
         DictTransformer, dict(tensor_parallel={**titan_plan(), "layers.*.feed_forward": PrepareModuleInput()})),
    ]
    for row_id, names, cls, kwargs in refused:
        plan = kwargs.pop("tensor_parallel")
        with pytest.raises(ValueError, match=row(row_id)) as info:
            pipeline(build(cls), plan, **kwargs)
        assert names in str(info.value), (names, str(info.value))


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_plan_shards, "fx")
    c.add(check_plan_shards, "export")
    c.add(check_training, "1f1b")
    c.add(check_training, "zb-h1")
    c.add(check_training, "1f1b", "export")
    c.add(check_training, "zb-h1", sequence_parallel=True, name="training-zb-h1-sequence-parallel")
    c.add(check_training, "1f1b", meta=True, name="training-1f1b-meta")
    c.add(check_training, "1f1b", callable_plan=True, name="training-1f1b-callable")
    c.add(check_training, "1f1b", "fx-enclosing", name="training-1f1b-fx-enclosing")
    c.add(check_training, "zb-h1", sequence_parallel=True, callable_plan=True,
          name="training-zb-h1-sequence-parallel-callable")
    c.add(check_training, "1f1b", "export", meta=True, name="training-1f1b-export-meta")
    c.add(check_training, "zb-h1", "export", sequence_parallel=True,
          name="training-zb-h1-export-sequence-parallel")
    c.add(check_refusals)
    return c


@pytest.mark.parametrize("cls", [Transformer, ExportedTransformer], ids=["fx", "export"])
def test_plan_modules_stay_module_calls(cls: type) -> None:
    """One process: the modules named in keep_calls are called as modules in the stages,
    hold the model's own objects at their own names, and the stages still compute the
    model's output."""
    from pipedream_ext._frontend.graph_split import split_model

    model = build(cls)
    keep = ["tok_embeddings", "layers.0.attention.wq", "layers.1.feed_forward.w2", "output"]
    if cls is Transformer:
        keep.append("layers.1.attention")  # fx keeps any module; export one-tensor calls only
    split = split_model(model, SPLIT, batch(0)[:1], keep_calls=keep)
    assert split.tracer == ("fx" if cls is Transformer else "export")
    modules = dict(model.named_modules())
    called = {}
    for stage in split.stages:
        for node in stage.graph.nodes:
            if node.op == "call_module" and str(node.target) in modules:
                called[str(node.target)] = stage.get_submodule(str(node.target))
    for name in keep:
        assert called.get(name) is modules[name], (name, sorted(called))
    assert "layers.1.attention.wq" not in called  # fx: inside a kept call; export: not kept
    x = batch(0)[0]
    with torch.no_grad():
        h = x
        for stage in split.stages:
            h = stage(h)
        torch.testing.assert_close(h[0] if isinstance(h, tuple) else h, model(x))


def mesh_3d_cases(world: int) -> Cases:
    c = Cases()
    c.add(check_training, "1f1b", dp=2, data_parallel="fsdp", name="training-pp2-dp2-tp2-fsdp")
    return c


LAUNCH = Launch(HERE, 4, cases, timeout=300)
MESH_3D = Launch(HERE, 8, mesh_3d_cases, name="8ranks", timeout=300, marks=(pytest.mark.slow,))


@parametrize_cases(LAUNCH)
def test_tensor_parallel_on_a_traced_model(case: CaseRef) -> None:
    case.check()


@pytest.mark.slow
@parametrize_cases(MESH_3D)
def test_tensor_parallel_on_a_traced_model_pp2_dp2_tp2(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH, MESH_3D])


def test_a_callable_plan_is_recorded_as_the_dict_it_applies(group: Any) -> None:
    """One process: torchtitan's parallelize function, run on a meta copy with the styles
    recording instead of applying, gives the dict plan it amounts to (exact module
    names, in its order), a style class it defines as it runs included; the model is
    untouched and the styles apply for real afterwards; two styles on one module are
    refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

    from pipedream_ext._parallel.tp_record import recorded_plan

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = build(Transformer)
    before = {n: p.clone() for n, p in model.named_parameters()}
    plan = recorded_plan(titan_apply_tp(), model, mesh)
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3"]
    assert list(plan) == ["tok_embeddings", "output"] + [f"layers.{i}.{m}" for i in range(LAYERS)
                                                           for m in per_block]
    assert type(plan["layers.1.attention.wo"]).__name__ == "RowwiseParallel"
    assert all(torch.equal(p, before[n]) and not isinstance(p, DTensor) for n, p in model.named_parameters())
    assert not any(m._forward_pre_hooks for m in model.modules())  # nothing applied

    def own_style(model: nn.Module, tp_mesh: Any) -> None:
        class Counting(ParallelStyle):
            def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
                module.register_forward_pre_hook(lambda *_: None)
                return module
        parallelize_module(model.layers["1"].attention, tp_mesh, Counting())
    recorded = recorded_plan(own_style, model, mesh)
    assert list(recorded) == ["layers.1.attention"] and not model.layers["1"].attention._forward_pre_hooks
    parallelize_module(model.layers["1"].attention, mesh, recorded["layers.1.attention"])
    assert len(model.layers["1"].attention._forward_pre_hooks) == 1  # applied for real
    parallelize_module(model, mesh, {"layers.0.attention.wq": ColwiseParallel()})
    assert isinstance(model.layers["0"].attention.wq.weight, DTensor)  # the patch is undone

    def twice(model: nn.Module, tp_mesh: Any) -> None:
        parallelize_module(model, tp_mesh, {"output": ColwiseParallel()})
        parallelize_module(model.output, tp_mesh, ColwiseParallel())
    with pytest.raises(ValueError, match="applies two styles to 'output'"):
        recorded_plan(twice, build(Transformer), mesh)
