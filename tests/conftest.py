"""Test selection: tests marked ``slow`` run only under `make test-all`.

`make test` (CI, a fresh clone, under 30 minutes) runs everything else; `make
test-all` sets ``PIPEDREAM_TEST_ALL=1`` and runs the slow ones too (the whole
transformers zoo of tests/test_zoo.py).
"""
from __future__ import annotations

import os
from typing import List

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if os.environ.get("PIPEDREAM_TEST_ALL") == "1":
        return
    skip = pytest.mark.skip(reason="slow: runs under `make test-all` (PIPEDREAM_TEST_ALL=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
