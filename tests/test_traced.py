"""Traced models (``split_points``): any nn.Module, cut by module names, exact.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PDTRACE_DIR=/tmp/t torchrun --standalone --nproc-per-node 3 tests/test_traced.py

Models: the shared ResNet-style CNN of examples/models.py at its smallest (BatchNorm in
train mode, residual adds, ``torch.flatten``); written here, a U-Net-style model (with
examples/models.py's decoder) whose first skip connection jumps
over several stages, a model with two tensor inputs, a keyword flag fixed by
``concrete_args`` and a tuple output, a tied-embedding language model, a model whose
tensor inputs are keyword arguments given as a dict of named tensors (one used only
by the last stage, one left to its default), and a model calling one Linear in its
first and its last stage (its parameters shared by both, under one name). Each runs every flush schedule and is
compared with the unsplit model after SGD-momentum and Adam steps: every loss,
weight and BatchNorm buffer. BatchNorm normalises each microbatch by its own
statistics in a pipeline, so the reference runs the unsplit model microbatch by
microbatch (the loss is the batch-share-weighted sum, the running statistics are
updated per microbatch in the same order). Then a checkpoint is saved, loaded
into another split of the same model and consolidated into the unmodified model.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, FromEnv, Launch, parametrize_cases, worker_main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import models

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
MICROBATCHES = 4


# --------------------------------------------------------------------------- models
def ResNet() -> nn.Module:
    """The shared ResNet at its smallest: 3x8x8 -> 5 classes, a biased conv stem (ReLU in
    forward), layers of 2 blocks (4 and 6 channels) with biased 1x1 conv projections."""
    return models.ResNet((2, 2), (4, 6), in_channels=3, classes=5, stem="conv", projection="conv", pool=2)


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(2, 4, 3, 1, 1), nn.GroupNorm(2, 4), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(4, 6, 3, 2, 1), nn.GroupNorm(2, 6), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(6, 6, 3, 1, 1), nn.Tanh())
        self.up = nn.ConvTranspose2d(6, 4, 2, 2)
        self.dec1 = models.Decoder(4)  # its skip crosses every cut between enc1 and here
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)                      # the skip: used again by dec1
        e2 = self.enc2(e1)
        m = self.mid(e2) + e2
        return self.head(self.dec1(self.up(m), e1))


class TwoInputs(nn.Module):
    """forward(x, mask, use_cache=...) -> (logits, aux); the mask is used by every block,
    and so are a constant buffer and a tensor made in the forward (both made by every
    stage using them, not sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 1)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, use_cache: bool = True):
        h = self.embed(x)
        offset = torch.full((8,), 0.1)
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * mask * self.gain + offset
        if use_cache:  # a branch fixed by concrete_args when tracing
            h = h * 2
        return self.head(h), self.aux(h).squeeze(1)


class TiedLM(nn.Module):
    """A language model whose head is tied to its embedding (stages 0 and last)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return self.head(h)


class KeywordInputs(nn.Module):
    """forward(x, mask=None, scale=None, bias=None, return_aux=False) -> (logits, aux):
    tensor keyword arguments, given by name (``scale`` reaches only the last stage;
    ``bias`` keeps its default), a flag fixed by concrete_args."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                return_aux: bool = False):
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
            if mask is not None:
                h = h * mask
        if bias is not None:
            h = h + bias
        logits = self.head(h) * (scale if scale is not None else 1.0)
        return (logits, self.aux(h).squeeze(1)) if return_aux else logits


class ReusedLinear(nn.Module):
    """One Linear called at the start and at the end: its parameters are used by the
    first and the last stage under one name (shared, gradients summed)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(torch.tanh(self.proj(h)))


def two_input_loss(out: Tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    return F.cross_entropy(logits, y) + 0.1 * aux.pow(2).mean()


def seg_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


#: name -> (builder, loss, split points by stage count, other split by count, kwargs)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable, Dict[int, List[str]],
                        Dict[int, List[str]], Dict[str, Any]]] = {
    "resnet": (ResNet, F.cross_entropy,
               {2: ["layer2"], 3: ["layer1.1", "layer2"], 4: ["layer1", "layer2", "layer2.1"]},
               {2: ["layer1.1"], 3: ["layer1", "layer2.1"], 4: ["layer1.1", "layer2", "fc"]}, {}),
    "unet": (UNet, seg_loss,
             {2: ["mid"], 3: ["enc2", "dec1"], 4: ["enc2", "mid", "dec1"]},
             {2: ["up"], 3: ["mid", "dec1"], 4: ["enc2", "up", "head"]}, {}),
    "two_inputs": (TwoInputs, two_input_loss,
                   {2: ["blocks.2"], 3: ["blocks.1", "blocks.3"],
                    4: ["blocks.1", "blocks.2", "head"]},
                   {2: ["blocks.1"], 3: ["blocks.2", "head"], 4: ["blocks.0", "blocks.3", "aux"]},
                   {"concrete_args": {"use_cache": False}}),
    "tied": (TiedLM, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
             {2: ["layers.1"], 3: ["layers.1", "head"], 4: ["layers.0", "layers.2", "head"]},
             {2: ["head"], 3: ["layers.0", "layers.2"], 4: ["layers.1", "layers.2", "head"]}, {}),
    "kwargs": (KeywordInputs, two_input_loss,
               {2: ["blocks.1"], 3: ["blocks.1", "head"], 4: ["blocks.0", "blocks.2", "head"]},
               {2: ["blocks.2"], 3: ["blocks.0", "aux"], 4: ["blocks.1", "head", "aux"]},
               {"concrete_args": {"return_aux": True}}),
    "reused": (ReusedLinear, F.cross_entropy,
               {2: ["blocks.1"], 3: ["blocks.0", "blocks.2"], 4: ["blocks.0", "blocks.1", "blocks.2"]},
               {2: ["blocks.2"], 3: ["blocks.1", "head"], 4: ["blocks.0", "blocks.2", "head"]}, {}),
}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind][0]().train()


def make_batch(kind: str, n: int, seed: int) -> Tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "resnet":
        return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)
    if kind == "unet":
        return torch.randn(n, 2, 8, 8, generator=g), torch.randint(0, 3, (n, 8, 8), generator=g)
    if kind == "tied":
        ids = torch.randint(0, 11, (n, 3), generator=g)
        return ids, torch.roll(ids, 1, dims=1)
    if kind == "reused":
        return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    if kind == "kwargs":  # named, in another order than forward's parameters
        x = torch.randn(n, 6, generator=g)
        mask = (torch.rand(n, 8, generator=g) > 0.3).float()
        scale = torch.rand(n, 1, generator=g) + 0.5
        return {"scale": scale, "x": x, "mask": mask}, torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 6, generator=g)
    mask = (torch.rand(n, 8, generator=g) > 0.3).float()
    return (x, mask), torch.randint(0, 3, (n,), generator=g)


def reference_step(kind: str, model: nn.Module, inputs: Any, y: torch.Tensor) -> float:
    """The unsplit model on the pipeline's microbatches: share-weighted loss, backward."""
    loss_fn = MODELS[kind][1]
    kwargs = dict(MODELS[kind][4].get("concrete_args", {}))
    named = inputs if isinstance(inputs, dict) else {}
    xs = () if named else inputs if isinstance(inputs, tuple) else (inputs,)
    parts = [torch.tensor_split(t, MICROBATCHES) for t in xs]
    named_parts = {k: torch.tensor_split(t, MICROBATCHES) for k, t in named.items()}
    ys = torch.tensor_split(y, MICROBATCHES)
    total = 0.0
    for i in range(MICROBATCHES):
        out = model(*[p[i] for p in parts], **{k: p[i] for k, p in named_parts.items()}, **kwargs)
        loss = loss_fn(out, ys[i]) * (ys[i].shape[0] / y.shape[0])
        loss.backward()
        total += loss.item()
    return total


def assert_same_state(pipe_state: Dict[str, torch.Tensor], ref: nn.Module, what: str) -> None:
    expected = ref.state_dict()
    for name, value in pipe_state.items():
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


# --------------------------------------------------------------------------- worker checks
def optimizers(params: List[nn.Parameter]) -> List[torch.optim.Optimizer]:
    return [torch.optim.SGD(params, lr=0.05, momentum=0.9), torch.optim.Adam(params, lr=0.01)]


def check_schedule(kind: str, schedule: str, replicas: Optional[List[int]] = None,
                   recompute: bool = False) -> None:
    """Two SGD-momentum steps then two Adam steps: every loss, weight and buffer exact."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    stages = len(replicas) if replicas is not None else world * chunks
    _, loss_fn, splits, _, kwargs = MODELS[kind]
    sample = make_batch(kind, 8, 99)
    pipe = pd.PipeDream(make_model(kind), loss_fn, schedule=schedule, microbatches=MICROBATCHES,
                        chunks=chunks, timeout=60, split_points=splits[stages],
                        sample=sample, replicas=replicas, recompute=recompute, **kwargs)
    ref = make_model(kind)
    names = {n for n, _ in pipe.named_parameters()}
    assert names <= set(dict(ref.named_parameters(remove_duplicate=False))), names
    assert pipe.traced.tracer == "fx"
    if kind == "kwargs":  # forward's order; scale travels to the last stage, bias defaults
        assert pipe.traced.input_names == ["x", "mask", "scale"], pipe.traced.input_names
        assert all("scale" in live for live in pipe.traced.live), pipe.traced.live
    if kind == "reused":  # proj is called by the first and the last stage: shared
        assert [(sp.names, sp.stages) for sp in pipe.shared_parameters] == [
            (("proj.weight",) * 2, (0, stages - 1)), (("proj.bias",) * 2, (0, stages - 1))]
    step = 0
    for ref_opt, opt in zip(optimizers(list(ref.parameters())),
                            optimizers(list(pipe.parameters()))):
        for _ in range(2):
            x, y = make_batch(kind, 8 + step % 2, 10 + step)
            expected = reference_step(kind, ref, x, y)
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), \
                f"{kind} {schedule} step {step}: loss {loss} != {expected}"
            ref_opt.step(); ref_opt.zero_grad()
            opt.step(); opt.zero_grad()
            step += 1
    assert_same_state(pipe.state_dict(), ref, f"{kind} {schedule} after {step} steps")


def check_checkpoint(kind: str, root: str) -> None:
    """Save from one split, load into another (weights and Adam state), consolidate."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    _, loss_fn, splits, other, kwargs = MODELS[kind]
    sample = make_batch(kind, 8, 99)
    path = os.path.join(root, f"{kind}-{world}")
    ref = make_model(kind)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    pipe = pd.PipeDream(make_model(kind), loss_fn, schedule="1f1b", microbatches=MICROBATCHES,
                        timeout=60, split_points=splits[world], sample=sample, **kwargs)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for step in range(2):
        x, y = make_batch(kind, 8, 20 + step)
        reference_step(kind, ref, x, y)
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        ref_opt.step(); ref_opt.zero_grad()
        opt.step(); opt.zero_grad()
    pd.save_checkpoint(path, pipe, opt, step=2)
    if dist.get_rank() == 0:
        whole = make_model(kind)
        whole.load_state_dict(pd.consolidate(path), strict=True)  # the unmodified model
        assert_same_state(whole.state_dict(), ref, f"{kind}: consolidated")
    # Another split of the same model (e.g. other stage boundaries inside layer1).
    other_pipe = pd.PipeDream(make_model(kind), loss_fn, schedule="gpipe",
                              microbatches=MICROBATCHES, timeout=60, split_points=other[world],
                              sample=sample, **kwargs)
    other_opt = torch.optim.Adam(other_pipe.parameters(), lr=0.01)
    other_pipe.load_state_dict(pd.consolidate(path))  # a full state dict, by original names
    assert_same_state(other_pipe.state_dict(), ref, f"{kind}: load_state_dict into {other[world]}")
    with torch.no_grad():
        for p in other_pipe.parameters():
            p.zero_()  # the checkpoint must restore every weight again
    info = pd.load_checkpoint(path, other_pipe, other_opt)
    assert info.step == 2
    assert_same_state(other_pipe.state_dict(), ref, f"{kind}: loaded into {other[world]}")
    x, y = make_batch(kind, 8, 30)
    expected = reference_step(kind, ref, x, y)
    loss = other_pipe.step(x if other_pipe.is_first else None, y if other_pipe.is_last else None)
    assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), (kind, loss, expected)
    ref_opt.step(); other_opt.step()
    assert_same_state(other_pipe.state_dict(), ref, f"{kind}: Adam step after loading")
    if kind in ("unet", "two_inputs", "kwargs"):  # no BatchNorm: outputs equal the model's
        out = other_pipe.forward_only(x if other_pipe.is_first else None)
        if other_pipe.is_last:
            with torch.no_grad():
                fixed = kwargs.get("concrete_args", {})
                expected_out = ref(**x, **fixed) if isinstance(x, dict) else \
                    ref(*(x if isinstance(x, tuple) else (x,)), **fixed)
            for got, want in zip(out if isinstance(out, (tuple, list)) else (out,),
                                 expected_out if isinstance(expected_out, tuple) else (expected_out,)):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


class Chain(nn.Module):
    """The layers of an nn.Sequential under the same names, in a plain module."""

    def __init__(self, layers: List[nn.Module]) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


class ExportedChain(Chain):
    """The same, with a check torch.fx cannot trace (a branch on a shape), so the
    pipeline takes the torch.export path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 6:
            raise ValueError("expected 6 features")
        return super().forward(x)


def chain_layers() -> List[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)),
            nn.Sequential(nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 3)]


def check_asynchronous_equals_sequential(schedule: str) -> None:
    """Asynchronous schedules (weight stashing) on a traced model run exactly as on the
    same layers given as an nn.Sequential with the same stage boundaries (fx, and
    torch.export for a forward fx cannot trace)."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    points = {2: ["2"], 3: ["1", "3"], 4: ["1", "2", "3"]}[world]
    balance = [b - a for a, b in zip([0] + [int(p) for p in points],
                                     [int(p) for p in points] + [4])]
    (x0, _), y0 = make_batch("two_inputs", 8, 1)
    pipes = [pd.PipeDream(nn.Sequential(*chain_layers()), F.cross_entropy, schedule=schedule,
                          microbatches=4, balance=balance, timeout=60),
             pd.PipeDream(Chain(chain_layers()), F.cross_entropy, schedule=schedule,
                          microbatches=4, split_points=points, sample=(x0, y0), timeout=60),
             pd.PipeDream(ExportedChain(chain_layers()), F.cross_entropy, schedule=schedule,
                          microbatches=4, split_points=points, sample=(x0, y0), timeout=60)]
    assert [p.traced.tracer for p in pipes[1:]] == ["fx", "export"]
    losses: List[List[Any]] = []
    for pipe in pipes:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        losses.append([])
        for step in range(4):
            (x, _), y = make_batch("two_inputs", 8, 40 + step)
            losses[-1].append(pipe.step(x if pipe.is_first else None,
                                        y if pipe.is_last else None, optimizer=opt))
        pipe.flush()
    assert losses[0] == losses[1] == losses[2], (schedule, losses)
    seq = pipes[0].state_dict()
    for pipe in pipes[1:]:
        traced = pipe.state_dict()
        assert list(seq) == list(traced), (list(seq), list(traced))
        for name in seq:
            assert torch.equal(seq[name], traced[name]), f"{schedule}: {name}"


class NanoGPT(nn.Module):
    """nanoGPT's interface: ``forward(idx, targets) -> (logits, loss)``, its ``transformer``
    ModuleDict and a head tied to the token embedding. ``export_only``: with nanoGPT's
    ``assert t <= block_size``, which torch.fx cannot trace (torch.export then does)."""

    def __init__(self, export_only: bool, blocks: int = 4, width: int = 8, vocab: int = 11,
                 context: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.export_only, self.context = export_only, context
        self.transformer = nn.ModuleDict(dict(
            wte=models.SmallInitEmbedding(vocab, width), wpe=models.SmallInitEmbedding(context, width),
            h=nn.ModuleList(models.Block(width, 2) for _ in range(blocks)), ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        _, t = idx.size()
        if self.export_only:
            assert t <= self.context, f"sequence of {t} > block size {self.context}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def check_aliased_sample(export_only: bool) -> None:
    """nanoGPT traced on a placeholder sample whose idx and targets are one tensor
    (``sample=((z, z), z)``), with ``loss_fn`` returning the model's own loss: every
    step's loss and the weights equal the unsplit model's, also for a batch that passes
    one tensor as both inputs, and no step warns."""
    import warnings

    import pipedream_ext as pd

    world = dist.get_world_size()
    z = torch.zeros(8, 6, dtype=torch.long)
    points = {2: ["transformer.h.2"], 3: ["transformer.h.1", "transformer.h.3"],
              4: ["transformer.h.1", "transformer.h.2", "transformer.h.3"]}[world]
    pipe = pd.PipeDream(NanoGPT(export_only), lambda out, y: out[1], microbatches=MICROBATCHES,
                        timeout=60, split_points=points, sample=((z, z), z))
    assert pipe.traced.tracer == ("export" if export_only else "fx")
    ref = NanoGPT(export_only)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        idx = torch.randint(0, 11, (8, 6), generator=g)
        targets = idx if step == 2 else torch.randint(0, 11, (8, 6), generator=g)
        expected = ref(idx, targets)[1]
        expected.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = float(pipe.step((idx, targets) if pipe.is_first else None, targets))
        assert abs(loss - expected.item()) <= 1e-5, (export_only, step, loss, expected.item())
        ref_opt.step(); ref_opt.zero_grad()
        opt.step(); opt.zero_grad()
    assert_same_state(pipe.state_dict(), ref, f"nanoGPT, aliased sample, export_only={export_only}")


def traced_cases(world: int) -> Cases:
    root = FromEnv("PDTRACE_DIR", f"/tmp/pdtrace-{os.environ.get('MASTER_PORT', 'x')}")
    schedules = ["gpipe", "1f1b", "zb-h1"] + (["interleaved-1f1b"] if world == 2 else [])
    cases = Cases()
    for kind in MODELS:
        for schedule in schedules:
            cases.add(check_schedule, kind, schedule)
        cases.add(check_checkpoint, kind, root)
    for schedule in ("pipedream", "pipedream-2bw"):
        cases.add(check_asynchronous_equals_sequential, schedule)
    if world > 2:  # hybrid: stage 0 on two ranks (no BatchNorm: replicas see other microbatches)
        cases.add(check_schedule, "unet", "1f1b", replicas=[2] + [1] * (world - 2))
    # Recompute: BatchNorm's running statistics still advance once per microbatch.
    cases.add(check_schedule, "resnet", "1f1b", recompute=True)
    cases.add(check_schedule, "kwargs", "zb-h1", recompute=True)
    for export_only in (False, True):
        cases.add(check_aliased_sample, export_only)
    return cases


# 3 ranks adds no feature 2 and 4 lack (4 also has a replicated stage): `make test-all` runs it.
LAUNCHES = [Launch(HERE, world, traced_cases, dirs=("PDTRACE_DIR",),
                   marks=(pytest.mark.slow,) if world == 3 else ()) for world in (2, 3, 4)]


# --------------------------------------------------------------------------- pytest side
@parametrize_cases(*LAUNCHES)
def test_traced_models_match_the_unsplit_model(case: CaseRef) -> None:
    """ResNet, U-Net, two-input and tied models: every flush schedule exact; checkpoints
    across splits; asynchronous schedules equal to the nn.Sequential path."""
    case.check()


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent: no graph
            h = -h
        return self.b(h)


@pytest.mark.parametrize("model, points, needle", [
    (Untraceable, ["b"], "Untraceable cannot be traced with torch.fx in module '(the root)' "
                         "(Untraceable.forward, test_traced.py:"),
    (ResNet, ["layer9"], "'layer9' names no submodule of ResNet"),
    (ResNet, ["layer1.2"], "names no submodule"),
    (ResNet, ["stem"], "leaves stage 0 empty"),
    (ResNet, ["layer2", "layer1"], "runs before 'layer2'"),
    (ResNet, ["layer2", "layer2.0"], "leaves stage 1 empty"),
    (UNet, ["mid", "enc2.0"], "runs before"),
])
def test_bad_split_points_are_named(model: Callable[[], nn.Module], points: List[str],
                                    needle: str) -> None:
    import pipedream_ext as pd

    x = torch.randn(4, 4) if model is Untraceable else torch.randn(4, 3 if model is ResNet else 2, 8, 8)
    with pytest.raises(ValueError, match=re.escape(needle)):
        pd.PipeDream(model(), F.cross_entropy, split_points=points, sample=(x, None))


def test_a_module_without_split_points_must_be_sequential() -> None:
    import pipedream_ext as pd

    with pytest.raises(ValueError, match="split_points"):
        pd.PipeDream(ResNet(), F.cross_entropy)


class TwoInputLinear(nn.Module):
    """forward(x, y) reading a weight and a buffer: each can be given aliased in a sample
    (the same tensor twice, a view of another input, the weight or buffer itself)."""

    def __init__(self, export_only: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.export_only = export_only
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 25).view(5, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.export_only and x.shape[-1] != 5:  # fx cannot trace it: torch.export does
            raise ValueError("expected 5 features")
        return self.b(self.a(x) * self.gain + y)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("alias", ["same", "view", "weight", "buffer", "named"])
def test_aliased_sample_inputs_trace_as_distinct_inputs(tracer: str, alias: str) -> None:
    """A sample whose inputs are one tensor (or an input that is the model's own weight)
    traces into stages that compute the model on any later distinct batch."""
    from pipedream_ext._frontend.graph_split import split_model
    from pipedream_ext._frontend.model_io import positional_inputs

    model = TwoInputLinear(export_only=tracer == "export")
    z = torch.zeros(5, 5)
    sample = {"same": (z, z), "view": (z, z[:, :]), "weight": (model.a.weight, z),
              "buffer": (z, model.gain), "named": {"y": z, "x": z}}[alias]
    split = split_model(model, ["b"], sample)
    assert split.tracer == tracer
    assert model.a.weight.requires_grad and model.gain.equal(torch.linspace(0.5, 1.5, 25).view(5, 5))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 5, generator=g), torch.randn(5, 5, generator=g)
    inputs = positional_inputs(split.input_names, {"x": x, "y": y} if alias == "named" else (x, y),
                               "step()")
    out = split.stages[1](split.stages[0](inputs))
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x, y))


def test_distinct_inputs_copies_only_what_aliases() -> None:
    from pipedream_ext._frontend.model_io import distinct_inputs

    model = nn.Linear(3, 3)
    x, other = torch.randn(2, 3), torch.randn(2, 3)
    assert distinct_inputs((x, other), model) == (x, other)  # nothing aliases: as given
    nested = distinct_inputs({"a": (x, [x[1:], other]), "w": model.weight, "k": 3}, model)
    assert nested["a"][0] is x and nested["a"][1][1] is other and nested["k"] == 3
    copies = [nested["a"][1][0], nested["w"]]
    assert all(c.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for c in copies)
    assert torch.equal(copies[0], x[1:]) and torch.equal(copies[1], model.weight)
    assert not copies[1].requires_grad  # a copy to trace with, not the parameter


if __name__ == "__main__":
    worker_main(LAUNCHES)
