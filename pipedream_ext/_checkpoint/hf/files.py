"""Hugging Face weight files: what a directory holds, and reading one rank's share of it.

A Hugging Face model directory (what ``save_pretrained`` writes) holds ``config.json``
and either one ``model.safetensors`` or several shards listed by
``model.safetensors.index.json`` (``{"metadata": {"total_size": n}, "weight_map":
{key: file}}``); a directory holding both is read as ``from_pretrained`` reads it: its
``model.safetensors``. Index entries must be plain file names in the directory, and a
damaged file is named with the tensor being read. :class:`HfWeights` parses that listing without opening any shard
(a single ``.safetensors`` file is its own listing: its header); :class:`ShareReader`
opens a shard only when this rank asks for one of its tensors (``safe_open``, a
memory map) and reads only that tensor, or with a DTensor (FSDP, tensor
parallelism) only this rank's slice of it (``get_slice``), counting what it
opened and read (``opened``, ``tensors``, ``bytes``) for tests and logs.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["CONFIG", "INDEX", "SINGLE", "HfWeights", "ShareReader", "is_hf", "local_bounds", "open_safetensors"]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SUFFIX = ".safetensors"


def is_hf(path: str) -> bool:
    """Whether ``path`` is a ``.safetensors`` file or a directory holding
    ``model.safetensors`` or ``model.safetensors.index.json``."""
    if os.path.isfile(path):
        return path.endswith(SUFFIX)
    return os.path.isfile(os.path.join(path, INDEX)) or os.path.isfile(os.path.join(path, SINGLE))


def _bad_index(index_path: str, why: str) -> ValueError:
    return ValueError(f"{index_path} is not a safetensors index ({why}); it must be JSON with a "
                      "'weight_map' from tensor names to shard files in the same directory, "
                      "as transformers' save_pretrained writes it")


def parse_index(index_path: str) -> Dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``, checked: key -> shard file name.

    Raises:
        ValueError: not JSON, no ``weight_map`` mapping, or a file name that is not a
            plain ``.safetensors`` name in the same directory.
    """
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise _bad_index(index_path, f"{type(exc).__name__}: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _bad_index(index_path, "no 'weight_map' mapping")
    for key, name in weight_map.items():
        if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(SUFFIX):
            raise _bad_index(index_path, f"{key!r} maps to {name!r}, not a .safetensors file name")
    return dict(weight_map)


def _damaged(path: str, key: Optional[str], exc: BaseException) -> ValueError:
    tensor = f" (reading tensor {key!r})" if key is not None else ""
    return ValueError(f"{path} is not a readable safetensors file{tensor}: {exc}; it is damaged, "
                      "incomplete (an interrupted download or copy?) or not safetensors at all "
                      "(a renamed pickle is refused, never unpickled): download or copy it again")


def open_safetensors(path: str, key: Optional[str] = None) -> Any:
    """``safe_open(path)`` on the CPU, its header checked by safetensors.

    Args:
        path: the file.
        key: the tensor wanted from it, for messages.

    Raises:
        ValueError: a damaged file (truncated, a header too large, overlapping offsets,
            not safetensors), naming it and the tensor.
    """
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise _damaged(path, key, exc) from exc


class HfWeights:
    """Which file holds each tensor of a Hugging Face directory or ``.safetensors`` file.

    Attributes:
        path: as given.
        folder: the directory of the shards.
        files: tensor name -> shard file name (in ``folder``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.isfile(path):
            if not path.endswith(SUFFIX):
                raise ValueError(f"{path} is not a .safetensors file; pass a Hugging Face model "
                                 f"directory ({CONFIG} with {SINGLE} or {INDEX}) or a .safetensors file")
            self.folder, single = os.path.split(os.path.abspath(path))
            with open_safetensors(path) as f:  # the header only
                self.files = {key: single for key in f.keys()}
        elif os.path.isfile(os.path.join(path, SINGLE)):
            # model.safetensors first, also beside an index: transformers' from_pretrained
            # (modeling_utils._get_resolved_checkpoint_files) reads it then
            self.folder = path
            with open_safetensors(os.path.join(path, SINGLE)) as f:
                self.files = {key: SINGLE for key in f.keys()}
        elif os.path.isfile(os.path.join(path, INDEX)):
            self.folder = path
            self.files = parse_index(os.path.join(path, INDEX))
        else:
            what = "no such file or directory" if not os.path.exists(path) else \
                f"a directory without {SINGLE} or {INDEX}"
            raise ValueError(f"{path}: {what}; pass a Hugging Face model directory (as "
                             "save_pretrained writes it) or a .safetensors file")


def local_bounds(current: torch.Tensor) -> Optional[List[Tuple[int, int]]]:
    """This rank's ``[start, stop)`` along each dimension of a DTensor's global value
    (torch.chunk's split per ``Shard`` placement, mesh dimensions in order), or ``None``
    where it holds the whole value (a plain tensor, or placements other than
    ``Shard``/``Replicate``, such as FSDP-over-TP's strided shards: read whole, cut locally)."""
    if not isinstance(current, DTensor):
        return None
    coordinate = current.device_mesh.get_coordinate()
    bounds = [(0, int(s)) for s in current.shape]
    for i, placement in enumerate(current.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard or coordinate is None:
            return None
        dim = placement.dim % len(bounds)
        start, stop = bounds[dim]
        chunk = math.ceil((stop - start) / current.device_mesh.size(i))
        low = min(start + coordinate[i] * chunk, stop)
        bounds[dim] = (low, min(low + chunk, stop))
    local = tuple(current.to_local().shape)
    return bounds if tuple(b - a for a, b in bounds) == local else None


class ShareReader:
    """Reads tensors of :class:`HfWeights` one by one, opening each shard at most once.

    Attributes:
        opened: the shard files opened, in order.
        tensors: the names of the tensors read.
        bytes: the bytes of tensor data read (slices: only the slice).
    """

    def __init__(self, weights: HfWeights) -> None:
        self.weights = weights
        self._open: Dict[str, Any] = {}
        self.opened: List[str] = []
        self.tensors: List[str] = []
        self.bytes = 0

    def _file(self, name: str, key: str) -> Any:
        if name not in self._open:
            full = os.path.join(self.weights.folder, name)
            if not os.path.isfile(full):
                raise ValueError(f"{full} is missing: {self.weights.path} lists it in {INDEX} "
                                 "but it is not there (an incomplete download or copy?)")
            self._open[name] = open_safetensors(full, key)
            self.opened.append(name)
        return self._open[name]

    def shape(self, key: str) -> Tuple[int, ...]:
        """The shape of ``key`` in its file (the header only)."""
        return tuple(self._file(self.weights.files[key], key).get_slice(key).get_shape())

    def _value(self, key: str, bounds: Optional[List[Tuple[int, int]]]) -> torch.Tensor:
        """``key``'s whole value, or the part within ``bounds``."""
        name = self.weights.files[key]
        file = self._file(name, key)
        try:
            part = file.get_slice(key)
            if bounds is not None:
                return part[tuple(slice(a, b) for a, b in bounds)]
            return part[:] if len(part.get_shape()) else file.get_tensor(key)
        except SafetensorError as exc:
            raise _damaged(os.path.join(self.weights.folder, name), key, exc) from exc

    def read(self, key: str, current: torch.Tensor) -> torch.Tensor:
        """``key``'s value laid out as ``current`` holds it: the whole tensor, or for a
        DTensor this rank's shard (only its slice read where :func:`local_bounds` knows it;
        else the whole value, cut locally)."""
        bounds = local_bounds(current)
        value = self._value(key, bounds)
        self.tensors.append(key)
        self.bytes += value.numel() * value.element_size()
        if not isinstance(current, DTensor):
            return value
        if bounds is None:
            return distribute_tensor(value, current.device_mesh, current.placements, src_data_rank=None)
        return DTensor.from_local(value.to(current.device), current.device_mesh, current.placements,
                                  run_check=False, shape=current.shape, stride=current.stride())

    def close(self) -> None:
        """Releases the memory maps."""
        self._open.clear()
