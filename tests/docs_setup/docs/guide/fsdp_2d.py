"""docs/guide/fsdp_2d.md's example on 2 ranks: pp 1 x dp 2, a small MLP, this dp rank's
part of the batch."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipedream_ext as pd

pp, dp = 1, 2
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
loss_fn = F.cross_entropy
generator = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator)
