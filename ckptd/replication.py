"""Replication of local-checkpoint parts between daemons: CURVE with an authenticator.

Owns everything a daemon says to other daemons:

- a ROUTER bound on ``--peer-listen`` (tcp), a CURVE server whose ZAP authenticator
  admits only the public keys the trainers handed this daemon through their own process
  group (``LOCAL_SESSION``); any other client fails the handshake and never reaches us;
- one DEALER per peer daemon (CURVE client, pinned to that peer's public key), with a
  heartbeat (``PEER_PING`` every :data:`PING_INTERVAL`, "down" after
  :data:`MISS_BUDGET` unanswered);
- part streams in both directions: *push* (after staging, the owner's daemon streams a
  part straight from the staging pool to each clique mate's daemon, while its writers
  write the local copy) and *fetch* (on load, a daemon whose rank lost its part asks the
  holders in order; a holder verifies its replica before sending, the receiver checks
  the crc32 again, so a corrupted replica is never used).

A stream is ``PART_BEGIN`` (header), ``PART_CHUNK`` frames of at most
:data:`ckptd.protocol.PART_FRAME_BYTES` (header + one raw frame), each acknowledged
(``PART_ACK``, at most :data:`WINDOW_FRAMES` unacknowledged: flow control, and a silent
peer shows up as a timeout), then ``PART_END`` with the crc32, answered by ``PART_DONE``
once the receiver made the part durable (dirty name, fsync, checksum, rename). Every wait
is bounded by :data:`PEER_TIMEOUT`: a dead or frozen peer becomes a failed stream (reduced
redundancy for a push, "next holder" for a fetch), never a hang.

Pattern: the replicator runs in its own thread with its own ZeroMQ context, so neither
network waits nor replica fsyncs stall the serve loop. The serve loop sends it commands
and receives its events over an inproc PAIR (the same header + frames encoding as
everything else); status is a snapshot the thread republishes. It must not touch
requests, the ledger or the pool allocator: it only reads extents it was told to send.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import secrets
import socket as _socket
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ckptd import protocol
from ckptd.checksum import ChecksumMismatchError, verify_file
from ckptd.local_store import LocalStore, LocalStoreError, PartWriter
from ckptd.protocol import PART_FRAME_BYTES, MessageType

log = logging.getLogger(__name__)

#: ZAP domain of the peer socket (the authenticator answers only for it).
ZAP_DOMAIN = "ckptd-peers"
#: Seconds a stream may go without progress before the peer counts as failed.
PEER_TIMEOUT = float(os.environ.get("CKPTD_PEER_TIMEOUT", "30"))
#: Seconds between heartbeats to each peer.
PING_INTERVAL = float(os.environ.get("CKPTD_PEER_PING_INTERVAL", "1.0"))
#: Heartbeats a peer may leave unanswered before it is reported down.
MISS_BUDGET = 3
#: Frames a sender may have in flight without an acknowledgement: enough to keep a
#: CURVE stream busy across the receiver's disk writes (4 is ~35% slower on loopback);
#: each stream queues at most this many encrypted frames in ZeroMQ.
WINDOW_FRAMES = int(os.environ.get("CKPTD_REPLICATION_WINDOW", "16"))
#: ZeroMQ I/O threads of the peer context (they do the CURVE encryption).
IO_THREADS = int(os.environ.get("CKPTD_PEER_IO_THREADS", "2"))
TICK_SECONDS = 0.1

# commands (serve loop -> replicator) and events (replicator -> serve loop)
CMD_PEERS = "peers"
CMD_CONNECT = "connect"
CMD_PUSH = "push"
CMD_CANCEL = "cancel"
CMD_FETCH = "fetch"
CMD_STOP = "stop"
EVT_PUSH_DONE = "push_done"
EVT_FETCH_DONE = "fetch_done"


class _AllowedKeys:
    """ZAP credentials provider: admits the CURVE public keys of this job's daemons."""

    def __init__(self) -> None:
        self.keys: frozenset = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self.keys
        if not allowed:
            log.warning("refused a peer connection with unknown CURVE key %s (domain %s): it "
                        "is not one of this job's daemons", key.decode(errors="replace"), domain)
        return allowed


def advertised_address(endpoint: str) -> str:
    """The address peers should dial for a bound ``tcp://host:port`` endpoint."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        host = _socket.gethostbyname(_socket.gethostname())
    return f"tcp://{host}:{port}"


# ------------------------------------------------------------------ stream sources

class _PoolItems:
    """Reads a part out of the staging pool: its buffers back to back (padding skipped)."""

    def __init__(self, pool: mmap.mmap, items: list) -> None:
        self.pool = pool
        self.items = [(int(offset), int(nbytes)) for offset, nbytes in items if int(nbytes) > 0]
        self.starts, cursor = [], 0
        for _, nbytes in self.items:
            self.starts.append(cursor)
            cursor += nbytes
        self.size = cursor

    def frame(self, position: int):
        """The frame at stream ``position``: at most PART_FRAME_BYTES; a slice of one large
        buffer is sent without copying, consecutive small buffers are joined."""
        index = bisect.bisect_right(self.starts, position) - 1
        pieces, length = [], 0
        while index < len(self.items) and length < PART_FRAME_BYTES:
            offset, nbytes = self.items[index]
            skip = position + length - self.starts[index]
            take = min(nbytes - skip, PART_FRAME_BYTES - length)
            pieces.append(memoryview(self.pool)[offset + skip:offset + skip + take])
            length += take
            index += 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        pass


class _FileSource:
    """Reads a part file from disk for a fetch."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def frame(self, position: int) -> bytes:
        return os.pread(self.fd, min(PART_FRAME_BYTES, self.size - position), position)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ------------------------------------------------------------------ streams and links

class _PeerGone(Exception):
    """The other end of a stream cannot be reached any more."""


@dataclass
class _OutStream:
    """A part this daemon sends (push to a holder, or serve a holder's copy to a fetcher)."""

    xfer: int
    kind: str  # "push" | "serve"
    peer: str
    send: Callable  # (msg_type, body, frames) -> bool; False: would block, retry later
    source: object
    begin_body: dict
    on_finish: Callable  # (ok, error)
    meta: dict = field(default_factory=dict)
    begin_sent: bool = False
    sent: int = 0
    acked: int = -1  # -1 until the receiver acknowledged PART_BEGIN
    crc: int = 0
    end_sent: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return self.source.size


@dataclass
class _InStream:
    """A part this daemon receives (a replica pushed to it, or a part it fetches)."""

    xfer: int
    kind: str  # "replica" | "fetch"
    peer: str
    send: Callable
    path: str
    on_finish: Callable  # (ok, error)
    writer: PartWriter | None = None
    size: int = -1
    expected_crc: int | None = None
    meta: dict = field(default_factory=dict)
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def received(self) -> int:
        return self.writer.size if self.writer else 0


@dataclass
class _PeerLink:
    """The DEALER this daemon dials a peer daemon with, and what it knows of the peer."""

    address: str
    key: bytes
    socket: zmq.Socket
    created: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0
    last_pong: float | None = None
    health: str = "unknown"
    bytes_sent: int = 0
    bytes_received: int = 0
    streams_ok: int = 0
    streams_failed: int = 0
    last_error: str | None = None


@dataclass
class _Fetch:
    fetch_id: int
    session: str
    owner: int
    iteration: int
    path: str
    holders: deque
    tried: list = field(default_factory=list)


# ------------------------------------------------------------------ the replicator

class Replicator:
    """The peer side of one daemon, running in its own thread.

    Parameters
    ----------
    listen : str
        ``tcp://host:port`` to bind the peer ROUTER on.
    store : LocalStore
        Where replicas and fetched parts are written, and served from.
    pool_path, pool_size
        The staging pool pushes read from (mapped read-only here).

    Attributes
    ----------
    address : str
        The address peers dial (the bound endpoint, port resolved).
    public_key : str
        This daemon's CURVE public key (z85), handed to peers through the trainers.
    wake_socket : zmq.Socket
        The serve loop polls it; :meth:`drain` reads the events.
    """

    def __init__(self, listen: str, store: LocalStore, pool_path: str, pool_size: int) -> None:
        if not listen.startswith("tcp://"):
            raise ValueError(f"--peer-listen {listen!r} must be a tcp://host:port address")
        self.store = store
        # CURVE encryption runs in ZeroMQ's I/O threads: two let a node encrypt what it
        # pushes while it decrypts what it receives.
        self.context = zmq.Context(io_threads=IO_THREADS)
        public, self._secret = zmq.curve_keypair()
        self._public = public
        self.public_key = public.decode()
        self._allowed = _AllowedKeys()
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("ckptd.replication.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._allowed)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.curve_server = True
        self.router.curve_publickey = public
        self.router.curve_secretkey = self._secret
        self.router.zap_domain = ZAP_DOMAIN.encode()
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, PART_FRAME_BYTES + (1 << 20))
        try:
            self.router.bind(listen)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot listen for peer daemons on {listen}: {exc}; pick a free "
                          "address for --peer-listen") from None
        self.address = advertised_address(
            self.router.getsockopt(zmq.LAST_ENDPOINT).decode())
        inproc = f"inproc://ckptd-replicator-{secrets.token_hex(4)}"
        self.wake_socket = self.context.socket(zmq.PAIR)
        self.wake_socket.linger = 0
        self.wake_socket.bind(inproc)
        self._commands = self.context.socket(zmq.PAIR)
        self._commands.linger = 0
        self._commands.connect(inproc)
        fd = os.open(pool_path, os.O_RDONLY)
        try:
            self._pool = mmap.mmap(fd, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._known: dict[str, bytes] = {}  # peer address -> public key, from the trainers
        self._links: dict[str, _PeerLink] = {}
        self._outs: dict[int, _OutStream] = {}
        self._ins: dict[int, _InStream] = {}
        self._fetches: dict[int, _Fetch] = {}
        self._poller = zmq.Poller()
        self._stopping = False
        self.snapshot: dict = {"address": self.address, "peers": [], "streams": []}
        self._thread = threading.Thread(target=self._run, name="ckptd-replicator", daemon=True)

    # ------------------------------------------------------------ serve-loop side
    def start(self) -> None:
        """Start the replicator thread."""
        self._thread.start()
        log.info("peer socket on %s (CURVE, key %s)", self.address, self.public_key)

    def command(self, kind: str, body: dict) -> None:
        """Send a command to the replicator thread (serve loop only)."""
        self.wake_socket.send_multipart(protocol.encode(kind, 0, body))

    def drain(self, on_event: Callable[[str, dict], None]) -> None:
        """Hand every pending event to ``on_event(kind, body)`` (serve loop only)."""
        while self.wake_socket.poll(0):
            msg = protocol.decode(self.wake_socket.recv_multipart())
            on_event(msg.type, msg.body)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, drop in-flight streams, close the peer sockets."""
        if self._thread.is_alive():
            try:
                self.command(CMD_STOP, {})
            except zmq.ZMQError:
                pass
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Release sockets, the authenticator and the pool mapping."""
        try:
            self.auth.stop()
        except Exception:  # stopping twice or after a failed start must not raise
            pass
        self.context.destroy(linger=0)
        pool = getattr(self, "_pool", None)
        if pool is not None:
            try:
                pool.close()
            except BufferError:  # a frame still references it; the process is exiting
                pass

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._commands, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._stopping:
                for sock, _ in self._poller.poll(int(TICK_SECONDS * 1000)):
                    if sock.closed:  # a link dropped while handling this batch
                        continue
                    try:
                        self._serve_socket(sock)
                    except Exception:  # one bad message must not end replication
                        log.exception("replicator: handling a message failed")
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + TICK_SECONDS
        finally:
            for stream in list(self._ins.values()):
                self._end_in(stream, False, "ckptd is shutting down")
            for stream in list(self._outs.values()):
                self._end_out(stream, False, "ckptd is shutting down")
            self._commands.close(linger=0)
            self.router.close(linger=0)
            for link in self._links.values():
                link.socket.close(linger=0)

    def _serve_socket(self, sock: zmq.Socket) -> None:
        if sock is self._commands:
            msg = protocol.decode(sock.recv_multipart())
            self._on_command(msg.type, msg.body)
            return
        if sock is self.router:
            frames = sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            msg = protocol.decode([f.buffer for f in frames[1:]])
            self._on_peer_message(msg, self._router_sender(identity), from_router=True,
                                  peer=f"peer connection {identity.hex()}")
            return
        link = next((l for l in self._links.values() if l.socket is sock), None)
        frames = sock.recv_multipart(copy=False)
        if link is None:
            return
        msg = protocol.decode([f.buffer for f in frames])
        self._on_peer_message(msg, self._link_sender(link), from_router=False,
                              peer=link.address, link=link)

    def _emit(self, kind: str, body: dict) -> None:
        self._commands.send_multipart(protocol.encode(kind, 0, body))

    # ------------------------------------------------------------ senders
    def _router_sender(self, identity: bytes) -> Callable:
        def send(msg_type: str, body: dict, frames=()) -> bool:
            try:
                self.router.send_multipart([identity, *protocol.encode(msg_type, 0, body, frames)],
                                           flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:  # EHOSTUNREACH: that peer disconnected
                raise _PeerGone(str(exc)) from None
        return send

    def _link_sender(self, link: _PeerLink) -> Callable:
        def send(msg_type: str, body: dict, frames=()) -> bool:
            try:
                link.socket.send_multipart(protocol.encode(msg_type, 0, body, frames),
                                           flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                return False
        return send

    # ------------------------------------------------------------ links
    def _link(self, address: str, key: str) -> _PeerLink:
        key_bytes = key.encode() if isinstance(key, str) else key
        link = self._links.get(address)
        if link is not None and link.key == key_bytes:
            return link
        if link is not None:  # the peer restarted with a new key
            self._drop_link(link)
        sock = self.context.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_serverkey = key_bytes
        sock.curve_publickey = self._public
        sock.curve_secretkey = self._secret
        sock.setsockopt(zmq.MAXMSGSIZE, PART_FRAME_BYTES + (1 << 20))
        sock.connect(address)
        link = _PeerLink(address, key_bytes, sock)
        self._links[address] = link
        self._poller.register(sock, zmq.POLLIN)
        return link

    def _drop_link(self, link: _PeerLink) -> None:
        self._poller.unregister(link.socket)
        link.socket.close(linger=0)
        self._links.pop(link.address, None)

    def _reset_link(self, link: _PeerLink) -> None:
        """Drop what is queued for a peer that stopped answering; dial it afresh."""
        stats = (link.bytes_sent, link.bytes_received, link.streams_ok, link.streams_failed,
                 link.last_error, link.last_pong, link.health)
        self._drop_link(link)
        fresh = self._link(link.address, link.key)
        (fresh.bytes_sent, fresh.bytes_received, fresh.streams_ok, fresh.streams_failed,
         fresh.last_error, fresh.last_pong, fresh.health) = stats
        for stream in self._outs.values():
            if stream.meta.get("link") is link:
                stream.meta["link"] = fresh
                stream.send = self._link_sender(fresh)
        for stream in self._ins.values():
            if stream.meta.get("link") is link:
                stream.meta["link"] = fresh
                stream.send = self._link_sender(fresh)

    # ------------------------------------------------------------ commands
    def _on_command(self, kind: str, body: dict) -> None:
        if kind == CMD_STOP:
            self._stopping = True
        elif kind == CMD_PEERS:
            # Links are dialed later (CMD_CONNECT, or a push or fetch), once every daemon
            # has this table: dialing a peer that does not know our key yet would be
            # refused. A peer that came back with a new key is redialed then too.
            self._allowed.keys = frozenset(k.encode() for k in body["allowed"])
            for address, key in body["peers"]:
                if address == self.address:
                    continue
                self._known[address] = key.encode()
                link = self._links.get(address)
                if link is not None and link.key != key.encode():
                    self._drop_link(link)
        elif kind == CMD_CONNECT:
            for address, key in list(self._known.items()):
                self._link(address, key)
        elif kind == CMD_PUSH:
            self._start_pushes(body)
        elif kind == CMD_CANCEL:
            for stream in [s for s in self._outs.values()
                           if s.kind == "push" and s.meta.get("request_id") == body["request_id"]]:
                self._abort_out(stream, "the save was aborted")
        elif kind == CMD_FETCH:
            fetch = _Fetch(body["fetch_id"], body["session"], body["owner"], body["iteration"],
                           body["path"], deque(body["holders"]))
            self._fetches[fetch.fetch_id] = fetch
            self._fetch_next(fetch)

    def _start_pushes(self, body: dict) -> None:
        for address, key in body["holders"]:
            link = self._link(address, key)
            source = _PoolItems(self._pool, body["items"])
            xfer = secrets.randbits(62)
            meta = {"request_id": body["request_id"], "session": body["session"],
                    "owner": body["owner"], "iteration": body["iteration"], "link": link}
            stream = _OutStream(
                xfer, "push", address, self._link_sender(link), source,
                {"xfer": xfer, "session": body["session"], "owner": body["owner"],
                 "iteration": body["iteration"], "size": source.size},
                self._push_finished(body["request_id"], address, source.size), meta)
            self._outs[xfer] = stream
            log.info("request %d (rank %d) replicating %d bytes of iteration %d to %s",
                     body["request_id"], body["owner"], source.size, body["iteration"], address)
            self._pump(stream)

    def _push_finished(self, request_id: int, holder: str, size: int) -> Callable:
        def finished(ok: bool, error: str | None) -> None:
            self._emit(EVT_PUSH_DONE, {"request_id": request_id, "holder": holder, "ok": ok,
                                       "error": error, "bytes": size if ok else 0})
        return finished

    # ------------------------------------------------------------ fetches
    def _fetch_next(self, fetch: _Fetch) -> None:
        while fetch.holders:
            address, key = fetch.holders.popleft()
            if address == self.address:
                fetch.tried.append({"holder": address, "error": "that is this daemon"})
                continue
            link = self._link(address, key)
            xfer = secrets.randbits(62)
            stream = _InStream(xfer, "fetch", address, self._link_sender(link), fetch.path,
                               self._fetch_step(fetch, address),
                               meta={"link": link, "session": fetch.session,
                                     "owner": fetch.owner, "iteration": fetch.iteration})
            stream.meta["get"] = {"xfer": xfer, "session": fetch.session, "owner": fetch.owner,
                                  "iteration": fetch.iteration}
            self._ins[xfer] = stream
            log.info("fetching rank %d's part of iteration %d from %s", fetch.owner,
                     fetch.iteration, address)
            self._send_get(stream)
            return
        self._fetches.pop(fetch.fetch_id, None)
        self._emit(EVT_FETCH_DONE, {"fetch_id": fetch.fetch_id, "ok": False, "path": None,
                                    "tried": fetch.tried})

    def _fetch_step(self, fetch: _Fetch, address: str) -> Callable:
        def step(ok: bool, error: str | None) -> None:
            if ok:
                self._fetches.pop(fetch.fetch_id, None)
                self._emit(EVT_FETCH_DONE, {"fetch_id": fetch.fetch_id, "ok": True,
                                            "path": fetch.path, "holder": address,
                                            "tried": fetch.tried})
                return
            log.warning("fetching rank %d's part of iteration %d from %s failed: %s; trying "
                        "the next holder", fetch.owner, fetch.iteration, address, error)
            fetch.tried.append({"holder": address, "error": error})
            self._fetch_next(fetch)
        return step

    # ------------------------------------------------------------ peer messages
    def _on_peer_message(self, msg: protocol.Message, send: Callable, from_router: bool,
                         peer: str, link: _PeerLink | None = None) -> None:
        body, kind = msg.body, msg.type
        if kind == MessageType.PEER_PING:
            send(MessageType.PEER_PONG, {"t": body.get("t")})
        elif kind == MessageType.PEER_PONG and link is not None:
            link.last_pong = time.monotonic()
        elif kind == MessageType.PART_GET and from_router:
            self._serve_part(body, send, peer)
        elif kind == MessageType.PART_BEGIN:
            stream = self._ins.get(body.get("xfer"))
            if stream is None and from_router:
                self._accept_replica(body, send, peer)
            elif stream is not None and stream.writer is None:
                self._begin_fetch_stream(stream, body)
        elif kind == MessageType.PART_CHUNK:
            stream = self._ins.get(body.get("xfer"))
            if stream is not None and msg.frames:
                self._receive_chunk(stream, body, msg.frames[0])
        elif kind == MessageType.PART_END:
            stream = self._ins.get(body.get("xfer"))
            if stream is not None:
                self._receive_end(stream, body)
        elif kind == MessageType.PART_ACK:
            stream = self._outs.get(body.get("xfer"))
            if stream is not None:
                stream.acked = int(body.get("received", 0))
                stream.last_progress = time.monotonic()
                self._pump(stream)
        elif kind == MessageType.PART_DONE:
            stream = self._outs.get(body.get("xfer"))
            if stream is not None:
                ok = bool(body.get("ok")) and stream.end_sent
                self._end_out(stream, ok, None if ok else body.get("error") or "refused")

    def _accept_replica(self, body: dict, send: Callable, peer: str) -> None:
        xfer = body.get("xfer")
        try:
            session = self.store.session(str(body.get("session")))
            owner, iteration, size = int(body["owner"]), int(body["iteration"]), int(body["size"])
            if min(owner, iteration, size) < 0:
                raise ValueError(f"owner {owner}, iteration {iteration}, size {size}")
            path = session.part_path(iteration, owner)
            stream = _InStream(xfer, "replica", peer, send, path, lambda ok, error: None,
                               writer=PartWriter(path), size=size,
                               meta={"session": session.session_id, "owner": owner,
                                     "iteration": iteration})
        except (LocalStoreError, KeyError, TypeError, ValueError, OSError) as exc:
            log.warning("refused a replica from %s: %s", peer, exc)
            self._safe_send(send, MessageType.PART_DONE,
                            {"xfer": xfer, "ok": False, "error": f"holder refused: {exc}"})
            return
        self._ins[xfer] = stream
        log.info("receiving rank %d's part of iteration %d (%d bytes) into %s", owner, iteration,
                 size, path)
        self._safe_send(send, MessageType.PART_ACK, {"xfer": xfer, "received": 0})

    def _send_get(self, stream: _InStream) -> None:
        """Ask the holder for the part (again at each tick while it would block)."""
        if "get" in stream.meta and self._safe_send(stream.send, MessageType.PART_GET,
                                                    stream.meta["get"]):
            del stream.meta["get"]

    def _begin_fetch_stream(self, stream: _InStream, body: dict) -> None:
        try:
            stream.size = int(body["size"])
            stream.expected_crc = body.get("crc")
            stream.writer = PartWriter(stream.path)
        except (KeyError, TypeError, ValueError, OSError) as exc:
            self._end_in(stream, False, f"cannot store the fetched part at {stream.path}: {exc}")
            return
        stream.last_progress = time.monotonic()
        self._safe_send(stream.send, MessageType.PART_ACK, {"xfer": stream.xfer, "received": 0})

    def _receive_chunk(self, stream: _InStream, body: dict, frame) -> None:
        if stream.writer is None or body.get("offset") != stream.received:
            self._end_in(stream, False, f"chunk at offset {body.get('offset')} arrived, "
                                        f"expected {stream.received}")
            return
        try:
            stream.writer.write(frame)
        except OSError as exc:
            self._end_in(stream, False, f"writing {stream.path} failed: {exc}")
            return
        stream.last_progress = time.monotonic()
        link = stream.meta.get("link")
        if link is not None:
            link.bytes_received += len(frame)
        self._safe_send(stream.send, MessageType.PART_ACK,
                        {"xfer": stream.xfer, "received": stream.received})

    def _receive_end(self, stream: _InStream, body: dict) -> None:
        if body.get("abort"):
            self._end_in(stream, False, body.get("error") or "the sender gave up", reply=False)
            return
        crc = body.get("crc")
        if stream.writer is None or stream.received != stream.size:
            self._end_in(stream, False, f"stream ended after {stream.received} of "
                                        f"{stream.size} bytes")
            return
        if stream.expected_crc is not None and crc != stream.expected_crc:
            self._end_in(stream, False, f"the holder's copy changed while it was sent "
                                        f"(crc32 {crc} vs recorded {stream.expected_crc})")
            return
        try:
            stream.writer.finish(crc)
        except (ChecksumMismatchError, OSError) as exc:
            stream.writer = None  # finish() already removed the dirty file
            self._end_in(stream, False, str(exc))
            return
        self.store.note_verified(stream.path)
        self._ins.pop(stream.xfer, None)
        log.info("%s %s durable (%d bytes, crc32 %08x)",
                 "replica" if stream.kind == "replica" else "fetched part", stream.path,
                 stream.size, crc)
        self._safe_send(stream.send, MessageType.PART_DONE, {"xfer": stream.xfer, "ok": True})
        stream.on_finish(True, None)

    def _serve_part(self, body: dict, send: Callable, peer: str) -> None:
        xfer = body.get("xfer")
        try:
            session = self.store.session(str(body.get("session")))
            path = session.part_path(int(body["iteration"]), int(body["owner"]))
            checksum = verify_file(path)  # a corrupted replica is never sent
            source = _FileSource(path)
        except FileNotFoundError:
            self._safe_send(send, MessageType.PART_END, {
                "xfer": xfer, "abort": True,
                "error": f"{self.address} holds no part of rank {body.get('owner')} for "
                         f"iteration {body.get('iteration')}"})
            return
        except (LocalStoreError, ChecksumMismatchError, KeyError, TypeError, ValueError,
                OSError) as exc:
            if isinstance(exc, ChecksumMismatchError):
                self.store.note_verified(path, ok=False)
            log.warning("refused to serve a part to %s: %s", peer, exc)
            self._safe_send(send, MessageType.PART_END,
                            {"xfer": xfer, "abort": True, "error": f"{self.address}: {exc}"})
            return
        stream = _OutStream(xfer, "serve", peer, send, source,
                            {"xfer": xfer, "size": source.size, "crc": checksum.value},
                            lambda ok, error: None,
                            meta={"path": path, "owner": int(body["owner"]),
                                  "iteration": int(body["iteration"])})
        self._outs[xfer] = stream
        log.info("serving %s (%d bytes) to %s", path, source.size, peer)
        self._pump(stream)

    # ------------------------------------------------------------ stream mechanics
    @staticmethod
    def _safe_send(send: Callable, msg_type: str, body: dict, frames=()) -> bool:
        try:
            return send(msg_type, body, frames)
        except _PeerGone:
            return False

    def _send_or_fail(self, stream: _OutStream, msg_type: str, body: dict, frames=()) -> bool:
        try:
            return stream.send(msg_type, body, frames)
        except _PeerGone as exc:
            self._end_out(stream, False, f"{stream.peer} went away: {exc}")
            return False

    def _pump(self, stream: _OutStream) -> None:
        """Send PART_BEGIN, then frames while the window allows, then PART_END."""
        if stream.xfer not in self._outs:
            return
        if not stream.begin_sent:
            stream.begin_sent = self._send_or_fail(stream, MessageType.PART_BEGIN,
                                                   stream.begin_body)
            return
        if stream.acked < 0:
            return
        window = WINDOW_FRAMES * PART_FRAME_BYTES
        while stream.sent < stream.size and stream.sent - stream.acked < window:
            frame = stream.source.frame(stream.sent)
            crc = zlib.crc32(frame, stream.crc)
            if not self._send_or_fail(stream, MessageType.PART_CHUNK,
                                      {"xfer": stream.xfer, "offset": stream.sent}, [frame]):
                return  # would block (or failed): the tick tries again
            stream.crc = crc
            stream.sent += len(frame)
            link = stream.meta.get("link")
            if link is not None:
                link.bytes_sent += len(frame)
        if stream.sent == stream.size and not stream.end_sent:
            if self._send_or_fail(stream, MessageType.PART_END,
                                  {"xfer": stream.xfer, "crc": stream.crc, "size": stream.size}):
                stream.end_sent = True

    def _abort_out(self, stream: _OutStream, reason: str) -> None:
        self._safe_send(stream.send, MessageType.PART_END,
                        {"xfer": stream.xfer, "abort": True, "error": reason})
        self._end_out(stream, False, reason)

    def _end_out(self, stream: _OutStream, ok: bool, error: str | None) -> None:
        if self._outs.pop(stream.xfer, None) is None:
            return
        stream.source.close()
        link = stream.meta.get("link")
        if link is not None:
            if ok:
                link.streams_ok += 1
            else:
                link.streams_failed += 1
                link.last_error = error
        if stream.kind == "push":
            if ok:
                log.info("request %d (rank %d) replica durable on %s", stream.meta["request_id"],
                         stream.meta["owner"], stream.peer)
            else:
                log.warning("request %d (rank %d) replication to %s failed: %s",
                            stream.meta["request_id"], stream.meta["owner"], stream.peer, error)
        stream.on_finish(ok, error)

    def _end_in(self, stream: _InStream, ok: bool, error: str | None, reply: bool = True) -> None:
        if self._ins.pop(stream.xfer, None) is None:
            return
        if stream.writer is not None:
            stream.writer.discard()
        if not ok and reply:
            self._safe_send(stream.send, MessageType.PART_DONE,
                            {"xfer": stream.xfer, "ok": False, "error": error})
        if not ok:
            log.warning("receiving %s from %s failed: %s", stream.path, stream.peer, error)
        stream.on_finish(ok, error)

    # ------------------------------------------------------------ timers
    def _tick(self, now: float) -> None:
        for stream in list(self._outs.values()):
            if now - stream.last_progress > PEER_TIMEOUT:
                link = stream.meta.get("link")
                self._end_out(stream, False, f"{stream.peer} made no progress for "
                                             f"{PEER_TIMEOUT:.0f}s (peer down or stuck)")
                if link is not None and link.address in self._links:
                    self._reset_link(link)
            else:
                self._pump(stream)  # frames that would have blocked earlier
        for stream in list(self._ins.values()):
            if now - stream.last_progress > PEER_TIMEOUT:
                self._end_in(stream, False, f"{stream.peer} sent nothing for "
                                            f"{PEER_TIMEOUT:.0f}s (peer down or stuck)")
            else:
                self._send_get(stream)
        for link in list(self._links.values()):
            self._heartbeat(link, now)
        self._publish(now)

    def _heartbeat(self, link: _PeerLink, now: float) -> None:
        if now - link.last_ping >= PING_INTERVAL:
            link.last_ping = now
            self._link_sender(link)(MessageType.PEER_PING, {"t": time.time()})
        silent_for = now - (link.last_pong or link.created)
        budget = MISS_BUDGET * PING_INTERVAL
        health = ("up" if link.last_pong is not None and silent_for <= budget
                  else "down" if silent_for > budget else "unknown")
        if health != link.health:
            (log.info if health == "up" else log.warning)(
                "peer %s is %s", link.address, health)
            link.health = health
        if health == "down" and now - link.created > 5 * PING_INTERVAL:
            # Redial: a connection refused during a peer's restart is not retried forever.
            self._reset_link(link)

    def _publish(self, now: float) -> None:
        lag: dict[str, float] = {}
        for s in self._outs.values():
            if s.kind == "push":
                lag[s.peer] = max(lag.get(s.peer, 0.0), now - s.started)
        peers = [{"address": l.address, "health": l.health, "lag_s": round(lag.get(l.address, 0.0), 3),
                  "last_heard_s": None if l.last_pong is None else round(now - l.last_pong, 3),
                  "bytes_sent": l.bytes_sent, "bytes_received": l.bytes_received,
                  "streams_ok": l.streams_ok, "streams_failed": l.streams_failed,
                  "last_error": l.last_error} for l in self._links.values()]
        streams = [{"direction": "out", "kind": s.kind, "peer": s.peer,
                    "request_id": s.meta.get("request_id"), "owner": s.meta.get("owner"),
                    "iteration": s.meta.get("iteration"), "size": s.size,
                    "bytes_done": max(s.acked, 0)} for s in self._outs.values()]
        streams += [{"direction": "in", "kind": s.kind, "peer": s.peer, "request_id": None,
                     "owner": s.meta.get("owner"), "iteration": s.meta.get("iteration"),
                     "size": s.size, "bytes_done": s.received} for s in self._ins.values()]
        self.snapshot = {"address": self.address, "peers": sorted(peers, key=lambda p: p["address"]),
                         "streams": streams}
