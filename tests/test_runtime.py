"""Multi-process runtime tests (CPU, Gloo, processes on localhost).

Runs under pytest, which launches the worker side with torchrun, or standalone:

    torchrun --standalone --nproc-per-node 3 tests/test_runtime.py

Every check compares against the unsplit model trained in the same process,
so it asserts numerical equality, not just "it ran".
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import (
    CaseRef,
    Cases,
    Launch,
    launch_raw,
    parametrize_cases,
    strict_and_gloo,
    worker_main,
)
from torch import nn

RTOL, ATOL = 1e-5, 1e-6
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


# --------------------------------------------------------------------------- models
class Fork(nn.Module):
    """Returns a tuple: exercises tuple activations between stages."""

    def forward(self, x: torch.Tensor):
        return x, torch.tanh(x)


class Join(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, pair):
        x, y = pair
        return self.a(x) + self.b(y)


def make_model(kind: str = "mlp", seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    if kind == "mlp":  # 8 layers: enough for 4 ranks x 2 chunks
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(),
                             nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))
    if kind == "tuple":
        return nn.Sequential(nn.Linear(6, 10), Fork(), Join(10), nn.ReLU(), nn.Linear(10, 3))
    raise ValueError(kind)


def batch(n: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- worker checks
def check_gradients_and_training(schedule: str, microbatches: int, kind: str = "mlp",
                                 balance: Optional[List[int]] = None, recompute: bool = False,
                                 replicas: Optional[List[int]] = None) -> None:
    """Loss and gradients equal the unsplit model's; so do weights after 5 SGD / Adam steps."""
    import pipedream_ext as pd

    chunks = 2 if schedule == "interleaved-1f1b" else 1
    for opt_name in ("sgd", "adam"):
        ref = make_model(kind)
        pipe = pd.PipeDream(make_model(kind), F.cross_entropy, schedule=schedule,
                            microbatches=microbatches, chunks=chunks, balance=balance, timeout=60,
                            recompute=recompute, replicas=replicas)
        make_opt: Callable = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) \
            if opt_name == "sgd" else (lambda ps: torch.optim.Adam(ps, lr=0.01))
        # torch optimizers refuse an empty parameter list (a parameter-free stage).
        has_params = any(True for _ in pipe.parameters())
        ref_opt = make_opt(ref.parameters())
        opt = make_opt(pipe.parameters()) if has_params else None
        ref_params: Dict[str, nn.Parameter] = dict(ref.named_parameters())
        for step in range(5):
            # Batch sizes 8, 9, 10, 8, 9: microbatch shapes change between steps, which
            # exercises the engine's redirected transfers (pre-posted receives of the old shape).
            x, y = batch(n=8 + step % 3, seed=10 + step)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            assert abs(loss - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item())), \
                f"{schedule} m={microbatches} step {step}: loss {loss} != {ref_loss.item()}"
            if step == 0:
                for name, p in pipe.named_parameters():
                    assert_close(p.grad, ref_params[name].grad,
                                 f"{schedule} m={microbatches} grad of {name}")
            ref_opt.step(); ref_opt.zero_grad()
            if opt is not None:
                opt.step(); opt.zero_grad()
        for name, p in pipe.named_parameters():
            assert_close(p.detach(), ref_params[name].detach(),
                         f"{schedule} m={microbatches} {opt_name} weight {name} after 5 steps")
        state = pipe.state_dict()
        assert set(state) == {n for n, _ in pipe.named_parameters()}


def check_recompute_with_dropout() -> None:
    """recompute=True restores the RNG state: dropout masks and weights are identical."""
    import pipedream_ext as pd

    weights = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.3), nn.Tanh(), nn.Linear(12, 12),
                              nn.Dropout(0.3), nn.Linear(12, 3))
        pipe = pd.PipeDream(model, F.cross_entropy, schedule="1f1b", microbatches=2,
                            recompute=recompute, timeout=60)
        params = list(pipe.parameters())
        opt = torch.optim.SGD(params, lr=0.1) if params else None  # a stage may be a lone Dropout
        torch.manual_seed(1234 + dist.get_rank())
        for step in range(3):
            x, y = batch(seed=50 + step)
            pipe.step(x, y)
            if opt is not None:
                opt.step(); opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in pipe.named_parameters()})
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=0, atol=0,
                                   msg=lambda m: f"recompute changed {name}: {m}")


def check_recompute_per_stage(schedule: str) -> None:
    """recompute= one bool per stage: only the marked stages run their forwards twice (a
    forward hook counts them), and loss and gradients still equal the unsplit model's."""
    import pipedream_ext as pd

    world, chunks, m = dist.get_world_size(), 2 if schedule == "interleaved-1f1b" else 1, 4
    # Rank 0's stages recompute (every chunk of it), the others' do not.
    marked = [j % world == 0 for j in range(world * chunks)]
    ref = make_model()
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule=schedule, microbatches=m,
                        chunks=chunks, recompute=marked, timeout=60)
    assert pipe.recompute == tuple(marked)
    calls: List[int] = []
    layers = list(pipe.module.children())
    for layer in layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    x, y = batch(seed=3)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    loss = float(pipe.step(x, y))
    assert abs(loss - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item())), (loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, ref_params[name].grad, f"{schedule} recompute={marked} grad of {name}")
    expected = len(layers) * m * (2 if dist.get_rank() == 0 else 1)
    assert len(calls) == expected, f"rank {dist.get_rank()}: {len(calls)} layer forwards, not {expected}"


def check_calibrate() -> None:
    """The machine's costs: measured within seconds, finite, the same on every rank, and a
    pipeline builds after them."""
    import pipedream_ext as pd
    from pipedream_ext import diagnostics
    from pipedream_ext._dist import collectives
    from pipedream_ext._planning.calibration import calibrate

    costs = calibrate(dist.group.WORLD, torch.device("cpu"), timeout=60, pipeline=pd.PipeDream)
    for key in ("latency_seconds", "bandwidth", "all_reduce_latency_seconds",
                "all_reduce_bandwidth", "send_seconds"):
        assert 0 < getattr(costs, key) < float("inf"), (key, costs)
    # The step holds Adam's per-step cost (> 0); posting a large send costs at least a small one.
    assert 0 < costs.step_seconds < 1 and 0 < costs.action_seconds < 1, costs
    assert 0 <= costs.send_seconds_per_byte < 1e-6, costs
    assert costs.cores >= 1 and costs.ranks_per_node == dist.get_world_size(), costs
    everyone = collectives.all_gather_json(costs.to_dict(), dist.group.WORLD)
    assert all(c == everyone[0] for c in everyone), everyone
    # Cached for these ranks and device; recalibrate=True measures again on every rank.
    assert calibrate(dist.group.WORLD, torch.device("cpu"), timeout=60, pipeline=pd.PipeDream) is costs
    again = diagnostics.calibrate(dist.group.WORLD, "cpu", timeout=60, recalibrate=True)
    assert again is not costs and again.cores == costs.cores, (again, costs)
    assert calibrate(dist.group.WORLD, torch.device("cpu"), timeout=60, pipeline=pd.PipeDream) is again
    # The probe pipeline over every rank left the ranks' group creation in step: a pipeline builds.
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=2, timeout=60)
    pipe.step(*batch())
    pipe.close()


def check_auto_balance() -> None:
    """balance="auto": the same plan on every rank, gradients equal the unsplit model's,
    and the saved plan.json rebuilds the same stages."""
    import tempfile
    import zlib

    import pipedream_ext as pd

    x, y = batch()
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=4,
                        balance="auto", sample=(x, y), timeout=60)
    digest = torch.tensor([zlib.crc32(pipe.plan.to_json().encode())], dtype=torch.int64)
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    assert low.item() == high.item(), "ranks got different plans"
    assert sum(pipe.balance) == 8 and sum(pipe.replicas) == dist.get_world_size()
    ref = make_model()
    F.cross_entropy(ref(x), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    pipe.step(x, y)
    for name, param in pipe.named_parameters():
        assert_close(param.grad, ref_grads[name], f"auto plan {pipe.balance}/{pipe.replicas} grad {name}")
    path = os.path.join(tempfile.gettempdir(), f"pipedream_plan_{os.environ.get('MASTER_PORT', 'x')}.json")
    if dist.get_rank() == 0:
        pipe.plan.save(path)
    dist.barrier()
    again = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=4,
                         balance=path, timeout=60)
    assert again.balance == pipe.balance and again.replicas == pipe.replicas
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)


def _same_everywhere(text: str) -> bool:
    """Every rank holds the same ``text`` (its CRC-32 all-reduced as min and max)."""
    import zlib

    digest = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64)
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return low.item() == high.item()


def _train_like_the_unsplit_model(pipe, steps: int = 4) -> None:
    """Loss every step and weights after ``steps`` SGD-momentum steps equal the unsplit model's."""
    ref = make_model()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(n=16, seed=20 + step)
        want = F.cross_entropy(ref(x), y)
        want.backward()
        loss = pipe.step(x, y)
        assert abs(loss - want.item()) <= 1e-5 * max(1.0, abs(want.item())), (step, loss, want.item())
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.detach(), expected[name].detach(), f"{pipe.schedule_name} weight {name}")


def _plan_path(tag: str) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"pipedream_{tag}_{os.environ.get('MASTER_PORT', 'x')}.json")


def check_auto_configuration() -> None:
    """schedule/microbatches/recompute="auto": one configuration on every rank, a flush
    schedule, trained exactly like the unsplit model; its plan file fixes all of it again,
    and an option given otherwise than the file says is refused."""
    import pipedream_ext as pd

    x, y = batch(n=16)
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="auto", microbatches="auto",
                        recompute="auto", sample=(x, y), timeout=60)
    chosen = pipe.configuration
    assert chosen is not None and chosen.prediction is not None
    assert _same_everywhere(json.dumps(chosen.to_dict(), sort_keys=True)), "ranks chose differently"
    assert chosen.schedule in pd.schedules.synchronous_names() and pipe.schedule_name == chosen.schedule
    assert (pipe.microbatches, pipe.chunks, pipe.balance) == \
        (chosen.microbatches, chosen.chunks, list(chosen.balance))
    assert chosen.predicted_step_seconds > 0 and len(chosen.predicted_peak_bytes) == dist.get_world_size()
    assert chosen.summary() and chosen.table().count("\n") >= len(chosen.candidates)
    _train_like_the_unsplit_model(pipe)
    path = _plan_path("configuration")
    if dist.get_rank() == 0:
        pipe.plan.save(path)
    dist.barrier()
    again = pd.PipeDream(make_model(), F.cross_entropy, balance=path, timeout=60)
    assert again.configuration.to_dict() == chosen.to_dict()
    assert (again.schedule_name, again.microbatches, again.chunks, again.balance) == \
        (pipe.schedule_name, pipe.microbatches, pipe.chunks, pipe.balance)
    # "auto" beside such a file takes the file's choice (no sample: nothing is measured).
    auto = pd.PipeDream(make_model(), F.cross_entropy, balance=path, schedule="auto",
                        microbatches="auto", timeout=60)
    assert auto.configuration.to_dict() == chosen.to_dict() and auto.schedule_name == chosen.schedule
    other = "gpipe" if chosen.schedule != "gpipe" else "1f1b"
    with pytest.raises(ValueError, match=rf"schedule='{other}' differs from the plan's configuration "
                                         rf"\(schedule='{chosen.schedule}'\)"):
        pd.PipeDream(make_model(), F.cross_entropy, balance=path, schedule=other, timeout=60)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)


class Branchy(nn.Module):
    """Not an nn.Sequential: torch.fx traces it (a skip connection crosses a cut)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                                          nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = h + torch.tanh(self.b(h))
        return self.d(torch.relu(self.c(h)))


def check_auto_configuration_traced() -> None:
    """A traced model with schedule/microbatches="auto": cut as the chosen balance over its
    groups; loss and gradients equal the unsplit model's."""
    import pipedream_ext as pd

    x, y = batch(n=16)
    pipe = pd.PipeDream(Branchy(), F.cross_entropy, schedule="auto", microbatches="auto",
                        sample=(x, y), timeout=60)
    chosen = pipe.configuration
    assert _same_everywhere(json.dumps(chosen.to_dict(), sort_keys=True)), "ranks chose differently"
    assert pipe.split_points and pipe.num_stages == len(chosen.balance) == dist.get_world_size()
    assert pipe.microbatches == chosen.microbatches and pipe.schedule_name == chosen.schedule
    ref = Branchy()
    want = F.cross_entropy(ref(x), y)
    want.backward()
    assert abs(pipe.step(x, y) - want.item()) <= 1e-5
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, expected[name].grad, f"traced {chosen.balance} grad {name}")


def check_memory_forces_recompute() -> None:
    """memory= between the peaks predicted with and without recompute: the search
    recomputes; one below every peak is refused naming the limit."""
    import pipedream_ext as pd

    x, y = batch(n=16)
    fixed = dict(schedule="gpipe", microbatches=4, balance=[4, 4], sample=(x, y), timeout=60)
    # A configuration the user fixed is predicted too (sample= given).
    peaks = [max(pd.PipeDream(make_model(), F.cross_entropy, recompute=r, **fixed)
                 .configuration.predicted_peak_bytes) for r in (False, True)]
    assert peaks[1] < peaks[0], peaks  # else the limit below could not force anything
    limit = (peaks[0] + peaks[1]) / 2
    pipe = pd.PipeDream(make_model(), F.cross_entropy, recompute="auto", memory=limit, **fixed)
    assert any(pipe.configuration.recompute), pipe.configuration.to_dict()
    assert max(pipe.configuration.predicted_peak_bytes) <= limit
    _train_like_the_unsplit_model(pipe)
    with pytest.raises(ValueError, match=r"memory"):
        pd.PipeDream(make_model(), F.cross_entropy, recompute="auto", memory=peaks[1] / 100, **fixed)


def check_prediction_warning() -> None:
    """A prediction far from what runs (a plan file whose prediction was made 1000x too
    fast): one warning per rank after the first steps, naming the largest term; stats()
    keeps both step times."""
    import warnings

    import pipedream_ext as pd

    x, y = batch(n=16)
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches="auto",
                        sample=(x, y), timeout=60)
    assert pipe.schedule_name == "1f1b" and pipe.plan.configuration is not None
    doctored = json.loads(pipe.plan.to_json())
    prediction = doctored["configuration"]["prediction"]
    for key in ("step_seconds", "pipeline_seconds", "overhead_seconds", "all_reduce_seconds"):
        prediction[key] /= 1000
    for key in ("compute_seconds", "wait_seconds", "transfer_seconds"):
        prediction[key] = [v / 1000 for v in prediction[key]]
    path = _plan_path("doctored")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(doctored, f)
    dist.barrier()
    slow = pd.PipeDream(make_model(), F.cross_entropy, balance=path, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            slow.step(x, y)
    mine = [str(w.message) for w in caught if "predicted" in str(w.message)]
    assert len(mine) == 1, mine
    assert re.search(r"measured step time [\d.]+ ms differs from the predicted [\d.]+ ms by more "
                     r"than 25%; the largest difference is (compute|waits|transfers|all-reduce|"
                     r"overhead)", mine[0]), mine[0]
    stats = slow.stats()
    assert stats["predicted_step_seconds"] == pytest.approx(prediction["step_seconds"])
    assert stats["measured_step_seconds"] > 1.25 * stats["predicted_step_seconds"]
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)


def check_forward_only() -> None:
    import pipedream_ext as pd

    ref = make_model()
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=3, timeout=60)
    # Evaluation and training interleaved with different batch sizes: the same
    # transfer slots carry changing shapes (pre-posted receives get redirected).
    for n, train in ((7, False), (9, True), (7, False), (5, False), (9, True), (9, False)):
        x, y = batch(n=n, seed=n)
        if train:
            pipe.train()
            loss = pipe.step(x, y)
            expected = F.cross_entropy(ref(x), y).item()
            assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), (loss, expected)
            continue
        pipe.eval()
        out = pipe.forward_only(x)
        if pipe.is_last:
            assert_close(out, ref(x).detach(), f"forward_only output, batch {n}")
        else:
            assert out is None
    pipe.train()


class Heads(nn.Module):
    """The last layer: outputs that are and are not batch-first (``forward_only``'s merge)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, h: torch.Tensor):  # type: ignore[no-untyped-def]
        if self.kind == "vector":  # a [10] statistic over the rows beside per-row logits
            return h, h.sum(0)
        if self.kind == "sequence-first":  # [3, B, 10], as a decoder over time steps returns it
            return torch.stack([h, 2 * h, h.square()])
        if self.kind == "flattened":  # batch-major [B * 3, 10], as logits flattened for the loss
            return torch.stack([h, 2 * h, h.square()], dim=1).reshape(-1, h.shape[1])
        if self.kind == "rows":  # a count that differs between microbatches
            return {"logits": h, "rows": h.shape[0]}
        return {"logits": h, "loss": h.square().mean(), "tag": "scores", "width": h.shape[1]}


def check_forward_only_merge() -> None:
    """Only outputs with each microbatch's rows along ``output_batch_dim`` are concatenated:
    a [10] output and a sequence-first [3, B, 10] one are refused by name on every rank
    (not returned as [40] / [12, 4, 10]), the latter comes back whole with
    output_batch_dim=1, each microbatch's output with None; a batch-major flattened output
    ([B * 3, 10]) and a dict of per-row logits, a mean and equal other values equal the
    unsplit model's output."""
    import pipedream_ext as pd

    x = batch(n=16, seed=3)[0]
    uneven = batch(n=10, seed=4)[0]  # microbatches of 3, 3, 2, 2 rows

    def pipeline(kind: str):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.ReLU(), Heads(kind)).eval()
        pipe = pd.PipeDream(model, lambda out, t: out.sum(), schedule="1f1b", microbatches=4,
                            timeout=60).eval()
        return model, pipe

    def refused(pipe, data, pattern: str, **kwargs: object) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(ValueError, match=pattern):
            pipe.forward_only(data, **kwargs)

    model, pipe = pipeline("vector")
    refused(pipe, x, r"forward_only\(\) failed on rank \d: forward_only\(\): output\[1\] has shape \[10\] in "
                     r"microbatch 0 of 4 rows \(the batch of 16 rows is cut into 4 microbatches of 4, 4, 4, 4 "
                     r"rows along dim 0\), so its dim 0 is not a batch dimension .* no dim of it has each "
                     r"microbatch's rows: pass output_batch_dim=None for the list of the 4 microbatches' outputs")
    parts = pipe.forward_only(x, output_batch_dim=None)
    if pipe.is_last:
        assert len(parts) == 4
        for part, rows in zip(parts, torch.tensor_split(x, 4)):
            for got, want in zip(part, model(rows)):
                assert_close(got, want, "forward_only(output_batch_dim=None): one microbatch's output")
    refused(pipe, x, r"output_batch_dim='0': use the dim of the outputs that holds", output_batch_dim="0")

    model, pipe = pipeline("sequence-first")
    refused(pipe, x, r"output has shape \[3, 4, 10\] .* its dim 1 has each microbatch's rows: pass "
                     r"forward_only\(\.\.\., output_batch_dim=1\)")
    # Rows 3, 3, 2, 2: dim 0 (3) has the first microbatches' rows, but not the third's.
    refused(pipe, uneven, r"output has shape \[3, 2, 10\] in microbatch 2 of 2 rows .* 4 microbatches of "
                          r"3, 3, 2, 2 rows")
    for dim in (1, -2):
        out = pipe.forward_only(x, output_batch_dim=dim)
        if pipe.is_last:
            assert_close(out, model(x), f"a sequence-first output, output_batch_dim={dim}")

    model, pipe = pipeline("flattened")  # dim 0: 3 x each microbatch's rows, none has the rows
    for data in (x, uneven):
        out = pipe.forward_only(data)
        if pipe.is_last:
            assert_close(out, model(data), "a batch-major flattened output")

    model, pipe = pipeline("dict")
    out = pipe.forward_only(x)
    if pipe.is_last:
        want = model(x)
        assert set(out) == set(want) and out["tag"] == "scores" and out["width"] == 10
        assert_close(out["logits"], want["logits"], "forward_only dict: per-row logits")
        assert_close(out["loss"], want["loss"], "forward_only dict: a mean over rows")
    model, pipe = pipeline("rows")
    refused(pipe, uneven, r"output\['rows'\] is 3 in microbatch 0 but 2 in microbatch 2; a number or string "
                          r"cannot be combined")


def check_symmetric_bad_input() -> None:
    """Errors every rank detects before any communication: raised everywhere, no hang."""
    import pipedream_ext as pd

    world = dist.get_world_size()
    cases = [
        (dict(balance=[1] * (world - 1) + [100]), "sums to"),
        (dict(balance=[2] * (world + 1)), "balance lists"),
        (dict(schedule="1f1c"), "not supported by the runtime"),
        (dict(schedule="1f1b", vertical_sync=True), "vertical_sync=True needs schedule=.pipedream."),
        (dict(microbatches=0), "microbatches must be a positive integer"),
    ]
    for kwargs, needle in cases:
        args = dict(schedule="1f1b", microbatches=2)
        args.update(kwargs)
        with pytest.raises(ValueError, match=needle):
            pd.PipeDream(make_model(), F.cross_entropy, **args)
    tiny = nn.Sequential(*[nn.Linear(6, 6) for _ in range(world - 1)]) if world > 1 else None
    if tiny is not None:
        with pytest.raises(ValueError, match="needs? .*stages|layers but"):
            pd.PipeDream(tiny, F.cross_entropy)


def runtime_cases(world: int) -> Cases:
    cases = Cases()
    for schedule in SCHEDULES:
        for m in (1, 2, 4, 8):
            cases.add(check_gradients_and_training, schedule, m)
    if world >= 2:
        # Uneven balance; from 3 ranks on, stage 1 is the parameter-free Tanh alone.
        uneven = [3, 5] if world == 2 else [1] * (world - 1) + [8 - (world - 1)]
        cases.add(check_gradients_and_training, "1f1b", 4, balance=uneven)
        cases.add(check_gradients_and_training, "zb-h1", 4, balance=uneven)
    if world <= 3:
        tuple_balance = {1: None, 2: [2, 3], 3: [2, 1, 2]}[world]
        cases.add(check_gradients_and_training, "1f1b", 4, kind="tuple", balance=tuple_balance)
        cases.add(check_gradients_and_training, "gpipe", 2, kind="tuple", balance=tuple_balance)
    # Replicated stages: the replicas' gradients add up to the whole batch's.
    for layout in {2: [[1, 1]], 3: [[2, 1], [1, 2]], 4: [[2, 1, 1], [1, 1, 2], [2, 2]]}.get(world, []):
        cases.add(check_gradients_and_training, "1f1b", 4, replicas=layout)
        cases.add(check_gradients_and_training, "gpipe", 6, replicas=layout)
        cases.add(check_gradients_and_training, "zb-h1", 5, replicas=layout)  # split backward, replicated
    if world > 2:  # split backward, replicated and recomputed at once
        cases.add(check_gradients_and_training, "zb-h1", 4, replicas=[2] + [1] * (world - 2), recompute=True)
    cases.add(check_gradients_and_training, "1f1b", 4, recompute=True)
    cases.add(check_gradients_and_training, "zb-h1", 4, recompute=True)
    cases.add(check_recompute_with_dropout)
    cases.add(check_recompute_per_stage, "1f1b")
    cases.add(check_recompute_per_stage, "interleaved-1f1b")
    cases.add(check_calibrate)
    cases.add(check_auto_balance)
    if world == 2:
        cases.add(check_auto_configuration)
        cases.add(check_auto_configuration_traced)
        cases.add(check_memory_forces_recompute)
        cases.add(check_prediction_warning)
    cases.add(check_forward_only)
    cases.add(check_forward_only_merge)
    cases.add(check_symmetric_bad_input)
    return cases


# --------------------------------------------------------------------------- faults
def fault_case(case: str) -> None:
    """One rank misbehaves; returns normally only on the misbehaving rank's expected path."""
    import pipedream_ext as pd

    rank = dist.get_rank()
    model = make_model()
    pipe = pd.PipeDream(model, F.cross_entropy, schedule="1f1b", microbatches=2, timeout=5)
    x, y = batch()
    pipe.step(x, y)  # one good step first
    if case == "kill" and rank == 1:
        os.kill(os.getpid(), 9)
    if case == "missing-targets":
        y = None if pipe.is_last else y
    if case == "small-batch":
        x = x[:1] if pipe.is_first else x
    start = time.time()
    try:
        pipe.step(x, y)
    except Exception as exc:  # noqa: BLE001 - report any failure type
        print(f"RANK{rank} ERROR after {time.time() - start:.1f}s: {type(exc).__name__}: {exc}",
              flush=True)
        sys.stdout.flush()
        os._exit(3)
    print(f"RANK{rank} NO ERROR", flush=True)
    os._exit(0)


# --------------------------------------------------------------------------- pytest side
# `make test`: 2 ranks on Gloo (the fused protocol's default), 4 under NCCL's rules;
# `make test-all` also 3 ranks (other replica layouts of the same kinds) and 4 on Gloo.
LAUNCHES = [Launch(HERE, 2, runtime_cases), Launch(HERE, 3, runtime_cases, marks=(pytest.mark.slow,)),
            *strict_and_gloo(HERE, 4, runtime_cases)]


@parametrize_cases(*LAUNCHES)
def test_flush_schedules_match_the_unsplit_model(case: CaseRef) -> None:
    case.check()


def test_killed_rank_makes_the_others_fail_naming_it() -> None:
    start = time.time()
    results = launch_raw(HERE, 2, "kill", timeout=120)
    assert results[1].returncode == -9
    assert results[0].returncode == 3, results[0].stdout
    assert "rank 1" in results[0].stdout, results[0].stdout
    # Communication timeout is 5 s; allow process start-up on a busy machine.
    assert time.time() - start < 90


@pytest.mark.parametrize("case, bad_rank, needle", [
    ("missing-targets", 1, "needs the targets"),
    ("small-batch", 0, "smaller than microbatches=2"),
])
def test_one_sided_bad_input_fails_everywhere(case: str, bad_rank: int, needle: str) -> None:
    results = launch_raw(HERE, 2, case, timeout=120)
    assert all(r.returncode == 3 for r in results), [r.stdout for r in results]
    assert needle in results[bad_rank].stdout
    other = results[1 - bad_rank].stdout
    assert f"rank {bad_rank}" in other, other


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default=None)
    args = parser.parse_args()
    if args.fault:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        fault_case(args.fault)
        return
    worker_main(LAUNCHES)


if __name__ == "__main__":
    main()
