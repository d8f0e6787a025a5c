"""docs/guide/expert_parallel.md's example on 2 ranks: pp 1 x ep 2, the torchtitan-style MoE
of tests/moe_model.py (with the aux-loss-free balancing buffers) as an nn.Sequential of its
embedding, blocks, norm and head, and its batch: each ep rank's part of a 2 x 4-row global
batch."""
import torch
import torch.distributed as dist
from moe_model import ExpertParallel, build
from test_expert_parallel import ROWS, batch, lm_loss
from torch.distributed.device_mesh import init_device_mesh

import pipedream_ext as pd

pp, ep = 1, 2


def make_model() -> torch.nn.Sequential:
    """A fresh copy of the model, for each later pipeline."""
    moe = build(bias=True)
    return torch.nn.Sequential(moe.tok_embeddings, *moe.layers.values(), moe.norm, moe.output)


model = make_model()
loss_fn = lm_loss
x, y = batch(0, ROWS * ep)
rows = slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)
x_part, y_part = x[rows], y[rows]
