"""One bulk connection between two daemons: the handshake and sealed frames over tcp.

Owns the byte layout of the bulk path (parts' bytes never travel over ZeroMQ):

- **handshake** (client = the daemon that dialed)::

      client -> server   MAGIC | protection | client public key | server public key | salt_c
      server -> client   ACCEPTED | salt_s | proof_s
      client -> server   proof_c

  The server answers only a client whose public key is in the trainers' table and that
  dialed this daemon's current key; each proof is a tag under the new connection keys
  (:mod:`.sealing`), so both ends know the other holds the secret of its public key.
  A client whose key is in the table but that dialed another key (the daemon it means was
  here before this one: it restarted) is told so in one byte, ``REPLACED``: what it had
  sent that daemon is lost, and waiting for it to come back would only cost the stream's
  whole no-progress deadline. Anyone else is disconnected without a byte of answer, so a
  stranger learns neither this daemon's key nor its protection choice. ``REPLACED`` is not
  authenticated (the dialer does not know the new key): whoever can forge bytes on the
  path can end a push with it at once, as they could by dropping its packets until the
  no-progress deadline. :meth:`BulkConnection.dial` raises :class:`PeerGoneError` for it,
  and :class:`DialRefusedError` for a refused connection or a handshake closed without a
  byte of answer: that may be a daemon gone, or a passing reject on the path, so only a
  lane that meets it for a while judges the peer gone (:mod:`.refusals`).
- **frames**: a 32-byte header in clear (kind, payload length, transfer id, offset, one
  more integer), authenticated together with the payload, then the sealed payload. A
  ``CHUNK`` carries part bytes; the other kinds carry a small msgpack map.

Pattern: a blocking socket per connection, used by one reading and one writing thread;
sends are serialized by a lock. It knows nothing of parts or transfers.
"""

from __future__ import annotations

import mmap
import socket
import struct
import threading
import time
from dataclasses import dataclass

from ckptd import knobs, protocol
from ckptd.protocol import PART_FRAME_BYTES
from ckptd.replication.sealing import (PROTECTIONS, SALT_BYTES, TAG_BYTES, AuthenticationError,
                                       Sealer, connection_keys, new_salt, shared_secret)

MAGIC = b"CKPTDBK2"
#: The server's first answer byte: the handshake goes on, or the key the client dialed is
#: not this daemon's (the daemon it meant is gone).
ACCEPTED, REPLACED = b"\x00", b"\x01"
_HELLO = struct.Struct(f"<8sB32s32s{SALT_BYTES}s")
_HEADER = struct.Struct("<BBHIQQQ")
HEADER_BYTES = _HEADER.size
#: Largest msgpack payload of a control frame (BEGIN, READY, END, DONE, ABORT).
MAX_CONTROL_PAYLOAD = 64 * 1024


class Kind:
    """Frame kinds of the bulk path."""

    BEGIN = 1   # sender: a part starts (extra = size); payload: which part, crc
    READY = 2   # receiver: ready for chunks, or why not
    CHUNK = 3   # sender: part bytes at offset
    ACK = 4     # receiver: the chunk at offset is written
    END = 5     # sender: every chunk acknowledged; payload: crc when known
    DONE = 6    # receiver: the part is durable (or why not)
    ABORT = 7   # either side: this transfer is over; payload: why

    CONTROL = (BEGIN, READY, END, DONE, ABORT)
    ALL = CONTROL + (CHUNK, ACK)


class BulkConnectionError(Exception):
    """The connection broke, or the other end sent something this end refuses."""


class PeerGoneError(BulkConnectionError):
    """The daemon a dial meant is no longer there: another daemon (another key) answers at
    its bulk address, or every dial there has been refused for a while. What it held of a
    transfer went with it, so a transfer to it cannot resume: redialing would only wait out
    its deadline."""


class DialRefusedError(BulkConnectionError):
    """The peer's bulk address refused the connection, or closed the handshake without a
    byte of answer. Nothing listens there (the daemon exited or moved), or a daemon there
    does not take this one's dials (restarted and not told of this daemon yet, another
    ckptd version, another ``--peer-encryption``); or something on the path rejected it
    for a moment (a firewall reload, a full accept queue) while the daemon lives: one
    such answer alone proves nothing."""


@dataclass(frozen=True)
class Frame:
    """A frame as received: ``payload`` is valid until the next receive."""

    kind: int
    xfer: int
    offset: int
    extra: int
    payload: memoryview

    def body(self) -> dict:
        """The msgpack map of a control frame.

        Raises
        ------
        BulkConnectionError
            If it is not a map (a peer that sends garbage is disconnected).
        """
        try:
            value = protocol.unpack_value(bytes(self.payload))
        except Exception as exc:  # whatever msgpack raises for hostile bytes
            raise BulkConnectionError(f"undecodable frame payload: {exc}") from None
        if not isinstance(value, dict):
            raise BulkConnectionError("a control frame's payload must be a map")
        return value


def _check_magic(magic: bytes) -> None:
    """Refuse a hello of another protocol, naming both versions when it is ckptd's: a
    daemon of another ckptd version gets no answer it understands, and only this log line
    on the listening node says why its pushes never start."""
    if magic == MAGIC:
        return
    if magic[:-1] == MAGIC[:-1] and magic[-1:].isdigit():
        raise BulkConnectionError(f"the peer speaks bulk protocol {magic[-1:].decode()}, this "
                                  f"daemon {MAGIC[-1:].decode()}: run the same ckptd version "
                                  "on every node")
    raise BulkConnectionError("not a ckptd bulk connection")


_NO_WAIT_LIMIT = struct.pack("ll", 0, 0)


def _wait_limit(seconds: float) -> bytes:
    """``SO_RCVTIMEO``'s value for ``seconds``."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _recv_exact(sock: socket.socket, view: memoryview, moved=None, slices: bool = False) -> None:
    """Fill ``view`` from ``sock``. ``slices``: while at least two slices of the body
    remain, be woken for a slice (``CKPTD_PEER_RECEIVE_SLICE_BYTES``) at a time, waiting at
    most ``CKPTD_PEER_RECEIVE_SLICE_WAIT`` for each and for any byte once a wait brought
    none; afterwards the socket wakes for any byte and waits without limit again (an idle
    connection waits for its next frame as long as it takes).

    Why two slices: the kernel wakes a blocked reader once the bytes it has not copied yet
    reach the low-water mark, and a call copies what is queued before it sleeps. With a
    slice or more still to come after anything one call can copy first, the mark is always
    reachable; for the body's tail it may not be (a call that copied part of the tail
    would wait for more bytes than will come, until the wait limit), so the tail is taken
    as it comes."""
    slice_bytes = knobs.PEER_RECEIVE_SLICE_BYTES.get() if slices else 0
    got, lowat, limited = 0, 1, False
    try:
        if slice_bytes and len(view) >= 2 * slice_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            _wait_limit(knobs.PEER_RECEIVE_SLICE_WAIT.get()))
            limited = True
        while got < len(view):
            want = slice_bytes if limited and len(view) - got >= 2 * slice_bytes else 1
            if want != lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                lowat = want
            try:
                n = sock.recv_into(view[got:])
            except BlockingIOError:  # nothing within the wait: take bytes as they come
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _NO_WAIT_LIMIT)
                limited = False
                continue
            if n == 0:
                raise BulkConnectionError(f"connection closed after {got} of {len(view)} bytes")
            got += n
            if moved is not None:
                moved()
    finally:
        try:
            if lowat != 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            if limited:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _NO_WAIT_LIMIT)
        except OSError:
            pass  # the connection is gone; its error is what is raised


#: Most bytes one send call is given: a blocking send returns only when all of it is
#: queued, and each return is a sign of life on a slow link.
SEND_SLICE_BYTES = 256 * 1024


def _send_all(sock: socket.socket, buffers: list, moved=None) -> None:
    """Send every buffer (no joining), in slices of at most :data:`SEND_SLICE_BYTES`."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        batch, room = [], SEND_SLICE_BYTES
        for view in views:
            if room <= 0:
                break
            batch.append(view[:room])
            room -= len(batch[-1])
        sent = sock.sendmsg(batch)
        if moved is not None:
            moved()
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


class BulkConnection:
    """An authenticated bulk connection (see the module docstring).

    Use :meth:`dial` or :meth:`accept` to make one.

    Attributes
    ----------
    peer_key : bytes
        The other end's raw public key (authenticated by the handshake).
    last_activity : float
        ``time.monotonic()`` when bytes last moved either way: on a slow link a chunk takes
        long, but its bytes keep moving, and that is progress.
    """

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, protection: str,
                 peer_key: bytes) -> None:
        self.sock = sock
        self.peer_key = peer_key
        self.protection = protection
        self._out = Sealer(send_key, protection)
        self._in = Sealer(recv_key, protection)
        self._send_lock = threading.Lock()
        # Reused per connection, grown on first use: a dialing end sends chunks and a
        # listening end receives them, so each end allocates only what its role needs.
        self._buffers: dict[str, memoryview] = {}
        self._head = memoryview(bytearray(HEADER_BYTES))
        self.closed = False
        self.last_activity = time.monotonic()

    def _moved(self) -> None:
        self.last_activity = time.monotonic()

    def _buffer(self, name: str, size: int) -> memoryview:
        buffer = self._buffers.get(name)
        if buffer is None or len(buffer) < size:
            # page-aligned (an anonymous mapping): a received chunk's payload then goes
            # from here to the replica's file with O_DIRECT, without another copy
            buffer = self._buffers[name] = memoryview(mmap.mmap(-1, max(size, 64 * 1024)))
        return buffer[:size]

    # ------------------------------------------------------------ making one
    @classmethod
    def dial(cls, address: tuple, own_secret: bytes, own_public: bytes, peer_public: bytes,
             protection: str, timeout: float, io_timeout: float | None = None) -> "BulkConnection":
        """Connect to a peer's bulk listener and authenticate both ends.

        ``timeout`` bounds connecting and the handshake; afterwards the connection is
        dropped by the kernel when the peer leaves sent bytes unacknowledged, or does not
        answer keepalive probes, for ``io_timeout`` seconds (:func:`_tune`). Sends and
        receives themselves wait as long as bytes keep moving: a chunk may take long on a
        slow link.

        Raises
        ------
        BulkConnectionError
            If the peer cannot be reached or the handshake fails.
        """
        where = f"{address[0]}:{address[1]}"
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except ConnectionRefusedError as exc:
            raise DialRefusedError(f"nothing listens at {where} ({exc.strerror})") from None
        except OSError as exc:
            raise BulkConnectionError(f"cannot reach {where}: {exc}") from None
        try:
            salt_c = new_salt()
            hello = _HELLO.pack(MAGIC, PROTECTIONS.index(protection), own_public, peer_public,
                                salt_c)
            sock.sendall(hello)
            status = memoryview(bytearray(1))
            try:
                _recv_exact(sock, status)
            except BulkConnectionError as exc:  # closed at once: it will not take this dial
                raise DialRefusedError(
                    f"the daemon at {where} closed the handshake without an answer ({exc}): it "
                    "does not know this daemon, runs another ckptd version or "
                    "--peer-encryption (its log says which)") from None
            if bytes(status) == REPLACED:
                raise PeerGoneError(f"the daemon at {where} has another key: the one dialed "
                                    f"was restarted")
            if bytes(status) != ACCEPTED:
                raise BulkConnectionError(f"answered the handshake with {bytes(status)!r}")
            answer = memoryview(bytearray(SALT_BYTES + TAG_BYTES))
            _recv_exact(sock, answer)
            salt_s, proof_s = bytes(answer[:SALT_BYTES]), bytes(answer[SALT_BYTES:])
            c2s, s2c = connection_keys(shared_secret(own_secret, peer_public), salt_c + salt_s,
                                       own_public, peer_public, protection)
            channel = cls(sock, c2s, s2c, protection, peer_public)
            transcript = hello + ACCEPTED + salt_s
            channel._in.check_proof(transcript, proof_s)
            sock.sendall(channel._out.proof(transcript + proof_s))
            _tune(sock, io_timeout)
            sock.settimeout(None)
            return channel
        except (PeerGoneError, DialRefusedError):
            sock.close()
            raise
        except (OSError, BulkConnectionError, AuthenticationError) as exc:
            sock.close()
            raise BulkConnectionError(f"bulk handshake with {where} failed: {exc}") from None

    @classmethod
    def accept(cls, sock: socket.socket, own_secret: bytes, own_public: bytes,
               allowed, protection: str, timeout: float,
               io_timeout: float | None = None) -> "BulkConnection":
        """Authenticate a connection a peer opened to this daemon's bulk listener.

        Parameters
        ----------
        allowed : callable
            ``allowed(raw_public_key) -> bool``: whether the trainers named that key.

        Raises
        ------
        BulkConnectionError
            If the client is not one of this job's daemons (it gets no answer at all).
        """
        try:
            sock.settimeout(timeout)
            hello = memoryview(bytearray(_HELLO.size))
            _recv_exact(sock, hello[:len(MAGIC)])  # first: another version's hello may differ
            _check_magic(bytes(hello[:len(MAGIC)]))
            _recv_exact(sock, hello[len(MAGIC):])
            magic, choice, client_public, server_public, salt_c = _HELLO.unpack(hello)
            if choice >= len(PROTECTIONS) or PROTECTIONS[choice] != protection:
                theirs = PROTECTIONS[choice] if choice < len(PROTECTIONS) else choice
                raise BulkConnectionError(f"the peer protects bulk bytes with {theirs!r}, this "
                                          f"daemon with {protection!r}: start every daemon of "
                                          "the job with the same --peer-encryption")
            # Strangers first, and silently: an answer would tell anyone who can reach the
            # port whether a key (or a protection choice) is this daemon's.
            if not allowed(client_public):
                raise BulkConnectionError("unknown key: not one of this job's daemons")
            if server_public != own_public:  # said, so the dialer stops waiting for that one
                sock.sendall(REPLACED)
                raise BulkConnectionError("the peer dialed another key (an earlier daemon "
                                          "here); told it that daemon is gone")
            salt_s = new_salt()
            c2s, s2c = connection_keys(shared_secret(own_secret, client_public),
                                       salt_c + salt_s, client_public, own_public, protection)
            channel = cls(sock, s2c, c2s, protection, client_public)
            transcript = bytes(hello) + ACCEPTED + salt_s
            proof_s = channel._out.proof(transcript)
            sock.sendall(ACCEPTED + salt_s + proof_s)
            proof_c = memoryview(bytearray(TAG_BYTES))
            _recv_exact(sock, proof_c)
            channel._in.check_proof(transcript + proof_s, bytes(proof_c))
            _tune(sock, io_timeout)
            sock.settimeout(None)
            return channel
        except (OSError, AuthenticationError) as exc:
            raise BulkConnectionError(str(exc)) from None

    # ------------------------------------------------------------ frames
    def send(self, kind: int, xfer: int, offset: int = 0, extra: int = 0, payload=b"") -> None:
        """Seal and send one frame (thread-safe; a CHUNK payload is not copied).

        Raises
        ------
        BulkConnectionError
            If the connection broke.
        """
        if isinstance(payload, dict):
            payload = protocol.pack_value(payload)
        header = _HEADER.pack(kind, 0, 0, len(payload), xfer, offset, extra)
        try:
            with self._send_lock:
                scratch = self._buffer("seal", len(payload) + TAG_BYTES)
                _send_all(self.sock, self._out.seal(header, payload, scratch), self._moved)
        except OSError as exc:
            raise BulkConnectionError(f"sending failed: {exc}") from None

    def receive(self) -> Frame:
        """Receive and open the next frame (one reading thread per connection).

        Raises
        ------
        BulkConnectionError
            If the connection broke, or a frame is malformed or fails authentication.
        """
        try:
            _recv_exact(self.sock, self._head, self._moved)
            kind, _, _, length, xfer, offset, extra = _HEADER.unpack(self._head)
            limit = PART_FRAME_BYTES if kind == Kind.CHUNK else MAX_CONTROL_PAYLOAD
            if kind not in Kind.ALL or length > limit:
                raise BulkConnectionError(f"refused a frame of kind {kind} with {length} bytes")
            body = self._buffer("body", self._in.body_size(length))
            _recv_exact(self.sock, body, self._moved, slices=True)
            payload = self._in.open(bytes(self._head), body, self._buffer("plain", length))
        except OSError as exc:
            raise BulkConnectionError(f"receiving failed: {exc}") from None
        except AuthenticationError as exc:
            raise BulkConnectionError(str(exc)) from None
        return Frame(kind, xfer, offset, extra, payload)

    def close(self) -> None:
        """Shut the connection down (unblocks a thread waiting in receive or send)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _tune(sock: socket.socket, stall_timeout: float | None) -> None:
    """No Nagle delay on small frames; and a connection whose peer vanished (a cut link, a
    dead node) is dropped by the kernel after ``stall_timeout`` seconds without the peer
    acknowledging what was sent (``TCP_USER_TIMEOUT``) or answering keepalive probes,
    while a slow link, whose bytes keep being acknowledged, is never cut."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if stall_timeout is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probe = max(1, int(stall_timeout / 3))
    for option, value in (("TCP_KEEPIDLE", probe), ("TCP_KEEPINTVL", probe),
                          ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", int(stall_timeout * 1000))):
        if hasattr(socket, option):  # Linux; elsewhere the stream timeouts still bound it
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
