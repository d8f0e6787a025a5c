"""Memory per rank when the model is built on the meta device vs built whole.

Model: ``--layers`` x ``Linear(--width, --width)`` (default 16 x 4096 x 4096 fp32:
1.0 GiB of parameters), split evenly over ``--ranks`` (default 4) ranks with
``1f1b``. Two ``torch.distributed.run`` launches in one run, one per way of
building the model, so each starts from fresh processes:

* **whole**: ``torch.manual_seed(0); model = make()`` on every rank (the only way
  before deferred initialisation), then ``PipeDream(model, ...)``;
* **meta**: ``with torch.device("meta"): model = make()``, then
  ``PipeDream(model, ...)``, which allocates and initialises only this rank's
  layers (``reset_parameters()`` seeded per layer).

Every rank reports its resident set size (``/proc/self/statm``) after the process
group is up (baseline), after building the model, after ``PipeDream(...)`` and
after one training step (batch ``--batch``, 2 microbatches, SGD without momentum,
so the step adds this stage's gradients), and its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, a lifetime maximum) before and
after the step; plus the seconds building the model and the pipeline took.

Command (about a minute on 2 cores; the whole launch needs ~6 GB of memory):

    python benchmarks/deferred_init.py
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["MODES", "main", "parse_args", "peak_rss_bytes", "report", "rss_bytes", "run_driver",
           "run_worker"]

LOG = logging.getLogger("deferred_init")
JSON_TAG = "DEFERRED_INIT_JSON "
MODES = ("whole", "meta")
MIB = float(1 << 20)
# Per-rank measurements, in this order (bytes or seconds), gathered on rank 0.
FIELDS = ("baseline", "built", "pipeline", "stepped", "peak_built", "peak_stepped",
          "build_s", "pipeline_s", "step_s", "params")


def rss_bytes() -> int:
    """The current resident set size (``/proc/self/statm``'s second field, in pages)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_worker(args: argparse.Namespace) -> int:
    """One rank: build the model the ``--worker`` way, the pipeline, one step; report."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn

        import pipedream_ext as pd

        def make() -> nn.Sequential:
            return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

        values: Dict[str, float] = {"baseline": rss_bytes()}
        t0 = time.perf_counter()
        if args.worker == "meta":
            with torch.device("meta"):
                model = make()
        else:
            torch.manual_seed(0)
            model = make()
        values["build_s"] = time.perf_counter() - t0
        values["built"], values["peak_built"] = rss_bytes(), peak_rss_bytes()
        t0 = time.perf_counter()
        pipe = pd.PipeDream(model, F.mse_loss, schedule="1f1b", microbatches=2, timeout=300)
        values["pipeline_s"] = time.perf_counter() - t0
        values["pipeline"] = rss_bytes()
        values["peak_built"] = peak_rss_bytes()
        values["params"] = sum(p.numel() for p in pipe.parameters())
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, args.width, generator=g)
        t0 = time.perf_counter()
        loss = pipe.step(x, torch.zeros(args.batch, args.width))
        opt.step()
        values["step_s"] = time.perf_counter() - t0
        values["stepped"], values["peak_stepped"] = rss_bytes(), peak_rss_bytes()
        mine = torch.tensor([float(values[f]) for f in FIELDS], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        result.update(mode=args.worker, loss=float(loss), model_params=sum(
            p.numel() for p in model.parameters()),
            ranks=[dict(zip(FIELDS, t.tolist()), rank=r) for r, t in enumerate(everyone)])

    return h.worker(JSON_TAG, body, backend="gloo")


def _mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def report(results: Dict[str, Dict[str, Any]], info: Dict[str, str], command: str,
           total_s: float, *, title: str = "Deferred initialisation: memory per rank",
           model: str = "", split: str = "split evenly",
           seconds: str = "build + pipeline s") -> str:
    """The Markdown report: per rank, whole vs meta side by side, then the summary
    (also benchmarks/meta_init.py's, with its own title, model and split).

    Args:
        results: each mode's launch result (rank 0's JSON with every rank's values).
        info: :func:`_harness.machine_info`.
        command: the command line.
        total_s: the run's seconds.
        title: the report's heading.
        model: what the model is, after its size (e.g. ``"Llama, "``).
        split: how it was cut.
        seconds: the header of the seconds column.

    Returns:
        The report.
    """
    whole, meta = results["whole"], results["meta"]
    params = meta.get("model_params") or whole.get("model_params") or 0
    lines = [f"# {title}", "",
             h.machine_line(info), "",
             f"Model: {params / 1e6:,.0f}M fp32 parameters ({params * 4 / MIB:,.0f} MiB), "
             f"{model}{split} over {len(meta.get('ranks', []))} ranks with 1f1b. RSS in MiB; "
             "peak = `ru_maxrss` (lifetime maximum of the process); 'after build' is before "
             "`PipeDream(...)`, 'after pipeline' after it, 'after step' after one training step "
             "(gradients of the stage).", ""]
    for mode, result in results.items():
        if "error" in result:
            lines += [f"**{mode} failed**: {result['error']} (log: {result.get('log', 'n/a')})", ""]
    rows = []
    for w, m in zip(whole.get("ranks", []), meta.get("ranks", [])):
        rows.append([w["rank"], f"{w['params'] / 1e6:,.1f}M",
                     f"{_mib(w['built'])} / {_mib(m['built'])}",
                     f"{_mib(w['pipeline'])} / {_mib(m['pipeline'])}",
                     f"{_mib(w['peak_built'])} / {_mib(m['peak_built'])}",
                     f"{_mib(w['stepped'])} / {_mib(m['stepped'])}",
                     f"{_mib(w['peak_stepped'])} / {_mib(m['peak_stepped'])}",
                     f"{w['build_s'] + w['pipeline_s']:.2f} / {m['build_s'] + m['pipeline_s']:.2f}"])
    lines += h.table(["rank", "stage params", "RSS after build (whole / meta)",
                      "RSS after pipeline", "peak RSS up to pipeline", "RSS after step",
                      "peak RSS after step", seconds], rows)
    if rows:
        peak_w = max(r["peak_stepped"] for r in whole["ranks"])
        peak_m = max(r["peak_stepped"] for r in meta["ranks"])
        sum_w = sum(r["peak_stepped"] for r in whole["ranks"])
        sum_m = sum(r["peak_stepped"] for r in meta["ranks"])
        lines += ["", f"Largest peak of a rank: {_mib(peak_w)} MiB built whole, {_mib(peak_m)} MiB "
                  f"built on meta ({peak_w / peak_m:.1f}x less); all ranks together: {_mib(sum_w)} "
                  f"vs {_mib(sum_m)} MiB. Baseline RSS (torch imported, process group up): "
                  f"{_mib(meta['ranks'][0]['baseline'])} MiB."]
    launches = ", ".join(f"{mode} {r.get('launch_s', 0.0):.0f} s" for mode, r in results.items())
    lines += ["", f"Command: `{command}` (total {total_s:.0f} s; torchrun launches: {launches}).", ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    """Both launches, then ``<out-dir>/deferred_init.md`` and ``.json``."""
    info, command = h.start_report(LOG)
    t0 = time.perf_counter()
    results: Dict[str, Dict[str, Any]] = {}
    for mode in MODES:
        LOG.info("launching %d ranks, model built %s", args.ranks, mode)
        results[mode] = h.launch_torchrun(Path(__file__), args.ranks, ["--worker", mode] + h.forward(
            args, "layers", "width", "batch"), JSON_TAG, timeout=args.timeout)
    text = report(results, info, command, time.perf_counter() - t0)
    h.write_results(Path(args.out_dir), "deferred_init", text,
                    {"machine": info, "command": command, "results": results})
    return 1 if any("error" in r for r in results.values()) else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--worker whole|meta`` under torchrun)."""
    parser = h.make_parser(__doc__, MODES)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600)
    return parser.parse_args(argv)


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
