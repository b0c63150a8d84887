"""A connection whose daemon died hands the CUDA IPC releases it owed back to this process.

The export cache registers that payment on the connection when it is made
(``DaemonConnection.when_daemon_dies``); nothing finds it by module name. These tests
run the real :class:`DaemonConnection` and :class:`ExportCache` with a real dead process
id; only the request channel is a stand-in (nothing here talks to a daemon), and the
release function is recorded instead of touching CUDA counters, which this machine lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptd import protocol
from ckpt_client.errors import DaemonUnavailableError
from ckpt_client.transport import cuda_exports
from ckpt_client.transport.connection import DaemonConnection


class QuietChannel:
    """The request channel of a daemon that answers nothing (it is gone)."""

    def __init__(self) -> None:
        self.closed = False
        self.sent: list = []

    def send(self, msg_type, body, frames=()) -> int:
        self.sent.append((msg_type, body))
        return len(self.sent)

    def wait(self, msg_id, timeout, alive=None):
        raise protocol.ReplyTimeout(self.sent[msg_id - 1][0])

    def call(self, msg_type, body, frames=(), timeout=None, alive=None):
        return self.wait(self.send(msg_type, body, frames), timeout, alive)

    def drop(self, msg_id) -> None:
        pass  # nothing comes to drop

    def collect(self) -> None:
        pass  # nothing comes to read

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert not protocol.process_alive(process.pid)
    return process.pid


def connection_to(pid: int) -> DaemonConnection:
    hello = protocol.HelloReply(daemon_pid=pid, incarnation="test", version="test",
                                pool_path="/nonexistent", pool_size=0)
    return DaemonConnection("/nonexistent/ckptd.sock", QuietChannel(), hello, rank=0)


@pytest.fixture
def released(monkeypatch) -> list:
    paid: list = []
    monkeypatch.setattr(protocol, "release_ipc_counters", lambda specs: paid.extend(specs))
    return paid


def owe_one_export(connection: DaemonConnection) -> dict:
    """A save whose fresh export reached the daemon and then failed: the release is owed."""
    cache = cuda_exports.export_cache(connection)
    spec = {"handle": b"h", "ref_counter_handle": "/torch_1", "ref_counter_offset": 7}
    specs, number, _ = cache.storage_specs([(0, 4096, 64)], lambda j: spec)
    cache.settle(number, [(0, 4096, 64)], specs, kept=None)
    return spec


def test_closing_a_connection_whose_daemon_died_pays_the_releases_it_owed(dead_pid, released):
    connection = connection_to(dead_pid)
    spec = owe_one_export(connection)
    assert released == []
    connection.close()
    assert released == [spec], "the export cache was not told that its daemon died"


def test_a_live_daemon_keeps_its_releases(released):
    connection = connection_to(os.getpid())  # a live process stands in for the daemon
    owe_one_export(connection)
    connection.close()
    assert released == []


def test_death_hooks_run_once(dead_pid):
    connection = connection_to(dead_pid)
    calls = []
    connection.when_daemon_dies(calls.append)
    connection.close()
    connection.close()
    assert calls == [connection]


def test_a_request_is_its_typed_body():
    connection = connection_to(os.getpid())
    with pytest.raises(TypeError, match="typed body"):
        connection.call(protocol.MessageType.POLL, {"request_ids": [1]})
    with pytest.raises(TypeError, match="is not a forget request"):
        connection.call(protocol.MessageType.FORGET, protocol.Poll(request_ids=[1]))
    channel = connection.channel
    with pytest.raises(DaemonUnavailableError, match="did not answer a poll request"):
        connection.call(protocol.MessageType.POLL, protocol.Poll(request_ids=[3]), timeout=0.01)
    msg_type, body = channel.sent[-1]
    assert msg_type == "poll" and body == {"request_ids": [3], "wait_seconds": 0.0, "seen": {},
                                           "incarnation": "test"}
