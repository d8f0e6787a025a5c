"""examples/ddp_vs_pipedream.py: DDP and a pipeline train the same model to the same
accuracy, and the "Moving from DDP" diff of docs/guide/ddp.md matches the example."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from typing import Dict, List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_vs_pipedream.py")
EPOCHS = "8"
MIN_ACCURACY = 0.95


def _train(parallel: str, save: str) -> Tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, "--parallel", parallel, "--epochs", EPOCHS,
           "--min-accuracy", str(MIN_ACCURACY), "--save", save]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    return result, time.time() - start


def _figure(result: subprocess.CompletedProcess, name: str) -> float:
    match = re.search(name + r" ([0-9.]+)", result.stdout)
    assert match, result.stdout[-3000:] + result.stderr[-3000:]
    return float(match.group(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ddp_vs_pipedream"))


@pytest.fixture(scope="module")
def runs(saved: str) -> Dict[str, subprocess.CompletedProcess]:
    out = {}
    for parallel in ("ddp", "1f1b"):
        result, seconds = _train(parallel, os.path.join(saved, f"{parallel}.pt"))
        print(f"{parallel}: {seconds:.1f} s")
        out[parallel] = result
    return out


def test_both_ways_save_the_whole_model(runs, saved):
    """The guide's last diff lines: DDP's rank-0 save of model.module and the pipeline's
    consolidated checkpoint both load into the unsplit model, every layer, and give back
    the test accuracy each run measured (the trained whole model, not one stage)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("ddp_vs_pipedream", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    _, test_set = example.load_digits(0)
    x_test, y_test = test_set.tensors
    for parallel in ("ddp", "1f1b"):
        assert runs[parallel].returncode == 0, runs[parallel].stderr[-3000:]
        model = example.make_model(1)  # other weights: all must come from the file
        state = torch.load(os.path.join(saved, f"{parallel}.pt"), weights_only=True)
        model.load_state_dict(state, strict=True)  # the whole model, every layer
        with torch.no_grad():
            accuracy = (model.eval()(x_test).argmax(dim=1) == y_test).double().mean().item()
        assert abs(accuracy - _figure(runs[parallel], "TEST ACCURACY")) < 1e-4, parallel


@pytest.mark.parametrize("parallel", ["ddp", "1f1b"])
def test_both_ways_reach_the_accuracy_threshold(runs, parallel):
    result = runs[parallel]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert _figure(result, "TEST ACCURACY") >= MIN_ACCURACY
    assert f"epoch {EPOCHS}: train loss" in result.stderr  # logged per epoch
    assert "samples/s" in result.stderr


def test_ddp_and_pipeline_train_alike(runs):
    # Same model, seed, samples per update and optimizer: 1f1b computes the same
    # mean gradient over the global batch as DDP, so the runs differ by rounding only.
    ddp, pipe = runs["ddp"], runs["1f1b"]
    assert abs(_figure(ddp, "TEST ACCURACY") - _figure(pipe, "TEST ACCURACY")) <= 0.02
    loss_ddp, loss_pipe = _figure(ddp, "FINAL TRAIN LOSS"), _figure(pipe, "FINAL TRAIN LOSS")
    assert abs(loss_ddp - loss_pipe) <= 0.1 * loss_ddp


# -- the guide's diff (docs/guide/ddp.md) -----------------------------------------------

GUIDE = os.path.join(ROOT, "docs", "guide", "ddp.md")


def _guide_diff() -> List[str]:
    with open(GUIDE, encoding="utf-8") as handle:
        text = handle.read()
    section = text.split("# Moving from DDP", 1)
    assert len(section) == 2, "docs/guide/ddp.md has no 'Moving from DDP' section"
    match = re.search(r"```diff\n(.*?)```", section[1], re.S)
    assert match, "no ```diff block in docs/guide/ddp.md's 'Moving from DDP'"
    return match.group(1).splitlines()


def _code(line: str) -> str:
    """The statement part of a line: comment and surrounding blanks removed."""
    return re.sub(r"\s+#.*$", "", line).strip()


def _example_lines() -> Dict[str, List[str]]:
    """Code part of every example line -> the comments it appears with."""
    lines: Dict[str, List[str]] = {}
    with open(EXAMPLE, encoding="utf-8") as handle:
        for line in handle:
            comment = line.split("#", 1)[1] if "  #" in line else ""
            lines.setdefault(_code(line), []).append(comment)
    return lines


def test_readme_diff_sides_are_valid_python():
    diff = _guide_diff()
    assert any(l.startswith("+") for l in diff) and any(l.startswith("-") for l in diff)
    for l in diff:
        assert l == "" or l[0] in " +-", f"not a diff line: {l!r}"
    before = "\n".join(l[1:] for l in diff if l[:1] in ("", " ", "-"))
    after = "\n".join(l[1:] for l in diff if l[:1] in ("", " ", "+"))
    compile(textwrap.dedent(before), "guide diff (DDP side)", "exec")
    compile(textwrap.dedent(after), "guide diff (pipeline side)", "exec")


def test_readme_diff_lines_are_the_examples_marked_lines():
    example = _example_lines()
    for line in _guide_diff():
        if line[:1] not in ("+", "-") or not _code(line[1:]):
            continue
        code = _code(line[1:])
        assert code in example, f"guide diff line not in examples/ddp_vs_pipedream.py: {line!r}"
        if code.startswith(("import ", "from ")):
            continue
        # Statements must sit on the matching path of the example: `# PIPELINE` for
        # added lines, `# DDP` for removed ones.
        marker = "PIPELINE" if line[0] == "+" else "DDP"
        assert any(marker in comment for comment in example[code]), (
            f"{line!r} is not marked # {marker} in examples/ddp_vs_pipedream.py")
