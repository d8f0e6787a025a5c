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

Modules, one job each: ``save``, ``load`` and ``consolidate`` (what every format
shares), ``storage`` (``CheckpointStorage``: the interface of one format) and
``storages`` (``STORAGES``, the table by name that ``format=`` and a manifest's
``storage`` look up), ``durable_io`` (atomic writes, sha256, verified loads),
``manifest`` (its format; which stage holds a key; layer checks), ``generations``
(file names, clean-up), ``extra``, ``optimizer_state`` (by parameter name),
``phases`` (what every save shares: arguments, generation, commit), ``directory``
(the same directory on every rank, checked), ``reshard`` (by name, shared with
``pipe.load_state_dict``), ``view`` (what they read of a pipeline); the
``"pipedream"`` storage: ``stage_files`` and ``stage_files_load``; the ``"dcp"``
storage: ``dcp_storage``, ``dcp_state`` (names both ways), ``dcp_files`` (file
records, checks, consolidation), ``dcp_save`` (synchronous and asynchronous) and
``dcp_load``; the ``"hf"`` storage (Hugging Face directories, weights only, no
manifest): ``hf_storage`` (``HfStorage``, ``detect``), ``hf_files`` (the index,
reading one rank's share), ``hf_load``, ``hf_save`` (``save_pretrained``) and
``hf_directory`` (writing into the user's directory: staged files moved whole,
nothing removed but a previous save's stale shards).
Design notes: docs/checkpoints.md.
"""
from .consolidate import consolidate
from .dcp.save import PendingCheckpoint, finish_pending
from .durable_io import atomic_torch_save
from .errors import CheckpointError
from .hf.save import save_pretrained
from .hf.storage import HF, HfStorage, detect, load_path
from .load import load_checkpoint
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointInfo
from .save import save_checkpoint
from .storage import CheckpointStorage
from .storages import FORMATS, STORAGES, read_manifest
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
