"""docs/guide/compile.md's example: nanoGPT's interface (``forward(idx, targets) ->
(logits, loss)``, blocks under ``transformer.h``) at a tiny size."""
from types import SimpleNamespace

import torch
from test_traced import NanoGPT

import pipedream_ext as pd


def GPT(config: SimpleNamespace) -> NanoGPT:  # nanoGPT's name
    return NanoGPT(export_only=False, blocks=config.n_layer)


config = SimpleNamespace(n_layer=7)
x, y = torch.randint(0, 11, (8, 6)), torch.randint(0, 11, (8, 6))
