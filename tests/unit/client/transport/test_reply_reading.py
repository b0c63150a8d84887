"""The trainer sends the typed request bodies it builds and reads every reply through its
typed body: a reply it cannot read (another
ckptd version) is one clear :class:`DaemonReplyError` naming the field, never a KeyError.

A daemon-like ROUTER socket on a real unix socket answers with the bodies each test
gives it, through the real framing.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from ckptd import protocol
from ckptd.protocol import HelloReply, MessageType
from ckpt_client.errors import DaemonReplyError, DaemonUnavailableError
from ckpt_client.transport.connection import connect
from ckpt_client.transport.daemon_save import DaemonSave


class FakeDaemon:
    """Answers each request type with a fixed body (a map, sent as it is)."""

    def __init__(self, socket_path: str, answers: dict, silent: tuple = (),
                 late: tuple = (), slow: dict | None = None) -> None:
        self.answers = answers
        self.silent = silent  # request types it reads and never answers (a stopped daemon)
        # Request types whose first request it answers only once the next request came
        # (a daemon slow on that one request, which then answers again).
        self.late = set(late)
        self._held: list = []
        # Request type -> seconds it takes over each of its next requests, in turn.
        self.slow = {kind: list(delays) for kind, delays in (slow or {}).items()}
        self._due: list = []  # (monotonic time, routing id, message) of slow answers
        self.received: list = []  # (message type, body) of each request
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.bind(f"ipc://{socket_path}")
        self.socket_path = socket_path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for due in [d for d in self._due if d[0] <= time.monotonic()]:
                self._due.remove(due)
                self._answer(*due[1:])
            if not self.socket.poll(10):
                continue
            routing_id, *frames = self.socket.recv_multipart()
            message = protocol.decode(frames)
            self.received.append((message.type, message.body))
            if message.type in self.silent:
                continue
            if message.type in self.late:
                self.late.discard(message.type)
                self._held.append((routing_id, message))
                continue
            for to, answered in self._held:
                self._answer(to, answered)
            self._held.clear()
            delay = self.slow.get(message.type, [0]).pop(0) if self.slow.get(message.type) else 0
            if delay:
                self._due.append((time.monotonic() + delay, routing_id, message))
            else:
                self._answer(routing_id, message)

    def _answer(self, to: bytes, message) -> None:
        body = self.answers.get(message.type, {})
        self.socket.send_multipart([to, *protocol.encode(MessageType.REPLY, message.id, body)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close(0)
        self.context.term()


@pytest.fixture
def daemon_at(tmp_path):
    made = []
    pool = tmp_path / "pool"
    pool.write_bytes(b"\0" * 4096)
    hello = HelloReply(daemon_pid=os.getpid(), incarnation="inc-1", version="0.0",
                       pool_path=str(pool), pool_size=4096).to_wire()

    def start(answers: dict, silent: tuple = (), late: tuple = (), slow: dict | None = None) -> str:
        made.append(FakeDaemon(str(tmp_path / "d.sock"), {MessageType.HELLO: hello, **answers},
                               silent, late, slow))
        return str(tmp_path / "d.sock")

    start.made = made

    yield start
    for fake in made:
        fake.close()


def staged_saves(conn, *request_ids: int) -> list:
    """A staged save on ``conn`` for each of ``request_ids``, waiting for its outcome."""
    saves = [DaemonSave(conn, rid, f"/ckpt/s{rid}") for rid in request_ids]
    for save in saves:
        save.mark_staged()
    return saves


def test_a_well_formed_reply_arrives_as_its_typed_body(daemon_at):
    socket = daemon_at({MessageType.PING: {"pid": 5, "added_by_a_newer_daemon": True}})
    conn = connect(socket, auto_start=False, rank=0)
    try:
        assert conn.call(MessageType.PING) == protocol.PingReply(pid=5)
        assert conn.incarnation == "inc-1" and conn.pool_size == 4096
    finally:
        conn.close()


def test_a_malformed_reply_is_a_clear_error_naming_the_field(daemon_at):
    socket = daemon_at({MessageType.POLL: {"requests": {1: {"bytes_total": 3}}}})
    conn = connect(socket, auto_start=False, rank=0)
    try:
        with pytest.raises(DaemonReplyError) as info:
            conn.call(MessageType.POLL, protocol.Poll(request_ids=[1]), timeout=5)
        text = str(info.value)
        assert f"pid {os.getpid()}" in text and socket in text and "poll request" in text
        assert "PollReply.requests[1]: RequestState needs 'phase'" in text
        assert "same ckptd version" in text
        assert isinstance(info.value, DaemonUnavailableError)  # no request there can work
    finally:
        conn.close()


def test_a_save_whose_poll_reply_is_unreadable_fails_with_that_reason(daemon_at):
    socket = daemon_at({MessageType.POLL: {"requests": {1: {"phase": "done",
                                                            "written": [{"size": 3}]}}}})
    conn = connect(socket, auto_start=False, rank=0)
    try:
        save = DaemonSave(conn, 1, "/ckpt/x")
        save.mark_staged()
        assert save.finished and "WrittenFile needs 'name'" in save.error
    finally:
        conn.close()


def test_a_malformed_hello_reply_refuses_the_connection(daemon_at):
    socket = daemon_at({MessageType.HELLO: {"daemon_pid": os.getpid(), "pool_path": "/p"}})
    with pytest.raises(DaemonReplyError, match="HelloReply needs 'incarnation'"):
        connect(socket, auto_start=False, rank=0)


def test_requests_go_out_as_the_typed_bodies_their_senders_built(daemon_at):
    socket = daemon_at({MessageType.FORGET: {"forgotten": [4]}})
    conn = connect(socket, auto_start=False, rank=3)
    try:
        assert conn.call(MessageType.FORGET, protocol.Forget(request_ids=[4])).forgotten == [4]
        with pytest.raises(TypeError, match="a Poll body is not a forget request"):
            conn.call(MessageType.FORGET, protocol.Poll(request_ids=[4]))
        with pytest.raises(TypeError, match="takes its typed body"):
            conn.call(MessageType.FORGET, {"request_ids": [4]})
    finally:
        conn.close()
    received = dict(daemon_at.made[0].received)
    assert protocol.Hello.from_wire(received[MessageType.HELLO]).rank == 3
    forget = received[MessageType.FORGET]
    assert protocol.Forget.from_wire(forget) == protocol.Forget(request_ids=[4])
    assert forget["incarnation"] == "inc-1"  # every request names the daemon it was made for


def test_a_save_given_up_on_asks_the_silent_daemon_nothing_more(daemon_at):
    """The POLL goes unanswered: the save gives up, queueing ABORT then FORGET(delete).
    Consuming its outcome then must not wait on the same silent daemon again: no second
    FORGET, no span report (each waited seconds more for nothing)."""
    from ckptd import knobs
    from ckpt_client.queue import spans

    socket = daemon_at({MessageType.PING: {"pid": 5}}, silent=(MessageType.POLL,))
    conn = connect(socket, auto_start=False, rank=0)
    try:
        save = DaemonSave(conn, 1, "/ckpt/x")
        save.mark_staged()
        save.spans.append(["blocked", 1.0, 2.0])
        with knobs.override(CALL_TIMEOUT=0.2):
            assert save.finished and "gave up on the save of /ckpt/x" in save.error
        save.forget(delete_files=True)  # what the queue does with a finished call
        spans.report([save])
        conn.call(MessageType.PING)  # answered after every request sent before it was read
    finally:
        conn.close()
    sent = [(kind, body) for kind, body in daemon_at.made[0].received
            if kind not in (MessageType.HELLO, MessageType.PING, MessageType.GOODBYE)]
    assert [kind for kind, _ in sent] == [MessageType.POLL, MessageType.ABORT,
                                          MessageType.FORGET], sent
    assert sent[2][1]["delete_files"] is True


@pytest.mark.parametrize("call_timeout, hello_timeout", [(0.2, 5.0), (0.4, 0.1)],
                         ids=["recheck_as_long", "production"])
def test_one_unanswered_call_gives_up_every_save_outstanding_on_the_connection(
        daemon_at, call_timeout, hello_timeout):
    """Three saves in flight on a daemon that stopped answering: the first POLL goes
    unanswered, the second save rechecks with one POLL (a short wait, unanswered too), and
    the third gives up without asking; each says an earlier call went unanswered, instead
    of each waiting a call timeout of its own (k saves cost one timeout and one short
    recheck, not k timeouts). With the default timings (the recheck waits a hello timeout,
    shorter than a call timeout) the silent recheck leaves the first POLL's mark as it
    was; a recheck that waits as long as a call marks the connection anew.
    Dropping them afterwards (close(abort=True)) sends nothing more: each one's abort and
    forget were queued when it gave up. A reply to a later request clears the mark."""
    from ckptd import knobs

    socket = daemon_at({MessageType.PING: {"pid": 5}},
                       silent=(MessageType.POLL, MessageType.ABORT, MessageType.FORGET))
    conn = connect(socket, auto_start=False, rank=0)
    try:
        saves = staged_saves(conn, 1, 2, 3)
        first_poll = conn.channel._next_id  # then its ABORT, FORGET, the recheck's POLL
        with knobs.override(CALL_TIMEOUT=call_timeout, HELLO_TIMEOUT=hello_timeout):
            assert all(save.finished for save in saves)
        mark = conn.not_answering
        assert mark is not None and mark.msg_type == "poll" and mark.rechecked
        assert mark.msg_id == first_poll + (3 if hello_timeout >= call_timeout else 0)
        for save in saves:
            save.abort("the trainer called AsyncCallsQueue.close(abort=True)")
            save.forget(delete_files=True)
        conn.call(MessageType.PING)  # answered after every request sent before it was read
        assert conn.not_answering is None, "a reply to a later request clears the mark"
    finally:
        conn.close()
    first, *others = [save.error for save in saves]
    assert f"did not answer a poll request within {call_timeout:g}s" in first, first
    for save, error in zip(saves[1:], others):
        assert error.startswith(f"rank 0: gave up on the save of {save.path}"), error
        assert "did not answer an earlier poll request on this connection" in error, error
        assert f"pid {os.getpid()}" in error and f"ckptd status --socket {socket}" in error
    sent = [(kind, body["request_ids"]) for kind, body in daemon_at.made[0].received
            if kind not in (MessageType.HELLO, MessageType.PING, MessageType.GOODBYE)]
    left = [MessageType.ABORT, MessageType.FORGET]
    assert sent == [(kind, [rid]) for rid, kinds in ((1, [MessageType.POLL, *left]),
                                                      (2, [MessageType.POLL, *left]), (3, left))
                    for kind in kinds], sent


def test_a_reply_to_a_request_sent_before_the_unanswered_one_keeps_the_mark(daemon_at):
    """A reply read late (another thread's request, answered just before the daemon
    stopped) says nothing about the daemon now: only a reply to a request sent after the
    unanswered one clears the connection's mark."""
    from ckptd import knobs

    socket = daemon_at({MessageType.PING: {"pid": 5}}, silent=(MessageType.POLL,))
    conn = connect(socket, auto_start=False, rank=0)
    try:
        earlier = conn.send(MessageType.PING)
        with knobs.override(CALL_TIMEOUT=0.2), pytest.raises(DaemonUnavailableError):
            conn.call(MessageType.POLL, protocol.Poll(request_ids=[1]))
        assert conn.reply_to(earlier, MessageType.PING).pid == 5
        assert conn.not_answering is not None and conn.not_answering.msg_type == "poll"
        conn.call(MessageType.PING)
        assert conn.not_answering is None
    finally:
        conn.close()


def done(*request_ids: int) -> dict:
    """A POLL reply saying each of ``request_ids`` is done."""
    return {"requests": {rid: {"phase": "done"} for rid in request_ids}}


@pytest.mark.parametrize("recheck_takes", [0.0, 0.5], ids=["recheck_answered", "recheck_slow"])
def test_a_daemon_slow_on_one_poll_is_rechecked_and_the_other_saves_go_on(daemon_at,
                                                                          recheck_takes):
    """The daemon takes longer than a call timeout on one POLL, and answers it with the
    next save's recheck: the save that waited gives up, but the recheck is answered, which
    clears the mark, so neither it nor the third save is given up, aborted or deleted
    (they were committed). With the production timings (the recheck's short wait below
    the call timeout) the daemon also takes longer than that short wait over the recheck
    itself: the late answer to the first POLL says it answers again, so the recheck waits
    on (up to a call timeout) and is answered (before, the late answer was dropped unread
    and both other saves were given up, their files deleted)."""
    from ckptd import knobs

    socket = daemon_at({MessageType.POLL: done(1, 2, 3)}, late=(MessageType.POLL,),
                       silent=(MessageType.ABORT, MessageType.FORGET),
                       slow={MessageType.POLL: [recheck_takes]})
    conn = connect(socket, auto_start=False, rank=0)
    timings = dict(CALL_TIMEOUT=1.5, HELLO_TIMEOUT=0.2) if recheck_takes else \
        dict(CALL_TIMEOUT=0.2)
    try:
        saves = staged_saves(conn, 1, 2, 3)
        with knobs.override(**timings):
            assert saves[0].finished and "did not answer a poll request" in saves[0].error
            assert conn.not_answering is not None
            assert saves[1].finished and saves[1].error is None, saves[1].error
            assert conn.not_answering is None, "the answered recheck clears the mark"
            assert saves[2].finished and saves[2].error is None, saves[2].error
    finally:
        conn.close()
    sent = [(kind, body["request_ids"]) for kind, body in daemon_at.made[0].received
            if kind not in (MessageType.HELLO, MessageType.GOODBYE)]
    assert sent == [(MessageType.POLL, [1]), (MessageType.ABORT, [1]), (MessageType.FORGET, [1]),
                    (MessageType.POLL, [2]), (MessageType.POLL, [3])], sent


def test_a_reply_run_out_after_a_later_request_was_answered_does_not_mark(daemon_at):
    """An older request (a STAGED sent without waiting) whose wait runs out after a later
    request (a POLL) was answered: the daemon read past it and answers, so the connection
    is not marked not answering."""
    from ckptd import knobs
    from ckpt_client.errors import DaemonNotAnsweringError

    socket = daemon_at({MessageType.POLL: done(1)}, silent=(MessageType.STAGED,))
    conn = connect(socket, auto_start=False, rank=0)
    try:
        staged = conn.send(MessageType.STAGED, protocol.Staged(request_id=1))
        assert conn.call(MessageType.POLL, protocol.Poll(request_ids=[1])).requests[1].phase \
            == "done"
        with knobs.override(CALL_TIMEOUT=0.2), pytest.raises(DaemonNotAnsweringError):
            conn.reply_to(staged, MessageType.STAGED)
        assert conn.not_answering is None
    finally:
        conn.close()


def test_aborting_a_save_on_a_marked_connection_leaves_it_failed_once(daemon_at):
    """abort() on a connection marked not answering queues ABORT and FORGET once: the save
    then reads as failed without asking again, and its STAGED reply is no longer kept."""
    from ckptd import knobs

    socket = daemon_at({}, silent=(MessageType.POLL, MessageType.STAGED, MessageType.ABORT,
                                   MessageType.FORGET))
    conn = connect(socket, auto_start=False, rank=0)
    try:
        first, second = staged_saves(conn, 1, 2)
        second.staged_reply = conn.send(MessageType.STAGED, protocol.Staged(request_id=2))
        with knobs.override(CALL_TIMEOUT=0.2):
            assert first.finished and conn.not_answering is not None
            second.abort("the trainer called AsyncCallsQueue.close(abort=True)")
            assert second.finished and "gave up on the save of /ckpt/s2" in second.error
            second.forget(delete_files=True)
        assert second.staged_reply is None
        assert second.last.phase == "failed"
        assert conn.channel._awaited == set(), "nobody waits for the STAGED reply any more"
    finally:
        conn.close()
    sent = [(kind, body["request_ids"]) for kind, body in daemon_at.made[0].received
            if kind in (MessageType.POLL, MessageType.ABORT, MessageType.FORGET)]
    assert sent == [(MessageType.POLL, [1]), (MessageType.ABORT, [1]), (MessageType.FORGET, [1]),
                    (MessageType.ABORT, [2]), (MessageType.FORGET, [2])], sent

