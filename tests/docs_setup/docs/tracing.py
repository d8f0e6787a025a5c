"""docs/tracing.md's examples on 2 ranks: a ResNet with a non-tensor flag on 8x8 images,
tiny GPT-2, nanoGPT and Llama models on token ids, and tests/test_tp_traced.py's
torchtitan-style Llama on a pp 2 x dp 1 x tp 1 mesh (pp 2 x tp 2 takes 4 ranks)."""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from test_tp_traced import batch as titan_batch
from test_tp_traced import build, lm_loss
from test_traced import NanoGPT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

import pipedream_ext as pd
from examples.models import ResNet


class FlaggedResNet(ResNet):
    """A ResNet whose forward takes a non-tensor flag, fixed by ``concrete_args``."""

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        return super().forward(x)


def GPT(config: SimpleNamespace) -> NanoGPT:  # nanoGPT's name
    return NanoGPT(export_only=False, blocks=config.n_layer)


def gpt2_loss(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def llama_loss(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


torch.manual_seed(0)
model = FlaggedResNet(blocks=[1, 1, 2], widths=[8, 16, 16], in_channels=1)
resnet = ResNet(blocks=[1, 1, 2], widths=[8, 16, 16], in_channels=1)
loss_fn = F.cross_entropy
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
ids, targets = torch.randint(0, 11, (8, 6)), torch.randint(0, 11, (8, 6))
m = torch.ones_like(ids)
config = SimpleNamespace(n_layer=7)
cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
pp, dp, tp, split_points = 2, 1, 1, ["layers.1"]
llama = build()
tokens, labels = titan_batch(0)
