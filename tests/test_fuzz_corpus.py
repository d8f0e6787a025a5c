"""Replays the plan JSON fuzz corpus and saved findings (tests/fuzz/corpus/plan_json,
tests/fuzz/regressions/plan_json) through the fuzz harness, without atheris."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz"
_spec = importlib.util.spec_from_file_location("fuzz_plan_json", FUZZ / "fuzz_plan_json.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)  # type: ignore[union-attr]

INPUTS = sorted(p for kind in ("corpus", "regressions") for p in (FUZZ / kind / "plan_json").glob("*")
                if p.is_file())


def test_corpus_is_there() -> None:
    assert len(INPUTS) >= 5


@pytest.mark.parametrize("path", INPUTS, ids=[f"{p.parent.parent.name}/{p.name}" for p in INPUTS])
def test_plan_json_input_is_accepted_or_clearly_rejected(path: Path) -> None:
    assert harness.check_plan_json(path.read_bytes()) == ""
