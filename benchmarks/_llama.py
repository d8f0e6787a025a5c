"""A small torchtitan-style Llama as an ``nn.Sequential``, and torchtitan's tensor-parallel
plan for it (benchmarks/vs_torch_tp.py).

The layers are torchtitan's (``torchtitan/models/llama3/model.py``): grouped-query
attention (``n_kv_heads`` key/value heads repeated to ``n_heads``) with rotary position
embeddings, a SwiGLU feed-forward (``w2(silu(w1(x)) * w3(x))``), pre-norm RMSNorms and
an untied output head; the module names inside a block are torchtitan's
(``attention.wq``, ``feed_forward.w1``, ``attention_norm``, ...). One difference: the
model is an ``nn.Sequential`` (embedding, blocks, norm, head), so a block computes its
rotary table from its own buffer instead of receiving ``freqs_cis`` from the model, and
a block's name is ``"3"`` where torchtitan's is ``"layers.2"``.

Imports torch at module level: the benchmark scripts import it inside functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "LlamaConfig", "llama", "tp_plan"]


@dataclass(frozen=True)
class LlamaConfig:
    """The model's sizes: ``dim`` split over ``n_heads`` query heads and ``n_kv_heads``
    key/value heads (both multiples of the tp degree), ``hidden`` the SwiGLU width."""

    dim: int = 256
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden: int = 768
    vocab: int = 2048
    blocks: int = 4
    seq: int = 64


def _rope_table(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """cos and sin of the rotary angles, ``[2, seq, head_dim // 2]``."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[b, s, heads, head_dim]`` (pairs of channels, torchtitan's layout)."""
    cos, sin = table[0, :x.shape[1], None, :], table[1, :x.shape[1], None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal attention. The views use ``-1`` heads, so a tp rank's column
    shard of wq/wk/wv runs its own query and key/value heads (torchtitan's way)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.register_buffer("rope", _rope_table(self.head_dim, cfg.seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = _rotate(self.wq(x).view(b, s, -1, self.head_dim), self.rope)
        k = _rotate(self.wk(x).view(b, s, -1, self.head_dim), self.rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        k, v = (t.repeat_interleave(self.n_rep, dim=2) for t in (k, v))  # torchtitan's repeat_kv
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm transformer block: attention and feed-forward, each after an RMSNorm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def llama(cfg: LlamaConfig, seed: int = 0) -> nn.Sequential:
    """Embedding, ``cfg.blocks`` blocks, RMSNorm, head: ``cfg.blocks + 3`` layers,
    initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(cfg.vocab, cfg.dim), *(Block(cfg) for _ in range(cfg.blocks)),
                         nn.RMSNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab, bias=False))


def tp_plan(cfg: LlamaConfig) -> Dict[str, Any]:
    """torchtitan's Llama TP plan without sequence parallelism, keys for the Sequential's
    names: the embedding row-wise (vocabulary rows split, output replicated), each
    block's wq/wk/wv and w1/w3 column-wise, wo and w2 row-wise, the head column-wise
    with its output gathered (replicated logits for an ordinary cross-entropy)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": RowwiseParallel(input_layouts=Replicate()),
            "*.attention.wq": ColwiseParallel(), "*.attention.wk": ColwiseParallel(),
            "*.attention.wv": ColwiseParallel(), "*.attention.wo": RowwiseParallel(),
            "*.feed_forward.w1": ColwiseParallel(), "*.feed_forward.w3": ColwiseParallel(),
            "*.feed_forward.w2": RowwiseParallel(),
            str(cfg.blocks + 2): ColwiseParallel(output_layouts=Replicate())}
