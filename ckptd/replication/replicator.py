"""The replicator thread: a daemon's peer side, off the serve loop.

Owns the thread and its loop: it polls the peer control sockets (:mod:`.transport`), its
command mailbox and the bulk threads' mailbox, dispatches commands and bulk outcomes
(:mod:`.commands`) and peer messages (:mod:`.wire`) through one handler table each, keeps
each peer's heartbeat (:mod:`.health`), runs the streams' timers (:mod:`.outgoing`,
:mod:`.incoming`), and republishes a status snapshot the serve loop reads. It also owns
the bulk path's pieces: the listener (:mod:`.bulk_receive`) and the sending lanes
(:mod:`.bulk_send`), whose threads move part bytes. Network waits and replica fsyncs
therefore never stall the serve loop, and heartbeats never wait behind part bytes.

Pattern: a thread with a typed mailbox in (commands) and one out (events), both
:class:`ckptd.mailbox.Mailbox`; the serve loop polls ``events.doorbell``.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Callable

import zmq

from ckptd import knobs, protocol
from ckptd.mailbox import Mailbox
from ckptd.replication.bulk_receive import BulkListener, Targets
from ckptd.replication.bulk_send import BulkSender
from ckptd.replication.commands import (CancelPush, ConnectPeers, Fetch, Push, Received, Sent,
                                        SetPeers, StopReplicator)
from ckptd.replication.incoming import Incoming
from ckptd.replication.outgoing import Outgoing
from ckptd.replication.sealing import PROTECTIONS
from ckptd.replication.transport import PeerTransport, Sender, bind_host, send_quietly
from ckptd.replication.wire import PEER_MESSAGES, PeerPing, PeerPong
from ckptd.storage.local_store import LocalStore

log = logging.getLogger(__name__)


class _SharedMailbox(Mailbox):
    """A mailbox every bulk connection thread may post to (one lock around the doorbell)."""

    def __init__(self, context: zmq.Context, name: str) -> None:
        super().__init__(context, name)
        self._post_lock = threading.Lock()

    def post(self, item: object) -> None:
        """Queue ``item`` and wake the replicator (any thread)."""
        with self._post_lock:
            super().post(item)


class Replicator:
    """The peer side of one daemon, running in its own thread.

    Parameters
    ----------
    listen : str
        ``tcp://host:port`` to bind the peer socket on.
    store : LocalStore
        Where replicas and fetched parts are written, and served from.
    pool_path, pool_size
        The staging pool pushes read from (mapped read-only here).
    advertise : str, optional
        ``--peer-advertise``: the host other nodes reach this daemon at.
    protection : str, optional
        ``--peer-encryption``: how bulk bytes are protected (:data:`PROTECTIONS`).

    Attributes
    ----------
    address : str
        The control address peers dial.
    bulk_address : str
        ``host:port`` of the bulk listener (same host as :attr:`address`).
    public_key : str
        This daemon's CURVE public key (z85), handed to peers through the trainers.
    events : Mailbox
        :class:`~ckptd.replication.commands.PushDone` and
        :class:`~ckptd.replication.commands.FetchDone` for the serve loop.
    snapshot : dict
        Peers and streams as of the last tick (read by the serve loop for status).
    """

    def __init__(self, listen: str, store: LocalStore, pool_path: str, pool_size: int,
                 advertise: str | None = None, protection: str | None = None) -> None:
        self.protection = protection or knobs.PEER_ENCRYPTION.get()
        if self.protection not in PROTECTIONS:
            raise ValueError(f"unknown peer encryption {self.protection!r}; choose one of "
                             f"{', '.join(PROTECTIONS)}")
        self.transport = PeerTransport(listen, advertise)
        self.address = self.transport.address
        self.public_key = self.transport.public_key
        self._commands = Mailbox(self.transport.context, "replicator-commands")
        self.events = Mailbox(self.transport.context, "replicator-events")
        self._bulk_events = _SharedMailbox(self.transport.context, "replicator-bulk")
        fd = os.open(pool_path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            self._pool = mmap.mmap(fd, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        credentials = (self.transport.raw_secret, self.transport.raw_public, self.protection)
        self.targets = Targets(store, self._bulk_events.post, self._peer_of_key)
        self.listener = BulkListener(bind_host(listen), credentials, self.transport.allowed_raw,
                                     self.targets)
        self.bulk_address = f"{self.transport.host}:{self.listener.port}"
        sender = BulkSender(credentials, self._bulk_events.post)
        self.outgoing = Outgoing(self.transport, store, self._pool, sender, self.events.post)
        self.incoming = Incoming(self.transport, self.targets, self.events.post,
                                 self.listener.activity)
        self._command_handlers: dict[type, Callable] = {
            SetPeers: self._set_peers, ConnectPeers: self._connect_peers,
            Push: self.outgoing.push, CancelPush: self.outgoing.cancel,
            Fetch: self.incoming.fetch, StopReplicator: self._stop_requested,
            Sent: self.outgoing.on_sent, Received: self.incoming.on_received,
        }
        self._peer_handlers: dict[type, Callable] = {
            **self.outgoing.handlers, **self.incoming.handlers,
            PeerPing: self._on_ping, PeerPong: self._on_pong,
        }
        self._stopping = False
        self._poller = zmq.Poller()
        self._polled_links: set = set()
        self.snapshot: dict = {"address": self.address, "peers": [], "streams": []}
        self._thread = threading.Thread(target=self._run, name="ckptd-replicator", daemon=True)

    # ------------------------------------------------------------ serve-loop side
    def start(self) -> None:
        """Start the replicator thread and the bulk listener."""
        self.listener.start()
        self._thread.start()
        log.info("peer socket on %s (CURVE, key %s); bulk listener on %s (%s)", self.address,
                 self.public_key, self.bulk_address, self.protection)

    def _peer_of_key(self, raw: bytes) -> tuple:
        """(control address, PeerStats) of the peer with this raw key (bulk threads ask)."""
        address = self.transport.address_of_key(raw)
        return address, self.transport.stats_of(address)

    def command(self, command: object) -> None:
        """Hand a command to the replicator thread (serve loop only)."""
        self._commands.post(command)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, drop in-flight streams, close the peer sockets."""
        if self._thread.is_alive():
            try:
                self.command(StopReplicator())
            except zmq.ZMQError:
                pass
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Release sockets, the authenticator, the bulk listener and the pool mapping."""
        self.listener.close()
        self.transport.close()
        try:
            self._pool.close()
        except BufferError:  # a frame still references it; the process is exiting
            pass

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        self._poller.register(self.transport.router, zmq.POLLIN)
        self._poller.register(self._commands.doorbell, zmq.POLLIN)
        self._poller.register(self._bulk_events.doorbell, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._stopping:
                self._poll_current_links()
                for sock, _ in self._poller.poll(int(knobs.REPLICATOR_TICK.get() * 1000)):
                    if sock.closed:  # a link dropped while handling this batch
                        continue
                    try:
                        self._serve_socket(sock)
                    except Exception:  # one bad message must not end replication
                        log.exception("replicator: handling a message failed")
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + knobs.REPLICATOR_TICK.get()
        finally:
            self.incoming.close("ckptd is shutting down")
            self.outgoing.close("ckptd is shutting down")

    def _poll_current_links(self) -> None:
        """Keep the poller's set of link sockets equal to the live links."""
        current = {link.socket for link in self.transport.links.values()}
        for sock in self._polled_links - current:
            self._poller.unregister(sock)
        for sock in current - self._polled_links:
            self._poller.register(sock, zmq.POLLIN)
        self._polled_links = current

    def _serve_socket(self, sock: zmq.Socket) -> None:
        if sock in (self._commands.doorbell, self._bulk_events.doorbell):
            mailbox = self._commands if sock is self._commands.doorbell else self._bulk_events
            mailbox.drain(lambda command: self._command_handlers[type(command)](command))
            return
        frames = sock.recv_multipart(copy=False)
        if sock is self.transport.router:
            # Who asks is the daemon whose key the authenticator admitted, whatever the
            # message says: a keyed peer must not act in another daemon's name.
            routing_id = frames[0].bytes
            sender = self.transport.sender_of(frames[1]) if len(frames) > 1 else None
            self._on_peer_message(frames[1:], self.transport.router_sender(routing_id),
                                  from_router=True,
                                  peer=sender or f"unnamed peer connection {routing_id.hex()}")
            return
        link = self.transport.link_of(sock)
        if link is not None:
            self._on_peer_message(frames, self.transport.link_sender(link.address),
                                  from_router=False, peer=link.address)

    def _on_peer_message(self, frames: list, send: Sender, from_router: bool, peer: str) -> None:
        msg = protocol.decode([f.buffer for f in frames])
        kind = PEER_MESSAGES.get(msg.type)
        if kind is None:
            log.warning("ignored a %r message from %s: not a peer message", msg.type, peer)
            return
        body = kind.from_wire(msg.body)
        self._peer_handlers[kind](body, msg.frames, send, from_router, peer)

    @staticmethod
    def _on_ping(body: PeerPing, frames, send: Sender, from_router: bool, peer: str) -> None:
        send_quietly(send, PeerPong(body.t))

    def _on_pong(self, body: PeerPong, frames, send, from_router: bool, peer: str) -> None:
        link = None if from_router else self.transport.links.get(peer)
        if link is not None:
            link.health.pong(time.monotonic())

    # ------------------------------------------------------------ commands
    def _set_peers(self, command: SetPeers) -> None:
        # Links are dialed later (ConnectPeers, or a push or fetch), once every daemon has
        # this table: dialing a peer that does not know our key yet would be refused. A
        # peer that came back with a new key is redialed then too.
        self.transport.allow(command.allowed_keys)
        for address, key, *bulk in command.peers:
            self.transport.learn(address, key, bulk[0] if bulk else None)
        self.transport.mates = {address for address in command.mates
                                if address != self.address}

    def _connect_peers(self, command: ConnectPeers) -> None:
        # Only the pinned peers (the clique mates): anyone else is dialed when a fetch
        # needs it, so a daemon's links and heartbeats do not grow with the job.
        for address in sorted(self.transport.pinned()):
            self.transport.link(address)

    def _stop_requested(self, command: StopReplicator) -> None:
        self._stopping = True

    # ------------------------------------------------------------ timers
    def _tick(self, now: float) -> None:
        self.outgoing.tick(now)
        self.incoming.tick(now)
        for link in list(self.transport.links.values()):
            if link.health.ping_due(now):
                send_quietly(self.transport.link_sender(link.address, keeps_open=False),
                             PeerPing(time.time()))
            link.health.assess(now)
            if link.health.wants_redial(now):
                self.transport.redial(link)
        idle = knobs.PEER_IDLE_TIMEOUT.get()
        busy = self.outgoing.peers_in_use() | self.incoming.peers_in_use()
        self.transport.drop_idle(now, idle, busy)
        self.outgoing.sender.drop_idle(now, idle, self.transport.pinned() | busy)
        self._publish(now)

    def _publish(self, now: float) -> None:
        lag = self.outgoing.lag_by_peer(now)
        peers = []
        for link in self.transport.links.values():
            heard = link.health.last_heard(now)
            stats = link.stats
            peers.append({"address": link.address, "health": link.health.state,
                          "lag_s": round(lag.get(link.address, 0.0), 3),
                          "last_heard_s": None if heard is None else round(heard, 3),
                          "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                          "streams_ok": stats.streams_ok, "streams_failed": stats.streams_failed,
                          "last_error": stats.last_error})
        self.snapshot = {"address": self.address,
                         "peers": sorted(peers, key=lambda p: p["address"]),
                         "streams": self.outgoing.describe() + self.incoming.describe()}

