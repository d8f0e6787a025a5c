"""Reading a DCP directory from elsewhere without running code from it.

DCP's own reader unpickles ``.metadata`` with ``pickle.load`` and its default planner
reads every non-tensor value with ``torch.load(weights_only=False)``: a crafted file
runs its payload. Here ``.metadata`` is unpickled by :class:`MetadataUnpickler`, which
resolves only DCP's metadata classes and the few torch types they hold (the
``weights_only`` idea, for a plain pickle), and :class:`SafeLoadPlanner` reads values
with ``torch.load(weights_only=True)``; :class:`CheckedReader` hands DCP the metadata
read and checked before (``dcp_files.read_metadata``) instead of reading it again.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, FrozenSet, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, Metadata, ReadItem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta

from ..errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "MetadataUnpickler", "load_metadata", "CheckedReader", "SafeLoadPlanner"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: The globals a ``.metadata`` pickle of torch 2.x references (listed from real saves);
#: besides these only ``torch.<dtype>`` resolves.
ALLOWED_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset(
    [(_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "BytesStorageMetadata",
                                        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")]
    # StorageMeta.checkpoint_id: the path DCP saved to (pathlib._local from Python 3.13)
    + [(module, cls) for module in ("pathlib", "pathlib._local")
       for cls in ("PosixPath", "PurePosixPath", "PureWindowsPath")])


class MetadataUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only :data:`ALLOWED_GLOBALS` and torch dtypes:
    anything else (``os.system``, ``builtins.eval``, any other class) raises
    ``pickle.UnpicklingError`` before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if it is allowed.

        Raises:
            pickle.UnpicklingError: it is not.
        """
        if (module, name) in ALLOWED_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}, which is not a class of DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        """DCP metadata has no persistent ids.

        Raises:
            pickle.UnpicklingError: always.
        """
        raise pickle.UnpicklingError("it has a persistent id, which DCP metadata never has")


def load_metadata(path: str) -> Metadata:
    """Unpickles a DCP ``.metadata`` file with :class:`MetadataUnpickler`.

    Args:
        path: the file.

    Returns:
        The ``Metadata`` (``storage_meta`` set, as DCP's reader sets it).

    Raises:
        CheckpointError: the file cannot be read, references anything but DCP's metadata
            classes (nothing of it ran), or holds something else than a ``Metadata``;
            naming the file.
    """
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} (DCP metadata) was refused: {exc}. A DCP checkpoint's metadata holds only "
            "torch.distributed.checkpoint's metadata classes, so this file was not written by "
            "dcp.save or was altered; nothing of it was run. Load only checkpoints you saved "
            "or trust, and save it again with save_checkpoint(format='dcp')") from exc
    except Exception as exc:  # an I/O error, or a damaged pickle
        raise CheckpointError(f"{path} (DCP metadata) cannot be read: {type(exc).__name__}: {exc}; "
                              "the checkpoint is damaged") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} (DCP metadata) holds a {type(metadata).__name__}, not DCP's "
                              "Metadata; the checkpoint is damaged or was not written by dcp.save")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader, answering ``read_metadata`` with metadata that was read by
    :func:`load_metadata` and checked: the files DCP opens are those checked."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata (a rank's own ``__{rank}.metadata`` is never read).

        Raises:
            CheckpointError: DCP asked for a rank's own metadata file.
        """
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: DCP asked for per-rank metadata, which "
                                  "pipedream_ext's checkpoints do not have")
        assert self._metadata.storage_meta is not None  # load_metadata set it
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor values (optimizer hyperparameters) with
    ``torch.load(weights_only=True)`` instead of ``weights_only=False``.

    Args:
        where: the DCP directory, for messages.
        **kwargs: ``DefaultLoadPlanner``'s.
    """

    def __init__(self, where: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Loads one non-tensor value into the state dict.

        Raises:
            CheckpointError: the value is not a plain value (it would run code), naming it.
        """
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # weights_only refuses anything that could run code
            raise CheckpointError(f"{self._where}: the value of {fqn!r} cannot be loaded with "
                                  f"torch.load(weights_only=True): {type(exc).__name__}: {exc}") from exc
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
