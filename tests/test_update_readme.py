"""benchmarks/update_readme.py: README blocks take the generated result files."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from update_readme import fill_blocks


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


def test_relative_links_of_a_result_file_point_from_the_readme(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "t.md").write_text(
        "![plot](t.png) [raw](t.json) [web](https://x.org/a.png) [here](#top) [up](../a.md)\n")
    out = fill_blocks("<!-- begin results/t.md -->\n<!-- end results/t.md -->\n", tmp_path)
    assert "![plot](results/t.png) [raw](results/t.json) [web](https://x.org/a.png) " \
           "[here](#top) [up](../a.md)" in out


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md"] +
                         sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
def test_every_image_and_local_link_of_the_docs_resolves(doc: str) -> None:
    import re

    text = (ROOT / doc).read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = (ROOT / doc).parent / target.split("#", 1)[0]
        if not path.exists():
            missing.append(target)
    assert not missing, f"{doc} links to files that do not exist: {missing}"
