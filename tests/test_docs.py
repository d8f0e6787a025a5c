"""Every ```python block of README.md and docs/**/*.md runs, on 2 Gloo ranks (the rule is
docs/testing.md's "The documentation's Python blocks").

A page's blocks run in order as one script in one namespace (a later block uses what an
earlier one defined, as in a doctest file), after the page's setup script
``tests/docs_setup/<page>.py`` if there is one, in a folder of the page's own that both
ranks share. Each page is one case of one 2-rank launch; the script is compiled under the
page's path with its blocks at their own line numbers, so a traceback names the page's
line.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, FromEnv, Launch, parametrize_cases, worker_main

HERE = os.path.abspath(__file__)
ROOT = Path(HERE).resolve().parent.parent
SETUP_DIR = ROOT / "tests" / "docs_setup"
WORLD = 2
FOLDERS_ENV = "PIPEDREAM_DOCS_FOLDERS"
# An opening fence and its info string; the block ends at the next fence of the same
# length or longer (a ```` fence may hold ``` lines).
_FENCE = re.compile(r"^(`{3,})(.*)$")


def pages() -> List[str]:
    """README.md and every Markdown page under docs/, relative to the checkout."""
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md", *docs]


def python_blocks(text: str) -> List[Tuple[int, str]]:
    """The ```python blocks of a Markdown text: (line number of the block's first line,
    its code), in order."""
    blocks: List[Tuple[int, str]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, info = opening.group(1), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and not (lines[end].startswith(fence) and not lines[end].strip("`")):
            end += 1
        if info.split()[:1] == ["python"]:
            blocks.append((i + 2, "\n".join(lines[i + 1:end])))
        i = end + 1
    return blocks


def page_script(page: str) -> str:
    """The page's Python blocks as one script, each at its own line numbers (the rest
    blank), so that compiling it under the page's path makes tracebacks name the page."""
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = [""] * (text.count("\n") + 1)
    for first, code in python_blocks(text):
        for offset, line in enumerate(code.split("\n")):
            lines[first - 1 + offset] = line
    return "\n".join(lines)


def setup_script(page: str) -> Path:
    """Where a page's setup script is (it may not exist)."""
    return SETUP_DIR / Path(page).with_suffix(".py")


def _folder_name(page: str) -> str:
    return page.replace("/", "__").removesuffix(".md")


def check_page(page: str, folders: str) -> None:
    """Runs the page's setup script, then its blocks, in the page's folder (shared by
    the ranks), in one namespace.

    Args:
        page: the page, relative to the checkout (``docs/guide/training.md``).
        folders: the launch's folder; the page runs in a subfolder of its own.

    Raises:
        Exception: whatever the page's setup or one of its blocks raised.
    """
    import torch.distributed as dist

    folder = os.path.join(folders, _folder_name(page))
    os.makedirs(folder, exist_ok=True)
    namespace: Dict[str, object] = {"__name__": "docs_page"}
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        setup = setup_script(page)
        if setup.exists():
            exec(compile(setup.read_text(encoding="utf-8"), str(setup), "exec"), namespace)
        exec(compile(page_script(page), str(ROOT / page), "exec"), namespace)
    finally:
        os.chdir(cwd)
    dist.barrier()  # the next page starts on every rank together


def docs_cases(world: int) -> Cases:
    """One case per page that has Python blocks, named after the page."""
    cases = Cases()
    for page in pages():
        if python_blocks((ROOT / page).read_text(encoding="utf-8")):
            cases.add(check_page, page, FromEnv(FOLDERS_ENV), name=_folder_name(page))
    return cases


LAUNCHES = [Launch(HERE, WORLD, docs_cases, timeout=600, dirs=(FOLDERS_ENV,))]


def test_python_blocks_are_found_with_their_line_numbers() -> None:
    text = "x\n```python\na = 1\n```\n````markdown\n```python\nnot = python\n```\n````\n```bash\nls\n```\n" \
           "```python title\nb = 2\nc = 3\n```\n"
    assert python_blocks(text) == [(3, "a = 1"), (14, "b = 2\nc = 3")]


@pytest.mark.parametrize("page", [p for p in pages() if python_blocks((ROOT / p).read_text(encoding="utf-8"))])
def test_every_python_block_compiles(page: str) -> None:
    compile(page_script(page), str(ROOT / page), "exec")


def test_every_setup_script_belongs_to_a_page() -> None:
    scripts = sorted(str(p.relative_to(SETUP_DIR)) for p in SETUP_DIR.rglob("*.py"))
    orphans = [s for s in scripts if not (ROOT / Path(s).with_suffix(".md")).exists()]
    assert not orphans, f"tests/docs_setup scripts whose page does not exist: {orphans}"


@parametrize_cases(*LAUNCHES)
def test_the_python_blocks_of_each_page_run(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main(LAUNCHES)
