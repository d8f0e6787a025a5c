"""Names the lost rank, and the job's first failure, in every rank's error.

When a rank dies, only some ranks see it directly, and not always by name: its
pipeline neighbours' transfers fail naming it ("... with rank 2 failed ...
Connection reset by peer"), ranks further away fail later naming their own
neighbour, and a rank inside a collective (the batch-loss all-reduce of the flush
schedules, a checkpoint's exchange) gets Gloo's message, which names an address,
not a rank. :func:`names_first_failure`, on ``PipeDream.step``, ``flush`` and
``forward_only``, adds two notes to an error about a peer::

    rank 0: RECV_B of microbatch 0 for stage 0 with rank 1 failed ... Connection closed by peer
    lost rank 2: no heartbeat for 3 s and no error reported (killed, crashed or hung)
    first failure in this job (0.1 s earlier): rank 1: RuntimeError: rank 1: RECV_B of
    microbatch 0 for stage 1 with rank 2 failed ... (is rank 2 alive?) ...

Both come from the process group's store (the c10d TCPStore every rank already
talks to; under torchrun the agent's, which outlives the workers), under a
per-attempt prefix:

* **heartbeats**: from its first pipeline call on, every rank increments a
  counter every 0.5 s from a daemon thread, which also reads every rank's
  counter and the list of ranks that reported an error, keeping the view in
  the process (so a rank that fails after the store is gone, as when the lost
  rank or rank 0 hosted it, still knows). A rank whose counter stood still for
  3 s and that reported no error is lost; a failing rank waits up to that long
  for the verdict. Counters, not clocks, decide, so hosts need not agree on the
  time. A rank blocked in a wait still beats: it is not reported. The thread
  stops at exit (before the interpreter shuts down) and at the first store error;
* **first failure**: every failing rank records its error (first writer wins);
  a rank that is not the first appends it;
* **calls**: every rank's pipeline calls as it makes them (``step()`` number
  ``k``, between calls, exited; and asynchronous minibatches left unflushed),
  published by the heartbeat thread when they change (the main thread never
  touches the store for it). A rank whose transfer fails compares its call
  with its peers': a peer between calls, in another call, or exited is named
  ("rank 0 is not in a pipeline call: it has made 3 step() calls; this rank is
  in step() number 3"), so an extra call on one rank names that rank, not the
  peer it waited for.

Every failure is recorded (a one-sided ``ValueError``, such as missing targets,
becomes the first failure its peers name), but only errors about a peer (a
failed or timed-out transfer, a closed connection) get notes, and only they wait
for the verdict. SIGTERM / Ctrl-C shutdowns are recorded too ("stopped by
SIGINT"): a rank that stopped that way is not lost. A
first-failure record older than the pipeline's timeout plus 30 s is stale (a
failure the program caught and survived) and is replaced. A failing rank first
waits for one fresh read of the store (half a second); if the store is gone (its
host exited: rank 0 of a job launched without torchrun), it uses its last view
and leaves the store alone (each failed store call makes torch print a warning
with a C++ stack; the heartbeat thread's is the only one). Store calls run on a
helper thread bounded to 5 s.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TypeVar

import torch.distributed as dist

__all__ = ["names_first_failure", "watch_unflushed", "BEAT_SECONDS", "SILENCE_SECONDS"]

#: Seconds between two heartbeats of a rank.
BEAT_SECONDS = 0.5
#: A rank whose heartbeat stood still this long (and that reported no error) is lost.
SILENCE_SECONDS = 3.0
_STORE_SECONDS = 5.0
_STALE_SLACK = 30.0
_MAX_CHARS = 800
# Errors caused by a peer (the runtime's and Gloo's wording): only these get notes.
_PEER_FAILURE = re.compile(r"failed or timed out|Connection (?:closed|reset) by peer|[Tt]imed out")

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_heartbeat: Dict[str, Any] = {"monitor": None}


def _prefix() -> str:
    return f"pipedream_ext/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor


def _in_thread(fn: Callable[[], Any], seconds: float) -> Optional[Any]:
    """Runs ``fn`` on a daemon thread; its result, or None on error or after ``seconds``."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - the store may be gone with the lost rank
            pass

    thread = threading.Thread(target=run, name="pipedream-faults", daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else None


class _Monitor:
    """This rank's heartbeat, and its view of the pipeline's heartbeats and failures."""

    def __init__(self, rank: int, ranks: List[int]) -> None:
        self.store, self.prefix, self.rank = _store(), _prefix(), rank
        self.ranks = sorted(set(ranks) | {rank})
        self.stop = threading.Event()
        self.store_ok = True
        self.store_lost_at = 0.0
        self.rounds = 0  # completed reads of the store
        self.first = ""  # the job's first-failure record, as last read
        self._view_lock = threading.Condition()
        now = time.monotonic()
        self.counts = {r: 0 for r in self.ranks}
        self.changed = {r: now for r in self.ranks}  # when each counter last moved
        self.failed: set = set()
        #: Every rank's last published call status (``_Calls.status``), by rank.
        self.statuses: Dict[int, dict] = {}
        self.published = ""
        self.thread = threading.Thread(target=self._run, name="pipedream-heartbeat", daemon=True)

    def key(self, rank: int) -> str:
        return f"{self.prefix}/beat/{rank}"

    def status_key(self, rank: int) -> str:
        return f"{self.prefix}/calls/{rank}"

    def publish(self) -> None:
        """Writes this rank's call status if it changed (heartbeat thread, and at exit)."""
        text = json.dumps(_calls.status())
        if text != self.published:
            self.store.set(self.status_key(self.rank), text)
            self.published = text

    def _run(self) -> None:
        keys = [self.key(r) for r in self.ranks]
        status_keys = [self.status_key(r) for r in self.ranks]
        failed_key, first_key = f"{self.prefix}/failed_ranks", f"{self.prefix}/first_failure"
        try:
            for k in keys:  # every key exists, so multi_get never waits
                self.store.add(k, 0)
            for k in status_keys:
                self.store.compare_set(k, "", "{}")
            self.store.append(failed_key, "")
            self.store.compare_set(first_key, "", "")  # created empty unless a failure is in
            while not self.stop.is_set():
                self.store.add(self.key(self.rank), 1)
                self.publish()
                *values, failed, first = self.store.multi_get(
                    keys + status_keys + [failed_key, first_key])
                statuses = values[len(keys):]
                values = values[:len(keys)]
                now = time.monotonic()
                with self._view_lock:
                    for r, v in zip(self.ranks, values):
                        if int(v) != self.counts[r]:
                            self.counts[r], self.changed[r] = int(v), now
                    for r, v in zip(self.ranks, statuses):
                        try:
                            self.statuses[r] = json.loads(v.decode() or "{}")
                        except ValueError:
                            self.statuses[r] = {}
                    self.failed = {int(r) for r in failed.decode().split(",") if r}
                    self.first = first.decode()
                    self.rounds += 1
                    self._view_lock.notify_all()
                self.stop.wait(BEAT_SECONDS)
        except Exception:  # noqa: BLE001 - the store is gone: keep the last view
            with self._view_lock:
                self.store_lost_at = time.monotonic()
                self.store_ok = False
                self._view_lock.notify_all()

    def fresh_view(self) -> bool:
        """Waits for one more read of the store (at most a few beats); False if the
        store is gone (then nothing should touch it: each failed call prints a warning)."""
        with self._view_lock:
            target = self.rounds + 1
            self._view_lock.wait_for(lambda: self.rounds >= target or not self.store_ok,
                                     timeout=4 * BEAT_SECONDS)
            return self.store_ok

    def report_failure(self) -> None:
        if self.store_ok:
            _in_thread(lambda: self.store.append(f"{self.prefix}/failed_ranks", f"{self.rank},"),
                       _STORE_SECONDS)

    def _silence(self) -> Dict[int, float]:
        """Seconds each other rank's counter has stood still (ranks that started
        beating, reported no error and did not exit normally), as of now or of the
        store's end."""
        with self._view_lock:
            now = time.monotonic() if self.store_ok else self.store_lost_at
            return {r: now - self.changed[r] for r in self.ranks
                    if r != self.rank and self.counts[r] > 0 and r not in self.failed
                    and not self.statuses.get(r, {}).get("exited")}

    def lost(self) -> List[int]:
        """Ranks silent for SILENCE_SECONDS that reported no error. Waits while a rank
        is quiet but not yet for that long (at most SILENCE_SECONDS and a beat), and
        a few beats in any case, so that a rank that just died shows as quiet."""
        start = time.monotonic()
        while True:
            silence = self._silence()
            lost = sorted(r for r, quiet in silence.items() if quiet >= SILENCE_SECONDS)
            quiet = [r for r, q in silence.items() if 2 * BEAT_SECONDS < q < SILENCE_SECONDS]
            waited = time.monotonic() - start
            if not self.store_ok or waited >= SILENCE_SECONDS + 2 * BEAT_SECONDS:
                return lost
            if not quiet and (lost or waited >= 3 * BEAT_SECONDS):
                return lost
            time.sleep(0.1)  # in the main thread: a signal still interrupts it


def _ensure_heartbeat() -> None:
    """Starts this process's heartbeat thread once the default group exists."""
    with _lock:
        if _heartbeat["monitor"] is not None or not dist.is_available() or not dist.is_initialized():
            return
        # The whole world: pipelines on subgroups share the process's monitor.
        monitor = _Monitor(dist.get_rank(), list(range(dist.get_world_size())))
        _heartbeat["monitor"] = monitor
        monitor.thread.start()
    # Stop it before the interpreter shuts down: a daemon thread coming back from a
    # C++ call during finalization can end the process with std::terminate.
    atexit.register(_stop_heartbeat)


def _stop_heartbeat() -> None:
    monitor = _heartbeat["monitor"]
    if monitor is not None:
        monitor.stop.set()
        monitor.thread.join(_STORE_SECONDS)
        _calls.exiting()
        left = sum(c[0] for c in _unflushed)
        if left:
            logging.getLogger("pipedream_ext._pipe").error(
                "rank %d: the asynchronous pipeline ends with %d minibatches admitted and never "
                "flushed: their backward passes and updates did not run, and peers still waiting "
                "for them fail; call pipe.flush() (or pipe.close()) on every rank before the end",
                monitor.rank, left)
        if monitor.store_ok:  # the peers still waiting learn why (see _calls_note)
            _in_thread(monitor.publish, _STORE_SECONDS)


class _Calls:
    """This rank's pipeline calls, for the peers' messages (see the module docstring)."""

    def __init__(self) -> None:
        self.current: Optional[str] = None
        self.counts: Dict[str, int] = {}
        self.exited = False

    def enter(self, name: str) -> None:
        number = self.counts.get(name, 0)
        self.counts[name] = number + 1
        self.current = f"{name}() number {number}"

    def leave(self) -> None:
        self.current = None

    def exiting(self) -> None:
        self.exited = True
        self.current = None

    def status(self) -> dict:
        return {"in": self.current, "counts": dict(self.counts), "exited": self.exited,
                "unflushed": sum(c[0] for c in _unflushed) if self.exited else 0}


_calls = _Calls()


def _made(counts: Dict[str, int]) -> str:
    made = [f"{n} {name}() call{'s' if n != 1 else ''}" for name, n in sorted(counts.items())
            if name != "flush"]
    return ", ".join(made) if made else "no step() call"


def _calls_note(monitor: "_Monitor", rank: int) -> Optional[str]:
    """Names the peers whose pipeline call is not this rank's (between calls, in another,
    exited), or ``None`` if every peer is in the same call."""
    mine = _calls.current
    if mine is None:
        return None
    with monitor._view_lock:  # noqa: SLF001 - the view is this module's
        statuses = dict(monitor.statuses)
    notes = []
    for r in sorted(statuses):
        status = statuses[r]
        if r == rank or not status:
            continue
        made = _made(status.get("counts", {}))
        if status.get("exited"):
            left = status.get("unflushed", 0)
            notes.append(f"rank {r} has ended (exited after {made}"
                         + (f", with {left} asynchronous minibatches admitted and never flushed: "
                            "call pipe.flush() or pipe.close() on every rank before the end"
                            if left else "") + ")")
        elif status.get("in") is None:
            notes.append(f"rank {r} is not in a pipeline call (it has made {made})")
        elif status.get("in") != mine:
            notes.append(f"rank {r} is in {status['in']}")
    if not notes:
        return None
    return (f"this rank is in {mine}, but " + "; ".join(notes) + ": every rank must call "
            "step(), forward_only() and flush() the same number of times in the same order (a "
            "call on one rank only, or an extra one, waits for peers that never come)")


def _after_fork_in_child() -> None:  # a forked child (a DataLoader worker) does not beat
    _heartbeat["monitor"] = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _describe(exc: BaseException) -> str:
    stopped = getattr(exc, "pipedream_stopped", None)
    if stopped is not None:  # Ctrl-C through pipedream_ext._signals
        return str(stopped)
    if isinstance(exc, SystemExit):
        return f"exited with status {exc.code}" + (" (SIGTERM)" if exc.code == 143 else "")
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS] + " ..."


def _record_and_read(pipe: Any, exc: BaseException, rank: int, cached: str = "",
                     store_ok: bool = True) -> Optional[dict]:
    """Records this rank's failure unless one is known (``cached``: the monitor's last
    read); returns another rank's fresh first failure, or None."""
    now = time.time()
    mine = json.dumps({"rank": rank, "time": now, "error": _describe(exc)})
    store, prefix = _store(), _prefix()
    if cached or not store_ok:
        current: Any = cached
    else:
        current = _in_thread(lambda: store.compare_set(f"{prefix}/first_failure", "", mine),
                             _STORE_SECONDS)
    if not current:
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
        if store_ok:
            _in_thread(lambda: store.compare_set(f"{prefix}/first_failure", current, mine),
                       _STORE_SECONDS)
        return None
    if first_rank == rank:
        return None
    first["age"] = max(age, 0.0)
    return first


def _report(pipe: Any, exc: BaseException) -> None:
    if getattr(exc, "_pipedream_first_failure_seen", False):
        return
    try:
        exc._pipedream_first_failure_seen = True  # type: ignore[attr-defined]  # noqa: SLF001 - our marker
    except AttributeError:  # pragma: no cover - exceptions without __dict__
        return
    if not dist.is_available() or not dist.is_initialized():
        return
    rank = dist.get_rank()
    monitor: Optional[_Monitor] = _heartbeat["monitor"]
    first = None
    try:
        # A ValueError (bad arguments, before any communication) is recorded at once.
        fresh = monitor is not None and not isinstance(exc, ValueError)
        store_ok = monitor.fresh_view() if fresh else (monitor is None or monitor.store_ok)
        if monitor is not None and store_ok:
            monitor.report_failure()
        first = _record_and_read(pipe, exc, rank, cached=monitor.first if monitor else "",
                                 store_ok=store_ok)
    except Exception:  # noqa: BLE001 - reporting must never hide the real error
        pass
    if not isinstance(exc, Exception) or not exc.args:
        return
    message = str(exc.args[0])
    if isinstance(exc, ValueError) or not _PEER_FAILURE.search(message):
        return  # a local error (the same on every rank, say): no notes
    notes = []
    calls = _calls_note(monitor, rank) if monitor is not None else None
    if calls:
        notes.append(calls)
    lost = monitor.lost() if monitor is not None else []
    if lost:
        notes.append(f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}: no "
                     f"heartbeat for {SILENCE_SECONDS:g} s and no error reported (killed, crashed "
                     "or hung)")
    if first is not None and first["error"] not in message:
        notes.append(f"first failure in this job ({first['age']:.1f} s earlier): rank "
                     f"{first['rank']}: {first['error']}")
    if notes:
        exc.args = ("\n".join([message, *notes]),) + tuple(exc.args[1:])


def watch_unflushed() -> List[int]:
    """A counter an asynchronous runner keeps at the number of minibatches it admitted
    and has not flushed (``counter[0]``); at exit, a non-zero total is logged as an
    error and published for the peers' messages (the pipeline may be gone by then)."""
    counter = [0]
    _unflushed.append(counter)
    return counter


_unflushed: List[List[int]] = []


def names_first_failure(method: F) -> F:
    """Decorates a ``PipeDream`` method: starts the heartbeat; on a failure records it
    in the store and, for an error about a peer, appends the lost ranks and the job's
    first failure to the message (same exception object, same type)."""
    if getattr(method, "_pipedream_names_first_failure", False):
        return method

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _heartbeat["monitor"] is None:
            _ensure_heartbeat()
        _calls.enter(method.__name__)
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            _report(self, exc)
            raise
        finally:
            _calls.leave()

    wrapper._pipedream_names_first_failure = True  # type: ignore[attr-defined]  # noqa: SLF001 - our marker
    return wrapper  # type: ignore[return-value]
