"""The split backward: time(I) + time(W) against time(B), and zb-h1 against 1f1b,
on 2 ranks, side by side in one run, on two models.

* ``mlp``: a pipeline of residual MLP blocks (the model of shape_change.py).
* ``gpt``: the GPT of examples/models.py (``gpt_sequential``: embedding, pre-norm
  blocks with causal attention, GELU MLPs, LayerNorm, a head tied to the embedding),
  cut as examples/train_gpt.py cuts it (the embedding with the first half of the
  blocks, the rest with LayerNorm and head), cross-entropy on the last stage.

Each model is built twice on the same ranks, once with ``1f1b`` (B: the whole
backward of a microbatch) and once with ``zb-h1`` (I: input gradients, W: weight
gradients from the gradients I captured, csrc/runtime/split_backward.h). Rounds
alternate the two (A B A B ...); each round runs ``--steps`` steps, timing each step
(the slower rank's, a barrier before it) and reading the executor's own per-kind
seconds (``stats()["seconds_by_kind"]``). Reported per rank: seconds per microbatch
of B, I and W and the ratio (I + W) / B; and the step time of both schedules with
their ratio, pair by pair.

Then, in one process, each model's stages (MLP: a middle and a first stage; GPT: the
first, a middle one of blocks only, and the last with the loss) run their backward
as B (one ``torch.autograd.backward``), as ours (``pipedream_ext.testing.SplitBackward``:
I then W) and as torch.distributed.pipelining's (``stage_backward_input`` then
``stage_backward_weight``; on a first stage, whose inputs need no gradient, torch's
``PipelineStage`` skips I and runs the whole backward as W, and so does this),
alternating, each on a fresh forward; the medians of the thread's CPU time of each.

Command (about 1-2 minutes on 2 cores; ``--smoke``: tiny models, one round):

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
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["MODELS", "gpt_stages", "main", "mlp_stages", "parse_args", "report", "run_driver", "run_worker",
           "single_process"]

JSON_TAG = "SPLIT_BACKWARD_JSON "
SCHEDULES = ("1f1b", "zb-h1")
MODELS = ("mlp", "gpt")
SPLITS = ("B", "ours", "torch")  # the one-process backward variants, in turn
_log = logging.getLogger("split_backward")
SMOKE = {"rounds": 1, "steps": 1, "hidden": 32, "blocks": 2, "single_repeats": 3, "gpt_single_repeats": 3,
         "order_steps": 1,
         "gpt_blocks": 2,
         "gpt_width": 32, "gpt_heads": 2, "gpt_context": 8}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="steps per schedule per round")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--blocks", type=int, default=4, help="MLP residual blocks (split evenly)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--gpt-blocks", type=int, default=8, help="GPT transformer blocks")
    p.add_argument("--gpt-width", type=int, default=256)
    p.add_argument("--gpt-heads", type=int, default=8)
    p.add_argument("--gpt-context", type=int, default=64, help="GPT tokens per row")
    p.add_argument("--gpt-batch", type=int, default=16, help="GPT rows per step")
    p.add_argument("--single-repeats", type=int, default=300, help="one-process B / I + W repeats (MLP)")
    p.add_argument("--gpt-single-repeats", type=int, default=60, help="the same for the GPT's stages")
    p.add_argument("--order-steps", type=int, default=10,
                   help="steps per schedule of the GPT's last stage in schedule order, one process")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of %(default)s")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models, one round of one step: checks that everything runs")
    args = p.parse_args(argv)
    h.apply_smoke(args, SMOKE)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    return args


def _mlp(args: argparse.Namespace) -> Any:
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


def _gpt(args: argparse.Namespace) -> Any:
    import torch

    torch.manual_seed(0)
    return h.models().gpt_sequential(args.gpt_blocks, args.gpt_width, args.gpt_heads, args.gpt_context)


def _gpt_balance(args: argparse.Namespace) -> List[int]:
    """examples/train_gpt.py's cut in 2: embedding + half the blocks, the rest + LayerNorm, head, flatten."""
    half = (args.gpt_blocks + 1) // 2
    return [1 + half, args.gpt_blocks - half + 3]


def _lm_loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits, targets.reshape(-1))


def _batch(args: argparse.Namespace, model: str) -> Tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    if model == "mlp":
        return torch.randn(args.batch, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    shape = (args.gpt_batch, args.gpt_context)
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)


def _pipe(args: argparse.Namespace, model: str, schedule: str) -> Any:
    import torch.nn.functional as F

    import pipedream_ext as pd

    if model == "mlp":
        return pd.PipeDream(_mlp(args), F.cross_entropy, schedule=schedule, microbatches=args.microbatches,
                            timeout=120)
    return pd.PipeDream(_gpt(args), _lm_loss, schedule=schedule, microbatches=args.microbatches,
                        balance=_gpt_balance(args), timeout=120)


# ----------------------------------------------------------------------------- one process
# A stage case: (name, stage module, input, loss or None). With a loss the stage's root
# is the loss (the last stage); else its output, with a random gradient.
Case = Tuple[str, Any, Any, Optional[Callable[[Any], Any]]]


def mlp_stages(args: argparse.Namespace) -> List[Case]:
    """A middle stage of the MLP (its input needs a gradient) and the same layers as a
    first stage (it does not)."""
    import torch

    stage = _mlp(args)[1:1 + max(1, args.blocks // 2)]
    rows = args.batch // args.microbatches
    return [("middle stage", stage, torch.randn(rows, args.hidden).requires_grad_(True), None),
            ("first stage", stage, torch.randn(rows, args.hidden), None)]


def gpt_stages(args: argparse.Namespace) -> List[Case]:
    """The GPT's first stage as the pipeline cuts it (token ids in), a middle stage of
    blocks only, and the last stage with the loss (its head untied here: the pipeline
    keeps a copy of the tied weight on each stage)."""
    import torch
    from torch import nn

    layers = list(_gpt(args))
    first, _ = _gpt_balance(args)
    blocks = args.gpt_blocks
    rows = max(1, args.gpt_batch // args.microbatches)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (rows, args.gpt_context), generator=g)
    targets = torch.randint(0, 256, (rows * args.gpt_context,), generator=g)
    hidden = torch.randn(rows, args.gpt_context, args.gpt_width, generator=g).requires_grad_(True)
    share = 1.0 / args.microbatches

    def loss(out: Any) -> Any:  # as the pipeline's last stage: the mean loss times its share
        return torch.nn.functional.cross_entropy(out, targets).float() * share

    middle = nn.Sequential(*layers[1 + blocks // 4:1 + blocks // 4 + max(1, blocks // 2)])
    return [("first stage", nn.Sequential(*layers[:first]), ids, None),
            ("middle stage", middle, hidden, None),
            ("last stage", nn.Sequential(*layers[first:]), hidden, loss)]


def _backward_once(case: Case, split: str, clock: Callable[[], float]) -> Tuple[float, float, int]:
    """One forward of the stage, then its backward as ``split``; seconds of (I, W), or
    (0, B) for the whole backward, and the minor page faults of the backward."""
    import resource

    import torch
    from torch.distributed.pipelining import _backward as torch_split

    import pipedream_ext.testing as pdt

    _, stage, x, loss = case
    weights = list(stage.parameters())
    out = stage(x)
    root = loss(out) if loss is not None else out
    grad = None if loss is not None else torch.randn_like(out)
    inputs = [x] if x.requires_grad else []
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    start = clock()
    if split == "B" or (split == "torch" and not inputs):  # torch's first stage: all in W
        torch.autograd.backward([root], None if grad is None else [grad])
        middle = start
    elif split == "ours":
        state = pdt.SplitBackward()
        state.input_pass([root], [grad], inputs, weights)
        middle = clock()
        state.weight_pass()
    else:
        _, groups = torch_split.stage_backward_input([root], None if grad is None else [grad], inputs,
                                                     iter(weights))
        middle = clock()
        torch_split.stage_backward_weight(iter(weights), groups)
    end = clock()
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
    stage.zero_grad(set_to_none=True)
    x.grad = None
    return middle - start, end - middle, faults


def saved_between_i_and_w(case: Case) -> Dict[str, float]:
    """MB of activations the stage's graph saved (parameters not counted; each storage
    once) that are still held after the forward, and after I, ours and torch's: what
    a split backward keeps from I to W, beside the gradients it captured."""
    import weakref

    import torch
    from torch.distributed.pipelining import _backward as torch_split

    import pipedream_ext.testing as pdt

    _, stage, x, loss = case
    weights = list(stage.parameters())
    params = {w.untyped_storage().data_ptr() for w in weights}

    class Box:  # what the graph keeps instead of the tensor: alive as long as it is saved
        def __init__(self, t: Any) -> None:
            self.t = t

    def held(boxes: Any) -> float:
        sizes = {b.t.untyped_storage().data_ptr(): b.t.untyped_storage().nbytes() for b in list(boxes)}
        return sum(n for ptr, n in sizes.items() if ptr not in params) / 2 ** 20

    out: Dict[str, float] = {}
    for split in ("ours", "torch"):
        boxes: Any = weakref.WeakSet()

        def pack(t: Any) -> Box:
            box = Box(t)
            boxes.add(box)
            return box

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
            y = stage(x)
        root = loss(y) if loss is not None else y
        grad = None if loss is not None else torch.randn_like(y)
        out["after F"] = held(boxes)
        if split == "ours":
            state = pdt.SplitBackward()
            state.input_pass([root], [grad], [x] if x.requires_grad else [], weights)
        else:
            state = torch_split.stage_backward_input([root], None if grad is None else [grad],
                                                     [x] if x.requires_grad else [], iter(weights))
        out[f"{split} after I"] = held(boxes)
        del state, root, y
        stage.zero_grad(set_to_none=True)
        x.grad = None
    return out


def _step_in_order(case: Case, order: List[Tuple[str, int]], microbatches: int) -> Dict[str, float]:
    """One step of a stage's compute actions in ``order`` ((kind, microbatch), kinds F,
    B, I, W), each microbatch on its own copy of the input: thread CPU seconds per
    kind, and the step's minor page faults."""
    import resource

    import torch

    import pipedream_ext.testing as pdt

    _, stage, x, loss = case
    weights = list(stage.parameters())
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for _ in range(microbatches)]
    roots: Dict[int, Tuple[Any, Any]] = {}
    states: Dict[int, Any] = {}
    spent = dict.fromkeys("FBIW", 0.0)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for kind, m in order:
        start = time.thread_time()
        if kind == "F":
            y = stage(inputs[m])
            roots[m] = (loss(y), None) if loss is not None else (y, torch.randn_like(y))
        elif kind == "B":
            root, grad = roots.pop(m)
            torch.autograd.backward([root], None if grad is None else [grad])
        elif kind == "I":
            states[m] = pdt.SplitBackward()
            states[m].input_pass([roots[m][0]], [roots[m][1]], [inputs[m]] if x.requires_grad else [], weights)
        else:
            states.pop(m).weight_pass()
            del roots[m]
        spent[kind] += time.thread_time() - start
    stage.zero_grad(set_to_none=True)
    return {**spent, "faults": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults}


def in_schedule_order(case: Case, microbatches: int, repeats: int) -> Dict[str, Any]:
    """The stage's compute actions in the order rank 1 of a 2-rank pipeline runs them
    (the last stage: 1f1b's F B F B ..., zb-h1's F I F I W F I W ...: W one
    microbatch behind, so two graphs live at once), a step of each schedule in turn,
    in this process on a thread of its own, as the executor's: medians over the
    steps of each kind's thread CPU ms per microbatch, of the step's page faults, and
    of the per-step ratio (I + W) / B."""
    import threading

    import torch

    import pipedream_ext as pd

    orders = {}
    for schedule in SCHEDULES:
        actions = pd.schedules.build(schedule, 2, microbatches).actions(1)
        orders[schedule] = [(a.kind.name, a.microbatch) for a in actions if a.is_compute]
    steps: Dict[str, List[Dict[str, float]]] = {s: [] for s in SCHEDULES}

    def run() -> None:
        torch.set_num_threads(1)
        for k in range(repeats + 1):  # one warm-up step each
            for schedule in SCHEDULES:
                spent = _step_in_order(case, orders[schedule], microbatches)
                if k:
                    steps[schedule].append(spent)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    out: Dict[str, Any] = {s: {kind: 1e3 * statistics.median(t[kind] for t in steps[s]) / microbatches
                               for kind in "FBIW"} for s in SCHEDULES}
    for s in SCHEDULES:
        out[s]["faults"] = statistics.median(t["faults"] for t in steps[s])
    out["ratio"] = statistics.median((z["I"] + z["W"]) / o["B"] for o, z in zip(steps["1f1b"], steps["zb-h1"]))
    return out


def single_process(cases: List[Case], repeats: int) -> Dict[str, Dict[str, float]]:
    """Each stage's backward as B, ours (I, W) and torch's (I, W), in turn on fresh
    forwards in this process, one thread: the medians (ms) of the thread's CPU time
    (``time.thread_time``: the other jobs on a shared machine take the wall clock's
    time, not this thread's), of the per-repeat ratios (I + W) / B, and of the minor
    page faults per backward."""
    import torch

    torch.set_num_threads(1)
    out: Dict[str, Dict[str, float]] = {}
    for case in cases:
        times: Dict[str, List[Tuple[float, float, int]]] = {s: [] for s in SPLITS}
        for k in range(repeats + 2):  # two warm-up repeats
            for split in SPLITS:
                t = _backward_once(case, split, time.thread_time)
                if k >= 2:
                    times[split].append(t)
        b = [i + w for i, w, _ in times["B"]]
        row = {"B": 1e3 * statistics.median(b), "B faults": statistics.median(f for *_, f in times["B"])}
        for split in ("ours", "torch"):
            row[f"{split} I"] = 1e3 * statistics.median(i for i, _, _ in times[split])
            row[f"{split} W"] = 1e3 * statistics.median(w for _, w, _ in times[split])
            row[f"{split} ratio"] = statistics.median((i + w) / bb for (i, w, _), bb in zip(times[split], b))
            row[f"{split} faults"] = statistics.median(f for *_, f in times[split])
        if case[2].requires_grad:  # a first stage has no I: nothing is kept for a W
            row.update({f"saved MB {k}": v for k, v in saved_between_i_and_w(case).items()})
        out[case[0]] = row
    return out


# ----------------------------------------------------------------------------- worker
def _rounds(args: argparse.Namespace, model: str) -> Dict[str, Any]:
    """Both ranks: one model's 1f1b and zb-h1 pipelines in alternating rounds; step
    times and the executor's per-kind ms per microbatch of every rank."""
    import torch
    import torch.distributed as dist

    pipes = {s: _pipe(args, model, s) for s in SCHEDULES}
    opts = {s: torch.optim.SGD(p.parameters(), lr=1e-3) for s, p in pipes.items()}
    x, y = _batch(args, model)
    step_ms: Dict[str, List[float]] = {s: [] for s in SCHEDULES}
    kinds: Dict[str, Dict[str, float]] = {s: {} for s in SCHEDULES}
    usage: Dict[str, List[float]] = {s: [0.0, 0.0] for s in SCHEDULES}  # CPU seconds, minor page faults
    for s in SCHEDULES:  # warm-up
        pipes[s].step(x, y)
        opts[s].step(); opts[s].zero_grad()
    for _ in range(args.rounds):
        for s in SCHEDULES:
            pipe, before = pipes[s], pipes[s].stats()["seconds_by_kind"]
            times, used = [], _usage()
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                pipe.step(x, y)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(elapsed.item())
                opts[s].step(); opts[s].zero_grad()
            step_ms[s].append(1e3 * statistics.median(times))
            usage[s] = [a + now - then for a, now, then in zip(usage[s], _usage(), used)]
            after = pipe.stats()["seconds_by_kind"]
            for kind in ("F", "B", "I", "W"):
                kinds[s][kind] = kinds[s].get(kind, 0.0) + after.get(kind, 0.0) - before.get(kind, 0.0)
    microbatches = args.rounds * args.steps * args.microbatches
    mine = {s: {k: 1e3 * v / microbatches for k, v in kinds[s].items()} for s in SCHEDULES}
    steps = args.rounds * args.steps
    per_step = {s: {"cpu_ms": 1e3 * usage[s][0] / steps, "minor_faults": usage[s][1] / steps} for s in SCHEDULES}
    return {"step_ms": step_ms, "ms_per_microbatch": h.all_gather_json(mine),
            "per_step": h.all_gather_json(per_step)}


def _usage() -> List[float]:
    """This process's CPU seconds (user + system) and minor page faults so far: neither
    counts the time other jobs on a shared machine take, unlike the wall clock."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return [r.ru_utime + r.ru_stime, float(r.ru_minflt)]


def run_worker(args: argparse.Namespace) -> int:
    """Both ranks: per model, alternate rounds of 1f1b and zb-h1; gather per-kind seconds."""
    def body(result: Dict[str, Any]) -> None:
        result["models"] = {model: _rounds(args, model) for model in args.models}

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def _describe(args: argparse.Namespace, model: str) -> str:
    if model == "mlp":
        return (f"Linear(32, {args.hidden}) + {args.blocks} residual MLP blocks (H={args.hidden}, 4H inner) "
                f"+ head, batch {args.batch} in {args.microbatches} microbatches")
    return (f"GPT of {args.gpt_blocks} blocks, width {args.gpt_width}, {args.gpt_heads} heads, "
            f"{args.gpt_context} tokens, tied head (examples/models.py gpt_sequential), balance "
            f"{_gpt_balance(args)}, batch {args.gpt_batch} rows in {args.microbatches} microbatches")


def _pipeline_lines(part: Dict[str, Any]) -> List[str]:
    rows = []
    for rank, per in enumerate(part["ms_per_microbatch"]):
        b, i, w = per["1f1b"].get("B", 0.0), per["zb-h1"].get("I", 0.0), per["zb-h1"].get("W", 0.0)
        rows.append([rank, h.fmt(per["1f1b"].get("F"), 3), h.fmt(b, 3), h.fmt(per["zb-h1"].get("F"), 3),
                     h.fmt(i, 3), h.fmt(w, 3), h.fmt((i + w) / b if b else None, 3)])
    lines = h.table(["rank", "1f1b F (ms)", "1f1b B (ms)", "zb-h1 F (ms)", "zb-h1 I (ms)",
                     "zb-h1 W (ms)", "(I + W) / B"], rows)
    lines += ["", "Per step, each rank's process (all its threads; `getrusage`): CPU time and minor page faults "
              "(fresh pages from the OS):", ""]
    lines += h.table(["rank", "1f1b CPU (ms)", "zb-h1 CPU (ms)", "zb-h1 / 1f1b CPU", "1f1b page faults",
                      "zb-h1 page faults"],
                     [[rank, h.fmt(u["1f1b"]["cpu_ms"], 1), h.fmt(u["zb-h1"]["cpu_ms"], 1),
                       h.fmt(u["zb-h1"]["cpu_ms"] / u["1f1b"]["cpu_ms"] if u["1f1b"]["cpu_ms"] else None, 3),
                       h.fmt(u["1f1b"]["minor_faults"], 0), h.fmt(u["zb-h1"]["minor_faults"], 0)]
                      for rank, u in enumerate(part["per_step"])])
    one, zb = part["step_ms"]["1f1b"], part["step_ms"]["zb-h1"]
    lines += ["", "Step time per round (median of its steps, the slower rank's):", ""]
    lines += h.table(["round", "1f1b (ms)", "zb-h1 (ms)", "zb-h1 / 1f1b"],
                     [[k, h.fmt(o), h.fmt(z), h.fmt(z / o, 3)] for k, (o, z) in enumerate(zip(one, zb))])
    pairs = [z / o for o, z in zip(one, zb)]
    return lines + ["", f"Median ratio zb-h1 / 1f1b over the rounds: {statistics.median(pairs):.3f}."]


def _single_lines(single: Dict[str, Dict[str, float]], repeats: int) -> List[str]:
    lines = [f"One process, one thread, each stage's backward as B, ours (I then W) and torch's "
             f"(`stage_backward_input` then `stage_backward_weight`) in turn on fresh forwards, "
             f"medians of {repeats} each (thread CPU time; the ratio is the median of the per-repeat ratios):", ""]
    rows = [[case, h.fmt(t["B"], 3), h.fmt(t["ours I"], 3), h.fmt(t["ours W"], 3), h.fmt(t["ours ratio"], 3),
             h.fmt(t["torch I"], 3), h.fmt(t["torch W"], 3), h.fmt(t["torch ratio"], 3),
             " / ".join(h.fmt(t[f"{k} faults"], 0) for k in ("B", "ours", "torch"))]
            for case, t in single.items()]
    lines += h.table(["stage", "B (ms)", "ours I (ms)", "ours W (ms)", "ours (I + W) / B",
                      "torch I (ms)", "torch W (ms)", "torch (I + W) / B",
                      "page faults B / ours / torch"], rows)
    kept = [[case, h.fmt(t["saved MB after F"], 2), h.fmt(t["saved MB ours after I"], 2),
             h.fmt(t["saved MB torch after I"], 2)] for case, t in single.items() if "saved MB after F" in t]
    return lines + ["", "Activations the graph saved (MB, parameters not counted) still held after the "
                    "forward and after I, that is, kept until W (besides the captured gradients):", ""] + \
        h.table(["stage", "after F", "after ours I", "after torch's I"], kept)


def _order_lines(order: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    lines = [f"One process, the last stage's compute actions in the order rank 1 of 2 runs them "
             f"({args.microbatches} microbatches; zb-h1's W one microbatch behind its I), on a thread of "
             f"its own, a step of each schedule in turn, medians of {args.order_steps} steps (thread CPU "
             "ms per microbatch; page faults per step):", ""]
    lines += h.table(["schedule", "F (ms)", "B (ms)", "I (ms)", "W (ms)", "page faults"],
                     [[s, h.fmt(order[s]["F"], 3), h.fmt(order[s]["B"], 3), h.fmt(order[s]["I"], 3),
                       h.fmt(order[s]["W"], 3), h.fmt(order[s]["faults"], 0)] for s in SCHEDULES])
    return lines + ["", f"Median per-step (I + W) / B in schedule order: {order['ratio']:.3f}."]


def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> str:
    """The Markdown report of one run."""
    lines = ["# Split backward: I + W against B, zb-h1 against 1f1b", "",
             f"2 ranks (Gloo, CPU), {args.rounds} alternating rounds of {args.steps} steps per schedule. "
             "Per-kind times are the executor's own (`stats()['seconds_by_kind']`), per microbatch.", ""]
    for model in args.models:
        part = result["models"][model]
        lines += [f"## {model}: {_describe(args, model)}", ""] + _pipeline_lines(part) + [""]
        lines += _single_lines(part["single"], part["single_repeats"]) + [""]
        if "order" in part:
            lines += _order_lines(part["order"], args) + [""]
    lines += [h.machine_line(info) + " Load average at the end: "
              + " ".join(f"{v:.2f}" for v in result.get("loadavg_end", [])) + ".", "",
              h.command_sentence(command, total_s, {2: result["launch_s"]}), ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    info, command = h.start_report(_log)
    start = time.perf_counter()
    worker_args = ["--worker"] + h.forward(args, "rounds", "steps", "batch", "hidden", "blocks", "microbatches",
                                           "gpt_blocks", "gpt_width", "gpt_heads", "gpt_context", "gpt_batch",
                                           "models")
    result = h.launch_torchrun(Path(__file__).resolve(), 2, worker_args, JSON_TAG, timeout=900, check=True)
    if "error" in result:
        _log.error("%s", result["error"])
        return 1
    for model in args.models:
        cases, repeats = (mlp_stages(args), args.single_repeats) if model == "mlp" else \
            (gpt_stages(args), args.gpt_single_repeats)
        result["models"][model]["single"] = single_process(cases, repeats)
        result["models"][model]["single_repeats"] = repeats
        if model == "gpt":
            result["models"][model]["order"] = in_schedule_order(cases[-1], args.microbatches, args.order_steps)
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
