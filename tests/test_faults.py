"""Faults: a killed rank, restarts from checkpoints, SIGTERM and Ctrl-C (CPU, Gloo, localhost).

* SIGKILL of one rank mid-run, ranks launched as plain processes (1f1b on 4 ranks,
  a middle rank killed; pipedream on 3, the last rank killed) and under torchrun:
  every other rank exits non-zero within the communication timeout + 10 s, its
  error names the lost rank (directly, or as the job's first failure), and no
  process of the job is left.
* ``torchrun --max-restarts 1`` of examples/train_resumable.py with a simulated
  crash: the restarted job resumes from the last checkpoint and ends with the
  weights of an uninterrupted run.
* SIGTERM to the torchrun agent and Ctrl-C (SIGINT to the process group) of a
  directly launched job: every rank says once that it is shutting down, no
  tracebacks, every process gone promptly, the last checkpoint loads.
* SIGTERM at a random moment of a save loop (tests/test_checkpoint.py's): the
  previous checkpoint stays loadable and no ``.tmp`` file is left.
* ``pipedream_ext._dist.elastic``: restarted workers on a long-lived agent store.

Every process a test starts carries a unique ``PDFAULT_JOB`` value in its
environment; the test checks in /proc that none is left and, in a ``finally``,
kills by pid any that is. The worker side (``PDFAULT_ROLE=train``) is a plain
training loop; it applies ``pipedream_ext._dist.faults`` and ``_signals`` itself
(no-ops once ``PipeDream`` does).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import free_port

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "train_resumable.py")
TIMEOUT = 10.0  # the pipelines' communication timeout in these tests (seconds)
BOUND = TIMEOUT + 10.0  # every rank must be gone this long after the fault
# A stopped rank (alive, silent) closes no connection: its peers wait out the timeout,
# then Gloo waits out their pending operations at exit (each bounded by the timeout).
BOUND_STOPPED = 2 * TIMEOUT + 10.0
KILL_AFTER_STEP = 20


# --------------------------------------------------------------------------- worker side
def make_model():  # type: ignore[no-untyped-def]
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(),
                         nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))


def worker_train() -> None:
    """Trains until killed; prints its progress; saves a checkpoint every PDFAULT_EVERY steps."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipedream_ext as pd
    import pipedream_ext._dist.signals as _signals

    assert all(getattr(getattr(pd.PipeDream, name), "_pipedream_names_first_failure", False)
               for name in ("step", "flush", "forward_only"))
    torch.set_num_threads(1)
    schedule = os.environ["PDFAULT_SCHEDULE"]
    every = int(os.environ.get("PDFAULT_EVERY", "0"))
    root = os.environ.get("PDFAULT_CKPT")
    data_parallel = os.environ.get("PDFAULT_MESH")  # pp 2 x dp 2 with this data_parallel
    mesh = None
    if data_parallel:  # as a user builds it: the default group too, with torch's timeout
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pipe = pd.PipeDream(make_model(), F.cross_entropy, schedule=schedule,
                        microbatches=1 if schedule == "pipedream" else 4, timeout=TIMEOUT,
                        **(dict(mesh=mesh, data_parallel=data_parallel) if mesh else {}))
    _signals.install()  # a no-op once PipeDream installs the handlers
    rank = dist.get_rank()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    if mesh is not None:  # each dp rank its half of the batch
        half = slice(8 * mesh["dp"].get_local_rank(), 8 * mesh["dp"].get_local_rank() + 8)
        x, y = x[half], y[half]
    for step in range(1, 10 ** 6):
        if pipe.asynchronous:
            pipe.step(x, y, optimizer=opt)
        else:
            pipe.step(x, y)
            opt.step()
            opt.zero_grad()
        if step % 10 == 0:
            print(f"rank {rank} pid {os.getpid()} step {step}", flush=True)
        if every and step % every == 0:
            pd.save_checkpoint(root, pipe, opt, step=step)
            if rank == 0:
                print(f"checkpoint {step}", flush=True)


def worker_elastic() -> None:
    """One attempt of a job on an agent store: init, barrier, all-reduce."""
    import datetime

    import torch.distributed as dist

    import pipedream_ext._dist.elastic as _elastic

    _elastic.init_process_group("gloo", datetime.timedelta(seconds=TIMEOUT))
    dist.barrier()
    total = torch.ones(1)
    dist.all_reduce(total)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"attempt {attempt} rank {dist.get_rank()} sum {int(total.item())}", flush=True)
    if attempt == "0" and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # leaves its keys behind, as a crash does
    time.sleep(0.5)
    os._exit(0)


# --------------------------------------------------------------------------- process helpers
def _marked_pids(marker: str) -> List[int]:
    """Live processes (not zombies) whose environment holds PDFAULT_JOB=marker."""
    needle = f"PDFAULT_JOB={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """Processes of one test job: a unique marker, output files, cleanup by pid."""

    def __init__(self, tmp: str, **env: str) -> None:
        self.marker = uuid.uuid4().hex
        self.tmp = tmp
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PDFAULT_JOB=self.marker,
                        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                                    os.environ.get("PYTHONPATH", "")]), **env)
        self.procs: List[subprocess.Popen] = []

    def start(self, cmd: Sequence[str], name: str, env: Optional[Dict[str, str]] = None,
              **popen: object) -> subprocess.Popen:
        out = open(os.path.join(self.tmp, f"{name}.out"), "w")
        err = open(os.path.join(self.tmp, f"{name}.err"), "w")
        # As launched from a terminal: a shell's background job (`make test &`) ignores
        # SIGINT, and the handlers keep an ignored signal ignored (the program's choice).
        proc = subprocess.Popen(list(cmd), env=dict(self.env, **(env or {})), stdout=out, stderr=err,
                                cwd=ROOT, preexec_fn=_default_sigint, **popen)  # type: ignore[call-overload]
        proc.name = name  # type: ignore[attr-defined]
        out.close()
        err.close()
        self.procs.append(proc)
        return proc

    def start_raw(self, world: int, cmd: Sequence[str], **env: str) -> List[subprocess.Popen]:
        """Ranks as plain processes (no torchrun), all in one new process group."""
        port = str(free_port())
        procs: List[subprocess.Popen] = []
        for r in range(world):
            rank_env = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            group = {"process_group": 0 if r == 0 else procs[0].pid}  # rank 0 leads a new group
            procs.append(self.start(cmd, f"rank{r}", rank_env, **group))
        return procs

    def output(self, name: str, stream: str = "out") -> str:
        with open(os.path.join(self.tmp, f"{name}.{stream}"), errors="replace") as f:
            return f.read()

    def wait_for(self, name: str, pattern: str, stream: str = "out", timeout: float = 120) -> re.Match:
        """Polls a process's output for ``pattern``; fails if every process ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output(name, stream), re.MULTILINE)
            if match:
                return match
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        pytest.fail(f"no {pattern!r} in {name}.{stream} after {timeout:.0f} s:\n" + self.dump())

    def wait_all(self, procs: Sequence[subprocess.Popen], since: float, limit: float) -> Dict[str, float]:
        """Waits until every process in ``procs`` ended; seconds from ``since`` to each exit."""
        ended: Dict[str, float] = {}
        deadline = since + limit + 60  # measured against ``limit`` by the caller; no hang here
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for p in procs:
                if p.name not in ended and p.poll() is not None:  # type: ignore[attr-defined]
                    ended[p.name] = time.monotonic() - since  # type: ignore[attr-defined]
            time.sleep(0.02)
        running = [p.name for p in procs if p.poll() is None]  # type: ignore[attr-defined]
        assert not running, f"{running} still running {limit + 60:.0f} s after the fault:\n" + self.dump()
        return ended

    def leftovers(self) -> List[int]:
        return _marked_pids(self.marker)

    def dump(self) -> str:
        parts = []
        for p in self.procs:
            name = p.name  # type: ignore[attr-defined]
            parts.append(f"--- {name} (exit {p.poll()}) stdout:\n{self.output(name)[-600:]}"
                         f"\n--- {name} stderr:\n{self.output(name, 'err')[-4000:]}")
        return "\n".join(parts)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for pid in self.leftovers():  # grandchildren (torchrun's workers), by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _torchrun(world: int, *args: str, restarts: int = 0) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", f"--max-restarts={restarts}", "--monitor-interval=0.2", *args]


def _assert_gone(job: Job, group: Optional[int] = None) -> None:
    assert job.leftovers() == [], f"processes left: {job.leftovers()}"
    if group is not None:
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)  # the process group is empty


def _kill_marked(job: Job, pid: int, sig: int) -> None:
    """Signals a process this job started (a torchrun worker), checked by its marker."""
    assert pid in job.leftovers(), f"pid {pid} is not a process of this job"
    os.kill(pid, sig)


# --------------------------------------------------------------------------- SIGKILL
@pytest.mark.parametrize("schedule, world, victim", [("1f1b", 4, 2), ("pipedream", 3, 2)],
                         ids=["1f1b-middle-rank", "pipedream-last-rank"])
def test_sigkill_raw_ranks_fail_naming_the_lost_rank(tmp_path, schedule: str, world: int,
                                                      victim: int) -> None:
    with Job(str(tmp_path), PDFAULT_ROLE="train", PDFAULT_SCHEDULE=schedule) as job:
        procs = job.start_raw(world, [sys.executable, HERE])
        job.wait_for(f"rank{victim}", rf"rank {victim} pid \d+ step {KILL_AFTER_STEP}(?!\d)")
        start = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        seconds = job.wait_all(procs, start, BOUND)
        print(f"{schedule}: rank {victim} of {world} killed; exits after {seconds}")
        assert procs[victim].returncode == -signal.SIGKILL
        for r, p in enumerate(procs):
            if r == victim:
                continue
            err = job.output(f"rank{r}", "err")
            assert p.returncode not in (0, None, -signal.SIGKILL), job.dump()
            # Neighbours' transfers name it; every rank (also one whose error came from a
            # collective, which names addresses) gets the heartbeat note.
            assert f"lost rank {victim}: no heartbeat" in err, f"rank {r}:\n{err[-3000:]}"
            assert seconds[f"rank{r}"] <= BOUND, (r, seconds)
        _assert_gone(job, procs[0].pid)


@pytest.mark.parametrize("data_parallel", ["fsdp", pytest.param("replicate", marks=pytest.mark.slow)])
def test_sigstop_on_a_mesh_every_other_rank_fails_within_the_timeout(tmp_path,
                                                                      data_parallel: str) -> None:
    """pp 2 x dp 2 (a mesh from init_device_mesh, whose groups wait 30 minutes): rank 3 is
    stopped (SIGSTOP: alive, silent); its pipeline peer (rank 1), its dp peer (rank 2, in
    FSDP's or the replicas' collectives) and rank 0 all fail naming it and exit within
    BOUND_STOPPED (15-20 s measured with timeout=10; the dp peer waited 30 minutes before).
    Every error names global ranks with mesh coordinates. replicate: make test-all."""
    world, victim = 4, 3
    with Job(str(tmp_path), PDFAULT_ROLE="train", PDFAULT_SCHEDULE="1f1b",
             PDFAULT_MESH=data_parallel) as job:
        procs = job.start_raw(world, [sys.executable, HERE])
        job.wait_for(f"rank{victim}", rf"rank {victim} pid \d+ step {KILL_AFTER_STEP}(?!\d)")
        start = time.monotonic()
        procs[victim].send_signal(signal.SIGSTOP)
        others = [p for r, p in enumerate(procs) if r != victim]
        seconds = job.wait_all(others, start, BOUND_STOPPED)
        print(f"{data_parallel}: rank {victim} stopped; exits after {seconds}")
        procs[victim].kill()
        procs[victim].wait(timeout=30)
        for r, p in enumerate(procs):
            if r == victim:
                continue
            err = job.output(f"rank{r}", "err")
            assert p.returncode not in (0, None), job.dump()
            assert f"lost rank {victim}: no heartbeat" in err, f"rank {r}:\n{err[-3000:]}"
            # Global ranks with mesh coordinates (mesh [[0, 1], [2, 3]]), not pp-group ranks.
            assert f"RuntimeError: rank {r} (pp {r // 2}, dp {r % 2})" in err, f"rank {r}:\n{err[-3000:]}"
            assert seconds[f"rank{r}"] <= BOUND_STOPPED, (r, seconds)
        _assert_gone(job, procs[0].pid)


def test_sigkill_under_torchrun_names_the_lost_rank(tmp_path) -> None:
    world, victim = 3, 1
    with Job(str(tmp_path), PDFAULT_ROLE="train", PDFAULT_SCHEDULE="1f1b") as job:
        agent = job.start(_torchrun(world, HERE), "torchrun", start_new_session=True)
        # Workers share torchrun's stdout: lines can run together, so no anchors.
        pid = int(job.wait_for("torchrun", rf"rank {victim} pid (\d+) step {KILL_AFTER_STEP}(?!\d)").group(1))
        start = time.monotonic()
        _kill_marked(job, pid, signal.SIGKILL)
        seconds = job.wait_all([agent], start, BOUND)["torchrun"]
        print(f"torchrun: rank {victim} of {world} killed; torchrun exits after {seconds:.2f} s")
        err = job.output("torchrun", "err")
        assert agent.returncode != 0 and seconds <= BOUND, (agent.returncode, seconds, err[-3000:])
        root = err[err.index("Root Cause"):]
        assert re.search(rf"rank\s*:\s*{victim} \(local_rank: {victim}\)\s*\n\s*exitcode\s*:\s*-9", root), err
        codes = {int(r): int(c) for r, c in re.findall(
            r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", err)}
        assert sorted(codes) == list(range(world)) and all(codes.values()), codes
        _assert_gone(job)


# --------------------------------------------------------------------------- restart
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path) -> None:
    """Rank 1 is SIGKILLed at step 25 on the first attempt; torchrun restarts the job,
    which resumes from the checkpoint of step 20 and ends equal to an uninterrupted run."""
    import pipedream_ext as pd

    args = ["--steps", "40", "--every", "10", "--timeout", str(TIMEOUT)]
    crashed, reference = str(tmp_path / "crashed"), str(tmp_path / "reference")
    # torch 2.13: Gloo workers restarted on torchrun's shared store can read the
    # failed attempt's addresses (see pipedream_ext/_dist/elastic.py); torch's switch:
    with Job(str(tmp_path), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1") as job:
        # The uninterrupted run (same 3-rank layout) alongside, to overlap start-ups.
        ranks = job.start_raw(3, [sys.executable, EXAMPLE, "--checkpoint", reference, *args])
        start = time.monotonic()
        agent = job.start(_torchrun(3, EXAMPLE, "--checkpoint", crashed, "--simulate-crash", "1:25",
                                    *args, restarts=1), "torchrun")
        for p in [agent, *ranks]:
            assert p.wait(timeout=300) == 0, job.dump()
        print(f"restarted run: {time.monotonic() - start:.1f} s")
        log = job.output("torchrun", "err")
        assert "attempt 0: no checkpoint" in log
        assert "rank 1: simulated crash at step 25" in log
        assert "attempt 1: resumed from" in log and "at step 20" in log, log[-3000:]
        assert "attempt 1: finished at step 40" in log
        assert "attempt 0: finished" not in log
        _assert_gone(job)
    for path in (crashed, reference):
        assert json.load(open(os.path.join(path, "manifest.json")))["step"] == 40
    got, want = pd.consolidate(crashed), pd.consolidate(reference)
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0, msg=key)


# --------------------------------------------------------------------------- SIGTERM, Ctrl-C
def _assert_checkpoint_loads(path: str, every: int) -> int:
    import pipedream_ext as pd

    step = json.load(open(os.path.join(path, "manifest.json")))["step"]
    assert step >= 2 * every and step % every == 0, step
    assert list(pd.consolidate(path)) == list(make_model().state_dict())
    return step


def test_sigterm_to_torchrun_stops_every_rank_cleanly(tmp_path) -> None:
    world, every = 2, 5
    ckpt = str(tmp_path / "ckpt")
    with Job(str(tmp_path), PDFAULT_ROLE="train", PDFAULT_SCHEDULE="1f1b", PDFAULT_EVERY=str(every),
             PDFAULT_CKPT=ckpt) as job:
        agent = job.start(_torchrun(world, HERE), "torchrun", start_new_session=True)
        job.wait_for("torchrun", rf"checkpoint {2 * every}(?!\d)")
        start = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        seconds = job.wait_all([agent], start, BOUND)["torchrun"]
        print(f"SIGTERM to torchrun: exits after {seconds:.2f} s")
        err = job.output("torchrun", "err")
        assert agent.returncode != 0 and seconds <= BOUND, (agent.returncode, seconds)
        # One line per rank, no traceback from the workers (torchrun prints its own).
        assert len(re.findall(r"pipedream_ext: rank \d \(pid \d+\) got SIGTERM: shutting down", err)) == world, err
        assert not re.search(r"^\[rank\d\]: Traceback", err, re.MULTILINE), err
        _assert_gone(job)
    _assert_checkpoint_loads(ckpt, every)


def test_ctrl_c_on_a_directly_launched_job(tmp_path) -> None:
    world, every = 3, 5
    ckpt = str(tmp_path / "ckpt")
    with Job(str(tmp_path), PDFAULT_ROLE="train", PDFAULT_SCHEDULE="pipedream",
             PDFAULT_EVERY=str(every), PDFAULT_CKPT=ckpt) as job:
        procs = job.start_raw(world, [sys.executable, HERE])
        job.wait_for("rank0", rf"checkpoint {2 * every}(?!\d)")
        start = time.monotonic()
        os.killpg(procs[0].pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        seconds = job.wait_all(procs, start, BOUND)
        print(f"Ctrl-C: exits after {seconds}")
        for r, p in enumerate(procs):
            err = job.output(f"rank{r}", "err")
            assert seconds[f"rank{r}"] <= BOUND
            assert p.returncode != 0, job.dump()
            assert err.count("got SIGINT: shutting down") == 1, err
            assert "Traceback" not in err, err
        _assert_gone(job, procs[0].pid)
    _assert_checkpoint_loads(ckpt, every)


def test_sigterm_during_saves_keeps_the_previous_checkpoint(tmp_path) -> None:
    """tests/test_checkpoint.py's save loop (every tensor = the save's step), with the
    signal handlers installed: SIGTERM at a random moment ends it with status 143,
    and the directory holds one complete checkpoint and no .tmp file."""
    import pipedream_ext as pd

    root = str(tmp_path / "ckpt")
    loop = os.path.join(ROOT, "tests", "test_checkpoint.py")
    code = ("import runpy, sys; from pipedream_ext._dist import signals; signals.install(); "
            f"sys.argv = [{loop!r}]; runpy.run_path({loop!r}, run_name='__main__')")
    with Job(str(tmp_path), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(free_port()), PDCKPT_DIR=root, PDCKPT_PHASE="kill-loop") as job:
        proc = job.start([sys.executable, "-c", code], "saver")
        job.wait_for("saver", r"^saved 2$")
        time.sleep(random.uniform(0.0, 0.5))
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        seconds = job.wait_all([proc], start, BOUND)["saver"]
        assert proc.returncode == 143, job.dump()
        assert "got SIGTERM: shutting down" in job.output("saver", "err")
        print(f"SIGTERM during saves: exits after {seconds:.2f} s")
        _assert_gone(job)
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    step = manifest["step"]
    for key, value in pd.consolidate(root).items():
        assert torch.equal(value, torch.full_like(value, step)), (key, step)
    assert not [f for f in os.listdir(root) if f.endswith(".tmp")], os.listdir(root)


SIGNAL_IN_WRITER = r"""
import os, signal, sys, torch
import pipedream_ext._dist.signals as _signals
import pipedream_ext._checkpoint.durable_io as durable_io
_signals.install()
write, calls = durable_io.HashingWriter.write, []
def write_then_signal(self, data):
    calls.append(1)
    if len(calls) == 3:  # inside torch.save, between two of its writes
        os.kill(os.getpid(), signal.SIGTERM)
    return write(self, data)
durable_io.HashingWriter.write = write_then_signal
try:
    durable_io.atomic_torch_save({"a": torch.zeros(1000)}, sys.argv[1], "x.pt")
finally:
    print("left", sorted(os.listdir(sys.argv[1])), "after", len(calls), "writes", flush=True)
"""


def test_sigterm_inside_torch_save_exits_143(tmp_path) -> None:
    """A signal while torch.save calls back into Python: raised inside the writer it
    broke torch's C++ writer, whose RuntimeError hid it (exit 1); now the save ends,
    the exception comes after it, the .tmp file goes and the status is 143."""
    script, out = tmp_path / "case.py", tmp_path / "out"
    script.write_text(SIGNAL_IN_WRITER)
    out.mkdir()
    with Job(str(tmp_path)) as job:
        proc = job.start([sys.executable, str(script), str(out)], "case")
        assert proc.wait(timeout=60) == 143, job.dump()
        text = job.output("case")
        assert "left [] after" in text and "after 3 writes" not in text, job.dump()
        assert "Traceback" not in job.output("case", "err"), job.dump()


SIGNALS_CASE = r"""
import ctypes, importlib.util, signal, sys, time
spec = importlib.util.spec_from_file_location("pd_signals", sys.argv[1])
signals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(signals)  # without torch: starts in milliseconds
case = sys.argv[2]
if case == "custom":  # the program's own handlers stay
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("installed", signals.install(grace=1.0), signal.getsignal(signal.SIGTERM), flush=True)
    sys.exit(0)
assert signals.install(grace=2.0)
print("ready", flush=True)
try:
    if case == "deferred":  # the block ends its work, then the signal raises
        with signals.deferred():
            with signals.deferred():
                print("in block", flush=True)
                time.sleep(1.0)
                print("block done", flush=True)
            print("inner done", flush=True)
        print("not reached", flush=True)
    if case == "blocked":  # the main thread stuck in C without the GIL, deaf to signals
        libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)
        libc.pthread_mutex_init(mutex, None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    while True:
        time.sleep(0.01)
finally:
    print("finally", flush=True)
    if case == "slow-finally":
        time.sleep(60)
"""


@pytest.mark.parametrize("case, signals, status, needles", [
    ("loop", [signal.SIGTERM], 143, ["got SIGTERM: shutting down", "finally"]),
    ("loop", [signal.SIGINT], -signal.SIGINT, ["finally", "stopped by SIGINT at case.py:"]),
    ("blocked", [signal.SIGTERM], 1, ["got SIGTERM", "Timeout (0:00:02)!"]),
    ("deferred", [signal.SIGTERM], 143, ["got SIGTERM", "block done\ninner done\nfinally"]),
    ("slow-finally", [signal.SIGTERM, signal.SIGTERM], -signal.SIGTERM, ["finally"]),
    ("custom", [], 0, ["installed False 1"]),  # 1: SIG_IGN
], ids=["sigterm", "sigint", "deadline", "deferred", "second-signal", "program-handlers"])
def test_signal_handlers(tmp_path, case: str, signals: List[int], status: int,
                         needles: List[str]) -> None:
    """pipedream_ext/_dist/signals.py alone: SystemExit(143) with finally blocks, one line for
    Ctrl-C, the deadline when the main thread is stuck in C, a second signal at once."""
    script = tmp_path / "case.py"
    script.write_text(SIGNALS_CASE)
    with Job(str(tmp_path)) as job:
        proc = job.start([sys.executable, str(script),
                          os.path.join(ROOT, "pipedream_ext", "_dist", "signals.py"), case], "case")
        for i, sig in enumerate(signals):
            job.wait_for("case", "^finally$" if i else ("^in block$" if case == "deferred" else "^ready$"))
            proc.send_signal(sig)
        assert proc.wait(timeout=30) == status, job.dump()
        text = job.output("case") + job.output("case", "err")
        for needle in needles:
            assert needle in text, job.dump()
        assert "Traceback" not in text and "not reached" not in text, job.dump()


# --------------------------------------------------------------------------- _elastic
def test_elastic_init_survives_a_torchrun_restart(tmp_path) -> None:
    """torchrun's agent store outlives attempts: plain init_process_group in the
    restarted workers fails or hangs on the failed attempt's Gloo keys (3 of 3 tries
    on torch 2.13); pipedream_ext._dist.elastic puts each attempt under its own prefix."""
    with Job(str(tmp_path), PDFAULT_ROLE="elastic") as job:
        agent = job.start(_torchrun(2, HERE, restarts=1), "torchrun")
        try:
            code = agent.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the restarted attempt hung:\n" + job.dump())
        out = job.output("torchrun")
        assert code == 0, job.dump()
        assert "attempt 0 rank 1 sum 2" in out and "attempt 1 rank 0 sum 2" in out \
            and "attempt 1 rank 1 sum 2" in out, job.dump()
        _assert_gone(job)


if __name__ == "__main__":
    {"train": worker_train, "elastic": worker_elastic}[os.environ["PDFAULT_ROLE"]]()
