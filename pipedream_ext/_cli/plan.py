"""CLI commands ``profile`` and ``plan``.

    python -m pipedream_ext profile --model MODULE:FACTORY --input-shape 64,1,8,8 -o graph.txt
      (an nn.Sequential: one node per layer; any other nn.Module: its traced graph)
    python -m pipedream_ext plan --profile graph.txt --workers 4,4 --bandwidth 16e9,1.25e9
    python -m pipedream_ext plan --profile graph.txt --workers 4 --bandwidth 16e9,1.25e9 \
        --data-parallel 2 --sharding fsdp --memory 2e9
      (4 pipeline stages, 2 FSDP ranks in each at 16e9 B/s, stages 1.25e9 B/s apart)
    python -m pipedream_ext plan --profile graph.txt --workers 4 --bandwidth 16e9,1.25e9 \
        --data-parallel 2 --sharding fsdp --tensor-parallel 2 --sequence-parallel \
        --tp-bandwidth 1e11
      (a (pp 4, dp 2, tp 2) mesh: 16 ranks, each stage's 2 x 2 ranks consecutive)
    python -m pipedream_ext plan --auto --profile graph.txt --batch-size 64 --workers 4 \
        --bandwidth 1e9 --memory 2e9 -o plan.json
      (the whole configuration: schedule, microbatches, balance, recompute; a table of the
      best ones; the plan file fixes all of it: PipeDream(..., balance="plan.json"))
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys

import torch
from torch import nn

from .._pipe import PipeDream
from .._planning import choose
from .._planning.calibration import calibrate_local
from .._planning.profile_chain import MAX_LAYERS, chain_of_profile
from .._planning.profiler import profile
from ..configuration import microbatch_candidates
from ..planner import SHARDINGS, Plan, load_profile, plan
from .arg_types import float_list, int_list

__all__ = ["register"]


def _load_factory(spec: str):  # type: ignore[no-untyped-def]
    if ":" not in spec:
        raise ValueError(f"--model {spec!r} should be MODULE:FACTORY, e.g. mypkg.models:make_mlp")
    module_name, attr = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for --model: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r}; --model needs MODULE:FACTORY")
    return factory


def _run_profile(args: argparse.Namespace) -> int:
    model = _load_factory(args.model)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{args.model} returned {type(model).__name__}; the factory must return "
                         "an nn.Module")
    device = torch.device(args.device)
    model = model.to(device)
    if args.input_dtype == "int64":
        sample = torch.randint(0, args.input_high, tuple(args.input_shape), device=device)
    else:
        sample = torch.randn(tuple(args.input_shape), device=device)
    # An nn.Sequential is a chain of its layers; any other model its traced graph.
    graph = profile(model, sample, steps=args.steps, warmup=args.warmup, output=args.output,
                    progress=args.progress)
    total_f = sum(n["forward_ms"] for n in graph.nodes())
    total_b = sum(n["backward_ms"] for n in graph.nodes())
    inputs = sum(1 for n in graph.nodes() if n["is_input"])
    what = "layers" if isinstance(model, nn.Sequential) else \
        f"groups of the traced graph, {len(graph.edges())} edges"
    print(f"profiled {len(graph) - inputs} {what}: forward {total_f:.3f} ms, backward "
          f"{total_b:.3f} ms" + (f"; wrote {args.output}" if args.output else ""))
    if not args.output:
        print(graph.to_string())
    return 0


def _run_auto(args: argparse.Namespace) -> int:
    """``plan --auto``: the whole configuration of a profile (a branching one as a chain
    in topological order: ``profile_chain``), searched with this machine's calibrated
    costs (``calibrate_local``) and the given bandwidth."""
    if args.batch_size is None:
        raise ValueError("--auto needs --batch-size: the samples per step of one pipeline, the "
                         "batch the profile was taken with")
    chain = chain_of_profile(load_profile(args.profile), args.batch_size, args.max_layers)
    costs = chain.costs
    world = math.prod(args.workers)
    # The calibration times our own runtime (a one-rank PipeDream).
    machine = dataclasses.replace(calibrate_local(torch.device(args.device), pipeline=PipeDream),
                                  bandwidth=args.bandwidth[0])
    request = choose.Request(
        schedules=choose.schedule_candidates(args.schedule, 1, len(costs.layers), world),
        microbatches=microbatch_candidates(args.batch_size), chunks=(2,), balance=None,
        recompute=args.recompute, memory=args.memory, meshes=[(world, 1, 1)])
    best, result = choose.search_profile(chain, machine, request, args.batch_size)
    table = best.table()
    if chain.nodes is not None:
        merged = sum(len(nodes) for nodes in chain.nodes)
        table += (f"\nbalance: layers per stage of the {len(chain.nodes)} layers the profile's "
                  f"{merged} nodes (inputs included) were merged into (--max-layers); the plan "
                  "(-o, --json) names each stage's nodes")
    return _report(result, table, args)


def _report(result: Plan, table: str, args: argparse.Namespace) -> int:
    """Writes the plan to ``--output`` and prints it as JSON (``--json``) or as ``table``."""
    if args.output:
        result.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(table)
        if args.output:
            print(f"wrote {args.output}")
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    if args.auto:
        return _run_auto(args)
    result = plan(
        args.profile,
        workers=args.workers,
        bandwidth=args.bandwidth,
        memory=args.memory,
        straight=args.straight,
        fewer_workers=args.fewer_workers,
        cost_model=args.cost_model,
        activation_compression_ratio=args.activation_compression_ratio,
        two_bw=args.two_bw,
        max_antichain_states=args.max_states,
        work_budget=args.work_budget,
        data_parallel=args.data_parallel,
        sharding=args.sharding,
        optimizer_state=args.optimizer_state,
        tensor_parallel=args.tensor_parallel,
        sequence_parallel=args.sequence_parallel,
        tensor_parallel_bandwidth=args.tp_bandwidth,
        tensor_parallel_all_reduces=args.tp_all_reduces,
    )
    return _report(result, result.table(), args)


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Adds the ``profile`` and ``plan`` commands."""
    p = subparsers.add_parser(
        "profile",
        help="time every layer of a model and write PipeDream's graph.txt",
        description="Profiles forward/backward time, activation and weight bytes per layer: "
        "the layers of an nn.Sequential (a chain), or for any other nn.Module the groups of "
        "operations of its torch.fx graph, with an edge for every value one group passes "
        "another (skip connections included; docs/tracing.md).",
    )
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="a factory returning an nn.Module (an nn.Sequential or any model "
                        "torch.fx can trace), e.g. mypkg.models:make_resnet")
    p.add_argument("--input-shape", required=True, type=int_list, metavar="N,C,...",
                   help="shape of one minibatch, e.g. 64,1,8,8")
    p.add_argument("--input-dtype", choices=["float32", "int64"], default="float32",
                   help="float32 (randn) or int64 (token ids in [0, --input-high))")
    p.add_argument("--input-high", type=int, default=2, help="upper bound for int64 inputs")
    p.add_argument("--steps", type=int, default=20, help="measured iterations (median)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured iterations first")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument("-o", "--output", help="graph.txt to write (default: print it)")
    p.set_defaults(func=_run_profile)

    q = subparsers.add_parser(
        "plan",
        help="partition a profiled model over a cluster (stages, replicas, ranks)",
        description="PipeDream's planner: stages, replicas per stage and ranks, "
        "with predicted time per stage and speedup over data parallelism.",
    )
    q.add_argument("--profile", required=True, help="graph.txt from `profile` or PipeDream")
    q.add_argument("--workers", required=True, type=int_list, metavar="N[,N...]",
                   help="workers per level, innermost first, e.g. 4,4")
    q.add_argument("--bandwidth", required=True, type=float_list, metavar="B[,B...]",
                   help="bytes/s per level, innermost first, e.g. 16e9,1.25e9")
    q.add_argument("--memory", type=float, default=None, metavar="BYTES",
                   help="memory per worker (per rank); plans that exceed it are rejected")
    q.add_argument("--straight", action="store_true", default=None,
                   help="one worker per stage (no replication)")
    q.add_argument("--fewer-workers", action="store_true", help="allow leaving workers unused")
    q.add_argument("--cost-model", choices=["pipedream", "default"], default="default",
                   help="pipedream: PipeDream's optimizer's cost model and search; default: ours (docs/planner.md)")
    q.add_argument("--activation-compression-ratio", type=float, default=None, metavar="C",
                   help="activation compression (pipedream model: absent means free transfers)")
    q.add_argument("--two-bw", action="store_true",
                   help="default model: count 2 weight versions per stage (2BW)")
    q.add_argument("--data-parallel", type=int, default=None, metavar="DP",
                   help="data-parallel ranks inside every stage (the dp size of a (pp, dp) "
                        "mesh): --workers are then the pipeline workers, stages straight over "
                        "them, and --bandwidth lists the dp ranks' bytes/s first")
    q.add_argument("--sharding", choices=list(SHARDINGS), default=None,
                   help="with --data-parallel: fsdp (weights, gradients and optimizer state "
                        "divided among a stage's dp ranks) or replicate (default)")
    q.add_argument("--optimizer-state", type=float, default=2.0, metavar="X",
                   help="with --data-parallel: optimizer state bytes per weight byte "
                        "(AdamW 2, SGD with momentum 1, plain SGD 0)")
    q.add_argument("--tensor-parallel", type=int, default=None, metavar="TP",
                   help="tensor-parallel ranks inside every data-parallel rank of a stage (the "
                        "tp size of a (pp, dp, tp) mesh; --data-parallel defaults to 1): "
                        "--workers stay the pipeline workers, the plan runs on pp x dp x tp "
                        "ranks")
    q.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel: activations are sharded over the tp ranks too "
                        "(stashed and sent to the next stage)")
    q.add_argument("--tp-bandwidth", type=float, default=None, metavar="B",
                   help="with --tensor-parallel: bytes/s among a stage's tp ranks (default: the "
                        "fastest --bandwidth, as TP runs inside a node)")
    q.add_argument("--tp-all-reduces", type=float, default=None, metavar="N",
                   help="with --tensor-parallel: all-reduces of each layer's output per "
                        "minibatch, forward and backward (default 4, a transformer block's)")
    q.add_argument("--max-states", type=int, default=4096, metavar="N",
                   help="use PipeDream's antichain states only up to N of them (else topological cuts)")
    q.add_argument("--work-budget", type=float, default=1.5e8, metavar="W",
                   help="DP updates allowed before falling back to cuts / coarsening them")
    q.add_argument("--auto", action="store_true",
                   help="choose the whole configuration (schedule, microbatches, balance, "
                        "recompute) for --workers ranks with this machine's "
                        "calibrated costs and --bandwidth; prints the best configurations")
    q.add_argument("--max-layers", type=int, default=MAX_LAYERS, metavar="N",
                   help="with --auto: merge a branching profile's nodes into at most N layers of "
                        f"consecutive nodes, cut where few bytes cross (default {MAX_LAYERS})")
    q.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="with --auto: samples per step (the batch the profile was taken with)")
    q.add_argument("--schedule", default="auto",
                   help="with --auto: a flush schedule to keep fixed (default: choose one)")
    q.add_argument("--recompute", choices=["never", "always", "search"], default="search",
                   help="with --auto: recompute no stage, every stage, or choose per stage")
    q.add_argument("--device", default="cpu", help="with --auto: where the calibration runs")
    q.add_argument("-o", "--output", help="plan.json to write")
    q.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    q.set_defaults(func=_run_plan)
