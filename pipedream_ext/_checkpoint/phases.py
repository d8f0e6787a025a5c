"""What every save shares, whatever stores its tensors: the first and last phases.

1. :func:`agree_to_start`: every rank checks its arguments and prepares what it
   will write, rank 0 picks the generation; one exchange makes a bad argument
   anywhere fail everywhere before anything is written;
2. (the storage's own writing: ``save.py`` per-stage files, ``dcp_save.py`` DCP);
3. :func:`commit`: rank 0 writes ``manifest.json`` atomically, then deletes
   superseded files; one exchange makes every rank return or raise together.

Also the manifest's common fields (:func:`build_manifest`) from the stage records
(:func:`stage_record`) the writing phase gathered.
"""
from __future__ import annotations

import datetime
import numbers
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from .._dist import collectives
from . import generations
from . import manifest as manifest_format
from .errors import CheckpointError
from .extra import check_extra
from .manifest import FORMAT, MANIFEST, STORAGE_VERSION
from .view import PipelineView

__all__ = ["Start", "checked_step", "agree_to_start", "stage_record", "build_manifest", "commit"]


def checked_step(step: Any) -> Optional[int]:
    """``step`` as an int (or ``None``).

    Raises:
        ValueError: a negative number, a bool or another type.
    """
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int or None (got {step!r})")
    return int(step)


def _prepare_directory(directory: str) -> int:
    """Rank 0: creates ``directory`` if needed; returns the new save's generation."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    return generations.next_generation(directory)


class Start(NamedTuple):
    """What phase 1 agreed on."""

    generation: int
    step: Optional[int]
    prepared: Any  # what this rank's ``prepare`` returned


def agree_to_start(view: PipelineView, directory: str, optimizer: Optional[torch.optim.Optimizer],
                   step: Any, extra: Any, prepare: Callable[[], Any]) -> Start:
    """Phase 1: local checks, this rank's preparation and the generation (nothing written yet).

    Args:
        view: the pipeline.
        directory: the checkpoint directory.
        optimizer: this rank's optimizer or ``None``.
        step: the step to record.
        extra: rank 0's ``extra``.
        prepare: builds what this rank will write (raises ``ValueError`` for an
            optimizer holding foreign tensors).

    Returns:
        The generation (the same on every rank), the checked step and ``prepare()``.

    Raises:
        ValueError: a bad argument on any rank, or an optimizer given on some ranks
            with parameters but not on others.
        CheckpointError: another failure on any rank.
    """
    error: Optional[BaseException] = None
    generation = 0
    prepared: Any = None
    try:
        step = checked_step(step)
        if view.rank == 0:
            check_extra(extra)
        prepared = prepare()
        if view.rank == 0:
            generation = _prepare_directory(directory)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    has_params = any(True for _ in view.module.parameters())
    gathered = collectives.gather_outcomes(
        error, view.group, view.timeout, f"saving checkpoint {directory}",
        payload={"generation": generation, "optimizer": optimizer is not None, "has_params": has_params},
        failure=CheckpointError)
    with_opt = [r for r, e in enumerate(gathered) if e["optimizer"]]
    without_opt = [r for r, e in enumerate(gathered) if e["has_params"] and not e["optimizer"]]
    if with_opt and without_opt:
        raise ValueError(f"saving checkpoint {directory}: optimizer= was given on ranks {with_opt} but "
                         f"not on ranks {without_opt}, whose stages have parameters; pass each rank's "
                         "optimizer (None only on ranks without parameters)")
    return Start(int(gathered[0]["generation"]), step, prepared)


def stage_record(view: PipelineView, j: int) -> Dict[str, Any]:
    """Local stage ``j``'s manifest record: layer range, ranks, and its layers'
    names and classes (moved to the manifest's ``layers`` by :func:`build_manifest`)."""
    module = view.stages[j]
    # A traced stage is one "layer" whose tensors are matched by name alone
    # (its children are partial copies of the model's, not layers).
    children = [(f"stage{j}", "GraphModule")] if view.split_points is not None else \
        [(name, manifest_format.layer_type(child)) for name, child in module.named_children()]
    return {"stage": j, "layers": list(view.stage_layers[j]), "ranks": list(view.stage_ranks[j]),
            "layer_names": [name for name, _ in children],
            "layer_types": [kind for _, kind in children]}


def build_manifest(view: PipelineView, generation: int, step: Optional[int],
                   stages: List[Dict[str, Any]], extra_record: Optional[Dict[str, Any]],
                   storage: str, optimizer_class: Optional[str]) -> Dict[str, Any]:
    """The manifest of a save from its stage records (their layer lists move to ``layers``).

    Args:
        view: the pipeline.
        generation: the save's generation.
        step: the checked step.
        stages: every stage's record (:func:`stage_record` and the storage's fields), in order.
        extra_record: ``extra``'s file record, or ``None``.
        storage: ``"pipedream"`` or ``"dcp"`` (sets ``version``).
        optimizer_class: the saved optimizer's class, or ``None``.

    Returns:
        The manifest; the storage adds its own fields.
    """
    layers = [{"name": n, "type": t} for s in stages for n, t in zip(s["layer_names"], s["layer_types"])]
    for s in stages:
        del s["layer_names"], s["layer_types"]
    manifest: Dict[str, Any] = {
        "format": FORMAT,
        "version": STORAGE_VERSION[storage],
        "storage": storage,
        "generation": generation,
        "step": step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "num_layers": len(layers),
        "layers": layers,
        "pipeline": view.describe(),
        "optimizer": optimizer_class,
        "stages": stages,
        "extra": extra_record,
    }
    if view.split_points is not None:
        manifest["split_points"] = list(view.split_points)
    return manifest


def commit(view: PipelineView, directory: str, manifest: Dict[str, Any], keep: Sequence[str]) -> None:
    """Phase 3: rank 0 writes the manifest last, then removes superseded files.

    Args:
        view: the pipeline.
        directory: the checkpoint directory.
        manifest: the new manifest.
        keep: the files and directories it names (everything else of ours goes).

    Raises:
        CheckpointError: the manifest could not be written (on every rank).
    """
    error: Optional[BaseException] = None
    stages = manifest["stages"]
    if view.rank == 0:
        try:
            if len(stages) != view.num_stages:
                raise CheckpointError(f"{directory}: got files for {len(stages)} of "
                                      f"{view.num_stages} stages")
            manifest_format.write_manifest(directory, manifest)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        else:
            generations.remove_superseded(directory, keep)
    collectives.gather_outcomes(error, view.group, view.timeout,
                                f"saving checkpoint {directory} (writing {MANIFEST})",
                                failure=CheckpointError)
