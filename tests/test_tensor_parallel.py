"""``PipeDream(mesh=("pp", "dp", "tp"), tensor_parallel=plan)``: tensor parallelism inside stages.

Runs under pytest, which launches the worker side with torchrun, or standalone:

    PIPEDREAM_TEST_LAUNCH=4ranks torchrun --standalone --nproc-per-node 4 tests/test_tensor_parallel.py

A tiny Llama-like ``nn.Sequential`` (embedding, blocks of attention with wq/wk/wv
column-wise and wo row-wise, a SwiGLU feed-forward with w1/w3 column-wise and w2
row-wise, RMSNorms, a head) on pp2 x tp2 (4 ranks, Gloo) trains side by side with the
unsplit model on the same batches: the loss of every step, every gradient of step 0
(``full_tensor()`` of each shard against the unsplit model's) and every weight after 3
AdamW steps must agree to 1e-4 relative (tensor parallelism changes the summation
order), with every flush schedule (the multi-chunk ones with 2 chunks per rank). Some
cases clip (``pd.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``), one runs
pp1 x dp2 x tp2 and one pp2 x dp2 x tp1 (``data_parallel="replicate"``), one a ``("pp",
"tp")`` mesh, one a callable plan; a slow launch runs pp2 x dp2 x tp2 on 8 ranks.
What is not supported yet is refused by name (traced models: tests/test_tp_traced.py);
so is, on every rank at construction, a plan that shards a dimension tp does not divide,
or a callable plan that raises or splits a stage differently on one rank; a step after
the first ``check_agreement`` whose tp ranks were given different batches fails on every
rank when its loss is read.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, strict_and_gloo, worker_main

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-4, 1e-5
DIM, HEADS, VOCAB, SEQ, ROWS, BLOCKS = 16, 4, 32, 6, 8, 2
BALANCE = [2, 3]  # embedding and a block; a block, the norm and the head
STEPS = 3


class Attention(nn.Module):
    """Causal multi-head attention; ``-1`` heads in the view, so a tp rank's column
    shard of wq/wk/wv runs its own heads (torchtitan's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.ffn = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


def llama(seed: int = 0) -> nn.Sequential:
    """embedding, BLOCKS blocks, norm, head: 2 + BLOCKS + 1 layers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), *(Block() for _ in range(BLOCKS)),
                          nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB))
    with torch.no_grad():  # RMSNorm starts at ones: make its gradients' errors visible
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(seed: int, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def plan() -> Dict[str, Any]:
    """torchtitan's Llama plan, without sequence parallelism."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"*.attn.wq": ColwiseParallel(), "*.attn.wk": ColwiseParallel(),
            "*.attn.wv": ColwiseParallel(), "*.attn.wo": RowwiseParallel(),
            "*.ffn.w1": ColwiseParallel(), "*.ffn.w3": ColwiseParallel(),
            "*.ffn.w2": RowwiseParallel()}


def parallelize_blocks(stage: nn.Module, tp_mesh: Any) -> None:
    """A callable plan (torchtitan's parallelize-function style): each block of the stage."""
    from torch.distributed.tensor.parallel import parallelize_module

    block_plan = {k.removeprefix("*."): v for k, v in plan().items()}
    for child in stage.children():
        if isinstance(child, Block):
            parallelize_module(child, tp_mesh, block_plan)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(full(actual).detach(), expected.detach(), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


def mesh_of(shape, names=("pp", "dp", "tp")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def check_training(schedule: str, shape=(2, 1, 2), names=("pp", "dp", "tp"),
                   tensor_parallel: Optional[Callable[[], Any]] = None, clip: Optional[float] = None,
                   data_parallel: str = "replicate", chunks: int = 1, microbatches: int = 2,
                   balance: Any = None, **options: Any) -> Any:
    """STEPS AdamW steps of the pipeline and of the unsplit model agree: the loss of every
    step, every gradient of step 0, every weight after each step (and the clipped norm).

    ``balance`` (default: BALANCE, or an even split) and ``options`` go to ``PipeDream``;
    returns the closed pipeline (its ``plan`` and ``balance``)."""
    import pipedream_ext as pd

    ref = llama()
    mesh = mesh_of(shape, names)
    dp = shape[1] if len(shape) == 3 else 1
    if balance is None:
        balance = None if shape[0] == 1 else BALANCE if chunks == 1 else [1, 1, 1, 2]
    pipe = pd.PipeDream(llama(), lm_loss, schedule=schedule, microbatches=microbatches, mesh=mesh,
                        data_parallel=data_parallel, timeout=60, balance=balance, chunks=chunks,
                        tensor_parallel=(tensor_parallel or plan)(), **options)
    # eps=1e-4 (typical gradients here: 3e-3): Adam divides by |gradient|, so an element
    # whose gradient cancels to ~1e-7 (2.attn.wo.weight[13, 7] on 16 rows) would turn
    # its summation-order difference (tp, dp) into a weight difference of up to lr.
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-4)
    refs = dict(ref.named_parameters())
    if data_parallel == "fsdp" and dp > 1:  # FSDP over TP: TP's shards sharded again over dp
        for name, p in pipe.named_parameters():
            tp_weight = name.split(".")[-2] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
            assert p.device_mesh.mesh_dim_names == (("dp", "tp") if tp_weight else ("dp",)), name
    dp_rank = mesh["dp"].get_local_rank() if "dp" in names else 0
    for step in range(STEPS):
        x, y = batch(step, ROWS * dp)
        part = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        loss = pipe.step(x[part], y[part])
        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        close(torch.as_tensor(float(loss)), ref_loss, f"{schedule} loss of step {step}")
        if clip is not None:
            norm = pd.clip_grad_norm_(pipe, clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            close(norm.to(ref_norm.dtype), ref_norm, f"{schedule} gradient norm of step {step}")
        names_seen = 0
        for name, p in pipe.named_parameters():
            if step == 0:
                close(p.grad, refs[name].grad, f"{schedule} step-0 gradient of {name}")
            names_seen += 1
        assert names_seen > 0
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        for name, p in pipe.named_parameters():
            close(p, refs[name], f"{schedule} weight {name} after step {step}")
    pipe.close()
    return pipe


def check_auto_mesh() -> None:
    """mesh="auto" with the plan: the planner chooses (pp, dp, tp) among the factorisations
    the plan splits evenly (16- and 32-wide layers: tp 1, 2 or 4), every rank builds that
    mesh, and the run trains as the unsplit model on the global batch (the sample: all
    2 * ROWS rows of a step; each dp rank feeds pipe.data_parallel_rank's part)."""
    import pipedream_ext as pd

    x, y = batch(0, 2 * ROWS)
    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, mesh="auto",
                        tensor_parallel=plan(), sample=(x, y), timeout=60)
    pp, dp, tp = pipe.configuration.mesh
    assert pp * dp * tp == 4 and pipe.data_parallel_size == dp, pipe.configuration.table()
    gathered: list = [None] * 4
    dist.all_gather_object(gathered, pipe.configuration.mesh)
    assert len(set(gathered)) == 1, gathered
    ref = llama()
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-4)
    rows = 2 * ROWS // dp
    part = slice(pipe.data_parallel_rank * rows, (pipe.data_parallel_rank + 1) * rows)
    for step in range(STEPS):
        x, y = batch(step, 2 * ROWS)
        loss = pipe.step(x[part], y[part])
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        close(torch.as_tensor(float(loss)), ref_loss, f"mesh {pipe.configuration.mesh} loss of step {step}")
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        close(p, refs[name], f"mesh {pipe.configuration.mesh} weight {name}")


def check_plan_shards() -> None:
    """The plan really shards: wq/wk/wv/w1/w3 are DTensors Shard(0) over the tp mesh,
    wo/w2 Shard(1), each rank holding half the rows (columns); the rest plain. Every tp
    rank starts from tp rank 0's weights; forward_only gives the unsplit model's output."""
    from torch.distributed.tensor import DTensor, Shard

    import pipedream_ext as pd

    mesh = mesh_of((2, 1, 2))
    shared = plan()
    settings = {k: dict(vars(style)) for k, style in shared.items()}
    # Each tp rank builds other weights: the pipeline starts from tp rank 0's (llama(0)).
    pipe = pd.PipeDream(llama(seed=mesh["tp"].get_local_rank()), lm_loss, schedule="1f1b",
                        microbatches=2, mesh=mesh, tensor_parallel=shared, balance=BALANCE, timeout=60)
    sharded = 0
    for name, p in pipe.named_parameters():
        leaf = name.split(".")[-2]
        if leaf in ("wq", "wk", "wv", "w1", "w3", "wo", "w2"):
            dim = 1 if leaf in ("wo", "w2") else 0
            assert isinstance(p, DTensor), name
            assert p.placements == (Shard(dim),), (name, p.placements)
            assert p.device_mesh.size() == 2 and p.device_mesh.mesh_dim_names == ("tp",), name
            assert p.to_local().shape[dim] * 2 == p.shape[dim], (name, p.to_local().shape)
            sharded += 1
        else:
            assert not isinstance(p, DTensor), name
    assert sharded == 7, sharded  # this rank's block
    x, _ = batch(0)
    out = pipe.forward_only(x)
    if pipe.is_last:
        with torch.no_grad():
            close(out, llama()(x), "forward_only's output")
    pipe.close()
    # One plan dict serves any number of pipelines: applying it leaves the user's styles as
    # they were (parallelize_module writes into the styles it applies, on the ranks whose
    # stages they match), so a second pipeline (another split) agrees on every rank.
    assert {k: dict(vars(style)) for k, style in shared.items()} == settings
    again = pd.PipeDream(llama(), lm_loss, schedule="gpipe", microbatches=2, mesh=mesh,
                         tensor_parallel=shared, balance=[3, 2], timeout=60)
    out = again.forward_only(x)
    if again.is_last:
        with torch.no_grad():
            close(out, llama()(x), "a second pipeline's forward_only output")
    again.close()


def check_stats_and_trace() -> None:
    """stats() counts this rank's own pipeline (its (dp, tp) coordinate's transfers: one
    replicated [rows/M, SEQ, DIM] activation or gradient per microbatch, never gathered
    over tp), and the merged Chrome trace has one track per rank of the mesh, each with
    its stage's F and B of every microbatch of every step."""
    import collections
    import json
    import tempfile

    import pipedream_ext as pd

    folder = [tempfile.mkdtemp(prefix="pd-tp-trace-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = os.path.join(folder[0], "run.json")
    mesh, micro = mesh_of((2, 1, 2)), 2
    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=micro, mesh=mesh,
                        tensor_parallel=plan(), balance=BALANCE, trace=path, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(STEPS):
        pipe.step(*batch(step))
        opt.step()
        opt.zero_grad()
    stats = pipe.stats()
    assert stats["steps"] == STEPS and stats["sends"] == stats["receives"] == STEPS * micro, stats
    # Only the activation crosses: its layout is metadata (tensor_parallel.LayoutExchange).
    data = STEPS * micro * (ROWS // micro) * SEQ * DIM * 4
    assert (stats["bytes_sent"], stats["bytes_received"]) == (data, data), stats
    pipe.write_trace()
    dist.barrier()
    if dist.get_rank() == 0:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        spans: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for e in events:
            if e["ph"] == "X" and e["name"][:1].isdigit():
                spans[e["pid"]][e["name"][1]] += 1  # "0F1": the kind
        assert sorted(spans) == [0, 1, 2, 3], sorted(spans)
        for r in range(4):
            assert spans[r]["F"] == spans[r]["B"] == STEPS * micro, (r, spans[r])
    pipe.close()


def check_refusals() -> None:
    """What tensor parallelism does not support yet is refused, naming it and the fix."""
    from test_bad_input import ROWS
    from torch.distributed.tensor.parallel import ColwiseParallel

    import pipedream_ext as pd

    def row(row_id: str) -> str:
        return next(r[2] for r in ROWS if r[0] == row_id)

    mesh = mesh_of((2, 1, 2))

    def build(make: Callable[[], nn.Module] = llama, **kwargs: Any) -> Any:
        options = dict(schedule="1f1b", microbatches=2, mesh=mesh, tensor_parallel=plan(), timeout=60)
        options.update(kwargs)
        return pd.PipeDream(make(), lm_loss, **options)

    bad_plan = {**plan(), "*.attn.wz": ColwiseParallel()}
    refused = [  # (row, what the message names, the model, the options)
        ("tp-plan-unmatched", "'*.attn.wz'", llama, dict(tensor_parallel=bad_plan)),
        ("tp-plan-type", "'colwise'", llama, dict(tensor_parallel={"*.attn.wq": "colwise"})),
        ("tp-plan-type", "tensor_parallel=3", llama, dict(tensor_parallel=3)),
        ("tp-unsupported", "schedule='pipedream-2bw'", llama, dict(schedule="pipedream-2bw")),
        ("tp-unsupported", "schedule='pipedream'", llama, dict(schedule="pipedream")),
        ("tp-mesh", "(mesh has ('pp', 'dp'))", llama, dict(mesh=mesh_of((2, 2), ("pp", "dp")))),
        ("tp-mesh", "'tp' dimension of size 2", llama, dict(tensor_parallel=None)),
        ("tp-mesh", "needs a mesh", llama, dict(mesh=None)),
    ]
    for row_id, names, make, kwargs in refused:
        with pytest.raises(ValueError, match=row(row_id)) as info:
            build(make, **kwargs)
        assert names in str(info.value), (names, str(info.value))
    # The plan is compared at construction: one rank's other style fails every rank.
    other = {**plan(), "*.attn.wo": ColwiseParallel()} if dist.get_rank() == 3 else plan()
    # Only the entry that differs is named, with its values per rank.
    with pytest.raises(ValueError, match=r"ranks disagree on the pipeline configuration: "
                                         r"tensor_parallel\['\*\.attn\.wo'\]\['style'\] is "
                                         r"\S*RowwiseParallel\S* on .*; \S*ColwiseParallel\S* on rank 3") as info:
        build(tensor_parallel=other, balance=BALANCE)
    assert "'*.attn.wq'" not in str(info.value), str(info.value)
    pipe = build()
    with pytest.raises(ValueError, match=row("tp-checkpoint")):
        pd.save_checkpoint(os.path.join(os.environ.get("TMPDIR", "/tmp"), "tp-ckpt"), pipe)
    x, y = batch(0)
    if mesh["tp"].get_local_rank() == 1:
        x = x.flip(0)
    with pytest.raises(ValueError, match=row("tp-batch")):
        pipe.step(x, y)
    pipe.close()


def check_later_batches() -> None:
    """After the first check_agreement steps, a step whose tp ranks were given different
    batches fails on every rank when its loss is read (the loss all-reduce carries each
    pipeline's batch fingerprint), naming the step and the tp ranks' pipelines."""
    from test_bad_input import ROWS

    import pipedream_ext as pd
    from pipedream_ext._runtime.mesh_steps import StepMismatch

    mesh = mesh_of((2, 1, 2))
    pipe = pd.PipeDream(llama(), lm_loss, schedule="1f1b", microbatches=2, mesh=mesh, timeout=60,
                        balance=BALANCE, tensor_parallel=plan(), check_agreement=1)
    float(pipe.step(*batch(0)))  # checked by the agreement of the first step
    float(pipe.step(*batch(1)))  # the same batch everywhere: passes the per-step check
    x, y = batch(2)
    if mesh["tp"].get_local_rank() == 1:
        x = x.flip(0)  # as many rows, other samples: only a fingerprint tells
    loss = pipe.step(x, y)
    row = next(r[2] for r in ROWS if r[0] == "tp-batch-later")
    with pytest.raises(StepMismatch, match=row) as info:
        float(loss)
    assert "step() number 2:" in str(info.value), str(info.value)
    pipe.close()


def _row(row_id: str) -> str:
    from test_bad_input import ROWS

    return next(r[2] for r in ROWS if r[0] == row_id)


def _build(model: nn.Module, tensor_parallel: Any, timeout: float = 60, balance: Any = BALANCE) -> Any:
    import pipedream_ext as pd

    return pd.PipeDream(model, lm_loss, schedule="1f1b", microbatches=2, mesh=mesh_of((2, 1, 2)),
                        timeout=timeout, tensor_parallel=tensor_parallel, balance=balance)


def check_uneven_shards() -> None:
    """A plan that shards a dimension tp does not divide is refused at construction on
    every rank, naming the parameter, the dimension, its size and tp (torch's sharding
    propagation failed on some ranks at the first step, their peers on a closed
    connection)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    uneven = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 7), nn.ReLU(), nn.Linear(7, VOCAB))
    with pytest.raises(ValueError, match=_row("tp-uneven")) as info:
        _build(uneven, {"1": ColwiseParallel(), "3": RowwiseParallel()}, balance=[2, 2])
    assert "'1.weight' (shape [7, 16]) on dim 0, of size 7, over tp=2" in str(info.value), str(info.value)


def check_plan_raises() -> None:
    """A callable plan that raises on one rank fails every rank at construction, naming
    the rank and the exception: raised after its collectives, and before them (its tp
    peer waits in the plan's scatter until timeout=, then every rank fails)."""
    rank = dist.get_rank()

    def raises_after(stage: nn.Module, tp_mesh: Any) -> None:
        parallelize_blocks(stage, tp_mesh)
        if rank == 3:
            raise RuntimeError("plan failed on purpose")

    def raises_before(stage: nn.Module, tp_mesh: Any) -> None:
        if rank == 3:
            raise RuntimeError("plan failed on purpose")
        parallelize_blocks(stage, tp_mesh)

    for fn, timeout in ((raises_after, 60), (raises_before, 3)):
        with pytest.raises(RuntimeError, match=_row("tp-plan-failed")) as info:
            _build(llama(), fn, timeout=timeout)
        assert "3 (pp 1, dp 0, tp 1): RuntimeError" in str(info.value), str(info.value)
        assert "RuntimeError: plan failed on purpose" in str(info.value), str(info.value)


def check_plan_differs() -> None:
    """A callable plan that splits a stage differently on one rank (wo column-wise
    there: as many bytes in the scatter, so nothing fails on its own) is refused at
    construction on every rank, naming the tensor, both placements and ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    rank = dist.get_rank()

    def differs(stage: nn.Module, tp_mesh: Any) -> None:
        if rank != 3:
            return parallelize_blocks(stage, tp_mesh)
        swapped = {k.removeprefix("*."): v for k, v in plan().items()}
        swapped["attn.wo"] = ColwiseParallel()
        for child in stage.children():
            if isinstance(child, Block):
                parallelize_module(child, tp_mesh, swapped)

    with pytest.raises(ValueError, match=_row("tp-plan-differs")) as info:
        _build(llama(), differs)
    text = str(info.value)
    assert "'2.attn.wo.weight' is (Shard(dim=1),) over mesh ('tp',) on rank 2" in text, text
    assert "(Shard(dim=0),) over mesh ('tp',) on rank 3" in text, text


def cases(world: int) -> Cases:
    c = Cases()
    c.add(check_plan_shards)
    c.add(check_training, "1f1b")
    c.add(check_training, "zb-h1")
    c.add(check_training, "gpipe", clip=0.05)
    c.add(check_training, "interleaved-1f1b", chunks=2)
    c.add(check_training, "zbv", chunks=2, clip=0.05)
    c.add(check_training, "dualpipev", chunks=2, microbatches=4)
    c.add(check_training, "interleaved-zb", chunks=2)
    c.add(check_training, "1f1b", tensor_parallel=lambda: parallelize_blocks, name="training-callable")
    c.add(check_training, "1f1b", shape=(2, 2), names=("pp", "tp"), name="training-pp-tp-mesh")
    c.add(check_training, "1f1b", shape=(1, 2, 2), clip=0.05, name="training-dp2-replicate")
    c.add(check_training, "zb-h1", shape=(2, 2, 1), clip=0.05, name="training-dp2-tp1-replicate")
    c.add(check_training, "1f1b", shape=(1, 2, 2), clip=0.05, data_parallel="fsdp",
          name="training-dp2-fsdp")
    c.add(check_training, "zb-h1", shape=(1, 2, 2), data_parallel="fsdp", name="training-zb-h1-dp2-fsdp")
    c.add(check_stats_and_trace, name="stats-and-trace")
    c.add(check_auto_mesh, name="auto-mesh")
    c.add(check_refusals)
    c.add(check_later_batches)
    c.add(check_uneven_shards)
    c.add(check_plan_differs)
    c.add(check_plan_raises)  # last: its tp peers time out in the plan's collective
    return c


def mesh_3d_cases(world: int) -> Cases:
    c = Cases()
    c.add(check_training, "1f1b", shape=(2, 2, 2), clip=0.05, name="training-pp2-dp2-tp2")
    c.add(check_training, "zb-h1", shape=(2, 2, 2), name="training-zb-h1-pp2-dp2-tp2")
    c.add(check_training, "1f1b", shape=(2, 2, 2), clip=0.05, data_parallel="fsdp",
          name="training-pp2-dp2-tp2-fsdp")
    c.add(check_training, "zbv", shape=(2, 2, 2), chunks=2, data_parallel="fsdp",
          name="training-zbv-pp2-dp2-tp2-fsdp")
    return c


# `make test` runs pp2 x tp2 under NCCL's rules (every group the mesh and the pipeline
# create on nccl_rules), `make test-all` on Gloo too.
LAUNCHES = strict_and_gloo(HERE, 4, cases, timeout=300)
MESH_3D = Launch(HERE, 8, mesh_3d_cases, name="8ranks", timeout=300, marks=(pytest.mark.slow,))


@parametrize_cases(*LAUNCHES)
def test_tensor_parallel_matches_the_unsplit_model(case: CaseRef) -> None:
    case.check()


@pytest.mark.slow
@parametrize_cases(MESH_3D)
def test_tensor_parallel_on_a_pp2_dp2_tp2_mesh(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([*LAUNCHES, MESH_3D])
