"""Command-line interface: ``python -m pipedream_ext <command> ...``.

Each command lives in a module of ``_cli/`` exposing
``register(subparsers)``; this file only assembles them.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from ._cli import checkpoint, plan, schedule

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipedream_ext",
        description="pipedream_ext: profile, plan and run pipeline-parallel training.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    schedule.register(subparsers)
    plan.register(subparsers)
    checkpoint.register(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the CLI and returns the process exit code (0 on success)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
