"""The sockets a daemon talks to its peer daemons with: CURVE, an authenticator, links.

Owns:

- the peer context and this daemon's CURVE key pair;
- a ROUTER bound on ``--peer-listen`` (tcp), a CURVE server whose ZAP authenticator
  admits only the public keys the trainers handed this daemon through their own process
  group; any other client fails the handshake and never reaches the replicator;
- one DEALER per peer daemon it talks to (a :class:`PeerLink`, CURVE client pinned to that
  peer's key): kept open to the *pinned* peers (the clique mates, or every daemon of the
  job with ``CKPTD_PEER_LINKS=all``), dialed on demand to any other and closed once unused
  for :data:`ckptd.knobs.PEER_IDLE_TIMEOUT`; redialed when the peer stopped answering;
- who a message on the listening socket comes from: the daemon whose CURVE key the
  authenticator admitted (its ZAP User-Id), never what the message says;
- non-blocking *senders*: ``send(body, frames) -> bool`` (``False``: would block, try
  later), raising :class:`PeerGone` when the peer is unreachable.

Pattern: pyzmq's ironhouse (CURVE + ZAP callback). It runs on the replicator thread only,
and knows nothing of parts or requests.
"""

from __future__ import annotations

import logging
import socket as _socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ckptd import knobs, protocol
from ckptd.protocol import Body
from ckptd.replication.health import PeerHealth

log = logging.getLogger(__name__)

#: ZAP domain of the peer socket (the authenticator answers only for it).
ZAP_DOMAIN = "ckptd-peers"
#: Largest peer control message (part bytes travel on the bulk path, never here).
MAX_PEER_MESSAGE = 1 << 20

#: ``send(body, frames=()) -> bool``: False when it would block.
Sender = Callable[..., bool]


class PeerGone(Exception):
    """The other end of a connection cannot be reached any more."""


def send_quietly(send: Sender, body: Body, frames=()) -> bool:
    """Send if possible; an unreachable peer is reported by its stream's timeout instead."""
    try:
        return send(body, frames)
    except PeerGone:
        return False


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


_WILDCARDS = ("0.0.0.0", "*", "[::]", "::", "")
_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def interface_addresses() -> list[tuple[str, str]]:
    """``(interface, IPv4 address)`` of every interface that is up and not loopback, in
    the kernel's interface order."""
    import fcntl
    import struct

    found = []
    with _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM) as probe:
        for _, name in _socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(probe, _SIOCGIFFLAGS, request), 16)[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                address = fcntl.ioctl(probe, _SIOCGIFADDR, request)[20:24]
            except OSError:  # no IPv4 address on it
                continue
            found.append((name, _socket.inet_ntoa(address)))
    return found


def advertised_address(endpoint: str, advertise: str | None = None) -> str:
    """The address peers should dial for a bound ``tcp://host:port`` endpoint.

    Parameters
    ----------
    endpoint : str
        What the socket is bound to (port resolved).
    advertise : str, optional
        ``--peer-advertise``: a host (or ``tcp://host[:port]``) other nodes reach this
        daemon at. Without it, a wildcard bind advertises the first interface address that
        is up and not loopback: the host name may resolve to 127.0.0.1, which other nodes
        cannot reach.
    """
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if advertise:
        given = advertise.removeprefix("tcp://")
        if given.count(":") == 1:
            given, port = given.split(":")
        return f"tcp://{given}:{port}"
    if host in _WILDCARDS:
        candidates = interface_addresses()
        if not candidates:
            log.warning("--peer-listen %s: this host has no interface address but loopback; "
                        "advertising 127.0.0.1, which only daemons on this host can reach "
                        "(use --peer-advertise)", endpoint)
            return f"tcp://127.0.0.1:{port}"
        host = candidates[0][1]
        if len(candidates) > 1:
            log.info("--peer-listen %s: advertising %s (interface %s) of %s; choose another "
                     "with --peer-advertise", endpoint, host, candidates[0][0],
                     ", ".join(f"{a} ({n})" for n, a in candidates))
    return f"tcp://{host}:{port}"


def bind_host(listen: str) -> str:
    """The host part of ``tcp://host:port`` as a socket binds it (``""``: every interface)."""
    host = listen.removeprefix("tcp://").rpartition(":")[0]
    return "" if host in _WILDCARDS else host.strip("[]")


@dataclass
class PeerStats:
    """What this daemon exchanged with one peer; survives redials of its link. Updated
    by the bulk connection threads, hence the lock."""

    bytes_sent: int = 0
    bytes_received: int = 0
    streams_ok: int = 0
    streams_failed: int = 0
    last_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        """Count bytes moved to or from this peer."""
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def stream_ended(self, ok: bool, error: str | None) -> None:
        """Count a finished stream with this peer."""
        with self._lock:
            if ok:
                self.streams_ok += 1
            else:
                self.streams_failed += 1
                self.last_error = error


@dataclass
class PeerLink:
    """The DEALER this daemon dials one peer daemon with, and what it knows of the peer."""

    address: str
    key: bytes
    socket: zmq.Socket
    health: PeerHealth
    stats: PeerStats = field(default_factory=PeerStats)
    #: ``time.monotonic()`` of the last use other than a heartbeat (idle links are closed).
    last_used: float = field(default_factory=time.monotonic)


def _send_multipart(sock: zmq.Socket, prefix: list, body: Body, frames) -> bool:
    try:
        sock.send_multipart([*prefix, *protocol.encode(body.message_type, 0, body.to_wire(),
                                                       frames)],
                            flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:  # EHOSTUNREACH: that peer disconnected
        raise PeerGone(str(exc)) from None


class PeerTransport:
    """The peer context, the authenticated listening socket and the links to peers.

    Parameters
    ----------
    listen : str
        ``tcp://host:port`` to bind the peer ROUTER on.
    advertise : str, optional
        ``--peer-advertise``: the host (or ``tcp://host[:port]``) other nodes dial.

    Attributes
    ----------
    address : str
        The address peers dial (the bound endpoint, port resolved).
    public_key : str
        This daemon's CURVE public key (z85), handed to peers through the trainers.
    raw_public, raw_secret : bytes
        The same key pair as raw X25519 keys (the bulk path's key agreement).
    router : zmq.Socket
        The listening socket (poll it for messages from peers that dialed us).
    """

    def __init__(self, listen: str, advertise: str | None = None) -> None:
        if not listen.startswith("tcp://"):
            raise ValueError(f"--peer-listen {listen!r} must be a tcp://host:port address")
        self.context = zmq.Context(io_threads=knobs.PEER_IO_THREADS.get())
        self._public, self._secret = zmq.curve_keypair()
        self.public_key = self._public.decode()
        self.raw_public, self.raw_secret = z85.decode(self._public), z85.decode(self._secret)
        self._allowed = _AllowedKeys()
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger(f"{__name__}.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._allowed)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.curve_server = True
        self.router.curve_publickey = self._public
        self.router.curve_secretkey = self._secret
        self.router.zap_domain = ZAP_DOMAIN.encode()
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE)
        try:
            self.router.bind(listen)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot listen for peer daemons on {listen}: {exc}; pick a free "
                          "address for --peer-listen") from None
        self.address = advertised_address(self.router.getsockopt(zmq.LAST_ENDPOINT).decode(),
                                          advertise)
        self.links: dict[str, PeerLink] = {}
        self.known: dict[str, bytes] = {}  # peer address -> public key, from the trainers
        self.bulk: dict[str, str] = {}     # peer address -> its bulk address (host:port)
        self.mates: set[str] = set()       # addresses of the clique mates (kept linked)
        self._stats: dict[str, PeerStats] = {}

    @property
    def host(self) -> str:
        """The host part of the advertised address (the bulk address uses it too)."""
        return self.address.removeprefix("tcp://").rpartition(":")[0]

    # ------------------------------------------------------------ keys
    def allow(self, keys) -> None:
        """Admit exactly these public keys (z85 strings) on the listening socket."""
        self._allowed.keys = frozenset(k.encode() if isinstance(k, str) else k for k in keys)

    def allowed_raw(self, raw_key: bytes) -> bool:
        """Whether a raw public key is one the trainers named (the bulk listener asks)."""
        return z85.encode(raw_key) in self._allowed.keys

    def address_of_key(self, raw_key: bytes) -> str:
        """The control address of the peer with this raw public key (or the key itself)."""
        key = z85.encode(raw_key)
        return next((a for a, k in list(self.known.items()) if k == key), key.decode())

    def sender_of(self, frame: zmq.Frame) -> str | None:
        """The control address of the daemon that sent ``frame`` to the listening socket:
        the one whose CURVE key the authenticator admitted (the ZAP User-Id, the key in
        z85), looked up in the trainers' table; ``None`` when the table has no such key."""
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:  # no metadata: not a CURVE connection
            return None
        key = user_id.encode() if isinstance(user_id, str) else user_id
        return next((a for a, k in list(self.known.items()) if k == key), None)

    def learn(self, address: str, key: str, bulk: str | None = None) -> None:
        """Remember a peer's key; a link to it with another key (it restarted) is dropped."""
        if address == self.address:
            return
        if bulk:
            self.bulk[address] = bulk
        self.known[address] = key.encode()
        link = self.links.get(address)
        if link is not None and link.key != key.encode():
            self.drop(link)

    # ------------------------------------------------------------ links
    def pinned(self) -> set[str]:
        """Peers whose links stay open: the clique mates, or (``CKPTD_PEER_LINKS=all``, the
        former mesh) every daemon the trainers named."""
        return set(self.known) if knobs.PEER_LINKS.get() == "all" else set(self.mates)

    def link(self, address: str, key: str | bytes | None = None) -> PeerLink:
        """The link to ``address`` (dialed now if there is none, or the key changed); using
        it keeps an on-demand link open."""
        key_bytes = key.encode() if isinstance(key, str) else (key or self.known[address])
        link = self.links.get(address)
        if link is not None and link.key == key_bytes:
            link.last_used = time.monotonic()
            return link
        if link is not None:  # the peer restarted with a new key
            self.drop(link)
        sock = self.context.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_serverkey = key_bytes
        sock.curve_publickey = self._public
        sock.curve_secretkey = self._secret
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE)
        sock.connect(address)
        link = PeerLink(address, key_bytes, sock, PeerHealth(address),
                        self._stats.setdefault(address, PeerStats()))
        self.links[address] = link
        return link

    def drop(self, link: PeerLink) -> None:
        """Close a link (what is queued on it is discarded)."""
        link.socket.close(linger=0)
        if self.links.get(link.address) is link:
            del self.links[link.address]

    def redial(self, link: PeerLink) -> PeerLink:
        """Replace a link whose peer stopped answering; its health history carries over."""
        self.drop(link)
        fresh = self.link(link.address, link.key)
        fresh.health = link.health.redialed()
        return fresh

    def drop_idle(self, now: float, idle: float, busy: set) -> list[str]:
        """Close links outside :meth:`pinned` unused for ``idle`` seconds and not ``busy``
        (a stream with that peer in flight); returns their addresses."""
        keep = self.pinned() | busy
        dropped = [link for address, link in list(self.links.items())
                   if address not in keep and now - link.last_used > idle]
        for link in dropped:
            log.info("closed the idle on-demand link to %s (unused for %.0fs)", link.address,
                     now - link.last_used)
            self.drop(link)
        return [link.address for link in dropped]

    def link_of(self, sock: zmq.Socket) -> PeerLink | None:
        """The link that owns ``sock`` (None once it was dropped)."""
        return next((l for l in self.links.values() if l.socket is sock), None)

    def stats_of(self, address: str) -> PeerStats:
        """Counters of the exchange with ``address``."""
        return self._stats.setdefault(address, PeerStats())

    # ------------------------------------------------------------ senders
    def link_sender(self, address: str, keeps_open: bool = True) -> Sender:
        """Send to ``address`` over its current link (follows redials). A send marks the
        link used unless ``keeps_open`` is False (heartbeats: a link kept alive only by
        its own pings would never close)."""
        def send(body: Body, frames=()) -> bool:
            link = self.links.get(address)
            if link is None:
                raise PeerGone(f"no link to {address}")
            if keeps_open:
                link.last_used = time.monotonic()
            return _send_multipart(link.socket, [], body, frames)
        return send

    def router_sender(self, routing_id: bytes) -> Sender:
        """Answer a peer that dialed us, by its connection's routing id."""
        return lambda body, frames=(): _send_multipart(self.router, [routing_id], body, frames)

    # ------------------------------------------------------------ end
    def close(self) -> None:
        """Stop the authenticator and destroy every socket."""
        try:
            self.auth.stop()
        except Exception:  # stopping twice or after a failed start must not raise
            pass
        self.context.destroy(linger=0)
