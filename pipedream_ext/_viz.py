"""Rank-by-time chart of a simulated schedule, written as a PNG (matplotlib, Agg).

One row per rank (rank 0 on top), x is the simulator's time. Every compute action
(F, B, I, W, ALLREDUCE) is a box coloured by its kind with the microbatch number
centred in it (``3v2``: microbatch 3 reading weight version 2, as in the action
text); ``U`` (the update, which takes no time in the simulator) is a vertical bar
at its instant. Interleaved schedules shade a rank's chunks differently (chunk 0
in the kind's colour, later chunks lighter). With ``comm=True`` SEND and RECV are
drawn as thin strips: SEND at the bottom of the row, as long as the transfer it
starts (``t_comm`` of the boundary), RECV at the top at the moment the data is in.

The image size depends only on the number of ranks and the width:
``image_size(ranks, width) == (width, 116 + 40 * ranks)`` pixels (1200 wide by
default, 100 dpi), whatever the schedule's length; see :func:`image_size`.

matplotlib is imported only when a plot is drawn (``pip install matplotlib``).
The figure is built with the object-oriented API on an Agg canvas, so pyplot's
global state and the user's interactive backend are left alone.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

from ._extension import _C

__all__ = ["COLORS", "DEFAULT_WIDTH", "image_size", "check_png_path", "draw_schedule"]

#: Pixels per inch of the written PNG.
DPI = 100
#: Default image width in pixels.
DEFAULT_WIDTH = 1200
MIN_WIDTH = 400
_ROW = 40      # pixels per rank row
_TOP = 36      # title
_BOTTOM = 80   # x tick labels, x label, legend
_LEFT = 78     # rank labels
_RIGHT = 14

#: Colour (hex RGB) of every action kind; chunk 0 uses exactly these.
COLORS: Dict[str, str] = {
    "F": "#1f77b4",          # blue
    "B": "#2ca02c",          # green
    "I": "#17becf",          # cyan: input-gradient half of a backward
    "W": "#9467bd",          # purple: weight-gradient half
    "ALLREDUCE": "#ff7f0e",  # orange
    "UPDATE": "#d62728",     # red
    "SEND_F": "#7f7f7f",     # grey
    "SEND_B": "#7f7f7f",
    "RECV_F": "#303030",     # dark grey
    "RECV_B": "#303030",
}
_LEGEND = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad",
           "ALLREDUCE": "all-reduce", "UPDATE": "U update", "SEND": "send", "RECV": "recv"}
_SENDS = (_C.ActionKind.SEND_F, _C.ActionKind.SEND_B)
_MIN_BOX_PX = 3.0   # zero-time boxes (an all-reduce with t_allreduce=0) stay visible
_LABEL_FONT = 8.0


def image_size(ranks: int, width: int = DEFAULT_WIDTH) -> Tuple[int, int]:
    """Returns the ``(width, height)`` in pixels of the PNG drawn for ``ranks`` ranks.

    ``height = 116 + 40 * ranks``; the width is what was asked for (at least 400).
    """
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1 (got {ranks!r})")
    if not isinstance(width, int) or isinstance(width, bool) or width < MIN_WIDTH:
        raise ValueError(f"plot width must be an integer number of pixels >= {MIN_WIDTH} "
                         f"(got {width!r})")
    return width, _TOP + _BOTTOM + _ROW * ranks


def check_png_path(path: Union[str, os.PathLike]) -> str:
    """Checks that ``path`` names a ``.png`` file in an existing, writable directory.

    Returns:
        The path as a string.

    Raises:
        ValueError: naming the path and what to change.
    """
    text = os.fspath(path)
    if not text.lower().endswith(".png"):
        raise ValueError(f"the plot is written as PNG: give a path ending in .png (got {text!r})")
    if os.path.isdir(text):
        raise ValueError(f"plot path {text!r} is a directory; give a file name ending in .png")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write the plot {text!r}: directory {directory!r} does not exist "
                         "(create it first)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write the plot {text!r}: directory {directory!r} is not writable")
    return text


def _import_matplotlib():
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional dependency
        from matplotlib.figure import Figure  # noqa: PLC0415 - optional dependency
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting a schedule needs matplotlib: pip install matplotlib") from exc
    return matplotlib, Figure, FigureCanvasAgg


def _lighter(color: str, amount: float) -> Tuple[float, float, float]:
    """``color`` mixed with white (``amount`` 0: unchanged, 1: white)."""
    r, g, b = (int(color[i:i + 2], 16) / 255.0 for i in (1, 3, 5))
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _text_color(rgb: Tuple[float, float, float]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.5 else "white"


def _label(action: "_C.Action") -> str:
    if action.kind == _C.ActionKind.ALLREDUCE:
        return f"v{action.version}"
    return f"{action.microbatch}v{action.version}" if action.version else str(action.microbatch)


def _transfer_time(send: "_C.Action", t_comm: List[float]) -> float:
    boundary = send.transfer.boundary  # stage j -> j+1 is boundary j
    return t_comm[boundary] if 0 <= boundary < len(t_comm) else 0.0


def _default_title(schedule: Any) -> str:
    parts = [f"{schedule.name}: {schedule.num_stages} stages"]
    if schedule.num_ranks != schedule.num_stages:
        parts.append(f"{schedule.num_ranks} ranks")
    parts.append(f"{schedule.microbatches} microbatches")
    if schedule.batches > 1:
        parts.append(f"{schedule.batches} batches")
    if any(r > 1 for r in schedule.replicas):
        parts.append("replicas " + ",".join(map(str, schedule.replicas)))
    return ", ".join(parts)


class _Chart:
    """One chart being drawn: the axes, the scale and the legend entries seen so far."""

    def __init__(self, ax: Any, schedule: Any, px_per_unit: float) -> None:
        self.ax = ax
        self.px_per_unit = px_per_unit
        self.chunks = {r: list(schedule.stages_of_rank(r)) for r in range(schedule.num_ranks)}
        self.most_chunks = max(len(s) for s in self.chunks.values())
        self.seen: Dict[str, Tuple[float, float, float]] = {}
        self.shaded: Dict[Tuple[str, int], Tuple[float, float, float]] = {}

    def fill(self, kind: str, chunk: int) -> Tuple[float, float, float]:
        # Later chunks of an interleaved rank are lighter shades of the kind's colour.
        amount = 0.0 if self.most_chunks == 1 else 0.55 * chunk / (self.most_chunks - 1)
        return _lighter(COLORS[kind], amount)

    def box(self, action: "_C.Action", chunk: int, rank: int, start: float, end: float) -> None:
        from matplotlib.patches import Rectangle  # noqa: PLC0415 - optional dependency

        kind = action.kind.name
        color = self.fill(kind, chunk)
        x0, w = start, max(end - start, _MIN_BOX_PX / self.px_per_unit)
        self.ax.add_patch(Rectangle((x0, rank + 0.08), w, 0.84, facecolor=color,
                                    edgecolor="white", linewidth=0.6))
        self.seen.setdefault(kind, COLORS[kind])
        if self.most_chunks > 1:
            self.shaded[(kind, chunk)] = color
        label = _label(action)
        box_px = w * self.px_per_unit
        for size in (_LABEL_FONT, 6.5):
            if len(label) * 0.62 * size * DPI / 72 + 3 <= box_px:
                self.ax.text(x0 + w / 2, rank + 0.5, label, ha="center", va="center",
                             fontsize=size, color=_text_color(color))
                break

    def update_bar(self, rank: int, start: float) -> None:
        self.ax.plot([start, start], [rank + 0.04, rank + 0.96], color=COLORS["UPDATE"],
                     linewidth=2.0, solid_capstyle="butt", clip_on=False, zorder=3)
        self.seen.setdefault("UPDATE", COLORS["UPDATE"])

    def transfer(self, action: "_C.Action", rank: int, start: float, end: float,
                 comm_costs: List[float]) -> None:
        from matplotlib.patches import Rectangle  # noqa: PLC0415 - optional dependency

        send = action.kind in _SENDS
        if send:  # as long as the transfer it starts, at the row's bottom
            w = max(end - start, _transfer_time(action, comm_costs))
            y0 = rank + 0.80
        else:
            w = end - start
            y0 = rank + 0.04
        w = max(w, 2.0 / self.px_per_unit)
        color = COLORS[action.kind.name]
        self.ax.add_patch(Rectangle((start, y0), w, 0.16, facecolor=color, edgecolor="none", zorder=4))
        self.seen.setdefault("SEND" if send else "RECV", color)

    def draw_timeline(self, timeline: Any, comm: bool, comm_costs: List[float]) -> None:
        for rank, _step, action, start, end in timeline:
            stage = action.stage
            chunk = self.chunks[rank].index(stage) if stage in self.chunks[rank] else 0
            if action.is_compute or action.kind == _C.ActionKind.ALLREDUCE:
                self.box(action, chunk, rank, start, end)
            elif action.kind == _C.ActionKind.UPDATE:
                self.update_bar(rank, start)
            elif comm:  # SEND_*/RECV_*
                self.transfer(action, rank, start, end, comm_costs)

    def label_axes(self, ranks: int) -> None:
        ax = self.ax
        ax.set_yticks([r + 0.5 for r in range(ranks)])
        ax.set_yticklabels([f"rank {r}\nstage{'s' if len(self.chunks[r]) > 1 else ''} "
                            + ",".join(map(str, self.chunks[r])) for r in range(ranks)], fontsize=8)
        ax.tick_params(axis="y", length=0)
        for r in range(1, ranks):
            ax.axhline(r, color="#dddddd", linewidth=0.6)
        ax.set_xlabel("simulated time (cost units)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)

    def legend_handles(self) -> List[Any]:
        from matplotlib.lines import Line2D  # noqa: PLC0415 - optional dependency
        from matplotlib.patches import Patch  # noqa: PLC0415 - optional dependency

        handles: List[Any] = []
        for kind in ("F", "B", "I", "W", "ALLREDUCE", "UPDATE", "SEND", "RECV"):
            if kind not in self.seen:
                continue
            if kind == "UPDATE":
                handles.append(Line2D([], [], color=COLORS[kind], linewidth=2.0, label=_LEGEND[kind]))
                continue
            handles.append(Patch(facecolor=self.seen[kind], label=_LEGEND[kind]))
            for (k, chunk), color in sorted(self.shaded.items()):
                if k == kind and chunk > 0:
                    handles.append(Patch(facecolor=color, label=f"{kind} chunk {chunk}"))
        return handles


def draw_schedule(schedule: Any, result: Any, comm_costs: List[float], path: str,
                  comm: bool = False, title: Optional[str] = None,
                  width: int = DEFAULT_WIDTH) -> None:
    """Writes the rank-by-time chart of an already simulated schedule.

    Args:
        schedule: a :class:`~pipedream_ext.schedules.Schedule` (read: its name, sizes,
            replicas and ``stages_of_rank``).
        result: its :class:`~pipedream_ext.schedules.SimulationResult` (``timeline``,
            ``makespan``, ``bubble_fraction``).
        comm_costs: the transfer time of every stage boundary (SEND strips' length).
        path: output file, checked by :func:`check_png_path`.
        comm: also draw SEND and RECV (thin strips).
        title: replaces the default title (schedule name and sizes); the bubble
            fraction and makespan are appended either way.
        width: image width in pixels (the height follows from the ranks).

    Raises:
        ValueError: bad width.
        RuntimeError: matplotlib is not installed.
    """
    ranks = schedule.num_ranks
    img_w, img_h = image_size(ranks, width)
    matplotlib, Figure, FigureCanvasAgg = _import_matplotlib()
    makespan = result.makespan if result.makespan > 0 else 1.0
    axes_px = img_w - _LEFT - _RIGHT
    # Only these settings shape the file; pin them against the user's matplotlibrc.
    rc = {"savefig.bbox": "standard", "savefig.transparent": False, "savefig.facecolor": "white",
          "figure.facecolor": "white", "axes.facecolor": "white", "font.family": "DejaVu Sans",
          "font.size": 9.0, "text.usetex": False, "axes.grid": False}
    with matplotlib.rc_context(rc):
        fig = Figure(figsize=(img_w / DPI, img_h / DPI), dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_axes((_LEFT / img_w, _BOTTOM / img_h, axes_px / img_w, _ROW * ranks / img_h))
        ax.set_xlim(0, makespan)
        ax.set_ylim(ranks, 0)  # rank 0 on top
        chart = _Chart(ax, schedule, axes_px / makespan)
        chart.draw_timeline(result.timeline, comm, comm_costs)
        chart.label_axes(ranks)
        handles = chart.legend_handles()
        ncol = max(1, min(len(handles), axes_px // 105))
        fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, 0.0), handlelength=1.4, columnspacing=1.2)
        heading = title if title is not None else _default_title(schedule)
        fig.suptitle(f"{heading}  |  bubble {result.bubble_fraction:.1%}, "
                     f"makespan {result.makespan:g}", fontsize=10, y=1 - 6 / img_h, va="top")
        fig.savefig(path, dpi=DPI, format="png")
