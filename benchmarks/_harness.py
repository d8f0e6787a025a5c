"""The one harness every benchmark script stands on (no torch at import time).

* machine info: :func:`machine_info`, :func:`machine_line` (what the numbers were
  taken on) and :func:`command_line` (the command that produced a report);
* commands: :func:`run_command` and :func:`launch_torchrun` with one failure policy
  (:class:`CommandFailed`): a failed command (non-zero exit, time-out, or a launch
  whose rank 0 printed no result) keeps its whole output in a log file, and the
  error names that file and the lines of the output that say what went wrong
  (:func:`failure_lines`);
* how quiet the machine was: :class:`CpuWatch` (the CPU time other processes and the
  hypervisor took while a command ran; :func:`launch_torchrun` records it);
* workers: :func:`worker` runs one rank's body under ``torch.distributed`` and prints
  its JSON result for the driver;
* formatting and results: :func:`fmt`, :func:`pct`, :func:`table`, :func:`table_row`,
  :func:`write_results` (Markdown and JSON under ``benchmarks/results``), :func:`pyplot`
  and :func:`save_figure` for the plots;
* the command-line skeleton: :func:`make_parser`, :func:`setup_logging`, :func:`main`;
* the shared models: :func:`mlp` and :func:`digits` (examples/train_digits.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["RESULTS", "ROOT", "all_gather_json", "apply_smoke", "check_step_args", "command_line", "command_sentence",
           "CommandFailed", "cpu_model", "CpuWatch", "digits", "failure_lines", "fmt", "forward", "launch_failed",
           "launch_torchrun", "machine_info", "machine_line", "main", "make_parser", "measure_bandwidth", "mlp",
           "models", "pct", "pyplot", "run_command", "save_figure", "setup_logging", "start_report", "table",
           "table_row", "worker", "write_results"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LOG = logging.getLogger("bench")


# ----------------------------------------------------------------------------- machine
def cpu_model() -> str:
    """The CPU's name.

    Returns:
        ``model name`` of /proc/cpuinfo, else ``platform.processor()``, else ``unknown``.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> Dict[str, str]:
    """What the numbers are measured on (imports torch).

    Returns:
        ``cpu_count``, ``cpu_model``, ``torch``, ``python``, ``platform``, ``cuda``
        (device name or ``none``) and ``loadavg_at_start`` (1, 5 and 15 minutes), all strings.
    """
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
    """One Markdown sentence describing the machine of :func:`machine_info`."""
    return (f"Machine: os.cpu_count()={info['cpu_count']}, CPU {info['cpu_model']}, torch {info['torch']}, "
            f"Python {info['python']}, {info['platform']}, CUDA: {info['cuda']}; load average at start "
            f"{info['loadavg_at_start']} (1/5/15 min).")


class CpuWatch:
    """The CPU time others took while a command ran: entered before it starts, left after
    it was waited for (so its processes' time is in ``RUSAGE_CHILDREN``).

    ``others_share``: the node's busy CPU time (``/proc/stat``: user, nice, system, irq,
    softirq) less this process's and its waited-for descendants', as a share of the
    wall time times the CPUs: what other processes took from the cores (two ranks
    per core look alike in the numbers measured, whatever the cost model says).
    ``steal_share``: the time the hypervisor ran something else on the virtual CPUs.
    Both are None where ``/proc/stat`` does not exist.
    """

    def __init__(self) -> None:
        self.others_share: Optional[float] = None
        self.steal_share: Optional[float] = None
        self._start: Optional[Tuple[float, Tuple[float, float], float]] = None

    @staticmethod
    def _node() -> Optional[Tuple[float, float]]:
        """Busy and stolen seconds of all CPUs since boot, or None off Linux."""
        try:
            fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        tick = float(os.sysconf("SC_CLK_TCK"))
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
        return (user + nice + system + irq + softirq) / tick, steal / tick

    @staticmethod
    def _ours() -> float:
        seconds = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            seconds += usage.ru_utime + usage.ru_stime
        return seconds

    def __enter__(self) -> "CpuWatch":
        node = self._node()
        self._start = None if node is None else (time.perf_counter(), node, self._ours())
        return self

    def __exit__(self, *exc: Any) -> None:
        node = self._node()
        if self._start is None or node is None:
            return
        t0, (busy0, steal0), ours0 = self._start
        capacity = (time.perf_counter() - t0) * (os.cpu_count() or 1)
        if capacity > 0:
            self.others_share = max(0.0, (node[0] - busy0) - (self._ours() - ours0)) / capacity
            self.steal_share = max(0.0, node[1] - steal0) / capacity


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command as typed, the script relative to the repository root where possible.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python3", str(script)] + args)


# ----------------------------------------------------------------------------- commands
def failure_lines(text: str, limit: int = 6) -> List[str]:
    """The lines of a failed command's output that say what went wrong.

    Exceptions, errors and signals, with torchrun's banner and profiler noise left out;
    the tail of the output when no line names an error.

    Args:
        text: the command's output.
        limit: at most this many lines (the last ones).
    """
    keys = ("Error", "error:", "Exception", "Signal", "terminate called", "Aborted", "what():")
    noise = ("USDT:", "torch.distributed.elastic", "error_file", "traceback :", "To enable traceback")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not any(n in ln for n in noise)]
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    return (hits or lines)[-limit:]


class CommandFailed(subprocess.CalledProcessError):
    """A command failed; its whole output is in ``log``.

    Attributes:
        log: path of the file that keeps the command line, stdout and stderr.
        lines: the lines of the output that name the error (:func:`failure_lines`).
        reason: ``exit N``, ``timed out after S s`` or ``exit 0 but no result``.
    """

    def __init__(self, cmd: Sequence[str], returncode: int, stdout: str, stderr: str, log: str,
                 reason: str) -> None:
        super().__init__(returncode, list(cmd), stdout, stderr)
        self.log = log
        self.reason = reason
        self.lines = failure_lines(stderr or stdout)

    @property
    def summary(self) -> str:
        """``reason: line | line``, without the log's path."""
        return f"{self.reason}: " + " | ".join(self.lines)

    def __str__(self) -> str:
        return f"{self.summary} (full output: {self.log})"


def _keep_log(cmd: Sequence[str], stdout: str, stderr: str) -> str:
    """Writes a failed command's whole output to a new file; returns its path."""
    stem = Path(cmd[-1]).stem if cmd else "command"
    for arg in cmd:
        if arg.endswith(".py"):
            stem = Path(arg).stem
            break
    fd, path = tempfile.mkstemp(prefix=f"{stem}-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(" ".join(cmd) + "\n--- stdout ---\n" + stdout + "\n--- stderr ---\n" + stderr)
    return path


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def run_command(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
                ok: Optional[Callable[[str], bool]] = None) -> "subprocess.CompletedProcess[str]":
    """Runs ``cmd`` to completion, capturing its output.

    Args:
        cmd: the command.
        timeout: seconds before it is killed.
        env: its environment (default: this process's).
        ok: with it, a command that exits 0 but whose stdout ``ok`` rejects failed too.

    Returns:
        The completed process.

    Raises:
        CommandFailed: a non-zero exit, a time-out or an output ``ok`` rejects; the
            whole output is kept in the exception's ``log`` file.
    """
    cmd = [str(c) for c in cmd]
    LOG.debug("run: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out, err = _text(exc.stdout), _text(exc.stderr)
        raise CommandFailed(cmd, -9, out, err, _keep_log(cmd, out, err), f"timed out after {timeout:.0f} s") \
            from None
    if proc.returncode != 0:
        reason = f"exit {proc.returncode}"
    elif ok is not None and not ok(proc.stdout):
        reason = "exit 0 but no result"
    else:
        return proc
    raise CommandFailed(cmd, proc.returncode, proc.stdout, proc.stderr,
                        _keep_log(cmd, proc.stdout, proc.stderr), reason)


def _tagged(stdout: str, tag: str) -> Optional[Dict[str, Any]]:
    """The JSON object of the last stdout line that starts with ``tag``."""
    out = None
    for line in stdout.splitlines():
        if line.startswith(tag):
            out = json.loads(line[len(tag):])
    return out


def launch_torchrun(script: Path, nproc: int, args: Sequence[str], tag: str, timeout: float,
                    env_extra: Optional[Dict[str, str]] = None, check: bool = False) -> Dict[str, Any]:
    """Runs ``script args`` on ``nproc`` local ranks under ``torch.distributed.run
    --standalone`` (one OpenMP/MKL thread per rank, the repository on PYTHONPATH).

    Args:
        script: the script; its workers print ``tag`` + a JSON object on rank 0
            (:func:`worker`).
        nproc: ranks.
        args: the script's arguments.
        tag: the prefix of the result line.
        timeout: seconds before the launch is killed.
        env_extra: more environment variables.
        check: raise on failure instead of reporting it in the result.

    Returns:
        Rank 0's JSON object plus ``launch_s`` and, on Linux, ``others_cpu_share`` and
        ``steal_share`` (:class:`CpuWatch`: how quiet the machine was). A failed launch (non-zero exit,
        time-out, no result line) also has ``error`` (what failed and the lines that
        name the error) and ``log`` (the file that keeps its whole output); whatever
        rank 0 reported before it failed is kept.

    Raises:
        CommandFailed: with ``check``, when the launch failed.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script)] + [str(a) for a in args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    t0 = time.perf_counter()
    with CpuWatch() as watch:
        try:
            proc = run_command(cmd, timeout, env=env, ok=lambda out: _tagged(out, tag) is not None)
            out = _tagged(proc.stdout, tag) or {}
        except CommandFailed as exc:
            if check:
                raise
            out = _tagged(exc.stdout, tag) or {}
            out.update(error=exc.summary, log=exc.log)
            LOG.error("launch of %s failed: %s", Path(script).name, exc)
    out["launch_s"] = time.perf_counter() - t0
    if watch.others_share is not None:
        out.update(others_cpu_share=watch.others_share, steal_share=watch.steal_share)
    return out


def forward(args: argparse.Namespace, *names: str) -> List[str]:
    """The driver's options ``names`` as command-line arguments for its workers.

    Args:
        args: the parsed options.
        names: attribute names (``pipe_timeout`` becomes ``--pipe-timeout``); a list
            value is passed comma-separated.

    Returns:
        ``["--name", "value", ...]``.
    """
    out: List[str] = []
    for name in names:
        value = getattr(args, name)
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        out += ["--" + name.replace("_", "-"), text]
    return out


def launch_failed(result: Dict[str, Any]) -> bool:
    """Whether a :func:`launch_torchrun` result is of a failed launch (errors a worker
    reported as data, with a clean exit, are not)."""
    return "log" in result


def worker(tag: str, body: Callable[[Dict[str, Any]], None], backend: Optional[str] = None) -> int:
    """One rank of a launch: sets up the process group, runs ``body(result)`` and prints
    ``tag`` + ``result`` as JSON on rank 0.

    One thread per rank; pipedream_ext's own logging at WARNING. An exception in
    ``body`` becomes ``result["error"]`` (and the exit status 1), so the driver
    reads what failed beside what was measured.

    Args:
        tag: the result line's prefix (:func:`launch_torchrun`).
        body: fills the result dict (it has ``world``).
        backend: the process group's backend (default: NCCL with CUDA, else Gloo).

    Returns:
        The exit status: 0, or 1 when ``body`` raised.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("pipedream_ext").setLevel(logging.WARNING)
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    rank = dist.get_rank()
    result: Dict[str, Any] = {"world": dist.get_world_size()}
    try:
        body(result)
    except Exception as exc:  # reported to the driver as data
        LOG.exception("rank %d failed", rank)
        result["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"
    if rank == 0:
        print(tag + json.dumps(result), flush=True)
    if "error" not in result:
        # A failed rank's peers may be stuck in a collective: no barrier then.
        dist.barrier()
    dist.destroy_process_group()
    return 0 if "error" not in result else 1


# ----------------------------------------------------------------------------- formatting
def fmt(value: Optional[float], digits: int = 2, none: str = "n/a") -> str:
    """A number in fixed point with ``digits`` decimals, ``none`` for None."""
    return none if value is None else f"{value:.{digits}f}"


def pct(value: Optional[float]) -> str:
    """A relative error as a signed percentage (``+12%``), ``n/a`` for None."""
    return "n/a" if value is None else f"{100 * value:+.0f}%"


def table_row(cells: Sequence[Any]) -> str:
    """One Markdown table row; an empty cell is a single space (``| a | | b |``) and a
    ``|`` inside a cell (error messages join lines with it) is escaped."""
    texts = [str(c).replace("|", "\\|") for c in cells]
    return "|" + "|".join(f" {t} " if t else " " for t in texts) + "|"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]] = ()) -> List[str]:
    """A Markdown table: the header, its ``|---|`` rule and one line per row."""
    return [table_row(header), "|" + "---|" * len(header)] + [table_row(r) for r in rows]


def run_options(args: argparse.Namespace, *skip: str) -> Dict[str, Any]:
    """The options a run used, for its JSON record: ``args`` without the parser's own
    (``out_dir``, ``worker``, ``verbose``) and ``skip``."""
    left_out = {"out_dir", "worker", "verbose", *skip}
    return {k: v for k, v in vars(args).items() if k not in left_out}


def write_results(out_dir: Path, name: str, text: str, data: Optional[Dict[str, Any]] = None,
                  echo: bool = True) -> Path:
    """Writes ``<out_dir>/<name>.md`` (and ``<name>.json`` from ``data``).

    Args:
        out_dir: the results folder (made if missing).
        name: the files' stem.
        text: the Markdown report.
        data: the raw results, or None for no JSON.
        echo: also print the report.

    Returns:
        The Markdown file's path.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(text)
    if data is not None:
        (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1))
    if echo:
        print(text)
    return path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110, rect: Optional[Sequence[float]] = None) -> Path:
    """Lays out, saves and closes a Matplotlib figure.

    Args:
        fig: the figure.
        path: where the image goes.
        dpi: its resolution.
        rect: ``tight_layout``'s rectangle (room for a legend or title outside the axes).

    Returns:
        ``path``.
    """
    fig.tight_layout(**({} if rect is None else {"rect": tuple(rect)}))
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- command line
def make_parser(doc: str, worker: Union[bool, Sequence[str]] = False,
                results: bool = True) -> argparse.ArgumentParser:
    """The parser every script starts from: its docstring as help, ``--out-dir``
    (default benchmarks/results), ``-v/--verbose`` and the internal ``--worker``.

    Args:
        doc: the script's docstring.
        worker: False: no ``--worker``; True: ``--worker`` is a flag; a sequence: the
            values ``--worker`` takes.
        results: add ``--out-dir`` (False for a script that prints its report).
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if worker is True:
        p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    elif worker:
        p.add_argument("--worker", choices=list(worker), help=argparse.SUPPRESS)
    if results:
        p.add_argument("--out-dir", default=str(RESULTS), help="where the results go (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def apply_smoke(args: argparse.Namespace, smoke: Mapping[str, Any]) -> None:
    """``--smoke``: the small sizes ``smoke`` names replace the arguments (the tests' quick run)."""
    if args.smoke:
        for key, value in smoke.items():
            setattr(args, key, value)


def check_step_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (``p.error``) a ``--batch`` that ``--microbatches`` does not divide and a run
    without a warm-up step (the first step checks that both sides do the same work)."""
    if args.batch % args.microbatches:
        p.error("--batch must be divisible by --microbatches")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first step checks the same work)")


def setup_logging(verbose: bool = False) -> None:
    """Timestamped log lines on stderr, DEBUG with ``verbose``."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(parse_args: Callable[[Optional[List[str]]], argparse.Namespace],
         run_worker: Callable[[argparse.Namespace], int],
         run_driver: Callable[[argparse.Namespace], int]) -> Callable[[Optional[List[str]]], int]:
    """A script's ``main(argv=None)``: parses ``argv``, sets up logging and runs the
    worker (``--worker``, under torchrun) or the driver.

    Args:
        parse_args: the script's parser of ``argv``.
        run_worker: one rank's side; returns its exit status.
        run_driver: the side that launches the workers and reports; returns its exit status.

    Returns:
        The ``main`` function; it returns the exit status of the side it ran.
    """
    def script_main(argv: Optional[List[str]] = None) -> int:
        args = parse_args(argv)
        setup_logging(args.verbose)
        return run_worker(args) if args.worker else run_driver(args)

    return script_main


def command_sentence(command: str, total_s: float, launches: Dict[int, float]) -> str:
    """``Command: `...` (total 80 s; torchrun launches: 2 ranks 30 s, 4 ranks 45 s).``

    Args:
        command: the command line.
        total_s: the whole run's seconds.
        launches: seconds of the launch of each world size.
    """
    return (f"Command: `{command}` (total {total_s:.0f} s; torchrun launches: "
            + ", ".join(f"{n} ranks {s:.0f} s" for n, s in launches.items()) + ").")


def start_report(log: logging.Logger) -> Tuple[Dict[str, str], str]:
    """What a report starts with: the machine (logged too) and the command line.

    Returns:
        ``(machine_info(), command_line())``.
    """
    info = machine_info()
    log.info("%s", machine_line(info))
    return info, command_line()


# ----------------------------------------------------------------------------- models
def mlp(sizes: Sequence[int], seed: int = 0):
    """``nn.Sequential`` of Linear(sizes[i], sizes[i + 1]) with a ReLU after every one
    but the last, initialised from ``torch.manual_seed(seed)``.

    Args:
        sizes: layer widths, input first (at least two).
        seed: the initialisation seed.

    Raises:
        ValueError: fewer than two sizes.
    """
    import torch
    from torch import nn

    if len(sizes) < 2:
        raise ValueError(f"an MLP needs an input and an output size, got {list(sizes)}")
    torch.manual_seed(seed)
    mods: List[Any] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        mods.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _examples_on_path() -> None:
    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)


def digits():
    """examples/train_digits.py (its ``make_model`` and ``load_digits``, unchanged)."""
    _examples_on_path()
    import train_digits

    return train_digits


def models():
    """examples/models.py: the ResNet, U-Net and GPT models examples and tests share."""
    _examples_on_path()
    import models as shared_models

    return shared_models


# ----------------------------------------------------------------------------- collectives
def all_gather_json(payload: Any) -> List[Any]:
    """Every rank of the default group contributes a JSON-serialisable object; every rank
    gets them all, in rank order (through JSON, as written to the result files)."""
    import torch.distributed as dist

    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, json.loads(json.dumps(payload)))
    return gathered


def measure_bandwidth(group: Any, a: int, b: int, size: int = 4 << 20, rounds: int = 3) -> float:
    """Bytes/s between ranks ``a`` and ``b`` of ``group``: the ping-pong ``balance="auto"``
    runs (``pipedream_ext.diagnostics.measure_bandwidth``), ``size`` bytes ``rounds`` times
    each way. Every rank of ``group`` must call it.

    Returns:
        The measured bandwidth, the same on every rank (the pair's slower clock).
    """
    from pipedream_ext import diagnostics

    return diagnostics.measure_bandwidth(group, a, b, size=size, rounds=rounds)
