"""The code's layout rules, checked by parsing the source (no import, no run)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List

__all__ = ["private_uses"]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pipedream_ext"


def _private(name: str) -> bool:
    """A leading-underscore name that is not a dunder (``__version__`` is public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == PACKAGE and any(_private(p) for p in parts[1:])


def _pipe_attribute(node: ast.Attribute) -> bool:
    """``pipe._x`` (or ``self.pipe._x``, ``pipes[s]._x``): a private field of a pipeline."""
    value = node.value
    while isinstance(value, ast.Subscript):
        value = value.value
    name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
    return _private(node.attr) and "pipe" in name.lower()


def private_uses(path: Path, root: Path = ROOT) -> Iterator[str]:
    """``file:line: what`` for every import of a private pipedream_ext module or name and
    every read of a pipeline's private attribute in ``path`` (named relative to ``root``)."""
    rel = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name):
                    yield f"{rel}:{node.lineno}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private_module(node.module):
                yield f"{rel}:{node.lineno}: from {node.module} import ..."
            elif node.module.split(".")[0] == PACKAGE:
                for alias in node.names:
                    if _private(alias.name):
                        yield f"{rel}:{node.lineno}: from {node.module} import {alias.name}"
        elif isinstance(node, ast.Attribute) and _pipe_attribute(node):
            yield f"{rel}:{node.lineno}: {ast.unparse(node)}"


def test_private_uses_are_found(tmp_path: Path) -> None:
    """The checker itself: each kind of private use is named, public uses are not."""
    probe = tmp_path / "probe.py"
    probe.write_text("import pipedream_ext._dist.groups\nfrom pipedream_ext import _C, testing\n"
                     "from pipedream_ext._frontend import graph_split\nimport pipedream_ext as pd\n"
                     "x = pipe._runner.executor\ny = pipe.schedule\nz = pd.__version__\n")
    found = [line.split(": ", 1)[1] for line in private_uses(probe, tmp_path)]
    assert found == ["import pipedream_ext._dist.groups", "from pipedream_ext import _C",
                     "from pipedream_ext._frontend import ...", "pipe._runner"], found


def test_benchmarks_and_examples_use_the_public_api_only() -> None:
    """benchmarks/ and examples/ import no private pipedream_ext module or name and read
    no private field of a pipeline: they show what a user can do."""
    found: List[str] = []
    for folder in ("benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += private_uses(path)
    assert not found, "private pipedream_ext uses:\n" + "\n".join(found)
