"""The README's main job: the digits example must train to >= 95% test accuracy."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "examples", "train_digits.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_digits_example_reaches_95_percent():
    result = _train()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    accuracy = float(re.search(r"TEST ACCURACY ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95
    assert "epoch 12: train loss" in result.stderr  # logged per epoch


def test_digits_example_other_schedules_run():
    result = _train("--schedule", "interleaved-1f1b", "--chunks", "2", "--epochs", "1",
                    "--min-accuracy", "0")
    assert result.returncode == 0, result.stderr[-5000:]
    assert "TEST ACCURACY" in result.stdout


def test_digits_example_asynchronous_pipedream_reaches_95_percent():
    result = _train("--schedule", "pipedream")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    accuracy = float(re.search(r"TEST ACCURACY ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95


def test_digits_example_replicas_and_auto_balance():
    result = _train("--schedule", "pipedream", "--replicas", "2,1,1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert float(re.search(r"TEST ACCURACY ([0-9.]+)", result.stdout).group(1)) >= 0.95
    result = _train("--balance", "auto", "--epochs", "2", "--min-accuracy", "0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "speedup over data parallelism" in result.stdout + result.stderr
