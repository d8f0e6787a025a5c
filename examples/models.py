"""The models that examples, benchmarks and tests share: a ResNet-style CNN, a U-Net-style
segmenter and a GPT-style decoder, each one definition with its variants as parameters.

Examples import it directly (``torchrun examples/x.py`` puts examples/ on ``sys.path``);
benchmarks and tests put examples/ on ``sys.path`` first. The order in which each
module creates its children is fixed: under one ``torch.manual_seed`` every variant
draws its weights exactly as the copies it replaces did.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VOCAB", "Block", "Decoder", "DecoderPath", "Embed", "EncoderPath", "FlattenLogits", "GPT",
           "ResNet", "Residual", "SmallInitEmbedding", "UNet", "conv_block", "gpt_sequential"]

VOCAB = 256  # bytes: the GPT models are byte-level

# ----------------------------------------------------------------------------- ResNet
#: Residual blocks' skip projection where the shape changes: a 1x1 convolution with a
#: bias (``"conv"``), or one without followed by BatchNorm (``"conv_bn"``).
PROJECTIONS = ("conv", "conv_bn")
#: The ResNet's stem: a 3x3 convolution with a bias (``"conv"``), without one and
#: BatchNorm (``"conv_bn"``), both followed by ``F.relu`` in ``forward``; or conv, BatchNorm
#: and an ``nn.ReLU`` module (``"conv_bn_relu"``).
STEMS = ("conv", "conv_bn", "conv_bn_relu")


class Residual(nn.Module):
    """A basic residual block: conv-BN-ReLU-conv-BN plus the (projected) input.

    Args:
        cin: input channels.
        cout: output channels.
        stride: of the first convolution and of the projection.
        projection: one of :data:`PROJECTIONS`, used when ``stride != 1 or cin != cout``.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, projection: str = "conv_bn") -> None:
        super().__init__()
        if projection not in PROJECTIONS:
            raise ValueError(f"unknown projection {projection!r}; choose from {PROJECTIONS}")
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = (nn.Conv2d(cin, cout, 1, stride) if projection == "conv" else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + skip)


class ResNet(nn.Module):
    """A stem, ``layer1``..``layerN`` of residual blocks (the first block of every layer
    after the first halves the resolution), ``F.adaptive_avg_pool2d``, ``torch.flatten``
    and a linear ``fc``.

    Args:
        blocks: residual blocks per layer.
        widths: output channels per layer (the stem's are ``widths[0]``).
        in_channels: input image channels.
        classes: outputs of ``fc``.
        stem: one of :data:`STEMS`.
        projection: the blocks' skip projection, one of :data:`PROJECTIONS`.
        pool: side of the pooled feature map (``fc`` takes ``widths[-1] * pool * pool``).
    """

    def __init__(self, blocks: Sequence[int], widths: Sequence[int], in_channels: int = 3,
                 classes: int = 10, stem: str = "conv_bn_relu", projection: str = "conv_bn",
                 pool: int = 1) -> None:
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"unknown stem {stem!r}; choose from {STEMS}")
        if len(blocks) != len(widths):
            raise ValueError(f"blocks {list(blocks)} and widths {list(widths)} differ in length")
        width = widths[0]
        if stem == "conv":
            self.stem: nn.Module = nn.Conv2d(in_channels, width, 3, 1, 1)
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                      *([nn.ReLU()] if stem == "conv_bn_relu" else []))
        self.relu_after_stem = stem != "conv_bn_relu"
        cin = width
        for i, (count, cout) in enumerate(zip(blocks, widths)):
            setattr(self, f"layer{i + 1}", nn.Sequential(*[
                Residual(cin if b == 0 else cout, cout, 2 if b == 0 and i > 0 else 1, projection)
                for b in range(count)]))
            cin = cout
        self.num_layers = len(blocks)
        self.pool = pool
        self.fc = nn.Linear(cin * pool * pool, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.relu_after_stem:
            x = F.relu(x)
        for i in range(self.num_layers):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, self.pool), 1))


# ----------------------------------------------------------------------------- U-Net
def conv_block(cin: int, cout: int, stride: int) -> nn.Sequential:
    """Two 3x3 convolutions with GroupNorm and ReLU (the first one strided)."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(2, cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, 1, 1), nn.GroupNorm(2, cout), nn.ReLU())


class Decoder(nn.Module):
    """Concatenates the upsampled path with the skip connection, then convolves (inside
    the module, so the skip crosses every cut between its encoder and here)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2 * channels, channels, 3, 1, 1)
        self.norm = nn.GroupNorm(2, channels)

    def forward(self, up: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(torch.cat([up, skip], dim=1))))


class UNet(nn.Module):
    """Encoder levels ``encs.i`` (the first keeps the resolution, the others halve it), a
    middle block, and per level an up-convolution ``ups.k`` and a decoder ``decs.k`` that
    concatenates the encoder's output of that level (the skip connection).

    Args:
        depth: encoder levels.
        width: channels of the first level (doubled per level).
        classes: output channels (per-pixel classes).
    """

    def __init__(self, depth: int, width: int, classes: int = 3) -> None:
        super().__init__()
        chans = [width * 2 ** i for i in range(depth)]
        self.encs = nn.ModuleList(conv_block(3 if i == 0 else chans[i - 1], chans[i], 1 if i == 0 else 2)
                                  for i in range(depth))
        self.mid = nn.Sequential(nn.Conv2d(chans[-1], chans[-1], 3, 1, 1), nn.Tanh())
        # ups[k] / decs[k] bring level depth-1-k up to level depth-2-k.
        self.ups = nn.ModuleList(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, 2)
                                 for i in reversed(range(depth - 1)))
        self.decs = nn.ModuleList(Decoder(chans[i]) for i in reversed(range(depth - 1)))
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for enc in self.encs:
            x = enc(x)
            skips.append(x)
        x = self.mid(x) + x
        for k in range(len(self.ups)):
            x = self.decs[k](self.ups[k](x), skips[-2 - k])
        return self.head(x)


class EncoderPath(nn.Module):
    """A :class:`UNet`'s encoders as one layer: x -> every level's output (a tuple)."""

    def __init__(self, encs: nn.ModuleList) -> None:
        super().__init__()
        self.encs = encs

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        skips = []
        for enc in self.encs:
            x = enc(x)
            skips.append(x)
        return tuple(skips)


class DecoderPath(nn.Module):
    """A :class:`UNet`'s middle, decoders and head as one layer, taking that tuple."""

    def __init__(self, unet: UNet) -> None:
        super().__init__()
        self.mid, self.ups, self.decs, self.head = unet.mid, unet.ups, unet.decs, unet.head

    def forward(self, skips: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = skips[-1]
        x = self.mid(x) + x
        for k in range(len(self.ups)):
            x = self.decs[k](self.ups[k](x), skips[-2 - k])
        return self.head(x)


# ----------------------------------------------------------------------------- GPT
class SmallInitEmbedding(nn.Embedding):
    """An embedding initialised N(0, 0.02) as in GPT-2, not N(0, 1): the head shares the
    token embedding's weight, and unit-variance rows would make the first logits huge."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Embed(nn.Module):
    """Token embedding plus learned positions; (batch, time) ids -> (batch, time, width)."""

    def __init__(self, width: int, context: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok = SmallInitEmbedding(vocab, width)
        self.pos = SmallInitEmbedding(context, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    Causal attention goes through ``scaled_dot_product_attention(is_causal=True)``,
    so there is no mask buffer (its values would not survive the meta device).

    Raises:
        ValueError: ``width`` is not a multiple of ``heads``.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def reset_parameters(self) -> None:
        """Resets every Linear and LayerNorm child (the block owns no tensors itself)."""
        for child in (self.ln1, self.qkv, self.proj, self.ln2, self.fc, self.out):
            child.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class FlattenLogits(nn.Module):
    """(batch, time, vocab) -> (batch * time, vocab), the shape cross entropy takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])


class GPT(nn.Module):
    """A GPT-style decoder as one module: :class:`Embed`, ``blocks.i``, a final LayerNorm
    ``ln_f`` and a head tied to the token embedding; returns flattened logits.

    Args:
        blocks: transformer blocks.
        width: model width.
        heads: attention heads per block.
        context: longest sequence (positions).
        vocab: vocabulary size.
    """

    def __init__(self, blocks: int, width: int, heads: int, context: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = Embed(width, context, vocab)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.tok.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)).flatten(0, 1)


def gpt_sequential(layers: int, width: int, heads: int, context: int, vocab: int = VOCAB) -> nn.Sequential:
    """The GPT as an ``nn.Sequential``: Embed, ``layers`` blocks, LayerNorm, tied head,
    flatten (``layers + 4`` layers).

    Returns:
        The model; its head's weight is the token embedding's (kept by both stages).
    """
    embed = Embed(width, context, vocab)
    head = nn.Linear(width, vocab, bias=False)
    head.weight = embed.tok.weight  # tied: the pipeline keeps it on both stages
    layers: List[nn.Module] = [embed, *[Block(width, heads) for _ in range(layers)], nn.LayerNorm(width), head,
                               FlattenLogits()]
    return nn.Sequential(*layers)
