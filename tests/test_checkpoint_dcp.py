"""DCP checkpoints (``save_checkpoint(format="dcp")``): re-sharding into other layouts
and the unsplit model, asynchronous saves, interrupted saves and errors (CPU, Gloo).
Each item below is a launch (``PIPEDREAM_TEST_LAUNCH=<name>`` and ``PDDCP_DIR`` run one
under torchrun):

* ``quick`` (2 ranks, in ``make test``): an asynchronous DCP save of a [3, 5]
  pipeline while it trains on, loaded into [6, 2] with other initial weights:
  bit-identical weights, then M steps equal to the uninterrupted run (losses and
  weights); ``consolidate``, ``dcp_to_torch_save`` and ``dcp.load`` into the unsplit
  model; a truncated file is named.
* ``save`` (4 ranks, slow): SGD on 3 stages with stage 0 on 2 replicas, Adam on 4
  stages saved asynchronously; the uninterrupted references.
* ``resume`` (3 ranks, slow): 4 -> 3 ranks ([4, 2, 2]) and 4 -> 2 ranks (a pair of
  ranks, [6, 2] and one data-parallel stage), train on and compare; mismatched
  models and optimizers, missing / truncated / corrupt files, saves interrupted
  in DCP's write and in the manifest, two asynchronous saves in a row, ``close()``.
* ``mesh-save`` (4 ranks, slow; its fsdp half in test_fsdp.py's fast launch) and
  ``mesh-load`` (2 ranks, slow): pipelines on a ``("pp", "dp")`` mesh, fsdp and
  replicate, saved on pp 2 x dp 2, resumed there, on pp 1 x dp 2, pp 2 x dp 1 and
  without a mesh, and read into the unsplit model; ``format="pipedream"`` refused.
* a 1-rank DCP save loop killed with SIGKILL at a random moment (slow).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from _multiprocess import ROOT, CaseRef, Cases, FromEnv, Launch, launch_raw, parametrize_cases, worker_main
from test_checkpoint import (
    SCENARIOS,
    batch,
    build,
    check_paths_must_agree,
    kill_a_save_loop,
    make_model,
    merged,
    on_rank0,
    shared_copy,
)

HERE = os.path.abspath(__file__)
N, M = 3, 3
SGD = dict(SCENARIOS["sgd"], scheduler=False)
ADAM = dict(schedule="1f1b", microbatches=4, opt="adam")


# --------------------------------------------------------------------------- helpers (torchrun side)
def train(pipe, opt, steps: range) -> List[float]:  # type: ignore[no-untyped-def]
    """Trains ``steps`` batches; returns each step's loss."""
    losses = []
    for t in steps:
        x, y = batch(t)
        losses.append(float(pipe.step(x, y)))
        if opt is not None:
            opt.step()
            opt.zero_grad()
    return losses


def whole_state(pipe, group: Optional[dist.ProcessGroup] = None) -> Dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The whole model's state, gathered from the pipeline's ranks."""
    parts: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {k: v.clone() for k, v in pipe.state_dict().items()}, group=group)
    return {k: v for part in parts for k, v in part.items()}


def assert_state(pipe, expected: Dict[str, torch.Tensor], what: str, exact: bool = False,  # type: ignore[no-untyped-def]
                 atol: float = 1e-7, parameters_only: bool = False) -> None:
    local = {k: p.detach() for k, p in pipe.named_parameters()} if parameters_only else pipe.state_dict()
    for key, value in local.items():
        torch.testing.assert_close(value, expected[key], rtol=0 if exact else 1e-6, atol=0 if exact else atol,
                                   msg=lambda m: f"{what}: {key}: {m}")


def dcp_dir(path: str) -> str:
    with open(os.path.join(path, "manifest.json")) as f:
        return os.path.join(path, json.load(f)["dcp"]["directory"])


def check_unsplit(path: str, expected: Dict[str, torch.Tensor]) -> None:
    """No process group needed: consolidate, dcp_to_torch_save and dcp.load into the unsplit model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import pipedream_ext as pd

    state = pd.consolidate(path)
    model = make_model(seed=3)
    assert list(state) == list(model.state_dict())
    model.load_state_dict(state)  # strict
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    out = os.path.join(os.path.dirname(path), f"plain-{os.getpid()}.pt")
    dcp_to_torch_save(dcp_dir(path), out)
    plain = torch.load(out, weights_only=False)
    os.remove(out)
    model = make_model(seed=4)
    model.load_state_dict(plain["model"])
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert any(k.startswith("state.") for k in plain["optim"]), list(plain["optim"])[:5]
    model = make_model(seed=5)
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=dcp_dir(path), no_dist=True)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- quick (2 ranks)
def phase_quick(root: str) -> None:
    import pipedream_ext as pd
    from pipedream_ext import CheckpointError

    path = os.path.join(root, "quick")
    scenario = dict(ADAM, balance=[3, 5])
    pipe, opt, _ = build(scenario)
    ref_losses = train(pipe, opt, range(N + M))
    reference = whole_state(pipe)

    pipe, opt, _ = build(scenario)
    train(pipe, opt, range(N))
    at_n = whole_state(pipe)
    pending = pd.save_checkpoint(path, pipe, opt, step=N, extra={"note": "quick"}, format="dcp",
                                 async_save=True)
    assert isinstance(pending, pd.PendingCheckpoint)
    losses = train(pipe, opt, range(N, N + M))  # the save holds the copy made at step N
    info = pending.result()
    assert info.generation == 1 and info.step == N and info.manifest["storage"] == "dcp"
    assert pending.result() is info  # later calls return the same
    assert losses == ref_losses[N:], (losses, ref_losses)  # saving did not change the run

    fresh, fresh_opt, _ = build(dict(ADAM, balance=[6, 2]), seed=99)
    loaded = pd.load_checkpoint(path, fresh, fresh_opt)
    assert loaded.step == N and loaded.extra == {"note": "quick"}
    assert_state(fresh, at_n, "[3, 5] -> [6, 2]: right after loading", exact=True)
    resumed = train(fresh, fresh_opt, range(N, N + M))
    torch.testing.assert_close(resumed, ref_losses[N:], rtol=1e-6, atol=1e-7)
    assert_state(fresh, reference, f"[3, 5] -> [6, 2]: after {M} more steps")
    if dist.get_rank() == 0:
        check_unsplit(path, at_n)
    dist.barrier()

    # A truncated file is named, on every rank, and nothing changes.
    bad = os.path.join(root, "quick-truncated")
    shared_copy(path, bad)
    data = sorted(n for n in os.listdir(dcp_dir(bad)) if n.endswith(".distcp"))[-1]
    on_rank0(lambda: os.truncate(os.path.join(dcp_dir(bad), data), 100))
    before = whole_state(fresh)
    with pytest.raises(CheckpointError, match=rf"{data} \(DCP data\) has 100 bytes but the manifest "
                                             r"says \d+: the file is truncated"):
        pd.load_checkpoint(bad, fresh, fresh_opt)
    assert_state(fresh, before, "a failed load changed nothing", exact=True)
    check_failed_saves(path, fresh, fresh_opt, at_n)


def check_failed_saves(path: str, pipe, opt, at_n: Dict[str, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    """Saves into ``path`` (generation 1, the weights ``at_n``) that fail leave it as it
    was: a path that differs on one rank, and a rank failing inside DCP's write (its
    partial generation directory is removed)."""
    import pipedream_ext as pd
    from pipedream_ext import CheckpointError

    def still_previous() -> None:
        fresh, fresh_opt, _ = build(dict(ADAM, balance=[5, 3]), seed=5)
        assert pd.load_checkpoint(path, fresh, fresh_opt).generation == 1
        assert_state(fresh, at_n, "the previous checkpoint after a failed save", exact=True)

    original = sorted(os.listdir(path))
    check_paths_must_agree(path, pipe, opt, "dcp", still_previous)
    for async_save in (False, True):
        with crash_in_dcp_write(), pytest.raises(CheckpointError, match="simulated crash while writing DCP data"):
            result = pd.save_checkpoint(path, pipe, opt, step=9, format="dcp", async_save=async_save)
            if async_save:
                result.result()
        dist.barrier()
        assert sorted(os.listdir(path)) == original, (async_save, sorted(os.listdir(path)))
    still_previous()


@contextlib.contextmanager
def crash_in_dcp_write() -> Iterator[None]:
    """Rank 1 fails inside DCP's write, after half a data file."""
    from torch.distributed.checkpoint import FileSystemWriter

    real_write = FileSystemWriter.write_data

    def crash_in_write(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            with open(os.path.join(str(self.path), "__1_0.distcp"), "wb") as f:
                f.write(b"half a file")
            raise OSError("simulated crash while writing DCP data")
        return real_write(self, plan, planner)
    FileSystemWriter.write_data = crash_in_write  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystemWriter.write_data = real_write  # type: ignore[method-assign]


# --------------------------------------------------------------------------- save (4 ranks)
def phase_save(root: str) -> None:
    import pipedream_ext as pd

    rank = dist.get_rank()
    layouts = {"sgd": dict(SGD, balance=[3, 3, 2], replicas=[2, 1, 1]), "adam": ADAM}
    for name, scenario in layouts.items():
        pipe, opt, _ = build(scenario)
        losses = train(pipe, opt, range(N + M))
        torch.save({"state": pipe.state_dict(), "losses": losses}, os.path.join(root, f"ref-{name}-rank{rank}.pt"))
        pipe, opt, _ = build(scenario)
        train(pipe, opt, range(N))
        torch.save(pipe.state_dict(), os.path.join(root, f"atN-{name}-rank{rank}.pt"))
        path = os.path.join(root, f"ckpt-{name}")
        if name == "adam":  # asynchronous; close() writes its manifest
            pd.save_checkpoint(path, pipe, opt, step=N, extra={"note": name}, format="dcp", async_save=True)
            train(pipe, opt, range(N, N + M))
            pipe.close()
            assert os.path.exists(os.path.join(path, "manifest.json"))
        else:
            info = pd.save_checkpoint(path, pipe, opt, step=N, extra={"note": name}, format="dcp")
            assert info.manifest["pipeline"]["replicas"] == [2, 1, 1]
    dist.barrier()


def reference(root: str, name: str) -> Dict[str, Any]:
    refs = [torch.load(os.path.join(root, f"ref-{name}-rank{r}.pt"), weights_only=True) for r in range(4)]
    return {"state": {k: v for ref in refs for k, v in ref["state"].items()}, "losses": refs[0]["losses"]}


# --------------------------------------------------------------------------- resume (3 ranks)
def resume(root: str, name: str, scenario: Dict[str, Any], group: Optional[dist.ProcessGroup] = None,
           atol: float = 1e-7, parameters_only: bool = False) -> None:
    """A fresh pipeline loads checkpoint ``name``, trains M steps and must equal the
    uninterrupted run (``parameters_only``: a replicated BatchNorm's statistics differ
    from an unreplicated one's, as in DDP)."""
    import pipedream_ext as pd

    if group is not None and dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    what = f"{name} -> {scenario.get('balance')} replicas {scenario.get('replicas')}"
    pipe, opt, _ = build(scenario, seed=99, group=group)
    info = pd.load_checkpoint(os.path.join(root, f"ckpt-{name}"), pipe, opt)
    assert info.step == N and info.extra == {"note": name}
    assert_state(pipe, merged(root, f"atN-{name}"), f"{what}: right after loading", exact=True)
    ref = reference(root, name)
    losses = train(pipe, opt, range(N, N + M))
    torch.testing.assert_close(losses, ref["losses"][N:], rtol=1e-6, atol=atol)
    assert_state(pipe, ref["state"], f"{what}: after {M} more steps", atol=atol,
                 parameters_only=parameters_only)


def check_errors(root: str) -> None:
    import pipedream_ext as pd
    from pipedream_ext import CheckpointError

    src = os.path.join(root, "ckpt-sgd")
    bad = os.path.join(root, "broken")

    def load(variant: str = "", opt_kind: str = "sgd", path: str = bad):  # type: ignore[no-untyped-def]
        pipe, opt, _ = build(dict(SGD, opt=opt_kind), seed=7, variant=variant)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        try:
            return pd.load_checkpoint(path, pipe, opt)
        finally:  # a failed load changes nothing, on any rank
            assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())

    with pytest.raises(CheckpointError, match="checkpoint's model has 8 layers .* this pipeline's model has 7"):
        load("short", path=src)
    with pytest.raises(CheckpointError, match=r"g000001-dcp has '2\.bias', which this model does not have"):
        load("nobias", path=src)
    with pytest.raises(CheckpointError, match=r"g000001-dcp: '7\.weight' has shape \[3, 12\] in the "
                                              r"checkpoint but \[4, 12\] in this model"):
        load("wide-head", path=src)
    with pytest.raises(CheckpointError, match=r"g000001-dcp holds the state of a torch\.optim\.sgd\.SGD, "
                                              r"not of a torch\.optim\.adam\.Adam"):
        load(opt_kind="adam", path=src)
    pipe, _, _ = build(SGD, variant="nobias")
    pd.save_checkpoint(bad, pipe, format="dcp")  # no optimizer, no '2.bias'
    with pytest.raises(CheckpointError, match=r"has no entry for '2\.bias', which this model has"):
        load()
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load("nobias")
    for damage, pattern in (("remove", r"not a complete checkpoint: __\d+_\d+\.distcp \(DCP data\) is missing"),
                            ("flip", r"__\d+_\d+\.distcp \(DCP data\) does not match the sha256"),
                            ("metadata", r"\.metadata \(DCP metadata\) has \d+ bytes but the manifest says")):
        shared_copy(src, bad)
        first_data = next(n for n in json.load(open(os.path.join(bad, "manifest.json")))["dcp"]["files"]
                          if n.endswith(".distcp"))
        target = os.path.join(dcp_dir(bad), ".metadata" if damage == "metadata" else first_data)
        on_rank0(lambda: _damage(target, damage))
        with pytest.raises(CheckpointError, match=pattern):
            load()
    on_rank0(lambda: shutil.rmtree(bad))


def _damage(path: str, how: str) -> None:
    if how == "remove":
        os.remove(path)
    elif how == "flip":
        with open(path, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(path, os.path.getsize(path) - 1)


def check_interrupted_saves(root: str) -> None:
    """A save that fails in DCP's write or in the manifest leaves the previous
    checkpoint loadable; the next save replaces it and removes the leftovers."""
    import pipedream_ext as pd
    import pipedream_ext._checkpoint.manifest as manifest_format
    from pipedream_ext import CheckpointError

    path = os.path.join(root, "interrupted")
    shared_copy(os.path.join(root, "ckpt-sgd"), path)
    at_n = merged(root, "atN-sgd")
    pipe, opt, _ = build(SGD, seed=99)

    def still_previous() -> None:
        fresh, fresh_opt, _ = build(SGD, seed=5)
        assert pd.load_checkpoint(path, fresh, fresh_opt).generation == 1
        assert_state(fresh, at_n, "previous checkpoint after an interrupted save", exact=True)

    with crash_in_dcp_write(), pytest.raises(CheckpointError, match="simulated crash while writing DCP data"):
        pd.save_checkpoint(path, pipe, opt, step=99, format="dcp")
    still_previous()

    real_manifest = manifest_format.write_manifest

    def crash_in_manifest(directory: str, manifest: Any) -> None:
        raise OSError("simulated crash while writing the manifest")
    manifest_format.write_manifest = crash_in_manifest
    try:  # an asynchronous save whose manifest fails: the next save reports it
        pending = pd.save_checkpoint(path, pipe, opt, step=99, format="dcp", async_save=True)
        with pytest.raises(CheckpointError, match=r"the asynchronous save of .*interrupted \(generation 2\) "
                                                  r"failed: .*simulated crash while writing the manifest"):
            pd.save_checkpoint(path, pipe, opt, step=99, format="dcp")
    finally:
        manifest_format.write_manifest = real_manifest
    with pytest.raises(CheckpointError, match="simulated crash while writing the manifest"):
        pending.result()  # the same failure again
    assert not os.path.exists(os.path.join(path, "g000002-dcp"))  # removed with the failure
    still_previous()

    # Two asynchronous saves in a row: the second finishes the first, then replaces it.
    first = pd.save_checkpoint(path, pipe, opt, step=100, format="dcp", async_save=True)
    second = pd.save_checkpoint(path, pipe, opt, step=101, format="dcp", async_save=True)
    assert first.done() and first.result().generation == 2
    assert second.result().generation == 3
    assert sorted(os.listdir(path)) == ["g000003-dcp", "manifest.json"], sorted(os.listdir(path))
    fresh, fresh_opt, _ = build(SGD, seed=5)
    assert pd.load_checkpoint(path, fresh, fresh_opt).step == 101
    for (key, saved), (_, loaded) in zip(pipe.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(saved, loaded), key
    with pytest.raises(ValueError, match="async_save=True needs format='dcp'"):
        pd.save_checkpoint(path, pipe, opt, async_save=True)
    with pytest.raises(ValueError, match="format='torch' is not a checkpoint format"):
        pd.save_checkpoint(path, pipe, opt, format="torch")
    on_rank0(lambda: shutil.rmtree(path))


@functools.lru_cache(maxsize=None)
def pair_group() -> dist.ProcessGroup:
    """Ranks 0 and 1 (made by every rank at the first case that asks for it)."""
    return dist.new_group([0, 1])


def resume_on_pair(root: str, name: str, scenario: Dict[str, Any], **kwargs: Any) -> None:
    resume(root, name, scenario, group=pair_group(), **kwargs)


def resume_cases(world: int) -> Cases:
    root = FromEnv("PDDCP_DIR")
    cases = Cases()
    cases.add(resume, root, "sgd", dict(SGD, balance=[4, 2, 2]), atol=1e-6, name="sgd-[4,2,2]")  # 4 -> 3 ranks
    cases.add(resume_on_pair, root, "sgd", dict(SGD, balance=[6, 2]), atol=1e-6, name="sgd-[6,2]")  # 4 -> 2 ranks
    cases.add(resume_on_pair, root, "sgd", dict(SGD, balance=[8], replicas=[2]), atol=1e-6,
              parameters_only=True, name="sgd-[8]-replicas=[2]-parameters_only")
    cases.add(resume, root, "adam", dict(ADAM, balance=[3, 3, 2]), name="adam-[3,3,2]")  # saved asynchronously
    cases.add(check_errors, root)
    cases.add(check_interrupted_saves, root)
    return cases


def phase_kill_loop(root: str) -> None:
    """1 rank: DCP saves over and over, every tensor filled with the save's step."""
    import pipedream_ext as pd

    pipe, opt, _ = build(SGD)
    train(pipe, opt, range(1))
    for step in range(100000):
        with torch.no_grad():
            for value in pipe.state_dict().values():
                value.fill_(step)
        pd.save_checkpoint(root, pipe, opt, step=step, format="dcp")
        print(f"saved {step}", flush=True)


def phase_exit_pending(root: str) -> None:
    """Saves (generation 1), then saves asynchronously and ends without finishing that
    save, the way ``PDDCP_EXIT`` says: "normal", "exception" or "destroyed" (the
    process group destroyed first). The weights at the second save go to ``state-rank{r}.pt``."""
    import pipedream_ext as pd

    pipe, opt, _ = build(SGD)
    train(pipe, opt, range(1))
    pd.save_checkpoint(os.path.join(root, "ckpt"), pipe, opt, step=1, format="dcp")
    train(pipe, opt, range(1, 2))
    torch.save(pipe.state_dict(), os.path.join(root, f"state-rank{dist.get_rank()}.pt"))
    pd.save_checkpoint(os.path.join(root, "ckpt"), pipe, opt, step=2, format="dcp", async_save=True)
    train(pipe, opt, range(2, 3))  # the save holds the copy made at step 2
    how = os.environ["PDDCP_EXIT"]
    if how == "destroyed":
        dist.destroy_process_group()
    elif how == "exception":
        raise RuntimeError("the training loop failed")


# --------------------------------------------------------------------------- mesh (pp x dp)
MESH_STEPS = 2  # steps before the save, and after it


def mesh_pipe(pp: int, dp: int, mode: Optional[str], seed: int):  # type: ignore[no-untyped-def]
    """test_fsdp.py's model on a ``(pp, dp)`` mesh (``mode`` ``"fsdp"``/``"replicate"``),
    or without a mesh (``mode=None``: pp over every rank), with AdamW."""
    import torch.nn.functional as F
    from test_fsdp import mlp
    from torch.distributed.device_mesh import init_device_mesh

    import pipedream_ext as pd

    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp")) if mode else None
    pipe = pd.PipeDream(mlp(seed), F.cross_entropy, schedule="zb-h1" if pp > 1 else "1f1b",
                        microbatches=4, timeout=60, mesh=mesh, data_parallel=mode or "fsdp")
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.01), (dp_rank, dp)


def mesh_train(pipe, opt, where, steps: range) -> List[float]:  # type: ignore[no-untyped-def]
    """Each dp rank trains on its part of test_fsdp.py's global batches."""
    from test_fsdp import BATCH, global_batch

    dp_rank, rows, losses = where[0], BATCH // where[1], []
    for t in steps:
        x, y = global_batch(100 + t)
        part = slice(dp_rank * rows, (dp_rank + 1) * rows)
        losses.append(float(pipe.step(x[part] if pipe.is_first else None,
                                      y[part] if pipe.is_last else None)))
        opt.step()
        opt.zero_grad()
    return losses


def mesh_weights(pipe) -> Dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every parameter of the whole model, gathered (collective over the world)."""
    from test_fsdp import full

    mine = {name: full(p.detach()).clone() for name, p in pipe.named_parameters()}
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def assert_weights(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str,
                   exact: bool = False) -> None:
    assert set(actual) == set(expected), (what, sorted(actual), sorted(expected))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0 if exact else 1e-5,
                                   atol=0 if exact else 1e-6, msg=lambda m: f"{what}: {key}: {m}")


def phase_mesh_save(root: str, modes: tuple = ("fsdp", "replicate")) -> None:
    """4 ranks, pp 2 x dp 2: save (async for fsdp) after MESH_STEPS AdamW steps; the
    uninterrupted run's next losses and weights; the format='pipedream' refusal; a
    resume on the same mesh."""
    import pipedream_ext as pd

    plain, plain_opt, _ = mesh_pipe(4, 1, None, seed=0)
    pd.save_checkpoint(os.path.join(root, "plain-pipedream"), plain, plain_opt)
    for mode in modes:
        path = os.path.join(root, f"mesh-{mode}")
        pipe, opt, where = mesh_pipe(2, 2, mode, seed=0)
        with pytest.raises(ValueError, match=r"load_checkpoint\(\) of a format='pipedream' "
                                             r"checkpoint .* does not support pipelines built with mesh="):
            pd.load_checkpoint(os.path.join(root, "plain-pipedream"), pipe, opt)
        mesh_train(pipe, opt, where, range(MESH_STEPS))
        at_save = mesh_weights(pipe)
        with pytest.raises(ValueError, match=r"save_checkpoint\(format='pipedream'\) does not "
                                             r"support pipelines built with mesh=.*format='dcp'"):
            pd.save_checkpoint(path + "-pipedream", pipe, opt)
        saved = pd.save_checkpoint(path, pipe, opt, step=MESH_STEPS, format="dcp",
                                   async_save=mode == "fsdp")
        losses = mesh_train(pipe, opt, where, range(MESH_STEPS, 2 * MESH_STEPS))
        if mode == "fsdp":
            saved = saved.result()
        assert saved.step == MESH_STEPS, saved
        after = mesh_weights(pipe)
        if dist.get_rank() == 0:
            torch.save({"at_save": at_save, "losses": losses, "after": after},
                       os.path.join(root, f"mesh-ref-{mode}.pt"))
        fresh, fresh_opt, fresh_where = mesh_pipe(2, 2, mode, seed=7)
        pd.load_checkpoint(path, fresh, fresh_opt)
        assert_weights(mesh_weights(fresh), at_save, f"{mode} 2x2 -> 2x2 loaded", exact=True)
        resumed = mesh_train(fresh, fresh_opt, fresh_where, range(MESH_STEPS, 2 * MESH_STEPS))
        torch.testing.assert_close(resumed, losses, rtol=1e-5, atol=1e-6)
        assert_weights(mesh_weights(fresh), after, f"{mode} 2x2 -> 2x2 resumed")
        dist.barrier()


def phase_mesh_load(root: str) -> None:
    """2 ranks: each 2x2 checkpoint into pp 1 x dp 2 and pp 2 x dp 1 (fsdp and
    replicate) and a pipeline without a mesh; resume equals the uninterrupted run;
    the unsplit model (consolidate, dcp_to_torch_save, dcp.load)."""
    import pipedream_ext as pd

    targets = [(1, 2, "fsdp"), (2, 1, "fsdp"), (1, 2, "replicate"), (2, 1, "replicate"), (2, 1, None)]
    for saved_mode in ("fsdp", "replicate"):
        path = os.path.join(root, f"mesh-{saved_mode}")
        ref = torch.load(os.path.join(root, f"mesh-ref-{saved_mode}.pt"), weights_only=False)
        for pp, dp, mode in targets:
            what = f"{saved_mode} 2x2 -> {mode} {pp}x{dp}"
            pipe, opt, where = mesh_pipe(pp, dp, mode, seed=5)
            pd.load_checkpoint(path, pipe, opt)
            assert_weights(mesh_weights(pipe), ref["at_save"], f"{what} loaded", exact=True)
            losses = mesh_train(pipe, opt, where, range(MESH_STEPS, 2 * MESH_STEPS))
            torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, what=what: f"{what} losses: {m}")
            assert_weights(mesh_weights(pipe), ref["after"], f"{what} resumed")
        if dist.get_rank() == 0:
            check_mesh_unsplit(path, ref["at_save"])
        dist.barrier()


def check_mesh_unsplit(path: str, expected: Dict[str, torch.Tensor]) -> None:
    """A meshed pipeline's DCP checkpoint in the unsplit model, without a process group."""
    import torch.distributed.checkpoint as dcp
    from test_fsdp import mlp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import pipedream_ext as pd

    model = mlp(seed=3)
    model.load_state_dict(pd.consolidate(path))  # strict
    assert_weights(dict(model.named_parameters()), expected, "consolidate", exact=True)
    out = os.path.join(os.path.dirname(path), f"mesh-plain-{os.getpid()}.pt")
    dcp_to_torch_save(dcp_dir(path), out)
    plain = torch.load(out, weights_only=False)
    os.remove(out)
    assert_weights({k: v for k, v in plain["model"].items() if k in expected}, expected,
                   "dcp_to_torch_save", exact=True)
    assert any(k.endswith(".exp_avg") for k in plain["optim"]), list(plain["optim"])[:5]
    model = mlp(seed=4)
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=dcp_dir(path), no_dist=True)
    model.load_state_dict(target["model"])
    assert_weights(dict(model.named_parameters()), expected, "dcp.load", exact=True)


def one_phase(phase: Callable[[str], None]) -> Callable[[int], Cases]:
    """The cases of a launch running ``phase`` alone."""
    def build(world: int) -> Cases:
        cases = Cases()
        cases.add(phase, FromEnv("PDDCP_DIR"), name=phase.__name__.removeprefix("phase_"))
        return cases
    return build


QUICK = Launch(HERE, 2, one_phase(phase_quick), name="quick", timeout=300, dirs=("PDDCP_DIR",))
SAVE = Launch(HERE, 4, one_phase(phase_save), name="save", timeout=300)
RESUME = Launch(HERE, 3, resume_cases, name="resume", timeout=300)
MESH_SAVE = Launch(HERE, 4, one_phase(phase_mesh_save), name="mesh-save", timeout=300)
MESH_LOAD = Launch(HERE, 2, one_phase(phase_mesh_load), name="mesh-load", timeout=300)


# --------------------------------------------------------------------------- pytest side
@parametrize_cases(QUICK)
def test_dcp_async_save_loads_into_another_balance_and_the_unsplit_model(case: CaseRef) -> None:
    """2 ranks: async DCP save of [3, 5] while training on, load into [6, 2], train on
    (equal to the uninterrupted run), unsplit model three ways, a truncated file."""
    case.check()


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 ranks (replicas; async) saved."""
    root = str(tmp_path_factory.mktemp("dcp"))
    SAVE.check_all(env={"PDDCP_DIR": root})
    return root


@pytest.mark.slow
@parametrize_cases(RESUME)
def test_dcp_resume_on_other_world_sizes_and_failures(case: CaseRef, dcp_saved: str) -> None:
    """4 ranks (replicas; async) -> 3 ranks and -> 2 ranks; errors, interrupted saves."""
    case.check(env={"PDDCP_DIR": dcp_saved})


@pytest.mark.slow
def test_dcp_checkpoints_of_4_ranks_consolidate(dcp_saved: str, tmp_path) -> None:
    import pipedream_ext as pd

    root = dcp_saved
    for name in ("sgd", "adam"):
        state = pd.consolidate(os.path.join(root, f"ckpt-{name}"))
        expected = merged(root, f"atN-{name}")
        assert all(torch.equal(v, expected[k]) for k, v in state.items()) and set(state) == set(expected)
    out = str(tmp_path / "model.pt")
    result = subprocess.run([sys.executable, "-m", "pipedream_ext", "consolidate",
                             os.path.join(root, "ckpt-sgd"), "-o", out],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "step 3" in result.stdout, result.stdout + result.stderr
    make_model().load_state_dict(torch.load(out, weights_only=True))


@pytest.fixture(scope="module")
def mesh_saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("dcp_mesh"))
    MESH_SAVE.check_all(env={"PDDCP_DIR": root})
    return root


@pytest.mark.slow
@parametrize_cases(MESH_LOAD)
def test_dcp_checkpoints_of_meshed_pipelines_reshard(case: CaseRef, mesh_saved: str) -> None:
    """pp 2 x dp 2 (fsdp: async, replicate) saved on 4 ranks, resumed on the same mesh;
    on 2 ranks loaded into pp 1 x dp 2, pp 2 x dp 1 and a pipeline without a mesh, and
    into the unsplit model: AdamW state round-trips (losses and weights)."""
    case.check(env={"PDDCP_DIR": mesh_saved})


@pytest.mark.slow
def test_killed_dcp_save_leaves_a_loadable_checkpoint(tmp_path) -> None:
    """SIGKILL at a random moment of a DCP save loop: one complete checkpoint remains."""
    import pipedream_ext as pd

    root = str(tmp_path / "ckpt")
    kill_a_save_loop(HERE, PDDCP_DIR=root, PDDCP_PHASE="kill-loop")
    step = json.load(open(os.path.join(root, "manifest.json")))["step"]
    state = pd.consolidate(root)
    assert set(state) == set(make_model().state_dict())
    for key, value in state.items():
        assert torch.equal(value, torch.full_like(value, step)), (key, step)


def test_async_save_pending_at_exit_is_finished_or_named(tmp_path, monkeypatch) -> None:
    """An asynchronous save nobody finished: a normal exit finishes it on every rank (2
    ranks: the manifest names it, its weights are the ones at the save); an exit by an
    uncaught exception, or after the process group was destroyed, warns naming the
    path and generation and leaves the previous checkpoint."""
    import pipedream_ext as pd

    for how, world in (("normal", 2), ("exception", 1), ("destroyed", 1)):
        root = tmp_path / how
        root.mkdir()
        for name, value in (("PDDCP_DIR", str(root)), ("PDDCP_PHASE", "exit-pending"), ("PDDCP_EXIT", how)):
            monkeypatch.setenv(name, value)
        results = launch_raw(HERE, world, how, timeout=240)  # plain processes: none is killed for another
        output = "\n".join(r.stdout for r in results)
        ckpt = str(root / "ckpt")
        manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
        pending = f"the asynchronous checkpoint save of {ckpt} (generation 2) was still pending at exit"
        if how == "normal":
            assert all(r.returncode == 0 for r in results), output
            assert output.count(f"{pending}: finishing it now") == world, output
            assert manifest["generation"] == 2 and manifest["step"] == 2, (manifest, output)
            state = pd.consolidate(ckpt)
            expected = merged(str(root), "state")
            assert set(state) == set(expected) and all(torch.equal(v, expected[k]) for k, v in state.items())
            continue
        reason = {"exception": "the process is ending with an uncaught RuntimeError",
                  "destroyed": r"the process group was destroyed before \(dist.destroy_process_group\(\)\)"}[how]
        assert [r.returncode for r in results] == [1 if how == "exception" else 0], output
        assert re.search(rf"{re.escape(pending)} and was not finished: {reason}[^.]*\. .* holds the previous "
                         r"checkpoint; call its result\(\) or pipe\.close\(\) on every rank", output), output
        assert "RuntimeWarning" in output, output
        assert manifest["generation"] == 1 and manifest["step"] == 1, (manifest, output)


# --------------------------------------------------------------------------- untrusted files (1 rank, here)
class _Payload:
    """Unpickled by pickle (or torch.load(weights_only=False)), it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _rehash(ckpt: str, name: str) -> None:
    """Records ``name`` of the DCP directory in the manifest with its size and sha256, as an
    attacker who hands out the checkpoint would: the manifest's checks pass."""
    from pipedream_ext._checkpoint import durable_io

    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    full = os.path.join(dcp_dir(ckpt), name)
    manifest["dcp"]["files"][name] = {"bytes": os.path.getsize(full), "sha256": durable_io.sha256_of(full)}
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _edit_metadata(ckpt: str, edit: Callable[[Any], None]) -> None:
    """Rewrites the checkpoint's DCP metadata after ``edit`` (a file this test saved)."""
    import pickle

    path = os.path.join(dcp_dir(ckpt), ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    _rehash(ckpt, ".metadata")


def _payload_file(ckpt: str, marker: str, fqns: List[str], tensor: bool = False) -> None:
    """Stores ``fqns`` in a new data file holding a pickled payload, as DCP stores a
    non-tensor value (``torch.save`` bytes); ``tensor=True`` also declares them bytes."""
    import io as _io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    buffer = _io.BytesIO()
    torch.save(_Payload(marker), buffer)
    with open(os.path.join(dcp_dir(ckpt), "__9_0.distcp"), "wb") as f:
        f.write(buffer.getvalue())
    _rehash(ckpt, "__9_0.distcp")

    def edit(metadata: Any) -> None:
        for fqn in fqns:
            if tensor:
                metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
            for index in [i for i in metadata.storage_data if i.fqn == fqn]:
                del metadata.storage_data[index]
            metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))
    _edit_metadata(ckpt, edit)


class _Untrusted:
    """A genuine 1-rank DCP checkpoint (Adam: its hyperparameters are stored as bytes) and
    a pipeline to load damaged copies into."""

    def __init__(self, root: str) -> None:
        import pipedream_ext as pd

        self.root = root
        pipe, opt, _ = build(dict(ADAM, balance=[8]))
        train(pipe, opt, range(1))
        self.good = os.path.join(root, "good")
        pd.save_checkpoint(self.good, pipe, opt, step=1, format="dcp")
        self.plain = os.path.join(root, "plain")  # format="pipedream": one torch.save file per stage
        pd.save_checkpoint(self.plain, pipe, opt, step=1)
        self.saved = {k: v.clone() for k, v in pipe.state_dict().items()}
        self.betas = opt.param_groups[0]["betas"]
        self.pipe, self.opt, _ = build(dict(ADAM, balance=[8]), seed=9)
        self.weight = next(k for k in self.saved if k.endswith("weight"))
        self.outside = os.path.join(root, "outside")  # a copy of the data files, elsewhere
        shutil.copytree(dcp_dir(self.good), self.outside)
        self.data = next(n for n in sorted(os.listdir(self.outside)) if n.endswith(".distcp"))

    def copy(self, name: str) -> str:
        shutil.copytree(self.good, os.path.join(self.root, name), symlinks=True)
        return os.path.join(self.root, name)

    def failures(self, bad: str, pattern: str, entry_points: str, marker: str) -> List[str]:
        """What each entry point (c: pd.consolidate, x: the CLI, l: pd.load_checkpoint) did
        wrong with ``bad``: no error, another message, the payload ran, a changed pipeline."""
        import pipedream_ext as pd
        from pipedream_ext import CheckpointError

        def cli() -> None:
            result = subprocess.run([sys.executable, "-m", "pipedream_ext", "consolidate", bad, "-o",
                                     os.path.join(self.root, "out.pt")], capture_output=True, text=True,
                                    cwd=ROOT, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
            if result.returncode != 2:
                raise AssertionError(f"exit {result.returncode}: {result.stderr.strip()[-300:]}")
            raise CheckpointError(result.stderr)  # the message, checked as the others

        before = {k: v.clone() for k, v in self.pipe.state_dict().items()}
        calls = {"c": ("pd.consolidate", lambda: pd.consolidate(bad)), "x": ("the CLI", cli),
                 "l": ("pd.load_checkpoint", lambda: pd.load_checkpoint(bad, self.pipe, self.opt))}
        wrong = []
        for key in entry_points:
            what, call = calls[key]
            try:
                call()
                wrong.append(f"{what}: no error")
            except CheckpointError as exc:
                if not re.search(pattern, str(exc)):
                    wrong.append(f"{what}: {exc}")
            except Exception as exc:  # noqa: BLE001 - listed
                wrong.append(f"{what}: {type(exc).__name__}: {exc}")
            if os.path.exists(marker):
                wrong.append(f"{what}: the payload ran")
                os.remove(marker)
        if any(not torch.equal(v, before[k]) for k, v in self.pipe.state_dict().items()):
            wrong.append("pd.load_checkpoint changed the pipeline")
        return wrong


@pytest.fixture(scope="module")
def untrusted(group: dist.ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> _Untrusted:
    return _Untrusted(str(tmp_path_factory.mktemp("untrusted")))


def _pickle_metadata(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = u.copy("pickle")
    with open(os.path.join(dcp_dir(bad), ".metadata"), "wb") as f:
        f.write(__import__("pickle").dumps(_Payload(marker)))
    _rehash(bad, ".metadata")
    return bad, (r"pickle/g000001-dcp/\.metadata \(DCP metadata\) was refused: it references io\.open, "
                 r"which is not a class of DCP metadata.*nothing of it was run"), "cxl"


def _pickled_value(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = u.copy("value")
    _payload_file(bad, marker, [f"optim.param_groups.{u.weight}.lr"])
    return bad, (rf"the value of 'optim\.param_groups\.{re.escape(u.weight)}\.lr' cannot be loaded with "
                 r"torch\.load\(weights_only=True\)"), "l"


def _pickled_tensor(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = u.copy("tensor")
    _payload_file(bad, marker, [f"model.{u.weight}"], tensor=True)
    return bad, rf"'{re.escape(u.weight)}' is (stored as|listed in the manifest with shape .* but DCP's " \
                rf"metadata has) BytesStorageMetadata", "cl"


def _data_path_outside(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = u.copy("escape")
    _edit_metadata(bad, lambda md: [setattr(info, "relative_path", f"../../outside/{u.data}")
                                    for info in md.storage_data.values()])
    return bad, (rf"escape/g000001-dcp/\.metadata \(DCP metadata\) stores '.*' in "
                 rf"'\.\./\.\./outside/{u.data}', which is not a data file .*manifest\.json lists"), "cl"


def _file_link_outside(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = u.copy("link")
    os.remove(os.path.join(dcp_dir(bad), u.data))
    os.symlink(os.path.join(u.outside, u.data), os.path.join(dcp_dir(bad), u.data))
    return bad, (rf"link/g000001-dcp/{u.data} \(DCP data\) is a symbolic link to "
                 rf"{re.escape(u.outside)}/{u.data}, outside .*: copy the file in instead of linking it"), "cl"


def _directory_link_outside(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = u.copy("dirlink")
    shutil.rmtree(dcp_dir(bad))
    os.symlink(u.outside, dcp_dir(bad))
    return bad, r"dirlink/g000001-dcp \(DCP directory\) is a symbolic link to .*outside", "cl"


def _stage_file_link_outside(u: _Untrusted, marker: str) -> Tuple[str, str, str]:
    bad = os.path.join(u.root, "stage-link")
    shutil.copytree(u.plain, bad)
    name = next(n for n in sorted(os.listdir(bad)) if n.endswith("-model.pt"))
    os.replace(os.path.join(bad, name), os.path.join(u.root, name))
    os.symlink(os.path.join(u.root, name), os.path.join(bad, name))
    return bad, rf"stage-link/{name} \(weights of stage 0, layers 0\.\.7\) is a symbolic link to .*, outside", "cl"


@pytest.mark.parametrize("attack", [_pickle_metadata, _pickled_value, _pickled_tensor, _data_path_outside,
                                    _file_link_outside, _directory_link_outside, _stage_file_link_outside],
                         ids=lambda f: f.__name__.strip("_").replace("_", "-"))
def test_an_untrusted_dcp_checkpoint_runs_no_code(untrusted: _Untrusted, attack: Callable[..., Any],
                                                  tmp_path: Any) -> None:
    """A checkpoint from elsewhere (1 rank, this process; the manifest's sizes and sha256
    match, as its author would make them): a crafted ``.metadata`` pickle, a value or a
    tensor stored as a pickled payload, a data path or a symbolic link leading out of the
    directory. ``pd.consolidate``, the CLI (exit 2) and ``pd.load_checkpoint`` refuse it
    naming the file or entry; no payload runs; the pipeline is unchanged."""
    marker = str(tmp_path / "payload-ran")
    bad, pattern, entry_points = attack(untrusted, marker)
    assert untrusted.failures(bad, pattern, entry_points, marker) == []


def test_a_genuine_dcp_checkpoint_loads_and_a_pickled_pt_is_refused(untrusted: _Untrusted, tmp_path: Any) -> None:
    """The refusals above leave genuine checkpoints alone (hyperparameters are read with
    ``weights_only=True``); ``pipe.load_state_dict(path)`` of a ``.pt`` stays ``weights_only``."""
    import pipedream_ext as pd

    pd.load_checkpoint(untrusted.good, untrusted.pipe, untrusted.opt)
    assert_state(untrusted.pipe, untrusted.saved, "a genuine DCP checkpoint", exact=True)
    assert untrusted.opt.param_groups[0]["betas"] == untrusted.betas
    assert set(pd.consolidate(untrusted.good)) == set(untrusted.saved)
    marker = str(tmp_path / "payload-ran")
    torch.save(_Payload(marker), tmp_path / "state.pt")
    with pytest.raises(Exception, match=r"Weights only load failed"):
        untrusted.pipe.load_state_dict(str(tmp_path / "state.pt"))
    assert not os.path.exists(marker)


if __name__ == "__main__":
    if os.environ.get("PDDCP_PHASE") in ("kill-loop", "exit-pending"):  # plain processes, 1 or 2 ranks
        torch.set_num_threads(1)
        from _multiprocess import init_test_group

        if os.environ.get("PDDCP_EXIT") == "normal":
            # After pipedream_ext's exit handlers (registered later, they run first), skip the
            # interpreter's finalization: a Gloo worker thread that drops the last collective's
            # tensors during it aborts the process now and then (pytorch/pytorch#190489; 4 of
            # 30 plain 2-rank Gloo scripts ending without destroy_process_group here).
            atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0)))
        init_test_group()
        {"kill-loop": phase_kill_loop, "exit-pending": phase_exit_pending}[os.environ["PDDCP_PHASE"]](
            os.environ["PDDCP_DIR"])
    else:
        worker_main([QUICK, SAVE, RESUME, MESH_SAVE, MESH_LOAD])
