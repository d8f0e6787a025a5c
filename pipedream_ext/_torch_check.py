"""Loads ``pipedream_ext._C`` and, when it cannot, says which torch it needs.

``_C`` is built against one torch release's C++ library (setup.py pins the package
to it: ``torch==X.Y.Z``); another torch leaves its symbols unresolved ("undefined
symbol: _ZN3c10...") or, if it loads, may still disagree on data layouts. This
module turns that into an error naming the installed torch, the torch the package
requires and the fix (rebuild, or install that torch).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import warnings
from types import ModuleType
from typing import Optional

import torch

__all__ = ["required_torch", "mismatch_message", "load_extension"]


def required_torch() -> Optional[str]:
    """The torch release the installed package was built against (its ``torch==``
    requirement), or ``None`` when it is not installed (a plain checkout on sys.path)."""
    try:
        requires = importlib.metadata.requires("pipedream_ext") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requires:
        match = re.fullmatch(r"torch\s*==\s*([\w.]+)", requirement.split(";")[0].strip())
        if match:
            return match.group(1)
    return None


def mismatch_message(installed: str, required: Optional[str], error: str) -> str:
    """The message of a ``_C`` that does not fit the installed torch."""
    built = f"torch {required}" if required else "another torch (see how it was built)"
    return (f"pipedream_ext._C cannot be used with the installed torch {installed}: it was built "
            f"against {built} ({error.strip().splitlines()[0][:300]}); rebuild it against this "
            "torch (pip install --no-build-isolation -e . in the checkout, or `make build`), "
            f"or install {('torch==' + required) if required else 'the torch it was built with'}")


def load_extension() -> ModuleType:
    """Imports ``pipedream_ext._C``.

    Raises:
        ImportError: ``_C`` is missing or was built against another torch (naming
            both versions and the fix).
    """
    installed = torch.__version__.split("+", 1)[0]
    required = required_torch()
    try:
        module = importlib.import_module("pipedream_ext._C")
    except ImportError as exc:
        if "undefined symbol" in str(exc) or (required and required != installed):
            raise ImportError(mismatch_message(installed, required, str(exc))) from exc
        raise
    if required and required != installed:
        warnings.warn(mismatch_message(installed, required, "it loaded, but its C++ types may "
                                                            "not match"), RuntimeWarning, stacklevel=2)
    return module
