"""tests/_multiprocess.py: each case of a launch passes or fails under its own pytest id.

Two real 2-rank launches of a small script (written here): a case broken on rank 1
fails alone with rank 1's message while the cases before and after it pass; a rank
that dies in a case fails that case and the ones it never started with the launch's
output, and the launch's exit status. Case names from the arguments.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from types import ModuleType

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import EXIT_CASE, Cases, FromEnv

SCRIPT = '''
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, {tests!r})
from _multiprocess import Cases, Launch, worker_main


def check_sum() -> None:
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size(), total


def check_broken_on_rank_1() -> None:
    assert dist.get_rank() != 1, "broken on rank 1 only"


def check_rank_0_dies() -> None:
    if dist.get_rank() == 0:
        os._exit(3)


def _between_sums(check: Callable[[], None]) -> Cases:
    """``check`` as a case between two passing ones ("before", "after")."""
    cases = Cases()
    cases.add(check_sum, name="before")
    cases.add(check)
    cases.add(check_sum, name="after")
    return cases


def broken_cases(world: int) -> Cases:
    return _between_sums(check_broken_on_rank_1)


def dying_cases(world: int) -> Cases:
    return _between_sums(check_rank_0_dies)


BROKEN = Launch(__file__, 2, broken_cases, name="broken", timeout=300)
DYING = Launch(__file__, 2, dying_cases, name="dying", timeout=300)

if __name__ == "__main__":
    worker_main([BROKEN, DYING])
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    path = tmp_path_factory.mktemp("cases") / "cases_script.py"
    path.write_text(textwrap.dedent(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))))
    spec = importlib.util.spec_from_file_location("cases_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def failure(result, case: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(pytest.fail.Exception) as info:
        result.check(case)
    return str(info.value)


def test_a_broken_case_fails_alone_with_its_ranks_message(script: ModuleType) -> None:
    result = script.BROKEN.result()
    result.check("before")
    result.check("after")
    result.check(EXIT_CASE)
    message = failure(result, "broken_on_rank_1")
    assert "rank 1 failed case 'broken_on_rank_1'" in message, message
    assert "AssertionError: broken on rank 1 only" in message, message
    assert "rank 0" not in message, message


def test_a_rank_that_dies_fails_its_case_the_cases_left_and_the_exit_status(script: ModuleType) -> None:
    result = script.DYING.result()
    result.check("before")
    message = failure(result, "rank_0_dies")
    assert "rank 0 started case 'rank_0_dies' and gave no result" in message, message
    assert "exited with status" in message and "its output's tail" in message, message
    assert "rank 0 never started case 'after'" in failure(result, "after")
    assert "exited with status" in failure(result, EXIT_CASE)


def test_case_names_come_from_the_function_and_its_arguments() -> None:
    def check_flush(schedule: str, root: str, balance: list) -> None:
        pass

    cases = Cases()
    cases.add(check_flush, "1f1b", FromEnv("ROOT_DIR"), balance=[3, 5])
    cases.add(check_flush, "1f1b", FromEnv("ROOT_DIR"), balance=[3, 5], name="again")
    assert cases.names() == ["flush-1f1b-balance=[3,5]", "again"]
    with pytest.raises(ValueError, match="case 'again' twice in one launch"):
        cases.add(check_flush, "gpipe", "x", [1], name="again")
