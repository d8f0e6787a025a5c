"""Every collective the Python layer runs follows the one device rule (CPU, Gloo, 3 ranks).

A GPU job's default group is ``cpu:gloo,cuda:nccl`` and a user's may be NCCL
only: a collective on a tensor whose device the group has no backend for fails
there ("No backend type associated with device type cpu"), and only there. To
catch that class of bug on a machine without a GPU, the workers wrap
torch.distributed's collectives and reject, while the library trains, saves,
traces and evaluates:

* a collective called from a ``pipedream_ext`` module other than
  ``_collectives`` (the one home of the device rule, whose choice of device for a
  CUDA-only group is tested in tests/test_collectives.py);
* a tensor on a device type the group has no backend for;
* object (pickling) collectives from the library.

    torchrun --standalone --nproc-per-node 3 tests/test_device_rule.py
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main

_GUARDED = ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce", "send",
            "recv", "isend", "irecv", "barrier", "monitored_barrier", "all_gather_into_tensor",
            "reduce_scatter_tensor", "all_to_all", "all_to_all_single")
_OBJECT = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
           "send_object_list", "recv_object_list")


def _library_caller() -> str:
    """The module of the first frame outside torch (``""`` if it is not ours)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "torch" or module.startswith("torch.")) and module != __name__:
            return module if module.startswith("pipedream_ext") else ""
        frame = frame.f_back
    return ""


def _tensors(values: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def install_guard(violations: List[str]) -> None:
    """Wraps torch.distributed's collectives to record every breach of the rule."""
    def wrap(name: str, original: Any, objects: bool) -> Any:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            caller = _library_caller()
            if caller and objects:
                violations.append(f"{caller} pickles through dist.{name}")
            elif caller and caller != "pipedream_ext._dist.collectives":
                violations.append(f"{caller} calls dist.{name} around the device rule")
            group = kwargs.get("group") or dist.group.WORLD
            backends = {t.type if isinstance(t, torch.device) else str(t)
                        for t in group._device_types}
            for t in _tensors(list(args) + list(kwargs.values())):
                if t.device.type not in backends:
                    violations.append(f"dist.{name} from {caller or 'outside'} on a "
                                      f"{t.device.type} tensor; the group has {sorted(backends)}")
            return original(*args, **kwargs)
        return guarded

    for name in _GUARDED + _OBJECT:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name), name in _OBJECT))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                         nn.Linear(8, 3))


def check_library_collectives() -> None:
    import pipedream_ext as pd

    violations: List[str] = []
    install_guard(violations)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    directory = os.environ["DEVRULE_DIR"]
    # Planning at start-up (bandwidth probe, plan broadcast), the config check, the
    # loss all-reduce, finite checks, trace gathering, checkpoints and evaluation.
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=3,
                        balance="auto", sample=(x, y), check_finite="raise",
                        trace=os.path.join(directory, "trace.json"), timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1) if any(True for _ in pipe.parameters()) \
        else None
    for _ in range(2):
        pipe.step(x, y)
        if opt is not None:
            opt.step()
            opt.zero_grad()
    pd.save_checkpoint(os.path.join(directory, "ckpt"), pipe, opt, step=2)
    pd.load_checkpoint(os.path.join(directory, "ckpt"), pipe, opt)
    pipe.eval()
    pipe.forward_only(x)
    pipe.close()
    # An asynchronous pipeline whose replicated last stage all-reduces the batch loss.
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="pipedream-2bw",
                        microbatches=4, replicas=[1, 2], balance=[3, 2], timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        pipe.step(x, y, optimizer=opt)
    pipe.flush()
    pipe.forward_only(x)
    assert not violations, "\n".join(violations)
    # The guard itself bites: a CPU-tensor collective from the library is caught.
    import pipedream_ext._runtime.observe as _observe
    exec("import torch.distributed as dist\ndist.all_reduce(__import__('torch').zeros(1))",
         vars(_observe))
    assert violations == ["pipedream_ext._runtime.observe calls dist.all_reduce around the device rule"], \
        violations


def device_rule_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(check_library_collectives)
    return cases


LAUNCH = Launch(os.path.abspath(__file__), 3, device_rule_cases, timeout=300, dirs=("DEVRULE_DIR",))


@parametrize_cases(LAUNCH)
def test_library_collectives_follow_the_device_rule(case: CaseRef) -> None:
    case.check()


if __name__ == "__main__":
    worker_main([LAUNCH])
