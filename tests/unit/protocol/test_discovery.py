"""Finding the daemon: socket path rules, the ready file, waiting for readiness."""

import json
import os
import socket
import subprocess
import sys

import pytest

from ckptd import protocol
from ckptd.protocol import ProtocolError


def test_socket_path_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(protocol.SOCKET_ENV, str(tmp_path / "env.sock"))
    assert protocol.resolve_socket_path(tmp_path / "arg.sock") == str(tmp_path / "arg.sock")
    assert protocol.resolve_socket_path() == str(tmp_path / "env.sock")
    monkeypatch.delenv(protocol.SOCKET_ENV)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert protocol.resolve_socket_path() == str(tmp_path / "ckptd" / "ckptd.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert protocol.resolve_socket_path() == f"/tmp/ckptd-{os.getuid()}/ckptd.sock"


def test_too_long_socket_path_gets_a_clear_error(tmp_path):
    with pytest.raises(ProtocolError, match="unix sockets allow"):
        protocol.endpoint_for("/" + "x" * 200)
    assert protocol.endpoint_for("/run/x.sock") == "ipc:///run/x.sock"


def test_private_dir_is_closed_to_others(tmp_path):
    path = tmp_path / "run"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    protocol.ensure_private_dir(str(path))
    assert os.stat(path).st_mode & 0o777 == 0o700


def test_the_ready_file_sits_beside_the_socket_and_names_the_pid(tmp_path):
    sock = str(tmp_path / "ckptd.sock")
    assert protocol.ready_file_for(sock) == str(tmp_path / "ckptd.ready")
    assert protocol.ready_pid(sock) is None
    (tmp_path / "ckptd.ready").write_text("not json")
    assert protocol.ready_pid(sock) is None
    (tmp_path / "ckptd.ready").write_text(json.dumps({"pid": 1234}))
    assert protocol.ready_pid(sock) == 1234


def test_waiting_for_readiness_ends_when_the_process_writes_its_ready_file(tmp_path):
    sock = str(tmp_path / "ckptd.sock")
    code = ("import json, os, sys; path = sys.argv[1]\n"
            "open(path + '.tmp', 'w').write(json.dumps({'pid': os.getpid()}))\n"
            "os.rename(path + '.tmp', path)\n"
            "sys.stdin.read()\n")
    process = subprocess.Popen([sys.executable, "-c", code, protocol.ready_file_for(sock)],
                               stdin=subprocess.PIPE)
    try:
        assert protocol.wait_until_ready(sock, process, timeout=60) is None
    finally:
        process.stdin.close()
        process.wait(30)


def test_waiting_for_readiness_reports_a_process_that_exited(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    reason = protocol.wait_until_ready(str(tmp_path / "ckptd.sock"), process, timeout=60)
    assert reason == "exited with status 3 before it was ready"


def test_a_socket_is_live_only_while_something_listens(tmp_path):
    path = str(tmp_path / "s.sock")
    assert not protocol.socket_is_live(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    try:
        assert protocol.socket_is_live(path)
    finally:
        server.close()
    assert not protocol.socket_is_live(path)  # the file is left behind, nobody answers
