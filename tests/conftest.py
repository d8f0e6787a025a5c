"""Test selection: tests marked ``slow`` run only under `make test-all`.

`make test` (CI, a fresh clone, under 25 minutes is the aim) runs everything else;
`make test-all` sets ``PIPEDREAM_TEST_ALL=1`` and runs the slow ones too, each a
repeat in kind of something `make test` runs (docs/testing.md, "What only `make
test-all` runs"). With ``--durations``, the summary also lists the slowest launches.
``group``: a 1-rank Gloo group for the tests of one process.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, List

import pytest
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if os.environ.get("PIPEDREAM_TEST_ALL") == "1":
        return
    skip = pytest.mark.skip(reason="slow: runs under `make test-all` (PIPEDREAM_TEST_ALL=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The slowest launches of tests/_multiprocess.py with their slowest cases: pytest's
    --durations charges a whole launch to whichever of its ids ran first."""
    from _multiprocess import FINISHED

    if not FINISHED or terminalreporter.config.getoption("durations") is None:
        return
    terminalreporter.write_sep("=", "slowest launches (start-up included) and their slowest cases")
    for result in sorted(FINISHED, key=lambda r: -r.seconds)[:25]:
        cases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in result.slowest_cases(3))
        terminalreporter.write_line(f"{result.seconds:6.1f}s {os.path.basename(result.launch.script)} "
                                    f"{result.launch.name}: {cases}")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    """The default group, 1 rank, Gloo; destroyed afterwards so that later tests in this
    process still see no process group."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
