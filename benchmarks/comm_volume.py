"""Communication volume: pipedream_ext's plans against data parallelism.

Two parts, both written to ``benchmarks/results/comm_volume.md``:

1. Measured: bytes the communication engine sends per training sample (all ranks
   together) for a VGG-16-shaped small model (convolutions, then big
   fully-connected layers) and the digits CNN, trained for a few steps with the
   plan the planner makes for 2 workers (``pipedream`` cost model at 1.25e9 B/s,
   i.e. 10 Gbit/s, with boundary transfers paid: compression ratio 1), beside data
   parallelism's ring all-reduce volume for the same model (2 (N-1) / N weight bytes
   per worker and step, an exact count for DDP's gradient bucket all-reduce).
2. Analytical: for the shipped PipeDream profiles (VGG-16, AlexNet, ResNet-50,
   GNMT) and plans for 4 and 16 workers, bytes per minibatch crossing stage
   boundaries (activations forward and gradients back, a tensor counted once per
   boundary it crosses) plus the all-reduce of replicated stages
   (2 (r-1) / r weight bytes per minibatch), against data parallelism over the
   same workers (2 (N-1) / N of all weight bytes per minibatch).

Command (about a minute on 2 cores):

    python benchmarks/comm_volume.py
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["analytical", "digits_cnn", "main", "measured", "parse_args", "report", "run_driver", "run_worker",
           "vgg_like", "weight_bytes"]

PROFILES = os.path.join(h.ROOT, "tests", "data", "profiles")  # PipeDream's profiles, shipped
JSON_TAG = "COMM_VOLUME_JSON "
_log = logging.getLogger("comm_volume")


# ----------------------------------------------------------------------------- models
def vgg_like(seed: int = 0) -> nn.Sequential:
    """Convolutions on 3x32x32, then VGG's big fully-connected head (scaled down)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )


def digits_cnn(seed: int = 0) -> nn.Sequential:
    """The CNN of examples/train_digits.py, unchanged."""
    return h.digits().make_model(seed)


MODELS = {"vgg-like": (vgg_like, (3, 32, 32)), "digits-cnn": (digits_cnn, (1, 8, 8))}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ----------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> int:
    """One rank: ``--steps`` 1f1b steps of model ``--worker`` with plan ``--plan``; rank 0
    reports the bytes all ranks sent per sample."""
    def body(result: Dict[str, Any]) -> None:
        import torch.distributed as dist
        import torch.nn.functional as F

        import pipedream_ext as pd

        factory, shape = MODELS[args.worker]
        pipe = pd.PipeDream(factory(), F.cross_entropy, schedule="1f1b", microbatches=4, balance=args.plan)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.01) if any(True for _ in pipe.parameters()) else None
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, *shape, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        for _ in range(args.steps):
            pipe.step(x, y)
            if opt is not None:
                opt.step(); opt.zero_grad()
        # The engine counts point-to-point transfers; a replicated stage also sends
        # its gradients' ring all-reduce, 2 (r - 1) / r of its weight bytes per step.
        r = pipe.replicas[pipe.stage_index]
        grad_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
        allreduce = args.steps * 2 * (r - 1) / r * grad_bytes if r > 1 else 0.0
        sent = torch.tensor([pipe.bytes_sent + allreduce], dtype=torch.float64)
        dist.all_reduce(sent)
        result["bytes_per_sample"] = sent.item() / (args.steps * args.batch)

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- measured
def measured(batch: int, steps: int) -> List[Dict]:
    """Bytes per sample of our plan's 2-rank run against DDP's, per model.

    Raises:
        harness.CommandFailed: a launch failed (its output is kept in a log file).
    """
    import torch.nn.functional as F

    import pipedream_ext as pd

    rows = []
    for name, (factory, shape) in tqdm(MODELS.items(), desc="measured"):
        model = factory()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
        graph = pd.profile(model, x, loss_fn=F.cross_entropy, target=y, steps=5, warmup=2)
        plan = pd.plan(graph, workers=[2], bandwidth=[1.25e9], cost_model="pipedream",
                       activation_compression_ratio=1.0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "plan.json")
            plan.save(path)
            ours = h.launch_torchrun(Path(__file__).resolve(), 2, ["--worker", name, "--plan", path, "--batch",
                                                                    str(batch), "--steps", str(steps)],
                                     JSON_TAG, timeout=600, check=True)
        weights = weight_bytes(model)
        dp = 2 * (2 - 1) * weights / batch  # ring all-reduce, both workers together, per sample
        rows.append({"model": name, "weights_MB": weights / 1e6, "plan": _describe(plan),
                     "ours": ours["bytes_per_sample"], "dp": dp})
    return rows


def _describe(plan) -> str:
    """``layers 0-3 x1, layers 4-9 x1``: a plan's stages."""
    layers = plan.layers or [None] * len(plan.stages)
    return ", ".join(f"layers {l[0]}-{l[1] - 1} x{r}" if l else f"x{r}"
                     for l, r in zip(layers, plan.replicas))


# ----------------------------------------------------------------------------- analytical
def analytical(profiles: Sequence[str], workers: Sequence[int]) -> List[Dict]:
    """Bytes per minibatch of the planner's plans for the shipped profiles against DP's."""
    import pipedream_ext as pd

    rows = []
    for name in tqdm(profiles, desc="analytical"):
        path = os.path.join(PROFILES, name + ".txt")
        if not os.path.exists(path):
            _log.warning("skipping %s: %s not found", name, path)
            continue
        graph = pd.load_profile(path)
        nodes = {n["id"]: n for n in graph.nodes()}
        edges = graph.edges()
        total_weights = sum(n["parameter_bytes"] for n in nodes.values())
        for n in workers:
            plan = pd.plan(graph, workers=[n], bandwidth=[1.25e9], cost_model="pipedream",
                           activation_compression_ratio=1.0)
            stage_of = {node: j for j, st in enumerate(plan.stages) for node in st.nodes}
            pipeline = 0.0
            for k in range(len(plan.stages) - 1):
                crossing = {a for a, b in edges
                            if a in stage_of and b in stage_of and stage_of[a] <= k < stage_of[b]}
                pipeline += 2 * sum(nodes[a]["activation_bytes"] for a in crossing)
            replicated = sum(2 * (st.replicas - 1) / st.replicas * st.parameter_bytes for st in plan.stages)
            dp = 2 * (n - 1) / n * total_weights
            rows.append({"profile": name, "workers": n, "plan": f"{len(plan.stages)} stages, replicas "
                         + "-".join(map(str, plan.replicas)), "ours": pipeline + replicated, "dp": dp})
    return rows


# ----------------------------------------------------------------------------- report
def report(measured_rows: List[Dict], analytical_rows: List[Dict], command: str) -> str:
    """The Markdown report of both parts."""
    lines = [h.machine_line(h.machine_info()) + f" Command: `{command}`.", "",
             "### Measured (2 ranks, 1f1b with the planner's plan, bytes counted by the engine; "
             "a replicated stage's gradient all-reduce added as 2 (r - 1) / r of its weight bytes "
             "per step)", "",
             *h.table(["model", "weights (MB)", "plan (layers x replicas)", "pipedream_ext (KB/sample)",
                       "data parallel (KB/sample)", "reduction"],
                      [[r["model"], f"{r['weights_MB']:.1f}", r["plan"], f"{r['ours'] / 1e3:.1f}",
                        f"{r['dp'] / 1e3:.1f}", f"{100 * (1 - r['ours'] / r['dp']):.0f}%"] for r in measured_rows])]
    lines += ["", "### Analytical (shipped profiles, `pipedream` cost model at 1.25e9 B/s, "
              "activation compression ratio 1)", "",
              *h.table(["profile", "workers", "plan", "pipedream_ext (MB/minibatch)", "data parallel (MB/minibatch)",
                        "reduction"],
                       [[r["profile"], r["workers"], r["plan"], f"{r['ours'] / 1e6:.1f}", f"{r['dp'] / 1e6:.1f}",
                         f"{100 * (1 - r['ours'] / r['dp']):.0f}%"] for r in analytical_rows])]
    return "\n".join(lines) + "\n"


def run_driver(args: argparse.Namespace) -> int:
    """Both parts; writes ``<out-dir>/comm_volume.md``."""
    rows_a = measured(args.batch, args.steps)
    rows_b = analytical(["vgg16", "alexnet", "resnet50", "gnmt"], [4, 16])
    h.write_results(Path(args.out_dir), "comm_volume", report(rows_a, rows_b, "python benchmarks/comm_volume.py"))
    return 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--worker MODEL --plan PATH`` under torchrun)."""
    parser = h.make_parser(__doc__, tuple(MODELS))
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    return parser.parse_args(argv)


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
