"""docs/guide/language_models.md's examples: a small language model on padded rows, and a
tiny Llama (transformers) on packed rows of two documents each."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import pipedream_ext as pd

VOCAB = 32
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, VOCAB))
tokens = torch.randint(0, VOCAB, (8, 6))
labels = torch.randint(0, VOCAB, (8, 6))
for row in range(8):  # each row ends in a different amount of padding
    labels[row, 6 - row % 4:] = -100

llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64))
ids = torch.randint(0, VOCAB, (4, 12))
pos = torch.cat([torch.arange(5), torch.arange(7)]).repeat(4, 1)  # documents of 5 and 7 tokens
y = ids.roll(-1, dims=1)
y[:, [4, 11]] = -100  # no target across a document's end
