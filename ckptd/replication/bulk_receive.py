"""Receiving parts on the bulk path: the listener, its connections, and their targets.

Owns the receiving side of every part stream (a replica pushed to this daemon, or a part
it fetches for its rank):

- :class:`BulkListener` accepts tcp connections on the advertised bulk address and
  authenticates each (:meth:`.bulk_connection.BulkConnection.accept`: only keys of
  this job's daemons; anyone else is closed without an answer, and logged);
- each connection has one thread that opens frames and hands them to :class:`Targets`;
- a :class:`Target` writes each chunk at its offset and checksums it on the way
  (:class:`ckptd.storage.local_store.PartReceiver`), acknowledges it, and on ``END``
  makes the part durable under its clean name, checked against the crc32 the holder
  recorded when one was announced; duplicates of chunks, ``BEGIN`` and ``END`` (sent again
  after a connection broke) are answered again, never written twice;
- every outcome is posted as a :class:`~ckptd.replication.commands.Received`; a target
  without progress for :data:`ckptd.knobs.PEER_TIMEOUT` is discarded by
  :meth:`Targets.expire` (the replicator's tick).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ckptd import knobs
from ckptd.checksum import ChecksumMismatchError
from ckptd.protocol.errors import ProtocolError
from ckptd.replication.bulk_connection import BulkConnection, BulkConnectionError, Frame, Kind
from ckptd.replication.send_job import io_timeout
from ckptd.replication.bulk_wire import Abort, Begin, Done, Ready, control_body, send_control
from ckptd.replication.commands import Received
from ckptd.storage.local_store import LocalStore, LocalStoreError, PartReceiver

log = logging.getLogger(__name__)

#: Outcomes of finished transfers remembered to answer a repeated ``END``.
REMEMBERED_OUTCOMES = 1024


@dataclass(eq=False)
class Target:
    """A part this daemon receives: ``kind`` is ``"replica"`` or ``"fetch"``."""

    xfer: int
    kind: str
    path: str
    peer_key: bytes              # only this sender may feed it
    peer: str                    # its control address, for logs and status
    owner: int | None = None
    iteration: int | None = None
    receiver: PartReceiver | None = None
    expected_crc: int | None = None
    last_progress: float = field(default_factory=time.monotonic)
    stats: object | None = None  # the sender's PeerStats, looked up once

    @property
    def size(self) -> int:
        """Bytes of the part (-1 before ``BEGIN``)."""
        return self.receiver.size if self.receiver else -1

    @property
    def received(self) -> int:
        """Bytes written so far."""
        return self.receiver.received if self.receiver else 0


class Targets:
    """Transfers this daemon receives, by transfer id (thread-safe).

    Parameters
    ----------
    store : LocalStore
        Where replicas go (under the owner's name) and fetched parts are noted verified.
    post : callable
        Hands a :class:`Received` to the replicator (from any thread).
    peer_of : callable
        ``peer_of(raw key) -> (control address, PeerStats)`` for a connected peer.
    """

    def __init__(self, store: LocalStore, post: Callable[[object], None],
                 peer_of: Callable[[bytes], tuple]) -> None:
        self.store = store
        self._post = post
        self._peer_of = peer_of
        self._lock = threading.Lock()
        self._targets: dict[int, Target] = {}
        self._outcomes: OrderedDict = OrderedDict()  # xfer -> (ok, error)
        #: The bulk path's handler table on the receiving end: frame kind -> handler.
        self._frame_handlers = {Kind.BEGIN: self._begin, Kind.CHUNK: self._chunk,
                                Kind.END: self._finish, Kind.ABORT: self._abort}

    # ------------------------------------------------------------ replicator thread
    def expect(self, target: Target) -> None:
        """A fetch asked a holder for a part: accept its stream under this id."""
        with self._lock:
            self._targets[target.xfer] = target

    def forget(self, xfer: int) -> Target | None:
        """Stop expecting a transfer that never began (its holder refused)."""
        with self._lock:
            target = self._targets.get(xfer)
            if target is None or target.receiver is not None:
                return None
            return self._targets.pop(xfer)

    def begun(self, xfer: int) -> bool:
        """Whether the stream of ``xfer`` started arriving."""
        with self._lock:
            target = self._targets.get(xfer)
        return target is not None and target.receiver is not None

    def expire(self, now: float, timeout: float,
               activity: Callable[[bytes], float] = lambda key: 0.0) -> None:
        """Discard transfers without progress for ``timeout`` seconds: no chunk written,
        and no byte arriving from their sender (``activity(key)``: when bytes last
        moved on that peer's connections) — a slow link is progress, a cut one is not."""
        with self._lock:
            stale = [t for t in self._targets.values()
                     if now - max(t.last_progress, activity(t.peer_key)) > timeout]
        for target in stale:
            self._end(target, False, f"{target.peer} sent nothing for {timeout:.0f}s (link "
                                     "down or peer stuck)")

    def close(self, reason: str) -> None:
        """End every transfer (the daemon is stopping)."""
        with self._lock:
            targets = list(self._targets.values())
        for target in targets:
            self._end(target, False, reason)

    def describe(self) -> list[dict]:
        """Transfers in flight, for the status document."""
        with self._lock:
            targets = list(self._targets.values())
        return [{"direction": "in", "kind": t.kind, "peer": t.peer, "request_id": None,
                 "owner": t.owner, "iteration": t.iteration, "size": t.size,
                 "bytes_done": t.received} for t in targets]

    # ------------------------------------------------------------ connection threads
    def handle(self, channel: BulkConnection, frame: Frame) -> None:
        """One frame from a sender (on that connection's thread).

        Raises
        ------
        BulkConnectionError
            For frames a sender must not send (the connection is closed).
        """
        handler = self._frame_handlers.get(frame.kind)
        if handler is None:
            raise BulkConnectionError(f"a sender sent a frame of kind {frame.kind}")
        handler(channel, frame)

    def _abort(self, channel: BulkConnection, frame: Frame) -> None:
        abort: Abort = control_body(frame)
        target = self._target(channel, frame.xfer)
        if target is not None:
            self._end(target, False, f"the sender gave up: {abort.error}")

    def _target(self, channel: BulkConnection, xfer: int) -> Target | None:
        with self._lock:
            target = self._targets.get(xfer)
        return target if target is not None and target.peer_key == channel.peer_key else None

    def _begin(self, channel: BulkConnection, frame: Frame) -> None:
        raw = frame.body()  # not a map: the connection is dropped
        with self._lock:
            target = self._targets.get(frame.xfer)
            finished = frame.xfer in self._outcomes
        try:
            body = Begin.from_wire(raw)  # a map that breaks the schema is refused, answered
            if finished:
                raise LocalStoreError("that transfer is over already")
            if target is not None and target.peer_key != channel.peer_key:
                raise LocalStoreError("that transfer belongs to another daemon")
            if target is None:
                target = self._replica(channel, frame.xfer, body)
            if target.receiver is None:
                target.expected_crc = body.crc
                target.receiver = PartReceiver(target.path, int(frame.extra), body.algorithm)
                log.info("receiving %s (%d bytes) from %s", target.path, frame.extra, target.peer)
            elif target.receiver.size != frame.extra:
                raise LocalStoreError(f"BEGIN again with {frame.extra} bytes, not "
                                      f"{target.receiver.size}")
        except (ProtocolError, LocalStoreError, ValueError, TypeError, OSError) as exc:
            log.warning("refused a part stream from %s: %s", self._peer_of(channel.peer_key)[0],
                        exc)
            send_control(channel, frame.xfer, Ready(False, str(exc)))
            if target is not None:
                self._end(target, False, f"could not store it: {exc}")
            return
        target.last_progress = time.monotonic()
        send_control(channel, frame.xfer, Ready(True))

    def _replica(self, channel: BulkConnection, xfer: int, body: Begin) -> Target:
        path = self.store.session(body.session).part_path(body.iteration, body.owner)
        peer = self._peer_of(channel.peer_key)[0]
        target = Target(xfer, "replica", path, channel.peer_key, peer, body.owner,
                        body.iteration)
        with self._lock:
            self._targets[xfer] = target
        return target

    def _chunk(self, channel: BulkConnection, frame: Frame) -> None:
        target = self._target(channel, frame.xfer)
        if target is None or target.receiver is None:
            send_control(channel, frame.xfer, Abort("no such transfer here (it timed out or "
                                                    "this daemon restarted)"))
            return
        try:
            fresh = target.receiver.write(frame.offset, frame.payload)
        except (ValueError, OSError) as exc:
            send_control(channel, frame.xfer, Abort(str(exc)))
            self._end(target, False, str(exc))
            return
        target.last_progress = time.monotonic()
        if fresh:
            self._stats(target).add(received=len(frame.payload))
        channel.send(Kind.ACK, frame.xfer, offset=frame.offset)

    def _finish(self, channel: BulkConnection, frame: Frame) -> None:
        control_body(frame)  # an END that breaks its schema drops the connection
        target = self._target(channel, frame.xfer)
        if target is None:
            with self._lock:
                outcome = self._outcomes.get(frame.xfer)
            ok, error = outcome if outcome else (False, "no such transfer here")
            send_control(channel, frame.xfer, Done(ok, error))
            return
        receiver = target.receiver
        if receiver is None or not receiver.complete:
            error = f"stream ended after {target.received} of {target.size} bytes"
            send_control(channel, frame.xfer, Done(False, error))
            self._end(target, False, error)
            return
        try:
            checksum = receiver.finish(target.expected_crc)
        except (ChecksumMismatchError, OSError) as exc:
            send_control(channel, frame.xfer, Done(False, str(exc)))
            self._end(target, False, str(exc), discard=False)
            return
        self.store.note_verified(target.path)
        log.info("%s %s durable (%d bytes, crc32 %08x) from %s",
                 "replica" if target.kind == "replica" else "fetched part", target.path,
                 checksum.size, checksum.value, target.peer)
        self._end(target, True, None, discard=False)
        send_control(channel, frame.xfer, Done(True))

    def _stats(self, target: Target):
        if target.stats is None:  # not per chunk: the lookup scans the peer table
            target.stats = self._peer_of(target.peer_key)[1]
        return target.stats

    def _end(self, target: Target, ok: bool, error: str | None, discard: bool = True) -> None:
        with self._lock:
            if self._targets.get(target.xfer) is not target:  # ended already
                return
            del self._targets[target.xfer]
            self._outcomes[target.xfer] = (ok, error)
            while len(self._outcomes) > REMEMBERED_OUTCOMES:
                self._outcomes.popitem(last=False)
        if discard and target.receiver is not None:
            target.receiver.discard()
        if not ok:
            log.warning("receiving %s from %s failed: %s", target.path, target.peer, error)
        self._stats(target).stream_ended(ok, error)
        self._post(Received(target.xfer, target.kind, ok, error, target.path if ok else None,
                            target.peer, max(target.size, 0)))


class BulkListener:
    """The bulk listening socket and one thread per accepted connection.

    Parameters
    ----------
    host : str
        Address to bind (``""`` for every interface); the port is
        :data:`ckptd.knobs.PEER_BULK_PORT` (0: any free one).
    credentials : tuple
        ``(own secret, own public key, protection)`` (raw keys).
    allowed : callable
        ``allowed(raw key) -> bool``: keys the trainers named.
    targets : Targets
        Where frames go.
    """

    def __init__(self, host: str, credentials: tuple, allowed: Callable[[bytes], bool],
                 targets: Targets) -> None:
        self._credentials = credentials
        self._allowed = allowed
        self.targets = targets
        try:
            self._sock = socket.create_server((host, knobs.PEER_BULK_PORT.get()), backlog=64)
        except OSError as exc:
            raise OSError(f"cannot listen for bulk connections on {host or '*'}:"
                          f"{knobs.PEER_BULK_PORT.get()}: {exc}") from None
        self.port = self._sock.getsockname()[1]
        self._channels: set = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="ckptd-bulk-accept")

    def start(self) -> None:
        """Accept connections from now on."""
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, address = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock, address), daemon=True,
                             name=f"ckptd-bulk-in-{address[0]}").start()

    def _serve(self, sock: socket.socket, address: tuple) -> None:
        own_secret, own_public, protection = self._credentials
        try:
            channel = BulkConnection.accept(sock, own_secret, own_public, self._allowed, protection,
                                     knobs.PEER_HANDSHAKE_TIMEOUT.get(), io_timeout())
        except BulkConnectionError as exc:
            log.warning("refused a bulk connection from %s:%d: %s", address[0], address[1], exc)
            sock.close()
            return
        with self._lock:
            if self._stopped:
                channel.close()
                return
            self._channels.add(channel)
        try:
            while True:
                self.targets.handle(channel, channel.receive())
        except BulkConnectionError as exc:
            if not channel.closed:
                log.debug("bulk connection from %s:%d ended: %s", address[0], address[1], exc)
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("bulk connection from %s:%d: handling a frame failed", *address[:2])
        finally:
            with self._lock:
                self._channels.discard(channel)
            channel.close()

    def activity(self, peer_key: bytes) -> float:
        """When bytes last moved on a connection from the peer with this key (0: never)."""
        with self._lock:
            return max((c.last_activity for c in self._channels if c.peer_key == peer_key),
                       default=0.0)

    def close(self) -> None:
        """Stop accepting and close every connection."""
        with self._lock:
            self._stopped = True
            channels = list(self._channels)
        self._sock.close()
        for channel in channels:
            channel.close()
