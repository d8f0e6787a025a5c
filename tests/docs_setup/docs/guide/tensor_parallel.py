"""docs/guide/tensor_parallel.md's example on 2 ranks: pp 1 x dp 1 x tp 2, the tiny Llama of
tests/test_tensor_parallel.py (wq/wk/wv/wo attention, w1/w2/w3 SwiGLU) and its batch."""
import torch
from test_tensor_parallel import batch, llama, lm_loss
from torch.distributed.device_mesh import init_device_mesh

import pipedream_ext as pd

pp, dp, tp = 1, 1, 2
model, loss_fn = llama(), lm_loss
x, y = batch(0)
