"""Copies the generated result tables into benchmarks/README.md (the last step of
`make bench`), so the README's numbers are always those of the latest run.

A block in the README looks like::

    <!-- begin results/throughput.md -->
    ...replaced by the file's content...
    <!-- end results/throughput.md -->

Usage: ``python benchmarks/update_readme.py [--readme benchmarks/README.md]``.
Exits with status 2 naming the file when a block's result file is missing.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import List, Optional

__all__ = ["fill_blocks", "main"]

LOG = logging.getLogger("update_readme")
# A relative link target: no scheme, no leading "/" or "#", not already "../".
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|/|#|\.\./)([^)\s]+)\)")
BLOCK = re.compile(r"(<!-- begin (?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- end (?P=name) -->)",
                   re.DOTALL)


def fill_blocks(text: str, root: Path) -> str:
    """Returns ``text`` with every block's body replaced by ``root / name``'s content.

    A leading ``# Title`` line of the result file is dropped (the README has its own
    headings), the file's other headings go one level down, and its relative links
    (``![plot](throughput.png)``, relative to the result file) are made relative to
    the README (``results/throughput.png``).

    Raises:
        FileNotFoundError: a block names a result file that does not exist.
    """
    def replace(match: "re.Match[str]") -> str:
        path = root / match.group("name")
        if not path.is_file():
            raise FileNotFoundError(f"{path} (named by a README block) does not exist; run "
                                    "`make bench` first")
        body = path.read_text()
        lines = body.splitlines()
        if lines and lines[0].startswith("# "):
            lines = lines[1:]
        # The README's section is "##": the file's own headings go one level down.
        body = "\n".join("#" + l if l.startswith("#") else l for l in lines).lstrip("\n")
        folder = Path(match.group("name")).parent.as_posix()
        if folder not in ("", "."):
            body = LINK.sub(lambda m: f"]({folder}/{m.group(1)})", body)
        if not body.endswith("\n"):
            body += "\n"
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(replace, text)


def main(argv: Optional[List[str]] = None) -> int:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=here / "README.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        text = args.readme.read_text()
        updated = fill_blocks(text, args.readme.parent)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    count = len(BLOCK.findall(text))
    args.readme.write_text(updated)
    LOG.info("updated %d result blocks in %s", count, args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
