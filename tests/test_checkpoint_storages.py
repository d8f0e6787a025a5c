"""The checkpoint storage table (``_checkpoint/storages.py``), in one process.

Every format is a ``CheckpointStorage`` in one table by name: ``format=`` and a
manifest's ``storage`` are looked up there and nowhere else, so a new format is
one class plus one row. The multi-rank behaviour of each storage is
tests/test_checkpoint.py's and tests/test_checkpoint_dcp.py's.
"""
from __future__ import annotations

import collections
import json
import pathlib
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import pytest
import torch
from torch import nn

import pipedream_ext as pd
from pipedream_ext._checkpoint import FORMAT, FORMATS, MANIFEST, STORAGES, CheckpointError, CheckpointStorage
from pipedream_ext._checkpoint import storages as storage_table
from pipedream_ext._checkpoint.stage_files.storage import StageFilesStorage
from pipedream_ext._checkpoint.storage import PreparedLoad, SaveJob, Written
from pipedream_ext._checkpoint.view import PipelineView

_PACKAGE = pathlib.Path(pd.__file__).parent


class _ToyStorage(CheckpointStorage):
    """A third format that only consolidates: one ``toy.pt`` file."""

    name = "toy"
    manifest_version = 2

    def save(self, view: PipelineView, directory: str, optimizer: Optional[torch.optim.Optimizer],
             step: Any, extra: Any, async_save: bool) -> Any:
        raise NotImplementedError

    def prepare_load(self, directory: str, manifest: Mapping[str, Any], view: PipelineView,
                     optimizer: Optional[torch.optim.Optimizer]) -> PreparedLoad:
        raise NotImplementedError

    def consolidate(self, directory: str, manifest: Mapping[str, Any]
                    ) -> "collections.OrderedDict[str, torch.Tensor]":
        return collections.OrderedDict(torch.load(f"{directory}/{manifest['toy']}", weights_only=True))

    def check_manifest(self, manifest: Mapping[str, Any]) -> None:
        if not isinstance(manifest["toy"], str):
            raise ValueError("the toy record names no file")


def _write_toy_checkpoint(path: pathlib.Path) -> None:
    torch.save({"0.weight": torch.ones(2, 3)}, path / "toy.pt")
    manifest = {"format": FORMAT, "version": 2, "storage": "toy", "generation": 1, "step": None,
                "layers": [{"name": "0", "type": "Linear"}], "num_layers": 1,
                "stages": [{"stage": 0, "layers": [0, 1], "model": None}], "toy": "toy.pt"}
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_every_format_is_one_row_named_by_its_storage() -> None:
    assert FORMATS == ("pipedream", "dcp")
    for name, storage in STORAGES.items():
        assert isinstance(storage, CheckpointStorage) and storage.name == name
    assert [s.name for s in STORAGES.values() if s.asynchronous] == ["dcp"]
    assert storage_table.storage_named("dcp") is STORAGES["dcp"]
    for bad in ("torch", ["dcp"], None):
        with pytest.raises(ValueError, match=re.escape(f"format={bad!r} is not a checkpoint format; "
                                                       "use 'pipedream' or 'dcp'")):
            storage_table.storage_named(bad)
    assert storage_table.storage_of({}) is STORAGES["pipedream"]  # manifests of version 1


def test_a_third_format_is_one_class_and_one_row(tmp_path, monkeypatch) -> None:
    _write_toy_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"is inconsistent: ValueError: unknown storage 'toy' "
                                              r"\(this pipedream_ext reads pipedream, dcp\)"):
        pd.consolidate(tmp_path)
    monkeypatch.setitem(STORAGES, "toy", _ToyStorage())
    state = pd.consolidate(tmp_path)
    assert list(state) == ["0.weight"] and torch.equal(state["0.weight"], torch.ones(2, 3))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["toy"] = 3
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is inconsistent: ValueError: the toy record names no file"):
        pd.consolidate(tmp_path)


def test_no_module_but_the_table_compares_format_names() -> None:
    """A format is chosen by a lookup in ``storages.STORAGES``, never by comparing its
    name (``format == "dcp"``, ``storage_of(manifest) != STORAGE_DCP``) elsewhere."""
    named = r"""(\bformat|\w*storage\w*|\w*STORAGE\w*|["'](pipedream|dcp)["'])"""
    compared = re.compile(rf"{named}\s*(==|!=|\bnot in\b|\bin\b)\s|(==|!=)\s*\(?\s*{named}")
    found = [f"{path.relative_to(_PACKAGE)}:{number}: {line.strip()}"
             for path in sorted(_PACKAGE.rglob("*.py")) if path.name != "storages.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if compared.search(line.split("#")[0])]
    assert found == [], found


class _RecordingStorage(StageFilesStorage):
    """The per-stage files format under another name, noting each save hook the driver
    calls; ``fail_in`` names a hook that raises instead."""

    name = "recording"

    def __init__(self, fail_in: str = "") -> None:
        self.calls: List[str] = []
        self.fail_in = fail_in

    def _note(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.fail_in:
            raise OSError(f"injected in {hook}")

    def check_pipeline(self, view: PipelineView) -> None:
        self._note("check_pipeline")
        super().check_pipeline(view)

    def prepare_save(self, view: PipelineView, optimizer: Optional[torch.optim.Optimizer]) -> Any:
        self._note("prepare_save")
        return super().prepare_save(view, optimizer)

    def write(self, job: SaveJob) -> Dict[int, Dict[str, Any]]:
        self._note("write")
        return super().write(job)

    def written(self, job: SaveJob, handle: Dict[int, Dict[str, Any]]) -> Written:
        self._note("written")
        return super().written(job, handle)

    def complete_manifest(self, job: SaveJob, manifest: Dict[str, Any], gathered: Sequence[Dict[str, Any]]) -> Any:
        self._note("complete_manifest")
        return super().complete_manifest(job, manifest, gathered)


def test_the_driver_calls_a_formats_hooks_in_order(tmp_path, group, monkeypatch) -> None:
    """A format's save hooks run in the documented order (driver.py); a write that
    fails, before or after its files are on disk, fails the save on every rank, and
    the driver removes the new generation's files (the previous checkpoint stays
    loadable)."""
    torch.manual_seed(0)
    pipe = pd.PipeDream(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                        nn.functional.cross_entropy, schedule="1f1b", microbatches=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    storage = _RecordingStorage()
    monkeypatch.setitem(STORAGES, storage.name, storage)
    info = pd.save_checkpoint(tmp_path, pipe, opt, step=3, extra={"note": "x"}, format=storage.name)
    assert storage.calls == ["check_pipeline", "prepare_save", "write", "written", "complete_manifest"]
    assert info.generation == 1 and info.manifest["storage"] == storage.name
    before = sorted(p.name for p in tmp_path.iterdir())
    assert before == ["g000001-extra.pt", "g000001-stage000-model.pt", "g000001-stage000-optim.pt", MANIFEST]
    for hook in ("write", "written"):
        monkeypatch.setitem(STORAGES, storage.name, _RecordingStorage(fail_in=hook))
        with pytest.raises(CheckpointError, match=f"saving checkpoint {re.escape(str(tmp_path))} failed on "
                                                  f"rank 0: OSError: injected in {hook}"):
            pd.save_checkpoint(tmp_path, pipe, opt, step=4, extra={"note": "y"}, format=storage.name)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, hook
    loaded = pd.load_checkpoint(tmp_path, pipe, opt)
    assert (loaded.generation, loaded.step, loaded.extra) == (1, 3, {"note": "x"})
