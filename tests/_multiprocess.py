"""Shared launcher for the multi-process test files (they run under pytest, which
starts their ranks as torchrun would, or directly under torchrun).

A test file lists its checks as named cases (``Cases``), groups them into launches
(``Launch``: one run of ``world`` ranks going through the cases in order), and
parametrizes its pytest functions over them (``parametrize_cases``). Launching the ranks
is the expensive part, so a launch runs once per pytest session however many of its
cases are selected; every rank writes one JSON line per case (name, passed, traceback)
and each case passes or fails under its own pytest id with the tracebacks of the ranks
that failed it. A case without a result on some rank (a crash, a hang, a launch killed
at its timeout) fails with the launch's output tail: a case never passes unseen.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Set by the pytest side for the ranks: which launch of the file to run, and the folder
# of the per-rank result files.
LAUNCH_ENV = "PIPEDREAM_TEST_LAUNCH"
RESULTS_ENV = "PIPEDREAM_TEST_RESULTS"
# A rank that failed a case waits this long for the others to finish it before it ends
# the launch (they may be waiting on it until their own timeouts; then the cases left
# fail as not run instead of hanging).
RESYNC_AFTER_FAILURE_S = 120.0
# The pseudo case of every launch: all ranks ran every case and exited with status 0.
EXIT_CASE = "exit-status"
# The backend of the ranks' default group, set by the pytest side (``Launch.backend``).
BACKEND_ENV = "PIPEDREAM_TEST_BACKEND"
BACKENDS = ("gloo", "nccl_rules")
_TAIL = 6000
# Every launch this pytest session ran, for the summary of the slowest (tests/conftest.py).
FINISHED: List["LaunchResult"] = []


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def launch_torchrun(script: str, world: int, timeout: float = 600,
                    env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs ``script`` on ``world`` local ranks (one thread each) under torchrun.

    Returns:
        The result, stdout and stderr together in ``stdout``; ``returncode`` is None when
        the launch ran past ``timeout`` (then torchrun and its ranks are killed).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", script]
    proc = subprocess.Popen(cmd, env=_rank_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, None, out + f"\n[killed after {timeout:.0f} s]", "")


def _reader(fd: int, chunks: List[str]) -> threading.Thread:
    """A thread that reads ``fd`` to its end into ``chunks``."""
    def read() -> None:
        with open(fd, errors="replace") as f:
            for line in f:
                chunks.append(line)
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:  # each rank and what it started: its own session
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def launch_ranks(script: str, world: int, timeout: float = 600,
                 env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs ``script`` on ``world`` local ranks (one thread each) as ``torchrun --standalone``
    does, without torchrun's own interpreter (an ``import torch`` before any rank starts,
    seconds per launch on 2 cores): this process hosts the store the ranks rendezvous on
    (torchrun's agent store), each rank gets torchrun's environment, and the first rank to
    exit non-zero ends the others (torchrun's default too). For what torchrun itself does
    (restarts, its agent), use ``launch_torchrun``.

    Returns:
        The result, every rank's stdout and stderr together in ``stdout``; ``returncode``
        is that of the first rank that failed (0 when none did), None when the launch ran
        past ``timeout`` (then every rank is killed, with what it started).
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    common = dict(env or {}, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                  GROUP_WORLD_SIZE="1", ROLE_NAME="default", ROLE_WORLD_SIZE=str(world),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                  TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                  TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE=str(True))
    cmd = [sys.executable, script]
    read_fd, write_fd = os.pipe()
    chunks: List[str] = []
    procs: List[subprocess.Popen] = []
    try:
        for rank in range(world):
            rank_env = _rank_env(dict(common, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank)))
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=write_fd, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    finally:
        os.close(write_fd)
    reader = _reader(read_fd, chunks)
    deadline, returncode, note = time.time() + timeout, 0, ""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            returncode = failed[0][1]
            note = f"\n[rank {failed[0][0]} exited with status {returncode}; the other ranks were killed]"
            break
        if all(code == 0 for code in codes):
            break
        if time.time() > deadline:
            returncode, note = None, f"\n[killed after {timeout:.0f} s]"
            break
        time.sleep(0.05)
    _kill_all(procs)
    reader.join(timeout=10)  # a grandchild may still hold the pipe: take what came
    del store
    return subprocess.CompletedProcess(cmd, returncode, "".join(chunks) + note, "")


def launch_raw(script: str, world: int, case: str, timeout: float = 120,
               rank_env: Optional[Sequence[Dict[str, str]]] = None
               ) -> List[subprocess.CompletedProcess]:
    """Runs ``script --fault case`` on ``world`` plain rank processes (no torchrun, which
    would kill the survivors of a failing rank); fails the test if a rank hangs.

    Args:
        rank_env: environment variables per rank (e.g. another ``PYTHONHASHSEED`` each).

    Returns:
        One result per rank (stdout and stderr together in ``stdout``).
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = _rank_env(dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        env.update(rank_env[rank] if rank_env else {})
        procs.append(subprocess.Popen([sys.executable, script, "--fault", case], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    deadline = time.time() + timeout
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} hung in fault case {case!r}")
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


# --------------------------------------------------------------------------- cases
def id_part(value: Any) -> str:
    """``value`` as a part of a pytest id (lists without spaces)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(id_part(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={id_part(v)}" for k, v in value.items()) + "}"
    return str(value)


@dataclass(frozen=True)
class FromEnv:
    """An argument of a case read from the ranks' environment variable ``var`` when the
    case runs (a folder the pytest side chose); not part of the case's name."""

    var: str
    default: Optional[str] = None  # where ``var`` is unset (a file run directly)


def _resolved(value: Any) -> Any:
    if not isinstance(value, FromEnv):
        return value
    return os.environ[value.var] if value.default is None else os.environ.get(value.var, value.default)


class Cases:
    """The cases of one launch, in the order the ranks run them: a name and a call each."""

    def __init__(self) -> None:
        self.calls: Dict[str, Callable[[], None]] = {}

    def add(self, fn: Callable[..., Any], *args: Any, name: Optional[str] = None,
            **kwargs: Any) -> None:
        """Adds ``fn(*args, **kwargs)`` as a case.

        Args:
            name: the case's pytest id; by default ``fn``'s name without ``check_``, then
                the arguments but ``FromEnv`` ones (``gradients_and_training-1f1b-4-balance=[3,5]``).

        Raises:
            ValueError: the name is already a case of this launch.
        """
        if name is None:
            parts = [fn.__name__.removeprefix("check_")]
            parts += [id_part(a) for a in args if not isinstance(a, FromEnv)]
            parts += [f"{k}={id_part(v)}" for k, v in kwargs.items() if not isinstance(v, FromEnv)]
            name = "-".join(parts)
        if name in self.calls or name == EXIT_CASE:
            raise ValueError(f"case {name!r} twice in one launch: pass name= to tell them apart")
        self.calls[name] = lambda: fn(*map(_resolved, args), **{k: _resolved(v) for k, v in kwargs.items()})

    def names(self) -> List[str]:
        return list(self.calls)


@dataclass
class Launch:
    """One launch of a test file (``launch_ranks``: torchrun's environment, without its
    interpreter): ``world`` ranks run ``cases(world)`` in order.

    Args:
        script: the test file (its ``__main__`` calls ``worker_main`` with its launches).
        world: the number of ranks.
        cases: the launch's cases; called by pytest (for the ids) and by every rank.
        name: unique among the file's launches (the pytest id's prefix where one test
            function has several launches); by default ``"{world}ranks"``.
        timeout: seconds for the whole launch; past it every case left fails.
        marks: pytest marks of every case of the launch (``pytest.mark.slow``).
        dirs: environment variables the ranks get set to a fresh empty folder each
            (removed after the launch).
        init_group: False where the cases create the default group themselves (PipeDream
            does on a GPU).
        backend: the ranks' default group: "gloo", or "nccl_rules" (NCCL's point-to-point
            rules on the CPU, ``pipedream_ext.testing``); ``PIPEDREAM_TEST_BACKEND`` in
            pytest's environment overrides it for every launch (tests/test_nccl_rules.py).
            The default name of a ``nccl_rules`` launch ends in ``-nccl_rules``.

    Raises:
        ValueError: an unknown ``backend``.
    """

    script: str
    world: int
    cases: Callable[[int], Cases]
    name: str = ""
    timeout: float = 600
    marks: Tuple[Any, ...] = ()
    dirs: Tuple[str, ...] = ()
    init_group: bool = True
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: use one of {BACKENDS}")
        suffix = "" if self.backend == "gloo" else f"-{self.backend}"
        self.name = self.name or f"{self.world}ranks{suffix}"
        self._result: Optional[LaunchResult] = None
        self._env: Optional[Dict[str, str]] = None

    def case_names(self) -> List[str]:
        return self.cases(self.world).names()

    def check_all(self, env: Optional[Dict[str, str]] = None) -> None:
        """Runs the launch (see ``result``) and fails at its first failed case: for a launch
        that is another test's prerequisite (a fixture), not a test itself."""
        for case in [*self.case_names(), EXIT_CASE]:
            self.result(env).check(case)

    def result(self, env: Optional[Dict[str, str]] = None) -> "LaunchResult":
        """Runs the launch the first time it is asked for (with ``env`` added to the ranks'
        environment) and returns its per-rank results from then on.

        Raises:
            ValueError: asked again with another ``env`` than the first time.
        """
        env = dict(env or {})
        if self._result is None:
            with tempfile.TemporaryDirectory(prefix="pipedream-cases-") as folder:
                ranks_env = {var: os.path.join(folder, var) for var in (*self.dirs, RESULTS_ENV)}
                for sub in ranks_env.values():
                    os.mkdir(sub)
                results = ranks_env[RESULTS_ENV]
                ranks_env.update(env, **{LAUNCH_ENV: self.name,
                                         BACKEND_ENV: os.environ.get(BACKEND_ENV) or self.backend})
                started = time.time()
                run = launch_ranks(self.script, self.world, self.timeout, ranks_env)
                self._result = LaunchResult(self, run, _read_records(results, self.world),
                                            time.time() - started)
                FINISHED.append(self._result)
            self._env = env
        elif env != self._env:
            raise ValueError(f"launch {self.name} ran with env {self._env}, asked again with {env}")
        return self._result


@dataclass(frozen=True)
class CaseRef:
    """One pytest id: a case of a launch."""

    launch: Launch
    case: str

    def check(self, env: Optional[Dict[str, str]] = None) -> None:
        """Runs the launch if no case of it did yet (``env``: see ``Launch.result``), then
        fails with the tracebacks of the ranks that failed this case, or the launch's output
        where a rank has no result for it."""
        self.launch.result(env).check(self.case)


def strict_and_gloo(script: str, world: int, cases: Callable[[int], Cases],
                    **kwargs: Any) -> Tuple[Launch, Launch]:
    """The launch on ``nccl_rules`` and its twin on Gloo, marked slow: `make test` runs
    each case once, on the stricter backend (the same cases, the same exactness checks,
    NCCL's rules on top), `make test-all` on both.

    Args:
        kwargs: ``Launch``'s other arguments; a ``name`` gets ``-nccl_rules`` appended on
            the strict launch.

    Returns:
        The ``nccl_rules`` launch, then the Gloo one.
    """
    marks = tuple(kwargs.pop("marks", ()))
    name = kwargs.pop("name", "")
    strict = Launch(script, world, cases, name=name and f"{name}-nccl_rules", marks=marks,
                    backend="nccl_rules", **kwargs)
    gloo = Launch(script, world, cases, name=name, marks=(*marks, pytest.mark.slow), **kwargs)
    return strict, gloo


def parametrize_cases(*launches: Launch) -> Any:
    """``pytest.mark.parametrize("case", ...)`` over every case of ``launches`` (a
    ``CaseRef`` each), plus each launch's ``exit-status``; ids are the case names, prefixed
    by the launch's name where there are several launches."""
    params = [pytest.param(CaseRef(launch, case),
                           id=case if len(launches) == 1 else f"{launch.name}-{case}",
                           marks=launch.marks)
              for launch in launches for case in [*launch.case_names(), EXIT_CASE]]
    return pytest.mark.parametrize("case", params)


def _read_records(folder: str, world: int) -> List[Dict[str, Dict[str, Any]]]:
    """Each rank's records by case name (the last record of a case wins: its result)."""
    ranks: List[Dict[str, Dict[str, Any]]] = []
    for rank in range(world):
        records: Dict[str, Dict[str, Any]] = {}
        path = os.path.join(folder, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):  # a rank killed mid-write leaves half a line
                        record = json.loads(line)
                        records[record["case"]] = record
        ranks.append(records)
    return ranks


@dataclass
class LaunchResult:
    """A launch's run (output, exit status) and each rank's records by case name."""

    launch: Launch
    run: subprocess.CompletedProcess
    ranks: List[Dict[str, Dict[str, Any]]]
    seconds: float

    def _launch_outcome(self) -> str:
        if self.run.returncode is None:
            how = f"ran past its timeout of {self.launch.timeout:.0f} s and was killed"
        else:
            how = f"exited with status {self.run.returncode} after {self.seconds:.0f} s"
        return (f"the launch of {os.path.basename(self.launch.script)} on {self.launch.world} ranks "
                f"({self.launch.name}) {how}; its output's tail:\n{self.run.stdout[-_TAIL:]}")

    def slowest_cases(self, count: int) -> List[Tuple[str, float]]:
        """The ``count`` cases that took longest (seconds on their slowest rank)."""
        seconds: Dict[str, float] = {}
        for records in self.ranks:
            for name, record in records.items():
                seconds[name] = max(seconds.get(name, 0.0), record.get("seconds", 0.0))
        return sorted(seconds.items(), key=lambda item: -item[1])[:count]

    def check(self, case: str) -> None:
        """Fails (pytest.fail) naming every rank that failed ``case`` or has no result."""
        if case == EXIT_CASE:
            expected = self.launch.case_names()
            for rank, records in enumerate(self.ranks):
                # A case only the ranks know (a name built from a rank's environment) would
                # pass or fail unseen.
                unknown = [name for name in records if name not in expected]
                assert not unknown, f"rank {rank} ran cases pytest does not list: {unknown}"
            if self.run.returncode != 0:
                pytest.fail(self._launch_outcome(), pytrace=False)
            return
        problems, missing = [], False
        for rank, records in enumerate(self.ranks):
            record = records.get(case)
            missing |= record is None or "passed" not in record
            if record is None:
                problems.append(f"rank {rank} never started case {case!r}")
            elif "passed" not in record:
                problems.append(f"rank {rank} started case {case!r} and gave no result (it crashed, "
                                "hung or was killed)")
            elif not record["passed"]:
                problems.append(f"rank {rank} failed case {case!r} after {record['seconds']:.1f} s:\n"
                                f"{record['error']}")
        if missing:
            problems.append(self._launch_outcome())
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


# --------------------------------------------------------------------------- the ranks' side


def init_test_group() -> None:
    """The default group of a test worker, on the backend ``PIPEDREAM_TEST_BACKEND`` names."""
    backend = os.environ.get(BACKEND_ENV, "gloo")
    if backend == "nccl_rules":
        import pipedream_ext.testing as pdt

        pdt.register_nccl_rules_backend()
    elif backend != "gloo":
        raise ValueError(f"{BACKEND_ENV}={backend!r}: use 'gloo' or 'nccl_rules'")
    dist.init_process_group(backend)


def _chosen_launch(launches: Sequence[Launch]) -> Launch:
    """The launch ``PIPEDREAM_TEST_LAUNCH`` names, or else the first for this world size
    (a file run directly under torchrun)."""
    by_name = {launch.name: launch for launch in launches}
    world = int(os.environ["WORLD_SIZE"])
    name = os.environ.get(LAUNCH_ENV) or next(
        (launch.name for launch in launches if launch.world == world), "")
    if by_name.get(name) is None or by_name[name].world != world:
        raise ValueError(f"{LAUNCH_ENV}={name!r} on {world} ranks: this file's launches are "
                         + ", ".join(f"{n} ({launch.world} ranks)" for n, launch in by_name.items()))
    return by_name[name]


class _Records:
    """This rank's result file (or stdout, run directly under torchrun)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        folder = os.environ.get(RESULTS_ENV)
        self.file = open(os.path.join(folder, f"rank{rank}.jsonl"), "a") if folder else None

    def write(self, **record: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        elif "passed" in record:
            outcome = "passed" if record["passed"] else "FAILED\n" + record["error"]
            print(f"rank {self.rank}: case {record['case']} {outcome}", flush=True)


def _wait_for_every_rank(store: dist.Store, index: int, world: int, timeout_s: float) -> bool:
    """A barrier on the store after case ``index``; False at the timeout."""
    if store.add(f"case{index}", 1) == world:
        store.set(f"case{index}/done", "1")
    try:
        store.wait([f"case{index}/done"], datetime.timedelta(seconds=timeout_s))
        return True
    except RuntimeError:  # the store's timeout (DistStoreError)
        return False


def _traceback_of_the_case(exc: BaseException) -> str:
    """``exc``'s traceback from the case's own code on (without this file's frames)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))[-_TAIL:]


def _run_cases(cases: Cases, records: _Records, store: dist.Store, world: int) -> bool:
    """Runs every case, the ranks starting each one together (so one rank's failure does
    not run on into the next case); True if each passed on this rank."""
    every = True
    for index, (name, call) in enumerate(cases.calls.items()):
        records.write(case=name)
        started = time.time()
        try:
            call()
            passed, error = True, ""
        except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:  # noqa: BLE001 - the case's result
            passed, error = False, _traceback_of_the_case(exc)
        records.write(case=name, passed=passed, error=error, seconds=time.time() - started)
        every &= passed
        # A rank that failed waits a bounded time: the others may wait on it until their
        # own timeouts, or forever on a collective of the test's own.
        if not _wait_for_every_rank(store, index, world, RESYNC_AFTER_FAILURE_S if not passed else 86400):
            print(f"rank {records.rank}: the other ranks did not finish case {name!r} within "
                  f"{RESYNC_AFTER_FAILURE_S:.0f} s of its failure here; ending the launch", flush=True)
            os._exit(1)
    return every


def worker_main(launches: Sequence[Launch]) -> None:
    """The ranks' side: the test group, then every case of the chosen launch, each rank
    writing each case's result (run directly under torchrun: printing it, and exiting
    with status 1 if a case failed here)."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    launch = _chosen_launch(launches)
    os.environ.setdefault(BACKEND_ENV, launch.backend)  # run directly: the launch's own
    if launch.init_group:
        init_test_group()
    records = _Records(rank)
    store = dist.PrefixStore("pipedream_test_cases/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
    every = _run_cases(launch.cases(world), records, store, world)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if not every and records.file is None:  # run directly: the exit status tells
        sys.exit(1)
