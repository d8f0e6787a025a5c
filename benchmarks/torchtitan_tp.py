"""torchtitan's own Llama 3 and its own ``apply_tp`` through ``PipeDream``: pp 2 x tp 2 on
4 Gloo ranks, the model traced with ``split_points`` and the plan handed over as the
parallelize function torchtitan calls (``functools.partial(apply_tp, loss_parallel=False,
enable_float8_tensorwise_tp=False)``), with sequence parallelism (torchtitan's plan) and
without (the same plan's linear layers only), on 1f1b, zb-h1 and zbv; every step's loss
and every weight after each AdamW step against the unsplit model on every rank.

Needs a torchtitan checkout (``--torchtitan PATH``, its repository root; tested at commit
238fa99). Only its model and parallelize modules are imported; the packages its other
modules import at start-up (datasets, tensorboard, tokenizers, triton for MoE kernels)
are stood in for by empty modules when missing. Model: ``TransformerModelArgs(dim=64,
n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=16)``,
``init_weights()``, batch 4 x 16 tokens in 2 microbatches; split points ``layers.2``
(zbv: ``layers.1``, ``layers.2``, ``layers.3``).

Command (about a minute on 2 cores):

    python benchmarks/torchtitan_tp.py --torchtitan ../torchtitan
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

__all__ = ["main", "parse_args", "report", "run_driver", "run_worker"]

JSON_TAG = "TORCHTITAN_TP_JSON "
SCHEDULES = ("1f1b", "zb-h1", "zbv")
STEPS = 3
_log = logging.getLogger("torchtitan_tp")
# What torchtitan's package imports at start-up that its model does not need.
_OPTIONAL = ("datasets", "tensorboard", "wandb", "tyro", "torchdata", "tokenizers", "tiktoken",
             "blobfile", "fsspec", "sentencepiece")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = h.make_parser(__doc__, worker=True)
    p.add_argument("--torchtitan", required=True, help="a torchtitan checkout (its repository root)")
    args = p.parse_args(argv)
    if not (Path(args.torchtitan) / "torchtitan" / "models" / "llama3").is_dir():
        p.error(f"--torchtitan {args.torchtitan!r} holds no torchtitan/models/llama3; give the root of a "
                "torchtitan checkout (git clone https://github.com/pytorch/torchtitan)")
    return args


# ----------------------------------------------------------------------------- worker
def _import_torchtitan(root: str) -> Any:
    """torchtitan's Llama 3 modules, with empty stand-ins for the packages only its other
    modules need (module docstring)."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    class Stub(types.ModuleType):
        __path__: List[str] = []

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *a, **k: None})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            top = name.split(".")[0]
            if top in _OPTIONAL and importlib.machinery.PathFinder.find_spec(top) is None:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec: Any) -> Any:
            return Stub(spec.name)

        def exec_module(self, module: Any) -> None:
            pass

    if importlib.util.find_spec("triton") is None:  # MoE kernels only
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None  # type: ignore[attr-defined]
        sys.modules["torchtitan.models.moe.kernels"] = kernels
    if importlib.util.find_spec("tensorboard") is None:  # metrics only
        board = types.ModuleType("torch.utils.tensorboard")
        board.SummaryWriter = None  # type: ignore[attr-defined]
        sys.modules["torch.utils.tensorboard"] = board
    sys.meta_path.append(Finder())
    sys.path.insert(0, root)
    from torchtitan.models.llama3.infra import parallelize
    from torchtitan.models.llama3.model import args, model
    return types.SimpleNamespace(Transformer=model.Transformer, Args=args.TransformerModelArgs,
                                 apply_tp=parallelize.apply_tp)


def _linear_plan() -> Any:
    """torchtitan's plan without sequence parallelism, as a parallelize function."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def apply(model: Any, tp_mesh: Any) -> None:
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel()})
    return apply


def _one(titan: Any, schedule: str, sequence_parallel: bool, mesh: Any) -> Dict[str, Any]:
    """One configuration: STEPS AdamW steps of the pipeline and of the unsplit model."""
    import functools

    import torch
    import torch.nn.functional as F

    import pipedream_ext as pd

    args = titan.Args(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                      max_seq_len=16)

    def build() -> Any:
        torch.manual_seed(0)
        model = titan.Transformer(args)
        with torch.no_grad():
            model.init_weights()
        return model

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
            for _ in range(STEPS + 1)]
    plan = functools.partial(titan.apply_tp, loss_parallel=False, enable_float8_tensorwise_tp=False) \
        if sequence_parallel else _linear_plan()
    chunks = 2 if schedule == "zbv" else 1
    ref = build()
    pipe = pd.PipeDream(build(), loss_fn, schedule=schedule, microbatches=2, chunks=chunks, mesh=mesh,
                        split_points=["layers.1", "layers.2", "layers.3"] if chunks == 2 else ["layers.2"],
                        sample=data[0], tensor_parallel=plan, timeout=120)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    refs = dict(ref.named_parameters())
    out: Dict[str, Any] = {"tracer": pipe.traced.tracer, "loss_rel": 0.0, "weight_rel": 0.0}
    for x, y in data[1:]:
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        out["loss_rel"] = max(out["loss_rel"], abs(float(loss) - ref_loss.item()) / abs(ref_loss.item()))
        for name, p in pipe.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            diff = (full.detach() - refs[name].detach()).norm() / refs[name].detach().norm()
            out["weight_rel"] = max(out["weight_rel"], diff.item())
    pipe.close()
    return out


def run_worker(args: argparse.Namespace) -> int:
    """Every configuration in one launch; each rank's worst differences, the maxima kept."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        titan = _import_torchtitan(args.torchtitan)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        result["configs"] = []
        for sequence_parallel in (True, False):
            for schedule in SCHEDULES:
                one = _one(titan, schedule, sequence_parallel, mesh)
                worst = torch.tensor([one["loss_rel"], one["weight_rel"]])
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                result["configs"].append({"schedule": schedule, "sequence_parallel": sequence_parallel,
                                          "tracer": one["tracer"], "loss_rel": worst[0].item(),
                                          "weight_rel": worst[1].item()})

    return h.worker(JSON_TAG, body, backend="gloo")


# ----------------------------------------------------------------------------- driver
def report(result: Dict[str, Any], info: Dict[str, str], command: str, total_s: float) -> str:
    """The Markdown report: one row per configuration."""
    lines = ["# torchtitan's Llama 3 and apply_tp through PipeDream", "",
             f"pp 2 x tp 2, 4 Gloo ranks; {STEPS} AdamW steps (lr 0.01) against the unsplit model on every "
             "rank: the largest relative difference of a step's loss, and of a weight after a step "
             "(||pipeline - unsplit|| / ||unsplit||, the pipeline's DTensor shards gathered), over ranks and "
             "steps. *plan*: torchtitan's `apply_tp` (sequence parallel) or its linear layers only; "
             "*tracer*: what traced the model (`split_points`).", ""]
    rows = [[c["schedule"], "apply_tp (sequence parallel)" if c["sequence_parallel"] else "linear layers only",
             c["tracer"], f"{c['loss_rel']:.1e}", f"{c['weight_rel']:.1e}"] for c in result["configs"]]
    lines += h.table(["schedule", "plan", "tracer", "loss: largest relative difference",
                      "weights: largest relative difference"], rows)
    lines += ["", h.machine_line(info), "",
              f"Command: `{command}` (total {total_s:.0f} s; launch {result.get('launch_s', 0.0):.0f} s).", ""]
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    """One 4-rank launch of every configuration; the report."""
    info, command = h.start_report(_log)
    start = time.perf_counter()
    result = h.launch_torchrun(Path(__file__).resolve(), 4, ["--worker"] + h.forward(args, "torchtitan"),
                               JSON_TAG, timeout=900)
    if "error" in result:
        _log.error("%s", result["error"])
        return 1
    text = report(result, info, command, time.perf_counter() - start)
    h.write_results(Path(args.out_dir), "torchtitan_tp", text,
                    {"machine": info, "command": command, "args": h.run_options(args), "result": result})
    return 0


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
