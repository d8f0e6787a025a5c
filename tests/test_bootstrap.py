""".ci/bootstrap.sh (what `make test` and `make run` run first) fails loudly: a failed
pip install stops it with pip's message, and so does a python that imports another
checkout's pipedream_ext. Runs the script with a stand-in python whose ``-m pip``
only prints and exits as told (nothing is installed), everything else the real one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "bootstrap.sh"


def _fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then\n'
                    '  echo "$FAKE_PIP_OUTPUT"; exit "${FAKE_PIP_STATUS:-0}"\n'
                    "fi\n"
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    if not os.path.exists("/usr/include/gtest/gtest.h") or shutil.which("cmake") is None:
        pytest.skip("bootstrap.sh would install GoogleTest and cmake with apt-get first")
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full.update(PYTHON=str(_fake_python(tmp_path)), **env)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full,
                          timeout=300)


def test_a_failed_pip_install_stops_the_bootstrap(tmp_path: Path) -> None:
    result = _run(tmp_path, FAKE_PIP_STATUS="1", FAKE_PIP_OUTPUT="ERROR: no matching distribution")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR: no matching distribution" in result.stderr
    assert "[bootstrap] pip install ninja pytest" in result.stderr and \
        "failed (exit status 1)" in result.stderr, result.stderr


def test_another_checkouts_pipedream_ext_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other" / "pipedream_ext"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    result = _run(tmp_path, PYTHONPATH=str(other.parent))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"imports pipedream_ext from {other / '__init__.py'}, not from this checkout " \
           f"({ROOT / 'pipedream_ext' / '__init__.py'})" in result.stderr, result.stderr
