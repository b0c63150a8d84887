"""Parts this daemon sends: pushes to holders, and a holder's copy served to a fetcher.

Owns the outgoing streams (:class:`~ckptd.replication.streams.OutStream`):

- *push*: after staging, the owner's daemon streams a part straight from the staging pool
  to each clique mate's daemon while its writers write the local copy; each holder's
  outcome goes back to the serve loop as a :class:`~ckptd.replication.commands.PushDone`;
- *serve*: asked with ``PART_GET``, a holder verifies its copy against its checksum before
  sending it, so a corrupted replica is never sent.

A stream without progress for :data:`ckptd.knobs.PEER_TIMEOUT` fails (reduced redundancy
for a push), never hangs. Runs on the replicator thread; it reads only the extents it was
told to push.
"""

from __future__ import annotations

import logging
import mmap
import secrets
from typing import Callable

from ckptd import knobs
from ckptd.checksum import ChecksumMismatchError, verify_file
from ckptd.replication.commands import CancelPush, Push, PushDone
from ckptd.replication.streams import FileSource, OutStream, PoolItems
from ckptd.replication.transport import PeerGone, PeerTransport, Sender, send_quietly
from ckptd.replication.wire import PartAck, PartBegin, PartDone, PartEnd, PartGet
from ckptd.storage.local_store import LocalStore, LocalStoreError

log = logging.getLogger(__name__)


class Outgoing:
    """The part streams this daemon sends (see the module docstring).

    Parameters
    ----------
    transport : PeerTransport
        Links and senders.
    store : LocalStore
        Where served parts come from.
    pool : mmap.mmap
        The staging pool, mapped read-only (pushes read from it).
    emit : callable
        Hands a :class:`PushDone` to the serve loop.
    """

    def __init__(self, transport: PeerTransport, store: LocalStore, pool: mmap.mmap,
                 emit: Callable[[object], None]) -> None:
        self.transport = transport
        self.store = store
        self.pool = pool
        self.emit = emit
        self.streams: dict[int, OutStream] = {}
        #: Peer message type -> handler ``(body, frames, send, from_router, peer)``.
        self.handlers = {PartGet: self._on_get, PartAck: self._on_ack, PartDone: self._on_done}

    # ------------------------------------------------------------ pushes
    def push(self, command: Push) -> None:
        """Start streaming a staged part to each of its holders."""
        part = command.part
        for address, key in command.holders:
            link = self.transport.link(address, key)
            source = PoolItems(self.pool, command.items)
            xfer = secrets.randbits(62)
            stream = OutStream(
                xfer=xfer, kind="push", peer=address, send=self.transport.link_sender(address),
                on_finish=self._push_finished(command.request_id, address, source.size),
                stats=link.stats, owner=part.owner, iteration=part.iteration, source=source,
                begin=PartBegin(xfer, source.size, part.session, part.owner, part.iteration),
                request_id=command.request_id)
            self.streams[xfer] = stream
            log.info("request %d (rank %d) replicating %d bytes of iteration %d to %s",
                     command.request_id, part.owner, source.size, part.iteration, address)
            self._pump(stream)

    def _push_finished(self, request_id: int, holder: str, size: int) -> Callable:
        def finished(ok: bool, error: str | None) -> None:
            self.emit(PushDone(request_id=request_id, holder=holder, error=error, ok=ok,
                               nbytes=size if ok else 0))
        return finished

    def cancel(self, command: CancelPush) -> None:
        """Stop the pushes of an aborted save."""
        for stream in [s for s in self.streams.values()
                       if s.kind == "push" and s.request_id == command.request_id]:
            send_quietly(stream.send, PartEnd(stream.xfer, abort=True,
                                              error="the save was aborted"))
            self._end(stream, False, "the save was aborted")

    # ------------------------------------------------------------ serving a fetch
    def _on_get(self, body: PartGet, frames, send: Sender, from_router: bool, peer: str) -> None:
        if not from_router:
            return
        path = None
        try:
            session = self.store.session(body.session)
            path = session.part_path(body.iteration, body.owner)
            checksum = verify_file(path)  # a corrupted replica is never sent
            source = FileSource(path)
        except FileNotFoundError:
            send_quietly(send, PartEnd(body.xfer, abort=True, error=(
                f"{self.transport.address} holds no part of rank {body.owner} for "
                f"iteration {body.iteration}")))
            return
        except (LocalStoreError, ChecksumMismatchError, OSError) as exc:
            if isinstance(exc, ChecksumMismatchError):
                self.store.note_verified(path, ok=False)
            log.warning("refused to serve a part to %s: %s", peer, exc)
            send_quietly(send, PartEnd(body.xfer, abort=True,
                                       error=f"{self.transport.address}: {exc}"))
            return
        stream = OutStream(xfer=body.xfer, kind="serve", peer=peer, send=send,
                           on_finish=lambda ok, error: None, owner=body.owner,
                           iteration=body.iteration, source=source,
                           begin=PartBegin(body.xfer, source.size, crc=checksum.value))
        self.streams[body.xfer] = stream
        log.info("serving %s (%d bytes) to %s", path, source.size, peer)
        self._pump(stream)

    # ------------------------------------------------------------ receiver's answers
    def _on_ack(self, body: PartAck, frames, send, from_router, peer) -> None:
        stream = self.streams.get(body.xfer)
        if stream is not None:
            stream.acknowledged(body.received)
            self._pump(stream)

    def _on_done(self, body: PartDone, frames, send, from_router, peer) -> None:
        stream = self.streams.get(body.xfer)
        if stream is not None:
            ok = body.ok and stream.end_sent
            self._end(stream, ok, None if ok else body.error or "refused")

    # ------------------------------------------------------------ mechanics
    def _pump(self, stream: OutStream) -> None:
        if stream.xfer not in self.streams:
            return
        try:
            stream.pump()
        except PeerGone as exc:
            self._end(stream, False, f"{stream.peer} went away: {exc}")

    def _end(self, stream: OutStream, ok: bool, error: str | None) -> None:
        if self.streams.pop(stream.xfer, None) is None:
            return
        stream.source.close()
        if stream.stats is not None:
            stream.stats.stream_ended(ok, error)
        if stream.kind == "push":
            if ok:
                log.info("request %d (rank %d) replica durable on %s", stream.request_id,
                         stream.owner, stream.peer)
            else:
                log.warning("request %d (rank %d) replication to %s failed: %s",
                            stream.request_id, stream.owner, stream.peer, error)
        stream.on_finish(ok, error)

    def tick(self, now: float) -> None:
        """Fail streams without progress; resend what would have blocked."""
        timeout = knobs.PEER_TIMEOUT.get()
        for stream in list(self.streams.values()):
            if now - stream.last_progress <= timeout:
                self._pump(stream)
                continue
            self._end(stream, False, f"{stream.peer} made no progress for {timeout:.0f}s "
                                     "(peer down or stuck)")
            link = self.transport.links.get(stream.peer)
            if link is not None and stream.kind == "push":
                self.transport.redial(link)

    def close(self, reason: str) -> None:
        """End every stream (the daemon is stopping)."""
        for stream in list(self.streams.values()):
            self._end(stream, False, reason)

    def lag_by_peer(self, now: float) -> dict[str, float]:
        """Age of the oldest push still streaming to each peer."""
        lag: dict[str, float] = {}
        for stream in self.streams.values():
            if stream.kind == "push":
                lag[stream.peer] = max(lag.get(stream.peer, 0.0), now - stream.started)
        return lag

    def describe(self) -> list[dict]:
        """Streams in flight, for the status document."""
        return [{"direction": "out", "kind": s.kind, "peer": s.peer, "request_id": s.request_id,
                 "owner": s.owner, "iteration": s.iteration, "size": s.size,
                 "bytes_done": max(s.acked, 0)} for s in self.streams.values()]
