"""A daemon that runs but does not answer (SIGSTOPped): the trainer's error says so.

Telling the user to start a daemon when one is running, only stopped, hung or overloaded,
sends them the wrong way (a second daemon on the same socket cannot start). Both ways a
trainer meets a silent daemon are covered with a real daemon process stopped by SIGSTOP:
a call on an open connection, and a fresh ``connect()`` whose hello goes unanswered (in
a child process, so it does not reuse this process's cached connection). The error is a
:class:`DaemonUnavailableError` (existing ``except`` clauses still catch it) that names
the socket, the pid and what to check, and never advises starting one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import wait_for
from ckptd.protocol import MessageType
from ckpt_client import DaemonUnavailableError, connect
from ckpt_client.errors import DaemonNotAnsweringError


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        return any(line.startswith("State:") and "T" in line.split()[1] for line in f)


def assert_names_a_silent_daemon(text: str, socket: str, pid: int) -> None:
    assert "Start one with" not in text, text
    assert f"at {socket} is running but silent" in text, text
    assert f"ckptd status --socket {socket}" in text, text
    assert f"pid {pid}" in text and "SIGSTOP" in text, text


def test_a_call_to_a_stopped_daemon_says_it_runs_but_is_silent(daemon):
    conn = connect(daemon.socket, auto_start=False, rank=0)
    assert conn.call(MessageType.PING).pid == daemon.pid  # it answers while running
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(daemon.pid), 30, "the daemon to be stopped")
        with pytest.raises(DaemonUnavailableError) as caught:
            conn.call(MessageType.PING, timeout=1)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert isinstance(caught.value, DaemonNotAnsweringError)
    assert "did not answer a ping request within 1s" in str(caught.value)
    assert_names_a_silent_daemon(str(caught.value), daemon.socket, daemon.pid)
    wait_for(lambda: not stopped(daemon.pid), 30, "the daemon to resume")
    assert conn.call(MessageType.PING).pid == daemon.pid  # resumed, it answers again


CONNECT = """
import sys
from ckpt_client import connect
from ckpt_client.errors import DaemonNotAnsweringError
try:
    connect(sys.argv[1], auto_start=False, rank=0)
except DaemonNotAnsweringError as exc:
    print(exc)
    sys.exit(3)
"""


def test_connecting_to_a_stopped_daemon_says_it_runs_but_is_silent(daemon):
    env = {**os.environ, "CKPTD_HELLO_TIMEOUT": "1"}
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(daemon.pid), 30, "the daemon to be stopped")
        child = subprocess.run([sys.executable, "-c", CONNECT, daemon.socket], env=env,
                               capture_output=True, text=True, timeout=120)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert child.returncode == 3, (child.returncode, child.stdout, child.stderr)
    assert "did not answer its hello within 1s" in child.stdout, child.stdout
    assert_names_a_silent_daemon(child.stdout, daemon.socket, daemon.pid)
