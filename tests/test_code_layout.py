"""The code's layout rules, checked by parsing the source (no import, no run).

Benchmarks and examples use the public API only; inside the package no import cycle (function-level
imports included), no import of another module's private names, functions under 100 lines and classes
under 450, in Python and C++. The layers themselves are import-linter's contract (pyproject.toml,
``make lint``); here, no import points up them or to the package root, function-level ones
included, and docs/architecture.md's ownership table names every module."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

__all__ = ["private_uses", "contract_layers", "upward_imports", "ownership_table_names",
           "cpp_function_lengths"]

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


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_modules(package_dir: Path = PACKAGE_DIR) -> Dict[str, Path]:
    return {_module_name(p, package_dir.parent): p for p in sorted(package_dir.rglob("*.py"))}


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


# -- the layers: every import points down, and every module has an owner --------------------

def contract_layers(pyproject: Path = ROOT / "pyproject.toml") -> Tuple[List[List[str]], Dict[str, Any]]:
    """The import-linter layers contract: its layers top first (each a list of the sibling
    modules ``a | b`` names) and the contract itself."""
    reader = tomllib or pytest.importorskip("tomli")  # Python < 3.11: import-linter's reader
    config = reader.loads(pyproject.read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return [[name.strip() for name in layer.split("|")] for layer in contract["layers"]], contract


def _layer_of(module: str, layers: List[List[str]]) -> Optional[int]:
    """The index of ``module``'s layer (0 is the top), ``None`` if no layer holds it."""
    for index, layer in enumerate(layers):
        if any(module == name or module.startswith(name + ".") for name in layer):
            return index
    return None


def _nearest_module(target: str, modules: Dict[str, Path]) -> str:
    """The Python module an import lands in: ``pkg._C`` (a compiled extension, not a
    file the import graph sees) lands in ``pkg`` itself, as import-linter counts it."""
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def upward_imports(modules: Dict[str, Path], layers: List[List[str]]) -> List[str]:
    """``file:line importer -> target`` for every import (function-level ones included)
    that reaches the package root or a layer above the importer's; a module in no layer
    is named too, since nothing can be said of its arrows."""
    found = [f"{module} is in no layer of the contract" for module in sorted(modules)
             if module != PACKAGE and _layer_of(module, layers) is None]
    for importer, _source, node, targets in _imports(modules):
        own = _layer_of(importer, layers)
        if own is None:  # the root, above every layer, or a module named above
            continue
        where = f"{modules[importer].relative_to(modules[PACKAGE].parent.parent)}:{node.lineno}"
        for target in [_nearest_module(target, modules) for target in targets]:
            layer = _layer_of(target, layers)
            if target == PACKAGE or (layer is not None and layer < own):
                found.append(f"{where} {importer} -> {target}")
    return found


def test_upward_imports_are_found(tmp_path: Path) -> None:
    """The checker itself: an import of the root, of a compiled module (which lands in the
    root) and of a higher layer is named; imports down, within a folder and of the own
    layer are not."""
    package = tmp_path / PACKAGE
    (package / "_low").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import high\n")
    (package / "high.py").write_text("from ._low import a\n")
    (package / "_low" / "__init__.py").write_text("")
    (package / "_low" / "a.py").write_text("from . import b\nfrom .. import _C\n"
                                           "def f():\n    from .. import high\n")
    (package / "_low" / "b.py").write_text("import pipedream_ext\nfrom .a import f\n")
    layers = [[f"{PACKAGE}.high"], [f"{PACKAGE}._low"]]
    found = [line.split(" ", 1)[1] for line in upward_imports(_package_modules(package), layers)]
    assert found == [f"{PACKAGE}._low.a -> {PACKAGE}", f"{PACKAGE}._low.a -> {PACKAGE}.high",
                     f"{PACKAGE}._low.b -> {PACKAGE}"], found
    assert upward_imports(_package_modules(package), [[f"{PACKAGE}.high"]]) == [
        f"{PACKAGE}._low{suffix} is in no layer of the contract" for suffix in ("", ".a", ".b")]


def test_every_import_points_down_the_layers() -> None:
    """No module imports the package root or a layer above its own (pyproject.toml's
    contract, which import-linter enforces but without function-level imports and with
    exceptions allowed): the contract excepts nothing."""
    layers, contract = contract_layers()
    assert not contract.get("ignore_imports"), ("the layers contract ignores imports; make each "
                                                "import point down instead")
    upward = upward_imports(_package_modules(), layers)
    assert not upward, ("imports of the package root or of a higher layer (import _C from "
                        "pipedream_ext._extension; move shared code down):\n" + "\n".join(upward))


ARCHITECTURE = ROOT / "docs" / "architecture.md"
OWNERSHIP_HEADING = "## Who owns what"


def ownership_table_names(text: str) -> Set[str]:
    """The package paths the ownership table of ``docs/architecture.md`` names.

    Rule (stated under the table): each row's first column names modules in backticks by
    their path relative to ``pipedream_ext/``; a later name in the same cell without a
    ``/`` is in the folder of the cell's first name; a folder (``_dist/``) names its
    ``__init__.py``. Names of ``csrc/`` and other names not ending in ``.py`` or ``/`` are
    not modules."""
    section = text.split(OWNERSHIP_HEADING, 1)[1].split("\n## ", 1)[0]
    names: Set[str] = set()
    for row in section.splitlines():
        if not row.startswith("|") or set(row) <= set("|- "):
            continue
        cell = [name for name in re.findall(r"`([^`]+)`", row.split("|")[1])
                if name.endswith((".py", "/")) and not name.startswith("csrc/")]
        first = cell[0] if cell else ""
        folder = first if first.endswith("/") else first[: first.rfind("/") + 1]
        names.update(cell[:1] + [name if "/" in name else folder + name for name in cell[1:]])
    return names


def _documented_path(path: Path) -> str:
    """How the ownership table names the module in ``path``."""
    relative = path.relative_to(PACKAGE_DIR)
    if path.name == "__init__.py" and relative.parent.parts:
        return f"{relative.parent.as_posix()}/"
    return relative.as_posix()


def test_ownership_table_names_are_read() -> None:
    """The reader itself: first columns of that section only, folders and short names."""
    text = ("# A\n| `x.py` | a |\n" + OWNERSHIP_HEADING + "\n| file | owns |\n|---|---|\n"
            "| `_a/one.py`, `two.py` | `not_a_name.py` |\n| `_b/` | init |\n"
            "| `__init__.py`, `y.py` | root |\n| `_c/`, `three.py`, `_d/` | c |\n"
            "| `csrc/c.cpp`, `csrc/x/` | C++ |\n## Next\n| `z.py` |\n")
    assert ownership_table_names(text) == {"_a/one.py", "_a/two.py", "_b/", "__init__.py", "y.py",
                                           "_c/", "_c/three.py", "_d/"}


def test_every_module_is_named_in_the_ownership_table() -> None:
    """docs/architecture.md's "Who owns what" names every module of the package, and
    only modules that exist."""
    named = ownership_table_names(ARCHITECTURE.read_text())
    modules = {_documented_path(path) for path in PACKAGE_DIR.rglob("*.py")}
    missing, stale = sorted(modules - named), sorted(named - modules)
    problems = [f"not named (add a row, or the name to its folder's row): {name}" for name in missing]
    problems += [f"named but no such module (rename or remove it): {name}" for name in stale]
    assert not problems, (
        f"{ARCHITECTURE.relative_to(ROOT)}, the table under '{OWNERSHIP_HEADING}':\n  "
        + "\n  ".join(problems) + "\nIts first column names a module in backticks by its path "
        "relative to pipedream_ext/ (a later name in a cell without '/' is in the folder of the "
        "cell's first name; a folder such as `_dist/` names its __init__.py).")


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
