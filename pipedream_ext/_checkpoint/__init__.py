"""Distributed checkpoints of a :class:`~pipedream_ext.PipeDream` pipeline.

``save_checkpoint(path, pipe, optimizer, step, extra)`` writes one weights file
per stage (written by the stage leader, replica 0) and one optimizer file per
stage, all keyed by the original model's names, then a ``manifest.json`` that
rank 0 writes last, after every rank reported its files; with ``format="dcp"``
one torch.distributed.checkpoint directory by the same names instead (also
asynchronously). ``load_checkpoint`` restores either into any balance, replica
layout or world size (re-sharded by name); ``consolidate`` returns the whole
model's plain ``state_dict``.

Layout of ``path/`` (generation ``g`` = one completed save)::

    manifest.json                    the only entry point; replaced atomically
    g000002-stage000-model.pt        stage 0's state_dict (parameters and buffers)
    g000002-stage000-optim.pt        stage 0's optimizer state, keyed by parameter name
    g000002-extra.pt                 the ``extra`` object given by rank 0
    g000003-dcp/                     format="dcp": DCP's .metadata and __{rank}_{i}.distcp

Modules, one job each: ``save``, ``load`` and ``consolidate`` (the public calls),
``driver`` (the one collective sequence of every save and load: agree, write,
gather, commit; a format answers hooks), ``phases`` (``CheckpointSave``:
generation, ``extra`` and manifest around a format's hooks), ``pending``
(asynchronous saves in progress), ``storage`` (``CheckpointStorage``: the hooks of
one format) and ``storages`` (``STORAGES``, the one table of formats by name that
``format=`` and a manifest's ``storage`` look up; ``detect``), ``durable_io``
(atomic writes, sha256, verified loads), ``manifest`` (its format; which stage
holds a key; layer checks), ``generations`` (file names, clean-up), ``extra``,
``optimizer_state`` (by parameter name), ``directory`` (the same directory on
every rank, checked), ``reshard`` (by name, shared with ``pipe.load_state_dict``),
``view`` (what they read of a pipeline); one folder per format: ``stage_files/``
(``"pipedream"``), ``dcp/`` (``"dcp"``, synchronous and asynchronous), ``hf/``
(``"hf"``: Hugging Face directories, weights only, no manifest;
``save_pretrained``) and ``torch_file`` (``"torch"``: a ``torch.save`` file).
Design notes: docs/checkpoints.md.
"""
import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:
    from .consolidate import consolidate
    from .durable_io import atomic_torch_save
    from .errors import CheckpointError
    from .hf.save import save_pretrained
    from .hf.storage import HF, HfStorage
    from .load import load_checkpoint
    from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointInfo
    from .pending import PendingCheckpoint, finish_pending
    from .save import save_checkpoint
    from .storage import CheckpointStorage
    from .storages import FORMATS, STORAGES, detect, load_path, read_manifest
    from .view import Pipeline, PipelineView

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "consolidate",
    "save_pretrained",
    "detect",
    "HF",
    "HfStorage",
    "load_path",
    "finish_pending",
    "PendingCheckpoint",
    "FORMATS",
    "STORAGES",
    "CheckpointStorage",
    "read_manifest",
    "atomic_torch_save",
    "CheckpointError",
    "CheckpointInfo",
    "PipelineView",
    "Pipeline",
    "MANIFEST",
    "FORMAT",
    "FORMAT_VERSION",
]

# Each public name's module. They are imported on first use (PEP 562) so that a
# pipeline that never saves does not pay for DCP, DTensor and safetensors at start-up
# (tests/test_import_cost.py): importing one light submodule (``reshard``, ``pending``)
# runs this file first. ``consolidate`` is also its submodule's name: resolving it
# here binds the function over the submodule the import bound.
_HOMES = {
    "consolidate": "consolidate", "atomic_torch_save": "durable_io", "CheckpointError": "errors",
    "save_pretrained": "hf.save", "HF": "hf.storage", "HfStorage": "hf.storage",
    "load_checkpoint": "load", "FORMAT": "manifest", "FORMAT_VERSION": "manifest",
    "MANIFEST": "manifest", "CheckpointInfo": "manifest", "PendingCheckpoint": "pending",
    "finish_pending": "pending", "save_checkpoint": "save", "CheckpointStorage": "storage",
    "FORMATS": "storages", "STORAGES": "storages", "detect": "storages", "load_path": "storages",
    "read_manifest": "storages", "Pipeline": "view", "PipelineView": "view",
}


def __getattr__(name: str) -> Any:
    """A public name of this package, imported from its module on first use.

    Raises:
        AttributeError: not a public name (``from . import <submodule>`` then imports the
            submodule, as for any package).
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
