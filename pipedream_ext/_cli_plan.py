"""CLI commands ``profile`` and ``plan`` (owned by the planner work)."""
from __future__ import annotations

import argparse

__all__ = ["register"]


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Adds the ``profile`` and ``plan`` commands (not implemented yet)."""
    del subparsers
