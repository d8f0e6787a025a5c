"""docs/checkpoints.md's examples: an 8-layer MLP, and a tiny 2-layer Llama saved as a
Hugging Face directory ("llama-dir") with a batch of token ids."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _docs_models import causal_lm_loss as loss_fn
from _docs_models import make_mlp as make_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import pipedream_ext as pd

model, step = make_model(), 0
if dist.get_rank() == 0:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=32)).save_pretrained("llama-dir")
dist.barrier()
ids = torch.randint(0, 32, (8, 6))
sample = ({"input_ids": ids}, ids)
