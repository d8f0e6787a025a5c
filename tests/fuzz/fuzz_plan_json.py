"""Fuzz target: the plan JSON loader (pipedream_ext.planner.Plan.load / from_json).

Plans are parsed in Python (json + Plan.from_dict), so this target runs under
atheris, Python's libFuzzer. ``check_plan_json`` is shared with the pytest
that replays tests/fuzz/corpus/plan_json and tests/fuzz/regressions/plan_json.

An input is fine when Plan.load accepts it, or rejects it with a ValueError
whose message names the file (the loader's own error, not a stray one). Anything else is a finding: another exception
type, an empty message, or an accepted plan whose table() fails or whose
to_json() does not load back to the same JSON.

    python3 tests/fuzz/fuzz_plan_json.py [libFuzzer flags] WORK_DIR SEED_DIR
    python3 tests/fuzz/fuzz_plan_json.py --seeds DIR   # (re)writes the seed corpus
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
from typing import Optional

_TMP: Optional[str] = None


def _plan_cls():
    from pipedream_ext.planner import Plan

    return Plan


def check_plan_json(data: bytes) -> str:
    """Returns "" when the input is accepted or clearly rejected, else the finding."""
    global _TMP
    Plan = _plan_cls()
    if _TMP is None:
        fd, _TMP = tempfile.mkstemp(prefix="fuzz_plan_", suffix=".json")
        os.close(fd)
    with open(_TMP, "wb") as f:
        f.write(data)
    try:
        plan = Plan.load(_TMP)
    except ValueError as exc:
        if not str(exc).strip() or _TMP not in str(exc):
            return f"ValueError that does not name the file ({exc!r})"
        return ""
    except Exception as exc:  # noqa: BLE001 - anything else is the finding
        return f"Plan.load raised {type(exc).__name__}: {exc}"
    try:
        plan.table()
        text = plan.to_json()
        again = Plan.from_json(text).to_json()
    except Exception as exc:  # noqa: BLE001
        return f"an accepted plan fails afterwards: {type(exc).__name__}: {exc}"
    if again != text:
        return "Plan.from_json(plan.to_json()).to_json() differs from plan.to_json()"
    return ""


def write_seeds(out_dir: str) -> None:
    """Plans the shipped profiles on a few clusters and writes them, plus near-valid variants."""
    import json

    import pipedream_ext as pd

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    profiles = os.path.join(root, "tests", "data", "profiles")
    os.makedirs(out_dir, exist_ok=True)

    def write(name: str, text: str) -> None:
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)

    plans = {
        "alexnet-4": pd.plan(os.path.join(profiles, "alexnet.txt"), workers=[4], bandwidth=[16e9]),
        "resnet18-2x2": pd.plan(os.path.join(profiles, "resnet18.txt"), workers=[2, 2],
                                bandwidth=[16e9, 1.25e9], cost_model="pipedream"),
        "gnmt-3-straight": pd.plan(os.path.join(profiles, "gnmt.txt"), workers=[3], bandwidth=[1e9],
                                   straight=True),
    }
    for name, plan in plans.items():
        write(name, plan.to_json())
        write(name + "-compact", plan.to_json(indent=None))
    d = json.loads(plans["alexnet-4"].to_json())
    variants = {
        "bad-version": dict(d, version=2),
        "bad-no-format": {k: v for k, v in d.items() if k != "format"},
        "bad-no-stages": {k: v for k, v in d.items() if k != "stages"},
        "bad-stage-type": dict(d, stages=[5]),
        "bad-replicas-type": dict(d, stages=[dict(d["stages"][0], replicas="two")]),
        "bad-topology": dict(d, topology={"workers": [0], "bandwidth": [1e9]}),
        "bad-layers": dict(d, stages=[dict(d["stages"][0], layers=[1])]),
    }
    for name, obj in variants.items():
        write(name, json.dumps(obj))
    write("bad-truncated", plans["alexnet-4"].to_json()[:200])
    write("bad-array", "[1, 2, 3]")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--seeds":
        write_seeds(sys.argv[2])
        return
    import atheris

    importlib.import_module("torch")  # large and not under test: loaded before instrumentation

    with atheris.instrument_imports(include=["pipedream_ext"]):
        _plan_cls()

    def one_input(data: bytes) -> None:
        finding = check_plan_json(data)
        if finding:
            raise RuntimeError("FINDING (plan_json): " + finding)

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
