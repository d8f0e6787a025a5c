"""Loading a DCP checkpoint (``"storage": "dcp"``) into a pipeline of any layout.

Re-sharding is DCP's job: each rank asks ``dcp.load`` for exactly the names its
own stages and optimizer hold (``dcp_state.LoadRequest``), whichever ranks wrote
them. Around it, the guarantees of ``load_checkpoint``:

1. :func:`prepare` (local, before any exchange): every file of the DCP directory
   is present and of its size, and this rank's share hashes to the manifest's
   sha256 (``dcp_files``); the model has the saved layers, and DCP's metadata has
   exactly the model's keys, each with the model's shape (names missing, unexpected
   or mis-shaped keys); the optimizer has the saved class;
2. (``load.py`` exchanges the outcomes: every rank goes on, or every rank raises)
3. :meth:`DcpLoad.read` (collective): ``dcp.load`` into new tensors, the optimizer's
   ``state_dict`` rebuilt in this rank's order, and a second exchange; only then
   does ``load.py`` copy into the live tensors.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    Metadata,
    TensorStorageMetadata,
)

from ..._dist import collectives
from ..._frontend.tied_params import alias_names
from ..errors import CheckpointError
from ..manifest import MANIFEST, check_layers, check_model_kind
from ..optimizer_state import class_name, state_dict_from_entries
from ..reshard import StageStates
from ..storage import PreparedLoad
from ..view import PipelineView, dcp_group
from . import files as dcp_files
from . import safe as dcp_safe
from . import state as dcp_state

__all__ = ["DcpLoad", "prepare"]

_SHOWN = 8  # keys named in one message


def _listed(keys: Any) -> str:
    keys = sorted(keys)
    return ", ".join(repr(k) for k in keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more"
                                                         if len(keys) > _SHOWN else "")


def _check_model_keys(dcp_dir: str, metadata: Metadata, view: PipelineView) -> None:
    """DCP's metadata holds every key the whole model stores, no other, each with the
    model's shape (a shared parameter once, under its canonical name).

    Raises:
        CheckpointError: naming the missing, unexpected or mis-shaped keys.
    """
    aliases = alias_names(view.shared_parameters)
    expected = {aliases.get(k, k): shape for k, shape in view.model_shapes.items()}
    prefix = f"{dcp_state.MODEL}."
    saved = {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    missing = set(expected) - set(saved)
    if missing:
        raise CheckpointError(f"{dcp_dir} has no entry for {_listed(missing)}, which this model has "
                              "(missing parameters or buffers: saved from another model?)")
    unexpected = set(saved) - set(expected)
    if unexpected:
        raise CheckpointError(f"{dcp_dir} has {_listed(unexpected)}, which this model does not have "
                              "(unexpected parameters or buffers: saved from another model?)")
    for key, shape in expected.items():
        md = saved[key]
        if not isinstance(md, TensorStorageMetadata):  # DCP would read it as a pickled object
            raise CheckpointError(f"{dcp_dir}: {key!r} is stored as {type(md).__name__}, not as a tensor; "
                                  "the checkpoint was altered or damaged: save it again")
        if tuple(md.size) != tuple(shape):
            raise CheckpointError(f"{dcp_dir}: {key!r} has shape {list(md.size)} in the checkpoint "
                                  f"but {list(shape)} in this model")


def _check_optimizer(dcp_dir: str, manifest: Mapping[str, Any], directory: str,
                     optimizer: torch.optim.Optimizer) -> None:
    saved = manifest.get("optimizer")
    if not saved:
        raise CheckpointError(f"{directory} holds no optimizer state (it was saved without "
                              "optimizer=); load it without optimizer=")
    if saved != class_name(optimizer):
        raise CheckpointError(f"{dcp_dir} holds the state of a {saved}, not of a "
                              f"{class_name(optimizer)}; create the same optimizer type as when saving")


class DcpLoad(PreparedLoad):
    """A load that :func:`prepare` checked on this rank: the request for ``dcp.load``."""

    def __init__(self, directory: str, dcp_dir: str, metadata: Metadata, request: dcp_state.LoadRequest,
                 optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.directory = directory
        self.dcp_dir = dcp_dir
        self.metadata = metadata
        self.request = request
        self.optimizer = optimizer

    def read(self, view: PipelineView) -> Tuple[StageStates, Optional[Dict[str, Any]]]:
        """Step 3 (collective): ``dcp.load`` of this rank's request, then every rank's outcome.

        Returns:
            Each local stage's state dict and the optimizer's ``state_dict`` (``None``
            without an optimizer), for ``load.py`` to copy in.

        Raises:
            CheckpointError: reading failed on some rank, or the optimizer's saved groups
                do not fit (on every rank; nothing changed).
        """
        error: Optional[BaseException] = None
        weights: StageStates = {}
        optimizer_state: Optional[Dict[str, Any]] = None
        try:
            try:
                dcp.load(self.request.state, storage_reader=dcp_safe.CheckedReader(self.dcp_dir, self.metadata),
                         planner=dcp_safe.SafeLoadPlanner(self.dcp_dir, allow_partial_load=False),
                         process_group=dcp_group(view))
            except (Exception, CheckpointException) as exc:  # DCP raises a failure on any rank on every rank
                raise CheckpointError(f"{self.dcp_dir}: reading the DCP checkpoint failed: "
                                      f"{dcp_files.describe_failure(exc)}") from exc
            weights = self.request.stage_states()
            if self.optimizer is not None:
                optimizer_state = state_dict_from_entries(self.request.optimizer_entry, view, self.optimizer)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        collectives.gather_outcomes(error, view.group, view.timeout, f"loading checkpoint {self.directory}",
                                    failure=CheckpointError)
        return weights, optimizer_state


def prepare(directory: str, manifest: Mapping[str, Any], view: PipelineView,
            optimizer: Optional[torch.optim.Optimizer]) -> DcpLoad:
    """Step 1: this rank's checks of the files, the model and the optimizer, and its request.

    Args:
        directory: the checkpoint directory.
        manifest: its manifest (``storage`` ``"dcp"``).
        view: the loading pipeline.
        optimizer: its optimizer, or ``None``.

    Returns:
        The checked load, for :meth:`DcpLoad.read`.

    Raises:
        CheckpointError: a missing, truncated or corrupt file, another model (layers,
            keys, shapes) or another optimizer class (nothing was read into the pipeline).
        ValueError: the optimizer holds tensors that are not this rank's parameters.
    """
    manifest_path = os.path.join(directory, MANIFEST)
    dcp_dir = dcp_files.generation_dir(directory, manifest, manifest_path)
    dcp_files.verify_files(dcp_dir, manifest["dcp"]["files"], view.rank, view.world_size, manifest_path)
    metadata = dcp_files.read_metadata(dcp_dir, manifest["dcp"]["files"], manifest_path)
    check_model_kind(manifest_path, manifest, view)
    if view.split_points is None:
        check_layers(manifest_path, manifest, view)
    _check_model_keys(dcp_dir, metadata, view)
    if optimizer is not None:
        _check_optimizer(dcp_dir, manifest, directory, optimizer)
    return DcpLoad(directory, dcp_dir, metadata, dcp_state.LoadRequest(view, optimizer, metadata, dcp_dir),
                   optimizer)
