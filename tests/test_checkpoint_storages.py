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
from typing import Any, Mapping, Optional

import pytest
import torch

import pipedream_ext as pd
from pipedream_ext._checkpoint import FORMAT, FORMATS, MANIFEST, STORAGES, CheckpointError, CheckpointStorage
from pipedream_ext._checkpoint import storages as storage_table
from pipedream_ext._checkpoint.storage import PreparedLoad
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
