"""``PipeDream(mesh=(pp, ep), expert_parallel=plan)``: expert parallelism inside the stages.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=4ranks-nccl_rules PIPEDREAM_TEST_BACKEND=nccl_rules PDEP_DIR=/tmp/x \
        torchrun --standalone --nproc-per-node 4 tests/test_expert_parallel.py

A torchtitan-style MoE transformer (``tests/moe_model.py``: ``layers`` a ModuleDict of
blocks whose ``moe.experts`` are ``GroupedExperts``), cut by ``split_points`` on pp2 x ep2
(4 ranks, Gloo) with torchtitan's ``ExpertParallel`` on ``layers.*.moe.experts``, trains
side by side with the unsplit model on the whole batch (each ep rank given its part, as
a data rank): the loss of every step, every gradient of step 0 and every weight after
3 steps within 1e-4, with AdamW and SGD with momentum, on every flush schedule: 1f1b,
zb-h1, gpipe and (4 stages, two stages' experts per rank) zbv, interleaved-1f1b, dualpipev
and interleaved-zb. The
routing is data-dependent and uneven (some experts get no tokens in some microbatches,
checked); the experts' parameters really are shards (half the experts per rank, DTensors
over ``mesh["ep"]``); what is not supported yet is refused by name.
"""
from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, FromEnv, Launch, parametrize_cases, strict_and_gloo, worker_main
from moe_model import (
    EXPERTS,
    VOCAB,
    ExpertParallel,
    MoETransformer,
    build,
    clear_counts,
    counts_seen,
    lm_loss,
    sequential,
    update_expert_bias,
)
from test_tensor_parallel import close, full, mesh_of

HERE = os.path.abspath(__file__)
SEQ, ROWS, STEPS = 4, 4, 3
SPLIT = ["layers.1"]


def batch(seed: int, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def plan() -> Dict[str, Any]:
    return {"layers.*.moe.experts": ExpertParallel()}


def pipeline(model: nn.Module, schedule: str = "1f1b", loss_fn: Callable[..., Any] = lm_loss,
             **kwargs: Any) -> Any:
    import pipedream_ext as pd

    options = dict(schedule=schedule, microbatches=2, mesh=mesh_of((2, 2), ("pp", "ep")),
                   timeout=60, split_points=SPLIT, sample=batch(0), expert_parallel=plan())
    options.update(kwargs)
    return pd.PipeDream(model, loss_fn, **options)


def optimizers(kind: str, pipe: Any, ref: nn.Module):
    if kind == "adamw":
        make = lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4)  # noqa: E731
    else:
        make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    return make(pipe.parameters()), make(ref.parameters())


def train_alongside(what: str, pipe: Any, opt: Any, ref: nn.Module, ref_opt: Any,
                    ref_step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
                    clip: Optional[float] = None, buffers: bool = False,
                    mask: Optional[Callable[[torch.Tensor, int], None]] = None) -> None:
    """STEPS steps of the pipeline (each copy its rows of the global batch) and of the
    unsplit model (``ref_step(x, y, copies)``: its backward on the whole batch, returning
    the loss) agree: the loss of every step, every gradient of step 0 and every weight
    (and with ``buffers`` every buffer) after each step; with ``clip``,
    ``pd.clip_grad_norm_`` before every update equals torch's on the unsplit model;
    ``mask(y, step)`` edits the global targets first."""
    import pipedream_ext as pd

    mine, copies = pipe.data_parallel_rank, pipe.data_parallel_size  # (dp, ep) coordinates
    refs = {**dict(ref.named_parameters()), **(dict(ref.named_buffers()) if buffers else {})}
    for step in range(STEPS):
        x, y = batch(step, ROWS * copies)
        if mask is not None:
            mask(y, step)
        part = slice(mine * ROWS, (mine + 1) * ROWS)
        loss = pipe.step(x[part], y[part])
        ref_opt.zero_grad()
        close(torch.as_tensor(float(loss)), ref_step(x, y, copies), f"{what}: loss of step {step}")
        if clip is not None:
            close(pd.clip_grad_norm_(pipe, clip), torch.nn.utils.clip_grad_norm_(ref.parameters(), clip),
                  f"{what}: gradient norm of step {step}")
        if step == 0:
            for name, p in pipe.named_parameters():
                close(p.grad, refs[name].grad, f"{what}: step-0 gradient of {name}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        tensors = [*pipe.named_parameters(), *(pipe.named_buffers() if buffers else [])]
        assert tensors and {name for name, _ in tensors} <= set(refs), tensors
        for name, t in tensors:
            close(t, refs[name], f"{what}: {name} after step {step}")


def whole_batch(ref: nn.Module, loss_fn: Callable[..., Any] = lm_loss):
    """``ref_step`` of :func:`train_alongside`: the unsplit model's loss on the whole
    batch (a token-sum loss divided by its tokens), backward run."""
    def step(x: torch.Tensor, y: torch.Tensor, copies: int) -> torch.Tensor:
        value = loss_fn(ref(x), y)
        loss = value[0] / value[1] if isinstance(value, tuple) else value
        loss.backward()
        return loss.detach()
    return step


def accumulated(ref: nn.Module, aux_scale: Optional[float] = None, microbatches: int = 2):
    """``ref_step`` of :func:`train_alongside`: gradient accumulation of the unsplit model
    over each copy's ``microbatches``, each weighing ``1 / (microbatches x copies)``, its aux
    losses ``aux_scale`` (default that weight too)."""
    import pipedream_ext as pd

    def step(x: torch.Tensor, y: torch.Tensor, copies: int) -> torch.Tensor:
        weight, total = 1.0 / (microbatches * copies), torch.zeros(())
        for c in range(copies):
            rows = slice(c * ROWS, (c + 1) * ROWS)
            for xi, yi in zip(torch.tensor_split(x[rows], microbatches), torch.tensor_split(y[rows], microbatches)):
                with pd.aux_loss_scale(weight if aux_scale is None else aux_scale):
                    loss = lm_loss(ref(xi), yi) * weight
                loss.backward()
                total += loss.detach()
        return total
    return step


def split_pipeline(model: nn.Module, schedule: str, layers: int, **options: Any) -> Any:
    """:func:`pipeline` cut into 2 stages, or with 4 layers 4 (two per rank)."""
    split = SPLIT if layers == 2 else [f"layers.{i}" for i in range(1, layers)]
    return pipeline(model, schedule, split_points=split, chunks=1 if layers == 2 else 2, **options)


def check_training(schedule: str, optimizer: str = "adamw", layers: int = 2,
                   clip: Optional[float] = None, dp: int = 1, **options: Any) -> None:
    """The pipeline trains as the unsplit model (:func:`train_alongside`), the ep ranks
    data ranks; some expert got no tokens somewhere. With 4 layers, 4 stages (two per
    rank: zbv's V); with ``clip`` each expert shard counted once; with ``dp`` > 1 on a
    (pp 2, dp, ep 2) mesh."""
    if dp > 1:
        options["mesh"] = mesh_of((2, dp, 2), ("pp", "dp", "ep"))
    ref = build(layers)
    pipe = split_pipeline(build(layers), schedule, layers, **options)
    assert pipe.data_parallel_size == dist.get_world_size() // 2, pipe.data_parallel_size
    opt, ref_opt = optimizers(optimizer, pipe, ref)
    clear_counts()  # construction measured the sample's forward
    train_alongside(f"{schedule} {optimizer}", pipe, opt, ref, ref_opt, whole_batch(ref), clip=clip)
    if options.get("overlap") is True:  # torchtitan's ExpertParallel: yields around its hooks
        assert pipe.stats()["overlap_yields"] > 0, "no half of an F&B pair yielded"
    if layers == 2:  # one MoE layer per rank: each forward records its local experts' counts
        runs = 2 if options.get("recompute") else 1  # a recomputed forward routes again
        assert len(counts_seen()) == runs * STEPS * 2 * (EXPERTS // 2), len(counts_seen())
    empty = torch.tensor([int(0 in counts_seen())])
    dist.all_reduce(empty)
    assert int(empty) > 0, "no expert was left without tokens: the test does not cover it"
    pipe.close()


def check_sequential(schedule: str) -> None:
    """An nn.Sequential (no tracing: its children are the stages' layers, the plan's
    pattern ``*.moe.experts`` over their names) on pp2 x ep2, with FSDP, trains as the
    unsplit model."""
    import pipedream_ext as pd

    ref = sequential()
    pipe = pd.PipeDream(sequential(), lm_loss, schedule=schedule, microbatches=2, balance=[2, 3],
                        mesh=mesh_of((2, 2), ("pp", "ep")), timeout=60,
                        expert_parallel={"*.moe.experts": ExpertParallel()})
    assert any(".moe.experts." in n for n, _ in pipe.named_parameters())
    opt, ref_opt = optimizers("adamw", pipe, ref)
    train_alongside(f"Sequential {schedule}", pipe, opt, ref, ref_opt, whole_batch(ref))
    pipe.close()


def check_planned_sequential() -> None:
    """``balance="auto"``, ``schedule="auto"`` and ``data_parallel="auto"`` on pp2 x ep2:
    the planner cuts the nn.Sequential and picks its schedule and FSDP or replicas knowing
    the plan's experts and all_to_all (``pipe.configuration.ep``), and the chosen pipeline
    trains as the unsplit model."""
    ref = sequential()
    import pipedream_ext as pd

    pipe = pd.PipeDream(sequential(), lm_loss, schedule="auto", microbatches=2, balance="auto",
                        data_parallel="auto", sample=batch(0), mesh=mesh_of((2, 2), ("pp", "ep")),
                        timeout=60, expert_parallel={"*.moe.experts": ExpertParallel()})
    chosen = pipe.configuration
    assert chosen is not None and chosen.ep == 2 and chosen.mesh == (2, 2, 1), chosen
    assert chosen.data_parallel in ("fsdp", "replicate") and chosen.candidates, chosen
    assert "ep=2 of the dp copies share their experts" in chosen.summary()
    opt, ref_opt = optimizers("adamw", pipe, ref)
    train_alongside("Sequential balance='auto'", pipe, opt, ref, ref_opt, whole_batch(ref))
    pipe.close()


def check_mesh_auto() -> None:
    """``mesh="auto"`` with a dict plan: the planner factors the 4 ranks into (pp, dp, tp)
    and an ep dividing dp and the 8 experts (each ep a search of its own), builds the
    chosen ``("pp", "ep")`` / ``("pp", "dp", "ep")`` mesh, and the pipeline trains as the
    unsplit model on the whole run's batch."""
    import pipedream_ext as pd

    ref = sequential()
    pipe = pd.PipeDream(sequential(), lm_loss, schedule="auto", microbatches=2, balance="auto",
                        data_parallel="auto", sample=batch(0, 2 * ROWS), mesh="auto", timeout=60,
                        expert_parallel={"*.moe.experts": ExpertParallel()})
    chosen = pipe.configuration
    assert chosen.mesh[1] % chosen.ep == 0 and pipe.data_parallel_size == chosen.mesh[1], chosen
    opt, ref_opt = optimizers("adamw", pipe, ref)
    train_alongside("mesh='auto'", pipe, opt, ref, ref_opt, whole_batch(ref))
    pipe.close()


def check_aux_loss(schedule: str, layers: int = 2, **options: Any) -> None:
    """A router's load-balancing loss added in its layer's backward (``pd.add_aux_loss``)
    trains as gradient accumulation of the unsplit model over the same microbatches with
    ``pd.aux_loss_scale(1 / (microbatches x copies))`` (:func:`accumulated`; the reported
    loss is the model's, without the aux term), whichever stage and schedule runs the
    layer (the split backward's I and W: zb-h1, zbv) and with recompute, 3 SGD steps.
    The aux term really moves the routers."""
    ref = build(layers, aux=True)
    pipe = split_pipeline(build(layers, aux=True), schedule, layers, **options)
    x, y = batch(0, ROWS * pipe.data_parallel_size)
    router = "layers.0.moe.router.weight"
    grads = []
    for aux_scale in (None, 0.0):  # on a copy: the weights the test starts from stay
        probe = copy.deepcopy(ref)
        accumulated(probe, aux_scale)(x, y, pipe.data_parallel_size)
        grads.append(dict(probe.named_parameters())[router].grad)
    moved = (grads[0] - grads[1]).abs().max()
    assert moved > 1e-3 * grads[0].abs().max(), f"the aux loss hardly changes {router}: {moved}"
    opt, ref_opt = optimizers("sgd", pipe, ref)
    train_alongside(f"{schedule} aux", pipe, opt, ref, ref_opt,
                    accumulated(ref, microbatches=options.get("microbatches", 2)))
    pipe.close()


def token_sum_loss(logits: torch.Tensor, targets: torch.Tensor):
    """``loss_reduction="tokens"``: the sum of the token losses (targets -100 skipped) and
    their count."""
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum",
                           ignore_index=-100)
    return loss, (targets != -100).sum()


def check_token_mean() -> None:
    """``loss_reduction="tokens"`` with masked targets (each ep rank's part holds another
    number of real tokens) trains as the unsplit model's mean over the whole batch's
    real tokens (AdamW), the experts' gradients included (summed over the ep ranks, not
    averaged)."""
    import pipedream_ext as pd

    ref = build()
    pipe = pd.PipeDream(build(), token_sum_loss, schedule="1f1b", microbatches=2, timeout=60,
                        mesh=mesh_of((2, 2), ("pp", "ep")), split_points=SPLIT, sample=batch(0),
                        expert_parallel=plan(), loss_reduction="tokens")
    opt, ref_opt = optimizers("adamw", pipe, ref)

    def mask(y: torch.Tensor, step: int) -> None:
        y[:ROWS, :1 + step] = -100  # the first copy's rows hold fewer real tokens

    train_alongside("tokens", pipe, opt, ref, ref_opt, whole_batch(ref, token_sum_loss), mask=mask)
    pipe.close()


def check_bias_balancing() -> None:
    """torchtitan's aux-loss-free balancing through an optimizer pre-step hook: each
    copy counts its tokens per expert, the hook sums them over ``pipe.data_parallel_group``
    and moves the expert bias; the losses, the weights and the biases after 3 AdamW steps
    equal the unsplit model's with the same hook over the whole batch, and the biases
    really moved."""
    ref = build(bias=True)
    pipe = pipeline(build(bias=True), "zb-h1")
    assert pipe.data_parallel_group is not None
    opt, ref_opt = optimizers("adamw", pipe, ref)
    opt.register_step_pre_hook(lambda *_: update_expert_bias(pipe, pipe.data_parallel_group))
    ref_opt.register_step_pre_hook(lambda *_: update_expert_bias(ref))
    train_alongside("bias balancing", pipe, opt, ref, ref_opt, whole_batch(ref), buffers=True)
    biases = [b for n, b in pipe.named_buffers() if n.endswith("expert_bias")]
    assert biases and all(float(b.abs().max()) > 0 for b in biases), biases
    pipe.close()


def check_shards() -> None:
    """The experts' w1/w2/w3 are DTensors Shard(0) over mesh['ep'] with half the experts
    each (ep rank r holds experts [r * 4, r * 4 + 4) of the unsplit model), everything
    else plain and equal to the unsplit model's; forward_only gives the unsplit output
    of this ep rank's part."""
    from torch.distributed.tensor import DTensor, Shard

    ref = build()
    pipe = pipeline(build(), data_parallel="replicate")
    ep_rank = pipe.data_parallel_rank
    refs = dict(ref.named_parameters())
    experts = []
    for name, p in pipe.named_parameters():
        if ".moe.experts." in name:
            assert isinstance(p, DTensor), name
            assert p.placements == (Shard(0),), (name, p.placements)
            assert p.device_mesh.mesh_dim_names == ("ep",), name
            local = p.to_local()
            assert local.shape[0] == EXPERTS // 2, (name, local.shape)
            half = EXPERTS // 2
            torch.testing.assert_close(local, refs[name][ep_rank * half:(ep_rank + 1) * half].detach())
            experts.append(name)
        else:
            assert not isinstance(p, DTensor), name
            torch.testing.assert_close(p.detach(), refs[name].detach())
    assert len(experts) == 3, experts
    x, _ = batch(5, ROWS * 2)
    part = x[ep_rank * ROWS:(ep_rank + 1) * ROWS]
    out = pipe.forward_only(part)
    if pipe.is_last:
        with torch.no_grad():
            close(out, ref(part), "forward_only's output")
    pipe.close()


def check_refusals() -> None:
    """What expert parallelism does not support yet is refused at construction, naming it
    (docs/bad_input.md's rows); a checkpoint save is refused before anything is written."""
    from test_bad_input import ROWS
    from torch.distributed.tensor.parallel import ColwiseParallel

    import pipedream_ext as pd

    def row(row_id: str) -> str:
        return next(r[2] for r in ROWS if r[0] == row_id)

    refused = [  # (row, what the message names, the options)
        ("ep-unsupported", "schedule='pipedream'", dict(schedule="pipedream")),
        ("ep-unsupported", "mesh='auto' and a callable plan",
         dict(mesh="auto", sample=batch(0, 8), balance="auto", split_points=None, model="sequential",
              expert_parallel=lambda stage, mesh: None)),
        ("tp-mesh", "after 'ep' with expert_parallel= (mesh has ('pp', 'ep'))",
         dict(tensor_parallel={"layers.*.mix": ColwiseParallel()})),
        ("tp-mesh", "'tp' dimension of size 2 but tensor_parallel= is not given",
         dict(mesh=mesh_of((1, 2, 2), ("pp", "ep", "tp")))),
        ("ep-mesh", "not ('pp', 'tp', 'ep')", dict(mesh=mesh_of((1, 2, 2), ("pp", "tp", "ep")),
                                                 tensor_parallel={"layers.*.mix": ColwiseParallel()})),
        ("ep-mesh", "'ep' dimension of size 2", dict(expert_parallel=None)),
        ("ep-mesh", "needs a mesh with an 'ep' dimension", dict(mesh=None)),
        ("ep-mesh", "not ('pp', 'dp')", dict(mesh=mesh_of((2, 2), ("pp", "dp")))),
        ("ep-plan-unmatched", "'layers.*.moe.gate'",
         dict(expert_parallel={"layers.*.moe.gate": ExpertParallel()})),
        ("ep-plan-type", "'experts'", dict(expert_parallel={"layers.*.moe.experts": "experts"})),
        ("ep-unsupported", "(MoETransformer) on the meta device", dict(model="meta")),
        ("ep-unsupported", "(Qwen3MoeForCausalLM) on the meta device",
         dict(model="qwen3_moe_meta", expert_parallel="auto", split_points=["model.layers.1"],
              loss_fn=transformers_loss, concrete_args={"use_cache": False})),
        ("ep-auto", "MoETransformer has none", dict(expert_parallel="auto")),
        ("ep-routed-experts", "has 3 experts, which the ep size 2 does not divide",
         dict(model="qwen3_moe_3", expert_parallel="auto", split_points=["model.layers.1"],
              loss_fn=transformers_loss, concrete_args={"use_cache": False})),
    ]
    for row_id, names, kwargs in refused:
        kind = kwargs.pop("model", None)
        if kind == "meta":  # its router's bincount has no meta kernel
            with torch.device("meta"):
                model = MoETransformer()
        elif kind == "sequential":
            model = sequential()
        elif kind == "qwen3_moe_meta":  # grouped_mm's meta kernel takes bf16 only
            with torch.device("meta"):
                model = transformers_moe("qwen3_moe")
        elif kind == "qwen3_moe_3":
            model = transformers_moe("qwen3_moe", experts=3)
        else:
            model = build()
        with pytest.raises(ValueError, match=row(row_id)) as info:
            pipeline(model, **kwargs)
        assert names in str(info.value), (names, str(info.value))
    pipe = pipeline(build())
    directory = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ep-refused-{os.getpid()}")
    with pytest.raises(ValueError, match=row("ep-checkpoint")):
        pd.save_checkpoint(directory, pipe)  # format="pipedream": one copy per stage
    assert not os.path.exists(directory)
    pipe.close()


def transformers_moe(kind: str, idle: bool = False, experts: int = 4, impl: Optional[str] = None) -> nn.Module:
    """A tiny transformers MoE (``"qwen3_moe"``, ``"mixtral"`` or ``"gpt_oss"``: 2 layers of
    4 experts, top-2), seeded; ``idle``: the routers' weights zero, so that in the first step every
    token picks experts 0 and 1 (topk's first of equal scores) and the ep rank holding
    experts 2 and 3 receives no row at all."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    shape: Dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if impl is not None:
        shape["experts_implementation"] = impl
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=experts, num_experts_per_tok=2, **shape))
    elif kind == "gpt_oss":  # experts(hidden_states, router_indices, routing_weights), with biases
        model = GptOssForCausalLM(GptOssConfig(num_local_experts=experts, num_experts_per_tok=2, head_dim=8,
                                               sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                               **dict(shape, intermediate_size=32)))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, **shape))
    if idle:
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith("mlp.gate"):
                    module.weight.zero_()
    return model.train()


def transformers_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(out.logits, y)


def check_transformers(kind: str, schedule: str, split: List[str], idle: bool = False,
                       root: Optional[str] = None, yields: bool = False, **options: Any) -> None:
    """A transformers MoE (its own experts, taken by the torch.export path) with
    ``expert_parallel="auto"`` (``RoutedExpertParallel`` on the experts its ``ep_plan``
    names) trains as the unsplit model; its experts are shards; with ``idle`` an ep rank
    received no row in the first step (checked) and the result is still exact; with
    ``root``, ``save_pretrained`` writes every expert, gathered over ep, which the model's
    own ``from_pretrained`` loads: the pipeline's weights, bit for bit; with ``yields``
    (``overlap=True``) the halves of dualpipev's F&B pairs passed the turn at the
    exchanges."""
    from pipedream_ext._parallel import routed_experts

    received: List[int] = []
    dispatch = routed_experts._Dispatching._dispatch

    def recording(self: Any, *args: Any) -> Any:
        out = dispatch(self, *args)
        received.append(out[0].shape[0])
        return out

    ref = transformers_moe(kind, idle)
    routed_experts._Dispatching._dispatch = recording
    try:
        pipe = pipeline(transformers_moe(kind, idle), schedule, expert_parallel="auto", split_points=split,
                        concrete_args={"use_cache": False}, loss_fn=transformers_loss, **options)
        experts = {n: p for n, p in pipe.named_parameters() if ".experts." in n}
        assert experts and all(p.to_local().shape[0] == 2 for p in experts.values()), experts
        opt, ref_opt = optimizers("adamw", pipe, ref)

        def ref_step(x: torch.Tensor, y: torch.Tensor, copies: int) -> torch.Tensor:
            loss = transformers_loss(ref(x, use_cache=False), y)
            loss.backward()
            return loss.detach()
        received.clear()  # construction ran the sample
        train_alongside(f"{kind} {schedule}", pipe, opt, ref, ref_opt, ref_step, clip=0.5)
        if yields:
            assert pipe.stats()["overlap_yields"] > 0, "no half of an F&B pair yielded"
    finally:
        routed_experts._Dispatching._dispatch = dispatch
    if idle:
        none = torch.tensor([int(0 in received)])
        dist.all_reduce(none)
        assert int(none) > 0, "every ep rank received rows: the test does not cover an idle one"
    if root is not None:
        import pipedream_ext as pd

        directory = os.path.join(root, f"{kind}-hf")
        whole = gathered(pipe)
        pd.save_pretrained(pipe, directory)
        if dist.get_rank() == 0:
            loaded = type(ref).from_pretrained(directory)
            same({k: v.detach() for k, v in loaded.named_parameters()}, whole, "from_pretrained of save_pretrained")
    pipe.close()


def dualpipe_example(module0: Any, inputs0: List[torch.Tensor], module1: Any,
                     outputs1: List[torch.Tensor], output_grads1: List[Optional[torch.Tensor]]):
    """DualPipe's example ``overlapped_forward_backward``: the forward, then the backward."""
    outputs0 = module0(*inputs0)
    torch.autograd.backward(outputs1, output_grads1)
    return outputs0


def forgets_the_backward(module0: Any, inputs0: List[torch.Tensor], module1: Any,
                         outputs1: List[torch.Tensor], output_grads1: List[Optional[torch.Tensor]]):
    return module0(*inputs0)


def megatron_attention() -> Dict[str, Any]:
    """A ``tensor_parallel=`` plan of transformers' attention, Megatron-style: q/k/v
    column-, o row-parallel, the attention kept as a call (its reshapes run per rank)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {"model.layers.*.self_attn": PrepareModuleInput(),
            **{f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "model.layers.*.self_attn.o_proj": RowwiseParallel()}


def check_experts_over_tp(schedule: str) -> None:
    """Mixtral on pp2 x tp2 with one ``tensor_parallel=`` plan: Megatron-style attention
    (q/k/v column-, o row-parallel, the attention kept as a call) and
    ``RoutedExpertParallel`` on the experts, which a tp mesh gives replicated tokens: each
    tp rank dispatches its slice of them to the rank holding their experts and gathers
    the results (tp2ep). Half the experts per rank; trains as the unsplit model."""
    import pipedream_ext as pd

    plan = {**megatron_attention(), "model.layers.*.mlp.experts": pd.RoutedExpertParallel()}
    ref = transformers_moe("mixtral")
    pipe = pipeline(transformers_moe("mixtral"), schedule, mesh=mesh_of((2, 1, 2), ("pp", "dp", "tp")),
                    expert_parallel=None, tensor_parallel=plan, split_points=["model.layers.1"],
                    concrete_args={"use_cache": False}, loss_fn=transformers_loss, data_parallel="replicate")
    shards = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]: tuple(p.to_local().shape)
              for n, p in pipe.named_parameters() if hasattr(p, "to_local")}
    assert shards["experts.gate_up_proj"][0] == 2 and shards["q_proj.weight"][0] == 16, shards
    opt, ref_opt = optimizers("adamw", pipe, ref)

    def ref_step(x: torch.Tensor, y: torch.Tensor, copies: int) -> torch.Tensor:
        loss = transformers_loss(ref(x, use_cache=False), y)
        loss.backward()
        return loss.detach()
    train_alongside(f"experts over tp, {schedule}", pipe, opt, ref, ref_opt, ref_step, clip=0.5)
    pipe.close()


def experts_and_tp(shape: Tuple[int, ...], schedule: str, **options: Any) -> Any:
    """transformers' Mixtral on a ``("pp", "dp", "ep", "tp")`` mesh (``("pp", "ep", "tp")``
    for a 3-tuple ``shape``) with two plans on two dimensions: ``tensor_parallel=``
    Megatron-style attention over tp, ``expert_parallel=`` ``RoutedExpertParallel`` over ep.
    ``options["scale"]`` scales its initial weights (another model); ``options["meta"]``
    builds it on the meta device (each rank materialises its shards, ``init_seed=5``)."""
    import pipedream_ext as pd

    attention = megatron_attention()
    names = ("pp", "dp", "ep", "tp") if len(shape) == 4 else ("pp", "ep", "tp")
    model = mixtral(options.pop("meta", False), options.pop("scale", 1.0))
    return pipeline(model, schedule, mesh=mesh_of(shape, names), tensor_parallel=attention,
                    expert_parallel={"model.layers.*.mlp.experts": pd.RoutedExpertParallel()},
                    split_points=["model.layers.1"], concrete_args={"use_cache": False}, loss_fn=transformers_loss,
                    **options)


def mixtral(meta: bool = False, scale: float = 1.0) -> nn.Module:
    """transformers' tiny Mixtral, its initial weights times ``scale`` (another model), or
    built on the meta device (experts that run there)."""
    if meta:
        with torch.device("meta"):
            return transformers_moe("mixtral", impl="batched_mm")
    model = transformers_moe("mixtral")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def check_experts_and_tp(shape: Tuple[int, ...], schedule: str, meta: bool = False, **options: Any) -> None:
    """:func:`experts_and_tp`: the experts are shards over ep (half per rank) replicated
    over tp, the attention shards over tp replicated over dp x ep; trains as the unsplit
    model (the copies' losses averaged), ``clip_grad_norm_`` counting every shard once.
    With ``meta`` from the meta device, against ``pd.materialize`` of the same model."""
    import pipedream_ext as pd

    ref = pd.materialize(mixtral(meta=True), "cpu", seed=5) if meta else mixtral()
    pipe = experts_and_tp(shape, schedule, meta=meta, **({"init_seed": 5} if meta else {}), **options)
    assert not any(p.is_meta for p in pipe.parameters())
    meshes = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]:
              (tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
              for n, p in pipe.named_parameters() if hasattr(p, "to_local")}
    if options.get("data_parallel") == "replicate":
        assert meshes["experts.gate_up_proj"] == ((2, 128, 32), ("ep",)), meshes
        assert meshes["q_proj.weight"] == ((16, 32), ("tp",)), meshes
    assert pipe.data_parallel_size == dist.get_world_size() // (shape[0] * shape[-1]), pipe.data_parallel_size
    opt, ref_opt = optimizers("adamw", pipe, ref)

    def ref_step(x: torch.Tensor, y: torch.Tensor, copies: int) -> torch.Tensor:
        loss = transformers_loss(ref(x, use_cache=False), y)
        loss.backward()
        return loss.detach()
    train_alongside(f"experts over ep and attention over tp, {schedule}", pipe, opt, ref, ref_opt, ref_step,
                    clip=0.5)
    pipe.close()


def check_experts_and_tp_checkpoints(root: str) -> None:
    """ep2 x tp2 (FSDP) trains 2 AdamW steps and saves (``format="dcp"``, and
    ``save_pretrained``); ``pd.consolidate`` gives the whole model's weights at the save;
    another model on ep2 x tp2 with replicas loads it (bit-identical weights) and trains on
    as the saving run did; pp2 x ep2 without tp loads the ``save_pretrained`` directory."""
    import pipedream_ext as pd

    path = os.path.join(root, "ep2-tp2")
    saving = experts_and_tp((1, 2, 2), "zbv", chunks=2)
    opt = torch.optim.AdamW(saving.parameters(), lr=0.01, eps=1e-4)
    train(saving, opt, range(2))
    at_save = gathered(saving)
    pd.save_checkpoint(path, saving, opt, step=2, format="dcp")
    pd.save_pretrained(saving, path + "-hf")
    later = train(saving, opt, range(2, 4))
    after = gathered(saving)
    saving.close()
    if dist.get_rank() == 0:
        same(dict(pd.consolidate(path)), at_save, "consolidate")
    fresh = experts_and_tp((1, 2, 2), "zbv", chunks=2, data_parallel="replicate", scale=0.5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01, eps=1e-4)
    assert pd.load_checkpoint(path, fresh, fresh_opt).step == 2
    same(gathered(fresh), at_save, "ep2 x tp2 loaded")
    torch.testing.assert_close(train(fresh, fresh_opt, range(2, 4)), later, rtol=1e-5, atol=1e-6)
    for name, value in gathered(fresh).items():
        torch.testing.assert_close(value, after[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"resumed {name}: {m}")
    fresh.close()
    from_hf = pipeline(mixtral(scale=0.5), split_points=["model.layers.1"], concrete_args={"use_cache": False},
                       loss_fn=transformers_loss, expert_parallel="auto")
    from_hf.load_state_dict(path + "-hf")
    same(gathered(from_hf), at_save, "save_pretrained of ep2 x tp2, loaded into pp2 x ep2")
    from_hf.close()


def check_from_meta() -> None:
    """transformers' Qwen3-MoE built on the meta device, its experts' forward one that runs
    on meta values (``experts_implementation="batched_mm"``; the default ``grouped_mm`` and
    the torchtitan-style router's ``bincount`` cannot, and are refused: check_refusals):
    each rank materialises only its stage, the plan then shards its experts, and it trains
    as the same model materialised whole (``pd.materialize``, the same seed), unsplit."""
    import pipedream_ext as pd

    def model() -> nn.Module:
        with torch.device("meta"):
            return transformers_moe("qwen3_moe", impl="batched_mm")

    pipe = pipeline(model(), "1f1b", init_seed=5, expert_parallel="auto", split_points=["model.layers.1"],
                    concrete_args={"use_cache": False}, loss_fn=transformers_loss)
    assert not any(p.is_meta for p in pipe.parameters())
    ref = pd.materialize(model(), "cpu", seed=5)
    opt, ref_opt = optimizers("adamw", pipe, ref)

    def ref_step(x: torch.Tensor, y: torch.Tensor, copies: int) -> torch.Tensor:
        loss = transformers_loss(ref(x, use_cache=False), y)
        loss.backward()
        return loss.detach()
    train_alongside("qwen3_moe from meta", pipe, opt, ref, ref_opt, ref_step)
    pipe.close()


def gathered(pipe: Any) -> Dict[str, torch.Tensor]:
    """Every parameter of the whole model, experts gathered (collective over the world)."""
    mine = {name: full(p.detach()).clone() for name, p in pipe.named_parameters()}
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    """Bit for bit."""
    assert set(actual) == set(expected), (what, sorted(actual), sorted(expected))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


def train(pipe: Any, opt: Any, steps: range) -> List[float]:
    mine, copies = pipe.data_parallel_rank, pipe.data_parallel_size
    losses = []
    for step in steps:
        x, y = batch(100 + step, ROWS * copies)
        part = slice(mine * ROWS, (mine + 1) * ROWS)
        losses.append(float(pipe.step(x[part], y[part])))
        opt.step()
        opt.zero_grad()
    return losses


def check_checkpoints(root: str) -> None:
    """pp2 x ep2 trains 2 AdamW steps and saves (``format="dcp"``); a fresh pp2 x ep2 loads
    it (the ep ranks of dp coordinate 0 wrote their experts: bit-identical weights) and
    trains on exactly as the uninterrupted run; ``pd.consolidate`` gives the whole
    model's weights at the save; the checkpoint also loads into pp2 x dp2 x ep1 (every
    rank all of its stage's experts, re-sharded by DCP) and trains on as the saving run;
    ``load_state_dict`` of the unsplit model's state dict cuts each rank's experts;
    ``save_pretrained`` writes every expert (gathered over ep) and ``load_state_dict`` of
    that directory gives the weights at the save; ``format="pipedream"`` is refused (FSDP,
    the default)."""
    from test_bad_input import ROWS as BAD_ROWS

    import pipedream_ext as pd

    path = os.path.join(root, "pp2-ep2")
    saving = pipeline(build())
    opt = torch.optim.AdamW(saving.parameters(), lr=0.01, eps=1e-4)
    train(saving, opt, range(2))
    at_save = gathered(saving)
    pd.save_checkpoint(path, saving, opt, step=2, format="dcp")
    with pytest.raises(ValueError, match=next(r[2] for r in BAD_ROWS if r[0] == "ep-checkpoint")):
        pd.save_checkpoint(path + "-pipedream", saving, opt)
    pd.save_pretrained(saving, path + "-hf")  # every expert, gathered over ep, by its own name
    later = train(saving, opt, range(2, 4))
    after = gathered(saving)
    saving.close()
    if dist.get_rank() == 0:
        same(dict(pd.consolidate(path)), at_save, "consolidate")
    fresh = pipeline(build(seed=7))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01, eps=1e-4)
    assert pd.load_checkpoint(path, fresh, fresh_opt).step == 2
    same(gathered(fresh), at_save, "pp2 x ep2 loaded")
    assert train(fresh, fresh_opt, range(2, 4)) == later
    same(gathered(fresh), after, "pp2 x ep2 resumed")
    fresh.close()
    from_hf = pipeline(build(seed=7))
    from_hf.load_state_dict(path + "-hf")  # each rank reads its experts' rows
    same(gathered(from_hf), at_save, "save_pretrained, loaded into pp2 x ep2")
    from_hf.close()
    dense = pipeline(build(seed=7), mesh=mesh_of((2, 2, 1), ("pp", "dp", "ep")))
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=0.01, eps=1e-4)
    pd.load_checkpoint(path, dense, dense_opt)
    same(gathered(dense), at_save, "pp2 x dp2 x ep1 loaded")
    resumed = train(dense, dense_opt, range(2, 4))
    torch.testing.assert_close(resumed, later, rtol=1e-5, atol=1e-6)
    dense.close()
    model = build(seed=3)
    loading = pipeline(build())
    loading.load_state_dict(model.state_dict())
    same(gathered(loading), {k: v.detach() for k, v in model.named_parameters()}, "load_state_dict")
    loading.close()


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_shards)
    c.add(check_training, "1f1b", clip=0.5, name="training-1f1b-clip")
    c.add(check_training, "1f1b", clip=0.5, data_parallel="replicate", name="training-1f1b-clip-replicate")
    c.add(check_training, "zb-h1", recompute=True, name="training-zb-h1-recompute")
    c.add(check_training, "zb-h1", "sgd")
    c.add(check_training, "gpipe", "sgd")
    c.add(check_training, "zbv", "adamw", layers=4, name="training-zbv-4-stages")
    c.add(check_training, "interleaved-1f1b", "sgd", layers=4, name="training-interleaved-1f1b-4-stages")
    c.add(check_training, "dualpipev", "adamw", layers=4, microbatches=4, name="training-dualpipev-4-stages")
    c.add(check_training, "interleaved-zb", "sgd", layers=4, name="training-interleaved-zb-4-stages")
    c.add(check_training, "dualpipev", "sgd", layers=4, microbatches=4, overlap=True,
          name="training-dualpipev-overlap")
    c.add(check_training, "dualpipev", "adamw", layers=4, microbatches=4, overlap=dualpipe_example,
          recompute=True, name="training-dualpipev-overlap-hook-recompute")
    c.add(check_token_mean)
    c.add(check_sequential, "zb-h1")
    c.add(check_planned_sequential)
    c.add(check_mesh_auto)
    c.add(check_bias_balancing)
    c.add(check_aux_loss, "1f1b")
    c.add(check_aux_loss, "zb-h1", recompute=True, name="aux-loss-zb-h1-recompute")
    c.add(check_aux_loss, "zbv", layers=4, name="aux-loss-zbv-4-stages")
    c.add(check_aux_loss, "dualpipev", layers=4, microbatches=4, overlap=True, name="aux-loss-dualpipev-overlap")
    c.add(check_transformers, "qwen3_moe", "1f1b", ["model.layers.1"], idle=True, root=FromEnv("PDEP_DIR"),
          name="transformers-qwen3-moe-1f1b-idle-rank-save-pretrained")
    c.add(check_transformers, "gpt_oss", "gpipe", ["model.layers.1"], name="transformers-gpt-oss-gpipe")
    c.add(check_transformers, "mixtral", "zbv", ["model.layers.0.mlp", "model.layers.1", "model.layers.1.mlp"],
          chunks=2, recompute=True, data_parallel="replicate", name="transformers-mixtral-zbv-4-stages")
    c.add(check_transformers, "qwen3_moe", "dualpipev", ["model.layers.0.mlp", "model.layers.1", "model.layers.1.mlp"],
          chunks=2, microbatches=4, overlap=True, yields=True, data_parallel="replicate",
          name="transformers-qwen3-moe-dualpipev-overlap")
    c.add(check_transformers, "mixtral", "dualpipev", ["model.layers.0.mlp", "model.layers.1", "model.layers.1.mlp"],
          chunks=2, microbatches=4, overlap=True, yields=True, recompute=True,
          name="transformers-mixtral-dualpipev-overlap-fsdp-recompute")
    c.add(check_from_meta)
    c.add(check_experts_over_tp, "zb-h1")
    c.add(check_experts_and_tp, (1, 2, 2), "zbv", chunks=2, data_parallel="replicate",
          name="experts-and-tp-zbv-ep2-tp2-replicate")
    c.add(check_experts_and_tp, (1, 2, 2), "dualpipev", chunks=2, microbatches=4, overlap=True, recompute=True,
          meta=True, name="experts-and-tp-dualpipev-ep2-tp2-fsdp-overlap-recompute-meta")
    c.add(check_refusals)
    c.add(check_checkpoints, FromEnv("PDEP_DIR"), name="checkpoints")
    c.add(check_experts_and_tp_checkpoints, FromEnv("PDEP_DIR"), name="experts-and-tp-checkpoints")
    return c


class AuxMLP(nn.Module):
    """Two linears, the first adding an aux loss (its output's mean square)."""

    def __init__(self, exported: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.exported = nn.Linear(4, 4), nn.Linear(4, 2), exported

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import pipedream_ext as pd

        if self.exported and x.shape[-1] > 1024:  # a branch on a shape: fx cannot trace it
            raise ValueError("too wide")
        h = self.a(x)
        return self.b(pd.add_aux_loss(h, h.pow(2).mean()))


def test_an_overlap_hook_must_run_both_halves_once() -> None:
    """One process: ``PairCallback`` runs a model's ``overlapped_forward_backward`` and
    refuses one that skips the backward (zero gradients would go upstream), runs the
    forward twice, or returns something else, naming the hook, the pair and the fix."""
    from pipedream_ext._runtime.overlap import PairCallback

    layer = nn.Linear(3, 3)
    forward = lambda stage, microbatch, inputs, weights: [layer(inputs[0])]  # noqa: E731

    def pair(hook: Any) -> Callable[[], List[torch.Tensor]]:
        x = torch.randn(2, 3, requires_grad=True)
        out = layer(x)
        callback = PairCallback(hook, forward, {0: layer, 1: layer})
        return lambda: callback(1, 5, [torch.randn(2, 3)], 0, 4, [out], [torch.ones_like(out)])

    assert pair(dualpipe_example)()[0].shape == (2, 3)
    x, out = torch.randn(2, 3, requires_grad=True), layer(torch.randn(2, 3))  # recompute: no graph kept
    kept = PairCallback(dualpipe_example, forward, {0: layer, 1: layer}, recompute=True)(
        1, 5, [x], 0, 4, [out], [torch.ones_like(out)])
    assert not kept[0].requires_grad
    with pytest.raises(RuntimeError, match=r"forgets_the_backward \(forward: stage 1 microbatch 5, backward: "
                                           r"stage 0 microbatch 4\) returned without the backward reaching "
                                           r"outputs1; call torch.autograd.backward"):
        pair(forgets_the_backward)()
    twice = lambda m0, i0, m1, o1, g1: (m0(*i0), dualpipe_example(m0, i0, m1, o1, g1))[1]  # noqa: E731
    with pytest.raises(RuntimeError, match="ran module0 2 times; run it exactly once"):
        pair(twice)()
    with pytest.raises(RuntimeError, match="returned Tensor; return module0's outputs"):
        pair(lambda *a: dualpipe_example(*a)[0])()
    with pytest.raises(RuntimeError, match="runs the pair's backward"):
        pair(lambda m0, i0, m1, o1, g1: m1(*i0))()


def test_overlap_true_takes_the_model_class_hook() -> None:
    """One process: ``overlap=True`` runs a model class's own ``overlapped_forward_backward``
    (a classmethod, as DualPipe's modules define it), else the executor's turns; a function
    given is the hook."""
    from pipedream_ext._runtime.overlap import hook_of

    class DualPipeModel(nn.Linear):
        @classmethod
        def overlapped_forward_backward(cls, module0: Any, inputs0: List[torch.Tensor], module1: Any,
                                        outputs1: List[torch.Tensor], output_grads1: List[Any]) -> Any:
            return dualpipe_example(module0, inputs0, module1, outputs1, output_grads1)

    own = hook_of(True, DualPipeModel(2, 2))
    assert own is not None and own.__func__ is DualPipeModel.overlapped_forward_backward.__func__
    assert hook_of(True, nn.Linear(2, 2)) is None and hook_of(False, DualPipeModel(2, 2)) is None
    assert hook_of(dualpipe_example, DualPipeModel(2, 2)) is dualpipe_example


def test_overlap_needs_dualpipev() -> None:
    """One process: ``overlap`` on another schedule, or of another type, is refused."""
    from pipedream_ext._runtime.config import PipelineConfig

    with pytest.raises(ValueError, match="overlap runs the F&B pairs of schedule='dualpipev' together; "
                                         "schedule '1f1b' has none"):
        PipelineConfig.checked("1f1b", 4, overlap=True)
    with pytest.raises(ValueError, match="overlap='yes' must be True, False or a function"):
        PipelineConfig.checked("dualpipev", 4, chunks=2, overlap="yes")
    assert PipelineConfig.checked("dualpipev", 4, chunks=2, overlap=True).overlap is True


def test_add_aux_loss_is_one_node_under_fx_and_refused_by_export() -> None:
    """One process: torch.fx keeps ``add_aux_loss`` as one ``call_function`` node, whose
    stage runs it (the aux gradient is injected: ``aux_loss_scale(0.5)`` adds half the
    aux term's gradient); the torch.export path refuses it, naming it."""
    import pipedream_ext as pd
    from pipedream_ext._frontend.graph_split import split_model

    torch.manual_seed(0)
    model, x = AuxMLP(), torch.randn(3, 4)
    split = split_model(model, ["b"], (x,))
    assert split.tracer == "fx"
    calls = [n for stage in split.stages for n in stage.graph.nodes if n.target is pd.add_aux_loss]
    assert len(calls) == 1, [n.format_node() for s in split.stages for n in s.graph.nodes]
    for scale in (0.0, 0.5):
        model.zero_grad()
        with pd.aux_loss_scale(scale):
            split.stages[1](split.stages[0](x)).sum().backward()
        got = model.a.weight.grad.clone()
        model.zero_grad()
        h = model.a(x)
        (model.b(h).sum() + scale * h.pow(2).mean()).backward()
        torch.testing.assert_close(got, model.a.weight.grad)
    with pytest.raises(ValueError, match="add_aux_loss cannot be traced by torch.export"):
        split_model(AuxMLP(exported=True), ["b"], (x,))


def test_the_cost_model_sees_the_experts_and_their_all_to_all() -> None:
    """One process: ``ep_costs.plan_traffic`` per top-level layer: the matched modules'
    parameter bytes, 5 exchanges per microbatch, and the routed rows' bytes per sample
    (torchtitan's experts: the rows they receive, tokens x top-k; transformers': tokens
    times ``top_k_index``'s k); the cost model then holds 1 / ep of the experts."""
    from moe_model import DIM, EXPERTS, HIDDEN, TOP_K

    from pipedream_ext import configuration
    from pipedream_ext._parallel import ep_costs
    from pipedream_ext._parallel.routed_experts import RoutedExpertParallel

    model = sequential()
    x, _ = batch(0)
    traffic = ep_costs.plan_traffic({"*.moe.experts": ExpertParallel()}, model, (x,))
    experts = 3.0 * EXPERTS * HIDDEN * DIM * 4
    routed = SEQ * TOP_K * DIM * 4.0
    assert traffic == [(0.0, 0.0, 0.0), (experts, 5.0, routed), (experts, 5.0, routed), (0.0, 0.0, 0.0),
                       (0.0, 0.0, 0.0)], traffic
    assert ep_costs.plan_traffic(lambda stage, mesh: None, model, (x,)) is None
    hf = transformers_moe("qwen3_moe")
    hf_traffic = ep_costs.plan_traffic({"model.layers.*.mlp.experts": RoutedExpertParallel()}, hf, (x,))
    shard = sum(p.numel() * 4.0 for p in hf.model.layers[0].mlp.experts.parameters())
    assert hf_traffic == [(2 * shard, 10.0, 2 * SEQ * 2 * 32 * 4.0), (0.0, 0.0, 0.0)], hf_traffic
    # predicted: a stage holding both MoE layers keeps half their experts per ep rank
    layers = [configuration.LayerCost(parameter_bytes=e, expert_parameter_bytes=e, all_to_all_calls=c,
                                      all_to_all_bytes_per_sample=b, forward_per_sample=1.0)
              for e, c, b in traffic]
    config = configuration.Configuration(schedule="gpipe", microbatches=1, balance=[2, 3],
                                         mesh=(2, 2, 1), ep=2)
    dense = configuration.Configuration(schedule="gpipe", microbatches=1, balance=[2, 3], mesh=(2, 2, 1))
    split = configuration.predict(layers, configuration.MachineCosts(), config, 4)
    whole = configuration.predict(layers, configuration.MachineCosts(), dense, 4)
    assert split.peak_bytes[0] < whole.peak_bytes[0] and split.pipeline_seconds > whole.pipeline_seconds


def test_mesh_auto_builds_the_expert_mesh_of_its_choice() -> None:
    """One process: the mesh ``mesh="auto"`` builds for a chosen ``(pp, dp, tp)`` and ep
    (``dp`` every copy per tp coordinate) keeps ``pp`` and ``ep`` and drops a ``dp`` or
    ``tp`` of size 1; its ascending ranks number the copies ``(d * ep + e) * tp + t``, the
    planner's ``dp * tp + t``."""
    from pipedream_ext._parallel.auto_mesh import expert_mesh_dims

    assert expert_mesh_dims((2, 2, 1), 2) == ((2, 2), ("pp", "ep"))
    assert expert_mesh_dims((2, 4, 1), 2) == ((2, 2, 2), ("pp", "dp", "ep"))
    assert expert_mesh_dims((2, 2, 2), 2) == ((2, 2, 2), ("pp", "ep", "tp"))
    assert expert_mesh_dims((1, 4, 2), 2) == ((1, 2, 2, 2), ("pp", "dp", "ep", "tp"))
    assert expert_mesh_dims((2, 4, 2), 1) == ((2, 4, 1, 2), ("pp", "dp", "ep", "tp"))


def test_mesh_auto_tries_every_ep_that_divides_the_copies_and_the_experts() -> None:
    """One process: ``auto_mesh.ep_sizes`` (divisors of the world dividing every matched
    module's expert count; none for a callable plan) and ``Request.searches`` (a search per
    ep dividing a mesh's dp)."""
    from pipedream_ext._parallel import auto_mesh
    from pipedream_ext._planning.choose import Request

    plan = {"*.moe.experts": ExpertParallel()}
    assert auto_mesh.ep_sizes(4, plan, sequential()) == [1, 2, 4]
    assert auto_mesh.ep_sizes(6, plan, sequential()) == [1, 2]  # 8 experts: not 3 or 6
    assert auto_mesh.ep_sizes(4, None, sequential()) == [1]
    assert auto_mesh.ep_sizes(4, lambda stage, mesh: None, sequential()) == []
    request = Request(schedules=["1f1b"], microbatches=[2], chunks=(2,), balance=None,
                      recompute="never", memory=None, meshes=[(4, 1, 1), (2, 2, 1)],
                      global_batch=True, eps=(1, 2, 4))
    searched = sorted((a["meshes"][0], a["ep"]) for _, _, a in request.searches(8))
    assert searched == [((2, 2, 1), 1), ((2, 2, 1), 2), ((4, 1, 1), 1)], searched


def mesh_3d_cases(world: int) -> Cases:
    c = Cases()
    c.add(check_training, "1f1b", clip=0.5, dp=2, name="training-pp2-dp2-ep2-clip")
    c.add(check_training, "zb-h1", clip=0.5, dp=2, data_parallel="replicate",
          name="training-pp2-dp2-ep2-clip-replicate")
    c.add(check_training, "dualpipev", "sgd", layers=4, microbatches=4, dp=2, overlap=True,
          name="training-pp2-dp2-ep2-dualpipev-overlap")
    c.add(check_experts_and_tp, (1, 2, 2, 2), "zbv", chunks=2, name="experts-and-tp-zbv-dp2-ep2-tp2-fsdp")
    c.add(check_experts_and_tp, (2, 1, 2, 2), "1f1b", data_parallel="replicate",
          name="experts-and-tp-1f1b-pp2-ep2-tp2-replicate")
    return c


# `make test` runs the 4-rank cases on nccl_rules (NCCL's point-to-point rules, the
# all_to_all a collective of each stage's ep group in every rank's order), `make
# test-all` on Gloo too.
LAUNCH, LAUNCH_GLOO = strict_and_gloo(HERE, 4, cases, timeout=300, dirs=("PDEP_DIR",))
MESH_3D = Launch(HERE, 8, mesh_3d_cases, name="8ranks", timeout=300, marks=(pytest.mark.slow,))


@parametrize_cases(LAUNCH, LAUNCH_GLOO)
def test_expert_parallel_on_a_traced_moe(case: CaseRef) -> None:
    case.check()


@pytest.mark.slow
@parametrize_cases(MESH_3D)
def test_expert_parallel_pp2_dp2_ep2(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH, LAUNCH_GLOO, MESH_3D])
