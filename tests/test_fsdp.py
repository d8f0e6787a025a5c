"""Pipeline + FSDP2 (2D): ``PipeDream(mesh=("pp", "dp"), data_parallel="fsdp"|"replicate")``.

Runs under pytest, which launches the worker side with torchrun on 4 ranks, or
standalone (``PIPEDREAM_TEST_LAUNCH`` picks the configurations: ``fast``, ``full`` or
``clip``, the full set's clipping cases; ``fast`` needs ``FSDP_CKPT_DIR``):

    PIPEDREAM_TEST_LAUNCH=full torchrun --standalone --nproc-per-node 4 tests/test_fsdp.py

Every configuration trains the pipeline, each dp rank on its part of the global batch,
next to the unsplit model trained on the whole global batch, and compares every step's
loss and every weight (the sharded ones gathered) after SGD-momentum or AdamW steps;
with ``"fsdp"`` it also counts the reduce-scatters (one per FSDP unit per step: the
gradient sync waits for each stage's last backward). Configurations cover a weight
tied across stages, traced stages (``split_points``) and ``recompute=True``. One launch runs many
configurations (a worker loops over them).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_shared_params as shared
from _multiprocess import CaseRef, Cases, Launch, id_part, parametrize_cases, worker_main

RTOL, ATOL = 1e-5, 1e-6
HERE = os.path.abspath(__file__)
WIDTH, CLASSES, LAYERS, BATCH, STEPS = 8, 4, 8, 16, 3
CKPT_ENV = "FSDP_CKPT_DIR"  # where the fast launch saves a DCP checkpoint (unset: no check)
CLIP_SMALL, INF = 0.05, float("inf")  # every step clips

OPTIMIZERS: Dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}


class Case(NamedTuple):
    schedule: str
    pp: int
    dp: int
    optimizer: str = "adamw"
    data_parallel: str = "fsdp"
    reshard_after_forward: bool = False
    meta: bool = False
    loss_reduction: str = "mean"
    mixed_precision: bool = False
    clip: Optional[Tuple[float, float]] = None  # (max_norm, norm_type): pd.clip_grad_norm_
    tied: bool = False
    traced: bool = False
    recompute: bool = False
    lm: bool = False  # test_shared_params' language model: embedding tied to the head
    order: Optional[Tuple[Tuple[int, ...], ...]] = None  # the mesh tensor (None: ascending)


# --------------------------------------------------------------------------- the model
class Scaled(nn.Module):
    """``x @ (weight * scale).T``: the weight's gradient reads ``scale``, so a W pass on
    resharded (freed) parameters would read freed memory."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(WIDTH, WIDTH))
        self.scale = nn.Parameter(torch.empty(WIDTH, 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.3)
        nn.init.uniform_(self.scale, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * self.scale).T


def mlp(seed: int = 0) -> nn.Sequential:
    """LAYERS layers: Linear+Tanh blocks (one a Scaled+Tanh), a ReLU (no parameters), a head."""
    torch.manual_seed(seed)
    blocks: List[nn.Module] = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                               for _ in range(LAYERS - 2)]
    blocks[3] = nn.Sequential(Scaled(), nn.Tanh())
    blocks.insert(2, nn.ReLU())
    return nn.Sequential(*blocks, nn.Linear(WIDTH, CLASSES))


def global_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def sum_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="sum")


class ReduceScatterCounter:
    """Counts FSDP2's gradient reductions: calls of ``torch.distributed.reduce_scatter_single``
    (what torch 2.13's FSDP calls) and ``reduce_scatter_tensor`` (earlier versions)."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.count = 0
        self._originals = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self) -> "ReduceScatterCounter":
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(original))
        return self

    def _counted(self, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *_: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def full(t: torch.Tensor) -> torch.Tensor:
    """A weight gathered over dp (a sharded DTensor), else itself. Collective on dp."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------------- one configuration
def build(case: Case, mesh: Any):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import pipedream_ext as pd

    chunks = 2 if pd.schedules.traits(case.schedule).multi_chunk else 1
    microbatches = 2 * case.pp if case.schedule == "dualpipev" else 4
    make = shared.tied_lm if case.lm else tied_mlp if case.tied else mlp
    if case.meta:
        with torch.device("meta"):
            model = make()
        with torch.device("meta"):
            ref = make()
        pd.materialize(ref, seed=0)
    else:
        model, ref = make(), make()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if case.mixed_precision else None
    loss_fn = shared.lm_loss if case.lm else sum_loss if case.loss_reduction == "sum" \
        else F.cross_entropy
    traced: Dict[str, Any] = {}
    if case.traced:  # the same layers, cut on the traced graph (GraphModule stages)
        x, y = global_batch(0)
        traced = dict(split_points=["4"] if chunks * case.pp == 2 else ["2", "4", "6"],
                      sample=(x[:4], y[:4]))
    pipe = pd.PipeDream(model, loss_fn, schedule=case.schedule, microbatches=microbatches,
                        chunks=chunks, timeout=60, loss_reduction=case.loss_reduction, **traced,
                        recompute=case.recompute,
                        mesh=mesh, data_parallel=case.data_parallel,
                        reshard_after_forward=case.reshard_after_forward, mp_policy=policy)
    return pipe, ref, loss_fn


def check_clip(case: Case, pipe: Any, ref: nn.Module, step: int) -> None:
    """``pd.clip_grad_norm_`` over pp x dp returns (every rank) and applies torch's
    norm of the unsplit model's gradients on the global batch."""
    import pipedream_ext as pd

    max_norm, norm_type = case.clip  # type: ignore[misc]
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    assert expected > max_norm, f"{case}: the reference norm {expected} does not clip"
    norm = pd.clip_grad_norm_(pipe, max_norm, norm_type)
    assert norm.dtype == expected.dtype and norm.dim() == 0, (case, norm)
    torch.testing.assert_close(norm, expected, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{case} step {step} norm: {m}")


def make_mesh(pp: int, dp: int, order: Optional[Tuple[Tuple[int, ...], ...]] = None) -> Any:
    """``init_device_mesh("cpu", (pp, dp))``, or a mesh of the ranks in ``order``."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if order is None:
        return init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    return DeviceMesh("cpu", torch.tensor(order), mesh_dim_names=("pp", "dp"))


def check_case(case: Case) -> None:
    """STEPS steps of the 2D pipeline equal the unsplit model on the global batch."""
    mesh = make_mesh(case.pp, case.dp, case.order)
    pipe, ref, loss_fn = build(case, mesh)
    dp_rank, rows = mesh["dp"].get_local_rank(), BATCH // case.dp
    params = list(pipe.parameters())  # a stage of one ReLU has none (torch refuses that)
    opt = OPTIMIZERS[case.optimizer](params) if params else None
    ref_opt = OPTIMIZERS[case.optimizer](ref.parameters())
    rtol, atol = (2e-2, 2e-2) if case.mixed_precision else (RTOL, ATOL)
    with ReduceScatterCounter() as counter:
        for step in range(STEPS):
            x, y = shared.batch(100 + step, BATCH) if case.lm else global_batch(100 + step)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            part = slice(dp_rank * rows, (dp_rank + 1) * rows)
            loss = float(pipe.step(x[part] if pipe.is_first else None,
                                   y[part] if pipe.is_last else None))
            assert abs(loss - ref_loss.item()) <= rtol * max(1.0, abs(ref_loss.item())), \
                f"{case} step {step}: loss {loss} != {ref_loss.item()}"
            if case.clip is not None:
                check_clip(case, pipe, ref, step)
            ref_opt.step(); ref_opt.zero_grad()
            if opt is not None:
                opt.step(); opt.zero_grad()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # a tie: every name
    # Adam divides by the root of the squared gradients: where those are tiny, a last-bit
    # difference in the summation order (a tie's two stages, the dp reduction) moves a
    # weight by up to ~1e-6 of lr 0.01 (seen on AVX-512 machines, main included).
    weight_atol = max(atol, 1e-5) if case.optimizer == "adamw" else atol
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full(p.detach()).float(), ref_params[name].detach(),
                                   rtol=rtol, atol=weight_atol, msg=lambda m: f"{case} weight {name}: {m}")
    if case.data_parallel == "fsdp" and case.dp > 1 and case.traced:
        groups = fsdp_param_groups(pipe)
        assert pipe._runner.data_parallel.units > 0, f"{case}: no submodule sharded on its own"
        assert counter.count == groups * STEPS, \
            f"{case}: {counter.count} reduce-scatters in {STEPS} steps, expected {groups * STEPS}"
    elif case.data_parallel == "fsdp" and case.dp > 1:
        # One FSDP unit per layer with parameters on this rank.
        units = sum(1 for start, stop in pipe.stage_layers.values() for layer in range(start, stop)
                    if any(True for _ in ref[layer].parameters()))
        assert counter.count == units * STEPS, \
            f"{case}: {counter.count} reduce-scatters in {STEPS} steps, expected {units * STEPS}"


def fsdp_param_groups(pipe: Any) -> int:
    """How many FSDP parameter groups (one reduce-scatter each per step) this rank's
    stages have: a traced stage's units and its root's own parameters."""
    from torch.distributed.fsdp import fully_shard

    count = 0
    for root in pipe._runner.data_parallel._roots():
        for state in fully_shard.state(root)._state_ctx.all_states:
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            count += len(groups)
    return count


FLUSH = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-zb"]


def cases(kind: str) -> List[Case]:
    if kind == "clip":  # the full set's clipping cases only (standalone runs)
        return [c for c in cases("full") if c.clip is not None]
    if kind == "fast":
        return [Case("zb-h1", 2, 2, tied=True), Case("1f1b", 2, 2, data_parallel="replicate",
                                                     clip=(CLIP_SMALL, INF)),
                Case("zb-h1", 2, 2, clip=(CLIP_SMALL, 2.0)),
                # a tied parameter's FSDP shards: counted in the norm on its first use's stage only
                Case("1f1b", 2, 2, tied=True, clip=(CLIP_SMALL, 2.0)),
                # pp ranks not ascending: stage 0 on pp rank 0 (ranks 0 and 1), as torch numbers it
                Case("1f1b", 2, 2, "sgd", order=((2, 3), (0, 1)))]
    full_cases = [Case(s, 2, 2, opt, reshard_after_forward=r)
                  for s in FLUSH for opt in OPTIMIZERS for r in (False, True)]
    full_cases += [Case(s, 2, 2, "adamw", "replicate") for s in ("1f1b", "zb-h1", "zbv")]
    full_cases += [Case(s, 1, 4) for s in ("1f1b", "zb-h1")]
    full_cases += [Case(s, 4, 1) for s in ("1f1b", "zb-h1", "zbv")]
    full_cases += [Case("zb-h1", 2, 2, meta=True), Case("zbv", 2, 2, meta=True,
                                                        reshard_after_forward=True),
                   Case("zb-h1", 2, 2, "sgd", loss_reduction="sum"),
                   Case("1f1b", 2, 2, "sgd", "replicate", loss_reduction="sum"),
                   Case("zb-h1", 2, 2, "sgd", mixed_precision=True)]
    full_cases += [Case(s, 2, 2, "adamw", dp_mode, clip=(CLIP_SMALL, p)) for s in ("1f1b", "zb-h1")
                   for dp_mode in ("fsdp", "replicate") for p in (2.0, INF)]
    full_cases += [Case("zbv", 2, 2, "sgd", clip=(CLIP_SMALL, 1.0), reshard_after_forward=True),
                   Case("1f1b", 1, 4, clip=(CLIP_SMALL, INF)), Case("zb-h1", 4, 1, clip=(CLIP_SMALL, 2.0))]
    # A weight tied across stages (layers 0 and 6): its copies' gradients summed.
    full_cases += [Case(s, 2, 2, opt, reshard_after_forward=r, tied=True)
                   for s in ("1f1b", "interleaved-1f1b") for opt in OPTIMIZERS
                   for r in (False, True)]
    full_cases += [Case(s, 2, 2, "adamw", "replicate", tied=True)
                   for s in ("1f1b", "zbv", "interleaved-zb")]
    full_cases += [Case("zb-h1", 2, 2, meta=True, tied=True),
                   Case("zb-h1", 2, 2, "sgd", loss_reduction="sum", tied=True),
                   Case("1f1b", 4, 1, tied=True), Case("1f1b", 4, 1, "adamw", "replicate",
                                                       tied=True)]
    # split_points: the stages are GraphModules; called modules are units, the rest roots.
    full_cases += [Case(s, 2, 2, opt, reshard_after_forward=r, traced=True)
                   for s in ("1f1b", "zb-h1", "interleaved-1f1b") for opt in OPTIMIZERS
                   for r in (False, True)]
    full_cases += [Case("zbv", 2, 2, "adamw", "replicate", traced=True),
                   Case("1f1b", 2, 2, "sgd", loss_reduction="sum", traced=True),
                   Case("1f1b", 2, 2, "adamw", tied=True, traced=True),
                   Case("zb-h1", 4, 1, traced=True)]
    # recompute=True: the recomputed forward gathers the weights again.
    full_cases += [Case(s, 2, 2, opt, reshard_after_forward=r, recompute=True)
                   for s in FLUSH for opt in OPTIMIZERS for r in (False, True)]
    full_cases += [Case("1f1b", 2, 2, "adamw", "replicate", recompute=True),
                   Case("zb-h1", 2, 2, "sgd", loss_reduction="sum", recompute=True),
                   Case("1f1b", 2, 2, "adamw", tied=True, traced=True, recompute=True),
                   Case("zb-h1", 2, 2, "sgd", mixed_precision=True, recompute=True)]
    # A GPT-like model: the embedding (stage 0) and the head (stage 1) share a weight.
    full_cases += [Case(s, 2, 2, "adamw", dp_mode, reshard_after_forward=r, lm=True)
                   for s in ("1f1b", "zb-h1") for dp_mode in ("fsdp", "replicate")
                   for r in (False, True) if dp_mode == "fsdp" or not r]
    return full_cases


# --------------------------------------------------------------------------- refusals
def tied_mlp(seed: int = 0) -> nn.Sequential:
    """mlp() with the last block's Linear tied to the first's (stages 0 and 1 on pp 2)."""
    model = mlp(seed)
    model[LAYERS - 2][0].weight = model[0][0].weight
    return model


def check_refusals() -> None:
    """What a mesh does not take is refused on every rank, naming the value and the fix."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipedream_ext as pd

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    x, y = global_batch(0)
    refused = [
        ("schedule 'pipedream' updates weights inside the pipeline, but mesh=",
         mlp, dict(schedule="pipedream")),
        ("schedule 'pipedream-2bw' updates weights inside the pipeline, but mesh=",
         mlp, dict(schedule="pipedream-2bw")),
        (r"replicas=\[1, 1\] and mesh= both ask for data parallelism; drop replicas",
         mlp, dict(replicas=[1, 1])),
        ("process_group= and mesh= both name the pipeline's ranks",
         mlp, dict(process_group=dist.group.WORLD)),
        ("data_parallel='ddp'; use 'fsdp'", mlp, dict(data_parallel="ddp")),
        (r"mesh has dimensions \('dp',\); PipeDream takes a 2-D mesh", mlp, dict(mesh=flat)),
        (r"parameter 0.0.weight = 6.0.weight is used by layer 0 and layer 6, which "
         r"data_parallel='fsdp' would shard as separate units on ranks 0 \(pp 0, dp 0\), 1 "
         r"\(pp 0, dp 1\), untying",
         tied_mlp, dict(schedule="zbv", chunks=2)),
    ]
    for match, make, kwargs in refused:
        kwargs = {"mesh": mesh, **kwargs}
        with pytest.raises(ValueError, match=match):
            pd.PipeDream(make(), F.cross_entropy, microbatches=4, timeout=60, **kwargs)
    with pytest.raises(ValueError, match="mp_policy and reshard_after_forward configure FSDP"):
        pd.PipeDream(mlp(), F.cross_entropy, reshard_after_forward=True, timeout=60)
    pipe = pd.PipeDream(mlp(), F.cross_entropy, schedule="1f1b", microbatches=4, mesh=mesh,
                        timeout=60)
    with pytest.raises(ValueError, match="batch size 6, which does not split into "
                                         "microbatches=4"):
        pipe.step(x[:6] if pipe.is_first else None, y[:6] if pipe.is_last else None)
    from test_bad_input import ROWS

    with pytest.raises(ValueError, match=next(r[2] for r in ROWS if r[0] == "mesh-checkpoint")):
        pd.save_checkpoint(os.path.join(os.environ.get("TMPDIR", "/tmp"), "fsdp-ckpt"), pipe)
    other = mlp(seed=3)  # load_state_dict: each dp rank takes its FSDP shards
    pipe.load_state_dict(other.state_dict())
    for name, p in pipe.named_parameters():
        assert torch.equal(full(p.detach()), other.state_dict()[name]), name


def check_mesh_errors() -> None:
    """A refusal on one pipeline reaches every rank with its reason; messages name global
    ranks with their mesh coordinates (mesh [[0, 1], [2, 3]]: pipeline dp 0 is ranks 0 and
    2); the sampler advice names the dp size; a mesh whose rank order gives no stage order,
    and balance="auto" with fewer layers than pipeline stages, are refused by name."""
    import pipedream_ext as pd

    mesh = make_mesh(2, 2)
    x, y = global_batch(0)
    rank = dist.get_rank()
    # Only pipeline dp 0's ranks disagree among themselves; dp 1's learn why too.
    with pytest.raises(ValueError, match=r"rank 0 \(pp 0, dp 0\): ranks disagree on the pipeline "
                       r"configuration: microbatches is 2 on rank 0 \(pp 0, dp 0\); 4 on ranks "
                       r"1 \(pp 0, dp 1\), 2 \(pp 1, dp 0\), 3 \(pp 1, dp 1\)" if rank == 0 else
                       r"microbatches is 2 on rank 0 \(pp 0, dp 0\); 4 on ranks 1 \(pp 0, dp 1\)"):
        pd.PipeDream(mlp(), F.cross_entropy, microbatches=2 if rank == 0 else 4, mesh=mesh,
                     timeout=60)
    pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=4, mesh=mesh, timeout=60)
    dp, rows = mesh["dp"].get_local_rank(), BATCH // 2
    part = slice(dp * rows, (dp + 1) * rows)
    with pytest.raises(ValueError, match=r"rank 3 \(pp 1, dp 1\) holds the last stage: step\(\) "
                                         "needs the targets"):
        pipe.step(x[part] if pipe.is_first else None,
                  y[part] if pipe.is_last and rank != 3 else None)
    other = torch.roll(y[part], 1) if rank == 3 else y[part]
    with pytest.raises(ValueError, match=r"stage 0 on rank 1 \(pp 0, dp 1\) and the last stage on "
                       r"rank 3 \(pp 1, dp 1\) were given different batches .*num_replicas=2, "
                       r"rank=mesh\['dp'\].get_local_rank\(\)"):
        pipe.step(x[part], other)  # the whole batch on every rank: they are compared
    per_row = pd.PipeDream(mlp(), lambda out, t: F.cross_entropy(out, t, reduction="none"),
                           microbatches=4, mesh=mesh, timeout=60)
    with pytest.raises(ValueError, match=r"step\(\) number 0 failed on ranks 2 \(pp 1, dp 0\), 3 "
                                         r"\(pp 1, dp 1\): loss_fn returned a tensor of shape \(2,\)"):
        per_row.step(x[part] if per_row.is_first else None, y[part] if per_row.is_last else None)
    with pytest.raises(ValueError, match=r"mesh \[\[0, 3\], \[2, 1\]\] cannot run a pipeline: "
                                         r".*in the dp group \[0, 3\] rank 0 is pp rank 0, rank 3 "
                                         "is pp rank 1"):
        pd.PipeDream(mlp(), F.cross_entropy, microbatches=4, mesh=make_mesh(2, 2, ((0, 3), (2, 1))),
                     timeout=60)
    few = nn.Sequential(*list(mlp())[:3])
    with pytest.raises(ValueError, match=r"balance='auto' on a mesh with 4 pipeline stages \(mesh\['pp'\]"
                                         r"\) needs at least one layer per stage, but the model has 3"):
        pd.PipeDream(few, F.cross_entropy, microbatches=4, mesh=make_mesh(4, 1), balance="auto",
                     sample=(x, y), timeout=60)


def check_dp_batches_and_steps() -> None:
    """dp ranks given batches of different sizes are refused (before the step in the
    first steps, after it later, naming each dp rank's rows); a step() refused on one
    pipeline in the first steps is refused on every rank, so a loop that catches it and
    goes on stays exact; a later step() skipped by one rank is named at the next read."""
    import pipedream_ext as pd

    mesh = make_mesh(2, 2)
    rank, dp, rows = dist.get_rank(), mesh["dp"].get_local_rank(), BATCH // 2
    part = slice(dp * rows, (dp + 1) * rows)
    short = slice(dp * rows, dp * rows + (rows if dp == 0 else rows // 2))  # 8 and 4 rows
    sizes = r"dp 0 \(rank 0 \(pp 0, dp 0\)\) 8 rows, dp 1 \(rank 1 \(pp 0, dp 1\)\) 4 rows"
    x, y = global_batch(0)
    for check in (3, 0):
        pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=4, mesh=mesh, timeout=60,
                            check_agreement=check)
        with pytest.raises(ValueError if check else RuntimeError, match=sizes):
            float(pipe.step(x[short] if pipe.is_first else None, y[short] if pipe.is_last else None))
    pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=4, mesh=mesh, timeout=60)
    ref = mlp()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pipe, ref))
    for step in range(3):
        x, y = global_batch(300 + step)
        if step == 1:  # dp 1's inputs do not split into 4 microbatches: every rank refuses
            bad = x[part][:6] if dp == 1 else x[part]
            with pytest.raises(ValueError, match="rank 1 .pp 0, dp 1.: inputs of this data-parallel "
                                                 "rank have batch size 6"):
                pipe.step(bad if pipe.is_first else None, y[part] if pipe.is_last else None)
            continue
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        loss = float(pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None))
        assert abs(loss - ref_loss.item()) <= RTOL * max(1.0, ref_loss.item()), (step, loss, ref_loss)
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    skipped = (r"in different step\(\) calls: ranks 0 \(pp 0, dp 0\), 2 \(pp 1, dp 0\), 3 "
               r"\(pp 1, dp 1\) in step\(\) number 1; rank 1 \(pp 0, dp 1\) in step\(\) number 2")
    for read in (True, False):  # named when the loss is read, else two steps later
        pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=4, mesh=mesh, timeout=60,
                            check_agreement=0)
        for step in range(5):
            x, y = global_batch(400 + step)
            if step == 1 and rank == 1:  # refused on this rank alone (no agreement), caught, skipped
                with pytest.raises(ValueError, match="batch size 6"):
                    pipe.step(x[part][:6], None)
                continue
            if step == (4 if rank == 1 else 3) and not read:
                with pytest.raises(RuntimeError, match=skipped):
                    pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None)
                break
            loss = pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None)
            if step == 0 or not read:
                continue
            with pytest.raises(RuntimeError, match=skipped):
                float(loss)
            break


def check_grad_scaler_skips_on_every_pipeline() -> None:
    """With FSDP each dp rank holds other shards of the gradients, so an inf in one shard
    must skip the step on every pipeline of the mesh (the unsplit model would skip it).
    ``pipe.grad_scaler()`` all-reduces over its pipeline; the dp ranks agree because its
    inf check on DTensor gradients reduces over the dp mesh (torch's DTensor rule)."""
    import pipedream_ext as pd

    mesh = make_mesh(2, 2)
    dp, rows = mesh["dp"].get_local_rank(), BATCH // 2
    pipe = pd.PipeDream(mlp(), F.cross_entropy, microbatches=4, mesh=mesh, timeout=60)
    scaler = pipe.grad_scaler(init_scale=16.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = global_batch(500)
    part = slice(dp * rows, (dp + 1) * rows)
    pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None)
    before = {name: full(p.detach()).clone() for name, p in pipe.named_parameters()}
    if dist.get_rank() == 0:  # one shard of one rank of one pipeline overflows
        grad = next(p.grad for p in pipe.parameters() if p.grad.to_local().numel() > 0)
        grad.to_local().fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0, f"rank {dist.get_rank()}: scale {scaler.get_scale()}"
    for name, p in pipe.named_parameters():
        assert torch.equal(full(p.detach()), before[name]), f"rank {dist.get_rank()}: {name} stepped"


def check_auto_plan() -> None:
    """``balance="auto"`` with a mesh plans the pp dimension (dp ranks per stage, memory
    per rank sharded), the same plan on every rank, and the pipeline it cuts trains; a
    plan of a traced model is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipedream_ext as pd

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    x, y = global_batch(0)
    half = BATCH // 2  # the sample is one dp rank's batch
    pipe = pd.PipeDream(mlp(), F.cross_entropy, schedule="1f1b", microbatches=4, mesh=mesh,
                        balance="auto", sample=(x[:half], y[:half]), timeout=60)
    assert (pipe.plan.data_parallel, pipe.plan.sharding) == (2, "fsdp"), pipe.plan
    assert len(pipe.balance) == 2 and sum(pipe.balance) == LAYERS and pipe.replicas == [1, 1], \
        (pipe.balance, pipe.replicas)
    loss = pipe.step(x[:half] if pipe.is_first else None, y[:half] if pipe.is_last else None)
    assert torch.isfinite(torch.as_tensor(float(loss))), loss
    with pytest.raises(ValueError, match="a plan of a traced model .*with mesh= .* is not supported"):
        pd.PipeDream(_Wrapped(), F.cross_entropy, microbatches=4, mesh=mesh, balance="auto", sample=(x, y),
                     timeout=60)


class _Wrapped(nn.Module):
    """An MLP that is not an nn.Sequential (traced for a plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


# --------------------------------------------------------------------------- mesh="auto"
def wide(seed: int = 0) -> nn.Sequential:
    """Three layers, the middle one most of the weights (66 KB): with AdamW the planner
    predicts more than 400 KB for a rank holding it replicated, at most 224 KB as FSDP's
    shard over dp 2 or 4."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(nn.Linear(WIDTH, 128), nn.Tanh()),
                         nn.Sequential(nn.Linear(128, 128), nn.Tanh()), nn.Linear(128, CLASSES))


def train_like_unsplit(pipe: Any, ref: nn.Module, optimizer: str, what: str) -> None:
    """STEPS steps, each dp rank feeding ``pipe.data_parallel_rank``'s rows of the global
    batch: every loss, and every weight after the steps, equal the unsplit model's."""
    dp, rows = pipe.data_parallel_rank, BATCH // pipe.data_parallel_size
    params = list(pipe.parameters())
    opt = OPTIMIZERS[optimizer](params) if params else None
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    part = slice(dp * rows, (dp + 1) * rows)
    for step in range(STEPS):
        x, y = global_batch(100 + step)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        loss = float(pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None))
        assert abs(loss - ref_loss.item()) <= RTOL * max(1.0, abs(ref_loss.item())), \
            f"{what} step {step}: loss {loss} != {ref_loss.item()}"
        ref_opt.step(); ref_opt.zero_grad()
        if opt is not None:
            opt.step(); opt.zero_grad()
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full(p.detach()), expected[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} weight {name}: {m}")


def same_everywhere(text: str) -> bool:
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, text)
    return len(set(gathered)) == 1


def check_auto_mesh() -> None:
    """mesh="auto" (the sample: one step's batch of the whole run) builds the (pp, dp, tp)
    its configuration names, the same on every rank; each dp rank feeds
    ``pipe.data_parallel_rank``'s rows and the run trains as the unsplit model on the
    global batch (SGD-momentum); the plan file with mesh="auto" builds it again. A choice
    of (4, 1, 1) runs without a mesh (AdamW)."""
    import pipedream_ext as pd

    x, y = global_batch(0)
    pipe = pd.PipeDream(mlp(), F.cross_entropy, schedule="auto", microbatches="auto", mesh="auto",
                        sample=(x, y), timeout=60)
    chosen = pipe.configuration
    pp, dp, tp = chosen.mesh
    assert same_everywhere(json.dumps(chosen.to_dict(), sort_keys=True)), "ranks chose differently"
    assert pp * dp * tp == 4 and tp == 1 and pipe.data_parallel_size == dp, chosen.table()
    assert pipe.num_stages == len(chosen.balance) == pp * chosen.chunks, chosen.table()
    assert chosen.data_parallel == ("fsdp" if dp > 1 else None), chosen.table()  # the default
    assert (BATCH // dp) % pipe.microbatches == 0, chosen.table()
    gathered: List[Any] = [None] * 4
    dist.all_gather_object(gathered, pipe.data_parallel_rank)
    assert sorted(gathered) == sorted(list(range(dp)) * pp), gathered
    train_like_unsplit(pipe, mlp(), "sgd", f"mesh='auto' {chosen.mesh}")
    path = os.path.join(os.environ[CKPT_ENV], "auto-mesh-plan.json")
    if dist.get_rank() == 0:
        pipe.plan.save(path)
    dist.barrier()
    again = pd.PipeDream(mlp(), F.cross_entropy, balance=path, mesh="auto", timeout=60)
    assert again.configuration.to_dict() == chosen.to_dict()
    assert (again.data_parallel_size, again.balance, again.microbatches) == \
        (dp, pipe.balance, pipe.microbatches)
    # Four stages fixed: only (4, 1, 1) can run them, without a mesh, any microbatch count.
    plain = pd.PipeDream(mlp(), F.cross_entropy, schedule="1f1b", microbatches=3, balance=[2] * 4,
                         mesh="auto", sample=(x, y), timeout=60)
    assert plain.configuration.mesh == (4, 1, 1) and plain.configuration.data_parallel is None
    assert plain.data_parallel_size == 1 and not plain._dims.on_mesh
    train_like_unsplit(plain, mlp(), "adamw", "mesh='auto' (4, 1, 1)")


def check_auto_data_parallel() -> None:
    """data_parallel="auto" with memory= only FSDP's shards fit (:func:`wide`): fsdp on
    the mesh mesh="auto" chose (dp 2 or 4), trained as the unsplit model (AdamW); on a
    given mesh too (its sample one dp rank's batch); without a limit the choice the cost
    model made is the one that runs."""
    import pipedream_ext as pd

    x, y = global_batch(0)
    pipe = pd.PipeDream(wide(), F.cross_entropy, schedule="1f1b", microbatches="auto", mesh="auto",
                        data_parallel="auto", memory=3e5, sample=(x, y), timeout=60)
    chosen = pipe.configuration
    assert chosen.mesh[1] > 1 and chosen.data_parallel == "fsdp", chosen.table()
    assert max(chosen.predicted_peak_bytes) <= 3e5, chosen.table()
    assert type(pipe._runner.data_parallel).__name__ == "FsdpStages"
    train_like_unsplit(pipe, wide(), "adamw", f"data_parallel='auto' {chosen.mesh}")
    half = BATCH // 2
    given = dict(schedule="1f1b", microbatches=2, mesh=make_mesh(2, 2), data_parallel="auto",
                 sample=(x[:half], y[:half]), timeout=60)
    fitted = pd.PipeDream(wide(), F.cross_entropy, memory=3e5, **given)
    assert fitted.configuration.data_parallel == "fsdp", fitted.configuration.table()
    free = pd.PipeDream(wide(), F.cross_entropy, **given)
    kind = {"fsdp": "FsdpStages", "replicate": "ReplicatedStages"}
    assert type(free._runner.data_parallel).__name__ == kind[free.configuration.data_parallel]


def case_name(case: Case) -> str:
    """The pytest id of ``case``: its schedule and mesh, then the fields set otherwise
    than by default."""
    others = [f"{field}={id_part(value)}" for field, value in case._asdict().items()
              if field not in ("schedule", "pp", "dp") and value != Case._field_defaults[field]]
    return "-".join([case.schedule, f"pp{case.pp}xdp{case.dp}", *others])


def check_dcp_mesh_save_fsdp() -> None:
    """test_checkpoint_dcp.py's meshed save and resume, fsdp half."""
    from test_checkpoint_dcp import phase_mesh_save

    phase_mesh_save(os.environ[CKPT_ENV], modes=("fsdp",))


def fsdp_cases(kind: str) -> Callable[[int], Cases]:
    """The cases of the ``kind`` launch (``fast``, ``full`` or ``clip``)."""
    def build(world: int) -> Cases:
        out = Cases()
        if kind == "fast":
            out.add(check_refusals)
            out.add(check_mesh_errors)
            out.add(check_dp_batches_and_steps)
            out.add(check_grad_scaler_skips_on_every_pipeline)
            out.add(check_auto_plan)
            out.add(check_auto_mesh)
            out.add(check_auto_data_parallel)
            out.add(check_dcp_mesh_save_fsdp)
        for case in cases(kind):
            out.add(check_case, case, name=case_name(case))
        return out
    return build


FAST = Launch(HERE, 4, fsdp_cases("fast"), name="fast", dirs=(CKPT_ENV,))
FULL = Launch(HERE, 4, fsdp_cases("full"), name="full", timeout=1800)
CLIP = Launch(HERE, 4, fsdp_cases("clip"), name="clip")  # standalone runs only


@parametrize_cases(FAST)
def test_fsdp_representative_case_and_refusals(case: CaseRef) -> None:
    """zb-h1, pp 2 x dp 2, AdamW, a weight tied across the two stages: losses, weights and
    one reduce-scatter per unit per step; pd.clip_grad_norm_ (fsdp p=2, replicate p=inf);
    an asynchronous DCP save of the fsdp pipeline resumed on the same mesh; balance="auto"
    with a mesh; mesh="auto" and data_parallel="auto"; and every refusal of a mesh (one
    launch)."""
    case.check()


@pytest.mark.slow
@parametrize_cases(FULL)
def test_every_flush_schedule_with_fsdp_and_replicate(case: CaseRef) -> None:
    """Every flush schedule x SGD-momentum / AdamW x both reshard settings (fsdp, pp 2 x
    dp 2), replicate, pp 1 x dp 4, pp 4 x dp 1, meta-device models, loss_reduction="sum",
    bf16 parameters with fp32 reduction; a weight tied across stages, traced stages
    (split_points) and recompute=True, each with fsdp and replicate."""
    case.check()

if __name__ == "__main__":
    worker_main([FAST, FULL, CLIP])
