"""docs/guide/gpus.md's example: a small MLP and one batch."""
import torch
import torch.nn.functional as F  # noqa: F401 - the page's blocks use it

import pipedream_ext as pd  # noqa: F401 - the page's blocks use it

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
