"""docs/guide/any_model.md's examples: examples/models.py's ResNet on 8x8 images, a
two-input model with a ``use_cache`` flag, token ids for GPT-2."""
import torch
import torch.nn.functional as F
from torch import nn

import pipedream_ext as pd
from examples.models import ResNet


class MaskedMLP(nn.Module):
    """Two tensor inputs (an image and its mask) and a non-tensor flag."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        h = (x * mask).flatten(1)
        for block in self.blocks:
            h = F.relu(block(h))
        return self.head(h)


def make_resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet(blocks=[1, 1, 2], widths=[8, 16, 16], in_channels=1)


resnet = make_resnet()
model, loss_fn = MaskedMLP(), F.cross_entropy
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
mask = torch.ones_like(x)
ids, targets = torch.randint(0, 64, (8, 12)), torch.randint(0, 64, (8, 12))
m = torch.ones_like(ids)
