"""The transformers zoo: small models from configs (no download, no network).

Each :class:`ZooModel` builds one family people pipeline, seeded so that every
rank builds the same weights, with its batches, loss and split points. Used by
tests/test_zoo.py (every model exact against the unsplit model under torchrun)
and by the zoo's timing table in docs/tracing.md.

Batches: token ids (and masks, token types, decoder inputs) of ``n`` rows and
``length`` positions, or images; targets are next tokens (causal LMs), masked
tokens (BERTs), labels (ViT) or the decoder's targets (T5). ``with_labels``
puts the targets in the inputs as ``labels`` too, so the model's output holds a
scalar ``loss`` (the case ``forward_only`` must combine per microbatch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZooModel", "ZOO", "REPRESENTATIVE"]

VOCAB = 64


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against its target (-100: ignored)."""
    return F.cross_entropy(out.logits.flatten(0, -2).float(), y.flatten())


def model_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """The loss the model computed itself from ``labels`` (plus a MoE's auxiliary loss)."""
    del y
    return out.loss


def image_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, y)


@dataclasses.dataclass
class ZooModel:
    """One family of the zoo.

    Attributes:
        name: short name (test id).
        build: makes the model (seeded: the same weights on every rank).
        batch: ``batch(n, length, seed, with_labels)`` -> ``(inputs dict, targets)``.
        loss_fn: ``loss_fn(model output, targets)``.
        splits: stage count -> split points.
        what: what the family exercises, for the zoo table.
        concrete_args: non-tensor forward arguments fixed for tracing.
        schedules: (schedule, chunks) pairs it runs on, 1f1b and a zero-bubble one at least.
        worlds: the world sizes it runs on.
        lengths: sequence lengths of the training steps (the sample's first).
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int, int, bool], Tuple[Dict[str, torch.Tensor], torch.Tensor]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    splits: Dict[int, List[str]]
    what: str
    concrete_args: Optional[Dict[str, Any]] = dataclasses.field(
        default_factory=lambda: {"use_cache": False})
    schedules: List[Tuple[str, int]] = dataclasses.field(
        default_factory=lambda: [("1f1b", 1), ("zb-h1", 1)])
    worlds: List[int] = dataclasses.field(default_factory=lambda: [2])
    lengths: List[int] = dataclasses.field(default_factory=lambda: [8, 8, 8])


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        _quiet()
        torch.manual_seed(0)
        return make().train()
    return build


def _causal_batch(mask: bool = False) -> Callable[..., Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    def batch(n: int, length: int, seed: int, with_labels: bool):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (n, length + 1), generator=g)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        inputs = {"input_ids": x}
        if mask:  # right padding, padded targets ignored
            lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
            attention = (torch.arange(length) < lengths[:, None]).long()
            y = y.masked_fill(attention == 0, -100)
            inputs["attention_mask"] = attention
        if with_labels:
            # HF shifts labels itself: labels are the inputs, the loss predicts the next one.
            inputs["labels"] = x.masked_fill(inputs.get("attention_mask", x) == 0, -100)
        return inputs, y
    return batch


def _masked_lm_batch(token_types: bool) -> Callable[..., Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    def batch(n: int, length: int, seed: int, with_labels: bool):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, VOCAB, (n, length), generator=g)
        picked = torch.rand(n, length, generator=g) < 0.3
        picked[:, 0] = True  # every row has a target
        y = ids.masked_fill(~picked, -100)
        x = ids.masked_fill(picked, 4)  # 4: the mask token
        lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
        attention = (torch.arange(length) < lengths[:, None]).long()
        y = y.masked_fill(attention == 0, -100)
        inputs = {"input_ids": x, "attention_mask": attention}
        if token_types:
            inputs["token_type_ids"] = (torch.arange(length) >= length // 2).long().expand(n, -1)
        if with_labels:
            inputs["labels"] = y
        return inputs, y
    return batch


def _t5_batch(n: int, length: int, seed: int, with_labels: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (n, length), generator=g)
    target = torch.randint(1, VOCAB, (n, length // 2 + 1), generator=g)
    decoder_in = torch.cat([torch.zeros(n, 1, dtype=torch.long), target[:, :-1]], dim=1)
    inputs = {"input_ids": x, "attention_mask": torch.ones_like(x),
              "decoder_input_ids": decoder_in}
    if with_labels:
        inputs["labels"] = target
    return inputs, target


def _image_batch(n: int, length: int, seed: int, with_labels: bool):
    del length
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, 3, 16, 16, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    inputs = {"pixel_values": pixels}
    if with_labels:
        inputs["labels"] = y
    return inputs, y


def _layers(prefix: str, count: int) -> Dict[int, List[str]]:
    """Split points at decoder layers: 2 stages at the middle, 3 at the thirds, 4 at each."""
    return {2: [f"{prefix}.{count // 2}"],
            3: [f"{prefix}.{count // 3}", f"{prefix}.{2 * count // 3}"],
            4: [f"{prefix}.{k}" for k in range(1, 4)]}


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64))


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64, type_vocab_size=2,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                               num_layers=2, num_decoder_layers=2, num_heads=4,
                                               dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3,
                                               hidden_size=32, num_hidden_layers=4,
                                               num_attention_heads=2, intermediate_size=64,
                                               num_labels=5, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64,
                                            output_router_logits=True))


def _qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, output_router_logits=True))


def _deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64))


def _gpt_oss() -> nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"] * 2, output_router_logits=True))


def _gemma3() -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=64))


def _modernbert() -> nn.Module:
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, global_attn_every_n_layers=2, local_attention=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, mask_token_id=4, embedding_dropout=0.0,
        mlp_dropout=0.0, attention_dropout=0.0))


ZOO: Dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("llama", _seeded(_llama), _causal_batch(), lm_loss, _layers("model.layers", 4),
             "GQA, RoPE, variable sequence lengths", lengths=[8, 12, 5],
             schedules=[("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]),
    ZooModel("qwen2", _seeded(_qwen2), _causal_batch(mask=True), lm_loss,
             _layers("model.layers", 4), "tied embedding and head, padding mask"),
    ZooModel("bert", _seeded(_bert), _masked_lm_batch(token_types=True), lm_loss,
             _layers("bert.encoder.layer", 4),
             "attention mask, token types, decoder tied to the embedding"),
    ZooModel("t5", _seeded(_t5), _t5_batch, lm_loss,
             {2: ["decoder.block.0"], 3: ["encoder.block.1", "decoder.block.1"]},
             "encoder-decoder, one embedding shared by encoder, decoder and head; 2 and 3 ranks",
             worlds=[2, 3]),
    ZooModel("vit", _seeded(_vit), _image_batch, image_loss, _layers("vit.layers", 4),
             "images, patch embedding, classification head", concrete_args=None),
    ZooModel("mixtral", _seeded(_mixtral), _causal_batch(), model_loss,
             _layers("model.layers", 4), "MoE (top-2 of 4 experts), router auxiliary loss"),
    ZooModel("qwen2_moe", _seeded(_qwen2_moe), _causal_batch(), model_loss,
             _layers("model.layers", 4), "MoE with a shared expert, router auxiliary loss"),
    ZooModel("deepseek_v3", _seeded(_deepseek_v3), _causal_batch(), lm_loss,
             _layers("model.layers", 4), "MLA attention, grouped top-k routing, a dense first layer"),
    ZooModel("gpt_oss", _seeded(_gpt_oss), _causal_batch(), model_loss,
             _layers("model.layers", 4), "MoE, attention sinks, sliding and full attention"),
    ZooModel("gemma3", _seeded(_gemma3), _causal_batch(), lm_loss, _layers("model.layers", 4),
             "two RoPE tables built in set order (PYTHONHASHSEED), sliding window"),
    ZooModel("modernbert", _seeded(_modernbert), _masked_lm_batch(token_types=False), lm_loss,
             _layers("model.layers", 4),
             "two RoPE tables built in set order (PYTHONHASHSEED), local and global attention"),
]}

#: Run by `make test` on 2 ranks; the other cases are marked slow, but for one a week
#: (`make test-all` runs every one). Gemma 3 is not among them: `make test` runs it in
#: tests/test_agreement.py (1f1b, ranks with different hash seeds); nor is Llama: `make
#: test` runs it exact against the unsplit model in tests/test_packed_sequences.py (1f1b)
#: and tests/test_traced_meta.py (built on meta), and GPT-2, a decoder too, under every
#: schedule in tests/test_hf.py.
REPRESENTATIVE = ("t5", "bert")


# --------------------------------------------------------------------------- exactness
RTOL, ATOL = 1e-5, 1e-6
MICROBATCHES = 4


def _rows_shares(n: int) -> List[float]:
    return [float(len(r)) / n for r in torch.tensor_split(torch.arange(n), MICROBATCHES)]


def _microbatches(inputs: Dict[str, torch.Tensor],
                  y: torch.Tensor) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    parts = {k: torch.tensor_split(v, MICROBATCHES) for k, v in inputs.items()}
    ys = torch.tensor_split(y, MICROBATCHES)
    return [({k: p[i] for k, p in parts.items()}, ys[i]) for i in range(MICROBATCHES)]


def reference_step(zm: ZooModel, model: nn.Module, inputs: Dict[str, torch.Tensor],
                   y: torch.Tensor) -> float:
    """The unsplit model on the pipeline's microbatches: each loss scaled by its rows'
    share of the batch, gradients accumulated (what the pipeline computes)."""
    total = 0.0
    for (part, target), share in zip(_microbatches(inputs, y), _rows_shares(y.shape[0])):
        loss = zm.loss_fn(model(**part, **(zm.concrete_args or {})), target) * share
        loss.backward()
        total += float(loss)
    return total


def _close(got: Optional[torch.Tensor], want: Optional[torch.Tensor], what: str,
           like: torch.Tensor) -> None:
    got = torch.zeros_like(like) if got is None else got
    want = torch.zeros_like(like) if want is None else want
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_exact(zm: ZooModel, schedule: str, chunks: int, steps: int = 3,
                timeout: float = 120) -> Any:
    """``zm`` pipelined on this world against the unsplit model: every step's loss, every
    gradient of the first step and every weight after ``steps`` SGD-momentum steps (at
    the sequence lengths of ``zm.lengths``), then ``forward_only`` in eval mode (the
    model's own output structure, its scalar ``loss`` combined over microbatches).

    Returns:
        The pipeline.
    """
    import torch.distributed as dist

    import pipedream_ext as pd

    world = dist.get_world_size()
    stages = world * chunks
    inputs, y = zm.batch(8, zm.lengths[0], 100, True)
    model = zm.build()
    pipe = pd.PipeDream(model, zm.loss_fn, schedule=schedule, microbatches=MICROBATCHES,
                        chunks=chunks, timeout=timeout, split_points=zm.splits[stages],
                        sample=(inputs, y), concrete_args=zm.concrete_args)
    ref = zm.build()
    own = dict(model.named_parameters(remove_duplicate=False))
    assert all(p is own[n] for n, p in pipe.named_parameters())  # the model's own tensors
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        length = zm.lengths[step % len(zm.lengths)]
        inputs, y = zm.batch(8 if step % 2 == 0 else 12, length, 10 + step, True)
        expected = reference_step(zm, ref, inputs, y)
        loss = pipe.step(inputs, y)
        assert abs(loss - expected) <= RTOL * max(1.0, abs(expected)) + ATOL, \
            f"{zm.name} {schedule} step {step}: loss {loss} != {expected}"
        if step == 0:
            for name, p in pipe.named_parameters():
                _close(p.grad, ref_params[name].grad, f"{zm.name} {schedule} grad {name}", p)
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    expected_state = ref.state_dict()
    for name, value in pipe.state_dict().items():
        _close(value, expected_state[name], f"{zm.name} {schedule} after {steps} steps: {name}",
               value)
    check_evaluation(zm, pipe, ref)
    return pipe


def check_evaluation(zm: ZooModel, pipe: Any, ref: nn.Module) -> None:
    """``forward_only`` in eval mode with ``labels`` among the inputs: the model's output
    type, tensors with a batch dimension equal to the unsplit model's on the whole batch,
    scalars (the loss, a MoE's auxiliary loss) to the rows-weighted mean of its values
    on the microbatches."""
    import torch.utils._pytree as pytree

    inputs, y = zm.batch(8, zm.lengths[0], 50, True)
    pipe.eval(); ref.eval()
    out = pipe.forward_only(inputs)
    if pipe.is_last:
        with torch.no_grad():
            whole = ref(**inputs, **(zm.concrete_args or {}))
            parts = [ref(**p, **(zm.concrete_args or {})) for p, _ in _microbatches(inputs, y)]
        assert type(out) is type(whole), (type(out), type(whole))
        assert out.loss is not None and out.loss.dim() == 0
        got, spec = pytree.tree_flatten(out)
        want, want_spec = pytree.tree_flatten(whole)
        assert spec == want_spec, (spec, want_spec)
        shares = _rows_shares(y.shape[0])
        for k, (g, w) in enumerate(zip(got, want)):
            if isinstance(w, torch.Tensor) and w.dim() == 0:
                w = sum(pytree.tree_leaves(p)[k] * s for p, s in zip(parts, shares))
            _close(g, w, f"{zm.name} forward_only output {k}", w)
    else:
        assert out is None
    pipe.train(); ref.train()
