"""The bulk path in one process: real tcp on 127.0.0.1, real listener, lanes and store.

Two "daemons" (key pairs) in this process: A sends with a :class:`BulkSender`, B receives
with a :class:`BulkListener` writing into a real :class:`LocalStore`. Outcomes arrive as
the events the replicator would get; every wait is on a condition with a timeout.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
import zlib

import pytest
import zmq

from ckptd import knobs
from ckptd.checksum import read_sidecar
from ckptd.protocol import PART_FRAME_BYTES
from ckptd.replication.bulk_connection import (ACCEPTED, MAGIC, BulkConnection,
                                              BulkConnectionError, DialRefusedError,
                                              PeerGoneError)
from ckptd.replication.bulk_receive import BulkListener, Target, Targets
from ckptd.replication.bulk_send import BulkSender
from ckptd.replication.send_job import SendJob
from ckptd.replication.bulk_wire import Begin
from ckptd.replication.commands import Received, Sent
from ckptd.replication.refusals import refusal_window
from ckptd.replication.sealing import raw_key
from ckptd.replication.transport import PeerStats
from ckptd.storage.local_store import LocalStore
from ckptd.storage.roots import AllowedRoots
from conftest import wait_for

TIMEOUT = 60.0


def credentials(protection="aes-256-gcm"):
    public, secret = zmq.curve_keypair()
    return raw_key(secret), raw_key(public), protection


class BytesSource:
    """A part held in memory; chunks at or after ``gate_at`` wait for ``gate``."""

    def __init__(self, data: bytes, gate_at: int | None = None) -> None:
        self.data, self.size = data, len(data)
        self.gate_at, self.gate = gate_at, threading.Event()
        self.closed = False

    def frame(self, position: int):
        if self.gate_at is not None and position >= self.gate_at:
            assert self.gate.wait(TIMEOUT)
        return memoryview(self.data)[position:position + PART_FRAME_BYTES]

    def close(self) -> None:
        self.closed = True


class Events:
    def __init__(self) -> None:
        self.items = queue.Queue()

    def post(self, item) -> None:
        self.items.put(item)

    def next(self, kind):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                item = self.items.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, kind):
                return item
        pytest.fail(f"no {kind.__name__} within {TIMEOUT}s")


@pytest.fixture(params=["aes-256-gcm", "none"])
def pair(request, tmp_path):
    a, b = credentials(request.param), credentials(request.param)
    store = LocalStore(AllowedRoots.of([str(tmp_path)]))
    session = store.register("s", str(tmp_path / "b"))
    events = Events()
    stats = PeerStats()
    targets = Targets(store, events.post, lambda key: ("node-a", stats))
    listener = BulkListener("127.0.0.1", b, lambda key: key == a[1], targets)
    listener.start()
    sender = BulkSender(a, events.post)
    yield a, b, session, events, targets, listener, sender
    sender.close()
    listener.close()


def push(sender, listener, b, source, xfer=1, owner=0, iteration=3):
    job = SendJob(xfer, "push", "node-b", source, Begin("s", owner, iteration), PeerStats())
    sender.send(f"127.0.0.1:{listener.port}", b[1], "node-b", job)
    return job


def test_a_part_crosses_in_chunks_over_several_connections_and_lands_verified(pair):
    a, b, session, events, targets, listener, sender = pair
    data = os.urandom(5 * PART_FRAME_BYTES + 123)
    with knobs.override(PEER_STREAMS=3):
        push(sender, listener, b, BytesSource(data))
        received, sent = events.next(Received), events.next(Sent)
    assert received.ok and sent.ok, (received, sent)
    path = session.part_path(3, 0)
    assert received.path == path and open(path, "rb").read() == data
    assert read_sidecar(path).value == zlib.crc32(data)


def test_broken_connections_resume_the_transfer_instead_of_dropping_it(pair):
    a, b, session, events, targets, listener, sender = pair
    data = os.urandom(6 * PART_FRAME_BYTES)
    source = BytesSource(data, gate_at=3 * PART_FRAME_BYTES)
    with knobs.override(PEER_STREAMS=2, REPLICATION_WINDOW=1):
        job = push(sender, listener, b, source)
        wait_for(lambda: len(job.acked) >= 2, TIMEOUT, "the first chunks to be acknowledged")
        lane = next(iter(sender._lanes.values()))
        with lane.lock:
            channels = [c.channel for c in lane.connections if c.channel is not None]
        for channel in channels:  # every connection breaks while chunks are in flight
            channel.close()
        source.gate.set()
        received, sent = events.next(Received), events.next(Sent)
    assert received.ok and sent.ok, (received, sent)
    assert open(session.part_path(3, 0), "rb").read() == data


def test_a_holder_whose_copy_changed_never_completes_it(pair):
    a, b, session, events, targets, listener, sender = pair
    data = os.urandom(PART_FRAME_BYTES + 1)
    path = session.part_path(4, 1)
    targets.expect(Target(9, "fetch", path, a[1], "node-a", 1, 4))
    job = SendJob(9, "serve", "node-b", BytesSource(data),
                  Begin("s", 1, 4, 1234), PeerStats(),
                  expected_crc=1234)
    sender.send(f"127.0.0.1:{listener.port}", b[1], "node-b", job)
    sent, received = events.next(Sent), events.next(Received)
    assert not sent.ok and sent.corrupted and "corrupted" in sent.error
    assert not received.ok and "corrupted" in received.error
    assert not os.path.exists(path) and os.listdir(os.path.dirname(path)) == []


def test_a_fetched_part_is_checked_against_the_holders_record(pair):
    a, b, session, events, targets, listener, sender = pair
    data = os.urandom(1000)
    path = session.part_path(5, 2)
    targets.expect(Target(11, "fetch", path, a[1], "node-a", 2, 5))
    # the holder's bytes were damaged where it did not look: its record says otherwise
    job = SendJob(11, "serve", "node-b", BytesSource(data),
                  Begin("s", 2, 5, zlib.crc32(data) ^ 1),
                  PeerStats())
    sender.send(f"127.0.0.1:{listener.port}", b[1], "node-b", job)
    received = events.next(Received)
    assert not received.ok and "corrupted" in received.error and not os.path.exists(path)


def test_unknown_keys_and_impostors_get_no_answer(pair):
    a, b, session, events, targets, listener, sender = pair
    stranger = credentials(a[2])
    address = ("127.0.0.1", listener.port)
    with pytest.raises(BulkConnectionError, match="closed after 0"):  # not a byte of answer
        BulkConnection.dial(address, stranger[0], stranger[1], b[1], a[2], 10.0)
    # an impostor naming A's (public) key cannot derive the connection keys ...
    with pytest.raises(BulkConnectionError, match="could not prove"):
        BulkConnection.dial(address, stranger[0], a[1], b[1], a[2], 10.0)
    # ... and a made-up proof gets it disconnected before any frame is read
    with socket.create_connection(address, timeout=10) as raw:
        raw.sendall(struct.pack("<8sB32s32s32s", MAGIC, ("aes-256-gcm", "none").index(a[2]),
                                a[1], b[1], os.urandom(32)))
        answer = b""
        while len(answer) < 49:
            answer += raw.recv(49 - len(answer)) or pytest.fail(f"closed after {answer!r}")
        assert answer[:1] == ACCEPTED  # then salt and proof of B
        raw.sendall(os.urandom(16) + os.urandom(100))  # a forged proof, then a "frame"
        try:  # closed with our "frame" unread: a reset, or an orderly end
            assert raw.recv(1) == b"", "the impostor must be disconnected"
        except ConnectionResetError:
            pass
    other = "none" if a[2] != "none" else "aes-256-gcm"
    with pytest.raises(BulkConnectionError):  # the job's key, but another protection choice
        BulkConnection.dial(address, a[0], a[1], b[1], other, 10.0)
    BulkConnection.dial(address, a[0], a[1], b[1], a[2], 10.0).close()


def test_a_daemon_that_restarted_tells_a_dialer_of_its_predecessor_so(pair):
    """A job's daemon dialing a key that is not the listener's (the daemon it meant was here
    before: it restarted) is answered, and fails as gone, not as a handshake to retry; a
    stranger hears nothing, whichever key and protection it names: an answer would tell it
    the listener's key and protection choice."""
    a, b, session, events, targets, listener, sender = pair
    earlier = credentials(a[2])
    address = ("127.0.0.1", listener.port)
    with pytest.raises(PeerGoneError, match="has another key: the one dialed was restarted"):
        BulkConnection.dial(address, a[0], a[1], earlier[1], a[2], 10.0)
    stranger = credentials(a[2])
    for protection in ("aes-256-gcm", "none"):
        for named in (b[1], earlier[1]):
            with pytest.raises(BulkConnectionError, match="closed after 0") as silent:
                BulkConnection.dial(address, stranger[0], stranger[1], named, protection, 10.0)
            assert not isinstance(silent.value, PeerGoneError), (protection, named == b[1])


@pytest.mark.parametrize("where", ["restarted", "exited", "restarted, not told of A"])
def test_a_push_to_a_daemon_that_is_gone_ends_at_once_not_at_its_deadline(pair, where):
    """Pushes stream to a daemon whose listener is now another daemon's (it restarted on
    the same port: another key), is closed (it exited, or restarted elsewhere), or is a
    restarted daemon's that does not know A yet (it closes the handshake unanswered): each
    ends with the reason as soon as a dial meets the first, or once the others persist
    (twice the handshake timeout, here 1 s), while the no-progress deadline (its only end
    before) is far off and never checked here (nothing calls ``expire``)."""
    a, b, session, events, targets, listener, sender = pair
    if where == "restarted":
        bulk, key = f"127.0.0.1:{listener.port}", credentials(a[2])[1]
        said = "has another key: the one dialed was restarted"
    else:
        allowed = (lambda k: True) if where == "exited" else (lambda k: False)
        other = BulkListener("127.0.0.1", credentials(a[2]), allowed, targets)
        bulk, key = f"127.0.0.1:{other.port}", b[1]
        if where == "exited":
            other.close()  # never started: its port is closed at once
            said = "nothing listens at"
        else:
            other.start()
            said = "closed the handshake without an answer"
    with knobs.override(PEER_TIMEOUT=3600.0, PEER_HANDSHAKE_TIMEOUT=0.5):
        for xfer in (21, 22):
            job = SendJob(xfer, "push", "node-b", BytesSource(os.urandom(PART_FRAME_BYTES + 1)),
                          Begin("s", 0, 7), PeerStats(), owner=0, iteration=7)
            sender.send(bulk, key, "node-b", job)
        ended = [events.next(Sent), events.next(Sent)]
    assert sorted(sent.xfer for sent in ended) == [21, 22]
    for sent in ended:
        assert not sent.ok and sent.error.startswith(
            "phase 'replicating': rank 0's part of iteration 7 to node-b was lost: "), sent
        assert said in sent.error, sent.error
        if where != "restarted":
            assert "exited or was restarted" in sent.error, sent.error
    assert not sender.jobs()
    if where == "restarted, not told of A":
        other.close()


class Relay:
    """A tcp relay in front of a listener. :meth:`refuse_new` closes its listening socket:
    new connections are refused (as a firewall reload or a load balancer's reject does)
    while those already relayed go on."""

    def __init__(self, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port, self.target = self.server.getsockname()[1], ("127.0.0.1", port)
        self.socks: list[socket.socket] = []
        self.flowing = threading.Event()  # cleared: bytes are held, not forwarded
        self.flowing.set()
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                near, _ = server.accept()
            except OSError:
                return  # refusing new connections now
            far = socket.create_connection(self.target)
            self.socks += [near, far]
            for one, other in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(one, other), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 20):
                assert self.flowing.wait(TIMEOUT)
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def refuse_new(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; port closed
        self.server.close()

    def accept_again(self) -> None:
        """Listen on the same port again (the reject on the path has passed)."""
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass  # refusing new connections already
        self.server.close()


def test_a_refused_dial_does_not_end_a_push_that_moves_on_another_connection(pair):
    """A push on two connections, each with a chunk in flight: one breaks, and its redials
    are refused (the peer's address rejects new connections for a while) while the other
    stays up. A refusal alone proves nothing, and an established connection proves the
    daemon is there: once the relay forwards again, the push completes on the connection
    that stayed up (before, the first refusal ended it)."""
    a, b, session, events, targets, listener, sender = pair
    relay = Relay(listener.port)
    data = os.urandom(4 * PART_FRAME_BYTES)
    source = BytesSource(data, gate_at=0)  # each connection takes a chunk and waits
    with knobs.override(PEER_STREAMS=2, REPLICATION_WINDOW=1):
        job = SendJob(1, "push", "node-b", source, Begin("s", 0, 3), PeerStats())
        sender.send(f"127.0.0.1:{relay.port}", b[1], "node-b", job)
        lane = next(iter(sender._lanes.values()))

        def both_carrying():
            with lane.lock:
                up = [c.channel for c in lane.connections
                      if c.channel is not None and c.chunks_in_flight()]
                return up if len(up) == 2 else None

        breaking, staying = wait_for(both_carrying, TIMEOUT, "a chunk on each connection")
        relay.flowing.clear()  # what is sent now stays unacknowledged: windows stay full
        relay.refuse_new()
        source.gate.set()
        breaking.close()  # its chunk goes back to the queue; it redials, and is refused
        wait_for(lambda: "nothing listens at" in (lane.last_error or ""), TIMEOUT,
                 "a redial to be refused")
        assert not staying.closed
        relay.flowing.set()
        received, sent = events.next(Received), events.next(Sent)
    relay.close()
    assert received.ok and sent.ok, (received, sent)
    assert open(session.part_path(3, 0), "rb").read() == data


class TwoGates(BytesSource):
    """A part whose chunks before ``second_at`` wait for ``gate``, the rest for ``gate2``."""

    def __init__(self, data: bytes, second_at: int) -> None:
        super().__init__(data, gate_at=0)
        self.second_at, self.gate2 = second_at, threading.Event()

    def frame(self, position: int):
        if position >= self.second_at:
            assert self.gate2.wait(TIMEOUT)
        return super().frame(position)


@pytest.mark.parametrize("pair", ["none"], indirect=True)  # the lane's judgement, not sealing
def test_bytes_moved_on_a_connection_since_closed_count_against_refused_dials(pair):
    """A push on two connections: one breaks and its redials are refused for longer than
    the refusal window while the other carries on; then that one moves bytes and is
    closed too, and a redial is refused at once. No connection is up, but bytes moved
    just now: the peer is not judged gone, and the push completes once the path accepts
    again. Before, a closed connection's bytes were forgotten with it, so "no byte moved
    within the window" held and that refusal ended the push as lost."""
    a, b, session, events, targets, listener, sender = pair
    relay = Relay(listener.port)
    data = os.urandom(4 * PART_FRAME_BYTES)
    source = TwoGates(data, second_at=2 * PART_FRAME_BYTES)
    # A 4 s refusal window: on a loaded machine the last redial still lands within it of
    # the last byte (with 2 s it could come later, and the push rightly end as lost).
    with knobs.override(PEER_STREAMS=2, REPLICATION_WINDOW=1, PEER_TIMEOUT=3600.0,
                        PEER_HANDSHAKE_TIMEOUT=2.0):
        window = refusal_window()
        job = SendJob(1, "push", "node-b", source, Begin("s", 0, 3), PeerStats())
        sender.send(f"127.0.0.1:{relay.port}", b[1], "node-b", job)
        lane = next(iter(sender._lanes.values()))

        def both_carrying():
            with lane.lock:
                up = [c for c in lane.connections
                      if c.channel is not None and c.chunks_in_flight()]
                return up if len(up) == 2 else None

        breaking, staying = wait_for(both_carrying, TIMEOUT, "a chunk on each connection")
        relay.flowing.clear()  # the staying connection's chunk waits unacknowledged
        relay.refuse_new()
        source.gate.set()
        breaking.channel.close()  # its chunk goes back to the queue; its redials are refused

        def refused_for_a_window():
            with lane.lock:
                return (lane.refusals.count >= 3
                        and time.monotonic() - lane.refusals.since >= window)

        wait_for(refused_for_a_window, TIMEOUT, "redials refused for a whole window")
        relay.flowing.set()  # the staying connection moves bytes: two chunks acknowledged
        wait_for(lambda: len(job.acked) == 2, TIMEOUT, "two chunks acknowledged")
        staying.channel.close()
        source.gate2.set()  # its writer, waiting for the next chunk, finds it closed

        def none_up():
            with lane.lock:
                return all(c.channel is None for c in lane.connections)

        wait_for(none_up, TIMEOUT, "both connections closed")
        with lane.lock:
            before = lane.refusals.count
        wait_for(lambda: job.finished or lane.refusals.count > before, TIMEOUT,
                 "a redial refused with no connection up")
        assert not job.finished, "bytes moved just now, on a connection since closed"
        relay.accept_again()
        received, sent = events.next(Received), events.next(Sent)
    relay.close()
    assert received.ok and sent.ok, (received, sent)
    assert open(session.part_path(3, 0), "rb").read() == data


def test_a_lane_whose_jobs_ended_stops_dialing_the_peer(pair):
    """A restarted daemon (another key) answers every dial REPLACED; the two pushes to the
    daemon before it end, and then the lane drops their work, so it dials no more (before,
    their BEGINs stayed queued and the lane redialed for as long as the daemon ran): its
    queue empties, and every dial it made is a connection the listener accepted."""
    a, b, session, events, targets, listener, sender = pair
    restarted = credentials(a[2])
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list = []

    def serve():
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return  # closed
            accepted.append(sock)
            try:
                BulkConnection.accept(sock, restarted[0], restarted[1], lambda k: True, a[2],
                                      TIMEOUT)
            except BulkConnectionError:
                pass  # REPLACED was said
            sock.close()

    threading.Thread(target=serve, daemon=True).start()
    with knobs.override(PEER_STREAMS=2, PEER_TIMEOUT=3600.0):
        for xfer in (31, 32):
            job = SendJob(xfer, "push", "node-b", BytesSource(os.urandom(1000)),
                          Begin("s", 0, 8), PeerStats(), owner=0, iteration=8)
            sender.send(f"127.0.0.1:{server.getsockname()[1]}", b[1], "node-b", job)
        ended = [events.next(Sent), events.next(Sent)]
        assert all(not sent.ok and "has another key" in sent.error for sent in ended), ended
        lane = next(iter(sender._lanes.values()))

        def idle() -> bool:
            with lane.lock:
                return not lane.queue  # a lane's threads dial only for queued work

        wait_for(idle, TIMEOUT, "the lane to drop the ended jobs' work")
        wait_for(lambda: len(accepted) == lane.dials, TIMEOUT, "every dial to be accepted")
    assert lane.dials >= 1 and not sender.jobs()
    server.shutdown(socket.SHUT_RDWR)
    server.close()


def test_a_daemon_of_another_version_is_named_so_in_the_listeners_log(pair, caplog):
    """A daemon of the previous ckptd version dials (its hello starts with ``CKPTDBK1``):
    the listener refuses it, silently as before, and its log names both protocol versions
    and what to do (before: "not a ckptd bulk connection"). Such a listener closes this
    version's hello unanswered, and the dialer's error names another version among the
    reasons."""
    a, b, session, events, targets, listener, sender = pair
    caplog.set_level(logging.WARNING, logger="ckptd.replication.bulk_receive")
    old_hello = struct.pack("<8sB32s32s32s", b"CKPTDBK1", 0, a[1], b[1], os.urandom(32))
    with socket.create_connection(("127.0.0.1", listener.port), timeout=TIMEOUT) as raw:
        raw.sendall(old_hello)
        try:  # closed after its magic: a reset (the rest unread), or an orderly end
            assert raw.recv(1) == b"", "another version must get no answer"
        except ConnectionResetError:
            pass
    said = "the peer speaks bulk protocol 1, this daemon 2: run the same ckptd version on every"
    wait_for(lambda: any(said in r.getMessage() for r in caplog.records), TIMEOUT,
             f"the listener to log {said!r}")

    server = socket.create_server(("127.0.0.1", 0))

    def old_listener():  # reads a hello, finds the magic not its own, closes
        sock, _ = server.accept()
        got = b""
        while len(got) < len(old_hello) and (data := sock.recv(len(old_hello) - len(got))):
            got += data
        sock.close()

    thread = threading.Thread(target=old_listener, daemon=True)
    thread.start()
    with pytest.raises(DialRefusedError, match="runs another ckptd version"):
        BulkConnection.dial(server.getsockname(), a[0], a[1], b[1], a[2], TIMEOUT)
    thread.join(TIMEOUT)
    server.close()


def test_a_receiver_without_progress_gives_up_but_a_slow_sender_is_progress(pair):
    a, b, session, events, targets, listener, sender = pair
    targets.expect(Target(13, "fetch", session.part_path(6, 0), a[1], "node-a", 0, 6))
    later = time.monotonic() + 100
    targets.expire(later, 30.0, activity=lambda key: later - 5 if key == a[1] else 0.0)
    assert targets.describe(), "bytes still arrive from that sender: not expired"
    targets.expire(later, 30.0)
    received = events.next(Received)
    assert received.xfer == 13 and not received.ok and "sent nothing for 30s" in received.error
