"""Tests of the network-namespace test bed itself (``tests/netbed.py``).

Real namespaces, real sockets, real processes. Tests that need namespaces skip with the
bed's own reason where it had to fall back to loopback; every wait is on a condition with
a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys

import pytest

from conftest import wait_for
from conftest_netbed import netbed  # noqa: F401  (the fixture)
import netbed as netbed_module
from netbed import NetBed, NetBedUnsupported, parse_rate, tbf_burst_bytes

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETBED_PY = os.path.join(TESTS_DIR, "netbed.py")
TIMEOUT = 30.0

# Answers each connection with "<peer address> <what the peer sent>".
ECHO_SERVER = r"""
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    with conn:
        conn.sendall(peer[0].encode() + b" " + conn.recv(64))
"""

# Reads "host port timeout" lines; tries one connection each (from this node's address)
# and prints "ok <reply>" or "fail <exception>".
PROBER = r"""
import os, socket, sys
for line in sys.stdin:
    host, port, timeout = line.split()
    source = "127.0.0.1" if host.startswith("127.0.0.") else os.environ["NETBED_IP"]
    try:
        with socket.create_connection((host, int(port)), timeout=float(timeout),
                                      source_address=(source, 0)) as s:
            s.sendall(b"hello")
            reply = b""
            while part := s.recv(64):
                reply += part
        print("ok", reply.decode(), flush=True)
    except OSError as exc:
        print("fail", type(exc).__name__, flush=True)
"""

GLOO_RANK = r"""
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(dist.get_rank(), value.item(), flush=True)
dist.destroy_process_group()
"""

# A process that leaves its session and process group, printing its pid.
STRAY = ["sh", "-c", "setsid sh -c 'echo $$; exec sleep 1000' & wait"]

# Makes a bed, starts processes in it (in netns mode one of them like STRAY), prints the
# bed and the pids, then waits for a signal. SIGINT gets Python's usual handler first: a
# suite started as a shell's background job passes SIGINT on ignored, and an owner that
# ignores it rightly keeps running (the SIGINT case then waited out its 30 s and failed).
# Likewise SIGHUP and SIGTERM get their default: a suite run under nohup passes SIGHUP on
# ignored (the SIGHUP case failed that way).
OWNER = r"""
import json, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
sys.path.insert(0, sys.argv[1])
from netbed import NetBed
with NetBed(2, tmpfs_size="16m") as bed:
    pids = [bed.popen(0, ["sleep", "1000"]).pid]
    if bed.mode == "netns":
        stray = bed.popen(1, json.loads(sys.argv[2]), stdout=subprocess.PIPE, text=True)
        pids.append(int(stray.stdout.readline()))
    print(json.dumps({**bed.describe(), "pids": pids}), flush=True)
    signal.pause()
"""


class Lines:
    """Lines from a process's stdout, each waited for with a timeout (no blocking read)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.buffer = proc, b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(proc.stdout, selectors.EVENT_READ)

    def next(self, timeout: float = TIMEOUT) -> str:
        def line():
            if b"\n" in self.buffer:
                return True
            if self.selector.select(0.05):
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    pytest.fail(f"process exited ({self.proc.wait()}) before writing a line")
                self.buffer += chunk
            return b"\n" in self.buffer

        wait_for(line, timeout, "a line from the process")
        text, self.buffer = self.buffer.split(b"\n", 1)
        return text.decode()


def start_server(bed: NetBed, i: int, host: str | None = None) -> int:
    port = bed.free_port(i)
    proc = bed.popen(i, [sys.executable, "-c", ECHO_SERVER, host or bed.nodes[i].ip, str(port)],
                     stdout=subprocess.PIPE)
    assert Lines(proc).next() == "listening"
    return port


class Prober:
    """A process in one node that tries connections on request."""

    def __init__(self, bed: NetBed, i: int):
        self.proc = bed.popen(i, [sys.executable, "-c", PROBER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
        self.lines = Lines(self.proc)

    def connect(self, host: str, port: int, timeout: float = 0.5) -> str:
        self.proc.stdin.write(f"{host} {port} {timeout}\n".encode())
        self.proc.stdin.flush()
        return self.lines.next(timeout + TIMEOUT)


def bed_remains(desc: dict, pids=()) -> list[str]:
    """What is left of a bed: namespaces, mounts, files, root-namespace links, processes."""
    name, left = desc["name"], []
    token = name[len(netbed_module.NAME_PREFIX):]
    if os.path.isdir("/run/netns"):
        left += [f"namespace {n}" for n in os.listdir("/run/netns") if n.startswith(name)]
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {line.split()[4]}" for line in f if name in line.split()[4]]
    for path in (desc["dir"], os.path.join(os.path.dirname(desc["dir"]), name + ".json")):
        if os.path.exists(path):
            left.append(f"file {path}")
    if desc["mode"] == "netns":
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        left += [f"root-namespace link {line}" for line in links.splitlines() if token in line]
    left += [f"process {pid}" for pid in pids if netbed_module._running(pid)]
    return left


# -- reaching each other -------------------------------------------------------------------

def test_nodes_reach_each_other_by_tcp_through_the_bridge(netbed):
    bed = netbed(3, tmpfs_size="16m")
    print(f"bed mode: {bed.mode} ({bed.mode_reason})")
    port = start_server(bed, 2)
    for i in (0, 1):
        # The server sees the client's own node address: the bytes went node to node.
        assert Prober(bed, i).connect(bed.nodes[2].ip, port) == f"ok {bed.nodes[i].ip} hello"
    assert len({n.ip for n in bed.nodes}) == 3


def test_a_nodes_loopback_is_its_own(netbed):
    bed = netbed(2, tmpfs_size="16m", require_netns=True)
    port = start_server(bed, 1, host="127.0.0.1")
    assert Prober(bed, 1).connect("127.0.0.1", port) == "ok 127.0.0.1 hello"
    assert Prober(bed, 0).connect("127.0.0.1", port).startswith("fail ConnectionRefused")


def test_nothing_of_the_bed_is_in_the_root_namespace(netbed):
    bed = netbed(2, tmpfs_size="16m", require_netns=True)
    token = bed.name[len(netbed_module.NAME_PREFIX):]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert token not in links
    assert bed.nodes[0].ip not in addrs
    # ...while the node namespace holds its link and address.
    inside = bed.run(0, ["ip", "-o", "addr", "show", "dev", bed.nodes[0].ifname]).stdout
    assert f"{bed.nodes[0].ip}/24" in inside
    routes = bed.run(0, ["ip", "route"]).stdout
    assert "default" not in routes, "a node must have no way out of the bed"


# -- node-local storage --------------------------------------------------------------------

def test_node_local_dirs_are_separate(netbed):
    bed = netbed(2, tmpfs_size="16m")
    bed.run(0, ["sh", "-c", 'echo zero > "$NETBED_LOCAL_DIR/part"'])
    assert open(os.path.join(bed.nodes[0].local_dir, "part")).read() == "zero\n"
    assert not os.path.exists(os.path.join(bed.nodes[1].local_dir, "part"))
    assert bed.nodes[0].local_dir != bed.nodes[1].local_dir


def test_each_node_has_a_tmpfs_of_its_own(netbed):
    bed = netbed(2, tmpfs_size="8m", require_netns=True)
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4]: line.split(" - ")[1].split()[0] for line in f}
    assert [mounts.get(n.local_dir) for n in bed.nodes] == ["tmpfs", "tmpfs"]
    assert os.stat(bed.nodes[0].local_dir).st_dev != os.stat(bed.nodes[1].local_dir).st_dev
    free_before = os.statvfs(bed.nodes[1].local_dir).f_bavail
    # Filling node 0 ends in ENOSPC there and takes nothing from node 1.
    filled = bed.run(0, ["dd", "if=/dev/zero", f"of={bed.nodes[0].local_dir}/fill", "bs=1M",
                         "count=16"], check=False)
    assert filled.returncode != 0 and "No space left" in filled.stderr
    assert os.statvfs(bed.nodes[0].local_dir).f_bavail == 0
    assert os.statvfs(bed.nodes[1].local_dir).f_bavail == free_before


# -- links -----------------------------------------------------------------------------------

def tbf_of(text: str) -> dict:
    match = re.search(r"qdisc tbf .* rate (\S+) burst (\d+)b lat (\S+)", text)
    assert match, f"no tbf qdisc in: {text!r}"
    return {"rate": parse_rate(match.group(1)), "burst": int(match.group(2)),
            "latency": match.group(3)}


def test_tc_shows_the_configured_tbf_rate(netbed):
    bed = netbed(2, rate="2gbit", tmpfs_size="16m", require_netns=True)
    for side in ("node", "bridge"):
        tbf = tbf_of(bed.qdisc(1, side))
        assert tbf == {"rate": 2e9, "burst": tbf_burst_bytes("2gbit"), "latency": "50ms"}
    # What tc shows from inside the node is what the bed says it set.
    assert tbf_of(bed.run(0, ["tc", "qdisc", "show", "dev", bed.nodes[0].ifname]).stdout)["rate"] == 2e9
    bed.set_rate(1, "100mbit")
    assert tbf_of(bed.qdisc(1, "node"))["rate"] == tbf_of(bed.qdisc(1, "bridge"))["rate"] == 1e8
    bed.set_rate(1, None)
    assert "tbf" not in bed.qdisc(1, "node") + bed.qdisc(1, "bridge")
    assert tbf_of(bed.qdisc(0, "node"))["rate"] == 2e9, "node 0 keeps its own limit"


def test_rates_and_bursts_are_parsed_as_tc_spells_them():
    assert parse_rate("2gbit") == parse_rate("2Gbit") == 2e9
    assert parse_rate("1gbps") == 8e9
    assert parse_rate("1mibit") == 2**20
    assert parse_rate("5000") == 5000
    assert tbf_burst_bytes("2gbit") == 1_000_000  # 4 ms of 2 Gbit/s
    assert tbf_burst_bytes("1mbit") == netbed_module.MIN_BURST_BYTES
    for bad in ("fast", "2gbits", "-1mbit", ""):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError):
        NetBed(2, rate="lots")


def test_link_down_fails_connections_and_link_up_restores_them(netbed):
    bed = netbed(2, tmpfs_size="16m", require_netns=True)
    port = start_server(bed, 1)
    prober = Prober(bed, 0)
    assert prober.connect(bed.nodes[1].ip, port).startswith("ok")
    bed.link_down(1)
    wait_for(lambda: prober.connect(bed.nodes[1].ip, port).startswith("fail"), TIMEOUT,
             "connections to a node whose link is down to fail")
    bed.link_up(1)
    wait_for(lambda: prober.connect(bed.nodes[1].ip, port).startswith("ok"), TIMEOUT,
             "connections to work again after link_up")


# -- processes -----------------------------------------------------------------------------

def test_gloo_ranks_in_two_nodes_all_reduce_over_the_bridge(netbed):
    bed = netbed(2, tmpfs_size="16m")
    port = bed.free_port(0)
    ranks = [bed.popen(i, [sys.executable, "-c", GLOO_RANK], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=bed.rank_env(i, i, 2, port))
             for i in (0, 1)]
    outputs = []
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err
        outputs.append(out.split())
    assert outputs == [["0", "3.0"], ["1", "3.0"]]
    assert bed.rank_env(1, 1, 2, port)["GLOO_SOCKET_IFNAME"] == bed.nodes[1].ifname
    assert bed.rank_env(1, 1, 2, port)["MASTER_ADDR"] == bed.nodes[0].ip


# -- teardown on every exit path -----------------------------------------------------------

@pytest.mark.parametrize("body_raises", [False, True], ids=["body returns", "body raises"])
def test_nothing_remains_after_the_context_exits(body_raises):
    class BodyFailed(Exception):
        pass

    pids = []
    with pytest.raises(BodyFailed) if body_raises else contextlib.nullcontext():
        with NetBed(2, tmpfs_size="16m") as bed:
            desc = bed.describe()
            pids.append(bed.popen(0, ["sleep", "1000"]).pid)
            if bed.mode == "netns":
                stray = bed.popen(1, STRAY, stdout=subprocess.PIPE)
                pids.append(int(Lines(stray).next()))
                assert os.path.ismount(bed.nodes[1].local_dir)
            assert all(netbed_module._running(p) for p in pids)
            if body_raises:
                raise BodyFailed()
    assert bed_remains(desc, pids) == []


def start_owner() -> tuple[subprocess.Popen, dict]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, TESTS_DIR, json.dumps(STRAY)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    desc = json.loads(Lines(owner).next())
    assert bed_remains(desc, desc["pids"]), "the bed should be up while its owner runs"
    return owner, desc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signalled_owner_removes_its_bed(sig):
    owner, desc = start_owner()
    owner.send_signal(sig)
    _, err = owner.communicate(timeout=TIMEOUT)
    if sig != signal.SIGINT:
        # The handler tore the bed down, then let the signal end the process as it would.
        assert owner.returncode == -sig, err.decode()
    assert bed_remains(desc, desc["pids"]) == []


def test_down_removes_a_bed_left_by_a_killed_owner():
    owner, desc = start_owner()
    owner.kill()
    owner.wait(TIMEOUT)
    assert bed_remains(desc, desc["pids"]), "SIGKILL leaves the bed (nothing can run)"
    listed = subprocess.run([sys.executable, NETBED_PY, "list"], capture_output=True, text=True,
                            timeout=TIMEOUT, check=True).stdout
    assert re.search(rf"^{desc['name']}\s+stale", listed, re.M), listed
    down = subprocess.run([sys.executable, NETBED_PY, "down"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert down.returncode == 0, down.stderr
    assert f"removed {desc['name']}" in down.stdout
    assert bed_remains(desc, desc["pids"]) == []
    again = subprocess.run([sys.executable, NETBED_PY, "down", desc["name"]], capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert again.returncode == 0, again.stderr


def test_a_live_bed_of_another_process_survives_down_without_all():
    owner, desc = start_owner()
    try:
        down = subprocess.run([sys.executable, NETBED_PY, "down"], capture_output=True,
                              text=True, timeout=TIMEOUT, check=True)
        assert desc["name"] not in down.stdout
        assert bed_remains(desc, desc["pids"])
    finally:
        owner.terminate()
        owner.communicate(timeout=TIMEOUT)
    assert bed_remains(desc, desc["pids"]) == []


def test_cli_up_leaves_a_bed_that_down_removes():
    up = subprocess.run([sys.executable, NETBED_PY, "up", "2", "--tmpfs-size", "16m"],
                        capture_output=True, text=True, timeout=TIMEOUT)
    assert up.returncode == 0, up.stderr
    desc = json.loads(up.stdout)
    try:
        assert [n["index"] for n in desc["nodes"]] == [0, 1]
        assert bed_remains(desc), "the bed outlives the `up` command"
        bed = NetBed.attach(desc["name"])
        assert [n.ip for n in bed.nodes] == [n["ip"] for n in desc["nodes"]]
        assert bed.run(1, ["sh", "-c", 'echo "$NETBED_IP"']).stdout.strip() == desc["nodes"][1]["ip"]
    finally:
        down = subprocess.run([sys.executable, NETBED_PY, "down", desc["name"]],
                              capture_output=True, text=True, timeout=TIMEOUT)
    assert down.returncode == 0, down.stderr
    assert bed_remains(desc) == []


# -- loopback fallback ---------------------------------------------------------------------

def test_loopback_fallback_says_why_and_still_runs_nodes(netbed):
    bed = netbed(2, tmpfs_size="16m", mode="loopback")
    assert bed.mode == "loopback" and "loopback mode was asked for" in bed.mode_reason
    assert [n.ip for n in bed.nodes] == [f"127.77.{bed.octet}.1", f"127.77.{bed.octet}.2"]
    assert [n.ifname for n in bed.nodes] == ["lo", "lo"]
    port = start_server(bed, 1)
    assert Prober(bed, 0).connect(bed.nodes[1].ip, port) == f"ok {bed.nodes[0].ip} hello"
    for operation in (lambda: bed.link_down(1), lambda: bed.set_rate(1, "1gbit")):
        with pytest.raises(NetBedUnsupported, match="loopback mode"):
            operation()
