"""The cost of a shape change: the first step after the boundary shapes change
against a steady step, on 2 ranks, side by side in one run.

A small language-model-shaped pipeline (embedding, residual MLP blocks that keep
[B, T, H], a head; cross entropy over the flattened logits) runs steps whose
sequence length alternates A, A, B, B, A, A, ... so every other step is the first
after a change (its sends redirect: zeros of the predicted shapes fill the
pre-posted buffers, the real tensors follow on their own tags, posted by the
receiver when the header arrives) and the one after it is steady (every receive
pre-posted with the right shapes). Every step starts after a barrier; its time is
the slower rank's. A control row times the same alternation on the unsplit model
in one process (the part of the cost that is compute on new shapes). Reported per schedule:
the median step time of each kind over the repeats, the redirected sends per step and the
bytes sent per step.

Command (about 20 s on 2 cores):

    python benchmarks/shape_change.py
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["main", "parse_args", "report", "run_driver", "run_worker"]

JSON_TAG = "SHAPE_CHANGE_JSON "
SCHEDULES = ("1f1b", "gpipe")
_log = logging.getLogger("shape_change")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--repeats", type=int, default=100, help="shape changes per schedule (default: %(default)s)")
    p.add_argument("--lengths", default="64,48", help="the two sequence lengths A,B (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> int:
    """Both ranks: per schedule, alternate the sequence length every two steps and
    time each step; rank 0 reports medians of steady steps and of first steps."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn

        import pipedream_ext as pd

        vocab, hidden = 64, args.hidden
        lengths = [int(v) for v in args.lengths.split(",")]

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + self.down(torch.relu(self.up(x)))

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

        result["schedules"] = {}
        for schedule in SCHEDULES:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(vocab, hidden), Block(), Block(), Block(),
                                  nn.Linear(hidden, vocab))
            pipe = pd.PipeDream(model, loss_fn, schedule=schedule, microbatches=args.microbatches,
                                timeout=120)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
            g = torch.Generator().manual_seed(0)
            batches = {t: torch.randint(0, vocab, (args.batch, t + 1), generator=g) for t in lengths}
            times: Dict[str, List[float]] = {"steady": [], "first": []}
            redirected: Dict[str, List[int]] = {"steady": [], "first": []}
            sent: Dict[str, List[int]] = {"steady": [], "first": []}
            previous = None
            # Two warm-up steps (the first step of a pipeline learns every slot), then
            # pairs: a first step after a change and a steady step of the same shapes.
            plan = [lengths[0], lengths[0]] + [lengths[(k // 2 + 1) % 2] for k in range(2 * args.repeats)]
            for index, length in enumerate(plan):
                tokens = batches[length]
                before = pipe.stats()
                dist.barrier()
                start = time.perf_counter()
                pipe.step(tokens[:, :-1], tokens[:, 1:])
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                opt.step(); opt.zero_grad()
                after = pipe.stats()
                if index >= 2:
                    kind = "first" if length != previous else "steady"
                    times[kind].append(elapsed.item())
                    redirected[kind].append(after["redirected_sends"] - before["redirected_sends"])
                    sent[kind].append(after["bytes_sent"] - before["bytes_sent"])
                previous = length
            # Each first step is followed by its steady step: their difference, pair by
            # pair, is less exposed to the machine's load drifting than two medians.
            pairs = [f - s for f, s in zip(times["first"], times["steady"])]
            result["schedules"][schedule] = {"extra_ms_median_over_pairs": 1e3 * statistics.median(pairs)}
            result["schedules"][schedule].update({
                kind: {"median_ms": 1e3 * statistics.median(times[kind]),
                       "steps": len(times[kind]),
                       "redirected_sends_per_step": statistics.mean(redirected[kind]),
                       "bytes_sent_per_step_rank0": statistics.mean(sent[kind])}
                for kind in times})
            del pipe, opt
        # Control: the unsplit model on rank 0 alone, the same alternation, so the
        # part of a first step's cost that is compute (new shapes for the kernels and
        # the allocator), not communication, shows beside the pipelines.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(vocab, hidden), Block(), Block(), Block(), nn.Linear(hidden, vocab))
        g = torch.Generator().manual_seed(0)
        batches = {t: torch.randint(0, vocab, (args.batch, t + 1), generator=g) for t in lengths}
        control: Dict[str, List[float]] = {"steady": [], "first": []}
        previous = None
        plan = [lengths[0], lengths[0]] + [lengths[(k // 2 + 1) % 2] for k in range(2 * args.repeats)]
        if dist.get_rank() == 0:
            for index, length in enumerate(plan):
                tokens = batches[length]
                start = time.perf_counter()
                loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                elapsed = time.perf_counter() - start
                model.zero_grad()
                if index >= 2:
                    control["first" if length != previous else "steady"].append(elapsed)
                previous = length
            result["unsplit"] = {kind: {"median_ms": 1e3 * statistics.median(values), "steps": len(values)}
                                 for kind, values in control.items()}
            pairs = [f - s for f, s in zip(control["first"], control["steady"])]
            result["unsplit"]["extra_ms_median_over_pairs"] = 1e3 * statistics.median(pairs)
        dist.barrier()

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> str:
    """The Markdown report of one run."""
    a, b = args.lengths.split(",")
    lines = ["# Cost of a shape change", "",
             f"2 ranks (Gloo, CPU), an embedding + 3 residual MLP blocks (H={args.hidden}) + head, "
             f"batch {args.batch} in {args.microbatches} microbatches; the sequence length alternates "
             f"{a}, {a}, {b}, {b}, ... so each change is followed by a steady step of the same shapes. "
             f"Medians over {args.repeats} steps of each kind (the slower rank's time, a barrier before "
             "each step), measured side by side in one run; the extra time of a change is the median, "
             "over the pairs, of the first step's time minus that of the steady step after it.", ""]
    rows = []
    for schedule, kinds in result["schedules"].items():
        steady, first = kinds["steady"], kinds["first"]
        rows.append([schedule, h.fmt(steady["median_ms"]), h.fmt(first["median_ms"]),
                     h.fmt(kinds["extra_ms_median_over_pairs"]),
                     h.fmt(steady["redirected_sends_per_step"], 1), h.fmt(first["redirected_sends_per_step"], 1),
                     f"{steady['bytes_sent_per_step_rank0'] / 1e6:.2f}",
                     f"{first['bytes_sent_per_step_rank0'] / 1e6:.2f}"])
    control = result["unsplit"]
    rows.append(["unsplit model, 1 process (control)", h.fmt(control["steady"]["median_ms"]),
                 h.fmt(control["first"]["median_ms"]),
                 h.fmt(control["extra_ms_median_over_pairs"]), "", "", "", ""])
    lines += h.table(["schedule", "steady step (ms)", "first step after a change (ms)",
                      "extra ms (median over pairs)",
                      "redirected sends / steady step", "redirected sends / first step",
                      "MB sent by rank 0 / steady step", "MB sent by rank 0 / first step"], rows)
    lines += ["", "Bytes of a first step include the zeros that fill the buffers pre-posted with the "
              "old shapes (the length alternates, so the mean over both lengths is shown).", "",
              h.machine_line(info), "", h.command_sentence(command, total_s, {2: result["launch_s"]}), ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(_log)
    start = time.perf_counter()
    worker_args = ["--worker"] + h.forward(args, "repeats", "lengths", "batch", "hidden", "microbatches")
    result = h.launch_torchrun(Path(__file__).resolve(), 2, worker_args, JSON_TAG, timeout=900, check=True)
    if "error" in result:
        _log.error("%s", result["error"])
        return 1
    text = report(result, info, command, args, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), "shape_change", text,
                    {"machine": info, "command": command,
                     "args": h.run_options(args),
                     "result": result})
    return 0


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
