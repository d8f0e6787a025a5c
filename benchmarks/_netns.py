"""An emulated cluster on one Linux machine: N network namespaces behind a switch.

Each host ``K`` is a network namespace ``<prefix>-nsK`` with its loopback up and
one veth link ``<prefix>-hK`` (address ``<subnet>.<K+1>/24``) whose peer
``<prefix>-sK`` sits in a switch namespace ``<prefix>-sw`` on a Linux bridge.
Optionally every link is limited to ``rate`` bits/s in **both** directions with a
token-bucket filter (``tc qdisc ... tbf``): on the host end (host -> switch) and
on the switch end (switch -> host), so a host's uplink and downlink each carry
``rate``, like a full-duplex NIC on a switch port. Nothing is created in the root
namespace except the namespace names, so the machine's own interfaces, routes and
firewall are left alone.

Optionally every host also gets a CPU quota of ``cpus`` cores (a cgroup per host,
``<prefix>-nsK`` under the cgroup v1 ``cpu`` hierarchy or cgroup v2): a host that
waits on the network then does not lend its CPU time to the others, as on real
separate machines. Commands started with :meth:`NetnsCluster.exec_prefix` run in
the host's namespace and cgroup.

Needs root and iproute2 (``ip``, ``tc``); :func:`missing_prerequisites` says
what is missing. Usage::

    with NetnsCluster(hosts=4, rate=100e6) as cluster:       # 100 Mbit/s links, cpus=0.5 optional
        subprocess.run(cluster.exec_prefix(0) + ["python3", "server.py"])
        cluster.hosts[0].address                              # '10.77.0.1'

Teardown deletes the namespaces (which destroys their veths and qdiscs) on any
exit from the ``with`` block, including exceptions, Ctrl-C and SIGTERM (turned
into ``SystemExit`` while the cluster is up). A process killed with SIGKILL
leaves its namespaces behind; the next cluster with the same prefix removes them
first. A lock file (``/run/<prefix>-netns.lock``, ``flock``) keeps two live
clusters from using the same prefix: the second one fails instead of deleting the
first one's namespaces. Use another ``prefix`` (and ``subnet``) to run two
clusters side by side.

The command construction (:meth:`NetnsCluster.setup_commands`,
:meth:`NetnsCluster.teardown_commands`, :func:`tbf_args`) is pure and tested
without root in ``tests/test_slow_network.py``.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import _harness

__all__ = ["Host", "NetnsCluster", "cgroup_cpu_root", "cgroup_settings", "missing_prerequisites",
           "parse_rate", "tbf_args"]

log = logging.getLogger("netns")

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]

_RATE_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: Any) -> float:
    """Bits/s from ``100e6``, ``"100mbit"``, ``"1gbit"``, ``"1.5Gbit"`` (decimal units, as tc).

    Raises:
        ValueError: not a positive rate.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _RATE_UNITS:
            raise ValueError(f"rate {text!r} is not understood; write e.g. 100mbit, 1gbit or 1e8 "
                             "(bits per second)")
        value = float(m.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"rate {text!r} must be > 0 bits/s")
    return value


def tbf_args(rate_bps: float, latency_ms: float = 50.0) -> List[str]:
    """``tbf`` parameters for ``rate_bps``: a burst of 2 ms of traffic (at least 64 KiB,
    enough for veth's GSO packets at any timer resolution) and a queue of
    ``latency_ms``."""
    burst = max(64 * 1024, int(rate_bps / 8 * 0.002))
    return ["tbf", "rate", f"{int(round(rate_bps))}bit", "burst", str(burst),
            "latency", f"{latency_ms:g}ms"]


def cgroup_cpu_root() -> Optional[Tuple[str, int]]:
    """Where per-host CPU quotas can be made: ``(directory, 1 or 2)`` for a cgroup v1
    ``cpu`` hierarchy or a cgroup v2 root with the cpu controller; None if neither."""
    v1 = "/sys/fs/cgroup/cpu"
    if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
        return v1, 1
    v2 = "/sys/fs/cgroup"
    try:
        with open(os.path.join(v2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return v2, 2
    except OSError:
        pass
    return None


def cgroup_settings(root: str, version: int, name: str, cpus: float,
                    period_us: int = 10000) -> List[Tuple[str, str]]:
    """``(file, value)`` pairs that limit cgroup ``root/name`` to ``cpus`` cores."""
    quota = max(1000, int(round(cpus * period_us)))
    path = os.path.join(root, name)
    if version == 1:
        return [(os.path.join(path, "cpu.cfs_period_us"), str(period_us)),
                (os.path.join(path, "cpu.cfs_quota_us"), str(quota))]
    return [(os.path.join(path, "cpu.max"), f"{quota} {period_us}")]


def missing_prerequisites() -> List[str]:
    """What this machine lacks to build a cluster: root, ``ip``, ``tc`` (empty if nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces and tc need root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (package iproute2) on PATH")
    return missing


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated host.

    Attributes:
        index: K, 0-based.
        namespace: its network namespace (``<prefix>-nsK``).
        ifname: its veth interface inside the namespace (``<prefix>-hK``); give it
            to Gloo as ``GLOO_SOCKET_IFNAME``.
        switch_ifname: the peer end in the switch namespace (``<prefix>-sK``).
        address: its IPv4 address (``<subnet>.<K+1>``).
    """

    index: int
    namespace: str
    ifname: str
    switch_ifname: str
    address: str


# The bandwidth probe: the server accepts one connection, times from the first
# byte to EOF and prints "bytes seconds"; the client connects (retrying while the
# server starts) and sends the given number of bytes.
_PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(60)
first = c.recv(1 << 20); got = len(first); t = time.perf_counter()
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    got += len(b)
print(got - len(first), time.perf_counter() - t)
"""
_PROBE_CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); break
    except OSError:
        time.sleep(0.05)
else:
    raise SystemExit("bandwidth probe: cannot connect")
buf = bytes(1 << 20); left = int(sys.argv[3])
while left > 0:
    c.sendall(buf[:min(left, len(buf))]); left -= len(buf)
c.close()
"""


def _default_runner(cmd: Sequence[str]) -> "subprocess.CompletedProcess[str]":
    """Runs one setup or teardown command; the harness's failure policy
    (:class:`_harness.CommandFailed`, a ``subprocess.CalledProcessError``) on failure."""
    return _harness.run_command(cmd, timeout=30)


class NetnsCluster:
    """N hosts in network namespaces on one bridge, links optionally rate limited.

    Args:
        hosts: number of hosts N (1 to 250).
        rate: link rate in bits/s (a number or ``"100mbit"``), applied to both
            directions of every link; ``None`` leaves the links unlimited.
        prefix: names start with it (namespaces ``<prefix>-ns0..``, switch
            ``<prefix>-sw``); at most 8 characters so interface names fit in 15.
        subnet: the first three octets of the /24 (host K gets ``.K+1``).
        latency_ms: tbf queue length in milliseconds of traffic.
        cpus: CPU quota per host in cores (e.g. 0.5); ``None``: no limit.
        runner: runs one command (list of strings) and raises on failure; tests
            pass a recorder.
    """

    def __init__(self, hosts: int, rate: Any = None, prefix: str = "pd", subnet: str = "10.77.0",
                 latency_ms: float = 50.0, cpus: Optional[float] = None,
                 runner: Optional[Runner] = None) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 250:
            raise ValueError(f"hosts={hosts!r} must be an integer from 1 to 250")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-8 lowercase letters/digits starting "
                             "with a letter (interface names are limited to 15 characters)")
        octets = subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet {subnet!r} must be three octets such as 10.77.0")
        if not latency_ms > 0:
            raise ValueError(f"latency_ms={latency_ms} must be > 0")
        if cpus is not None and not 0.01 <= cpus <= (os.cpu_count() or 1):
            raise ValueError(f"cpus={cpus} must be between 0.01 and the machine's "
                             f"{os.cpu_count()} cores (or None for no limit)")
        self.cpus = None if cpus is None else float(cpus)
        self._cgroup: Optional[Tuple[str, int]] = None
        self.rate: Optional[float] = None if rate is None else parse_rate(rate)
        self.prefix = prefix
        self.subnet = subnet
        self.latency_ms = float(latency_ms)
        self.switch = f"{prefix}-sw"
        self.bridge = f"{prefix}-br"
        self.hosts = [Host(k, f"{prefix}-ns{k}", f"{prefix}-h{k}", f"{prefix}-s{k}",
                           f"{subnet}.{k + 1}") for k in range(hosts)]
        self._run: Runner = runner or _default_runner
        self._lock_file: Optional[Any] = None
        self._old_sigterm: Any = None
        self._up = False

    # -- pure parts ---------------------------------------------------------------
    def namespaces(self) -> List[str]:
        """Every namespace the cluster owns: the switch first, then the hosts."""
        return [self.switch] + [h.namespace for h in self.hosts]

    def exec_prefix(self, k: int, limit_cpu: bool = True) -> List[str]:
        """Prepend it to a command to run it on host ``k``: ``ip netns exec <ns>``, after,
        with a CPU quota, a shell that moves itself into the host's cgroup and execs
        the rest (so every descendant stays in it). ``limit_cpu=False`` leaves the
        cgroup out, e.g. to start unthrottled and :meth:`move_into_cgroup` later."""
        prefix = ["ip", "netns", "exec", self.hosts[k].namespace]
        cgroup = self._cgroup or (cgroup_cpu_root() if self.cpus is not None else None)
        if limit_cpu and self.cpus is not None and cgroup is not None:
            # Join the cgroup first: `ip netns exec` mounts the namespace's own
            # sysfs over /sys, which hides /sys/fs/cgroup.
            procs = os.path.join(cgroup[0], self.hosts[k].namespace, "cgroup.procs")
            prefix = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs] + prefix
        return prefix

    def cgroup_dirs(self) -> List[str]:
        """The per-host cgroup directories (empty without a CPU quota)."""
        if self.cpus is None or self._cgroup is None:
            return []
        return [os.path.join(self._cgroup[0], h.namespace) for h in self.hosts]

    def setup_commands(self) -> List[List[str]]:
        """The ``ip``/``tc`` commands that build the cluster, in order."""
        sw = self.switch
        cmds = [["ip", "netns", "add", sw],
                ["ip", "-n", sw, "link", "set", "lo", "up"],
                ["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"],
                ["ip", "-n", sw, "link", "set", self.bridge, "up"]]
        for h in self.hosts:
            cmds += [
                ["ip", "netns", "add", h.namespace],
                ["ip", "-n", h.namespace, "link", "set", "lo", "up"],
                # Both ends are created directly inside their namespaces: no name
                # is ever taken in the root namespace.
                ["ip", "link", "add", h.ifname, "netns", h.namespace, "type", "veth",
                 "peer", "name", h.switch_ifname, "netns", sw],
                ["ip", "-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.ifname],
                ["ip", "-n", h.namespace, "link", "set", h.ifname, "up"],
                ["ip", "-n", sw, "link", "set", h.switch_ifname, "master", self.bridge],
                ["ip", "-n", sw, "link", "set", h.switch_ifname, "up"],
            ]
            if self.rate is not None:
                tbf = tbf_args(self.rate, self.latency_ms)
                cmds += [  # host -> switch, then switch -> host
                    ["ip", "netns", "exec", h.namespace, "tc", "qdisc", "replace", "dev", h.ifname,
                     "root"] + tbf,
                    ["ip", "netns", "exec", sw, "tc", "qdisc", "replace", "dev", h.switch_ifname,
                     "root"] + tbf,
                ]
        return cmds

    def teardown_commands(self, existing: Optional[Sequence[str]] = None) -> List[List[str]]:
        """``ip netns del`` for the cluster's namespaces (hosts first, then the switch).

        Args:
            existing: namespace names present now (``ip netns list``); only those
                are deleted, plus any other ``<prefix>-nsK`` among them (leftovers of
                a larger cluster). ``None``: every namespace of this cluster.
        """
        own = self.namespaces()
        if existing is None:
            names = own
        else:
            pattern = re.compile(rf"{re.escape(self.prefix)}-(ns\d+|sw)")
            names = [n for n in existing if n in own or pattern.fullmatch(n)]
        names = sorted(names, key=lambda n: (n == self.switch, n))
        return [["ip", "netns", "del", n] for n in names]

    @staticmethod
    def parse_netns_list(text: str) -> List[str]:
        """Namespace names from ``ip netns list`` output (``name (id: 3)`` lines)."""
        return [line.split()[0] for line in text.splitlines() if line.strip()]

    # -- effects ------------------------------------------------------------------
    def pids(self, namespace: str) -> List[int]:
        """PIDs of the processes running in ``namespace`` (``ip netns pids``)."""
        try:
            out = self._run(["ip", "netns", "pids", namespace])
        except subprocess.CalledProcessError:
            return []
        return [int(tok) for tok in (out.stdout or "").split() if tok.isdigit()]

    def kill_processes(self, names: Optional[Sequence[str]] = None, sig: int = signal.SIGKILL) -> List[int]:
        """Sends ``sig`` to every process inside the cluster's namespaces (by PID).

        Processes started with ``ip netns exec`` keep a namespace alive after
        ``ip netns del``, and torchrun starts its workers in sessions of their
        own, so this is how a run makes sure nothing of it survives.
        """
        killed = []
        for ns in names if names is not None else self.namespaces():
            for pid in self.pids(ns):
                if pid == os.getpid():
                    continue
                try:
                    os.kill(pid, sig)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return killed

    def measure_bandwidth(self, src: int = 0, dst: int = 1, seconds: float = 1.0,
                          port: int = 5201, python: str = "python3") -> float:
        """Bits/s of one TCP stream from host ``src`` to host ``dst`` (about ``seconds`` long
        at the configured rate; 1 GB cap when unlimited)."""
        size = int(min((self.rate or 8e9) / 8 * seconds, 1e9))
        server = subprocess.Popen(
            self.exec_prefix(dst) + [python, "-c", _PROBE_SERVER, self.hosts[dst].address, str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _harness.run_command(self.exec_prefix(src) + [python, "-c", _PROBE_CLIENT,
                                                          self.hosts[dst].address, str(port), str(size)],
                                 timeout=30 + 20 * seconds)
            out, err = server.communicate(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        if server.returncode != 0:
            raise RuntimeError(f"bandwidth probe server failed: {err.strip()}")
        received, elapsed = out.split()
        return 8 * float(received) / max(float(elapsed), 1e-9)

    def move_into_cgroup(self, k: int) -> List[int]:
        """Moves every process now in host ``k``'s namespace into its CPU-quota cgroup
        (whole processes, all threads); their future children stay there."""
        if self.cpus is None or self._cgroup is None:
            raise RuntimeError("the cluster has no CPU quota (cpus=None) or is not up")
        procs = os.path.join(self._cgroup[0], self.hosts[k].namespace, "cgroup.procs")
        moved = []
        for pid in self.pids(self.hosts[k].namespace):
            try:
                with open(procs, "w") as f:
                    f.write(str(pid))
                moved.append(pid)
            except OSError as exc:  # it exited meanwhile
                log.debug("could not move pid %d into %s: %s", pid, procs, exc)
        return moved

    def _existing(self) -> List[str]:
        out = self._run(["ip", "netns", "list"])
        return self.parse_netns_list(out.stdout or "")

    def cleanup_stale(self) -> List[str]:
        """Deletes leftovers of an earlier (crashed) cluster with this prefix."""
        removed = []
        for cmd in self.teardown_commands(self._existing()):
            killed = self.kill_processes([cmd[-1]])
            if killed:
                log.warning("killed %d leftover processes in %s", len(killed), cmd[-1])
            self._run(cmd)
            removed.append(cmd[-1])
        if self._run is _default_runner:
            self._remove_cgroups(stale=True)
        if removed:
            log.warning("removed stale namespaces of an earlier run: %s", ", ".join(removed))
        return removed

    def up(self) -> "NetnsCluster":
        """Takes the prefix lock, removes stale leftovers, builds the cluster."""
        lock_path = f"/run/{self.prefix}-netns.lock"
        self._lock_file = open(lock_path, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            self._lock_file.close()
            self._lock_file = None
            raise RuntimeError(f"another live process holds {lock_path}: a cluster with prefix "
                               f"{self.prefix!r} is in use; wait for it or choose another prefix") from exc
        try:
            self.cleanup_stale()
            self._up = True
            for cmd in self.setup_commands():
                try:
                    self._run(cmd)
                except subprocess.CalledProcessError as exc:
                    raise RuntimeError(f"`{' '.join(cmd)}` failed: {(exc.stderr or '').strip()}") from exc
            if self.cpus is not None:
                self._make_cgroups()
            # Bridged frames must not go through netfilter in the switch namespace.
            self._run(["ip", "netns", "exec", self.switch, "sh", "-c",
                       "f=/proc/sys/net/bridge/bridge-nf-call-iptables; "
                       "[ -w $f ] && echo 0 > $f || true"])
        except BaseException:
            self.down()
            raise
        rate = "unlimited" if self.rate is None else f"{self.rate / 1e6:g} Mbit/s each way"
        cpu = "" if self.cpus is None else f", {self.cpus:g} cores per host"
        log.info("netns cluster up: %d hosts %s.1-%d behind %s, links %s%s", len(self.hosts),
                 self.subnet, len(self.hosts), self.switch, rate, cpu)
        return self

    def _make_cgroups(self) -> None:
        found = cgroup_cpu_root()
        if found is None:
            raise RuntimeError("cpus= needs a cgroup cpu controller (cgroup v1 /sys/fs/cgroup/cpu "
                               "or cgroup v2 with cpu enabled); none is mounted")
        self._cgroup = found
        root, version = found
        for h in self.hosts:
            os.makedirs(os.path.join(root, h.namespace), exist_ok=True)
            for path, value in cgroup_settings(root, version, h.namespace, self.cpus):
                with open(path, "w") as f:
                    f.write(value)

    def _remove_cgroups(self, stale: bool = False) -> None:
        """Removes the hosts' cgroups (with ``stale``: any ``<prefix>-nsK`` cgroup)."""
        found = self._cgroup or cgroup_cpu_root()
        if found is None:
            return
        root = found[0]
        if stale:
            pattern = re.compile(rf"{re.escape(self.prefix)}-ns\d+")
            try:
                names = [n for n in os.listdir(root) if pattern.fullmatch(n)]
            except OSError:
                names = []
        else:
            names = [h.namespace for h in self.hosts] if self.cpus is not None else []
        for name in names:
            path = os.path.join(root, name)
            for attempt in range(50):  # killed processes take a moment to leave
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 49:
                        log.error("could not remove cgroup %s (processes still in it?)", path)
                    time.sleep(0.1)

    def down(self) -> None:
        """Deletes every namespace of the cluster (errors are logged, not raised)."""
        try:
            if self._up:
                try:
                    existing: Optional[List[str]] = self._existing()
                except Exception:  # noqa: BLE001
                    existing = None
                for cmd in self.teardown_commands(existing):
                    try:
                        self.kill_processes([cmd[-1]])
                        self._run(cmd)
                    except Exception as exc:  # noqa: BLE001
                        log.error("teardown: `%s` failed: %s", " ".join(cmd), exc)
                self._remove_cgroups()
                self._up = False
                log.info("netns cluster %s torn down", self.prefix)
        finally:
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None

    def __enter__(self) -> "NetnsCluster":
        missing = missing_prerequisites() if self._run is _default_runner else []
        if missing:
            raise RuntimeError("cannot build a netns cluster, missing: " + "; ".join(missing))
        self._old_sigterm = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread: no handler, teardown still runs on exceptions
            self._old_sigterm = None
        try:
            return self.up()
        except BaseException:
            self._restore_sigterm()
            raise

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def __exit__(self, *exc: Any) -> None:
        try:
            self.down()
        finally:
            self._restore_sigterm()
