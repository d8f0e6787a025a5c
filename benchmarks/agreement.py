"""What the agreement checks cost (measured with ``pipedream_ext.diagnostics``; docs/runtime.md).

One ``torch.distributed.run`` launch of 2 CPU ranks (Gloo on localhost) measures,
as medians over ``--reps`` repetitions:

* **construction**: fingerprinting the stages (``fingerprint_layers`` of an MLP of
  ``--layers`` x ``Linear(--width, --width)``; ``fingerprint_split`` of a small
  GPT-2 exported and cut in 2, the export path), and the exchange that compares
  them (``check_stages_agree``: one all-gather), beside building the pipeline
  (``PipeDream(...)``, which includes them);
* **the first steps**: one ``check_batches_agree`` (fingerprints of the batch on both
  ranks, one all-gather: what ``step()`` runs for its first ``check_agreement`` calls)
  for image batches of ``--batches`` rows of 3x32x32 floats, beside a training step of
  the MLP pipeline (1f1b, 4 microbatches) on a batch of ``--rows`` rows, and the same
  step with ``check_agreement=0``;
* **evaluation**: the two small all-reduces of every ``forward_only`` call: the one it
  opens with (stage 0's batch size, so the last stage can check its outputs against
  each microbatch's rows, and a failure flag; bounded by the timeout) and the flag
  all-reduce it ends with, beside ``forward_only`` of the MLP pipeline.

Every step after the first ``check_agreement`` (default 3) costs nothing: the check
is one ``if``. Command (about half a minute on 2 cores):

    python benchmarks/agreement.py
"""
from __future__ import annotations

import argparse
import datetime
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["main", "parse_args", "report", "run_driver", "run_worker"]

LOG = logging.getLogger("agreement")
JSON_TAG = "AGREEMENT_JSON "


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _construction(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    """Fingerprints and the exchange comparing them: an MLP and a small GPT-2 (export path)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipedream_ext as pd
    import pipedream_ext.diagnostics as pdd

    mlp = h.mlp([args.width] * (args.layers + 1))
    balance = [len(mlp) // 2, len(mlp) - len(mlp) // 2]
    fp = pdd.fingerprint_layers(mlp, balance)
    config = {"schedule": "1f1b", "microbatches": 4}
    result["mlp_fingerprint_ms"] = _median_ms(lambda: pdd.fingerprint_layers(mlp, balance), args.reps)
    dist.barrier()
    result["construction_exchange_ms"] = _median_ms(lambda: pdd.check_stages_agree(fp, config), args.reps)
    t0 = time.perf_counter()
    pd.PipeDream(h.mlp([args.width] * (args.layers + 1)), F.cross_entropy,
                 schedule="1f1b", microbatches=4, timeout=120)
    result["mlp_pipeline_ms"] = 1e3 * (time.perf_counter() - t0)

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=128,
                                      n_positions=64, use_cache=False))
    ids = torch.randint(0, 128, (8, 16))
    timing = pdd.time_split(gpt2, ["transformer.h.2"], {"input_ids": ids}, {"use_cache": False})
    result["gpt2_split_ms"] = 1e3 * timing.total_s
    result["gpt2_nodes"] = timing.graph_nodes
    result["gpt2_fingerprint_ms"] = _median_ms(lambda: pdd.fingerprint_split(timing.split), args.reps)
    dist.barrier()
    result["gpt2_exchange_ms"] = _median_ms(
        lambda: pdd.check_stages_agree(timing.split.fingerprint, config), args.reps)


def _first_steps(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    """The batch check alone per batch size, a training step with and without it, and
    forward_only's closing flag all-reduce."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipedream_ext as pd
    import pipedream_ext.diagnostics as pdd

    checks = {}
    for rows in args.batches:
        x = torch.randn(rows, 3, 32, 32)
        y = torch.randint(0, 10, (rows,))
        dist.barrier()
        checks[str(rows)] = _median_ms(lambda: pdd.check_batches_agree(x, y), args.reps)
    result["check_ms"] = checks
    # A training step with and without the check, alternating (same load for both).
    x = torch.randn(args.rows, args.width)
    y = torch.randint(0, args.width, (args.rows,))
    runs = {}
    for label, window in (("checked", 10 ** 9), ("unchecked", 0)):
        pipe = pd.PipeDream(h.mlp([args.width] * (args.layers + 1)), F.cross_entropy,
                            schedule="1f1b", microbatches=4, timeout=120, check_agreement=window)
        runs[label] = (pipe, torch.optim.SGD(pipe.parameters(), lr=0.01))
    times: Dict[str, List[float]] = {label: [] for label in runs}
    for rep in range(args.reps + 3):
        for label, (pipe, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, y)
            opt.step()
            opt.zero_grad()
            if rep >= 3:
                times[label].append(time.perf_counter() - t0)
    steps = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    dist.barrier()
    steps["check alone"] = _median_ms(lambda: pdd.check_batches_agree(x, y), args.reps)
    result["step_ms"] = steps
    dist.barrier()
    # What forward_only opens with: two float64 in one all-reduce, waited for with a bound.
    result["open_allreduce_ms"] = _median_ms(
        lambda: dist.all_reduce(torch.zeros(2, dtype=torch.float64), op=dist.ReduceOp.MAX,
                                async_op=True).wait(timeout=datetime.timedelta(seconds=120)), args.reps)
    dist.barrier()
    # What forward_only ends with: one float64 all-reduce on the (Gloo, CPU) group.
    result["flag_allreduce_ms"] = _median_ms(
        lambda: dist.all_reduce(torch.zeros(1, dtype=torch.float64)), args.reps)
    pipe = runs["unchecked"][0].eval()  # no batch check: forward_only alone
    pipe.forward_only(x)
    dist.barrier()
    result["forward_only_ms"] = _median_ms(lambda: pipe.forward_only(x), args.reps)


def run_worker(args: argparse.Namespace) -> int:
    def body(result: Dict[str, Any]) -> None:
        _construction(args, result)
        _first_steps(args, result)

    return h.worker(JSON_TAG, body, backend="gloo")


def report(result: Dict[str, Any], args: argparse.Namespace, info: Dict[str, str],
           command: str) -> str:
    step = result["step_ms"]
    lines = ["# Agreement checks: what they cost", "",
             f"{h.machine_line(info)} 2 ranks, Gloo on localhost; medians of {args.reps} "
             f"repetitions. Command: `{command}`.", "",
             "## Construction (once)", ""]
    lines += h.table(["what", "ms"], [
        [f"fingerprint of an MLP of {args.layers} x Linear({args.width}, {args.width}) "
         "(layers_fingerprint)", h.fmt(result["mlp_fingerprint_ms"])],
        [f"fingerprint of GPT-2 exported and cut in 2 ({result['gpt2_nodes']} graph nodes; "
         "graph_fingerprint)", h.fmt(result["gpt2_fingerprint_ms"])],
        ["the exchange comparing them, MLP (agree_at_construction: one all-gather)",
         h.fmt(result["construction_exchange_ms"])],
        ["the exchange, GPT-2", h.fmt(result["gpt2_exchange_ms"])],
        ["for scale: PipeDream(...) of the MLP (includes both)", h.fmt(result["mlp_pipeline_ms"])],
        ["for scale: split_model of GPT-2 (export, includes its fingerprint)",
         h.fmt(result["gpt2_split_ms"])],
    ])
    lines += ["", f"## The first {3} steps (check_agreement=3, the default)", ""]
    rows = [[f"StepAgreement.check, batch of {n} x 3x32x32 float32 "
             f"({int(n) * 3 * 32 * 32 * 4 / 2 ** 20:.1f} MiB) + targets", h.fmt(ms)]
            for n, ms in result["check_ms"].items()]
    rows += [[f"training step of the MLP (1f1b, 4 microbatches, {args.rows} rows), checked",
              h.fmt(step["checked"])],
             ["the same step, check_agreement=0", h.fmt(step["unchecked"])],
             ["difference", h.fmt(step["checked"] - step["unchecked"])],
             [f"StepAgreement.check alone, that step's batch ({args.rows} x {args.width} "
              "float32)", h.fmt(step["check alone"])],
             ["forward_only's opening all-reduce: stage 0's batch size and a failure flag "
              "(every call)", h.fmt(result["open_allreduce_ms"])],
             ["forward_only's closing flag all-reduce (every call)",
              h.fmt(result["flag_allreduce_ms"])],
             [f"for scale: forward_only of the MLP pipeline ({args.rows} rows, 4 microbatches; "
              "both included)", h.fmt(result["forward_only_ms"])]]
    lines += h.table(["what", "ms"], rows)
    lines += ["", "Steps after the first 3 run no check (one comparison of a counter).", ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(LOG)
    result = h.launch_torchrun(Path(__file__), 2, ["--worker"] + h.forward(
        args, "layers", "width", "rows", "reps", "batches"), JSON_TAG, timeout=600)
    if "error" in result:
        LOG.error("failed: %s", result["error"])
        return 1
    h.write_results(Path(args.out_dir), "agreement", report(result, args, info, command), result)
    return 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=64, help="rows of the training batch")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[64, 256],
                   help="rows of the image batches the check fingerprints")
    return p.parse_args(argv)


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
