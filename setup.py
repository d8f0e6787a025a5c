"""Builds pipedream_ext._C from csrc/ with torch.utils.cpp_extension (ninja).

Install against the already installed torch (CPU wheel here):
    pip install --no-build-isolation -e .

_C links against that torch's C++ library, whose ABI changes between releases, so
the package requires exactly that torch release (``torch==2.13.0``: the local
version label, ``+cpu`` or ``+cu128``, is dropped so either build satisfies it);
``pipedream_ext/__init__.py`` names both versions if _C cannot load.
"""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_RELEASE = torch.__version__.split("+", 1)[0]


def _sources() -> list:
    core = sorted(glob.glob("csrc/core/*.cpp"))
    runtime = sorted(glob.glob("csrc/runtime/*.cpp"))
    bindings = sorted(glob.glob("csrc/bindings/*.cpp"))
    return core + runtime + bindings


setup(
    packages=find_packages(include=["pipedream_ext", "pipedream_ext.*"]),
    install_requires=[f"torch=={TORCH_RELEASE}", "tqdm", "numpy"],
    ext_modules=[
        CppExtension(
            name="pipedream_ext._C",
            sources=_sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": ["-O2", "-std=c++17"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
