"""A small mixture-of-experts transformer as torchtitan writes one, and torchtitan's
``ExpertParallel`` style, for the expert-parallel tests.

``MoE`` routes each token to its ``top_k`` experts (softmax scores, ``topk``, tokens
sorted by expert with a stable ``argsort``, counts by ``bincount``), runs them in
``GroupedExperts`` (one parameter per projection, experts along dim 0, a loop over the
experts: dropless, any count including 0) and adds the scored outputs back per token.
``ExpertParallel`` follows torchtitan's ``torchtitan/distributed/expert_parallel.py``
(BSD): the experts' parameters ``Shard(0)`` over the ep mesh, token dispatch by an
``all_to_all_single`` of the counts then ``all_to_all_single_autograd`` of the tokens,
regrouped by local expert, and the combine in reverse; its ``_permute`` is a plain
regrouping here (no padding: the experts loop).
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import pipedream_ext as pd

__all__ = ["DIM", "EXPERTS", "ExpertParallel", "GroupedExperts", "MoE", "MoEConfig", "MoETransformer", "VOCAB",
           "build", "clear_counts", "counts_seen", "lm_loss", "sequential", "update_expert_bias"]

DIM, HIDDEN, EXPERTS, TOP_K, VOCAB, LAYERS = 8, 16, 8, 2, 32, 2


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes (the tests' defaults; benchmarks/vs_torch_ep.py scales them)."""

    dim: int = DIM
    hidden: int = HIDDEN
    experts: int = EXPERTS
    top_k: int = TOP_K
    vocab: int = VOCAB
    aux: bool = False   # Switch Transformer's load-balancing loss through pd.add_aux_loss
    bias: bool = False  # torchtitan's aux-loss-free balancing buffers


# Large enough that a wrongly scaled aux gradient shows in the weights within 1e-4.
AUX_COEF = 0.1

#: Every token count a sharded ``GroupedExperts`` received in a forward, per process
#: (the tests check that routing left some expert without tokens, and count forwards).
_SEEN: List[int] = []


def counts_seen() -> List[int]:
    """Every count ``GroupedExperts`` received since :func:`clear_counts`."""
    return list(_SEEN)


def clear_counts() -> None:
    _SEEN.clear()


class GroupedExperts(nn.Module):
    """torchtitan's experts: ``w1``, ``w3`` (experts, hidden, dim), ``w2`` (experts, dim,
    hidden); SwiGLU per expert over its contiguous run of tokens."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, experts: int = EXPERTS) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal, each matrix scaled by its fan-in (what a meta-built model gets from
        ``pd.materialize``, one unit at a time)."""
        with torch.no_grad():
            for w in (self.w1, self.w2, self.w3):
                w.normal_(0.0, w.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        sharded = hasattr(self.w1, "to_local")  # a DTensor: expert parallelism
        w1, w2, w3 = (w.to_local() if sharded else w for w in (self.w1, self.w2, self.w3))
        counts = num_tokens_per_expert.tolist()
        if sharded:
            _SEEN.extend(counts)
        out = [(F.silu(chunk @ w1[e].T) * (chunk @ w3[e].T)) @ w2[e].T
               for e, chunk in enumerate(torch.split(x, counts))]
        return torch.cat(out) if out else x[:0]


class MoE(nn.Module):
    """Router, experts, and the scatter back (torchtitan's ``MoE`` without shared experts,
    scores applied before the experts). With ``aux``, Switch Transformer's load-balancing
    loss ``E * sum_e f_e * P_e`` (``f_e``: the share of the routed slots expert ``e``
    got, ``P_e``: its mean router probability) times ``AUX_COEF`` is added in the layer's
    own backward (``pd.add_aux_loss``, Megatron's ``MoEAuxLossAutoScaler``)."""

    def __init__(self, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, cfg.hidden, cfg.experts)
        if cfg.bias:  # torchtitan's aux-loss-free balancing: a bias on the choice, not the scores
            self.register_buffer("expert_bias", torch.zeros(cfg.experts))
            self.register_buffer("tokens_per_expert", torch.zeros(cfg.experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, cfg.dim)
        scores = torch.softmax(self.router(x), dim=-1)
        if cfg.bias:
            _, chosen = torch.topk(scores + self.expert_bias, cfg.top_k, dim=-1)
            top = scores.gather(-1, chosen)
        else:
            top, chosen = torch.topk(scores, cfg.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=cfg.experts)
        if cfg.bias:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        token = order // cfg.top_k
        routed = x[token] * top.reshape(-1)[order].unsqueeze(-1)
        out = self.experts(routed, counts)
        y = torch.zeros_like(x).index_add(0, token, out).reshape(shape)
        if cfg.aux:
            share = counts.float() / flat.shape[0]
            y = pd.add_aux_loss(y, AUX_COEF * cfg.experts * (share * scores.mean(0)).sum())
        return y


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__()
        self.norm, self.moe_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.mix = nn.Linear(cfg.dim, cfg.dim)  # the attention's place: dense, per token
        self.moe = MoE(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.mix(self.norm(h))
        return h + self.moe(self.moe_norm(h))


class MoETransformer(nn.Module):
    """torchtitan's layout: tok_embeddings, layers (a ModuleDict of MoE blocks), norm, output."""

    def __init__(self, layers: int = LAYERS, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(layers)})
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def build(layers: int = LAYERS, seed: int = 0, aux: bool = False, bias: bool = False,
          cfg: MoEConfig = MoEConfig()) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(layers, dataclasses.replace(cfg, aux=aux or cfg.aux, bias=bias or cfg.bias))
    with torch.no_grad():  # norms start at ones: make their gradients' errors visible
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model


def sequential(layers: int = LAYERS, seed: int = 0) -> nn.Sequential:
    """The MoE transformer as an nn.Sequential (embedding, blocks, norm, head)."""
    moe = build(layers, seed=seed)
    return nn.Sequential(moe.tok_embeddings, *moe.layers.values(), moe.norm, moe.output)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def update_expert_bias(model: Any, group: Any = None, coef: float = 0.05) -> None:
    """torchtitan's aux-loss-free balancing step (before the optimizer's): every MoE's
    tokens per expert summed over ``group`` (the copies), the bias moved towards the
    experts that got fewer, the counts cleared. By buffer name, so that ``model`` may be
    a pipeline (whose traced stages keep the buffers under their names, not the MoE
    modules)."""
    import torch.distributed as dist

    buffers = dict(model.named_buffers())
    for name, counts in buffers.items():
        if not name.endswith("tokens_per_expert"):
            continue
        if group is not None:
            dist.all_reduce(counts, group=group)
        with torch.no_grad():
            delta = coef * torch.sign(counts.mean() - counts)
            buffers[name.rpartition(".")[0] + ".expert_bias"].add_(delta - delta.mean())
            counts.zero_()


def _expert_parallel_base() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class ExpertParallel(_expert_parallel_base()):
    """torchtitan's ``ExpertParallel`` (token dispatch and combine by all_to_all over the
    ep mesh, experts ``Shard(0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_splits: List[int] = []
        self.output_splits: List[int] = []
        self.received: List[int] = []
        self.order: List[int] = []

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: Any) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for param_name, param in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))

    def _token_dispatch(self, mod: nn.Module, inputs: Tuple[torch.Tensor, torch.Tensor],
                        device_mesh: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        routed_input, num_tokens_per_expert = inputs
        ep = device_mesh.shape[0]
        local = num_tokens_per_expert.shape[0] // ep
        with torch.no_grad():
            received = all_to_all_single(num_tokens_per_expert, None, None, group=device_mesh.get_group())
            received = torch.ops._c10d_functional.wait_tensor(received)
            self.input_splits = num_tokens_per_expert.view(ep, -1).sum(dim=1).tolist()
            self.output_splits = received.view(ep, -1).sum(dim=1).tolist()
        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits,
                                                  device_mesh.get_group())
        # From [rank r: its tokens for local experts 0..] to [local expert e: every rank's].
        self.received = received.tolist()
        self.order = [r * local + e for e in range(local) for r in range(ep)]
        chunks = torch.split(routed_input, self.received)
        routed_input = torch.cat([chunks[i] for i in self.order])
        return routed_input, received.view(ep, local).sum(dim=0)

    def _token_combine(self, mod: nn.Module, routed_output: torch.Tensor, device_mesh: Any) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        pieces = torch.split(routed_output, [self.received[i] for i in self.order])
        back = [torch.empty(0)] * len(self.order)
        for piece, i in zip(pieces, self.order):
            back[i] = piece
        return all_to_all_single_autograd(torch.cat(back), self.input_splits, self.output_splits,
                                          device_mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh, partition_fn=self._partition_fn,
                                 input_fn=self._token_dispatch, output_fn=self._token_combine)
