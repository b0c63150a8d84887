"""A daemon that runs but does not answer (SIGSTOPped): the trainer's error says so.

Telling the user to start a daemon when one is running, only stopped, hung or overloaded,
sends them the wrong way (a second daemon on the same socket cannot start). Both ways a
trainer meets a silent daemon are covered with a real daemon process stopped by SIGSTOP:
a call on an open connection, and a fresh ``connect()`` whose hello goes unanswered (in
a child process, so it does not reuse this process's cached connection). The error is a
:class:`DaemonUnavailableError` (existing ``except`` clauses still catch it) that names
the socket, the pid and what to check, and never advises starting one.

Several saves in flight on a daemon that stops: the first unanswered call marks the
connection, and the other saves give up at once instead of each waiting a call timeout;
the daemon, resumed, drops them all and serves the next save. Zero-stall saves queued
for staging behind a STAGE that goes unanswered likewise fail at once, and the request
that STAGE makes once the daemon resumes is dropped at once (the trainer's abort names the
STAGE message), so it holds no pool space. A STAGE sent ahead that its save drops on a
marked connection is given up the same way, without waiting for its reply.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import pytest

import torch

from conftest import wait_for
from faults import writers_paused
from ckptd.protocol import MessageType
from ckpt_client import DaemonUnavailableError, TorchAsyncCheckpoint, connect
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
import threading
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


@pytest.mark.parametrize("call_timeout, hello_timeout", [("1", None), ("1.5", "0.5")],
                         ids=["recheck_as_long", "production"])
def test_saves_in_flight_on_a_stopped_daemon_wait_one_call_timeout_not_one_each(
        daemon, monkeypatch, call_timeout, hello_timeout):
    """Three saves in flight when the daemon is SIGSTOPped: finalize asks about the first,
    its POLL goes unanswered for the call timeout, the second's recheck for its short wait
    (a hello timeout, shorter than a call's by default), and the third is given up without
    asking (their errors say an earlier call went unanswered; before, each waited its own
    call timeout). Resumed, the daemon answers the POLLs late, and the replies read late
    (to those POLLs or to the aborts the given-up saves queued) clear the connection's mark
    with no new request answered (nobody waits for them; before, they were never read and
    the mark stayed until a new request was answered); it drops all three saves (their
    aborts were queued) and a new save on the same connection commits."""
    monkeypatch.setenv("CKPTD_CALL_TIMEOUT", call_timeout)
    if hello_timeout is not None:
        monkeypatch.setenv("CKPTD_HELLO_TIMEOUT", hello_timeout)
    paths = [os.path.join(daemon.roots[0], f"s{i}.pt") for i in range(3)]
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket, failure_policy="warn")
    try:
        with writers_paused(daemon):  # the saves stay in flight while the daemon is stopped
            for i, path in enumerate(paths):
                checkpoint.async_save({"w": torch.full((1 << 12,), float(i))}, path)
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: stopped(daemon.pid), 30, "the daemon to be stopped")
                checkpoint.finalize_async_save(blocking=True)
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            connection = connect(daemon.socket, auto_start=False)
            wait_for(lambda: connection.not_answering is None, 15,
                     "the resumed daemon's late answers to clear the mark")
            wait_for(lambda: not daemon.status()["saves"], 60, "the resumed daemon's aborts")
        errors = [exc.failures[0] for _, exc in checkpoint.failed_calls]
        assert len(errors) == 3, errors
        waited = f"within {call_timeout}s"  # as waited: "1.5s", not rounded
        assert f"did not answer a poll request {waited}" in errors[0], errors[0]
        for path, error in zip(paths[1:], errors[1:]):
            assert error.startswith(f"rank 0: gave up on the save of {path}"), error
            assert f"did not answer an earlier poll request on this connection {waited}" \
                in error, error
        for error in errors:
            assert_names_a_silent_daemon(error, daemon.socket, daemon.pid)
        wait_for(lambda: not any(w["jobs"] for w in daemon.status()["writers"]), 60,
                 "the writers to answer the dropped saves")
        assert not any(os.path.exists(path) for path in paths), "a given-up save committed"
        checkpoint.async_save({"w": torch.full((1 << 12,), 7.0)}, paths[0])
        checkpoint.finalize_async_save(blocking=True)
        assert len(checkpoint.failed_calls) == 3, "the save after the resume failed"
        assert torch.load(paths[0], weights_only=True)["w"][0] == 7.0
        assert connect(daemon.socket, auto_start=False).not_answering is None
    finally:
        checkpoint.close()


def daemon_with_short_stage_waits(start_daemon, monkeypatch, **options):
    """A daemon, and this trainer, that wait about 2 s for a STAGE's reply (1 s for a call)."""
    for knob, value in (("CALL_TIMEOUT", "1"), ("STAGE_TIMEOUT", "1"), ("WAIT_MARGIN", "0")):
        monkeypatch.setenv(f"CKPTD_{knob}", value)
    return start_daemon(env={"CKPTD_STAGE_TIMEOUT": "1"}, **options)


@contextlib.contextmanager
def stopped_after_hello(daemon):
    """This process connected (its hello answered), then ``daemon`` SIGSTOPped for the
    block, and resumed (SIGCONT) after it, whatever happens."""
    connect(daemon.socket, auto_start=False)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(daemon.pid), 30, "the daemon to be stopped")
        yield
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def test_zero_stall_saves_queued_behind_an_unanswered_stage_fail_at_once(start_daemon,
                                                                         monkeypatch):
    """Three zero-stall saves queued while the daemon is stopped: the background thread's
    first STAGE goes unanswered for its whole wait (2.5 s here), and the two saves queued
    behind it fail without a STAGE of their own (before, each waited as long again).
    Resumed, the daemon serves a new save on the same connection."""
    daemon = daemon_with_short_stage_waits(start_daemon, monkeypatch)
    paths = [os.path.join(daemon.roots[0], f"z{i}.pt") for i in range(3)]
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket, failure_policy="warn")
    try:
        with stopped_after_hello(daemon):
            for i, path in enumerate(paths):
                checkpoint.async_save({"w": torch.full((1 << 12,), float(i))}, path,
                                      zero_stall=True)
            checkpoint.finalize_async_save(blocking=True)
        errors = [exc.failures[0] for _, exc in checkpoint.failed_calls]
        assert len(errors) == 3, errors
        assert "did not answer a stage request within 2.5s" in errors[0], errors[0]
        for path, error in zip(paths[1:], errors[1:]):
            assert error.startswith(f"rank 0: staging {path} failed"), error
            assert "did not answer an earlier stage request on this connection" in error, error
            assert_names_a_silent_daemon(error, daemon.socket, daemon.pid)
        checkpoint.async_save({"w": torch.full((1 << 12,), 7.0)}, paths[1])
        checkpoint.finalize_async_save(blocking=True)
        assert len(checkpoint.failed_calls) == 3, "the save after the resume failed"
        assert torch.load(paths[1], weights_only=True)["w"][0] == 7.0
        assert not os.path.exists(paths[0]) and not os.path.exists(paths[2])
    finally:
        checkpoint.close()


def test_a_stage_given_up_on_leaves_no_request_holding_the_pool(start_daemon, monkeypatch):
    """A zero-stall save whose STAGE the stopped daemon does not answer: the trainer gives
    up on it (it never learns the request id). Resumed, the daemon reads the STAGE and
    makes the request anyway, then the abort the trainer left naming that STAGE: the
    request is dropped and its three quarters of the pool are free at once (before, they
    stayed held until the staging deadline, 600 s, and the next save found no room)."""
    daemon = daemon_with_short_stage_waits(start_daemon, monkeypatch, pool_size="16M")
    paths = [os.path.join(daemon.roots[0], f"o{i}.pt") for i in range(2)]
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket, failure_policy="warn")
    try:
        with stopped_after_hello(daemon):
            checkpoint.async_save({"w": torch.zeros(3 << 20)}, paths[0], zero_stall=True)
            checkpoint.finalize_async_save(blocking=True)
        [(_, failure)] = checkpoint.failed_calls
        assert "did not answer a stage request" in failure.failures[0], failure.failures
        wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 15,
                 "the resumed daemon to free the space of the STAGE given up on")
        status = daemon.status()
        assert not status["saves"], status["saves"]
        assert [r["phase"] for r in status["requests"]] == ["aborted"], status["requests"]
        checkpoint.async_save({"w": torch.full((3 << 20,), 7.0)}, paths[1])
        checkpoint.finalize_async_save(blocking=True)
        assert len(checkpoint.failed_calls) == 1, "the save after the resume failed"
        assert torch.load(paths[1], weights_only=True)["w"][0] == 7.0
        assert not os.path.exists(paths[0])
    finally:
        checkpoint.close()


def test_a_save_sent_ahead_and_dropped_on_a_stopped_daemon_returns_at_once(daemon,
                                                                             monkeypatch):
    """The third save of a steady layout sends its STAGE ahead to a daemon stopped after a
    call on the connection went unanswered (the connection is marked); the state dict
    cannot be saved (a dtype ckptd cannot store), so the save drops what it sent ahead.
    It raises while the daemon is still stopped, like every other give-up on a marked
    connection (before, it waited for the STAGE's reply: the daemon's whole staging wait
    plus a margin, ten minutes by default). Resumed, the daemon makes the request and
    drops it at once (the abort the trainer left names the STAGE): nothing stays held,
    and the next save on the same connection commits."""
    monkeypatch.setenv("CKPTD_CALL_TIMEOUT", "1")  # marks the connection soon
    monkeypatch.delenv("CKPTD_STAGE_TIMEOUT", raising=False)  # the STAGE reply's long wait
    from test_torch_async import record_sends_ahead

    sent = record_sends_ahead(monkeypatch)
    paths = [os.path.join(daemon.roots[0], f"a{i}.pt") for i in range(4)]
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket, failure_policy="warn")
    outcome: list = []

    def save_what_cannot_be_saved() -> None:
        try:
            checkpoint.async_save({"w": torch.zeros(1 << 12, dtype=torch.float8_e5m2fnuz)},
                                  paths[2])
        except BaseException as exc:  # reported to the test's thread
            outcome.append(exc)

    try:
        for path in paths[:2]:
            checkpoint.async_save({"w": torch.full((1 << 12,), 1.0)}, path)
        checkpoint.finalize_async_save(blocking=True)
        with stopped_after_hello(daemon):
            connection = connect(daemon.socket, auto_start=False)
            with pytest.raises(DaemonNotAnsweringError):
                connection.call(MessageType.PING)
            assert connection.not_answering is not None
            saving = threading.Thread(target=save_what_cannot_be_saved, daemon=True)
            saving.start()
            wait_for(lambda: not saving.is_alive(), 30,
                     "the save that dropped its STAGE sent ahead to return")
            assert stopped(daemon.pid), "the save returned only once the daemon resumed"
        assert sent == [False, False, True], sent
        [error] = outcome
        assert isinstance(error, TypeError) and "float8_e5m2fnuz" in str(error), error

        def dropped() -> bool:
            # The pool is empty before the resumed daemon reads the STAGE too, and a status
            # call from another connection can be served between the STAGE and the ABORT
            # queued behind it: wait for the request to exist, aborted, with nothing held.
            doc = daemon.status()
            phases = [r["phase"] for r in doc["requests"] if r["path"] == paths[2]]
            return phases == ["aborted"] and doc["pool"]["used_bytes"] == 0

        wait_for(dropped, 30, "the resumed daemon to drop the request the STAGE sent ahead made")
        checkpoint.async_save({"w": torch.full((1 << 12,), 7.0)}, paths[3])
        checkpoint.finalize_async_save(blocking=True)
        assert not checkpoint.failed_calls, checkpoint.failed_calls
        assert torch.load(paths[3], weights_only=True)["w"][0] == 7.0
        assert not os.path.exists(paths[2])
    finally:
        checkpoint.close()
