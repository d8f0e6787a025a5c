"""Writes stdlib_docstrings.tsv: the first line of the docstrings of the public
functions, classes and methods of a few standard-library modules, labelled by the
family of the module they come from (text, files, network, numbers).

The text is CPython's own (PSF licence); regenerating it with another Python
version may change some lines. Used by examples/finetune_minilm.py.

    python examples/data/make_stdlib_docstrings.py > examples/data/stdlib_docstrings.tsv
"""
from __future__ import annotations

import importlib
import inspect
import random
import sys

FAMILIES = {
    "text": ["string", "re", "textwrap", "difflib", "unicodedata", "codecs", "html", "html.parser",
             "csv", "json"],
    "files": ["os", "os.path", "shutil", "pathlib", "glob", "fnmatch", "tempfile", "filecmp",
              "zipfile", "tarfile", "io"],
    "network": ["socket", "http.client", "http.server", "urllib.request", "urllib.parse", "smtplib",
                "ftplib", "ssl", "ipaddress", "email.message", "email.utils"],
    "numbers": ["math", "cmath", "statistics", "decimal", "fractions", "random", "numbers"],
}
PER_FAMILY = 90


def first_lines(module_name: str) -> list:
    module = importlib.import_module(module_name)
    lines = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", module_name) != module.__name__:
            continue
        members = [obj] + ([m for n, m in sorted(vars(obj).items()) if not n.startswith("_")]
                           if inspect.isclass(obj) else [])
        for member in members:
            doc = inspect.getdoc(member) if callable(member) else None
            if doc:
                line = doc.strip().splitlines()[0].strip()
                if 25 <= len(line) <= 160 and "\t" not in line:
                    lines.append(line)
    return lines


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    for family, modules in FAMILIES.items():
        lines = [line for m in modules for line in first_lines(m)]
        lines = [line for line in dict.fromkeys(lines) if line not in seen]
        seen.update(lines)
        rng.shuffle(lines)
        rows += [(family, line) for line in sorted(lines[:PER_FAMILY])]
    rng.shuffle(rows)
    print(f"# first docstring lines of CPython {sys.version.split()[0]}'s standard library "
          "(PSF licence), labelled by module family; examples/data/make_stdlib_docstrings.py")
    for family, line in rows:
        print(f"{family}\t{line}")


if __name__ == "__main__":
    main()
