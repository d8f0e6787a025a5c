"""Distributed checkpoints of a :class:`~pipedream_ext.PipeDream` pipeline.

``save_checkpoint(path, pipe, optimizer, step, extra)`` writes one weights file
per stage (written by the stage leader, replica 0) and one optimizer file per
stage, all keyed by the original model's names, then a ``manifest.json`` that
rank 0 writes last, after every rank reported its files. ``load_checkpoint``
restores into any balance, replica layout or world size (re-sharded by name);
``consolidate`` returns the whole model's plain ``state_dict``.

Layout of ``path/`` (generation ``g`` = one completed save)::

    manifest.json                    the only entry point; replaced atomically
    g000002-stage000-model.pt        stage 0's state_dict (parameters and buffers)
    g000002-stage000-optim.pt        stage 0's optimizer state, keyed by parameter name
    g000002-extra.pt                 the ``extra`` object given by rank 0

Every file is written as ``<name>.tmp``, fsynced and renamed into place; files
of a new generation never overwrite the ones the current manifest names, and
superseded files are deleted only after the new manifest is in place, so a
crash at any moment leaves the previous checkpoint loadable. Design notes:
docs/checkpoints.md.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
import logging
import numbers
import os
import re
import time
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import torch

from .._dist import collectives, signals
from .._frontend.tied_params import alias_names, canonical_names

if TYPE_CHECKING:  # pragma: no cover
    from .._pipe import PipeDream

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "consolidate",
    "read_manifest",
    "CheckpointError",
    "CheckpointInfo",
    "MANIFEST",
    "FORMAT",
    "FORMAT_VERSION",
]

_log = logging.getLogger(__name__)

#: Name of the manifest inside a checkpoint directory.
MANIFEST = "manifest.json"
#: Value of the manifest's ``format`` field.
FORMAT = "pipedream_ext-checkpoint"
#: Version of the on-disk layout this module writes (and the newest it reads).
FORMAT_VERSION = 1

# Files this module owns inside a checkpoint directory (only these are ever deleted).
_OWN_FILE = re.compile(r"^g(\d+)-(?:stage\d+-(?:model|optim)|extra)\.pt(?:\.tmp)?$")
_READ_CHUNK = 1 << 22

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model.

    The message names the checkpoint file and, where one is involved, the parameter.
    """


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`save_checkpoint` wrote or :func:`load_checkpoint` restored.

    Attributes:
        path: the checkpoint directory.
        generation: the save's generation number (1 for the first save into ``path``).
        step: the ``step`` given to :func:`save_checkpoint` (``None`` if none was).
        extra: the ``extra`` object given by rank 0 (``None`` if none was); its
            tensors are loaded on the CPU.
        manifest: the parsed ``manifest.json``.
    """

    path: str
    generation: int
    step: Optional[int]
    extra: Any
    manifest: Dict[str, Any]


# --------------------------------------------------------------------------- files
class _HashingWriter:
    """A write-only file object that hashes and counts what passes through."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self._file.closed:
            # torch.save's C++ writer ends its archive in its destructor; after an
            # interrupted save (SIGTERM) that runs once `with open` closed the file, and
            # an exception there aborts the process. The save failed and its .tmp goes.
            return view.nbytes
        self._hash.update(view)
        self.size += view.nbytes
        return self._file.write(view)

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse
        pass
    finally:
        os.close(fd)


def _atomic_torch_save(obj: Any, directory: str, name: str) -> Dict[str, Any]:
    """``torch.save`` to ``directory/name`` via a fsynced ``.tmp`` file and ``os.replace``.

    Returns:
        ``{"file": name, "bytes": size, "sha256": hex digest}`` of what was written.
    """
    final = os.path.join(directory, name)
    tmp = final + ".tmp"
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            with signals.deferred():  # a signal inside torch.save's writer breaks it
                torch.save(obj, writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return {"file": name, "bytes": writer.size, "sha256": writer.hexdigest()}


_INNERMOST = re.compile(r"[\[{][^\[\]{}]*[\]}]")
_FLAT_DICT = re.compile(r"\{(?:[^{}\[\]]|\[[^\[\]\n]*\])*\}")


def _manifest_text(manifest: Mapping[str, Any]) -> str:
    """Indented JSON with small containers (shapes, layers, records) on one line."""
    text = json.dumps(manifest, indent=1)
    for pattern in (_INNERMOST, _FLAT_DICT):
        text = pattern.sub(lambda m: re.sub(r"\s*\n\s*", " ", m.group(0)), text)
    return text + "\n"


def _write_manifest(directory: str, manifest: Mapping[str, Any]) -> None:
    """Writes ``manifest.json`` atomically (tmp file, fsync, rename, directory fsync)."""
    final = os.path.join(directory, MANIFEST)
    tmp = final + ".tmp"
    text = _manifest_text(manifest)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)


def _sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def _verified_path(directory: str, record: Mapping[str, Any], what: str) -> str:
    """The full path of a file the manifest names, after checking it exists, has
    the recorded size and the recorded sha256."""
    name = record.get("file")
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name.startswith("."):
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: bad file name {name!r} for {what}")
    full = os.path.join(directory, name)
    if not os.path.isfile(full):
        raise CheckpointError(f"{directory} is not a complete checkpoint: {name} ({what}) is missing")
    size = os.path.getsize(full)
    if size != record.get("bytes"):
        raise CheckpointError(f"{full} ({what}) has {size} bytes but the manifest says "
                              f"{record.get('bytes')}: the file is truncated or was overwritten")
    if _sha256_of(full) != record.get("sha256"):
        raise CheckpointError(f"{full} ({what}) does not match the sha256 in the manifest: "
                              "the file is corrupt")
    return full


def _load_verified(directory: str, record: Mapping[str, Any], what: str,
                   map_location: Union[str, torch.device],
                   cache: Optional[Dict[str, Any]] = None) -> Any:
    """Verifies a file the manifest names and loads it with ``weights_only=True``."""
    name = str(record.get("file"))
    if cache is not None and name in cache:
        return cache[name]
    full = _verified_path(directory, record, what)
    try:
        obj = torch.load(full, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - report any unpickling failure with the file
        raise CheckpointError(f"{full} ({what}) cannot be loaded with torch.load(weights_only=True): "
                              f"{type(exc).__name__}: {exc}") from exc
    if cache is not None:
        cache[name] = obj
    return obj


# --------------------------------------------------------------------------- manifest
def read_manifest(path: PathLike) -> Dict[str, Any]:
    """Reads and checks the manifest of a checkpoint (no files are loaded).

    Args:
        path: the checkpoint directory.

    Returns:
        The parsed ``manifest.json``.

    Raises:
        CheckpointError: no directory, no manifest ("not a complete checkpoint"),
            invalid JSON, another format, a newer version, or inconsistent stages.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: {MANIFEST} is missing (the save did not "
            "finish, or this directory is not a pipedream_ext checkpoint)")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a pipedream_ext checkpoint manifest "
                              f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path} has format version {version!r}; this pipedream_ext "
                              f"reads versions up to {FORMAT_VERSION} (upgrade pipedream_ext)")
    try:
        layers = manifest["layers"]
        stages = manifest["stages"]
        end = 0
        for j, stage in enumerate(stages):
            start, stop = stage["layers"]
            if stage["stage"] != j or start != end or stop <= start:
                raise ValueError(f"stage {j} covers layers {start}..{stop}, expected to start at {end}")
            if not isinstance(stage["model"], dict):
                raise ValueError(f"stage {j} has no weights file")
            end = stop
        if end != len(layers) or manifest["num_layers"] != len(layers):
            raise ValueError(f"the stages cover {end} layers but the model has {len(layers)}")
        for field, optional in (("step", True), ("generation", False)):
            value = manifest.get(field)
            if (value is None and optional) or (isinstance(value, int) and
                                                 not isinstance(value, bool) and value >= 0):
                continue
            raise ValueError(f"{field!r} is {value!r} ({type(value).__name__}); it must be a "
                             f"non-negative integer{' or null' if optional else ''} (as "
                             "save_checkpoint writes it)")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is inconsistent: {type(exc).__name__}: {exc}") from exc
    return manifest


def _stage_of_layer(manifest: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """For each layer index of the original model, the manifest's record of its stage."""
    owner: List[Dict[str, Any]] = []
    for stage in manifest["stages"]:
        start, stop = stage["layers"]
        owner.extend([stage] * (stop - start))
    return owner


def _owner_of_key(manifest: Mapping[str, Any]) -> Any:
    """``key -> the manifest's record of the stage whose weights file lists key``.

    An ``nn.Sequential``'s key belongs to the stage of its layer (its first name
    component); a traced model's (``split_points`` in the manifest) to the stage
    whose file lists it, so it loads into any other split by name.
    """
    if "split_points" in manifest:
        # A name several stages list (a parameter read on both sides of a cut) is
        # stored by one and listed "same_as" itself by the others: that one owns it.
        listed = {key: stage for stage in manifest["stages"]
                  for key, record in stage["model"].get("tensors", {}).items()
                  if "same_as" not in record}
        listed.update({key: stage for stage in manifest["stages"]
                       for key in stage["model"].get("tensors", {}) if key not in listed})

        def traced_owner(key: str) -> Dict[str, Any]:
            if key not in listed:
                raise CheckpointError(f"the checkpoint has no entry for {key!r}, which this model "
                                      "has (missing parameter or buffer)")
            return listed[key]
        return traced_owner
    owner = _stage_of_layer(manifest)
    layer_index = {layer["name"]: i for i, layer in enumerate(manifest["layers"])}
    return lambda key: owner[layer_index[key.split(".", 1)[0]]]


def _stage_what(stage: Mapping[str, Any], kind: str) -> str:
    start, stop = stage["layers"]
    return f"{kind} of stage {stage['stage']}, layers {start}..{stop - 1}"


def _next_generation(directory: str) -> int:
    """1 + the newest generation found in ``directory`` (manifest or leftover files)."""
    generations = [0]
    for name in os.listdir(directory):
        match = _OWN_FILE.match(name)
        if match:
            generations.append(int(match.group(1)))
    manifest_path = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest_path):
        try:
            with open(manifest_path, encoding="utf-8") as f:
                old = json.load(f)
        except ValueError:
            old = None  # a damaged manifest: the new save replaces it
        if isinstance(old, dict):
            if old.get("format") != FORMAT:
                raise CheckpointError(f"{manifest_path} exists and is not a pipedream_ext checkpoint "
                                      "manifest; refusing to overwrite it (choose another path)")
            if isinstance(old.get("generation"), int):
                generations.append(old["generation"])
    return max(generations) + 1


def _remove_superseded(directory: str, keep: Sequence[str]) -> None:
    """Deletes this module's files that the current manifest does not name."""
    keep_set = set(keep)
    for name in os.listdir(directory):
        if _OWN_FILE.match(name) and name not in keep_set:
            try:
                os.remove(os.path.join(directory, name))
            except OSError as exc:  # the checkpoint is complete; leftovers are harmless
                _log.warning("could not delete superseded checkpoint file %s: %s",
                             os.path.join(directory, name), exc)


# --------------------------------------------------------------------------- collectives
def _exchange(pipe: "PipeDream", payload: Mapping[str, Any], what: str) -> List[Dict[str, Any]]:
    """Every rank of ``pipe.group`` contributes a JSON object; every rank gets them all.

    A barrier with the pipeline's timeout comes first (Gloo: ``monitored_barrier``,
    which names a rank that does not arrive). Both collectives are
    :mod:`._collectives`', on its metadata device; payloads travel as UTF-8 JSON
    bytes in tensors, never pickled.

    Args:
        pipe: the pipeline (its ``group``, ``world_size``, ``rank`` and ``timeout``).
        payload: this rank's JSON-serialisable object.
        what: the operation, for the error message.

    Returns:
        Every rank's payload, in rank order.

    Raises:
        CheckpointError: a peer did not arrive within the timeout, or the exchange failed.
    """
    if pipe.world_size == 1:
        return [json.loads(json.dumps(payload))]
    try:
        collectives.barrier(pipe.group, pipe.timeout)
        return collectives.all_gather_json(payload, pipe.group)
    except Exception as exc:  # noqa: BLE001 - a dead or stuck peer
        raise CheckpointError(f"rank {pipe.rank}: {what}: waiting for the other ranks failed: "
                              f"{type(exc).__name__}: {exc}") from exc


def _error_entry(exc: BaseException) -> Dict[str, str]:
    """A rank's failure as JSON: bad arguments stay ``ValueError``s, the rest become
    ``CheckpointError``s (with the original type named, e.g. ``OSError: ...``)."""
    if isinstance(exc, (CheckpointError, ValueError)):
        return {"type": type(exc).__name__ if isinstance(exc, CheckpointError) else "ValueError",
                "message": str(exc)}
    return {"type": "CheckpointError", "message": f"{type(exc).__name__}: {exc}"}


def _raise_if_failed(gathered: Sequence[Mapping[str, Any]], what: str) -> None:
    """Raises the same error on every rank if any rank reported one."""
    errors = [(rank, entry["error"]) for rank, entry in enumerate(gathered) if entry.get("error")]
    if not errors:
        return
    messages = []
    for rank, error in errors:
        if error["message"] not in messages:
            messages.append(error["message"])
    ranks = ", ".join(str(r) for r, _ in errors)
    text = f"{what} failed on rank{'s' if len(errors) > 1 else ''} {ranks}: " + "; ".join(messages)
    if all(error["type"] == "ValueError" for _, error in errors):
        raise ValueError(text)
    raise CheckpointError(text)


# --------------------------------------------------------------------------- helpers
def _stage_ranks(pipe: "PipeDream", stage: int) -> List[int]:
    return list(pipe._schedule.stage_ranks(stage))  # noqa: SLF001 - same package


def _local_stage_modules(pipe: "PipeDream") -> Dict[int, torch.nn.Module]:
    return {j: pipe._stages[j] for j in pipe.local_stages}  # noqa: SLF001 - same package


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_extra(value: Any, where: str = "extra") -> None:
    """``extra`` must load with ``torch.load(weights_only=True)``: plain containers,
    numbers, strings and tensors only."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_extra(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ValueError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            _check_extra(item, f"{where}[{key!r}]")
        return
    raise ValueError(f"{where} is a {type(value).__name__}; extra may hold only dicts, lists, "
                     "tuples, str, int, float, bool, None and tensors (it is loaded with "
                     "torch.load(weights_only=True))")


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _optimizer_by_stage(pipe: "PipeDream", optimizer: torch.optim.Optimizer) -> Dict[int, Dict[str, Any]]:
    """This rank's optimizer state split per local stage and keyed by parameter name.

    Returns:
        For each local stage with parameters in the optimizer: ``{"class", "state":
        {name: {...}}, "param_groups": [{hyperparameters..., "params": [names]}]}``.

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of this
            rank's stages.
    """
    # A parameter shared by stages is saved once, under its canonical name, by the
    # canonical name's stage: the other stages' copies hold the same state.
    canonical = canonical_names(pipe.shared_parameters)
    names = {id(p): canonical.get(n, n) for n, p in pipe.named_parameters()}
    stage_of_name: Dict[str, int] = {}
    for j, module in sorted(_local_stage_modules(pipe).items()):
        for n, _ in module.named_parameters():
            stage_of_name.setdefault(n, j)  # a name two local stages hold: the first stores it
    packed = optimizer.state_dict()  # runs the optimizer's state_dict hooks; tensors are not copied
    index_to_name: Dict[int, str] = {}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError(f"rank {pipe.rank}: optimizer param group {g} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of this rank's stages; "
                                 "build the optimizer from pipe.parameters()")
            index_to_name[index] = name
            index += 1
    result: Dict[int, Dict[str, Any]] = {}
    for g, group in enumerate(packed["param_groups"]):
        # "param_names" (optimizers built from named_parameters) describes the group's
        # composition, which loading may change; the names kept here replace it.
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        kept = [i for i in group["params"] if index_to_name[i] in stage_of_name]
        for j in sorted({stage_of_name[index_to_name[i]] for i in kept}):
            entry = result.setdefault(j, {"format": "pipedream_ext-optimizer",
                                          "class": _class_name(optimizer), "state": {},
                                          "param_groups": []})
            entry["param_groups"].append(dict(hyper, params=[
                index_to_name[i] for i in kept if stage_of_name[index_to_name[i]] == j]))
    for i, value in packed["state"].items():
        name = index_to_name[int(i)]
        if name in stage_of_name:
            result[stage_of_name[name]]["state"][name] = value
    return result


def _describe(t: torch.Tensor) -> Dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


# --------------------------------------------------------------------------- save
def save_checkpoint(path: PathLike, pipe: "PipeDream", optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, extra: Any = None) -> CheckpointInfo:
    """Saves the pipeline's weights, buffers and optimizer state under ``path/``.

    Collective: every rank of the pipeline calls it with the same ``path`` (on a
    file system all ranks share). Asynchronous schedules are flushed first
    (``pipe.flush()``). Each stage's leader (replica 0) writes the stage's
    ``state_dict`` and its optimizer state keyed by the original model's names;
    once every rank reported its files, rank 0 writes ``manifest.json`` last and
    atomically, then deletes the files of older saves. A crash or error at any
    moment leaves the previous checkpoint in ``path`` loadable.

    Args:
        path: the checkpoint directory (created if needed; an existing checkpoint
            there is replaced once the new one is complete).
        pipe: the pipeline.
        optimizer: this rank's optimizer (``None`` on ranks whose stages have no
            parameters; given on one rank with parameters, it must be given on all).
            Its per-parameter state and its param-group hyperparameters (``lr``,
            ``initial_lr`` of LR schedulers, ...) are saved.
        step: a step counter to store in the manifest (e.g. the number of batches done).
        extra: anything else to keep, from rank 0: dicts, lists, tuples, str,
            numbers, ``None`` and tensors, e.g. ``{"scheduler": sched.state_dict()}``.

    Returns:
        The :class:`CheckpointInfo` of the new checkpoint (same on every rank).

    Raises:
        ValueError: a bad ``step`` or ``extra``, an optimizer holding foreign
            tensors, or an optimizer given on some ranks with parameters but not on
            others (raised on every rank, before anything is written).
        CheckpointError: writing failed on some rank, or a rank did not arrive
            within the pipeline's timeout (raised on every rank that can).
    """
    directory = os.fspath(path)
    started = time.perf_counter()
    if pipe.asynchronous:
        pipe.flush()

    # Phase 1: local checks and the generation number (nothing written yet).
    error = None
    generation = 0
    has_params = any(True for _ in pipe.parameters())
    optimizer_parts: Dict[int, Dict[str, Any]] = {}
    try:
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise ValueError(f"step must be a non-negative int or None (got {step!r})")
            step = int(step)
        if pipe.rank == 0:
            _check_extra(extra)
        if optimizer is not None:
            optimizer_parts = _optimizer_by_stage(pipe, optimizer)
        if pipe.rank == 0:
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise CheckpointError(f"{directory} exists and is not a directory")
            os.makedirs(directory, exist_ok=True)
            generation = _next_generation(directory)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = _error_entry(exc)
    gathered = _exchange(pipe, {"error": error, "generation": generation,
                                "optimizer": optimizer is not None, "has_params": has_params},
                         f"saving checkpoint {directory}")
    _raise_if_failed(gathered, f"saving checkpoint {directory}")
    with_opt = [r for r, e in enumerate(gathered) if e["optimizer"]]
    without_opt = [r for r, e in enumerate(gathered) if e["has_params"] and not e["optimizer"]]
    if with_opt and without_opt:
        raise ValueError(f"saving checkpoint {directory}: optimizer= was given on ranks {with_opt} but "
                         f"not on ranks {without_opt}, whose stages have parameters; pass each rank's "
                         "optimizer (None only on ranks without parameters)")
    generation = int(gathered[0]["generation"])

    # Phase 2: stage leaders write their files under new names.
    error = None
    records: List[Dict[str, Any]] = []
    extra_record: Optional[Dict[str, Any]] = None
    try:
        os.makedirs(directory, exist_ok=True)
        for j, module in _local_stage_modules(pipe).items():
            ranks = _stage_ranks(pipe, j)
            if ranks[0] != pipe.rank:
                continue  # replicas hold the leader's weights
            aliases = alias_names(pipe.shared_parameters, stage=j)
            start, stop = pipe.stage_layers[j]
            state = module.state_dict()  # detached views, no copies
            # A name of a parameter shared with an earlier stage is listed with the
            # name it is stored under ("same_as"), not stored again.
            stored = collections.OrderedDict((k, v) for k, v in state.items() if k not in aliases)
            model = _atomic_torch_save(stored, directory, f"g{generation:06d}-stage{j:03d}-model.pt")
            model["tensors"] = {k: dict(_describe(v), same_as=aliases[k]) if k in aliases
                                else _describe(v) for k, v in state.items()}
            optim = None
            if j in optimizer_parts:
                part = optimizer_parts[j]
                optim = _atomic_torch_save(part, directory, f"g{generation:06d}-stage{j:03d}-optim.pt")
                optim["class"] = part["class"]
                held = {n for g in part["param_groups"] for n in g["params"]}
                optim["params"] = [n for n, _ in module.named_parameters() if n in held]
            # A traced stage is one "layer" whose tensors are matched by name alone
            # (its children are partial copies of the model's, not layers).
            children = [(f"stage{j}", "GraphModule")] if pipe.split_points is not None else \
                [(name, type(child).__qualname__) for name, child in module.named_children()]
            records.append({
                "stage": j, "layers": [start, stop], "ranks": ranks,
                "layer_names": [name for name, _ in children],
                "layer_types": [kind for _, kind in children],
                "model": model, "optimizer": optim,
            })
        if pipe.rank == 0 and extra is not None:
            extra_record = _atomic_torch_save(extra, directory, f"g{generation:06d}-extra.pt")
        _fsync_directory(directory)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = _error_entry(exc)
    gathered = _exchange(pipe, {"error": error, "stages": records, "extra": extra_record},
                         f"saving checkpoint {directory}")
    _raise_if_failed(gathered, f"saving checkpoint {directory}")

    # Phase 3: rank 0 writes the manifest last, then removes superseded files.
    stages = sorted((s for entry in gathered for s in entry["stages"]), key=lambda s: s["stage"])
    extra_record = gathered[0]["extra"]
    layers = [{"name": n, "type": t} for s in stages for n, t in zip(s["layer_names"], s["layer_types"])]
    for s in stages:
        del s["layer_names"], s["layer_types"]
    optimizer_class = next((s["optimizer"]["class"] for s in stages if s["optimizer"]), None)
    manifest: Dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "generation": generation,
        "step": step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "num_layers": len(layers),
        "layers": layers,
        "pipeline": {"schedule": pipe.schedule_name, "microbatches": pipe.microbatches,
                     "balance": list(pipe.balance), "replicas": list(pipe.replicas),
                     "chunks": pipe.chunks, "world_size": pipe.world_size},
        "optimizer": optimizer_class,
        "stages": stages,
        "extra": extra_record,
    }
    if pipe.split_points is not None:
        manifest["split_points"] = pipe.split_points
    error = None
    if pipe.rank == 0:
        try:
            if len(stages) != pipe.num_stages:
                raise CheckpointError(f"{directory}: got files for {len(stages)} of {pipe.num_stages} stages")
            _write_manifest(directory, manifest)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = _error_entry(exc)
        else:
            keep = [s["model"]["file"] for s in stages] + \
                [s["optimizer"]["file"] for s in stages if s["optimizer"]] + \
                ([extra_record["file"]] if extra_record else [])
            _remove_superseded(directory, keep)
    gathered = _exchange(pipe, {"error": error}, f"saving checkpoint {directory}")
    _raise_if_failed(gathered, f"saving checkpoint {directory} (writing {MANIFEST})")
    if pipe.rank == 0:
        _log.info("saved checkpoint %s (generation %d, step %s, %d stages) in %.2f s",
                  directory, generation, step, len(stages), time.perf_counter() - started)
    return CheckpointInfo(path=directory, generation=generation, step=step, extra=extra, manifest=manifest)


# --------------------------------------------------------------------------- load
def _prepare_weights(directory: str, manifest: Mapping[str, Any], pipe: "PipeDream",
                     cache: Dict[str, Any]) -> Dict[int, "collections.OrderedDict[str, torch.Tensor]"]:
    """For each local stage, its state_dict gathered from the checkpoint's stage files."""
    manifest_path = os.path.join(directory, MANIFEST)
    if ("split_points" in manifest) != (pipe.split_points is not None):
        saved, here = (("a traced model (split_points)", "an nn.Sequential")
                       if "split_points" in manifest else
                       ("an nn.Sequential", "a traced model (split_points)"))
        raise CheckpointError(f"{manifest_path} was saved from {saved} but this pipeline runs "
                              f"{here}; load it into a pipeline built the same way, or load "
                              "pd.consolidate(path) with pipe.load_state_dict")
    if pipe.split_points is not None:
        return _prepare_traced_weights(directory, manifest, pipe, cache)
    layers = manifest["layers"]
    num_layers = sum(pipe.balance)
    if len(layers) != num_layers:
        raise CheckpointError(
            f"{manifest_path}: the checkpoint's model has {len(layers)} layers "
            f"({', '.join(l['name'] + ':' + l['type'] for l in layers[:12])}"
            f"{', ...' if len(layers) > 12 else ''}) but this pipeline's model has {num_layers}")
    owner = _stage_of_layer(manifest)
    layer_index = {layer["name"]: i for i, layer in enumerate(layers)}
    result: Dict[int, "collections.OrderedDict[str, torch.Tensor]"] = {}
    for j, module in _local_stage_modules(pipe).items():
        start, stop = pipe.stage_layers[j]
        index_of: Dict[str, int] = {}
        for offset, (name, child) in enumerate(module.named_children()):
            i = start + offset
            saved = layers[i]
            if saved["name"] != name or saved["type"] != type(child).__qualname__:
                raise CheckpointError(
                    f"{manifest_path}: layer {i} is {saved['name']!r} ({saved['type']}) in the "
                    f"checkpoint but {name!r} ({type(child).__qualname__}) in this model; "
                    "the checkpoint was saved from a different model")
            index_of[name] = i
        expected = module.state_dict()
        loaded: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
        for key, current in expected.items():
            stage = owner[index_of[key.split(".", 1)[0]]]
            # A parameter shared with an earlier stage is stored under that stage's name.
            same_as = stage["model"].get("tensors", {}).get(key, {}).get("same_as")
            if same_as is not None:
                stage = owner[layer_index[same_as.split(".", 1)[0]]]
            what = _stage_what(stage, "weights")
            data = _load_verified(directory, stage["model"], what, pipe.device, cache)
            full = os.path.join(directory, stage["model"]["file"])
            source = key if same_as is None else same_as
            if source not in data:
                raise CheckpointError(f"{full} ({what}) has no entry for {source!r}, which this model "
                                      "has (missing parameter or buffer)")
            value = data[source]
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{full} ({what}): {key!r} is a {type(value).__name__}, not a tensor")
            if value.shape != current.shape:
                raise CheckpointError(f"{full} ({what}): {key!r} has shape {list(value.shape)} in the "
                                      f"checkpoint but {list(current.shape)} in this model")
            loaded[key] = value
        for stage in {id(owner[i]): owner[i] for i in index_of.values()}.values():
            what = _stage_what(stage, "weights")
            data = _load_verified(directory, stage["model"], what, pipe.device, cache)
            for key in data:
                if key.split(".", 1)[0] in index_of and key not in expected:
                    raise CheckpointError(
                        f"{os.path.join(directory, stage['model']['file'])} ({what}) has {key!r}, "
                        "which this model does not have (unexpected parameter or buffer)")
        result[j] = loaded
    return result


def _prepare_traced_weights(directory: str, manifest: Mapping[str, Any], pipe: "PipeDream",
                            cache: Dict[str, Any]) -> Dict[int, "collections.OrderedDict[str, torch.Tensor]"]:
    """:func:`_prepare_weights` for a traced model: every key found by name in the
    stage file listing it (any split of the same model)."""
    owner_of = _owner_of_key(manifest)
    model_keys = set(pipe._model_shapes)  # noqa: SLF001 - same package
    listed = {key for stage in manifest["stages"] for key in stage["model"].get("tensors", {})}
    if listed - model_keys:
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)} lists "
                              f"{sorted(listed - model_keys)[:8]}, which this model does not have "
                              "(unexpected parameters or buffers: saved from another model)")
    result: Dict[int, "collections.OrderedDict[str, torch.Tensor]"] = {}
    for j, module in _local_stage_modules(pipe).items():
        loaded: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
        for key, current in module.state_dict().items():
            stage = owner_of(key)
            same_as = stage["model"]["tensors"][key].get("same_as")
            if same_as is not None:
                stage = owner_of(same_as)
            what = _stage_what(stage, "weights")
            data = _load_verified(directory, stage["model"], what, pipe.device, cache)
            full = os.path.join(directory, stage["model"]["file"])
            source = key if same_as is None else same_as
            if source not in data or not isinstance(data[source], torch.Tensor):
                raise CheckpointError(f"{full} ({what}) has no tensor for {source!r}, which this "
                                      "model has (missing parameter or buffer)")
            if data[source].shape != current.shape:
                raise CheckpointError(f"{full} ({what}): {key!r} has shape {list(data[source].shape)} "
                                      f"in the checkpoint but {list(current.shape)} in this model")
            loaded[key] = data[source]
        result[j] = loaded
    return result


def _prepare_optimizer(directory: str, manifest: Mapping[str, Any], pipe: "PipeDream",
                       optimizer: torch.optim.Optimizer, cache: Dict[str, Any]) -> Dict[str, Any]:
    """The optimizer's ``state_dict`` for this rank's parameter order, from per-name state."""
    if not manifest.get("optimizer"):
        raise CheckpointError(f"{directory} holds no optimizer state (it was saved without "
                              "optimizer=); load it without optimizer=")
    owner_of = _owner_of_key(manifest)
    canonical = canonical_names(pipe.shared_parameters)
    names = {id(p): canonical.get(n, n) for n, p in pipe.named_parameters()}
    group_of: Dict[str, Dict[str, Any]] = {}  # file -> {name: saved group}
    state: Dict[int, Any] = {}
    groups: List[Dict[str, Any]] = []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        hyper: Optional[Dict[str, Any]] = None
        hyper_source = ""
        indices: List[int] = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError(f"rank {pipe.rank}: optimizer param group {g} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of this rank's stages; "
                                 "build the optimizer from pipe.parameters()")
            stage = owner_of(name)
            what = _stage_what(stage, "optimizer state")
            record = stage.get("optimizer")
            if not record:
                raise CheckpointError(f"{directory}: stage {stage['stage']} was saved without optimizer "
                                      f"state, which parameter {name!r} needs")
            full = os.path.join(directory, record["file"])
            payload = _load_verified(directory, record, what, "cpu", cache)
            try:
                if payload["class"] != _class_name(optimizer):
                    raise CheckpointError(f"{full} ({what}) holds the state of a {payload['class']}, "
                                          f"not of a {_class_name(optimizer)}; create the same "
                                          "optimizer type as when saving")
                if record["file"] not in group_of:
                    group_of[record["file"]] = {n: saved for saved in payload["param_groups"]
                                                for n in saved["params"]}
                saved_group = group_of[record["file"]].get(name)
                if saved_group is None:
                    raise CheckpointError(f"{full} ({what}) has no optimizer entry for parameter {name!r} "
                                          "(the saved optimizer did not hold it)")
                saved_hyper = {k: v for k, v in saved_group.items() if k not in ("params", "param_names")}
                if hyper is None:
                    hyper, hyper_source = saved_hyper, name
                else:
                    differing = sorted(k for k in set(hyper) | set(saved_hyper)
                                       if not _same_value(hyper.get(k), saved_hyper.get(k)))
                    if differing:
                        raise CheckpointError(
                            f"{full}: optimizer param group {g} holds {hyper_source!r} and {name!r}, "
                            f"which were saved with different {', '.join(differing)}; group the "
                            "parameters as when saving")
                if name in payload["state"]:
                    state[index] = payload["state"][name]
            except (KeyError, TypeError) as exc:
                raise CheckpointError(f"{full} ({what}) is not a pipedream_ext optimizer file: "
                                      f"{type(exc).__name__}: {exc}") from exc
            indices.append(index)
            index += 1
        new_group = dict(hyper) if hyper is not None else \
            {k: v for k, v in group.items() if k not in ("params", "param_names")}
        new_group["params"] = indices
        groups.append(new_group)
    return {"state": state, "param_groups": groups}


def load_checkpoint(path: PathLike, pipe: "PipeDream",
                    optimizer: Optional[torch.optim.Optimizer] = None) -> CheckpointInfo:
    """Restores a checkpoint into ``pipe`` (and ``optimizer``), in place.

    Collective: every rank of the pipeline calls it. The pipeline may differ from
    the one that saved: another balance, replica layout, schedule or world size;
    each rank gathers its layers' tensors by name from whichever stage files hold
    them. Every file is checked against the manifest (size, sha256) and loaded with
    ``torch.load(..., weights_only=True)``. Nothing is changed unless every rank
    succeeded; then parameters and buffers are copied into the live tensors (so the
    executor and the weight store of asynchronous schedules see them; an
    asynchronous pipeline is flushed first), gradients are cleared, and the
    optimizer gets its per-parameter state and the saved param-group
    hyperparameters.

    Args:
        path: the checkpoint directory.
        pipe: the pipeline; its model must have the same layers (names, types and
            shapes) as the saved one.
        optimizer: this rank's optimizer over ``pipe.parameters()`` (same type as
            when saving), or ``None`` to load only weights and buffers.

    Returns:
        The :class:`CheckpointInfo` (``step`` and ``extra`` as saved).

    Raises:
        CheckpointError: on every rank, if any rank found the checkpoint missing,
            incomplete (no manifest, a missing or truncated file), corrupt, or not
            matching the model or optimizer; the message names the file and the
            parameter.
        ValueError: the optimizer holds tensors that are not this rank's parameters.
    """
    directory = os.fspath(path)
    if pipe.asynchronous:
        pipe.flush()
    error = None
    manifest: Dict[str, Any] = {}
    weights: Dict[int, "collections.OrderedDict[str, torch.Tensor]"] = {}
    optimizer_state: Optional[Dict[str, Any]] = None
    extra: Any = None
    try:
        manifest = read_manifest(directory)
        cache: Dict[str, Any] = {}
        weights = _prepare_weights(directory, manifest, pipe, cache)
        if optimizer is not None:
            optimizer_state = _prepare_optimizer(directory, manifest, pipe, optimizer, cache)
        if manifest.get("extra"):
            extra = _load_verified(directory, manifest["extra"], "extra", "cpu")
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = _error_entry(exc)
    gathered = _exchange(pipe, {"error": error}, f"loading checkpoint {directory}")
    _raise_if_failed(gathered, f"loading checkpoint {directory}")
    modules = _local_stage_modules(pipe)
    with torch.no_grad():
        for j, state in weights.items():
            # In place (param.copy_): the executor and weight store keep the same tensors.
            modules[j].load_state_dict(state, strict=True)
            for p in modules[j].parameters():
                p.grad = None
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if pipe.rank == 0:
        _log.info("loaded checkpoint %s (generation %s, step %s)", directory,
                  manifest.get("generation"), manifest.get("step"))
    return CheckpointInfo(path=directory, generation=int(manifest["generation"]),
                          step=manifest.get("step"), extra=extra, manifest=manifest)


# --------------------------------------------------------------------------- consolidate
def consolidate(path: PathLike) -> "collections.OrderedDict[str, torch.Tensor]":
    """The whole original model's ``state_dict`` from a checkpoint, in layer order.

    Needs no process group: ``model.load_state_dict(consolidate(path))`` works on
    the unsplit ``nn.Sequential``, and ``torch.save`` of the result loads anywhere
    with plain PyTorch (``weights_only=True``). Tensors are loaded on the CPU.

    Args:
        path: the checkpoint directory.

    Returns:
        An ``OrderedDict`` from the original model's names (``"3.weight"``) to tensors.

    Raises:
        CheckpointError: no complete checkpoint, a missing, truncated or corrupt
            file, or a file whose tensors differ from the manifest (names the file
            and the entry).
    """
    directory = os.fspath(path)
    manifest = read_manifest(directory)
    result: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
    for stage in manifest["stages"]:
        what = _stage_what(stage, "weights")
        data = _load_verified(directory, stage["model"], what, "cpu")
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
    return result
