"""Deferred initialisation (a model built on the meta device) and ``pipe.load_state_dict``.

Two torchrun launches, both under the ``meta`` fixture:

* 2 ranks: a meta-built pipeline loaded with a full state dict trains like the
  unsplit model loaded with it (``1f1b``: loss every step and weights after 3
  SGD-momentum steps; ``pipedream``: like the same pipeline built whole, also
  after loading with minibatches in flight); bad input (missing / unexpected
  keys, wrong shape, a module without ``reset_parameters()``, a mask that
  ``reset_parameters()`` does not set) raises on every rank naming it; tensors
  ``init_fn`` left unset are refused by the first step on every rank, naming each
  rank's, until a load sets them, and a meta model's state dict is refused naming
  its entries; a meta-built pipeline with ``reset_parameters()`` saves a checkpoint.
* 4 ranks: the same with 4 stages saves another checkpoint, and the 2-rank
  checkpoint, consolidated, loads into a meta-built 4-rank pipeline.

In this process: both checkpoints hold identical weights, equal to
``pd.materialize`` and to a CPU model seeded layer by layer by hand; on one rank,
``pipe.named_buffers()``, the first call's refusal of unset tensors (and the warning
of a partial load) and the refusal of a meta model's state dict.

    PDMETA_DIR=/tmp/x torchrun --standalone --nproc-per-node 2 tests/test_deferred_init.py
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Type

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main
from torch import nn

HERE = os.path.abspath(__file__)
RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------- models
def make_model() -> nn.Sequential:
    """8 layers (4 ranks x 2), with BatchNorm buffers (compared in eval mode)."""
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.BatchNorm1d(12),
                         nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12), nn.Linear(12, 3))


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return make_model()


class Scale(nn.Module):
    """Owns a parameter but has no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Masked(nn.Linear):
    """A causal mask registered in ``__init__``: ``reset_parameters()`` does not set it."""

    def __init__(self) -> None:
        super().__init__(12, 12)
        self.register_buffer("mask", torch.ones(12, 12).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


def meta_model_masked() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), Masked(), nn.Linear(12, 3))


def pretrained() -> Dict[str, torch.Tensor]:
    """A full state dict unlike any initialisation (trained BatchNorm statistics too)."""
    torch.manual_seed(7)
    model = make_model()
    model[3].running_mean.uniform_(-1, 1)
    model[3].running_var.uniform_(0.5, 2)
    model[3].num_batches_tracked.fill_(5)
    return model.state_dict()


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def skip_biases(layer: nn.Module) -> None:
    """An ``init_fn`` that sets every weight and buffer but leaves the biases of the
    ``Linear`` layers to a state dict (that may never come)."""
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.3)
        elif isinstance(module, nn.BatchNorm1d):
            module.reset_parameters()


def _expect(error: Type[Exception], pattern: str, fn: Callable[[], object]) -> None:
    with pytest.raises(error) as info:
        fn()
    assert re.search(pattern, str(info.value)), str(info.value)


# --------------------------------------------------------------------------- worker checks
def check_flush_schedule_matches_unsplit() -> None:
    import pipedream_ext as pd

    state = pretrained()
    ref = make_model()
    ref.load_state_dict(state)
    pipe = pd.PipeDream(meta_model(), F.cross_entropy, schedule="1f1b", microbatches=2, timeout=60)
    assert all(not p.is_meta for p in pipe.parameters())
    rng = torch.get_rng_state()
    pipe.load_state_dict(state)
    assert torch.equal(rng, torch.get_rng_state())
    # BatchNorm on its loaded statistics: batch statistics would differ per microbatch.
    ref.eval(); pipe.eval()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = batch(step)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step(); ref_opt.zero_grad()
        loss = pipe.step(x, y)
        opt.step(); opt.zero_grad()
        assert abs(loss - ref_loss.item()) <= RTOL * max(1.0, abs(ref_loss.item())), (step, loss)
    expected = ref.state_dict()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"1f1b meta + load_state_dict: {name}: {m}")


def check_async_schedule_matches_whole_built() -> None:
    """``pipedream``: meta + load equals built whole + load; loading with minibatches in
    flight flushes them first and leaves exactly the loaded weights."""
    import pipedream_ext as pd

    state = pretrained()
    runs = []
    for meta in (False, True):
        model = meta_model() if meta else make_model()
        pipe = pd.PipeDream(model, F.cross_entropy, schedule="pipedream", microbatches=2,
                            timeout=60)
        if meta:  # minibatches in flight over uninitialised-then-reset weights
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for step in range(2):
                pipe.step(*batch(50 + step), optimizer=opt)
        pipe.load_state_dict(state)
        for name, value in pipe.state_dict().items():
            assert torch.equal(value, state[name]), f"pipedream: {name} not loaded exactly"
        opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
        losses = [pipe.step(*batch(step), optimizer=opt) for step in range(4)]
        pipe.flush()
        runs.append((losses, pipe.state_dict()))
    assert runs[0][0] == runs[1][0], runs
    for name, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], value, rtol=RTOL, atol=ATOL)


def check_bad_input() -> None:
    import pipedream_ext as pd

    pipe = pd.PipeDream(meta_model(), F.cross_entropy, schedule="1f1b", microbatches=2, timeout=60)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    state = pretrained()
    missing = {k: v for k, v in state.items() if k != "6.bias"}  # stage 1 (layers 4-7) on 2 ranks
    _expect(ValueError, r"load_state_dict failed on rank 1: the state dict lacks 1 key\(s\) of "
            r"stage 1 \(layers 4-7\): '6\.bias' \(missing keys\)", lambda: pipe.load_state_dict(missing))
    other = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 3)).state_dict()  # another model
    other["head.bias"] = torch.zeros(3)
    _expect(ValueError, r"failed on ranks 0, 1: the state dict has 3 key\(s\) this model does not "
            r"have: '1\.weight', '1\.bias', 'head\.bias' \(unexpected keys",
            lambda: pipe.load_state_dict(other))
    wrong = dict(state, **{"7.weight": torch.zeros(4, 12)})
    _expect(ValueError, r"'7\.weight' has shape \[4, 12\] but this model's is \[3, 12\]",
            lambda: pipe.load_state_dict(wrong))
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before[name]), f"a failed load changed {name}"
    # Only what exists is loaded with strict=False; this rank's missing keys come back.
    result = pipe.load_state_dict(missing, strict=False)
    assert result.missing_keys == (["6.bias"] if pipe.rank == 1 else [])
    # Construction: every rank raises, naming the module by its name in the model.
    with torch.device("meta"):
        no_reset = nn.Sequential(nn.Linear(6, 12), nn.Sequential(nn.Tanh(), Scale()), nn.Linear(12, 3))
    _expect(ValueError, r"module '1\.1' \(Scale: gain\) has parameters or buffers on the meta device "
            r"but no reset_parameters\(\).*pass PipeDream\(\.\.\., init_fn=fn\)",
            lambda: pd.PipeDream(no_reset, F.cross_entropy, microbatches=2, timeout=60))
    masked = meta_model_masked()
    _expect(ValueError, r"initialising the meta-device layers failed on rank 1: layer 2 \('2'\): "
            r"'2\.mask' on the meta device were not set by reset_parameters\(\)",
            lambda: pd.PipeDream(masked, F.cross_entropy, microbatches=2, timeout=60))
    # init_fn handles both: fn(layer) under the layer's seeded RNG.
    def init_fn(layer: nn.Module) -> None:
        for module in layer.modules():
            if isinstance(module, Scale):
                module.gain.fill_(2.0)
            elif isinstance(module, Masked):
                module.mask.copy_(torch.ones(12, 12).tril())
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

    # A fresh masked model: the refused one kept the layers it had materialised (NaN).
    for model in (no_reset, meta_model_masked()):
        pipe = pd.PipeDream(model, F.cross_entropy, microbatches=2, timeout=60, init_fn=init_fn)
        pipe.step(*batch(0))
    seed = dist.get_rank()  # a model that no single init_seed gives
    _expect(ValueError, r"ranks disagree on the pipeline configuration: init_seed is 0 on rank 0; "
            r"1 on rank 1",
            lambda: pd.PipeDream(meta_model(), F.cross_entropy, microbatches=2, timeout=60,
                                 init_seed=seed))
    # A bug in init_fn on one rank: every rank raises, naming it (no rank waits on a dead peer).
    def broken(layer: nn.Module) -> None:
        if isinstance(layer, Masked):
            raise TypeError("init_fn bug")
        init_fn(layer)

    _expect(RuntimeError, r"initialising the meta-device layers failed on rank 1: TypeError: init_fn bug",
            lambda: pd.PipeDream(meta_model_masked(), F.cross_entropy, microbatches=2, timeout=60,
                                 init_fn=broken))


def check_unset_tensors_raise_on_every_rank() -> None:
    """``init_fn`` left the biases unset: the first step raises on every rank naming each
    rank's; a partial load (``strict=False``) leaves one, which ``forward_only`` refuses
    too; a full load trains as the unsplit model. A meta model's state dict is refused,
    on every rank, naming its entries, before anything is copied."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(meta_model(), F.cross_entropy, schedule="1f1b", microbatches=2, timeout=60,
                        init_fn=skip_biases)
    x, y = batch(0)
    _expect(ValueError, r"step\(\): tensors built on the meta device were never set .*: rank 0: "
            r"'0\.bias', '2\.bias'; rank 1: '4\.bias', '6\.bias', '7\.bias'; nothing set them",
            lambda: pipe.step(x, y))
    _expect(ValueError, r"load_state_dict failed on ranks 0, 1: state dict entries '0\.weight', "
            r"'0\.bias', .* are on the meta device, which has shapes but no values",
            lambda: pipe.load_state_dict(meta_model().state_dict(), strict=False))
    state = pretrained()
    result = pipe.load_state_dict({k: v for k, v in state.items() if k != "6.bias"}, strict=False)
    assert result.missing_keys == (["6.bias"] if pipe.rank == 1 else [])
    _expect(ValueError, r"forward_only\(\): tensors built on the meta device were never set .*\): "
            r"rank 1: '6\.bias'; nothing set them", lambda: pipe.forward_only(x))
    _assert_loads_and_steps_like_the_model(pipe, state, x, y)


def _assert_loads_and_steps_like_the_model(pipe: Any, state: Dict[str, torch.Tensor],
                                           x: torch.Tensor, y: torch.Tensor) -> None:
    """After a full ``load_state_dict(state)`` the pipeline's eval loss is the model's."""
    pipe.load_state_dict(state)
    ref = make_model()
    ref.load_state_dict(state)
    ref.eval(); pipe.eval()
    expected = F.cross_entropy(ref(x), y).item()
    assert abs(pipe.step(x, y) - expected) <= RTOL * max(1.0, abs(expected))


def check_init_fn_may_assign_buffers() -> None:
    """init_fn may assign a buffer anew instead of filling it in place (``layer.mask =
    table()``, torchtitan's idiom for ``freqs_cis``, or ``register_buffer`` again): the
    pipeline keeps the new tensor and computes what the unsplit model does."""
    import pipedream_ext as pd

    tril = torch.ones(12, 12).tril()

    def assign(layer: nn.Module) -> None:
        if callable(getattr(layer, "reset_parameters", None)):
            layer.reset_parameters()
        if isinstance(layer, Masked):
            layer.mask = tril.clone()

    def register(layer: nn.Module) -> None:
        assign(layer)
        if isinstance(layer, Masked):
            layer.register_buffer("mask", tril.clone(), persistent=False)

    for init_fn in (assign, register):
        ref = pd.materialize(meta_model_masked(), init_fn=init_fn)
        pipe = pd.PipeDream(meta_model_masked(), F.cross_entropy, microbatches=2, timeout=60,
                            init_fn=init_fn)
        mask = dict(pipe.module.named_buffers()).get("2.mask")
        assert (mask is not None and torch.equal(mask, tril)) == (pipe.rank == 1), pipe.rank
        assert "2.mask" not in pipe.state_dict()  # still non-persistent
        x, y = batch(1)
        expected = F.cross_entropy(ref(x), y).item()
        assert abs(pipe.step(x, y) - expected) <= RTOL * max(1.0, abs(expected)), init_fn.__name__


def save_reset_parameters_checkpoint() -> None:
    """Meta-built, initialised by reset_parameters(): saved for the test process to compare."""
    import pipedream_ext as pd

    rng = torch.get_rng_state()
    world = dist.get_world_size()
    # 2 ranks: interleaved, so a rank keeps layers 0-1 and 4-5 (not one contiguous slice).
    schedule, chunks = ("interleaved-1f1b", 2) if world == 2 else ("1f1b", 1)
    pipe = pd.PipeDream(meta_model(), F.cross_entropy, schedule=schedule, chunks=chunks,
                        microbatches=2, timeout=60, init_seed=3)
    assert torch.equal(rng, torch.get_rng_state()), "deferred init changed the global RNG"
    pd.save_checkpoint(os.path.join(os.environ["PDMETA_DIR"], f"reset-{world}"), pipe)


def load_consolidated_checkpoint() -> None:
    """The 2-rank checkpoint, consolidated, into a meta-built 4-rank pipeline."""
    import pipedream_ext as pd

    state = pd.consolidate(os.path.join(os.environ["PDMETA_DIR"], "reset-2"))
    pipe = pd.PipeDream(meta_model(), F.cross_entropy, schedule="gpipe", microbatches=2, timeout=60)
    pipe.load_state_dict(state)
    own = pipe.state_dict()
    assert own and all(torch.equal(value, state[name]) for name, value in own.items())
    ref = make_model()
    ref.load_state_dict(state)
    ref.eval(); pipe.eval()
    x, y = batch(0)
    expected = F.cross_entropy(ref(x), y).item()
    assert abs(pipe.step(x, y) - expected) <= RTOL * max(1.0, abs(expected))


def deferred_cases(world: int) -> Cases:
    cases = Cases()
    if world == 2:
        cases.add(check_flush_schedule_matches_unsplit)
        cases.add(check_async_schedule_matches_whole_built)
        cases.add(check_bad_input)
        cases.add(check_init_fn_may_assign_buffers)
        cases.add(check_unset_tensors_raise_on_every_rank)
        cases.add(save_reset_parameters_checkpoint)
    else:
        cases.add(save_reset_parameters_checkpoint)
        cases.add(load_consolidated_checkpoint)
    return cases


TWO, FOUR = (Launch(HERE, world, deferred_cases, timeout=300) for world in (2, 4))


# --------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def meta_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("deferred"))


@parametrize_cases(TWO, FOUR)
def test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input(case: CaseRef,
                                                                          meta_dir: str) -> None:
    """1f1b and pipedream after load_state_dict, the errors, and a consolidated checkpoint
    (the 2-rank launch's) loading into a meta-built pipeline on 4 ranks."""
    if case.launch is FOUR:
        TWO.result(env={"PDMETA_DIR": meta_dir})  # its checkpoint first (run alone: pytest -k 4ranks)
    case.check(env={"PDMETA_DIR": meta_dir})


def test_named_buffers_are_the_stages_buffers_by_the_models_names(group: dist.ProcessGroup) -> None:
    import pipedream_ext as pd

    model = make_model()
    want = {name: b.clone() for name, b in model.named_buffers()}
    pipe = pd.PipeDream(model, F.cross_entropy, microbatches=2, timeout=60)
    held = dict(pipe.module.named_buffers())
    got = list(pipe.named_buffers())
    assert [name for name, _ in got] == list(want) == ["3.running_mean", "3.running_var",
                                                        "3.num_batches_tracked"]
    assert all(b is held[name] and torch.equal(b, want[name]) for name, b in got)
    assert [id(b) for b in pipe.buffers()] == [id(b) for _, b in got]


def test_the_first_call_refuses_tensors_nothing_set(group: dist.ProcessGroup,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """One rank: ``init_fn`` left the biases unset; step() and forward_only() refuse them by
    name, a partial load warns about the one it leaves, a full load trains."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(meta_model(), F.cross_entropy, microbatches=2, timeout=60, init_fn=skip_biases)
    x, y = batch(0)
    unset = r"rank 0: '0\.bias', '2\.bias', '4\.bias', '6\.bias', '7\.bias'; nothing set them"
    _expect(ValueError, r"^step\(\): tensors built on the meta device were never set .*" + unset,
            lambda: pipe.step(x, y))
    _expect(ValueError, r"^forward_only\(\): .*" + unset, lambda: pipe.forward_only(x))
    state = pretrained()
    with caplog.at_level("WARNING", logger="pipedream_ext._pipe"):
        result = pipe.load_state_dict({k: v for k, v in state.items() if k != "6.bias"}, strict=False)
    assert result.missing_keys == ["6.bias"] and "load_state_dict(): tensors" in caplog.text
    _expect(ValueError, r"step\(\): .*: rank 0: '6\.bias'; nothing set them", lambda: pipe.step(x, y))
    _assert_loads_and_steps_like_the_model(pipe, state, x, y)


def test_a_meta_models_state_dict_is_refused_naming_its_entries(group: dist.ProcessGroup) -> None:
    import pipedream_ext as pd

    pipe = pd.PipeDream(meta_model(), F.cross_entropy, microbatches=2, timeout=60)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    for strict in (True, False):  # strict=False once failed copying: "Cannot copy out of meta tensor"
        _expect(ValueError, r"load_state_dict failed on rank 0: state dict entries '0\.weight', "
                r"'0\.bias', .* and 7 more are on the meta device, which has shapes but no values.*"
                r"pd\.materialize\(model\)", lambda: pipe.load_state_dict(meta_model().state_dict(),
                                                                       strict=strict))
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())


@pytest.fixture(scope="module")
def saved(meta_dir: str) -> str:
    for launch in (TWO, FOUR):
        launch.check_all(env={"PDMETA_DIR": meta_dir})
    return meta_dir


def test_weights_do_not_depend_on_the_world_size(saved: str) -> None:
    import pipedream_ext as pd

    two = pd.consolidate(os.path.join(saved, "reset-2"))
    four = pd.consolidate(os.path.join(saved, "reset-4"))
    reference = pd.materialize(meta_model(), "cpu", seed=3).state_dict()
    by_hand = make_model()
    for l, layer in enumerate(by_hand):  # the documented rule, spelled out
        torch.manual_seed(3 * 2**16 + l)
        for module in layer.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    assert list(two) == list(four) == list(reference) == list(by_hand.state_dict())
    for name, value in by_hand.state_dict().items():
        for what, other in (("2 ranks", two), ("4 ranks", four), ("pd.materialize", reference)):
            assert torch.equal(other[name], value), f"{what}: {name} differs from the seeding rule"
    assert not torch.equal(two["0.weight"], pd.materialize(meta_model(), seed=4)[0].weight)


if __name__ == "__main__":
    worker_main([TWO, FOUR])
