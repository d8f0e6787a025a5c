"""Checkpoints: save, load in fresh processes (other balance, world size, replicas,
schedule), consolidate, and failures (CPU, Gloo, processes on localhost).

Two torchrun launches, so loading always happens in other processes than saving:

* ``save`` (3 ranks): per scenario, an uninterrupted run of N + M steps (the
  reference) and a run that saves after N steps and goes on (saving must not
  change it). Layouts: 3 stages; 2 stages with stage 0 replicated; and 2-rank
  pipelines (interleaved, pipedream, pipedream-2bw) on a subgroup of ranks 0, 1;
* ``resume`` (2 ranks): load every checkpoint into a fresh pipeline with other
  initial weights (other world size, balance, replicas or schedule, and the same
  layout for the asynchronous schedules), train M steps, compare with the
  reference; broken checkpoints, interrupted saves, bad arguments.

A killed save (SIGKILL at a random moment) runs as a 1-rank process. Standalone:
``PDCKPT_DIR=/tmp/ck PIPEDREAM_TEST_LAUNCH=save torchrun --standalone --nproc-per-node 3
tests/test_checkpoint.py``, then ``PIPEDREAM_TEST_LAUNCH=resume`` with 2 ranks.
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _multiprocess import (
    ROOT,
    CaseRef,
    Cases,
    FromEnv,
    Launch,
    free_port,
    parametrize_cases,
    strict_and_gloo,
    worker_main,
)
from torch import nn

HERE = os.path.abspath(__file__)
N, M = 3, 3  # steps before the checkpoint, steps after it
RTOL, ATOL = 1e-6, 1e-7
# How each checkpoint is saved (3-rank launch; "pair": on ranks 0 and 1 only).
SCENARIOS: Dict[str, Dict[str, Any]] = {
    "sgd": dict(schedule="1f1b", microbatches=4, opt="sgd", scheduler=True),  # [3, 3, 2]
    # SGD: Adam would amplify rounding noise where the gradient is ~0 (a bias before a
    # BatchNorm), and another layout sums the replicas' gradients in another order.
    "replicated": dict(schedule="1f1b", microbatches=4, replicas=[2, 1], opt="sgd"),  # [4, 4]
    "interleaved": dict(schedule="interleaved-1f1b", microbatches=4, chunks=2, opt="adam-named",
                        pair=True),
    "pipedream": dict(schedule="pipedream", microbatches=1, opt="adam", pair=True),
    "2bw": dict(schedule="pipedream-2bw", microbatches=2, opt="sgd", pair=True),
}


# --------------------------------------------------------------------------- model and training
def make_model(seed: int = 0, variant: str = "") -> nn.Sequential:
    """8 layers with a BatchNorm (buffers) in the second half."""
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12),
              nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3)]
    if variant == "relu1":
        layers[1] = nn.ReLU()
    elif variant == "nobias":
        layers[2] = nn.Linear(12, 12, bias=False)
    elif variant == "wide-head":
        layers[7] = nn.Linear(12, 4)
    elif variant == "short":
        del layers[6]
    return nn.Sequential(*layers)


def batch(t: int, n: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def build(scenario: Dict[str, Any], seed: int = 0, variant: str = "",  # type: ignore[no-untyped-def]
          group: Optional[dist.ProcessGroup] = None):
    import pipedream_ext as pd

    pipe = pd.PipeDream(make_model(seed, variant), F.cross_entropy, schedule=scenario["schedule"],
                        microbatches=scenario["microbatches"], balance=scenario.get("balance"),
                        chunks=scenario.get("chunks", 1), replicas=scenario.get("replicas"),
                        process_group=group, timeout=60)
    params = list(pipe.parameters())
    opt = sched = None
    if params:
        if scenario["opt"] == "sgd":
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        elif scenario["opt"] == "adam-named":  # param groups with "param_names"
            opt = torch.optim.Adam(pipe.named_parameters(), lr=0.01)
        else:
            opt = torch.optim.Adam(params, lr=0.01)
        if scenario.get("scheduler"):
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return pipe, opt, sched


def train(pipe, opt, sched, steps: range) -> None:  # type: ignore[no-untyped-def]
    for t in steps:
        x, y = batch(t)
        if pipe.asynchronous:
            pipe.step(x, y, optimizer=opt)
        else:
            pipe.step(x, y)
            if opt is not None:
                opt.step()
                opt.zero_grad()
        if sched is not None:
            sched.step()


def merged(root: str, prefix: str) -> Dict[str, torch.Tensor]:
    """The whole model's state from per-rank files written by the save phase."""
    state: Dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(root, f"{prefix}-rank*.pt"))):
        state.update(torch.load(path, weights_only=True))
    assert state, f"no {prefix}-rank*.pt under {root}"
    return state


def assert_state(pipe, expected: Dict[str, torch.Tensor], what: str,  # type: ignore[no-untyped-def]
                 exact: bool = False, atol: float = ATOL, parameters_only: bool = False) -> None:
    local = {k: p.detach() for k, p in pipe.named_parameters()} if parameters_only else pipe.state_dict()
    assert local, what
    if os.environ.get("PDCKPT_DEBUG"):
        worst = max(float((v.double() - expected[k].double()).abs().max()) for k, v in local.items())
        print(f"rank {dist.get_rank()}: {what}: max abs difference {worst:.3g}", flush=True)
    for key, value in local.items():
        rtol, tol = (0.0, 0.0) if exact else (RTOL, atol)
        torch.testing.assert_close(value, expected[key], rtol=rtol, atol=tol,
                                   msg=lambda m: f"{what}: {key}: {m}")


def shared_copy(src: str, dst: str) -> None:
    """Rank 0 copies a checkpoint directory; every rank waits for it."""
    if dist.get_rank() == 0:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    dist.barrier()


def on_rank0(fn) -> None:  # type: ignore[no-untyped-def]
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


# --------------------------------------------------------------------------- phases (torchrun side)
def phase_save(root: str) -> None:
    import pipedream_ext as pd

    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    for name, scenario in SCENARIOS.items():
        group = pair if scenario.get("pair") else None
        if group is not None and rank > 1:
            continue
        pipe, opt, sched = build(scenario, group=group)
        train(pipe, opt, sched, range(N))
        pipe.flush()  # saving flushes an asynchronous pipeline; so does the reference
        train(pipe, opt, sched, range(N, N + M))
        pipe.flush()
        torch.save(pipe.state_dict(), os.path.join(root, f"ref-{name}-rank{rank}.pt"))

        pipe, opt, sched = build(scenario, group=group)
        train(pipe, opt, sched, range(N))
        extra = {"scheduler": sched.state_dict() if sched else None, "tensor": torch.arange(3),
                 "note": name}
        info = pd.save_checkpoint(os.path.join(root, f"ckpt-{name}"), pipe, opt, step=N, extra=extra)
        assert info.generation == 1 and info.step == N
        torch.save(pipe.state_dict(), os.path.join(root, f"atN-{name}-rank{rank}.pt"))
        train(pipe, opt, sched, range(N, N + M))
        pipe.flush()
        dist.barrier(group=group)
        assert_state(pipe, merged(root, f"ref-{name}"), f"{name}: saving changed the run", exact=True)
    dist.barrier()


def resume(root: str, name: str, pre_steps: int = 0, atol: float = ATOL, **override: Any) -> None:
    """A fresh pipeline (other initial weights) loads checkpoint ``name``, trains M
    steps and must equal the uninterrupted N + M run (``atol``: where the layouts sum
    replica gradients in another order)."""
    import pipedream_ext as pd

    scenario = dict(SCENARIOS[name], pair=False, balance=None, replicas=None, chunks=1)
    if scenario["schedule"] in ("interleaved-1f1b", "pipedream", "pipedream-2bw"):
        scenario.update(SCENARIOS[name])  # saved on 2 ranks: the same layout by default
    scenario.update(override)
    what = f"{name} -> {override or 'same layout'}"
    pipe, opt, sched = build(scenario, seed=99)
    # An asynchronous pipeline in use: loading flushes it, then overwrites everything.
    train(pipe, opt, sched, range(100, 100 + pre_steps))
    info = pd.load_checkpoint(os.path.join(root, f"ckpt-{name}"), pipe, opt)
    assert info.step == N and info.generation == 1 and info.extra["note"] == name
    assert torch.equal(info.extra["tensor"], torch.arange(3))
    if sched is not None:
        sched.load_state_dict(info.extra["scheduler"])
    assert_state(pipe, merged(root, f"atN-{name}"), f"{what}: right after loading", exact=True)
    train(pipe, opt, sched, range(N, N + M))
    pipe.flush()
    # Replicas of a stage each run part of the microbatches, so a replicated
    # BatchNorm's running statistics differ from an unreplicated one's: compare the
    # parameters there.
    replicated_buffers = any(r > 1 and any(True for _ in pipe._stages[j].buffers())
                             for j, r in enumerate(pipe.replicas) if j in pipe.local_stages)
    assert_state(pipe, merged(root, f"ref-{name}"), f"{what}: after {M} more steps", atol=atol,
                 parameters_only=replicated_buffers)


def check_broken_checkpoints(root: str) -> None:
    import pipedream_ext as pd
    from pipedream_ext import CheckpointError

    sgd = SCENARIOS["sgd"]
    src = os.path.join(root, "ckpt-sgd")
    bad = os.path.join(root, f"broken-{os.environ.get('MASTER_PORT', 'x')}")

    def load(variant: str = "", opt_kind: Optional[str] = None, path: str = bad):  # type: ignore[no-untyped-def]
        pipe, opt, _ = build(dict(sgd, opt=opt_kind or "sgd"), seed=7, variant=variant)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        try:
            return pd.load_checkpoint(path, pipe, opt)
        finally:  # a failed load changes nothing, on any rank
            for k, v in pipe.state_dict().items():
                assert torch.equal(v, before[k]), f"a failed load changed {k}"

    # The model does not fit: different layers, a missing or extra parameter, shapes.
    with pytest.raises(CheckpointError, match="checkpoint's model has 8 layers .* this pipeline's model has 7"):
        load("short", path=src)
    with pytest.raises(CheckpointError, match=r"layer 1 is '1' \(Tanh\) in the checkpoint but '1' \(ReLU\)"):
        load("relu1", path=src)
    with pytest.raises(CheckpointError, match=r"g000001-stage000-model\.pt .*has '2\.bias', which this "
                                              r"model does not have"):
        load("nobias", path=src)
    with pytest.raises(CheckpointError, match=r"g000001-stage002-model\.pt .*'7\.weight' has shape "
                                              r"\[3, 12\] in the checkpoint but \[4, 12\]"):
        load("wide-head", path=src)
    with pytest.raises(CheckpointError, match=r"g000001-stage000-optim\.pt .*state of a "
                                              r"torch\.optim\.sgd\.SGD, not of a torch\.optim\.adam\.Adam"):
        load(opt_kind="adam", path=src)
    # A checkpoint missing a parameter this model has.
    pipe, _, _ = build(sgd, variant="nobias")
    pd.save_checkpoint(bad, pipe)  # no optimizer
    with pytest.raises(CheckpointError, match=r"g000001-stage000-model\.pt .*no entry for '2\.bias'"):
        load()
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load("nobias")
    # Incomplete or damaged files: every rank raises, naming the file.
    shared_copy(src, bad)
    on_rank0(lambda: os.remove(os.path.join(bad, "manifest.json")))
    with pytest.raises(CheckpointError, match="is not a complete checkpoint: manifest.json is missing"):
        load()
    shared_copy(src, bad)
    stage2 = os.path.join(bad, "g000001-stage002-model.pt")
    on_rank0(lambda: os.truncate(stage2, os.path.getsize(stage2) // 2))
    with pytest.raises(CheckpointError, match=r"failed on rank 1: .*g000001-stage002-model\.pt "
                                              r"\(weights of stage 2, layers 6\.\.7\) has \d+ bytes but "
                                              r"the manifest says \d+: the file is truncated"):
        load()
    shared_copy(src, bad)
    on_rank0(lambda: os.remove(os.path.join(bad, "g000001-stage000-optim.pt")))
    with pytest.raises(CheckpointError, match=r"failed on rank 0: .* not a complete checkpoint: "
                                              r"g000001-stage000-optim\.pt \(optimizer state of stage 0, "
                                              r"layers 0\.\.2\) is missing"):
        load()

    def flip_byte() -> None:
        with open(stage2, "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
    shared_copy(src, bad)
    on_rank0(flip_byte)
    with pytest.raises(CheckpointError, match=r"g000001-stage002-model\.pt .*does not match the sha256"):
        load()
    on_rank0(lambda: shutil.rmtree(bad))


def check_paths_must_agree(path: str, pipe, opt, fmt: str, still_previous) -> None:  # type: ignore[no-untyped-def]
    """A save into ``path`` on every rank but the last, ``path + "-typo"`` there, is
    refused on every rank before anything is written; with that check off (as if the
    ranks shared no file system), rank 0 refuses to write the manifest. Either way
    ``path`` keeps its files and its checkpoint loads (``still_previous``). Loading
    with the same two paths is refused too."""
    import pipedream_ext as pd
    import pipedream_ext._checkpoint.directory as directory
    import pipedream_ext._checkpoint.phases as phases
    from pipedream_ext import CheckpointError

    last = dist.get_world_size() - 1
    resolved, typo = os.path.realpath(path), os.path.realpath(path) + "-typo"
    mine = path + "-typo" if dist.get_rank() == last else path
    before = sorted(os.listdir(path))
    with pytest.raises(ValueError, match=rf"the ranks were given different directories: {re.escape(resolved)} "
                                         rf"on ranks? 0.*; {re.escape(typo)} on rank {last}\. Every rank must "
                                         r"pass the same directory.*nothing was written or deleted"):
        pd.save_checkpoint(mine, pipe, opt, step=7, format=fmt)
    dist.barrier()
    assert sorted(os.listdir(path)) == before and not os.path.exists(typo)
    still_previous()
    real_check, real_written_by = directory.check_same, phases.written_by
    directory.check_same = lambda *args: None
    try:
        with pytest.raises(CheckpointError, match=rf"did not all write generation 2 into {re.escape(resolved)} "
                                                  rf"\(rank {last}: generation 2 in {re.escape(typo)}\)"):
            pd.save_checkpoint(mine, pipe, opt, step=7, format=fmt)
        phases.written_by = lambda directory, generation: {"resolved": "/shared", "generation": generation}
        with pytest.raises(CheckpointError, match=r"is missing on rank 0, which writes the manifest: the ranks "
                                                  r"wrote into different directories, or the directory is not "
                                                  r"on a file system all ranks share"):
            pd.save_checkpoint(mine, pipe, opt, step=7, format=fmt)
    finally:
        directory.check_same, phases.written_by = real_check, real_written_by
    dist.barrier()
    assert sorted(os.listdir(path)) == before, (sorted(os.listdir(path)), before)
    still_previous()
    shared_copy(path, typo)  # two checkpoints: loading each on some ranks would mix them
    with pytest.raises(ValueError, match=rf"loading checkpoint .*: the ranks were given different directories: "
                                         rf"{re.escape(resolved)} on ranks? 0.*; {re.escape(typo)} on rank {last}\. "
                                         r".*nothing was loaded"):
        pd.load_checkpoint(mine, pipe, opt)
    on_rank0(lambda: shutil.rmtree(typo))


def check_interrupted_saves(root: str) -> None:
    """A save that fails before its manifest leaves the previous checkpoint loadable;
    the next successful save replaces it and removes the leftovers."""
    import pipedream_ext as pd
    import pipedream_ext._checkpoint.durable_io as durable_io
    import pipedream_ext._checkpoint.manifest as manifest_format
    from pipedream_ext import CheckpointError

    rank = dist.get_rank()
    path = os.path.join(root, f"interrupted-{os.environ.get('MASTER_PORT', 'x')}")
    shared_copy(os.path.join(root, "ckpt-sgd"), path)
    original = sorted(os.listdir(path))
    at_n = merged(root, "atN-sgd")
    pipe, opt, sched = build(SCENARIOS["sgd"], seed=99)  # other weights than the checkpoint's

    def still_previous() -> None:
        fresh, fresh_opt, _ = build(SCENARIOS["sgd"], seed=5)  # 2 stages, the checkpoint has 3
        assert pd.load_checkpoint(path, fresh, fresh_opt).generation == 1
        assert_state(fresh, at_n, "previous checkpoint after an interrupted save", exact=True)

    check_paths_must_agree(path, pipe, opt, "pipedream", still_previous)

    # 1. rank 0 fails while writing the manifest (all stage files of generation 2 are in
    # place): it removes them.
    real_manifest, real_save = manifest_format.write_manifest, durable_io.atomic_torch_save

    def crash_in_manifest(directory: str, manifest: Any) -> None:
        with open(os.path.join(directory, "manifest.json.tmp"), "w") as f:
            f.write('{"format": "pipedream_ext-checkpoint", "genera')  # half written
        raise OSError("simulated crash while writing the manifest")
    manifest_format.write_manifest = crash_in_manifest
    try:
        with pytest.raises(CheckpointError, match="simulated crash while writing the manifest"):
            pd.save_checkpoint(path, pipe, opt, step=99)
    finally:
        manifest_format.write_manifest = real_manifest
    # Its generation's files went; the manifest's half-written .tmp (as a crash leaves
    # it) is overwritten by the next save.
    assert sorted(set(os.listdir(path)) - {"manifest.json.tmp"}) == original, sorted(os.listdir(path))
    still_previous()

    # 2. rank 1 fails half-way through its stage file.
    def crash_in_stage_file(obj: Any, directory: str, name: str) -> Dict[str, Any]:
        if rank == 1:
            with open(os.path.join(directory, name + ".tmp"), "wb") as f:
                f.write(b"PK\x03\x04 half a file")
            raise OSError(f"simulated crash while writing {name}")
        return real_save(obj, directory, name)
    durable_io.atomic_torch_save = crash_in_stage_file
    try:
        with pytest.raises(CheckpointError, match=r"failed on rank 1: OSError: simulated crash while "
                                                  r"writing g000002-stage001-model\.pt"):
            pd.save_checkpoint(path, pipe, opt, step=99)
    finally:
        durable_io.atomic_torch_save = real_save
    dist.barrier()  # rank 0 removes the failed generation once it raised
    assert not [n for n in os.listdir(path) if n.startswith("g000002")], os.listdir(path)
    still_previous()

    # 3. A complete save replaces it and removes every superseded file.
    info = pd.save_checkpoint(path, pipe, opt, step=99)
    assert info.generation == 2
    files = sorted(os.listdir(path))
    assert files == ["g000002-stage000-model.pt", "g000002-stage000-optim.pt",
                     "g000002-stage001-model.pt", "g000002-stage001-optim.pt",
                     "manifest.json"], files
    fresh, fresh_opt, _ = build(SCENARIOS["sgd"], seed=5)
    assert pd.load_checkpoint(path, fresh, fresh_opt).step == 99
    for (key, saved), (_, loaded) in zip(pipe.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(saved, loaded), key
    on_rank0(lambda: shutil.rmtree(path))


def check_bad_save_arguments(root: str) -> None:
    import pipedream_ext as pd

    pipe, opt, _ = build(SCENARIOS["sgd"])
    path = os.path.join(root, f"args-{os.environ.get('MASTER_PORT', 'x')}")
    with pytest.raises(ValueError, match=r"extra\['f'\] is a function"):
        pd.save_checkpoint(path, pipe, opt, extra={"f": lambda: 0})
    with pytest.raises(ValueError, match="optimizer= was given on ranks \\[0\\] but not on ranks \\[1\\]"):
        pd.save_checkpoint(path, pipe, opt if dist.get_rank() == 0 else None)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        pd.save_checkpoint(path, pipe, opt, step=-1)
    assert not os.path.exists(os.path.join(path, "manifest.json"))
    dist.barrier()
    on_rank0(lambda: shutil.rmtree(path, ignore_errors=True))


def resume_cases(world: int) -> Cases:
    root = FromEnv("PDCKPT_DIR")
    cases = Cases()
    cases.add(resume, root, "sgd")                       # saved as 3 stages [3, 3, 2], loaded as [4, 4]
    cases.add(resume, root, "sgd", balance=[6, 2])
    cases.add(resume, root, "sgd", balance=[8], replicas=[2], atol=1e-6)  # one stage on 2 replicas (data parallel)
    cases.add(resume, root, "replicated", atol=1e-6)     # saved as [4, 4] with replicas [2, 1]
    cases.add(resume, root, "replicated", balance=[3, 5], atol=1e-6)
    cases.add(resume, root, "interleaved")               # 4 stages on 2 ranks, as saved
    cases.add(resume, root, "interleaved", schedule="gpipe", chunks=1, balance=[5, 3])
    cases.add(resume, root, "pipedream")
    cases.add(resume, root, "pipedream", pre_steps=2)    # the async pipeline was in use before loading
    cases.add(resume, root, "2bw")
    cases.add(check_broken_checkpoints, root)
    cases.add(check_interrupted_saves, root)
    cases.add(check_bad_save_arguments, root)
    return cases


def save_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(phase_save, FromEnv("PDCKPT_DIR"), name="save")
    return cases


# `make test` saves and resumes under NCCL's rules, `make test-all` on Gloo too (each
# backend resumes what it saved).
SAVE, SAVE_GLOO = strict_and_gloo(HERE, 3, save_cases, name="save", timeout=300)
RESUME, RESUME_GLOO = strict_and_gloo(HERE, 2, resume_cases, name="resume", timeout=300)


def phase_kill_loop(root: str) -> None:
    """1 rank: saves over and over, every tensor filled with the save's step."""
    import pipedream_ext as pd

    pipe, opt, _ = build(SCENARIOS["sgd"])
    train(pipe, opt, None, range(1))
    for step in range(100000):
        with torch.no_grad():
            for value in pipe.state_dict().values():
                value.fill_(step)
            for state in opt.state.values():
                state["momentum_buffer"].fill_(step)
        pd.save_checkpoint(root, pipe, opt, step=step, extra={"step": step})
        print(f"saved {step}", flush=True)


# --------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def saved_by(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Launch], str]:
    """The folder ``save``'s launch (run the first time it is asked for) wrote: checkpoints
    after N steps, the weights then, and the uninterrupted N + M references."""
    folders: Dict[str, str] = {}

    def folder(launch: Launch) -> str:
        if launch.name not in folders:
            folders[launch.name] = str(tmp_path_factory.mktemp("checkpoints"))
            launch.check_all(env={"PDCKPT_DIR": folders[launch.name]})
        return folders[launch.name]
    return folder


@pytest.fixture(scope="module")
def saved(saved_by: Callable[[Launch], str]) -> str:
    return saved_by(SAVE)


@parametrize_cases(RESUME, RESUME_GLOO)
def test_resume_in_other_processes_equals_an_uninterrupted_run(case: CaseRef,
                                                               saved_by: Callable[[Launch], str]) -> None:
    """3 -> 2 ranks, other balance, replicas -> none -> data parallel, interleaved
    -> gpipe, pipedream and 2bw; broken checkpoints, interrupted saves."""
    case.check(env={"PDCKPT_DIR": saved_by(SAVE if case.launch is RESUME else SAVE_GLOO)})


def test_consolidate_gives_the_unsplit_models_state_dict(saved: str, tmp_path) -> None:
    import pipedream_ext as pd
    from pipedream_ext.__main__ import main as cli

    for name in ("sgd", "interleaved"):
        path = os.path.join(saved, f"ckpt-{name}")
        state = pd.consolidate(path)
        expected = merged(saved, f"atN-{name}")
        model = make_model(seed=3)
        assert list(state) == list(model.state_dict())  # the unsplit model's order
        model.load_state_dict(state)  # strict
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), key
    # The CLI, then plain torch (weights_only) into the unsplit model.
    out = str(tmp_path / "model.pt")
    result = subprocess.run([sys.executable, "-m", "pipedream_ext", "consolidate",
                             os.path.join(saved, "ckpt-replicated"), "-o", out],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "8 layers" in result.stdout and "step 3" in result.stdout, result.stdout
    model = make_model(seed=3)
    model.load_state_dict(torch.load(out, weights_only=True))
    expected = merged(saved, "atN-replicated")
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())

    # Broken checkpoints: a clear error naming the file (exit code 2 from the CLI).
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(saved, "ckpt-sgd"), broken)
    stage1 = os.path.join(broken, "g000001-stage001-model.pt")
    os.truncate(stage1, 100)
    with pytest.raises(pd.CheckpointError, match=r"g000001-stage001-model\.pt \(weights of stage 1, "
                                                 r"layers 3\.\.5\) has 100 bytes .* truncated"):
        pd.consolidate(broken)
    os.remove(stage1)
    with pytest.raises(pd.CheckpointError, match=r"not a complete checkpoint: g000001-stage001-model\.pt"):
        pd.consolidate(broken)
    os.remove(os.path.join(broken, "manifest.json"))
    with pytest.raises(pd.CheckpointError, match="not a complete checkpoint: manifest.json is missing"):
        pd.consolidate(broken)
    assert cli(["consolidate", broken, "-o", str(tmp_path / "x.pt")]) == 2
    assert not os.path.exists(tmp_path / "x.pt")
    with pytest.raises(pd.CheckpointError, match="no such checkpoint directory"):
        pd.consolidate(str(tmp_path / "nowhere"))


def kill_a_save_loop(script: str, **env: str) -> None:
    """Runs ``script`` as a 1-rank save loop (``env`` picks it), waits for its first
    "saved" line, then SIGKILLs it at a random moment of a later save."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    proc = subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("saved"):
                break
        assert lines and lines[-1].startswith("saved"), "".join(lines)
        time.sleep(random.uniform(0.2, 0.8))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


def test_killed_save_leaves_a_loadable_checkpoint(tmp_path) -> None:
    """SIGKILL at a random moment of a save loop: the directory always holds one
    complete checkpoint, all of one generation."""
    import pipedream_ext as pd

    root = str(tmp_path / "ckpt")
    kill_a_save_loop(HERE, PDCKPT_DIR=root, PDCKPT_PHASE="kill-loop")
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    step = manifest["step"]
    state = pd.consolidate(root)
    assert set(state) == set(make_model().state_dict())
    for key, value in state.items():
        assert torch.equal(value, torch.full_like(value, step)), (key, step)
    extra = torch.load(os.path.join(root, manifest["extra"]["file"]), weights_only=True)
    assert extra == {"step": step}


def test_only_what_a_save_wrote_is_deleted(tmp_path, group) -> None:
    """The clean-up after a save (superseded generations) and after a failed save (its
    generation) deletes files and DCP directories this package wrote, never an entry
    of the user's that looks like one: a link, a directory holding other files, a file
    where we write a directory, a name with fewer digits than ours."""
    import pipedream_ext as pd
    from pipedream_ext._checkpoint import generations

    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "mine.pt"
    ckpt.mkdir()
    elsewhere.write_text("mine")
    user = {"g1-dcp/notes.txt": "x", "g000001-dcp/notes.txt": "x", "g000001-extra.pt/x": "x",
            "g000001-stage000-optim.pt.tmp/x": "x", "g2-stage0-model.pt": "x", "g000003-dcp": "x"}
    for name, text in user.items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_text(text)
    os.symlink(elsewhere, ckpt / "g000001-stage000-model.pt")
    torch.manual_seed(0)
    pipe = pd.PipeDream(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), F.cross_entropy,
                        schedule="1f1b", microbatches=1)
    for fmt in ("pipedream", "pipedream", "dcp", "dcp", "pipedream"):  # each supersedes the one before
        info = pd.save_checkpoint(ckpt, pipe, format=fmt)
    assert info.generation == 8  # after the user's g000003-dcp
    theirs = {name.split("/")[0] for name in user} | {"g000001-stage000-model.pt"}
    assert set(os.listdir(ckpt)) == theirs | {"manifest.json", "g000008-stage000-model.pt"}
    (ckpt / "g000009-stage000-model.pt.tmp").write_bytes(b"partial")
    (ckpt / "g000009-dcp").mkdir()
    (ckpt / "g000009-dcp" / "__0_0.distcp").write_bytes(b"partial")
    for generation in (1, 3, 9):  # a failed save's clean-up
        generations.remove_generation(str(ckpt), generation)
    assert not (ckpt / "g000009-stage000-model.pt.tmp").exists() and not (ckpt / "g000009-dcp").exists()
    for name, text in user.items():
        assert (ckpt / name).read_text() == text, name
    assert os.readlink(ckpt / "g000001-stage000-model.pt") == str(elsewhere) and elsewhere.read_text() == "mine"
    state = pd.consolidate(ckpt)
    for key, value in pipe.state_dict().items():
        assert torch.equal(state[key], value), key


if __name__ == "__main__":
    if os.environ.get("PDCKPT_PHASE") == "kill-loop":
        torch.set_num_threads(1)
        phase_kill_loop(os.environ["PDCKPT_DIR"])
    else:
        worker_main([SAVE, RESUME, SAVE_GLOO, RESUME_GLOO])
