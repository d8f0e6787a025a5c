"""The Python layer's small collectives (pipedream_ext/_dist/collectives.py) and the
checkpoint exchange built on them, in this process on a 1-rank Gloo group.

Several ranks exchanging real payloads are covered by tests/test_checkpoint.py,
whose saves and loads go through ``collectives.gather_outcomes``.
"""
from __future__ import annotations

import datetime
import json
import types
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

import pipedream_ext._dist.collectives as _collectives
from pipedream_ext._checkpoint import CheckpointError


def _fake_group(*device_types: Any) -> Any:
    return types.SimpleNamespace(_device_types=list(device_types))


def test_metadata_device_prefers_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert _collectives.metadata_device(_fake_group(torch.device("cuda"), cpu)) == cpu
    assert _collectives.metadata_device(_fake_group("cpu")) == cpu


def test_metadata_device_cuda_only_group_uses_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _collectives.metadata_device(_fake_group(torch.device("cuda"))) == torch.device("cuda", 3)


def test_metadata_device_rejects_a_group_without_cpu_or_cuda() -> None:
    with pytest.raises(RuntimeError, match=r"no CPU or CUDA backend \(device types \['meta'\]\)"):
        _collectives.metadata_device(_fake_group(torch.device("meta")))


def test_metadata_device_of_a_gloo_group(group: dist.ProcessGroup) -> None:
    assert _collectives.metadata_device(group) == torch.device("cpu")
    assert _collectives.metadata_device() == torch.device("cpu")  # the default group
    assert _collectives.metadata_device(dist.new_group([0])) == torch.device("cpu")


def test_all_reduce(group: dist.ProcessGroup) -> None:
    assert _collectives.all_reduce([1.5, -2.0], group) == [1.5, -2.0]
    assert _collectives.all_reduce([7, 3], group, op=dist.ReduceOp.MAX, dtype=torch.int64) == [7, 3]
    assert _collectives.all_reduce([2 ** 53 + 1], group, dtype=torch.int64) == [2 ** 53 + 1]


@pytest.mark.parametrize("payload", [b"", b"plan", bytes(range(256)) * 3, "é\x00".encode()])
def test_broadcast_and_gather_bytes(group: dist.ProcessGroup, payload: bytes) -> None:
    assert _collectives.broadcast_bytes(payload, 0, group) == payload
    assert _collectives.gather_bytes(payload, group) == [payload]
    sub = dist.new_group([0])
    assert _collectives.broadcast_bytes(payload, 0, sub) == payload
    assert _collectives.gather_bytes(payload, sub) == [payload]


def test_broadcast_bytes_without_payload(group: dist.ProcessGroup) -> None:
    assert _collectives.broadcast_bytes(None, 0, group) == b""


def test_all_gather_json(group: dist.ProcessGroup) -> None:
    payload = {"error": None, "stages": [{"layers": [0, 3], "ranks": [0]}], "x": 1.5, "s": "é"}
    assert _collectives.all_gather_json(payload, group) == [payload]
    result = _collectives.all_gather_json({"t": (1, 2)}, group)
    assert result == [{"t": [1, 2]}]  # what a JSON round trip gives, as with several ranks
    with pytest.raises(TypeError):
        _collectives.all_gather_json({"bad": object()}, group)


def test_broadcast_data_refuses_a_device_without_backend(group: dist.ProcessGroup) -> None:
    t = torch.arange(3.0)
    _collectives.broadcast_data(t, 0, group)  # one rank: unchanged
    assert torch.equal(t, torch.arange(3.0))
    with pytest.raises(ValueError, match="has no backend for meta tensors"):
        _collectives.broadcast_data(torch.zeros(2, device="meta"), 0, group)


def test_barrier_on_gloo_is_monitored(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[dict] = []
    real = dist.monitored_barrier

    def spy(**kwargs: Any) -> None:
        calls.append(kwargs)
        real(**kwargs)

    monkeypatch.setattr(_collectives.dist, "monitored_barrier", spy)
    _collectives.barrier(group, 2.5)
    assert calls == [{"group": group, "timeout": datetime.timedelta(seconds=2.5), "wait_all_ranks": True}]


def _exchange(group: dist.ProcessGroup, what: str) -> List[Any]:
    """The exchange a checkpoint save or load runs (no rank failed, payload None)."""
    return _collectives.gather_outcomes(None, group, 5.0, what, failure=CheckpointError)


def _as_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange sees a pipeline of 2 ranks (the group here has 1)."""
    monkeypatch.setattr(_collectives.dist, "get_world_size", lambda group=None: 2)


def test_checkpoint_exchange_goes_through_collectives(group: dist.ProcessGroup,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[str] = []
    real_barrier = _collectives.barrier

    def barrier(g: dist.ProcessGroup, timeout: float) -> None:
        calls.append(f"barrier {timeout}")
        real_barrier(g, timeout)

    def all_gather_json(payload: Any, g: dist.ProcessGroup) -> List[Any]:
        calls.append("all_gather_json")
        return [json.loads(json.dumps(payload))]  # the group's one rank

    monkeypatch.setattr(_collectives, "barrier", barrier)
    monkeypatch.setattr(_collectives, "all_gather_json", all_gather_json)
    # world_size 1: no collective at all, as a 1-rank pipeline has no peer to wait for.
    assert _exchange(group, "saving") == [None]
    assert calls == []
    # A pipeline of several ranks: the barrier first, then the gather.
    _as_two_ranks(monkeypatch)
    assert _exchange(group, "saving") == [None]
    assert calls == ["barrier 5.0", "all_gather_json"]


def test_checkpoint_exchange_wraps_failures(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    def stuck(g: dist.ProcessGroup, timeout: float) -> None:
        raise RuntimeError("Rank 1 failed to pass monitoredBarrier in 5000 ms")

    monkeypatch.setattr(_collectives, "barrier", stuck)
    _as_two_ranks(monkeypatch)
    with pytest.raises(CheckpointError, match=r"^rank 0: saving checkpoint /x: waiting for the other ranks "
                       r"failed: RuntimeError: Rank 1 failed to pass monitoredBarrier") as info:
        _exchange(group, "saving checkpoint /x")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_failures_keep_their_message_or_name_their_type(group: dist.ProcessGroup) -> None:
    # Bad input and the caller's own failure type say what failed; anything else is named.
    assert _collectives.failure_entry(None) is None
    assert _collectives.failure_entry(ValueError("bad step")) == {"value": True, "message": "bad step"}
    assert _collectives.failure_entry(CheckpointError("x.pt is corrupt"), CheckpointError) == \
        {"value": False, "message": "x.pt is corrupt"}
    assert _collectives.failure_entry(OSError("disk full"), CheckpointError) == \
        {"value": False, "message": "OSError: disk full"}
    assert _collectives.failure_entry(RuntimeError("boom")) == {"value": False, "message": "RuntimeError: boom"}
    with pytest.raises(ValueError, match=r"^saving failed on rank 0: bad step$"):
        _collectives.gather_outcomes(ValueError("bad step"), group, 5.0, "saving", failure=CheckpointError)
    with pytest.raises(CheckpointError, match=r"^saving failed on rank 0: OSError: disk full$"):
        _collectives.gather_outcomes(OSError("disk full"), group, 5.0, "saving", failure=CheckpointError)
    assert _collectives.gather_outcomes(None, group, 5.0, "saving", payload={"generation": 3}) == \
        [{"generation": 3}]
