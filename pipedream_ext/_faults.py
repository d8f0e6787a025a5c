"""Names a job's first failure in the errors of the ranks that fail after it.

When a rank dies, only its neighbours in the pipeline see it go ("... with rank 2
failed ... Connection reset by peer"); ranks further away fail later, when their
own neighbour stops, and name that neighbour instead. With
:func:`names_first_failure` on ``PipeDream.step``, ``flush`` and
``forward_only``, every rank whose call fails records its error in the process
group's store (the c10d TCPStore every rank already talks to; under torchrun the
agent's, which outlives the workers), first writer wins, and a rank that is not
the first appends the first one to its message::

    rank 0: RECV_B of microbatch 0 for stage 0 with rank 1 failed ... Connection closed by peer
    first failure in this job (0.1 s earlier): rank 1: RuntimeError: rank 1: RECV_B of
    microbatch 0 for stage 1 with rank 2 failed ... (is rank 2 alive?) ...

``ValueError`` (bad arguments, raised before any communication) is neither
recorded nor annotated, and only errors about a peer (a failed or timed-out
transfer, a closed connection) get the note; SIGTERM / Ctrl-C shutdowns are
recorded ("stopped by SIGINT") so the peers they break say so. A record older than the pipeline's
timeout plus 30 s is stale (a failure the program caught and survived) and is
replaced. Store operations run on a helper thread bounded to a few seconds: a
store that is gone (its host was the lost rank) only means no annotation.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import time
from typing import Any, Callable, Optional, TypeVar

__all__ = ["names_first_failure", "ensure_installed", "KEY"]

#: Store key (under the default group's store prefix, so one per torchrun attempt).
KEY = "pipedream_ext/first_failure"
_STORE_SECONDS = 5.0
_STALE_SLACK = 30.0
_MAX_CHARS = 800
# Errors caused by a peer (the runtime's and Gloo's wording): only these get the note.
_PEER_FAILURE = re.compile(r"failed or timed out|Connection (?:closed|reset) by peer|[Tt]imed out")

F = TypeVar("F", bound=Callable[..., Any])


def _in_thread(fn: Callable[[], Any], seconds: float) -> Optional[Any]:
    """Runs ``fn`` on a daemon thread; its result, or None on error or after ``seconds``."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - the store may be gone with the lost rank
            pass

    thread = threading.Thread(target=run, name="pipedream-first-failure", daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else None


def _describe(exc: BaseException) -> str:
    stopped = getattr(exc, "pipedream_stopped", None)
    if stopped is not None:  # Ctrl-C through pipedream_ext._signals
        return str(stopped)
    if isinstance(exc, SystemExit):
        return f"exited with status {exc.code}" + (" (SIGTERM)" if exc.code == 143 else "")
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS] + " ..."


def _record_and_read(pipe: Any, exc: BaseException) -> Optional[dict]:
    """Records this rank's failure unless one is recorded; returns another rank's
    fresh first failure, or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    rank = dist.get_rank()
    now = time.time()
    mine = json.dumps({"rank": rank, "time": now, "error": _describe(exc)})
    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor
    current = _in_thread(lambda: store.compare_set(KEY, "", mine), _STORE_SECONDS)
    if current is None:
        return None
    current = current.decode() if isinstance(current, bytes) else str(current)
    if current == mine:
        return None
    try:
        first = json.loads(current)
        age = now - float(first["time"])
        first_rank = int(first["rank"])
    except (ValueError, KeyError, TypeError):
        return None
    if age > float(getattr(pipe, "timeout", 300.0)) + _STALE_SLACK:
        _in_thread(lambda: store.compare_set(KEY, current, mine), _STORE_SECONDS)
        return None
    if first_rank == rank:
        return None
    first["age"] = max(age, 0.0)
    return first


def _report(pipe: Any, exc: BaseException) -> None:
    if getattr(exc, "_pipedream_first_failure_seen", False):
        return
    try:
        exc._pipedream_first_failure_seen = True  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - exceptions without __dict__
        return
    try:
        first = _record_and_read(pipe, exc)
    except Exception:  # noqa: BLE001 - reporting must never hide the real error
        return
    if first is None or not isinstance(exc, Exception) or not exc.args:
        return
    message = str(exc.args[0])
    if not _PEER_FAILURE.search(message):  # a local error (the same on every rank, say)
        return
    note = (f"first failure in this job ({first['age']:.1f} s earlier): rank {first['rank']}: "
            f"{first['error']}")
    if first["error"] in message:
        return
    exc.args = (f"{message}\n{note}",) + tuple(exc.args[1:])


def names_first_failure(method: F) -> F:
    """Decorates a ``PipeDream`` method: a failure is recorded in the store and, if
    another rank failed first, its error is appended to this one's message (same
    exception object, same type)."""
    if getattr(method, "_pipedream_names_first_failure", False):
        return method

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except ValueError:
            raise
        except BaseException as exc:
            _report(self, exc)
            raise

    wrapper._pipedream_names_first_failure = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def ensure_installed(cls: type) -> bool:
    """Applies :func:`names_first_failure` to ``cls.step``, ``flush`` and
    ``forward_only`` unless they have it. Returns True if anything changed."""
    changed = False
    for name in ("step", "flush", "forward_only"):
        method = getattr(cls, name)
        if not getattr(method, "_pipedream_names_first_failure", False):
            setattr(cls, name, names_first_failure(method))
            changed = True
    return changed
