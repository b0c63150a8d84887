"""Parts this daemon receives: replicas pushed to it, and parts it fetches for its ranks.

Owns the replicator thread's side of incoming streams (the bytes arrive on the bulk
connections of :mod:`.bulk_receive`) and each fetch's list of holders still to try:

- *replica*: a clique mate's daemon pushes its rank's part; it is written under the
  owner's name through the local store, checksummed as it arrives (nothing to do here
  but count it);
- *fetch*: a daemon whose rank lost its part asks the holders in order (``PART_GET`` on
  the control link, dialed for the fetch when the holder is not a clique mate, asked
  again until the stream begins; the holder knows who asks from the link's CURVE key); the holder streams it to this
  daemon's bulk listener, where it is written, checksummed on the way, checked against
  the crc32 the holder recorded, and made durable once. A holder that refuses or fails
  means "next holder". The outcome goes back to the serve loop as a
  :class:`~ckptd.replication.commands.FetchDone`.

A stream without progress for :data:`ckptd.knobs.PEER_TIMEOUT` fails, never hangs.
Runs on the replicator thread.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ckptd import knobs
from ckptd.replication.bulk_receive import Target, Targets
from ckptd.replication.commands import Fetch, FetchDone, Received
from ckptd.replication.sealing import raw_key
from ckptd.replication.transport import PeerTransport, send_quietly
from ckptd.replication.wire import PartGet, PartRefused

log = logging.getLogger(__name__)


@dataclass
class _FetchState:
    command: Fetch
    holders: deque
    tried: list = field(default_factory=list)
    holder: str | None = None      # the holder asked now
    get: PartGet | None = None
    asked_at: float = 0.0


class Incoming:
    """The part streams this daemon receives (see the module docstring).

    Parameters
    ----------
    transport : PeerTransport
        Control links to the holders.
    targets : Targets
        The bulk listener's transfers.
    emit : callable
        Hands a :class:`FetchDone` to the serve loop.
    activity : callable
        ``activity(raw key)``: when bytes last arrived from that peer (the listener).
    """

    def __init__(self, transport: PeerTransport, targets: Targets,
                 emit: Callable[[object], None],
                 activity: Callable[[bytes], float] = lambda key: 0.0) -> None:
        self.transport = transport
        self.targets = targets
        self._activity = activity
        self.emit = emit
        self._fetches: dict[int, _FetchState] = {}  # xfer -> the fetch waiting for it
        #: Peer message type -> handler ``(body, frames, send, from_router, peer)``.
        self.handlers = {PartRefused: self._on_refused}

    # ------------------------------------------------------------ fetches
    def fetch(self, command: Fetch) -> None:
        """Start fetching a part from its holders, in order."""
        self._fetch_next(_FetchState(command, deque(command.holders)))

    def _fetch_next(self, fetch: _FetchState) -> None:
        command, part = fetch.command, fetch.command.part
        while fetch.holders:
            address, key = fetch.holders.popleft()[:2]
            if address == self.transport.address:
                fetch.tried.append({"holder": address, "error": "that is this daemon"})
                continue
            xfer = secrets.randbits(62)
            self.targets.expect(Target(xfer, "fetch", command.path, raw_key(key), address,
                                       part.owner, part.iteration))
            self.transport.link(address, key)
            fetch.holder = address
            fetch.get = PartGet(xfer, part.session, part.owner, part.iteration)
            self._fetches[xfer] = fetch
            log.info("fetching rank %d's part of iteration %d from %s", part.owner,
                     part.iteration, address)
            self._ask(fetch, time.monotonic())
            return
        self.emit(FetchDone(command.fetch_id, False, None, None, fetch.tried))

    def _ask(self, fetch: _FetchState, now: float) -> None:
        fetch.asked_at = now
        send_quietly(self.transport.link_sender(fetch.holder), fetch.get)

    def _failed(self, fetch: _FetchState, error: str) -> None:
        part = fetch.command.part
        log.warning("fetching rank %d's part of iteration %d from %s failed: %s; trying the "
                    "next holder", part.owner, part.iteration, fetch.holder, error)
        fetch.tried.append({"holder": fetch.holder, "error": error})
        self._fetch_next(fetch)

    def on_received(self, event: Received) -> None:
        """A transfer to this daemon ended (a fetch's outcome decides its next step)."""
        fetch = self._fetches.pop(event.xfer, None)
        if fetch is None:
            return  # a replica: the bulk side logged and counted it
        if event.ok:
            self.emit(FetchDone(fetch.command.fetch_id, True, event.path, fetch.holder,
                                fetch.tried))
        else:
            self._failed(fetch, event.error or "failed")

    def _on_refused(self, body: PartRefused, frames, send, from_router: bool, peer: str) -> None:
        fetch = self._fetches.get(body.xfer)
        if fetch is not None and self.targets.forget(body.xfer) is not None:
            del self._fetches[body.xfer]
            self._failed(fetch, body.error or "refused")

    def peers_in_use(self) -> set[str]:
        """Holders a fetch is waiting on now (their links stay open)."""
        return {fetch.holder for fetch in self._fetches.values() if fetch.holder}

    # ------------------------------------------------------------ timers, status
    def tick(self, now: float) -> None:
        """Fail transfers without progress; ask again where a stream has not begun."""
        self.targets.expire(now, knobs.PEER_TIMEOUT.get(), self._activity)
        interval = knobs.PEER_PING_INTERVAL.get()
        for xfer, fetch in list(self._fetches.items()):
            if now - fetch.asked_at > interval and not self.targets.begun(xfer):
                self._ask(fetch, now)

    def close(self, reason: str) -> None:
        """End every transfer (the daemon is stopping)."""
        self.targets.close(reason)

    def describe(self) -> list[dict]:
        """Streams in flight, for the status document."""
        return self.targets.describe()
