"""A daemon restarted under a trainer: a lost save is never finalized as a success.

systemd's ``Restart=on-failure`` (and a SLURM prolog's retry) start a new daemon at the
same socket after the old one was SIGKILLed. The trainer's ZeroMQ socket reconnects to
the new daemon by itself, whose request ids start again at 1: without more, a trainer
asking about its lost request 1 would be told about somebody else's request 1. Every
request is therefore bound to the daemon incarnation that accepted it and to the
connection that made it; a lost save fails with ``CheckpointException`` naming the
restart, and no raw transport error reaches the trainer.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from conftest import start_daemon_process, wait_for
from faults import writers_paused

from ckpt_client import CheckpointException, TorchAsyncCheckpoint, connect
from ckpt_client.transport import handover
from ckpt_client.transport.daemon_save import DaemonSave
from ckpt_client.transport.handover import handover_for
from ckptd import protocol


def kill_daemon_and_writers(daemon) -> None:
    """SIGKILL the daemon and its writers, as a node-level crash would."""
    writers = [w["pid"] for w in daemon.status()["writers"]]
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.process.wait()
    for pid in writers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def other_trainer_saves(socket_path: str, path: str) -> protocol.Channel:
    """A second trainer whose save (request 1 of the new daemon) stays unfinalized."""
    channel = protocol.Channel(protocol.endpoint_for(socket_path))
    channel.call("hello", {"rank": 1, "pid": os.getpid(), "world_size": 2})
    reply = channel.call("stage", {"format": "torch", "path": path, "buffers": [],
                                   "skeleton": protocol.pack_value({"x": 1})}).body
    channel.call("staged", {"request_id": reply["request_id"]})
    return channel


@pytest.fixture
def restartable(tmp_path):
    """Start a daemon; ``restart()`` kills it and starts a new one at the same socket."""
    started = []

    def start():
        started.append(start_daemon_process(tmp_path, name="same"))
        return started[-1]

    def restart():
        with writers_paused(started[-1]):
            kill_daemon_and_writers(started[-1])
        return start()

    yield start, restart
    for daemon in started:
        daemon.stop(signal.SIGKILL, 30)


def test_a_save_lost_in_a_restart_is_reported_not_finalized(restartable, monkeypatch):
    start, restart = restartable
    daemon = start()
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    lost = os.path.join(daemon.roots[0], "A.pt")
    checkpoint = TorchAsyncCheckpoint()
    with writers_paused(daemon):  # the save stays in flight when the node crashes
        checkpoint.async_save({"w": torch.ones(1 << 16)}, lost)
        kill_daemon_and_writers(daemon)
    new = start()
    other = other_trainer_saves(new.socket, os.path.join(new.roots[0], "B.pt"))
    try:
        wait_for(lambda: [r["phase"] for r in new.status()["requests"]] == ["done"], 60,
                 "the other trainer's save")
        with pytest.raises(CheckpointException, match="restarted") as info:
            checkpoint.finalize_async_save(blocking=True)
        assert "A.pt" in str(info.value)
    finally:
        other.close()
    assert not os.path.exists(lost)


def test_saving_again_then_finalizing_the_lost_save_raises_cleanly(restartable, monkeypatch):
    start, restart = restartable
    daemon = start()
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    checkpoint = TorchAsyncCheckpoint()
    with writers_paused(daemon):
        checkpoint.async_save({"w": torch.ones(1 << 16)}, os.path.join(daemon.roots[0], "A.pt"))
        kill_daemon_and_writers(daemon)
    new = start()
    again = os.path.join(new.roots[0], "again.pt")
    checkpoint.async_save({"w": torch.full((8,), 2.0)}, again)  # reconnects to the new daemon
    with pytest.raises(CheckpointException, match="restarted"):
        checkpoint.finalize_async_save(blocking=True)  # the lost save comes first, in order
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(again, weights_only=True)["w"], torch.full((8,), 2.0))


def test_a_request_of_another_incarnation_is_refused_by_the_daemon(restartable):
    start, _ = restartable
    daemon = start()
    channel = protocol.Channel(protocol.endpoint_for(daemon.socket))
    try:
        hello = channel.call("hello", {"rank": 0, "pid": os.getpid()}).body
        assert hello["incarnation"]
        with pytest.raises(protocol.ErrorReply, match="restarted") as info:
            channel.call("poll", {"request_ids": [1], "incarnation": "a-previous-daemon"})
        assert info.value.code == "daemon_restarted"
    finally:
        channel.close()


def test_connect_after_a_restart_retires_the_old_pool_and_saves_through_the_new(
        restartable, monkeypatch):
    start, restart = restartable
    daemon = start()
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"w": torch.ones(1 << 16)}, os.path.join(daemon.roots[0], "A.pt"),
                          zero_stall=True)
    checkpoint.finalize_async_save(blocking=True)
    old = connect()
    kept = handover_for(old)  # its copier's views of the pool outlive the connection
    stager = kept.stager()._thread
    assert stager.is_alive()
    restart()
    new = connect()  # finds the cached connection's daemon dead: closes it
    assert new is not old and old.closed
    with open("/proc/self/maps") as maps:
        assert old.pool_path not in maps.read(), "a dead daemon's pool is still mapped"
    assert old not in handover._handovers and kept.copier.pool is not new.pool
    # Its zero-stall thread ends with it (it held the connection: one thread and one dead
    # connection left behind per reconnection otherwise) ...
    wait_for(lambda: not stager.is_alive(), 30, "the old connection's zero-stall thread to end")
    # ... and a job handed to it late fails at once instead of waiting for a thread.
    late = DaemonSave(old, None, os.path.join(daemon.roots[0], "late.pt"))
    kept.stager().submit(SimpleNamespace(save=late))
    with pytest.raises(CheckpointException, match="was closed"):
        late.wait_staged(timeout=0)
    again = os.path.join(daemon.roots[0], "again.pt")
    checkpoint.async_save({"w": torch.full((8,), 2.0)}, again)
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(again, weights_only=True)["w"], torch.full((8,), 2.0))
