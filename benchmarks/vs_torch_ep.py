"""Pipeline x expert parallelism (pp 2 x ep 2, 4 CPU ranks, Gloo): ours against
torch's pieces composed torchtitan's way, on one torchtitan-style MoE transformer, in
one launch.

The model (tests/moe_model.py): token embedding, ``--layers`` blocks (a dense per-token
mix and an MoE: a softmax router choosing ``--top-k`` of ``--experts`` SwiGLU experts
of width ``--hidden``, tokens sorted by expert, ``GroupedExperts`` looping over them,
dropless), RMSNorms, an untied head; width ``--dim``, vocabulary ``--vocab``, ``--seq``
tokens; a global batch of ``--batch`` rows, each ep rank training on its half (ep ranks
are data ranks, torchtitan's dp2ep) in ``--microbatches`` microbatches; next-token
cross-entropy, AdamW. Both sides apply torchtitan's ``ExpertParallel`` (experts
``Shard(0)`` over ep, token dispatch and combine by all_to_all) to the same modules:

* **ours**: ``pd.PipeDream(model, loss, schedule=S, mesh=init_device_mesh("cpu", (2, 2),
  ("pp", "ep")), split_points=["layers.L/2"], sample=..., expert_parallel={"layers.*.moe.experts":
  ExpertParallel()}, data_parallel="replicate")`` (the dense weights whole on both ep
  ranks, as torch's side keeps them);
* **torch**: each rank cuts its stage out of the model by hand (the same cut: the
  embedding and the first half of the blocks | the rest, the norm and the head, under
  their unsplit names), ``parallelize_module(stage, mesh["ep"], plan)``, one
  ``torch.distributed.pipelining.PipelineStage`` on ``mesh["pp"]``'s group and the
  matching schedule class (1f1b - ``Schedule1F1B``, gpipe - ``ScheduleGPipe``, zb-h1 -
  ``ScheduleInterleavedZeroBubble`` on one stage per rank); after each step the dense
  gradients are averaged over the ep group (one flat all-reduce per stage, as ours) and
  the experts' divided by ep (the experts' shards already hold every ep rank's tokens'
  part).

The rounds, bytes, profiles and same-work check are vs_torch_tp.py's (its helpers):
before timing each configuration's first step is checked against the unsplit model on
the whole batch (the loss, every gradient gathered from its shards); then ``--pairs``
rounds, per comparison ``--steps`` steps of each side between barriers, the side going
first alternating; then per rank the bytes held and one profiled step. Writes
``<out-dir>/vs_torch_ep.md`` and ``vs_torch_ep.json``.

    python3 benchmarks/vs_torch_ep.py [--pairs 12] [--steps 1] [--smoke]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))
import _harness as h
import vs_torch_tp as tp

__all__ = ["COMPARISONS", "main", "parse_args", "report", "run_driver", "run_worker"]

JSON_TAG = "VS_TORCH_EP_JSON "
LOG = logging.getLogger("vs_torch_ep")
PP, EP = 2, 2
COMPARISONS: Tuple[Tuple[str, int, str], ...] = (
    ("1f1b", 1, "Schedule1F1B"),
    ("gpipe", 1, "ScheduleGPipe"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
)
SMOKE = {"dim": 16, "hidden": 32, "experts": 4, "vocab": 64, "layers": 2, "seq": 8, "batch": 8,
         "microbatches": 2, "pairs": 1, "steps": 1, "warmup": 1}
PLAN_KEY = "layers.*.moe.experts"


def _cfg(args: argparse.Namespace) -> Any:
    from moe_model import MoEConfig

    return MoEConfig(dim=args.dim, hidden=args.hidden, experts=args.experts, top_k=args.top_k, vocab=args.vocab)


def _model(args: argparse.Namespace) -> Any:
    from moe_model import build

    return build(args.layers, seed=0, cfg=_cfg(args))


def _plan() -> Dict[str, Any]:
    from moe_model import ExpertParallel

    return {PLAN_KEY: ExpertParallel()}


def _batch(args: argparse.Namespace) -> Tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _part(args: argparse.Namespace, ep_rank: int) -> slice:
    rows = args.batch // EP
    return slice(ep_rank * rows, (ep_rank + 1) * rows)


def _ours(args: argparse.Namespace, name: str, mesh: Any, x: Any, y: Any) -> tp.Config:
    import torch

    import pipedream_ext as pd

    part = _part(args, mesh["ep"].get_local_rank())
    pipe = pd.PipeDream(_model(args), tp.lm_loss, schedule=name, microbatches=args.microbatches, mesh=mesh,
                        split_points=[f"layers.{args.layers // 2}"], sample=(x[part], y[part]),
                        expert_parallel=_plan(), data_parallel="replicate", timeout=args.pipe_timeout)
    c = tp.Config()
    c.pipe = pipe
    c.params = list(pipe.parameters())
    tp.named_parameters_of(c, pipe)
    c.opt = torch.optim.AdamW(c.params, lr=args.lr)

    def forward_backward(loss: bool) -> float:
        value = pipe.step(x[part], y[part])
        return float(value) if loss else 0.0

    c.forward_backward = forward_backward
    return c


class _Stage:
    """A hand cut stage of the MoE transformer under its unsplit names (torchtitan's
    pipeline split keeps ``layers.N``): the embedding and the first blocks, or the last
    blocks, the norm and the head."""

    @staticmethod
    def build(model: Any, first: bool, split: int) -> Any:
        from torch import nn

        class Stage(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                keys = [k for k in model.layers if (int(k) < split) == first]
                self.layers = nn.ModuleDict({k: model.layers[k] for k in keys})
                if first:
                    self.tok_embeddings = model.tok_embeddings
                else:
                    self.norm, self.output = model.norm, model.output

            def forward(self, h: Any) -> Any:
                if first:
                    h = self.tok_embeddings(h)
                for layer in self.layers.values():
                    h = layer(h)
                return h if first else self.output(self.norm(h))

        return Stage()


def _torch(args: argparse.Namespace, cls_name: str, mesh: Any, x: Any, y: Any) -> tp.Config:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.tensor.parallel import parallelize_module

    pp_rank, ep_group = mesh["pp"].get_local_rank(), mesh["ep"].get_group()
    part = _part(args, mesh["ep"].get_local_rank())
    module = _Stage.build(_model(args), pp_rank == 0, args.layers // 2)
    parallelize_module(module, mesh["ep"], _plan())
    stage = pipelining.PipelineStage(module, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = getattr(pipelining, cls_name)(stage if cls_name != "ScheduleInterleavedZeroBubble" else [stage],
                                         args.microbatches, loss_fn=tp.lm_loss)
    params = list(module.parameters())
    experts = [p for p in params if hasattr(p, "device_mesh")]
    dense = [p for p in params if not hasattr(p, "device_mesh")]

    def reduce_gradients() -> None:
        # dp2ep: the dense gradients averaged over the ep ranks, the experts' divided by ep.
        with torch.no_grad():
            grads = [p.grad for p in dense]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=ep_group)
            flat /= EP
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            for p in experts:
                p.grad.to_local().div_(EP)

    def forward_backward(loss: bool) -> float:
        losses: List[Any] = []
        sched.step(*((x[part],) if pp_rank == 0 else ()),
                   **({"target": y[part], "losses": losses} if pp_rank == PP - 1 else {}))
        reduce_gradients()
        if not loss:
            return 0.0
        mean = float(torch.stack([v.detach() for v in losses]).mean()) if losses else 0.0
        value = torch.tensor([mean / EP], dtype=torch.float64)
        dist.all_reduce(value)
        return float(value.item())

    c = tp.Config()
    c.params = params
    c.named = list(module.named_parameters())
    c.opt = torch.optim.AdamW(params, lr=args.lr)
    c.forward_backward = forward_backward
    return c


def _build(args: argparse.Namespace, mesh: Any, x: Any, y: Any, result: Dict[str, Any]) -> Dict[str, tp.Config]:
    """Every configuration (torch's, then ours, per comparison), each checked against the
    unsplit model on the whole batch; a failing one is recorded and left out."""
    import torch
    import torch.distributed as dist

    model = _model(args)
    loss = tp.lm_loss(model(x), y)
    loss.backward()
    reference = (float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    configs: Dict[str, tp.Config] = {}
    for ours, _chunks, cls_name in COMPARISONS:
        if ours not in args.schedules:
            continue
        for side in ("torch", "ours"):
            key = f"{side} {ours}"
            entry = result["configs"].setdefault(key, {"class": cls_name if side == "torch" else ours})
            try:
                config = _torch(args, cls_name, mesh, x, y) if side == "torch" else _ours(args, ours, mesh, x, y)
                entry["same_work"] = tp.same_work(config, *reference)
                for _ in range(args.warmup - 1):
                    config.step()
                if config.pipe is not None:
                    config.pipe.reset_stats()
                configs[key] = config
            except Exception as exc:  # a failing configuration is a result
                entry["error"] = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
                LOG.exception("%s failed", key)
            ok = torch.tensor([float(key in configs)])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item() and configs.pop(key, None) is not None:
                entry.setdefault("error", "another rank failed (its error is in its log)")
    return configs


def run_worker(args: argparse.Namespace) -> int:
    """Every rank: every configuration, the interleaved rounds, the bytes and profiles."""
    def body(result: Dict[str, Any]) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != PP * EP:
            raise ValueError(f"vs_torch_ep.py runs on {PP * EP} ranks (pp {PP} x ep {EP}), "
                             f"not {dist.get_world_size()}")
        mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
        x, y = _batch(args)
        result.update(rounds=[], configs={}, loadavg_start=list(os.getloadavg()))
        configs = _build(args, mesh, x, y, result)
        tp.timed_rounds(args, configs, result, COMPARISONS)
        result["loadavg_end"] = list(os.getloadavg())
        tp.measure(args, configs, result)
        for config in configs.values():
            if config.pipe is not None:
                config.pipe.close()

    return h.worker(JSON_TAG, body, backend="gloo")


def report(result: Dict[str, Any], info: Dict[str, str], command: str, args: argparse.Namespace,
           total_s: float) -> Tuple[str, Dict[str, Any]]:
    """The Markdown report and the summary figures of one run (vs_torch_tp.py's tables)."""
    speed, summaries = tp.speed_table(result, COMPARISONS)
    lines = [f"# pp {PP} x ep {EP}: ours against torch's pieces composed torchtitan's way", "",
             f"Model: a torchtitan-style MoE transformer (tests/moe_model.py): {args.layers} blocks of width "
             f"{args.dim}, each a dense per-token mix and an MoE of {args.experts} SwiGLU experts of width "
             f"{args.hidden}, top-{args.top_k} softmax routing (dropless, a loop over the experts), RMSNorm, "
             f"untied head, vocabulary {args.vocab}; a global batch of {args.batch} x {args.seq} tokens, each "
             f"ep rank its half in {args.microbatches} microbatches, cross-entropy, AdamW lr={args.lr}; "
             f"torchtitan's ExpertParallel on `{PLAN_KEY}`. 4 Gloo ranks, mesh (pp {PP}, ep {EP}); 2 stages "
             f"cut at `layers.{args.layers // 2}` for both. {args.pairs} rounds, per comparison {args.steps} "
             f"steps of each side between barriers (the side going first alternating), after {args.warmup} "
             "warm-up steps (the first checks the loss and every gradient against the unsplit model on the "
             "whole batch).", ""] + speed
    loads = [r["loadavg_1min"] for r in result["rounds"]]
    if loads:
        lines += ["", f"Load average (1 min) over the rounds: {min(loads):.2f}-{max(loads):.2f}."]
    lines += ["", "Bytes per rank after the rounds (parameters, gradients, AdamW state; an expert DTensor's "
              "local shard) and one profiled forward-backward's allocator peak above its start:", ""]
    lines += tp.bytes_table(result, COMPARISONS)
    lines += ["", "Collectives of that profiled step, per rank (the experts' dispatch and combine are "
              "`alltoall_base_`; the dense gradients' all-reduce `allreduce_`):", ""]
    lines += tp.collectives_table(result, COMPARISONS)
    lines += ["", "Same work: each configuration's first step against the unsplit model:", ""]
    lines += tp.same_work_lines(result)
    lines += ["", h.machine_line(info), "", h.command_sentence(command, total_s, {PP * EP: result["launch_s"]}), ""]
    return "\n".join(lines), {"comparisons": summaries}


def run_driver(args: argparse.Namespace) -> int:
    """The one 4-rank launch, then ``<out-dir>/vs_torch_ep.md`` and ``.json``."""
    return tp.drive(args, Path(__file__).resolve(), "vs_torch_ep", PP * EP, JSON_TAG,
                    ["dim", "hidden", "experts", "top_k", "vocab", "layers"], report, LOG)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--worker`` under torchrun)."""
    p = h.make_parser(__doc__, worker=True)
    tp.add_round_args(p, COMPARISONS, pairs=12, batch=16, batch_help="global batch rows (each ep rank its half)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256, help="each expert's SwiGLU width")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (a multiple of ep)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="MoE blocks (even: two stages)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    args = p.parse_args(argv)
    tp.check_round_args(p, args, COMPARISONS, SMOKE)
    if args.layers % 2 or args.experts % EP or args.batch % (EP * args.microbatches):
        p.error(f"--layers {args.layers} must be even, --experts {args.experts} a multiple of ep {EP}, and "
                f"--batch {args.batch} a multiple of ep x --microbatches ({EP * args.microbatches})")
    return args


main = h.main(parse_args, run_worker, run_driver)

if __name__ == "__main__":
    sys.exit(main())
