"""docs/guide/gpus.md's example: a small MLP and one batch."""
import torch
import torch.nn.functional as F

import pipedream_ext as pd

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
