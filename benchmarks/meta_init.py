"""Memory per rank of a traced Hugging Face model built on the meta device vs built whole.

Model: a Llama (``transformers``' ``LlamaForCausalLM`` from a config, no download):
``--layers`` decoder layers (default 16) of width ``--hidden`` (1024, MLP 3072, 16
heads, 8 key/value heads), vocabulary 32000, untied head: 267M fp32 parameters
(1.0 GiB). Pipelined with ``split_points`` at every ``layers / ranks``-th decoder
layer over ``--ranks`` (default 4) ranks with ``1f1b`` (traced with torch.export).
Two ``torch.distributed.run`` launches in one run, one per way of building it:

* **whole**: ``torch.manual_seed(0); model = AutoModelForCausalLM.from_config(cfg)``
  on every rank, then ``PipeDream(model, ..., split_points=..., sample=...)``;
* **meta**: the same under ``with torch.device("meta"):``; ``PipeDream`` traces the
  model without values and allocates and initialises only the units this rank's
  stages hold (the model's ``_init_weights``, seeded per unit).

Every rank reports its resident set size (``/proc/self/statm``) after the process
group is up (baseline), after building the model, after ``PipeDream(...)`` and
after one training step (batch ``--batch`` of ``--length`` tokens, 2 microbatches,
SGD without momentum), its peak RSS (``ru_maxrss``) and the seconds building the
model and the pipeline took (tracing included).

Command (a few minutes on 2 cores: every rank exports the model; ~7 GB of memory):

    python benchmarks/meta_init.py
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
import deferred_init as whole_vs_meta
from deferred_init import FIELDS, peak_rss_bytes, rss_bytes

__all__ = ["MODES", "main", "parse_args", "peak_rss_bytes", "report", "rss_bytes", "run_driver",
           "run_worker"]

LOG = logging.getLogger("meta_init")
JSON_TAG = "META_INIT_JSON "
MODES = ("whole", "meta")
# Per-rank measurements: deferred_init.FIELDS, gathered on rank 0.


def run_worker(args: argparse.Namespace) -> int:
    """One rank: build the model the ``--worker`` way, the pipeline, one step; report."""
    def body(result: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.utils import logging as hf_logging

        import pipedream_ext as pd

        hf_logging.set_verbosity_error()
        cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=16,
                          num_key_value_heads=8, max_position_embeddings=256)
        world = dist.get_world_size()
        splits = [f"model.layers.{k * args.layers // world}" for k in range(1, world)]

        def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.logits.flatten(0, -2), y.flatten())

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 32000, (args.batch, args.length + 1), generator=g)
        x, y = {"input_ids": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()
        values: Dict[str, float] = {"baseline": rss_bytes()}
        t0 = time.perf_counter()
        if args.worker == "meta":
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
        else:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
        values["build_s"] = time.perf_counter() - t0
        values["built"], values["peak_built"] = rss_bytes(), peak_rss_bytes()
        t0 = time.perf_counter()
        pipe = pd.PipeDream(model, loss_fn, schedule="1f1b", microbatches=2, timeout=600,
                            split_points=splits, sample=(x, y), concrete_args={"use_cache": False})
        values["pipeline_s"] = time.perf_counter() - t0
        values["pipeline"] = rss_bytes()
        values["peak_built"] = peak_rss_bytes()
        values["params"] = sum(p.numel() for p in pipe.parameters())
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        opt.step()
        values["step_s"] = time.perf_counter() - t0
        values["stepped"], values["peak_stepped"] = rss_bytes(), peak_rss_bytes()
        mine = torch.tensor([float(values[f]) for f in FIELDS], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        result.update(mode=args.worker, loss=float(loss), model_params=sum(
            p.numel() for p in model.parameters()), split_points=splits,
            ranks=[dict(zip(FIELDS, t.tolist()), rank=r) for r, t in enumerate(everyone)])

    return h.worker(JSON_TAG, body, backend="gloo")


def report(results: Dict[str, Dict[str, Any]], info: Dict[str, str], command: str,
           total_s: float) -> str:
    """benchmarks/deferred_init.py's report (whole vs meta per rank) for this model."""
    meta = results["meta"]
    split = meta.get("split_points") or results["whole"].get("split_points")
    return whole_vs_meta.report(
        results, info, command, total_s, title="Traced model from the meta device: memory per rank",
        model="Llama, ", split=f"split at {split}",
        seconds="build + pipeline s (tracing included)")


def run_driver(args: argparse.Namespace) -> int:
    """Both launches, then ``<out-dir>/meta_init.md`` and ``.json``."""
    info, command = h.start_report(LOG)
    t0 = time.perf_counter()
    results: Dict[str, Dict[str, Any]] = {}
    for mode in MODES:
        LOG.info("launching %d ranks, model built %s", args.ranks, mode)
        results[mode] = h.launch_torchrun(Path(__file__), args.ranks, ["--worker", mode] + h.forward(
            args, "layers", "hidden", "batch", "length"), JSON_TAG, timeout=args.timeout)
    text = report(results, info, command, time.perf_counter() - t0)
    h.write_results(Path(args.out_dir), "meta_init", text,
                    {"machine": info, "command": command, "results": results})
    return 1 if any("error" in r for r in results.values()) else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--worker whole|meta`` under torchrun)."""
    parser = h.make_parser(__doc__, MODES)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900)
    return parser.parse_args(argv)


main = h.main(parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
