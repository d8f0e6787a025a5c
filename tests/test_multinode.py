"""Multi-node for real: 2 hosts as network namespaces joined by veth links to a bridge
(benchmarks/_netns.py), `torchrun --nnodes 2 --nproc-per-node 2` with c10d
rendezvous on the first host's address, the digits CNN trained with a hybrid plan
that spans both hosts (stage 0 replicated on host 0's two ranks, stages 1 and 2 on
host 1), and the final weights compared with the same job run on one host, and
with the unsplit model trained in one process.

Needs root and iproute2 (CI runs as root); skips with the reason where network
namespaces cannot be made.

The worker side (`python tests/test_multinode.py OUT_DIR` under torchrun) is in
this file too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Dict, List

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

REPLICAS = [2, 1, 1]
BALANCE = [3, 4, 3]
STEPS, BATCH, MICROBATCHES = 6, 64, 4
MARKER = "MULTINODE WORKER DONE"


# --------------------------------------------------------------------------- worker
def reference_weights() -> Dict[str, torch.Tensor]:
    """The unsplit model trained in one process on the same batches."""
    import torch.nn.functional as F
    from train_digits import make_model as build_model

    model = build_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
        opt.step(); opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def batches() -> List:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(STEPS)]


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from train_digits import make_model as build_model

    import pipedream_ext as pd

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pipe = pd.PipeDream(build_model(seed=0), F.cross_entropy, schedule="1f1b",
                        microbatches=MICROBATCHES, balance=BALANCE, replicas=REPLICAS, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches():
        pipe.step(x, y)
        opt.step(); opt.zero_grad()
    expected = reference_weights()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {pipe.rank} {name}: {m}")
    rank = dist.get_rank()
    torch.save(pipe.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    host = os.environ.get("PD_TEST_HOST", "local")
    print(f"rank {rank} on host {host} ({os.uname().nodename}): {MARKER}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- pytest
def _torchrun(args: List[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, os.path.abspath(__file__)]


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra,
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _load_all(out_dir: str) -> Dict[str, torch.Tensor]:
    merged: Dict[str, torch.Tensor] = {}
    for rank in range(4):
        merged.update({f"{rank}:{k}": v for k, v in
                       torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=True).items()})
    return merged


def test_two_hosts_hybrid_plan_equals_a_single_host_run(tmp_path) -> None:
    from _netns import NetnsCluster, missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        pytest.skip(f"network namespaces need {', '.join(missing)}")
    cluster = NetnsCluster(hosts=2, prefix="pdmn", subnet="10.79.0")
    try:
        cluster.up()
    except Exception as exc:  # noqa: BLE001 - any failure to build namespaces means skip
        cluster.down()
        pytest.skip(f"cannot create network namespaces here: {exc}")
    multi, single = tmp_path / "multi", tmp_path / "single"
    multi.mkdir(); single.mkdir()
    try:
        endpoint = f"{cluster.hosts[0].address}:29731"
        rdzv = uuid.uuid4().hex[:8]
        procs = []
        for k, host in enumerate(cluster.hosts):
            cmd = cluster.exec_prefix(k) + _torchrun(
                ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(k),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv,
                 # Host 0 holds the c10d store; every agent advertises its own address
                 # (its hostname is not resolvable from the other namespace).
                 "--rdzv-conf", f"is_host={'true' if k == 0 else 'false'},join_timeout=90",
                 "--local-addr", host.address, "--max-restarts", "0"]) + [str(multi)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True,
                                          env=_env(GLOO_SOCKET_IFNAME=host.ifname,
                                                   PD_TEST_HOST=host.address)))
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=240))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        for p, (out, err) in zip(procs, outputs):
            assert p.returncode == 0, out[-3000:] + err[-6000:]
        text = "".join(out for out, _ in outputs)
        assert text.count(MARKER) == 4, text
        # Ranks 0, 1 (stage 0's replicas) ran on host 0, ranks 2, 3 on host 1.
        for rank, host in ((0, 0), (1, 0), (2, 1), (3, 1)):
            assert f"rank {rank} on host {cluster.hosts[host].address}" in text, text
    finally:
        cluster.down()

    result = subprocess.run(_torchrun(["--standalone", "--nproc-per-node", "4"]) + [str(single)],
                            capture_output=True, text=True, timeout=240, env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    a, b = _load_all(str(multi)), _load_all(str(single))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=0, msg=lambda m: f"{key}: {m}")


if __name__ == "__main__":
    worker(sys.argv[1])
