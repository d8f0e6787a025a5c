"""The models, sizes, configurations and pure helpers every part of benchmarks/traced.py uses."""
from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import _harness as h

__all__ = ["CONFIGS", "JSON_TAG", "LABELS", "LOG", "MODELS", "SMOKE_THROUGHPUT_SIZES", "SMOKE_TRACE_SIZES",
           "THROUGHPUT_SIZES", "TRACE_SIZES", "VOCAB", "WORKERS", "build", "config_order", "fmt_ratio",
           "grad_check", "loss_fn", "make_batch", "median", "ratio_stats", "reference", "sequential_twin",
           "split_point"]

LOG = logging.getLogger("traced")
JSON_TAG = "TRACED_JSON "
MODELS = ("resnet", "unet", "gpt")
WORKERS = ("throughput", "probe")

#: The throughput configurations, in the order of an even round (odd rounds: reversed).
CONFIGS = ("pd-traced-1f1b", "pd-sequential-1f1b", "torch-1f1b",
           "torch-gpipe", "pd-sequential-gpipe", "pd-traced-gpipe")
LABELS = {"pd-traced-1f1b": "pipedream_ext traced, 1f1b",
          "pd-sequential-1f1b": "pipedream_ext nn.Sequential, 1f1b",
          "torch-1f1b": "torch.distributed.pipelining Schedule1F1B",
          "pd-traced-gpipe": "pipedream_ext traced, gpipe",
          "pd-sequential-gpipe": "pipedream_ext nn.Sequential, gpipe",
          "torch-gpipe": "torch.distributed.pipelining ScheduleGPipe"}

#: Model sizes for the trace table: kind -> list of size dicts (``label`` names the size).
TRACE_SIZES: Dict[str, List[Dict[str, Any]]] = {
    "resnet": [dict(label="8 blocks (2,2,2,2)", blocks=(2, 2, 2, 2), width=16, image=32),
               dict(label="16 blocks (3,4,6,3)", blocks=(3, 4, 6, 3), width=16, image=32),
               dict(label="33 blocks (3,4,23,3)", blocks=(3, 4, 23, 3), width=16, image=32)],
    "unet": [dict(label="depth 2", depth=2, width=8, image=64),
             dict(label="depth 4", depth=4, width=8, image=64),
             dict(label="depth 6", depth=6, width=8, image=64)],
    "gpt": [dict(label="4 blocks", blocks=4, width=64, heads=4, context=64),
            dict(label="16 blocks", blocks=16, width=64, heads=4, context=64),
            dict(label="48 blocks", blocks=48, width=64, heads=4, context=64)],
}
#: One size per model for the stage-call and throughput parts.
THROUGHPUT_SIZES: Dict[str, Dict[str, Any]] = {
    "resnet": dict(label="8 blocks (2,2,2,2), width 16, 32x32", blocks=(2, 2, 2, 2), width=16, image=32),
    "unet": dict(label="depth 4, width 8, 64x64", depth=4, width=8, image=64),
    "gpt": dict(label="8 blocks, width 128, 32 tokens", blocks=8, width=128, heads=4, context=32),
}
#: --smoke: every part on tiny sizes.
SMOKE_TRACE_SIZES: Dict[str, List[Dict[str, Any]]] = {
    "resnet": [dict(label="4 blocks (1,1,1,1)", blocks=(1, 1, 1, 1), width=4, image=16)],
    "unet": [dict(label="depth 3", depth=3, width=4, image=16)],
    "gpt": [dict(label="2 blocks", blocks=2, width=16, heads=2, context=8)],
}
SMOKE_THROUGHPUT_SIZES: Dict[str, Dict[str, Any]] = {k: v[0] for k, v in SMOKE_TRACE_SIZES.items()}
VOCAB = 256


# ----------------------------------------------------------------------------- models
def build(kind: str, size: Dict[str, Any], seed: int = 0):
    """The model ``kind`` of ``size`` in train mode, initialised from ``manual_seed(seed)``."""
    import torch

    m = h.models()
    torch.manual_seed(seed)
    if kind == "resnet":
        widths = [size["width"] * 2 ** i for i in range(len(size["blocks"]))]
        return m.ResNet(size["blocks"], widths).train()
    if kind == "unet":
        return m.UNet(size["depth"], size["width"]).train()
    if kind == "gpt":
        return m.GPT(size["blocks"], size["width"], size["heads"], size["context"], VOCAB).train()
    raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")


def split_point(kind: str, size: Dict[str, Any]) -> str:
    """The module the second of 2 stages starts at (about half the compute on each side)."""
    if kind == "resnet":
        return "layer3"
    if kind == "unet":
        return "mid"
    return f"blocks.{size['blocks'] // 2}"


def sequential_twin(kind: str, model) -> Tuple[Any, List[int]]:
    """``model``'s modules (the same objects) as an ``nn.Sequential`` and the balance that
    puts its boundary where :func:`split_point` does."""
    from torch import nn

    m = h.models()
    if kind == "resnet":
        layers = [model.stem]
        first = 1
        for i in range(model.num_layers):
            blocks = list(getattr(model, f"layer{i + 1}"))
            layers += blocks
            if i < 2:
                first += len(blocks)
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), model.fc]
        return nn.Sequential(*layers), [first, len(layers) - first]
    if kind == "unet":
        return nn.Sequential(m.EncoderPath(model.encs), m.DecoderPath(model)), [1, 1]
    n = len(model.blocks)
    layers = [model.embed, *model.blocks, model.ln_f, model.head, m.FlattenLogits()]
    return nn.Sequential(*layers), [1 + n // 2, len(layers) - 1 - n // 2]


def make_batch(kind: str, size: Dict[str, Any], batch: int, seed: int):
    """``(inputs, targets)`` for ``kind``: images and labels, images and per-pixel labels,
    or token ids and next tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "resnet":
        s = size["image"]
        return torch.randn(batch, 3, s, s, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if kind == "unet":
        s = size["image"]
        return torch.randn(batch, 3, s, s, generator=g), torch.randint(0, 3, (batch, s, s), generator=g)
    ids = torch.randint(0, VOCAB, (batch, size["context"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(kind: str) -> Callable:
    """Cross entropy in the shape each model's output takes (mean reduction)."""
    import torch.nn.functional as F

    if kind == "gpt":
        return lambda logits, targets: F.cross_entropy(logits, targets.reshape(-1))
    return F.cross_entropy


# ----------------------------------------------------------------------------- pure helpers
def config_order(round_index: int, configs: Sequence[str] = CONFIGS) -> List[str]:
    """The configurations of one round: as listed in even rounds, reversed in odd ones
    (A B C, C B A: each neighbour pair runs in both orders)."""
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def ratio_stats(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Optional[Dict[str, float]]:
    """Median, min and max of the per-round ratios ``a[r] / b[r]`` (rounds where either
    is missing or ``b[r]`` is 0 are left out); None when no round has both."""
    ratios = [x / y for x, y in zip(a, b) if x is not None and y]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios),
            "at_least_1": sum(r >= 1.0 for r in ratios)}


def fmt_ratio(stats: Optional[Dict[str, float]]) -> str:
    """``1.02 [0.97-1.05], 3/5 >= 1`` for :func:`ratio_stats`'s result, ``n/a`` for None."""
    if stats is None:
        return "n/a"
    return (f"{stats['median']:.2f} [{stats['min']:.2f}-{stats['max']:.2f}], "
            f"{stats['at_least_1']}/{stats['n']} >= 1")


def median(values: Sequence[float]) -> Optional[float]:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def grad_check(named_grads: Sequence[Tuple[str, Any]], ref_grads: Dict[str, Any]) -> Tuple[float, float, int]:
    """(max |g - g_ref|, max |g_ref| over the same names, names without a gradient)."""
    diff, scale, missing = 0.0, 0.0, 0
    for name, grad in named_grads:
        want = ref_grads.get(name)
        if want is None:
            continue
        if grad is None:
            missing += 1
            continue
        diff = max(diff, float((grad - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
    return diff, scale, missing


def reference(kind: str, size: Dict[str, Any], x, y, microbatches: int) -> Tuple[float, Dict[str, Any]]:
    """The unsplit model's loss and gradients on ``(x, y)``, run microbatch by microbatch
    (each microbatch's loss weighted by its share of the batch, as a pipeline does), by
    every name of every parameter (a tied weight under both names)."""
    import torch

    model = build(kind, size)
    lossf = loss_fn(kind)
    total = 0.0
    for xs, ys in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
        loss = lossf(model(xs), ys) * (ys.shape[0] / y.shape[0])
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}

