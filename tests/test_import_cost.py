"""``import pipedream_ext`` leaves the checkpoint formats' heavy dependencies unloaded.

Every rank of every launch imports the package, and every ``python -m pipedream_ext``
its command line: DCP, DTensor and safetensors come in only with the checkpoint calls
that need them (PEP 562 attributes of the package and of ``_checkpoint``). The check
runs in a fresh interpreter, since this one has them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFERRED = ("torch.distributed.tensor", "torch.distributed.checkpoint", "safetensors")

_PROBE = """
import json, sys
import pipedream_ext as pd
import pipedream_ext.__main__
loaded_at_import = [m for m in {deferred!r} if m in sys.modules]
calls = [pd.save_checkpoint, pd.load_checkpoint, pd.consolidate, pd.save_pretrained, pd.detect]
print(json.dumps({{"at_import": loaded_at_import,
                   "after_calls": [m for m in {deferred!r} if m in sys.modules],
                   "calls": [c.__module__ + "." + c.__name__ for c in calls],
                   "package_consolidate": pd._checkpoint.consolidate is pd.consolidate}}))
"""


def _probe() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _PROBE.format(deferred=DEFERRED)], env=env,
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_and_cli_defer_checkpoint_dependencies_until_a_checkpoint_call() -> None:
    result = _probe()
    assert result["at_import"] == []
    # Asking for the calls imports them (so the probe above can see a regression).
    assert sorted(result["after_calls"]) == sorted(DEFERRED)
    assert result["calls"] == [
        "pipedream_ext._checkpoint.save.save_checkpoint",
        "pipedream_ext._checkpoint.load.load_checkpoint",
        "pipedream_ext._checkpoint.consolidate.consolidate",
        "pipedream_ext._checkpoint.hf.save.save_pretrained",
        "pipedream_ext._checkpoint.storages.detect",
    ]
    # The function, not the submodule of the same name that importing it bound.
    assert result["package_consolidate"]
