"""Clean, bounded shutdown of a pipeline rank on SIGTERM and Ctrl-C (SIGINT).

Without handlers, SIGTERM kills a rank on the spot (no ``finally``, no exit
handlers) and Ctrl-C prints a ``KeyboardInterrupt`` traceback on every rank.
:func:`install` (idempotent; meant to be called by ``PipeDream`` once the process
group exists) makes the first SIGTERM or SIGINT:

* print one line on stderr: ``pipedream_ext: rank 1 (pid 4242) got SIGTERM:
  shutting down (exits within 10 s; a second signal ends it at once)``;
* raise in the main thread: ``SystemExit(143)`` for SIGTERM (no traceback, exit
  status 128 + 15) and ``KeyboardInterrupt`` for SIGINT (``except
  KeyboardInterrupt`` works as usual; uncaught, it prints one line, ``rank 1
  stopped by SIGINT at train.py:42 (in main)``, instead of a traceback, and the
  process ends by SIGINT as Python's would).
  ``finally`` blocks, context managers and ``atexit`` handlers run. The runtime
  calls back into Python for every stage forward (and every update of the
  asynchronous schedules), so the exception comes between two actions; a rank
  blocked on a dead or stopping peer gets a communication error first;
* arm a deadline: if the process still runs ``grace`` seconds after the signal
  (default 10, ``PIPEDREAM_SHUTDOWN_GRACE``), ``faulthandler`` prints where every
  thread is and ends it with status 1. The deadline is armed from a helper
  thread woken by the signal itself (``signal.set_wakeup_fd``), so it holds even
  while the main thread waits inside the C++ runtime without the GIL;
* restore the default actions, so a second SIGTERM or Ctrl-C ends the process
  at once.

Code that must not be cut in the middle (``torch.save`` calls back into Python
for every write, and an exception there leaves its C++ writer broken: it then
raises a ``RuntimeError`` that hides the signal) runs inside :func:`deferred`:
a signal arriving there is announced and arms the deadline at once, but raises
only when the block ends.

Handlers the program installed itself are left alone (only the default SIGTERM
action and Python's default SIGINT handler are replaced), as is a wakeup fd set
by someone else (asyncio): then the deadline is armed when the handler runs.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, Callable, Dict, Iterator, Optional, Type

__all__ = ["install", "installed", "deferred", "DEFAULT_GRACE"]

#: Seconds a rank has after SIGTERM / SIGINT before it is ended (``PIPEDREAM_SHUTDOWN_GRACE``).
DEFAULT_GRACE = 10.0

_lock = threading.Lock()
_installed: Dict[int, Any] = {}  # signal number -> the handler it replaced
# Main thread only (signal handlers run there): "defer_depth" counts nested
# deferred() blocks, "pending" the signal one of them holds back.
_state: Dict[str, Any] = {"grace": DEFAULT_GRACE, "announced": False, "armed": False,
                          "wakeup_read": -1, "excepthook": None, "defer_depth": 0, "pending": None}


def installed() -> bool:
    """Whether the handlers are installed in this process."""
    return bool(_installed)


def _grace_from_env(default: float) -> float:
    text = os.environ.get("PIPEDREAM_SHUTDOWN_GRACE")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"PIPEDREAM_SHUTDOWN_GRACE={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"PIPEDREAM_SHUTDOWN_GRACE={text!r} must be > 0 seconds")
    return value


def _rank() -> str:
    dist = sys.modules.get("torch.distributed")  # never import torch from a signal handler
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:  # noqa: BLE001 - a message must never fail
        pass
    return os.environ.get("RANK", "?")


def _announce(signum: int) -> None:
    """One line on stderr, once per process; arms the deadline."""
    with _lock:
        first = not _state["announced"]
        _state["announced"] = True
        if not _state["armed"]:
            _state["armed"] = True
            # A C-level watchdog thread: works even if the interpreter is stuck.
            faulthandler.dump_traceback_later(_state["grace"], exit=True, file=sys.__stderr__)
    if first:
        name = signal.Signals(signum).name
        line = (f"pipedream_ext: rank {_rank()} (pid {os.getpid()}) got {name}: shutting down "
                f"(exits within {_state['grace']:g} s; a second signal ends it at once)\n")
        try:
            os.write(2, line.encode())
        except OSError:
            pass


def _restore_defaults() -> None:
    for signum in _installed:
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (ValueError, OSError):  # not the main thread: keep ours (it re-raises)
            pass


def _handler(signum: int, frame: Optional[FrameType]) -> None:
    del frame
    _announce(signum)
    _restore_defaults()
    if _state["defer_depth"] > 0:
        _state["pending"] = signum
        return
    _raise_for(signum)


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        # A plain KeyboardInterrupt (Python ends the process by SIGINT only for
        # that exact type), marked for the excepthook.
        exc = KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
        exc.pipedream_stopped = f"stopped by {signal.Signals(signum).name}"  # type: ignore[attr-defined]
        raise exc
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds back the exception of a SIGTERM / SIGINT arriving inside the block
    until the block ends (it is announced and the deadline armed at once).

    For work an exception would break rather than stop, such as ``torch.save``
    into a Python writer. Nests; outside the main thread it does nothing (signals
    are handled in the main thread).

    Raises:
        SystemExit: 143 at the end of the block if SIGTERM arrived inside it.
        KeyboardInterrupt: likewise for SIGINT.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state["defer_depth"] += 1
    try:
        yield
    finally:
        _state["defer_depth"] -= 1
        signum = _state["pending"]
        if _state["defer_depth"] == 0 and signum is not None:
            _state["pending"] = None
            _raise_for(signum)


def _watch(fd: int) -> None:
    """Helper thread: the C-level handler writes the signal number to ``fd``."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            # Only signals our handler will act on (not ones the program took over).
            if signum in _installed and signal.getsignal(signum) is _handler:
                _announce(signum)


def _where(tb: Optional[TracebackType]) -> str:
    """`` at train.py:42 (in main)``: the innermost frame outside torch and this package."""
    torch = sys.modules.get("torch")
    skip = tuple([os.path.dirname(os.path.abspath(__file__)) + os.sep]
                 + ([os.path.dirname(torch.__file__) + os.sep] if getattr(torch, "__file__", None) else []))
    found = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skip):
            found = f" at {os.path.basename(code.co_filename)}:{tb.tb_lineno} (in {code.co_name})"
        tb = tb.tb_next
    return found


def _excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(kind: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        stopped = getattr(value, "pipedream_stopped", None)
        if stopped is not None:
            sys.stderr.write(f"pipedream_ext: rank {_rank()} {stopped}{_where(tb)}\n")
            sys.stderr.flush()
            return
        previous(kind, value, tb)

    hook.pipedream_previous = previous  # type: ignore[attr-defined]
    return hook


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) gets the defaults back: its signals must
    not arm the parent's deadline through the inherited wakeup pipe."""
    if not _installed:
        return
    try:
        if _state["wakeup_read"] != -1:
            signal.set_wakeup_fd(-1)
            os.close(_state["wakeup_read"])
        for signum, previous in _installed.items():
            signal.signal(signum, previous)
    except (ValueError, OSError):  # forked from another thread: nothing we can reset
        pass
    _installed.clear()
    _state.update(announced=False, armed=False, wakeup_read=-1)


os.register_at_fork(after_in_child=_after_fork_in_child)


def install(grace: Optional[float] = None) -> bool:
    """Installs the SIGTERM / SIGINT handlers described in the module docstring.

    Idempotent; a no-op outside the main thread (signal handlers can only be set
    there). Call it after ``torch.distributed.init_process_group`` (which wraps
    ``sys.excepthook``), as ``PipeDream`` does.

    Args:
        grace: seconds between the first signal and the forced end of the process
            (default: ``PIPEDREAM_SHUTDOWN_GRACE`` or :data:`DEFAULT_GRACE`).

    Returns:
        True if the handlers are installed (now or before), False if not (not the
        main thread, or the program handles both signals itself).
    """
    if threading.current_thread() is not threading.main_thread():
        return installed()
    with _lock:
        _state["grace"] = float(grace) if grace is not None else _grace_from_env(DEFAULT_GRACE)
        if _state["grace"] <= 0:
            raise ValueError(f"grace must be > 0 seconds (got {grace})")
    if _installed:
        return True
    for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
        current = signal.getsignal(signum)
        if current is default:
            signal.signal(signum, _handler)
            _installed[signum] = current
    if not _installed:
        return False
    # Wake a helper thread on the signal itself, so the deadline is armed even
    # while the main thread waits in C++ without the GIL.
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous = None
    if previous is None or previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)  # someone else's (asyncio): keep it
        os.close(read_fd)
        os.close(write_fd)
    else:
        _state["wakeup_read"] = read_fd
        threading.Thread(target=_watch, args=(read_fd,), name="pipedream-signals",
                         daemon=True).start()
    _state["excepthook"] = sys.excepthook
    sys.excepthook = _excepthook(sys.excepthook)
    return True
