"""Readiness signals of the real daemon: sd_notify datagrams, the stdout line, the ready file.

A test AF_UNIX datagram socket stands in for systemd's notify socket (``Type=notify``):
the daemon must send ``READY=1`` (with its ``MAINPID``) once it serves, and
``STOPPING=1`` when SIGTERM starts its shutdown.
"""

import json
import os
import signal
import socket
import uuid

import pytest

from conftest import wait_for
from ckptd.protocol import socket_is_live
from ckptd.status import query_status


def receive_states(sock: socket.socket) -> list[dict]:
    """All datagrams waiting on ``sock``, each parsed into its KEY=VALUE assignments."""
    states = []
    while True:
        try:
            data = sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return states
        states.append(dict(line.split("=", 1) for line in data.decode().splitlines() if line))


class NotifyListener:
    """A datagram socket collecting sd_notify messages, like systemd's."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address.replace("@", "\0", 1) if address.startswith("@") else address)
        self.received: list[dict] = []

    def wait_for_state(self, key: str, timeout: float = 30.0) -> dict:
        def arrived():
            self.received += receive_states(self.sock)
            return next((s for s in self.received if key in s), None)

        return wait_for(arrived, timeout, f"an sd_notify datagram with {key}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def notify(request, tmp_path):
    address = (str(tmp_path / "notify.sock") if request.param == "path"
               else f"@ckptd-test-notify-{uuid.uuid4().hex}")
    listener = NotifyListener(address)
    yield listener
    listener.close()


def test_ready_and_stopping_reach_the_notify_socket(start_daemon, notify):
    daemon = start_daemon(env={"NOTIFY_SOCKET": notify.address})
    ready = notify.wait_for_state("READY")
    assert ready["READY"] == "1"
    assert ready["MAINPID"] == str(daemon.pid)
    assert daemon.socket in ready.get("STATUS", "")
    # READY=1 may only be sent once the socket accepts clients.
    assert socket_is_live(daemon.socket)
    assert not any("STOPPING" in s for s in notify.received)

    daemon.process.send_signal(signal.SIGTERM)
    assert notify.wait_for_state("STOPPING")["STOPPING"] == "1"
    assert daemon.process.wait(60) == 0
    assert sum("READY" in s for s in notify.received) == 1


def test_stdout_line_and_ready_file_announce_the_daemon(start_daemon):
    daemon = start_daemon(writers=1)
    ready_file = os.path.join(os.path.dirname(daemon.socket), "ckptd.ready")
    with open(ready_file) as f:
        info = json.load(f)
    assert info["socket"] == daemon.socket and info["pid"] == daemon.pid
    assert info["writers"] == 1 and info["pool_size"] >= 256 << 20
    line = f"ckptd ready socket={daemon.socket} pid={daemon.pid}"
    wait_for(lambda: line in daemon.log().splitlines(), 30, "the ready line on stdout")

    assert daemon.stop() == 0
    assert not os.path.exists(ready_file), "the ready file must be withdrawn at exit"
    assert not os.path.exists(daemon.socket)


def test_no_notify_socket_means_no_datagram_and_a_normal_start(start_daemon, tmp_path):
    listener = NotifyListener(str(tmp_path / "unused.sock"))
    try:
        daemon = start_daemon(env={"NOTIFY_SOCKET": ""})
        assert socket_is_live(daemon.socket)
        assert daemon.stop() == 0
        assert receive_states(listener.sock) == []
    finally:
        listener.close()


def test_a_stale_notify_socket_does_not_stop_the_daemon(tmp_path):
    import subprocess
    import sys

    sock = str(tmp_path / "run" / "ckptd.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")}
    env.pop("CKPTD_SOCKET", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "serve", "--socket", sock, "--root", str(tmp_path),
         "--pool-size", "16M", "--writers", "1"], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Answering a status request means the serve loop runs (the socket and the ready
        # file exist a moment before sd_notify is called).
        answers = lambda: os.path.exists(sock) and query_status(sock, timeout=2)[0] == 0
        wait_for(lambda: process.poll() is not None or answers(), 120,
                 "the daemon to answer or exit")
        assert process.poll() is None, f"ckptd exited with {process.returncode}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        # A daemon that failed during start-up leaves its staging pool behind.
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptd-{os.getuid()}-{process.pid}-"):
                os.unlink(os.path.join("/dev/shm", name))


# ------------------------------------------------------------------ the systemd unit

UNIT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "deploy", "systemd", "ckptd@.service")


def unit_settings() -> dict:
    """``Key -> [values]`` of deploy/systemd/ckptd@.service (comments skipped)."""
    settings: dict = {}
    with open(UNIT) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", ";", "[")):
                key, _, value = line.partition("=")
                settings.setdefault(key, []).append(value)
    return settings


def test_unit_is_type_notify_with_its_socket_in_the_runtime_directory():
    settings = unit_settings()
    assert settings["Type"] == ["notify"] and settings["NotifyAccess"] == ["main"]
    assert settings["RuntimeDirectory"] == ["ckptd/%i"]
    assert settings["RuntimeDirectoryMode"] == ["0700"]
    [exec_start] = settings["ExecStart"]
    assert " serve --socket %t/ckptd/%i/ckptd.sock " in exec_start
    assert "PrivateDevices" not in settings, "a private /dev hides /dev/shm from the trainers"
    drain = float(exec_start.split("--drain-timeout", 1)[1].split()[0])
    assert float(settings["TimeoutStopSec"][0]) > drain, "systemd must not kill a drain early"


def test_the_units_command_line_serves_and_notifies_like_under_systemd(tmp_path):
    """Run ExecStart as systemd would expand it, with a notify socket standing in for systemd's."""
    import subprocess
    import sys

    settings = unit_settings()
    runtime = tmp_path / "run"  # %t
    instance = "job7"           # %i
    directory = runtime / settings["RuntimeDirectory"][0].replace("%i", instance)
    directory.mkdir(parents=True, mode=0o700)
    roots = tmp_path / "ckpt"
    roots.mkdir()
    words = settings["ExecStart"][0].replace("%t", str(runtime)).replace("%i", instance).split()
    assert words[0].endswith("/ckptd")
    args = [a for w in words[1:] for a in ([f"--root={roots}", "--pool-size", "64M",
                                            "--writers", "1"] if w == "$CKPTD_ARGS" else [w])]
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    env = {**os.environ, "NOTIFY_SOCKET": listener.address}
    env.pop("CKPTD_SOCKET", None)
    with open(tmp_path / "unit.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "ckptd", *args], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        ready = listener.wait_for_state("READY", timeout=120)
        assert ready["MAINPID"] == str(process.pid)
        assert socket_is_live(str(directory / "ckptd.sock"))
        process.send_signal(signal.SIGTERM)
        listener.wait_for_state("STOPPING")
        assert process.wait(float(settings["TimeoutStopSec"][0])) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        listener.close()
