"""docs/guide/checkpoints.md's examples: a pipeline of an 8-layer MLP after one step (Adam
and a learning-rate schedule), and a tiny Llama saved as a Hugging Face directory."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _docs_models import causal_lm_loss as loss_fn
from _docs_models import make_mlp as make_model
from transformers import LlamaConfig, LlamaForCausalLM

import pipedream_ext as pd


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=100)


model = make_model()
pipe = pd.PipeDream(model, F.mse_loss, balance=[4, 4])
opt = torch.optim.Adam(pipe.parameters())
sched = make_scheduler(opt)
pipe.step(torch.randn(8, 16), torch.randn(8, 16))
opt.step()
sched.step()
step = 1

torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64))
if dist.get_rank() == 0:
    llama.save_pretrained("llama-dir")
dist.barrier()
ids = torch.randint(0, 32, (4, 8))
sample = ({"input_ids": ids}, ids)
