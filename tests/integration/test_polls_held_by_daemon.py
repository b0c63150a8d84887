"""A POLL the real daemon holds until a save changes phase, and a channel shared fairly.

One torch save is made by hand (STAGE, then STAGED when the test says so), so the request
stays in ``staging`` exactly as long as a test needs: a held POLL about it must not be
answered before the STAGED, and must be answered once the save moves on, at its bound,
at a goodbye, or when the daemon stops. Every assertion is on what was answered and in
which order, never on how long anything took.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from conftest import wait_for
from ckptd import knobs, protocol
from ckptd.protocol import MessageType, Phase, Poll, SaveFormat, Stage, Staged
from ckpt_client import TorchAsyncCheckpoint
from ckpt_client.errors import DaemonUnavailableError
from ckpt_client.transport.connection import DaemonConnection, connect
from ckpt_client.transport.flatten import buffers_of, flatten_state_dict
from ckpt_client.transport.phase_poll import ask_phase, poll_hold


#: Polls the daemon may hold longer than any test step takes, so a poll answered early
#: can only have been answered for a reason, never because its wait ran out.
LONG_HOLDS = {"CKPTD_POLL_HOLD_MAX": "600"}


def stage_by_hand(connection: DaemonConnection, path: str) -> int:
    """A torch save whose STAGE is answered and whose STAGED is not sent yet: its request
    stays in phase ``staging`` until the test sends it."""
    flat = flatten_state_dict({"w": torch.arange(1024, dtype=torch.float32)})
    reply = connection.call(MessageType.STAGE, Stage(
        format=SaveFormat.TORCH, path=path, buffers=buffers_of(flat.layout),
        skeleton=flat.skeleton), timeout=30)
    assert reply.phase == Phase.STAGING
    return reply.request_id


class HeldPoll(threading.Thread):
    """A thread that asks about ``request_id`` with a POLL the daemon may hold."""

    def __init__(self, connection: DaemonConnection, request_id: int, seen: str,
                 wait_seconds: float = 600.0) -> None:
        super().__init__(daemon=True)
        self.connection, self.request_id = connection, request_id
        self.body = Poll(request_ids=[request_id], wait_seconds=wait_seconds,
                         seen={request_id: seen})
        self.sent = threading.Event()
        self.state = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            msg_id = self.connection.send(MessageType.POLL, self.body)
            self.sent.set()
            self.state = self.connection.reply_to(msg_id, MessageType.POLL,
                                                  timeout=700).requests[self.request_id]
        except Exception as exc:  # the test reads it
            self.error = exc
        finally:
            self.sent.set()

    @property
    def answered(self) -> bool:
        return self.state is not None or self.error is not None


def a_held_poll(start_daemon, name: str, wait_seconds: float = 600.0, **options):
    """A daemon, a connection to it, a save staged by hand and a thread whose held POLL
    about it the daemon has read: ``(daemon, connection, request_id, poll)``."""
    daemon = start_daemon(env={**LONG_HOLDS, **options.pop("env", {})}, **options)
    connection = connect(daemon.socket)
    request_id = stage_by_hand(connection, os.path.join(daemon.roots[0], name))
    poll = HeldPoll(connection, request_id, seen=Phase.STAGING, wait_seconds=wait_seconds)
    poll.start()
    assert poll.sent.wait(30)
    assert connection.call(MessageType.PING, timeout=30).pid == daemon.pid  # POLL is read
    assert not poll.answered
    return daemon, connection, request_id, poll


def test_a_held_poll_waits_for_the_phase_change_while_other_calls_go_through(start_daemon):
    """Thread A's POLL is held while the save stays in ``staging``; meanwhile thread B's
    calls on the same connection (its socket lent in turns) are all answered, and A is
    still waiting after them. B's STAGED moves the save on and A hears of it; held POLLs
    follow the save to ``done``, the last one with its file."""
    daemon = start_daemon(env=LONG_HOLDS)
    connection = connect(daemon.socket)
    path = os.path.join(daemon.roots[0], "held.pt")
    request_id = stage_by_hand(connection, path)
    poll = HeldPoll(connection, request_id, seen=Phase.STAGING)
    poll.start()
    assert poll.sent.wait(30)
    for _ in range(20):  # each one is answered after the POLL was read by the daemon
        assert connection.call(MessageType.PING, timeout=30).pid == daemon.pid
    assert connection.call(MessageType.POLL, Poll(request_ids=[request_id]),
                           timeout=30).requests[request_id].phase == Phase.STAGING
    assert not poll.answered, "the POLL was answered while its save stayed in staging"
    connection.call(MessageType.STAGED, Staged(request_id=request_id), timeout=30)
    poll.join(60)
    assert poll.error is None and poll.state.phase != Phase.STAGING
    while poll.state.phase not in Phase.FINISHED:  # writing -> done
        poll = HeldPoll(connection, request_id, seen=poll.state.phase)
        poll.run()
        assert poll.error is None
    assert poll.state.phase == Phase.DONE and [w.path for w in poll.state.written] == [path]
    assert torch.load(path, weights_only=True)["w"].shape == (1024,)  # bytes: never copied


def test_status_and_metrics_count_the_polls_held(start_daemon, tmp_path):
    """``ckptd status`` (``--json`` and the table) and the ``ckptd_held_polls`` gauge show
    the POLL the daemon holds while its save stays in staging, and none once the save
    moved on and it was answered."""
    from ckptd.status import query_status, render

    textfile = str(tmp_path / "metrics" / "ckptd.prom")
    os.makedirs(os.path.dirname(textfile))
    daemon, connection, request_id, poll = a_held_poll(
        start_daemon, "counted.pt", extra_args=["--metrics-textfile", textfile],
        env={"CKPTD_METRICS_INTERVAL": "0.1"})
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}
    shown = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", daemon.socket,
                            "--json"], capture_output=True, text=True, timeout=60, env=env,
                           stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["held_polls"] == {"held": 1, "connections": 1}
    assert "polls   1 held until their save moves on, for 1 trainer connection(s)" \
        in render(doc).splitlines()

    def exported() -> float | None:
        try:
            with open(textfile) as f:
                lines = [line for line in f if line.startswith("ckptd_held_polls ")]
        except FileNotFoundError:
            return None
        return float(lines[0].split()[1]) if lines else None

    wait_for(lambda: exported() == 1, 30, "ckptd_held_polls 1 in the metrics textfile")
    connection.call(MessageType.STAGED, Staged(request_id=request_id), timeout=30)
    poll.join(60)
    assert poll.error is None and poll.state.phase != Phase.STAGING
    code, doc, why = query_status(daemon.socket)
    assert code == 0, why
    assert doc["held_polls"] == {"held": 0, "connections": 0}
    wait_for(lambda: exported() == 0, 30, "ckptd_held_polls 0 in the metrics textfile")
    connection.close()


def test_a_held_poll_is_answered_unchanged_at_its_bound_and_at_once_without_a_wait(
        start_daemon):
    """The daemon caps the wait (``CKPTD_POLL_HOLD_MAX``): a POLL asking for an hour is
    answered, the save still staging; an old client's POLL (no wait) and one whose
    trainer saw another phase are answered at once, in the order they were sent."""
    daemon = start_daemon(env={"CKPTD_POLL_HOLD_MAX": "1"})
    connection = connect(daemon.socket)
    request_id = stage_by_hand(connection, os.path.join(daemon.roots[0], "bound.pt"))
    held = HeldPoll(connection, request_id, seen=Phase.STAGING, wait_seconds=3600)
    held.run()  # within the call timeout: the daemon's cap ended the wait
    assert held.error is None and held.state.phase == Phase.STAGING
    first = connection.send(MessageType.POLL, Poll(request_ids=[request_id], wait_seconds=60,
                                                   seen={request_id: Phase.WRITING}))
    second = connection.send(MessageType.POLL, Poll(request_ids=[request_id]))
    ping = connection.send(MessageType.PING)
    heard, watch = [], connection.channel.on_reply
    connection.channel.on_reply = lambda msg_id: (heard.append(msg_id), watch(msg_id))
    assert connection.reply_to(ping, MessageType.PING, timeout=30).pid == daemon.pid
    assert heard[:3] == [first, second, ping], "a POLL with news to give was held"
    for msg_id in (first, second):
        assert connection.reply_to(msg_id, MessageType.POLL, timeout=5) \
            .requests[request_id].phase == Phase.STAGING


def test_a_held_poll_is_answered_at_its_bound_not_at_the_next_housekeeping_tick(start_daemon):
    """The daemon's housekeeping tick comes once at start and then not for ten minutes;
    the trainer's call timeout is 2 s, so it asks for 1 s holds: each is answered at its
    bound (the serve loop wakes for it), and the healthy daemon is never marked not
    answering. Answered at the tick, each would have met the call timeout first."""
    daemon = start_daemon(env={"CKPTD_SERVE_TICK": "600"})
    with knobs.override(CALL_TIMEOUT=2.0):
        connection = connect(daemon.socket)
        request_id = stage_by_hand(connection, os.path.join(daemon.roots[0], "tick.pt"))
        assert poll_hold(connection) == 1.0
        for _ in range(3):
            state = ask_phase(connection, request_id, Phase.STAGING, hold=True)
            assert state.phase == Phase.STAGING and connection.not_answering is None


def test_a_held_poll_is_answered_when_its_trainer_says_goodbye(start_daemon):
    """A thread still waits on a held POLL when the trainer closes its connection: the
    daemon aborts the save (never staged) and then answers the POLL, before the goodbye:
    the answer is the save's end, never the phase the trainer already saw."""
    daemon, connection, request_id, poll = a_held_poll(start_daemon, "bye.pt")
    connection.close()
    poll.join(60)
    assert poll.error is None, poll.error
    assert poll.state.phase == Phase.ABORTED, poll.state


def test_a_held_poll_is_answered_when_the_daemon_stops(start_daemon):
    """SIGTERM: the drain gives up on the save that is never staged, and the held POLL
    gets the save's end as its answer before the daemon's socket closes."""
    daemon, connection, request_id, poll = a_held_poll(
        start_daemon, "stop.pt", wait_seconds=3600, extra_args=["--drain-timeout", "1"])
    daemon.process.send_signal(signal.SIGTERM)
    poll.join(90)
    assert poll.error is None, poll.error
    assert poll.state.phase == Phase.FAILED and "shut down" in poll.state.error
    assert daemon.process.wait(60) == 0


def test_a_blocking_finalize_asks_with_held_polls(daemon, monkeypatch):
    """``finalize_async_save(blocking=True)`` asks the daemon with POLLs it may hold, each
    saying the phase last seen: a handful for a save, not one every 10 ms."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    monkeypatch.setenv("CKPTD_POLL_HOLD", "30")  # no expiry within the save
    polls = []
    real_send = DaemonConnection.send

    def spy(self, msg_type, body=None, frames=()):
        if msg_type == MessageType.POLL:
            polls.append(body)
        return real_send(self, msg_type, body, frames)

    monkeypatch.setattr(DaemonConnection, "send", spy)
    checkpoint = TorchAsyncCheckpoint()
    path = os.path.join(daemon.roots[0], "finalize.pt")
    state = {"w": torch.randn(256, 256)}
    checkpoint.async_save(state, path)
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
    held = [p for p in polls if p.wait_seconds > 0]
    assert held and all(p.seen for p in held)
    # staging/writing/done: at most one immediate ask and one held ask per phase change
    assert len(polls) <= 4, [(p.wait_seconds, p.seen) for p in polls]
    checkpoint.close()
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "the extent freed")


#: A trainer whose SIGUSR1 handler calls the daemon (a launcher's "save now" signal),
#: signalled while its main thread waits on a held POLL (a blocking finalize).
SIGNALLED_DURING_A_HELD_POLL = """
import json, os, signal, sys, threading
sys.path.insert(0, sys.argv[2])
from conftest import wait_for
from integration.test_polls_held_by_daemon import stage_by_hand
from ckptd.protocol import MessageType, Phase
from ckpt_client.transport.connection import connect
from ckpt_client.transport.phase_poll import ask_phase

connection = connect(sys.argv[1], auto_start=False)
request_id = stage_by_hand(connection, os.path.join(sys.argv[3], "signalled.pt"))
main, seen = threading.current_thread(), {}

def handler(signum, frame):
    seen["poll_awaited"] = bool(connection.channel._awaited)  # the main thread waits on it
    seen["ping"] = connection.call(MessageType.PING, timeout=30).pid

signal.signal(signal.SIGUSR1, handler)

def waiting_for_a_reply():
    frame = sys._current_frames().get(main.ident)
    while frame is not None and frame.f_code.co_name != "_receive":
        frame = frame.f_back
    return frame is not None

def signal_once_the_poll_is_held():
    wait_for(waiting_for_a_reply, 30, "the main thread waiting for the POLL's reply")
    os.kill(os.getpid(), signal.SIGUSR1)

threading.Thread(target=signal_once_the_poll_is_held, daemon=True).start()
state = ask_phase(connection, request_id, Phase.STAGING, hold=True)
print(json.dumps({**seen, "phase": state.phase}))
"""


def test_a_signal_handler_calls_the_daemon_while_its_thread_waits_on_a_held_poll(
        start_daemon):
    """The main thread holds the channel's turn, waiting on a held POLL, when a signal
    handler on that thread calls the daemon: the handler's call shares the turn and is
    answered, and the POLL is answered after it (queued behind its own thread, the
    handler would wait forever)."""
    daemon = start_daemon(env={"CKPTD_POLL_HOLD_MAX": "2"})
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run(
        [sys.executable, "-c", SIGNALLED_DURING_A_HELD_POLL, daemon.socket, tests,
         daemon.roots[0]], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.splitlines()[-1]) == {
        "poll_awaited": True, "ping": daemon.pid, "phase": Phase.STAGING}


#: A trainer whose SIGUSR1 handler calls the daemon, signalled while its main thread is
#: inside the connection's record of replies (AnswerWatch.heard, under its lock): raised
#: from a trace hook on heard's first line inside the lock, the signal's handler runs
#: right there, as one that lands at that moment does.
SIGNALLED_WHILE_A_REPLY_IS_RECORDED = """
import json, signal, sys
from ckptd.protocol import MessageType
from ckpt_client.transport.connection import connect

connection = connect(sys.argv[1], auto_start=False)
seen, lines = {}, []

def handler(signum, frame):
    seen["ping"] = connection.call(MessageType.PING, timeout=30).pid

def trace(frame, event, arg):
    if frame.f_code.co_name != "heard" or "silence" not in frame.f_code.co_filename:
        return None
    def in_heard(frame, event, arg):
        if event == "line":
            lines.append(frame.f_lineno)
            if len(lines) == 2:  # the first statement under the lock
                sys.settrace(None)
                signal.raise_signal(signal.SIGUSR1)
        return in_heard
    return in_heard

signal.signal(signal.SIGUSR1, handler)
sys.settrace(trace)
seen["own"] = connection.call(MessageType.PING, timeout=30).pid
sys.settrace(None)
print(json.dumps(seen))
"""


def test_a_signal_handler_calls_the_daemon_while_its_thread_records_a_reply(start_daemon):
    """A signal lands while the main thread records a reply it read (the connection's
    AnswerWatch, under its lock) and its handler calls the daemon: the handler's call is
    answered (a plain lock there waited forever for the thread it had interrupted), and
    so is the interrupted call."""
    daemon = start_daemon()
    child = subprocess.run(
        [sys.executable, "-c", SIGNALLED_WHILE_A_REPLY_IS_RECORDED, daemon.socket],
        capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.splitlines()[-1]) == {"ping": daemon.pid,
                                                         "own": daemon.pid}


def test_a_process_forked_while_a_thread_holds_the_socket_connects_afresh(start_daemon):
    """A process forks (a DataLoader worker, a process runner) while a thread of its
    parent holds the channel's turn and another waits on a held POLL: the child's
    connect() makes a connection of its own and its calls are answered; the inherited
    one says it is closed instead of waiting forever for a thread that is not there."""
    daemon, connection, request_id, poll = a_held_poll(start_daemon, "fork.pt")
    holding, release = threading.Event(), threading.Event()

    def hold_the_turn():
        with connection.channel._lock:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold_the_turn, daemon=True)
    holder.start()
    assert holding.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 2
        try:
            fresh = connect(daemon.socket)
            answered = fresh.call(MessageType.PING, timeout=30).pid == daemon.pid
            try:
                connection.call(MessageType.PING, timeout=5)
                inherited_refused = False
            except DaemonUnavailableError as exc:
                inherited_refused = "forked" in str(exc)
            code = 0 if fresh is not connection and answered and inherited_refused else 1
        finally:
            os._exit(code)
    release.set()
    finished = []

    def child_done():
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            finished.append(status)
        return bool(finished)

    try:
        wait_for(child_done, 60, "the forked child to finish (not hang on the turn)")
    finally:
        if not finished:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(finished[0]) == 0
    connection.call(MessageType.ABORT, _abort(request_id), timeout=30)  # the parent's goes on
    poll.join(60)
    assert poll.error is None and poll.state.phase == Phase.ABORTED


class RecordedTurns(protocol.Turns):
    """The channel's turns, with who asked for the socket and who got it, in order: each
    recorded by the turns themselves as it happens (getting in line, taking the turn), so
    the log's order is the order the turns were served in."""

    def __init__(self) -> None:
        super().__init__(on_event=lambda event: self.log.append(
            (event, threading.current_thread().name)))
        self.log: list = []

    def turns_taken_while_waiting(self, name: str) -> list:
        """For each time ``name`` asked: how many turns others got before its own."""
        counts, waiting = [], None
        for event, who in list(self.log):
            if who == name:
                if event == "ask":
                    waiting = 0
                elif waiting is not None:
                    counts.append(waiting)
                    waiting = None
            elif event == "got" and waiting is not None:
                waiting += 1
        return counts


@pytest.mark.parametrize("threads", [3])
def test_threads_waiting_on_one_channel_take_the_socket_in_turns(start_daemon, threads):
    """Several threads each keep a held POLL outstanding on one connection (each taking
    the socket for short slices, over and over) while another thread's calls run: every
    call completes while all the POLLs are still held, and each time the caller asks for
    the socket it gets it before any poller has a second turn."""
    daemon = start_daemon(env=LONG_HOLDS)
    connection = connect(daemon.socket)
    request_id = stage_by_hand(connection, os.path.join(daemon.roots[0], "turns.pt"))
    turns = connection.channel._lock = RecordedTurns()  # nobody uses the socket now
    polls = [HeldPoll(connection, request_id, seen=Phase.STAGING) for _ in range(threads)]
    for poll in polls:
        poll.start()
    assert all(poll.sent.wait(30) for poll in polls)
    done = []

    def caller():
        for _ in range(10):
            done.append(connection.call(MessageType.STATUS, timeout=30)["pid"])

    worker = threading.Thread(target=caller, name="caller", daemon=True)
    worker.start()
    worker.join(60)
    assert done == [daemon.pid] * 10
    assert not any(poll.answered for poll in polls)
    waited = turns.turns_taken_while_waiting("caller")
    assert waited and max(waited) <= threads, waited
    connection.call(MessageType.ABORT, _abort(request_id), timeout=30)
    for poll in polls:
        poll.join(60)
        assert poll.error is None and poll.state.phase == Phase.ABORTED


def _abort(request_id: int):
    from ckptd.protocol import Abort

    return Abort(request_ids=[request_id], reason="the test is over")
