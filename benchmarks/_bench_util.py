"""Shared helpers of plan_accuracy.py, memory.py and soak.py (no torch at import time).

* :func:`machine_info` / :func:`machine_line`: cores, CPU model, torch and Python
  versions, platform, load average (what the numbers were taken on);
* :func:`command_line`: the exact command that produced a report;
* :func:`launch_torchrun`: runs one of these scripts in ``--worker`` mode under
  ``python -m torch.distributed.run --standalone`` (OMP_NUM_THREADS=1) and returns
  the JSON object that rank 0 printed after ``tag``.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
LOG = logging.getLogger("bench")


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo, or ``unknown``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> Dict[str, str]:
    """What the numbers were measured on (torch imported lazily)."""
    import torch

    try:
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    return {"cpu_count": str(os.cpu_count()), "cpu_model": cpu_model(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "loadavg_at_start": load}


def machine_line(info: Dict[str, str]) -> str:
    """One Markdown sentence describing the machine."""
    return (f"Machine: os.cpu_count()={info['cpu_count']}, CPU {info['cpu_model']}, torch {info['torch']}, "
            f"Python {info['python']}, {info['platform']}, CUDA: {info['cuda']}; load average at start "
            f"{info['loadavg_at_start']} (1/5/15 min).")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command as typed, relative to the repository root where possible."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python3", str(script)] + args)


def launch_torchrun(script: Path, nproc: int, args: List[str], tag: str, timeout: float,
                    env_extra: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Runs ``script --worker ...`` on ``nproc`` local ranks; returns rank 0's tagged JSON.

    On failure the result is ``{"error": "...", "launch_s": ...}`` with the tail of stderr.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script)] + args
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    LOG.debug("launch: %s", " ".join(cmd))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "launch_s": time.perf_counter() - t0}
    out: Optional[Dict[str, Any]] = None
    for line in proc.stdout.splitlines():
        if line.startswith(tag):
            out = json.loads(line[len(tag):])
    if out is None or proc.returncode != 0:
        out = dict(out or {})
        out["error"] = f"exit {proc.returncode}: " + " | ".join(failure_lines(proc.stderr or proc.stdout))
        # The whole output of a failed launch is kept for diagnosis.
        fd, path = tempfile.mkstemp(prefix=f"{Path(script).stem}-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(" ".join(cmd) + "\n--- stdout ---\n" + proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        out["log"] = path
        LOG.error("launch failed; full output in %s", path)
    out["launch_s"] = time.perf_counter() - t0
    return out


def failure_lines(text: str, limit: int = 6) -> List[str]:
    """The lines of a failed launch's output that say what went wrong: exceptions,
    errors and signals (torchrun's banner and profiler noise left out), else the tail."""
    keys = ("Error", "error:", "Exception", "Signal", "terminate called", "Aborted", "what():")
    noise = ("USDT:", "torch.distributed.elastic", "error_file", "traceback :", "To enable traceback")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not any(n in ln for n in noise)]
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    return (hits or lines)[-limit:]


def fmt(value: Optional[float], digits: int = 2) -> str:
    """``n/a`` for None, else fixed-point."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def pct(value: Optional[float]) -> str:
    """A relative error as a signed percentage (``+12%``)."""
    return "n/a" if value is None else f"{100 * value:+.0f}%"
