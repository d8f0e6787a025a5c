"""Every rank agrees or the run stops: same graph, same weights, same batch.

* Gemma 3 (transformers, from a config) on 2 ranks started with different
  ``PYTHONHASHSEED`` values: its two RoPE tables are built in ``set`` order, so the
  ranks trace them in different orders; the pipeline proves both graphs compute the
  same values and sends them in rank 0's order, and trains exactly like the unsplit
  model (without the reordering the first step's ``q_proj`` gradients are off).
* Ranks that built different pipelines are refused at construction on every rank,
  naming the first difference: a forward that depends on the rank (fx, with
  ``split_points``, ``balance="auto"``, chunks, replicas), a config that differs
  (export path), another layer or a wider one in an ``nn.Sequential``, another
  argument.
* Replicas of a stage start from their leader's weights (3 ranks, ``replicas=[2, 1]``,
  each rank's model seeded differently) and train like the leader's unsplit model.
* The first steps: a ``DistributedSampler`` kept from DDP (other batches per rank),
  batches of other sizes, ranks in different calls, an input without the batch
  dimension, a ``loss_fn`` that sums, or returns a float or a tuple: every rank
  raises the same error before (or right after) the step; ``loss_reduction="sum"``
  trains like the unsplit model; ``forward_only`` returns a dict or tuple with a
  scalar, combined over microbatches; a stage returning a dict is named.

    torchrun --standalone --nproc-per-node 2 tests/test_agreement.py
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import (
    CaseRef,
    Cases,
    Launch,
    launch_raw,
    parametrize_cases,
    worker_main,
)

HERE = os.path.abspath(__file__)
_LAYER_TYPES = '["sliding_attention", "full_attention"]'


def _row(row_id: str) -> str:
    """The message of a row of docs/bad_input.md (tests/test_bad_input.py's ROWS)."""
    from test_bad_input import ROWS

    return next(message for rid, _, message, _ in ROWS if rid == row_id)


def _expect(pattern: str, fn: Any, kind: type = ValueError, row: str = "") -> str:
    """Runs ``fn``, which must raise ``kind`` matching ``pattern`` (and the docs row ``row``)."""
    with pytest.raises(kind) as info:
        fn()
    assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    if row:
        assert re.search(_row(row), str(info.value)), (row, str(info.value))
    return str(info.value)


def _kwargs(**kwargs: Any) -> Dict[str, Any]:
    base = dict(loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, timeout=60)
    base.update(kwargs)
    return base


# --------------------------------------------------------------------------- models
class RankDependent(nn.Module):
    """fx traces it; its activation depends on the rank tracing it (read at trace time)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.d, self.c = (nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 12),
                                          nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.tanh(h) if os.environ.get("RANK") == "1" else torch.relu(h)
        return self.c(self.d(self.b(h)))


def sequential(rank: int, tanh_on: int = -1, wider_on: int = -1, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    width = 16 if rank == wider_on else 12
    return nn.Sequential(nn.Linear(6, width), nn.Tanh() if rank == tanh_on else nn.ReLU(),
                         nn.Linear(width, 12), nn.Linear(12, 3))


def batch(n: int = 8, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


# --------------------------------------------------------------------------- construction
def train_like_the_reference(pipe: Any, ref: nn.Module, first_seed: int) -> None:
    """3 SGD-momentum steps on the pipeline and on the unsplit ``ref``: every loss equal,
    then every weight."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = batch(8, seed=first_seed + step)
        loss = pipe.step(x, y)
        want = F.cross_entropy(ref(x), y)
        want.backward()
        assert abs(loss - float(want)) < 1e-5, (step, loss, float(want))
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6)


def check_different_graphs_are_refused() -> None:
    import pipedream_ext as pd

    x, y = batch()
    graph = (r"ranks traced different graphs: stage 0 differs between rank 0 and rank 1: rank 1 "
             r"has `tanh = call_function tanh\(a\).*` where rank 0 has `relu = call_function "
             r"relu\(a\).*`.*PYTHONHASHSEED")
    # fx with split points, with chunks, and a plan made at start-up (stages and replicas).
    _expect(graph, lambda: pd.PipeDream(RankDependent(), **_kwargs(
        split_points=["b"], sample=(x, y))), row="graph-mismatch")
    _expect(graph, lambda: pd.PipeDream(RankDependent(), **_kwargs(
        schedule="interleaved-1f1b", chunks=2, split_points=["b", "d", "c"], sample=(x, y))))
    _expect(r"ranks traced different graphs: stage 0 differs between rank 0 and rank 1: rank 1 "
            r"has `tanh = ", lambda: pd.PipeDream(RankDependent(), **_kwargs(
                balance="auto", sample=(x, y), bandwidth=[1e9])))
    # nn.Sequential: another activation, a wider layer.
    rank = dist.get_rank()
    _expect(r"ranks built different models: stage 0 differs between rank 0 and rank 1: rank 1 has "
            r"`layer 1, module '1': Tanh\(\)` where rank 0 has `layer 1, module '1': ReLU\(\)`",
            lambda: pd.PipeDream(sequential(rank, tanh_on=1), **_kwargs()), row="model-mismatch")
    _expect(r"stage 0 differs between rank 0 and rank 1: rank 1 has `layer 0, module '0': "
            r"Linear\(in_features=6, out_features=16, bias=True\) with weight torch.float32\[16, 6\]",
            lambda: pd.PipeDream(sequential(rank, wider_on=1), **_kwargs()), row="model-wider")
    # An argument: named with its value on every rank.
    _expect(r"ranks disagree on the pipeline configuration: microbatches is 2 on rank 0; 4 on "
            r"rank 1", lambda: pd.PipeDream(sequential(rank), **_kwargs(
                microbatches=2 + 2 * rank)), row="config-mismatch")


def check_export_config_difference_is_refused() -> None:
    """The export path: a config that differs by rank (another RoPE base) changes a buffer
    the graph reads; named by its path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import pipedream_ext as pd

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    theta = 10000.0 if dist.get_rank() == 0 else 500000.0
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": theta}))
    ids = torch.randint(0, 32, (4, 6))
    _expect(r"ranks traced different graphs: stage 0 differs between rank 0 and rank 1: rank 1 "
            r"has `.*model\.rotary_emb\.inv_freq", lambda: pd.PipeDream(
                model, lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
                microbatches=2, timeout=60, split_points=["model.layers.1"],
                sample=({"input_ids": ids}, ids), concrete_args={"use_cache": False}),
            row="graph-constant-mismatch")


# --------------------------------------------------------------------------- the first steps
def check_first_steps() -> None:
    import pipedream_ext as pd

    rank = dist.get_rank()
    # A DistributedSampler kept from DDP: every rank another batch of the same size.
    pipe = pd.PipeDream(sequential(0), **_kwargs())
    x, y = batch(8, seed=rank)
    for _ in range(2):  # the pipeline stays usable after a refused step
        _expect(r"step\(\) number \d: stage 0 on rank 0 and the last stage on rank 1 were given "
                r"different batches \(targets fingerprints \w+ and \w+\).*DistributedSampler"
                r"\(dataset, num_replicas=1, rank=0", lambda: pipe.step(x, y), row="batch-sampler")
    x, y = batch(8)
    pipe.step(x, y)  # the same batch: fine
    # Inputs and targets of different sizes.
    pipe = pd.PipeDream(sequential(0), **_kwargs())
    n = 8 if rank == 0 else 12
    _expect(r"stage 0 on rank 0 was given inputs of 8 rows but the last stage on rank 1 targets "
            r"of 12 rows", lambda: pipe.step(*batch(n)), row="batch-rows")
    # Ranks in different calls: named with their numbers, before anything is sent.
    pipe = pd.PipeDream(sequential(0), **_kwargs())
    call = (lambda: pipe.forward_only(x)) if rank == 0 else (lambda: pipe.step(x, y))
    _expect(r'ranks are in different calls: "forward_only\(\) number 0" on rank 0; "step\(\) '
            r'number 0" on rank 1', call, row="different-calls")
    # One rank's bad argument is every rank's error.
    pipe = pd.PipeDream(sequential(0), **_kwargs())
    _expect(r"rank 1 holds the last stage: step\(\) needs the targets",
            lambda: pipe.step(x, y if rank == 0 else None))


class MemoryBank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 5), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.a(x), dim=-1)  # (rows, slots)
        return self.b(x + weights @ bank)


def check_inputs_without_batch_dimension() -> None:
    import pipedream_ext as pd

    x, y = batch()
    bank = torch.randn(5, 6)
    pipe = pd.PipeDream(MemoryBank(), **_kwargs(split_points=["b"], sample=((x, bank), y)))
    _expect(r"rank 0: inputs 1 has 5 rows in dim 0 but the batch has 8 rows.*register it as a "
            r"buffer", lambda: pipe.step((x, bank), y))
    named = pd.PipeDream(MemoryBank(), **_kwargs(split_points=["b"],
                                                 sample=({"x": x, "bank": bank}, y)))
    _expect(r"inputs 1 \('bank'\) has 5 rows", lambda: named.step({"x": x, "bank": bank}, y),
            row="input-no-batch")


def check_losses() -> None:
    import pipedream_ext as pd

    x, y = batch(12)
    rank = dist.get_rank()
    summed = lambda out, t: F.cross_entropy(out, t, reduction="sum")  # noqa: E731
    pipe = pd.PipeDream(sequential(0), **_kwargs(loss_fn=summed))
    _expect(r"step\(\) number 0 failed on rank 1: loss_fn sums over the batch.*loss_reduction="
            r"'sum'", lambda: pipe.step(x, y), row="loss-sum")
    assert all(p.grad is None for p in pipe.parameters())  # the zero loss left nothing behind
    # loss_reduction="sum": the unsplit model's gradients of the summed loss.
    pipe = pd.PipeDream(sequential(0), **_kwargs(loss_fn=summed, loss_reduction="sum",
                                                 microbatches=3))
    ref = sequential(0)
    loss = pipe.step(x, y)
    want = summed(ref(x), y)
    want.backward()
    assert abs(loss - float(want)) < 1e-4, (loss, float(want))
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6)
    pipe = pd.PipeDream(sequential(0), **_kwargs(loss_fn=F.cross_entropy, loss_reduction="sum"))
    _expect(r"loss_fn averages over the batch.*drop loss_reduction='sum'", lambda: pipe.step(x, y),
            row="loss-sum-mean")
    # A float or a tuple: every rank raises within the step.
    for value, kind in [(lambda out, t: F.cross_entropy(out, t).item(), "float"),
                        (lambda out, t: (F.cross_entropy(out, t), out), "tuple")]:
        pipe = pd.PipeDream(sequential(0), **_kwargs(loss_fn=value))
        _expect(rf"step\(\) number 0 failed on rank 1: loss_fn returned a {kind} .*scalar tensor",
                lambda: pipe.step(x, y), row="loss-float")
    del rank


class WithScalar(nn.Module):
    """A last layer returning the logits and their mean (a 0-d tensor), as a dict."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict

    def forward(self, h: torch.Tensor) -> Any:
        if self.as_dict:
            return {"logits": h, "mean": h.mean(), "name": "scores"}
        return h, h.mean()


def check_forward_only_structures() -> None:
    import pipedream_ext as pd

    x, _ = batch(10)  # microbatches of 3, 3, 2, 2 rows
    for as_dict in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), WithScalar(as_dict))
        loss = (lambda out, t: F.cross_entropy(out["logits"], t)) if as_dict else \
            (lambda out, t: F.cross_entropy(out[0], t))
        pipe = pd.PipeDream(model, **_kwargs(loss_fn=loss, microbatches=4))
        pipe.step(x, batch(10)[1])
        pipe.eval()
        out = pipe.forward_only(x)
        if not pipe.is_last:
            assert out is None
            continue
        with torch.no_grad():
            logits = model[:3](x)
        parts = torch.tensor_split(logits, 4)
        mean = sum(p.mean() * (len(p) / 10) for p in parts)
        if as_dict:
            assert set(out) == {"logits", "mean", "name"} and out["name"] == "scores"
            got_logits, got_mean = out["logits"], out["mean"]
        else:
            got_logits, got_mean = out
        torch.testing.assert_close(got_logits, logits)
        assert got_mean.dim() == 0
        torch.testing.assert_close(got_mean, mean)


class ReturnsDict(nn.Module):
    def forward(self, h: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"hidden": h}


def check_stage_returning_a_dict() -> None:
    """Found on rank 0 inside the step; rank 1 fails at its timeout naming it."""
    import pipedream_ext as pd

    group = dist.new_group([0, 1])  # Gloo closes a pair after a timed-out receive
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), ReturnsDict(), nn.Linear(12, 3))
    pipe = pd.PipeDream(model, **_kwargs(balance=[2, 1], timeout=5, process_group=group,
                                         check_agreement=0))
    x, y = batch()
    if dist.get_rank() == 0:
        _expect(r"rank 0: stage 0 \(layers 0-1\) returned a dict; a stage before the last must "
                r"return a tensor or a tuple of tensors", lambda: pipe.step(x, y), row="stage-dict")
    else:
        _expect(r"rank 0", lambda: pipe.step(x, y), RuntimeError)


# --------------------------------------------------------------------------- replicas (3 ranks)
def check_replicas_start_from_the_leader() -> None:
    """Every rank seeds its model differently (as a DDP script without a seed would)."""
    import pipedream_ext as pd

    rank = dist.get_rank()
    pipe = pd.PipeDream(sequential(0, seed=rank), **_kwargs(replicas=[2, 1], balance=[2, 2],
                                                            microbatches=4))
    ref = sequential(0, seed=0)  # stage 0 as its leader (rank 0) built it
    other = sequential(0, seed=2)  # stage 1 as rank 2 built it
    ref[2].load_state_dict(other[2].state_dict())
    ref[3].load_state_dict(other[3].state_dict())
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert torch.equal(p, expected[name]), name
    train_like_the_reference(pipe, ref, first_seed=10)
    # A rank-dependent forward with replicas: refused too.
    x, y = batch()
    _expect(r"ranks traced different graphs: stage 0 differs between rank 0 and rank 1",
            lambda: pd.PipeDream(RankDependent(), **_kwargs(replicas=[2, 1], split_points=["b"],
                                                            sample=(x, y))))


class TwoNamedInputs(nn.Module):
    """A model taking keyword tensors: planned with balance="auto" on a dict sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)) * scale
        return self.c(torch.relu(self.b(h)) + h)


def check_auto_balance_with_named_inputs() -> None:
    """balance="auto" takes the same dict of inputs as split_points; exact training."""
    import pipedream_ext as pd

    x, y = batch(8)
    scale = torch.rand(8, 1)
    pipe = pd.PipeDream(TwoNamedInputs(), **_kwargs(schedule="zb-h1", balance="auto",
                                                    sample=({"scale": scale, "x": x}, y),
                                                    bandwidth=[1e9]))
    assert pipe.traced.input_names == ["x", "scale"], pipe.traced.input_names
    ref = TwoNamedInputs()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9) \
        if any(True for _ in pipe.parameters()) else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = batch(8, seed=20 + step)
        scale = torch.rand(8, 1, generator=torch.Generator().manual_seed(step))
        loss = pipe.step({"x": x, "scale": scale}, y)
        want = F.cross_entropy(ref(x, scale), y)
        want.backward()
        assert abs(loss - float(want)) < 1e-5, (step, loss, float(want))
        if opt is not None:
            opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6)


def agreement_cases(world: int) -> Cases:
    cases = Cases()
    if world == 3:
        cases.add(check_replicas_start_from_the_leader)
        return cases
    cases.add(check_different_graphs_are_refused)
    cases.add(check_export_config_difference_is_refused)
    cases.add(check_auto_balance_with_named_inputs)
    cases.add(check_first_steps)
    cases.add(check_inputs_without_batch_dimension)
    cases.add(check_losses)
    cases.add(check_forward_only_structures)
    cases.add(check_stage_returning_a_dict)
    return cases


TWO, THREE = (Launch(HERE, world, agreement_cases) for world in (2, 3))


# --------------------------------------------------------------------------- Gemma 3
class SetOrder(nn.Module):
    """fx's Gemma 3: two branches computed in set order, both crossing the cut."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branch = nn.ModuleDict({name: nn.Linear(6, 8) for name in eval(_LAYER_TYPES)})
        self.sliding, self.full = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = {}
        for name in set(self.branch):
            h[name] = torch.tanh(self.branch[name](x))
        return self.sliding(h["sliding_attention"]) - self.full(h["full_attention"])


def check_set_order_on_the_fx_path() -> None:
    import pipedream_ext as pd
    import pipedream_ext._dist.collectives as _collectives

    x, y = batch(8)
    pipe = pd.PipeDream(SetOrder(), **_kwargs(split_points=["sliding"], sample=(x, y)))
    lives = _collectives.all_gather_json(pipe.traced.live, dist.group.WORLD)
    assert lives[0] != lives[1], lives  # each rank's own names, in rank 0's order
    ref = SetOrder()
    train_like_the_reference(pipe, ref, first_seed=30)


def gemma_with_other_hash_seeds() -> None:
    """Runs on 2 raw ranks whose PYTHONHASHSEED differ (see the test)."""
    from _zoo import ZOO, check_exact

    import pipedream_ext._dist.collectives as _collectives

    orders = _collectives.all_gather_json(list(set(eval(_LAYER_TYPES))), dist.group.WORLD)
    assert orders[0] != orders[1], f"the hash seeds give one set order: {orders}"
    pipe = check_exact(ZOO["gemma3"], "1f1b", chunks=1)
    # The ranks traced the RoPE tables in different orders; one rank sends or expects
    # the values crossing the cut in rank 0's order instead of its own graph order.
    lives = _collectives.all_gather_json(pipe.traced.live, dist.group.WORLD)
    assert lives[0] != lives[1], lives
    check_set_order_on_the_fx_path()


def _seeds_with_different_set_orders() -> List[str]:
    """Two PYTHONHASHSEED values under which set(layer_types) iterates differently."""
    found: Dict[str, str] = {}
    for seed in range(1, 50):
        order = subprocess.run([sys.executable, "-c", f"print(list(set({_LAYER_TYPES})))"],
                               env=dict(os.environ, PYTHONHASHSEED=str(seed)),
                               capture_output=True, text=True, check=True).stdout
        found.setdefault(order, str(seed))
        if len(found) == 2:
            return list(found.values())
    raise AssertionError("no two hash seeds give different set orders")


def test_gemma3_ranks_with_other_hash_seeds_train_like_the_unsplit_model() -> None:
    """The reproduction: without the agreement, rank 1 runs its stage on the RoPE tables in
    the other order and the first step's gradients are wrong (export path); the same with
    a small fx model whose two branches run in set order."""
    pytest.importorskip("transformers")
    seeds = _seeds_with_different_set_orders()
    results = launch_raw(HERE, 2, "gemma", timeout=600,
                         rank_env=[{"PYTHONHASHSEED": s} for s in seeds])
    for rank, r in enumerate(results):
        assert r.returncode == 0 and "GEMMA OK" in r.stdout, (rank, r.stdout[-6000:])


def test_auto_balance_of_an_export_only_model_names_split_points(monkeypatch) -> None:
    """Refused before any communication, naming split_points (not blaming control flow)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import pipedream_ext as pd

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1))
    ids = torch.randint(0, 32, (4, 6))
    _expect(r"LlamaForCausalLM cannot be traced with torch\.fx.*balance='auto' and plan files cut "
            r"torch\.fx graphs.*takes split_points=\[module names\] instead",
            lambda: pd.PipeDream(model, F.cross_entropy, balance="auto",
                                 sample=({"input_ids": ids}, ids),
                                 concrete_args={"use_cache": False}), row="auto-export-only")


@parametrize_cases(TWO)
def test_ranks_must_agree_on_graph_batch_and_loss(case: CaseRef) -> None:
    """2 ranks: construction refusals, the first steps' checks, losses, forward_only."""
    pytest.importorskip("transformers")
    case.check()


@parametrize_cases(THREE)
def test_replicas_start_from_their_leaders_weights(case: CaseRef) -> None:
    case.check()


# --------------------------------------------------------------------------- calls (raw ranks)
def extra_step_case() -> None:
    """Rank 1 calls step() once more than rank 0, which stays alive between calls: rank 1
    fails at its timeout naming rank 0's calls (not only "is rank 0 alive?")."""
    import pipedream_ext as pd

    rank = dist.get_rank()
    pipe = pd.PipeDream(sequential(0), **_kwargs(timeout=5, check_agreement=1))
    x, y = batch()
    for _ in range(2):
        pipe.step(x, y)
    done = os.path.join(os.environ["AGREE_DIR"], "done")
    if rank == 0:
        deadline = time.time() + 90
        while not os.path.exists(done) and time.time() < deadline:
            time.sleep(0.2)
        print("RANK0 IDLE", flush=True)
        os._exit(0)
    try:
        pipe.step(x, y)
    except Exception as exc:  # noqa: BLE001 - printed for the test
        print(f"RANK1 ERROR: {exc}", flush=True)
        open(done, "w").close()
        os._exit(3)
    open(done, "w").close()
    os._exit(0)


def unflushed_case() -> None:
    import pipedream_ext as pd

    pipe = pd.PipeDream(sequential(0), **_kwargs(schedule="pipedream", timeout=30))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = batch()
    for _ in range(3):
        pipe.step(x, y, optimizer=opt)
    print(f"rank {dist.get_rank()}: ended", flush=True)


def test_an_extra_step_on_one_rank_names_the_other_ranks_calls(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AGREE_DIR", str(tmp_path))
    results = launch_raw(HERE, 2, "extra-step", timeout=180)
    assert results[0].returncode == 0, results[0].stdout[-3000:]
    assert results[1].returncode == 3, results[1].stdout[-3000:]
    assert re.search(_row("extra-step"), results[1].stdout), results[1].stdout[-3000:]


def test_an_asynchronous_run_ended_without_flush_is_named_on_every_rank() -> None:
    """Each rank that ends unflushed says so; a rank still waiting on one that ended is
    told why (not only "lost rank 0")."""
    results = launch_raw(HERE, 2, "unflushed", timeout=180)
    first = results[0].stdout
    assert "rank 0: ended" in first, first[-3000:]
    assert re.search(_row("unflushed"), first) and "rank 0: the asynchronous" in first, \
        first[-3000:]
    second = results[1].stdout
    assert re.search(r"rank 1: the asynchronous pipeline ends with \d minibatches admitted and "
                     r"never flushed", second), second[-3000:]
    if "rank 1: ended" not in second:  # it was still waiting for rank 0's last minibatch
        assert "rank 0 has ended (exited after 3 step() calls, with 3 asynchronous minibatches " \
               "admitted and never flushed: call pipe.flush()" in second, second[-3000:]
        assert "lost rank 0" not in second, second[-3000:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default=None)
    args = parser.parse_args()
    if args.fault in ("extra-step", "unflushed"):
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        (extra_step_case if args.fault == "extra-step" else unflushed_case)()
        return
    if args.fault == "gemma":
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        gemma_with_other_hash_seeds()
        print(f"rank {dist.get_rank()}: GEMMA OK", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    worker_main([TWO, THREE])


if __name__ == "__main__":
    main()


def test_a_dict_valued_argument_names_only_the_entries_that_differ() -> None:
    """A plan dict that differs on one rank names that entry, not the whole JSON value."""
    from pipedream_ext._dist.agreement import _disagreement
    from pipedream_ext._dist.groups import RankNames

    plan = {f"*.w{i}": {"style": "Colwise", "settings": {"use_local_output": "True"}} for i in range(14)}
    other = {**plan, "*.w3": {"style": "Rowwise", "settings": {"use_local_output": "True"}}}
    names = RankNames([0, 1, 2, 3])
    assert _disagreement("tensor_parallel", [plan, plan, plan, other], names) == \
        "tensor_parallel['*.w3']['style'] is \"Colwise\" on ranks 0, 1, 2; \"Rowwise\" on rank 3"
    assert _disagreement("microbatches", [2, 4], RankNames([0, 1])) == "microbatches is 2 on rank 0; 4 on rank 1"
    # A key only some ranks have; and no more than three differences spelled out.
    assert _disagreement("d", [{"a": 1}, {}], RankNames([0, 1])) == "d['a'] is 1 on rank 0; \"(absent)\" on rank 1"
    # A level's own values come before those inside its dicts: the style before its settings.
    nested = [{"style": "C", "settings": {"x": 1}}, {"style": "R", "settings": {"x": 2}}]
    assert _disagreement("p", nested, RankNames([0, 1])).startswith("p['style'] is \"C\" on rank 0")
    many = [{k: i for k in "abcde"} for i in range(2)]
    assert _disagreement("d", many, RankNames([0, 1])).endswith("d['c'] is 0 on rank 0; 1 on rank 1 (and 2 more "
                                                                "differences)")


def test_a_mesh_rank_is_named_by_its_coordinates() -> None:
    """Messages name a mesh's rank by pp and its copy's coordinates: ``(dp, tp)`` with tp,
    ``(dp, ep, tp)`` with ep too (copy ``(d * ep + e) * tp + t``)."""
    from pipedream_ext._dist.groups import RankNames

    two_d = [[0, 2], [1, 3]]  # (pp 2, dp 2)
    assert RankNames([1, 3], two_d).of_global(3) == "rank 3 (pp 1, dp 1)"
    four_d = [[c, 8 + c] for c in range(8)]  # (pp 2, dp 2, ep 2, tp 2), ascending
    assert RankNames(four_d[0], four_d, 2).of_global(13) == "rank 13 (pp 1, dp 2, tp 1)"
    assert RankNames(four_d[0], four_d, 2, 2).of_global(13) == "rank 13 (pp 1, dp 1, ep 0, tp 1)"
    assert RankNames(four_d[0], four_d, 2, 2).many([6, 7]) == \
        "ranks 6 (pp 0, dp 1, ep 1, tp 0), 7 (pp 0, dp 1, ep 1, tp 1)"
    assert RankNames(four_d[0], four_d[:4], 1, 2).of_global(3) == "rank 3 (pp 0, dp 1, ep 1)"
