"""Schedule plots (``Schedule.plot`` and ``schedule --plot``): checked for content,
not only existence: a valid PNG of the documented size with every kind's colour."""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")
from matplotlib import image as mpimg

import pipedream_ext._viz as _plot
from pipedream_ext import schedules

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple:
    """(width, height) from the PNG signature and the IHDR chunk, which must come first."""
    with open(path, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == PNG_SIGNATURE, "not a PNG file"
    length, chunk = struct.unpack(">I4s", head[8:16])
    assert chunk == b"IHDR" and length == 13
    return struct.unpack(">II", head[16:24])


def _colors(path) -> set:
    """Distinct RGB colours of the decoded image, as 0..255 integer triples."""
    pixels = mpimg.imread(str(path))
    rgb = (pixels[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(c) for c in rgb.tolist()}


def _rgb(hex_color: str) -> tuple:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def _has(colors: set, hex_color: str) -> bool:
    target = _rgb(hex_color)
    return any(all(abs(a - b) <= 1 for a, b in zip(c, target)) for c in colors)


def test_image_size_is_a_function_of_ranks_and_width():
    assert _plot.image_size(4) == (1200, 116 + 40 * 4)
    assert _plot.image_size(1, 400) == (400, 156)
    with pytest.raises(ValueError, match="plot width must be an integer number of pixels >= 400"):
        _plot.image_size(4, 399)


def test_1f1b_plot_is_a_png_of_the_expected_size_with_every_kind(tmp_path):
    s = schedules.build("1f1b", stages=4, microbatches=8)
    path = tmp_path / "s.png"
    result = s.plot(path)
    assert result.bubble_fraction == pytest.approx(3 / 11)
    assert _png_size(path) == _plot.image_size(4) == (1200, 276)
    colors = _colors(path)
    for kind in ("F", "B", "UPDATE"):
        assert _has(colors, _plot.COLORS[kind]), kind
    for kind in ("I", "W", "ALLREDUCE"):  # not in this schedule, not in the picture
        assert not _has(colors, _plot.COLORS[kind]), kind
    assert len(colors) > 20  # boxes, antialiased text, axes: not a blank canvas


def test_size_follows_ranks_replicas_and_width(tmp_path):
    replicated = schedules.build("pipedream", stages=3, microbatches=8, replicas=[2, 1, 1])
    path = tmp_path / "r.png"
    replicated.plot(path, t_comm=0.3, t_allreduce=0.5, comm=True, width=800)
    assert _png_size(path) == _plot.image_size(4, 800) == (800, 276)  # one row per rank
    colors = _colors(path)
    for kind in ("F", "B", "ALLREDUCE", "UPDATE", "SEND_F", "RECV_F"):
        assert _has(colors, _plot.COLORS[kind]), kind

    two = schedules.build("gpipe", stages=2, microbatches=4)
    two.plot(tmp_path / "two.png")
    assert _png_size(tmp_path / "two.png") == (1200, 196)


def test_zero_bubble_and_interleaved_colours(tmp_path):
    zb = schedules.build("zb-h1", stages=4, microbatches=8)
    zb.plot(tmp_path / "zb.png", t_f=1, t_b=1, t_w=1)
    colors = _colors(tmp_path / "zb.png")
    for kind in ("F", "I", "W", "UPDATE"):
        assert _has(colors, _plot.COLORS[kind]), kind

    inter = schedules.build("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    inter.plot(tmp_path / "i.png")
    assert _png_size(tmp_path / "i.png") == _plot.image_size(2)  # rows are ranks, not stages
    colors = _colors(tmp_path / "i.png")
    lighter = tuple(round(255 * c) for c in _plot._lighter(_plot.COLORS["F"], 0.55))
    assert _has(colors, _plot.COLORS["F"]) and any(
        all(abs(a - b) <= 1 for a, b in zip(c, lighter)) for c in colors)  # chunk 1 shaded


def test_plot_rejects_bad_paths(tmp_path):
    s = schedules.build("1f1b", stages=2, microbatches=2)
    with pytest.raises(ValueError, match="ending in .png"):
        s.plot(tmp_path / "s.jpg")
    with pytest.raises(ValueError, match="does not exist"):
        s.plot(tmp_path / "missing" / "s.png")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        s.plot(tmp_path / "dir.png")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipedream_ext", "schedule", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_plot_writes_the_png_and_keeps_the_text_output(tmp_path):
    path = tmp_path / "p.png"
    out = _cli("--name", "1f1b", "--stages", "4", "--microbatches", "8", "--t-f", "1", "--t-b", "2",
               "--plot", str(path))
    assert out.returncode == 0, out.stderr
    assert "bubble fraction" in out.stdout and "wrote schedule plot" in out.stderr
    assert _png_size(path) == (1200, 276)
    assert _has(_colors(path), _plot.COLORS["B"])


def test_cli_plot_bad_path_exits_2_with_a_message(tmp_path):
    out = _cli("--name", "1f1b", "--stages", "4", "--microbatches", "8",
               "--plot", str(tmp_path / "schedule.jpg"))
    assert out.returncode == 2
    assert "error: the plot is written as PNG: give a path ending in .png (got" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""  # failed before any output


@pytest.mark.parametrize("target, extra, needle", [
    ("missing/schedule.png", [], "directory"),
    ("afile/schedule.png", [], "does not exist (create it first)"),  # the parent is a file
    ("dir.png", [], "is a directory"),
    ("ok.png", ["--plot-width", "100"], "plot width must be an integer number of pixels >= 400"),
])
def test_cli_plot_bad_input_returns_2(tmp_path, capsys, target, extra, needle):
    from pipedream_ext.__main__ import main

    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "dir.png").mkdir()
    code = main(["schedule", "--name", "1f1b", "--stages", "2", "--microbatches", "2",
                 "--plot", str(tmp_path / target), *extra])
    captured = capsys.readouterr()
    assert code == 2 and needle in captured.err and captured.out == ""
    assert not (tmp_path / "ok.png").exists()


def test_readme_example_image_has_the_documented_size():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "docs", "images", "schedule_1f1b.png")
    assert _png_size(path) == _plot.image_size(4)  # made by the command in docs/guide/schedules.md
    assert _has(_colors(path), _plot.COLORS["F"]) and _has(_colors(path), _plot.COLORS["B"])
