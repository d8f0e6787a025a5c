"""The ``"pipedream"`` storage: one ``torch.save`` file per stage, the manifest last.

Saving (``save_checkpoint(format="pipedream")``, the default; the driver runs the
sequence): the stage leaders (replica 0) write their stages' weights and optimizer
files under new names; each file's record (size, sha256, the tensors' names, shapes
and dtypes) goes into its stage's manifest record. Loading re-shards by name from
whichever stage files hold each key (``load``); consolidating concatenates the
stage files in layer order. Layout: docs/checkpoints.md.
"""
from __future__ import annotations

import collections
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..._frontend.tied_params import alias_names
from .. import durable_io, generations
from ..errors import CheckpointError
from ..manifest import load_file, stage_what
from ..optimizer_state import optimizer_by_stage
from ..storage import CheckpointStorage, FileRecord, PreparedLoad, SaveJob, Written
from ..view import PipelineView
from . import load as stage_files_load

__all__ = ["StageFilesStorage"]


def _describe(t: torch.Tensor) -> Dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def _write_stage(view: PipelineView, j: int, directory: str, generation: int,
                 optimizer_part: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Writes local stage ``j``'s weights (and optimizer) file; returns its manifest fields."""
    module = view.stages[j]
    aliases = alias_names(view.shared_parameters, stage=j)
    state = module.state_dict()  # detached views, no copies
    # A name of a parameter shared with an earlier stage is listed with the
    # name it is stored under ("same_as"), not stored again.
    stored = collections.OrderedDict((k, v) for k, v in state.items() if k not in aliases)
    model = durable_io.atomic_torch_save(stored, directory, generations.model_file(generation, j))
    model["tensors"] = {k: dict(_describe(v), same_as=aliases[k]) if k in aliases
                        else _describe(v) for k, v in state.items()}
    optim = None
    if optimizer_part is not None:
        optim = durable_io.atomic_torch_save(optimizer_part, directory,
                                             generations.optimizer_file(generation, j))
        optim["class"] = optimizer_part["class"]
        held = {n for g in optimizer_part["param_groups"] for n in g["params"]}
        optim["params"] = [n for n, _ in module.named_parameters() if n in held]
    return {"model": model, "optimizer": optim}


def _add_stage(directory: str, stage: Mapping[str, Any],
               result: "collections.OrderedDict[str, torch.Tensor]") -> None:
    """Adds one stage file's tensors to ``result``, checked against the manifest."""
    what = stage_what(stage, "weights")
    data = load_file(directory, stage["model"], what, "cpu")
    full = os.path.join(directory, stage["model"]["file"])
    listed = stage["model"].get("tensors", {})
    stored = [k for k, v in listed.items() if "same_as" not in v]
    missing = [k for k in stored if k not in data]
    unexpected = [k for k in data if k not in stored]
    if missing or unexpected:
        raise CheckpointError(f"{full} ({what}) does not hold what the manifest lists: "
                              f"missing {missing}, unexpected {unexpected}")
    for key, record in listed.items():
        # A parameter shared with an earlier stage: the same tensor under both
        # names, as in the tied model's own state_dict.
        value = data[key] if "same_as" not in record else result.get(record["same_as"])
        if value is None:
            raise CheckpointError(f"{full} ({what}): {key!r} is the same tensor as "
                                  f"{record['same_as']!r}, which no earlier stage holds")
        if list(value.shape) != record["shape"]:
            raise CheckpointError(f"{full} ({what}): {key!r} has shape {list(value.shape)} but "
                                  f"the manifest says {record['shape']}")
        result[key] = value


class StageFilesStorage(CheckpointStorage):
    """``format="pipedream"``: per-stage ``torch.save`` files, each sha256-checked.

    Manifests without a ``storage`` field are of this storage; they stay readable
    by older pipedream_ext (manifest version 1). A pipeline built with ``mesh=``
    holds several copies or shards of a stage: it is refused (DCP handles it).
    """

    name = "pipedream"
    manifest_version = 1

    def check_pipeline(self, view: PipelineView) -> None:
        view.refuse_mesh(f"save_checkpoint(format={self.name!r})")

    def prepare_save(self, view: PipelineView, optimizer: Optional[torch.optim.Optimizer]) -> Any:
        """The optimizer's state per local stage, by parameter name."""
        return optimizer_by_stage(view, optimizer) if optimizer is not None else {}

    def write(self, job: SaveJob) -> Dict[int, Dict[str, Any]]:
        """Stage leaders (replica 0) write their stages' files; returns their fields."""
        view = job.view
        fields = {j: _write_stage(view, j, job.directory, job.generation, job.prepared.get(j))
                  for j in view.stages if view.is_leader(j)}  # replicas hold the leader's weights
        durable_io.fsync_directory(job.directory)
        return fields

    def written(self, job: SaveJob, handle: Dict[int, Dict[str, Any]]) -> Written:
        return Written(stages=handle, payload={})

    def complete_manifest(self, job: SaveJob, manifest: Dict[str, Any],
                          gathered: Sequence[Dict[str, Any]]) -> Tuple[List[FileRecord], List[str]]:
        stages = manifest["stages"]
        files: List[FileRecord] = [("", s["model"], f"weights of stage {s['stage']}") for s in stages]
        files += [("", s["optimizer"], f"optimizer state of stage {s['stage']}")
                  for s in stages if s["optimizer"]]
        return files, [str(record["file"]) for _, record, _ in files]

    def prepare_load(self, directory: str, manifest: Mapping[str, Any], view: PipelineView,
                     optimizer: Optional[torch.optim.Optimizer]) -> PreparedLoad:
        view.refuse_mesh(f"load_checkpoint() of a format={self.name!r} checkpoint ({directory})")
        return stage_files_load.prepare(directory, manifest, view, optimizer)

    def consolidate(self, directory: str, manifest: Mapping[str, Any]
                    ) -> "collections.OrderedDict[str, torch.Tensor]":
        result: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
        for stage in manifest["stages"]:
            _add_stage(directory, stage, result)
        return result

    def check_manifest(self, manifest: Mapping[str, Any]) -> None:
        for j, stage in enumerate(manifest["stages"]):
            if not isinstance(stage["model"], dict):
                raise ValueError(f"stage {j} has no weights file")
