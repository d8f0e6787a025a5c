"""docs/runtime.md's examples: a small MLP, batches that are a function of the step, a
checkpoint folder."""
import os

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR

import pipedream_ext as pd

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
steps, k, ckpt = 4, 2, "ckpt"


def batch_of_step(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator)


loader = [batch_of_step(step) for step in range(3)]
