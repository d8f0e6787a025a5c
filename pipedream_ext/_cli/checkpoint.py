"""CLI command ``consolidate``: one plain state_dict from a pipeline checkpoint.

    python -m pipedream_ext consolidate CHECKPOINT_DIR -o model.pt

The output loads with plain PyTorch into the unsplit ``nn.Sequential``:
``model.load_state_dict(torch.load("model.pt", weights_only=True))``.
"""
from __future__ import annotations

import argparse
import os

# Attributes read when the command runs: the formats load then, not for every command.
from .. import _checkpoint

__all__ = ["register"]


def _run_consolidate(args: argparse.Namespace) -> int:
    manifest = _checkpoint.read_manifest(args.checkpoint)
    state = _checkpoint.consolidate(args.checkpoint)
    output = os.path.abspath(args.output)
    directory, name = os.path.split(output)
    try:
        os.makedirs(directory, exist_ok=True)
        _checkpoint.atomic_torch_save(state, directory, name)  # never leaves a half-written model.pt
    except OSError as exc:
        raise RuntimeError(f"cannot write {args.output}: {exc}") from exc
    # A tied parameter is one tensor under several names (and stored once).
    numel = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    step = manifest.get("step")
    print(f"wrote {args.output}: {len(state)} tensors ({numel:,} values) of "
          f"{manifest['num_layers']} layers, generation {manifest['generation']}"
          f"{f', step {step}' if step is not None else ''}, saved by {manifest['pipeline']['schedule']} "
          f"on {len(manifest['stages'])} stages")
    if args.verbose_tensors:
        for key, tensor in state.items():
            print(f"  {key:40s} {str(tensor.dtype).replace('torch.', ''):9s} {list(tensor.shape)}")
    return 0


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Adds the ``consolidate`` command."""
    p = subparsers.add_parser(
        "consolidate",
        help="merge a pipeline checkpoint into one state_dict of the unsplit model",
        description="Reads a checkpoint written by pipedream_ext.save_checkpoint (checks every "
                    "file's size and sha256) and writes the original nn.Sequential's state_dict "
                    "with torch.save; it loads with plain PyTorch (weights_only=True). Exit "
                    "status 2 with a message naming the file on a missing, incomplete or "
                    "corrupt checkpoint.",
    )
    p.add_argument("checkpoint", help="the checkpoint directory (holds manifest.json)")
    p.add_argument("-o", "--output", required=True, help="the state_dict file to write, e.g. model.pt")
    p.add_argument("--list", dest="verbose_tensors", action="store_true",
                   help="also print every tensor's name, dtype and shape")
    p.set_defaults(func=_run_consolidate)
