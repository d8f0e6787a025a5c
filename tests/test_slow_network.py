"""Pure parts of benchmarks/slow_network.py and benchmarks/_netns.py.

No namespaces are created and nothing is trained: command construction, argument
validation, the missing-prerequisite path (root / iproute2 faked with
monkeypatch), teardown of stale leftovers against a recorded `ip netns list`, and
the result summaries.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _netns  # noqa: E402
import slow_network as sn  # noqa: E402


class Recorder:
    """A runner that records commands and answers `ip netns list` / `ip netns pids`."""

    def __init__(self, netns_list: str = "", pids: str = "") -> None:
        self.calls: List[List[str]] = []
        self.netns_list = netns_list
        self.pid_text = pids

    def __call__(self, cmd: Sequence[str]) -> "subprocess.CompletedProcess[str]":
        cmd = list(cmd)
        self.calls.append(cmd)
        out = ""
        if cmd[:3] == ["ip", "netns", "list"]:
            out = self.netns_list
        elif cmd[:3] == ["ip", "netns", "pids"]:
            out = self.pid_text
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")


# ------------------------------------------------------------------ _netns: pure parts
def test_parse_rate_units_and_errors():
    assert _netns.parse_rate("100mbit") == 100e6
    assert _netns.parse_rate("1gbit") == 1e9
    assert _netns.parse_rate("1.5Gbit") == 1.5e9
    assert _netns.parse_rate(2.5e8) == 2.5e8
    assert _netns.parse_rate("1e8") == 1e8
    for bad in ("fast", "100mb/s", "-5mbit", "0", ""):
        with pytest.raises(ValueError):
            _netns.parse_rate(bad)


def test_tbf_args_burst_scales_with_rate():
    slow = _netns.tbf_args(100e6)
    fast = _netns.tbf_args(10e9)
    assert slow[:3] == ["tbf", "rate", "100000000bit"]
    assert int(slow[slow.index("burst") + 1]) == 64 * 1024  # the floor
    assert int(fast[fast.index("burst") + 1]) == int(10e9 / 8 * 0.002)  # 2 ms of traffic
    assert slow[slow.index("latency") + 1] == "50ms"


def test_setup_commands_limit_both_directions_of_every_link():
    c = _netns.NetnsCluster(hosts=3, rate="100mbit", runner=Recorder())
    cmds = c.setup_commands()
    assert cmds[0] == ["ip", "netns", "add", "pd-sw"]
    assert [h.address for h in c.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    for h in c.hosts:
        assert ["ip", "netns", "add", h.namespace] in cmds
        assert ["ip", "-n", h.namespace, "link", "set", "lo", "up"] in cmds
        assert ["ip", "link", "add", h.ifname, "netns", h.namespace, "type", "veth",
                "peer", "name", h.switch_ifname, "netns", "pd-sw"] in cmds
        assert ["ip", "-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.ifname] in cmds
        assert ["ip", "-n", "pd-sw", "link", "set", h.switch_ifname, "master", "pd-br"] in cmds
        tbf = [cmd for cmd in cmds if "tbf" in cmd and (h.ifname in cmd or h.switch_ifname in cmd)]
        # host -> switch on the host end, switch -> host on the switch end
        assert [cmd[3] for cmd in tbf] == [h.namespace, "pd-sw"]
        assert all("100000000bit" in cmd for cmd in tbf)
        # the namespace exists before anything is put into it
        assert cmds.index(["ip", "netns", "add", h.namespace]) < cmds.index(tbf[0])
    # interface names fit Linux's 15 characters
    assert all(len(h.ifname) <= 15 and len(h.switch_ifname) <= 15 for h in c.hosts)


def test_setup_commands_without_rate_have_no_qdisc_and_custom_prefix():
    c = _netns.NetnsCluster(hosts=2, prefix="pdt", subnet="10.78.5", runner=Recorder())
    cmds = c.setup_commands()
    assert not any("tc" in cmd for cmd in cmds)
    assert c.namespaces() == ["pdt-sw", "pdt-ns0", "pdt-ns1"]
    assert c.hosts[1].address == "10.78.5.2"
    assert c.exec_prefix(1) == ["ip", "netns", "exec", "pdt-ns1"]


def test_cluster_argument_validation():
    for kwargs in ({"hosts": 0}, {"hosts": 300}, {"hosts": 2, "prefix": "Bad-Name"},
                   {"hosts": 2, "prefix": "muchtoolongprefix"}, {"hosts": 2, "subnet": "10.77"},
                   {"hosts": 2, "subnet": "10.77.300"}, {"hosts": 2, "rate": "0mbit"},
                   {"hosts": 2, "cpus": 0.0}):
        with pytest.raises(ValueError):
            _netns.NetnsCluster(runner=Recorder(), **kwargs)


def test_teardown_deletes_own_and_stale_namespaces_only():
    c = _netns.NetnsCluster(hosts=2, runner=Recorder())
    listing = "pd-ns1 (id: 4)\npd-sw (id: 2)\npd-ns7\nother-ns (id: 1)\npd-nsx\npdx-ns0\n"
    existing = c.parse_netns_list(listing)
    assert existing == ["pd-ns1", "pd-sw", "pd-ns7", "other-ns", "pd-nsx", "pdx-ns0"]
    cmds = c.teardown_commands(existing)
    # hosts (also pd-ns7, left by a larger crashed cluster) before the switch; others untouched
    assert cmds == [["ip", "netns", "del", "pd-ns1"], ["ip", "netns", "del", "pd-ns7"],
                    ["ip", "netns", "del", "pd-sw"]]
    assert [cmd[-1] for cmd in c.teardown_commands()] == ["pd-ns0", "pd-ns1", "pd-sw"]


def test_cleanup_stale_kills_leftover_processes_then_deletes(monkeypatch):
    rec = Recorder(netns_list="pd-ns0\npd-sw\n", pids="4242\n")
    killed = []
    monkeypatch.setattr(_netns.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    c = _netns.NetnsCluster(hosts=1, runner=rec)
    assert c.cleanup_stale() == ["pd-ns0", "pd-sw"]
    assert killed == [(4242, _netns.signal.SIGKILL)] * 2
    deletes = [cmd for cmd in rec.calls if cmd[:3] == ["ip", "netns", "del"]]
    assert deletes == [["ip", "netns", "del", "pd-ns0"], ["ip", "netns", "del", "pd-sw"]]
    assert rec.calls.index(["ip", "netns", "pids", "pd-ns0"]) < rec.calls.index(deletes[0])


def test_cpu_quota_settings_and_exec_prefix():
    assert _netns.cgroup_settings("/cg", 1, "pd-ns0", 0.5) == [
        ("/cg/pd-ns0/cpu.cfs_period_us", "10000"), ("/cg/pd-ns0/cpu.cfs_quota_us", "5000")]
    assert _netns.cgroup_settings("/cg", 2, "pd-ns1", 1.5) == [("/cg/pd-ns1/cpu.max", "15000 10000")]
    c = _netns.NetnsCluster(hosts=2, cpus=0.5, runner=Recorder())
    c._cgroup = ("/cg", 1)
    prefix = c.exec_prefix(1)
    # the shell joins the cgroup *before* `ip netns exec` remounts /sys
    assert prefix[:4] == ["sh", "-c", 'echo $$ > "$0" && exec "$@"', "/cg/pd-ns1/cgroup.procs"]
    assert prefix[4:] == ["ip", "netns", "exec", "pd-ns1"]
    assert c.exec_prefix(1, limit_cpu=False) == ["ip", "netns", "exec", "pd-ns1"]


def test_missing_prerequisites_names_root_ip_and_tc(monkeypatch):
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: None)
    missing = _netns.missing_prerequisites()
    assert len(missing) == 3
    assert "root" in missing[0] and "`ip`" in missing[1] and "`tc`" in missing[2]
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    assert _netns.missing_prerequisites() == []


# ------------------------------------------------------------------ slow_network.py
def test_main_without_root_exits_2_with_instructions(monkeypatch, capsys):
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert sn.main(["--models", "digits"]) == 2
    err = capsys.readouterr().err
    assert "root privileges" in err and "`tc`" in err and "`ip`" not in err
    assert "sudo make bench-network" in err and "--models digits" in err


@pytest.mark.parametrize("argv, fragment", [
    (["--bandwidths", "100mbit,fast"], "rate 'fast'"),
    (["--bandwidths", ","], "--bandwidths is empty"),
    (["--models", "digits,resnet"], "unknown model 'resnet'"),
    (["--configs", "ddp,gpipe"], "unknown config 'gpipe'"),
    (["--configs", "ddp,ddp"], "lists a name twice"),
    (["--microbatches", "2"], "needs >= 3"),
    (["--targets", "digits=1.5"], "(0, 1]"),
    (["--targets", "cifar=0.5"], "MODEL=ACCURACY"),
    (["--max-seconds", "0"], "--max-seconds"),
    (["--host-cpus", "-1"], "--host-cpus"),
    (["--worker", "1f1b", "--model", "digits", "--result", "r.json"], "needs --plan"),
])
def test_bad_arguments_exit_2_naming_the_value(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        sn.parse_args(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_good_arguments_are_parsed():
    args = sn.parse_args(["--bandwidths", "100mbit,1gbit", "--models", "mlp", "--configs", "ddp,1f1b",
                          "--targets", "mlp=0.8"])
    assert args.bandwidths == [1e8, 1e9]
    assert args.models == ["mlp"] and args.configs == ["ddp", "1f1b"]
    assert sn.parse_targets(args.targets) == {"mlp": 0.8}
    assert sn.bandwidth_label(1e8) == "100mbit" and sn.bandwidth_label(1e9) == "1gbit"
    assert sn.bandwidth_label(2.5e9) == "2.5gbit"


def test_torchrun_commands_one_node_per_namespace():
    c = _netns.NetnsCluster(hosts=4, runner=Recorder())
    prefixes = [c.exec_prefix(k) for k in range(4)]
    cmds = sn.torchrun_commands(c.hosts, prefixes, "bench.py", ["--worker", "ddp"], 29801, "run7",
                                python="py")
    assert len(cmds) == 4
    for k, cmd in enumerate(cmds):
        assert cmd[:4] == ["ip", "netns", "exec", f"pd-ns{k}"]
        assert f"GLOO_SOCKET_IFNAME=pd-h{k}" in cmd and "OMP_NUM_THREADS=1" in cmd
        assert cmd[cmd.index("py") + 1:cmd.index("py") + 3] == ["-m", "torch.distributed.run"]
        assert cmd[cmd.index("--node-rank") + 1] == str(k)
        assert cmd[cmd.index("--nnodes") + 1] == "4"
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == "10.77.0.1:29801"
        assert cmd[cmd.index("--rdzv-id") + 1] == "run7"
        assert cmd[cmd.index("--local-addr") + 1] == f"10.77.0.{k + 1}"
        assert cmd[cmd.index("--rdzv-conf") + 1].startswith(f"is_host={'true' if k == 0 else 'false'},")
        assert cmd[-3:] == ["bench.py", "--worker", "ddp"]
    with pytest.raises(ValueError):
        sn.torchrun_commands(c.hosts, prefixes[:3], "bench.py", [], 1, "x")


def test_microbatches_and_profile_scaling():
    assert sn.microbatches_for("1f1b", [1, 3], 8) == 9
    assert sn.microbatches_for("1f1b-straight", [1, 1, 1, 1], 8) == 8
    assert sn.microbatches_for("pipedream-2bw", [2, 1, 1], 8) == 8
    assert sn.microbatches_for("pipedream", [1, 3], 8) == 1
    text = ("node2 -- Linear -- forward_compute_time=0.500, backward_compute_time=1.250, "
            "activation_size=100.000, parameter_size=8.000")
    scaled = sn.scale_profile_text(text, 2.0)
    assert "forward_compute_time=1.000000" in scaled and "backward_compute_time=2.500000" in scaled
    assert "activation_size=100.000" in scaled


def _result(times, accs, target=0.9, step=10):
    return {"target": target, "steps": step * len(times),
            "records": [{"step": step * (i + 1), "time": t, "test_acc": a, "train_loss": 1.0,
                         "tx_bytes": 1e6 * (i + 1)} for i, (t, a) in enumerate(zip(times, accs))]}


def test_same_plan_run_dedupes_only_identical_straight_plans():
    plan = {"layers": [[0, 2], [2, 4]], "replicas": [1, 1], "microbatches": 8}
    run = {"model": "mlp", "bw": 1e9, "config": "1f1b", "ok": True}
    plans = {("mlp", 1e9, "1f1b"): plan, ("mlp", 1e9, "1f1b-straight"): dict(plan)}
    assert sn.same_plan_run([run], plans, "mlp", 1e9, "1f1b-straight") is run
    assert sn.same_plan_run([run], plans, "mlp", 1e9, "pipedream") is None
    plans[("mlp", 1e9, "1f1b-straight")] = dict(plan, layers=[[0, 1], [1, 4]])
    assert sn.same_plan_run([run], plans, "mlp", 1e9, "1f1b-straight") is None


def test_time_to_target_and_speedup_over_ddp():
    runs = [
        {"model": "mlp", "bw": 1e8, "config": "ddp", "ok": True, "wall_s": 1.0,
         "result": _result([10, 20, 30, 40], [0.5, 0.8, 0.91, 0.92])},
        {"model": "mlp", "bw": 1e8, "config": "1f1b", "ok": True, "wall_s": 1.0,
         "result": _result([2, 4, 6], [0.7, 0.95, 0.96])},
        {"model": "mlp", "bw": 1e8, "config": "pipedream", "ok": True, "wall_s": 1.0,
         "result": _result([5, 10], [0.5, 0.6])},
    ]
    assert sn.time_to_target(runs[0]["result"]["records"], 0.9)["time"] == 30
    assert sn.time_to_target(runs[2]["result"]["records"], 0.9) is None
    rows = {r["config"]: r for r in sn.summarize(runs, ["mlp"], [1e8], ["ddp", "1f1b", "pipedream"])[("mlp", 1e8)]}
    assert rows["ddp"]["speedup"] == 1.0
    assert rows["1f1b"]["speedup"] == pytest.approx(30 / 4)
    assert rows["1f1b"]["final_acc"] == 0.96 and rows["1f1b"]["steps_to_target"] == 20
    assert rows["pipedream"]["time_to_target"] is None and rows["pipedream"]["speedup"] is None
