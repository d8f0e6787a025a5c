"""benchmarks/update_readme.py: README blocks take the generated result files."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from update_readme import fill_blocks  # noqa: E402


def test_blocks_take_the_result_files_without_their_title(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.md").write_text("# A title\n\n## Part\n| x |\n|---|\n| 1 |\n")
    (tmp_path / "results" / "b.md").write_text("plain")
    text = ("intro\n<!-- begin results/a.md -->\nold\n<!-- end results/a.md -->\nmiddle\n"
            "<!-- begin results/b.md -->\n<!-- end results/b.md -->\nend\n")
    out = fill_blocks(text, tmp_path)
    assert out == ("intro\n<!-- begin results/a.md -->\n### Part\n| x |\n|---|\n| 1 |\n"
                   "<!-- end results/a.md -->\nmiddle\n<!-- begin results/b.md -->\nplain\n"
                   "<!-- end results/b.md -->\nend\n")
    assert fill_blocks(out, tmp_path) == out  # idempotent


def test_a_missing_result_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="results/none.md"):
        fill_blocks("<!-- begin results/none.md -->\n<!-- end results/none.md -->\n", tmp_path)
