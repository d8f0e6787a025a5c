"""The ``"dcp"`` storage: one torch.distributed.checkpoint directory per generation.

Every rank writes its part of ``g000003-dcp/`` with ``dcp.save`` (or
``dcp.async_save``), by the unsplit model's names (``state``); the manifest
lists that directory's files with their sizes and sha256 (``files``), which
DCP does not keep. Saving: ``save``'s hooks; loading (DCP re-shards): ``load``;
consolidating: ``files.consolidate_dcp``. Design notes: docs/checkpoints.md,
"DCP checkpoints".
"""
from __future__ import annotations

import collections
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..manifest import MANIFEST
from ..storage import CheckpointStorage, FileRecord, PreparedLoad, SaveJob, Written
from ..view import PipelineView
from . import files as dcp_files
from . import load as dcp_load
from . import save as dcp_save

__all__ = ["DcpStorage"]


class DcpStorage(CheckpointStorage):
    """``format="dcp"``: torch.distributed.checkpoint's files, re-sharded by DCP,
    readable by DCP's own tools; saves synchronously or asynchronously, and supports
    pipelines built with ``mesh=`` (each dp rank writes its own shard).

    Manifest version 2: older pipedream_ext refuse it, naming the upgrade.
    """

    name = "dcp"
    manifest_version = 2
    asynchronous = True

    def prepare_save(self, view: PipelineView, optimizer: Optional[torch.optim.Optimizer]) -> Any:
        return dcp_save.state_to_save(view, optimizer)

    def write(self, job: SaveJob) -> Any:
        return dcp_save.write(job)

    def written(self, job: SaveJob, handle: Any) -> Written:
        return dcp_save.written(job, handle)

    def complete_manifest(self, job: SaveJob, manifest: Dict[str, Any],
                          gathered: Sequence[Dict[str, Any]]) -> Tuple[List[FileRecord], List[str]]:
        return dcp_save.complete_manifest(job, manifest, gathered)

    def prepare_load(self, directory: str, manifest: Mapping[str, Any], view: PipelineView,
                     optimizer: Optional[torch.optim.Optimizer]) -> PreparedLoad:
        return dcp_load.prepare(directory, manifest, view, optimizer)

    def consolidate(self, directory: str, manifest: Mapping[str, Any]
                    ) -> "collections.OrderedDict[str, torch.Tensor]":
        return dcp_files.consolidate_dcp(directory, manifest, os.path.join(directory, MANIFEST))

    def check_manifest(self, manifest: Mapping[str, Any]) -> None:
        """The ``dcp`` record names a generation directory and its files, each with a
        plain name, and lists the tensors."""
        record = manifest["dcp"]
        names = [record["directory"], *record["files"]]
        for name in names:
            if not isinstance(name, str) or not name or os.path.basename(name) != name or name in ("..",):
                raise ValueError(f"bad DCP file or directory name {name!r}")
        if not isinstance(record["tensors"], dict):
            raise ValueError("the DCP record lists no tensors")
