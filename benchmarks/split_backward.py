"""The split backward: time(I) + time(W) against time(B), and zb-h1 against 1f1b,
on 2 ranks, side by side in one run.

A pipeline of residual MLP blocks (the model of shape_change.py) is built twice on
the same ranks, once with ``1f1b`` (B: the whole backward of a microbatch) and once
with ``zb-h1`` (I: input gradients, W: weight gradients from the gradients I
captured, csrc/runtime/split_backward.h). Rounds alternate the two (A B A B ...);
each round runs ``--steps`` steps, timing each step (the slower rank's, a barrier
before it) and reading the executor's own per-kind seconds
(``stats()["seconds_by_kind"]``). Reported per rank: seconds per microbatch of B,
I and W and the ratio (I + W) / B; and the step time of both schedules with their
ratio, pair by pair.

Command (about 15-40 s on 2 cores; ``--smoke``: a tiny model, one round):

    python benchmarks/split_backward.py [--smoke]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["main", "parse_args", "report", "run_driver", "run_worker"]

JSON_TAG = "SPLIT_BACKWARD_JSON "
SCHEDULES = ("1f1b", "zb-h1")
_log = logging.getLogger("split_backward")
SMOKE = {"rounds": 1, "steps": 1, "hidden": 32, "blocks": 2, "single_repeats": 3}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="steps per schedule per round")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4, help="residual blocks (split evenly)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--single-repeats", type=int, default=300, help="one-process B / I + W repeats")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, one round of one step: checks that everything runs")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return args


def _model(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(args.hidden, 4 * args.hidden)
            self.down = nn.Linear(4 * args.hidden, args.hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, args.hidden), *[Block() for _ in range(args.blocks)],
                         nn.Linear(args.hidden, 10))


# ----------------------------------------------------------------------------- one process
def single_process(args: argparse.Namespace, repeats: int = 200) -> Dict[str, Dict[str, float]]:
    """The same stage's backward as B (one autograd.backward) and as I then W
    (pipedream_ext.testing.SplitBackward), alternating, in this process: median ms of each, for a
    middle stage (its input needs a gradient) and a first stage (it does not)."""
    import torch

    import pipedream_ext.testing as pdt

    torch.set_num_threads(1)
    stage = _model(args)[1:1 + max(1, args.blocks // 2)]
    weights = list(stage.parameters())
    out: Dict[str, Dict[str, float]] = {}
    for case, input_grad in (("middle stage", True), ("first stage", False)):
        x = torch.randn(args.batch // args.microbatches, args.hidden).requires_grad_(input_grad)
        times: Dict[str, List[float]] = {"B": [], "I": [], "W": []}
        for _ in range(repeats):
            y = stage(x)
            grad = torch.randn_like(y)
            start = time.perf_counter()
            torch.autograd.backward([y], [grad])
            times["B"].append(time.perf_counter() - start)
            stage.zero_grad(set_to_none=True)
            x.grad = None
            y = stage(x)
            state = pdt.SplitBackward()
            start = time.perf_counter()
            state.input_pass([y], [grad], [x], weights)
            middle = time.perf_counter()
            state.weight_pass()
            times["I"].append(middle - start)
            times["W"].append(time.perf_counter() - middle)
            stage.zero_grad(set_to_none=True)
        out[case] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return out


# ----------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> int:
    """Both ranks: alternate rounds of 1f1b and zb-h1; gather per-kind seconds."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        import pipedream_ext as pd

        pipes = {s: pd.PipeDream(_model(args), F.cross_entropy, schedule=s,
                                 microbatches=args.microbatches, timeout=120) for s in SCHEDULES}
        opts = {s: torch.optim.SGD(p.parameters(), lr=1e-3) for s, p in pipes.items()}
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(args.batch, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
        step_ms: Dict[str, List[float]] = {s: [] for s in SCHEDULES}
        kinds: Dict[str, Dict[str, float]] = {s: {} for s in SCHEDULES}
        for s in SCHEDULES:  # warm-up
            pipes[s].step(x, y)
            opts[s].step(); opts[s].zero_grad()
        for _ in range(args.rounds):
            for s in SCHEDULES:
                pipe, before = pipes[s], pipes[s].stats()["seconds_by_kind"]
                times = []
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    pipe.step(x, y)
                    elapsed = torch.tensor([time.perf_counter() - start])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times.append(elapsed.item())
                    opts[s].step(); opts[s].zero_grad()
                step_ms[s].append(1e3 * statistics.median(times))
                after = pipe.stats()["seconds_by_kind"]
                for kind in ("F", "B", "I", "W"):
                    kinds[s][kind] = kinds[s].get(kind, 0.0) + after.get(kind, 0.0) - before.get(kind, 0.0)
        microbatches = args.rounds * args.steps * args.microbatches
        mine = {s: {k: 1e3 * v / microbatches for k, v in kinds[s].items()} for s in SCHEDULES}
        everyone = h.all_gather_json(mine)
        result.update(step_ms=step_ms, ms_per_microbatch=everyone)

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> str:
    """The Markdown report of one run."""
    lines = ["# Split backward: I + W against B, zb-h1 against 1f1b", "",
             f"2 ranks (Gloo, CPU), Linear(32, {args.hidden}) + {args.blocks} residual MLP blocks "
             f"(H={args.hidden}, 4H inner) + head, batch {args.batch} in {args.microbatches} "
             f"microbatches, {args.rounds} alternating rounds of {args.steps} steps per schedule. "
             "Per-kind times are the executor's own (`stats()['seconds_by_kind']`), per microbatch.", ""]
    rows = []
    for rank, per in enumerate(result["ms_per_microbatch"]):
        b, i, w = per["1f1b"].get("B", 0.0), per["zb-h1"].get("I", 0.0), per["zb-h1"].get("W", 0.0)
        rows.append([rank, h.fmt(per["1f1b"].get("F"), 3), h.fmt(b, 3), h.fmt(per["zb-h1"].get("F"), 3),
                     h.fmt(i, 3), h.fmt(w, 3), h.fmt((i + w) / b if b else None, 3)])
    lines += h.table(["rank", "1f1b F (ms)", "1f1b B (ms)", "zb-h1 F (ms)", "zb-h1 I (ms)",
                      "zb-h1 W (ms)", "(I + W) / B"], rows)
    pairs = [z / o for o, z in zip(result["step_ms"]["1f1b"], result["step_ms"]["zb-h1"])]
    lines += ["", "Step time per round (median of its steps, the slower rank's):", ""]
    lines += h.table(["round", "1f1b (ms)", "zb-h1 (ms)", "zb-h1 / 1f1b"],
                     [[k, h.fmt(o), h.fmt(z), h.fmt(z / o, 3)] for k, (o, z) in
                      enumerate(zip(result["step_ms"]["1f1b"], result["step_ms"]["zb-h1"]))])
    lines += ["", f"Median ratio zb-h1 / 1f1b over the rounds: {statistics.median(pairs):.3f}.", "",
              f"One process, one stage of {max(1, args.blocks // 2)} blocks on a microbatch of "
              f"{args.batch // args.microbatches} rows, B and I + W alternating, medians of "
              f"{result['single_repeats']} each:", ""]
    lines += h.table(["stage", "B (ms)", "I (ms)", "W (ms)", "(I + W) / B"],
                     [[case, h.fmt(t["B"], 3), h.fmt(t["I"], 3), h.fmt(t["W"], 3),
                       h.fmt((t["I"] + t["W"]) / t["B"], 3)] for case, t in result["single"].items()])
    lines += ["",
              h.machine_line(info) + " Load average at the end: "
              + " ".join(f"{v:.2f}" for v in result.get("loadavg_end", [])) + ".", "",
              h.command_sentence(command, total_s, {2: result["launch_s"]}), ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(_log)
    start = time.perf_counter()
    worker_args = ["--worker"] + h.forward(args, "rounds", "steps", "batch", "hidden", "blocks",
                                           "microbatches")
    result = h.launch_torchrun(Path(__file__).resolve(), 2, worker_args, JSON_TAG, timeout=900, check=True)
    if "error" in result:
        _log.error("%s", result["error"])
        return 1
    result["single_repeats"] = args.single_repeats
    result["single"] = single_process(args, args.single_repeats)
    result["loadavg_end"] = list(os.getloadavg())
    text = report(result, info, command, args, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), "split_backward", text,
                    {"machine": info, "command": command,
                     "args": h.run_options(args),
                     "result": result})
    return 0


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
