"""The code's layout rules, checked by parsing the source (no import, no run).

Benchmarks and examples use the public API only; inside the package no import cycle (function-level
imports included), no import of another module's private names, functions under 100 lines and classes
under 450, in Python and C++. The layers themselves are import-linter's contract (pyproject.toml,
``make lint``)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

__all__ = ["private_uses", "cpp_function_lengths"]

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


# -- the package's own layout (issue 23): cycles, private names, sizes ----------------------

PACKAGE_DIR = ROOT / PACKAGE
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module ``node`` imports from (``from ..x import y`` -> ``pkg.x``)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(modules: Dict[str, Path]) -> Iterator[Tuple[str, str, ast.ImportFrom, List[str]]]:
    """(importer, imported module, node, modules the names resolve to) for every
    ``from ... import`` inside the package, function-level imports included."""
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("pipedream_ext"):
                        yield name, alias.name, node, [alias.name]  # type: ignore[misc]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, path.name == "__init__.py", node)
                if not source.startswith("pipedream_ext"):
                    continue
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
                yield name, source, node, targets


def test_package_has_no_import_cycle():
    """No cycle among the package's modules, counting imports inside functions too (a
    package's ``__init__`` counts as the package)."""
    modules = _package_modules()
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    for importer, _source, _node, targets in _imports(modules):
        for target in targets:
            if target in modules and target != importer and target != "pipedream_ext":
                edges[importer].add(target)
    # A package's __init__ re-exports its modules: an edge to the package is an edge to them.
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module)


def test_no_module_imports_another_modules_private_names():
    modules = _package_modules()
    bad = []
    for importer, source, node, _targets in _imports(modules):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                private = alias.name.startswith("_") and alias.name != "_C"
                if private and f"{source}.{alias.name}" not in modules:
                    bad.append(f"{modules[importer].relative_to(ROOT)}:{node.lineno} imports "
                               f"{alias.name} from {source}")
    assert not bad, "make the name public in its own module:\n" + "\n".join(bad)


def _python_sizes() -> Iterator[Tuple[str, str, int]]:
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield kind, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", \
                    node.end_lineno - node.lineno + 1


def test_python_functions_and_classes_stay_small():
    too_long = [f"{where} ({lines} lines)" for kind, where, lines in _python_sizes()
                if lines >= (MAX_FUNCTION_LINES if kind == "function" else MAX_CLASS_LINES)]
    assert not too_long, (f"functions must stay under {MAX_FUNCTION_LINES} lines and classes "
                          f"under {MAX_CLASS_LINES}; split:\n" + "\n".join(too_long))


_CPP_NOISE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', re.S)
_NOT_FUNCTIONS = re.compile(r"^\s*(namespace|class|struct|enum|union|extern)\b|=\s*$")
_CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else)\s*(\(|$)")


def cpp_function_lengths(text: str) -> List[Tuple[str, int, int]]:
    """(signature's last words, first line, line count) of every function body defined at
    namespace or class scope (lambdas and blocks count towards their function)."""
    code = _CPP_NOISE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    found: List[Tuple[str, int, int]] = []
    scopes: List[Tuple[str, int, str]] = []  # (kind, start offset, name)
    last_stop = 0
    for pos, char in enumerate(code):
        if char in ";":
            last_stop = pos + 1
        elif char == "{":
            header = code[last_stop:pos].strip()
            in_function = any(kind == "function" for kind, _, _ in scopes)
            is_function = (not in_function and ")" in header and not _NOT_FUNCTIONS.search(header)
                           and not _CONTROL.search(header.split("\n")[-1]))
            name = header.split("(")[0].split()[-1] if is_function and header.split("(")[0].split() else ""
            scopes.append(("function" if is_function else "block", pos, name))
            last_stop = pos + 1
        elif char == "}":
            if scopes:
                kind, start, name = scopes.pop()
                if kind == "function":
                    first = code.count("\n", 0, start) + 1
                    found.append((name, first, code.count("\n", start, pos) + 1))
            last_stop = pos + 1
    return found


def test_cpp_function_lengths_are_measured():
    text = "namespace a {\nint f(int x) {\n  if (x) {\n    return 1;\n  }\n  return 2;\n}\n" \
           "struct S {\n  void g() const { auto h = [](int y) { return y; }; }\n};\n}\n"
    assert cpp_function_lengths(text) == [("f", 2, 6), ("g", 9, 1)]


def test_cpp_functions_stay_small():
    too_long = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".cpp", ".h"):
            for name, line, lines in cpp_function_lengths(path.read_text()):
                if lines >= MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)")
    assert not too_long, f"C++ functions must stay under {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)
