"""The runtime on a CUDA device (skipped without a GPU).

One GPU cannot hold two NCCL ranks, so on one GPU these run:

* 2 ranks on the same GPU, Gloo carrying CUDA tensors (staged through pinned
  host memory): every flush schedule equals the unsplit model on the GPU (loss
  and weights after SGD-momentum and Adam steps), recompute with dropout is
  bit-identical (the CUDA RNG state is restored), bf16 autocast sends bf16,
  ``pipedream`` trains and flushes, a checkpoint round trip restores the weights,
  and ``stats()`` reports CUDA memory;
* the same over the split protocol (``PIPEDREAM_P2P_PROTOCOL=split``: metadata on
  the side group, the tensors alone on the data channel), which NCCL groups use;
* 1 rank with ``cpu:gloo,cuda:nccl`` (the group PipeDream creates on GPUs):
  interleaved chunks on that rank, metadata collectives on the CPU, the split
  protocol chosen for the NCCL data channel, equal to the unsplit model;
* the main job (examples/train_digits.py) on the GPU: one NCCL rank holding 4 stages,
  and 2 ranks over Gloo carrying CUDA tensors.

Several NCCL ranks need one GPU each; that is not run here (the ``nccl_rules``
backend proves the protocol under NCCL's rules on the CPU: tests/test_nccl_rules.py).

    torchrun --standalone --nproc-per-node 2 tests/test_gpu.py
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, Launch, parametrize_cases, worker_main

RTOL, ATOL = 1e-5, 1e-6
FLUSH = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16),
                         nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 6, generator=g).to(device),
            torch.randint(0, 3, (8,), generator=g).to(device))


def check_flush_equals_unsplit(schedule: str, device: torch.device, optimizer: str,
                               overlap: bool = False) -> None:
    import pipedream_ext as pd

    chunks = 2 if pd.schedules.traits(schedule).multi_chunk else 1
    ref = make_model().to(device)
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule=schedule, microbatches=4,
                        chunks=chunks, device=device, timeout=120, overlap=overlap)
    expected = os.environ.get("PIPEDREAM_P2P_PROTOCOL") or (
        "split" if "nccl" in str(dist.get_backend()) else "fused")
    assert pipe._runner.executor.protocol == expected, pipe._runner.executor.protocol
    make_opt = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if optimizer == "sgd" \
        else (lambda ps: torch.optim.Adam(ps, lr=0.01))
    ref_opt, opt = make_opt(ref.parameters()), make_opt(pipe.parameters())
    for step in range(4):
        x, y = batch(step, device)
        loss = pipe.step(x, y)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(torch.tensor(float(loss), dtype=torch.float64),
                                   ref_loss.detach().cpu().double(),
                                   rtol=RTOL, atol=ATOL)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    reference = ref.state_dict()
    for name, value in pipe.state_dict().items():
        assert value.device.type == "cuda", (name, value.device)
        torch.testing.assert_close(value, reference[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{schedule} {optimizer} {name}: {m}")


def check_recompute_restores_cuda_rng(device: torch.device) -> None:
    import pipedream_ext as pd

    weights = []
    for recompute in (False, True):
        torch.cuda.manual_seed(7)
        pipe = pd.PipeDream(make_model(dropout=0.5), F.cross_entropy, schedule="1f1b",
                            microbatches=4, device=device, recompute=recompute, timeout=120)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for step in range(3):
            pipe.step(*batch(step, device))
            opt.step()
            opt.zero_grad()
        weights.append({k: v.clone() for k, v in pipe.state_dict().items()})
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def check_bf16_and_stats(device: torch.device) -> None:
    import pipedream_ext as pd

    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="1f1b", microbatches=4,
                        device=device, autocast=torch.bfloat16, timeout=120)
    loss = pipe.step(*batch(0, device))
    assert loss == loss, loss  # finite
    stats = pipe.stats()
    assert stats["cuda_peak_memory_allocated"] >= stats["cuda_memory_allocated"] > 0, stats
    assert stats["bytes_sent"] > 0, stats
    # Gloo carries CUDA tensors through pinned host buffers: one device-to-host copy per
    # tensor sent (one per transfer here), none on the receive side.
    assert stats["host_syncs"] == stats["sends"] > 0, stats


def check_async_and_checkpoint(device: torch.device, directory: str) -> None:
    import pipedream_ext as pd

    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule="pipedream", microbatches=1,
                        device=device, timeout=120)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for step in range(6):
        pipe.step(*batch(step, device), optimizer=opt)
    pipe.flush()
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    pd.save_checkpoint(directory, pipe, opt, step=6)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    pd.load_checkpoint(directory, pipe, opt)
    for name, value in pipe.state_dict().items():
        assert value.device.type == "cuda" and torch.equal(value, saved[name]), name
    full = pd.consolidate(directory)
    unsplit = copy.deepcopy(make_model())
    unsplit.load_state_dict(full)


def cuda0() -> torch.device:
    """The GPU, TF32 off (the pipeline is compared with the unsplit model)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)


def check_flush_on_the_gpu(schedule: str, optimizer: str, protocol: str = "", overlap: bool = False) -> None:
    if protocol:
        os.environ["PIPEDREAM_P2P_PROTOCOL"] = protocol
    try:
        check_flush_equals_unsplit(schedule, cuda0(), optimizer, overlap)
    finally:
        os.environ.pop("PIPEDREAM_P2P_PROTOCOL", None)


def gpu_directory() -> str:
    """Every rank must see the same directory (the pytest side makes one)."""
    return os.environ.get("PDGPU_DIR") or os.path.join(
        tempfile.gettempdir(), f"pipedream_gpu_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")


def gloo_cases(world: int) -> Cases:
    cases = Cases()
    for schedule in FLUSH:
        for optimizer in ("sgd", "adam"):
            cases.add(check_flush_on_the_gpu, schedule, optimizer)
    for schedule in ("1f1b", "zbv"):
        cases.add(check_flush_on_the_gpu, schedule, "adam", protocol="split")  # what NCCL groups speak
    # dualpipev's F&B pairs overlapped: the forward on a second thread, on the caller's stream
    cases.add(check_flush_on_the_gpu, "dualpipev", "adam", overlap=True)
    cases.add(lambda: check_recompute_restores_cuda_rng(cuda0()), name="recompute_restores_cuda_rng")
    cases.add(lambda: check_bf16_and_stats(cuda0()), name="bf16_and_stats")
    cases.add(lambda: check_async_and_checkpoint(cuda0(), os.path.join(gpu_directory(), "ckpt")),
              name="async_and_checkpoint")
    return cases


def check_pipedream_made_an_nccl_group() -> None:
    assert "nccl" in str(dist.get_backend()), dist.get_backend()


def nccl_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(check_flush_on_the_gpu, "interleaved-1f1b", "adam")
    cases.add(check_flush_on_the_gpu, "1f1b", "sgd")
    cases.add(check_flush_on_the_gpu, "dualpipev", "adam", overlap=True)
    cases.add(check_pipedream_made_an_nccl_group)
    return cases


# PipeDream creates the default group itself (cpu:gloo,cuda:nccl on a GPU) for the NCCL
# run; the Gloo run creates a Gloo group first, which PipeDream then uses.
GLOO = Launch(os.path.abspath(__file__), 2, gloo_cases, name="gloo", dirs=("PDGPU_DIR",))
NCCL = Launch(os.path.abspath(__file__), 1, nccl_cases, name="nccl", init_group=False)


@needs_gpu
@parametrize_cases(GLOO)
def test_gloo_ranks_carry_cuda_tensors(case: CaseRef) -> None:
    case.check()


@needs_gpu
@parametrize_cases(NCCL)
def test_one_nccl_rank_with_interleaved_chunks(case: CaseRef) -> None:
    case.check()


DIGITS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                      "train_digits.py")


@needs_gpu
@pytest.mark.parametrize("world, args", [
    (1, ["--schedule", "interleaved-1f1b", "--chunks", "4"]),       # one NCCL rank, 4 stages
    (2, ["--backend", "gloo", "--device", "cuda:0", "--schedule", "zbv", "--chunks", "2"]),
])
def test_digits_example_trains_on_the_gpu(world: int, args: list) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(DIGITS) + "/.." + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={world}", DIGITS, "--epochs", "8",
                             "--min-accuracy", "0.9", *args],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TEST ACCURACY" in result.stdout, result.stdout[-2000:]


if __name__ == "__main__":
    worker_main([GLOO, NCCL])
