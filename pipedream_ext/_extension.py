"""The compiled extension ``_C``, loaded once for every module of the package.

The bottom of the layers (docs/architecture.md): it imports only torch and
``_torch_check``, so a module that needs ``_C`` takes it from here
(``from .._extension import _C``) and never from the package root above it.
"""
import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

from ._torch_check import load_extension

__all__ = ["_C"]

# Fails at the package's first import, naming both torch versions, if _C does not fit.
_C = load_extension()
