"""What a message costs when the cores are busy: a Gloo ping-pong between 2 ranks, the
ranks computing between messages or not, on a quiet machine and beside one busy process
at nice 19, side by side in one run.

Why: the configuration planner's cost model (docs/planner.md, "How accurate it is")
prices a message with the latency the calibration measures on idle ranks. On a machine
with as many cores as ranks, a message lands only when Gloo's receiving thread
(``gloo_tcp_loop``) gets a core; this script measures how much later that is when the
ranks compute (``both``: both ranks compute before each message; ``sender``: only the
rank about to send) and when another process, however low its priority, keeps a core
busy.

Per case: microseconds per exchange (one message one way) and the extra over the
compute (``per exchange - compute``), the median over ``--rounds`` rounds of
``--messages`` exchanges each. The compute is a loop of 64 x 64 matmuls for the given
milliseconds (one thread).

Command (about 30 s on 2 cores):

    python benchmarks/message_load.py [--compute-ms 0,0.2,1,3]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["main", "parse_args", "report", "run_driver", "run_worker"]

JSON_TAG = "MESSAGE_LOAD_JSON "
MODES = ("both", "sender")
_log = logging.getLogger("message_load")
# A busy loop at the lowest priority: the "load" of the loaded launch.
_BUSY = "import time\nwhile True:\n    time.perf_counter()\n"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--compute-ms", default="0,0.2,1,3",
                   help="milliseconds of compute before each message (default: %(default)s)")
    p.add_argument("--messages", type=int, default=40, help="exchanges per round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per case (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        args.compute = [float(v) for v in args.compute_ms.split(",") if v]
    except ValueError:
        p.error(f"--compute-ms takes comma-separated milliseconds, got {args.compute_ms!r}")
    if not args.compute or min(args.compute) < 0 or args.messages < 2 or args.rounds < 1:
        p.error("--compute-ms needs values >= 0, --messages at least 2 and --rounds at least 1")
    return args


# ----------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> int:
    """Both ranks: per compute time and mode, rounds of alternating one-float messages."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        rank, peer = dist.get_rank(), 1 - dist.get_rank()
        message, a = torch.zeros(1), torch.randn(64, 64)

        def compute(ms: float) -> None:
            start = time.perf_counter()
            while time.perf_counter() - start < ms / 1e3:
                a @ a

        result["cases"] = []
        for ms in args.compute:
            for mode in MODES:
                rounds = []
                for _ in range(args.rounds):
                    dist.barrier()
                    start = time.perf_counter()
                    for i in range(args.messages):
                        sending = (i + rank) % 2 == 0
                        if mode == "both" or sending:
                            compute(ms)
                        (dist.send if sending else dist.recv)(message, peer)
                    rounds.append((time.perf_counter() - start) / args.messages)
                seconds = torch.tensor([statistics.median(rounds)])
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                result["cases"].append({"compute_ms": ms, "mode": mode, "us": 1e6 * seconds.item()})

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def report(results: Dict[str, Dict[str, Any]], info: Dict[str, str], command: str, total_s: float) -> str:
    """The Markdown report: one row per case, quiet and loaded side by side."""
    lines = ["# What a message costs when the cores are busy", "",
             "Two ranks (Gloo, CPU, one thread each) send one float back and forth; before each message "
             "both ranks (*both*) or only the sender (*sender*) compute for the given time. Microseconds per "
             "exchange and the extra over the compute, the median over rounds (the slower rank's), on the "
             "machine as it is (*quiet*) and beside one busy process at nice 19 (*loaded*).", ""]
    quiet, loaded = results["quiet"]["cases"], results["loaded"]["cases"]
    rows = []
    for q, lo in zip(quiet, loaded):
        compute_us = 1e3 * q["compute_ms"]
        rows.append([h.fmt(q["compute_ms"], 1), q["mode"], f"{q['us']:.0f}", f"{q['us'] - compute_us:.0f}",
                     f"{lo['us']:.0f}", f"{lo['us'] - compute_us:.0f}"])
    lines += h.table(["compute before a message (ms)", "who computes", "quiet: us per exchange",
                      "quiet: extra (us)", "loaded: us per exchange", "loaded: extra (us)"], rows)
    launches = {k: v.get("launch_s", 0.0) for k, v in results.items()}
    shares = ", ".join(f"{k}: others {v['others_cpu_share']:.0%} of the CPUs"
                       for k, v in results.items() if "others_cpu_share" in v)
    lines += ["", h.machine_line(info) + (f" During the launches, {shares}." if shares else ""), "",
              f"Command: `{command}` (total {total_s:.0f} s; launches: "
              + ", ".join(f"{k} {s:.0f} s" for k, s in launches.items()) + ").", ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    """Two launches: quiet, then beside a busy process at nice 19 (stopped afterwards)."""
    info, command = h.start_report(_log)
    start = time.perf_counter()
    worker_args = ["--worker"] + h.forward(args, "compute_ms", "messages", "rounds")
    script = Path(__file__).resolve()
    results = {"quiet": h.launch_torchrun(script, 2, worker_args, JSON_TAG, timeout=600)}
    busy = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", _BUSY])
    try:
        results["loaded"] = h.launch_torchrun(script, 2, worker_args, JSON_TAG, timeout=600)
    finally:
        busy.kill()
        busy.wait()
    failed = [f"{k}: {v['error']}" for k, v in results.items() if "error" in v]
    if failed:
        _log.error("%s", "; ".join(failed))
        return 1
    text = report(results, info, command, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), "message_load", text,
                    {"machine": info, "command": command, "args": h.run_options(args), "results": results})
    return 0


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
