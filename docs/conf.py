"""Sphinx configuration of the pipedream_ext documentation (`make docs`, into build/docs).

The pages are Markdown (MyST); the API reference is autodoc over the public modules'
docstrings (Google style: Args/Returns/Raises, read by napoleon).
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout's package, with its built _C

project = "pipedream_ext"
author = "pipedream_ext developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Links to "page.md#a-heading" resolve as GitHub renders them.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
# benchmarks/README.md's generated result tables put #### under ## (update_readme.py).
suppress_warnings = ["myst.header"]

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Pages link the benchmarks as GitHub shows them (../benchmarks/README.md, relative to
# the page); on the site that file's text is the page benchmarks.md.
_BENCHMARKS_LINK = re.compile(r"\]\(((?:\.\./)+)benchmarks/README\.md")


def _benchmarks_page() -> str:
    """benchmarks/README.md with its links made relative to docs/ (images shown, raw
    result files as downloads)."""
    with open(os.path.join(ROOT, "benchmarks", "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    text = re.sub(r"\]\(results/([^)]+\.md)\)", r"](path:../benchmarks/results/\1)", text)
    return re.sub(r"\]\(results/", "](../benchmarks/results/", text)


def _read_source(app, docname: str, source: list) -> None:
    """Fills the benchmarks page and points every page's benchmark links at it."""
    if docname == "benchmarks":
        source[0] = _benchmarks_page()
    depth = docname.count("/")
    source[0] = _BENCHMARKS_LINK.sub("](" + "../" * depth + "benchmarks.md", source[0])


def setup(app) -> None:
    app.connect("source-read", _read_source)


html_theme = "alabaster"
html_title = "pipedream_ext"
