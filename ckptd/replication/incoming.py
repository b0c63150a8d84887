"""Parts this daemon receives: replicas pushed to it, and parts it fetches for its ranks.

Owns the incoming streams (:class:`~ckptd.replication.streams.InStream`) and each fetch's
list of holders still to try:

- *replica*: a clique mate's daemon pushes its rank's part; it is written under the
  owner's name through the local store (dirty name, fsync, checksum, rename);
- *fetch*: a daemon whose rank lost its part asks the holders in order; the crc32 the
  holder recorded is checked again on arrival, so a corrupted copy is never kept, and a
  holder that fails means "next holder". The outcome goes back to the serve loop as a
  :class:`~ckptd.replication.commands.FetchDone`.

A stream without progress for :data:`ckptd.knobs.PEER_TIMEOUT` fails, never hangs.
Runs on the replicator thread.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ckptd import knobs
from ckptd.checksum import ChecksumMismatchError
from ckptd.replication.commands import Fetch, FetchDone
from ckptd.replication.streams import InStream
from ckptd.replication.transport import PeerTransport, Sender, send_quietly
from ckptd.replication.wire import PartAck, PartBegin, PartChunk, PartDone, PartEnd, PartGet
from ckptd.storage.local_store import LocalStore, LocalStoreError

log = logging.getLogger(__name__)


@dataclass
class _FetchState:
    command: Fetch
    holders: deque
    tried: list = field(default_factory=list)


class Incoming:
    """The part streams this daemon receives (see the module docstring).

    Parameters
    ----------
    transport : PeerTransport
        Links and senders.
    store : LocalStore
        Where replicas and fetched parts are written.
    emit : callable
        Hands a :class:`FetchDone` to the serve loop.
    """

    def __init__(self, transport: PeerTransport, store: LocalStore,
                 emit: Callable[[object], None]) -> None:
        self.transport = transport
        self.store = store
        self.emit = emit
        self.streams: dict[int, InStream] = {}
        #: Peer message type -> handler ``(body, frames, send, from_router, peer)``.
        self.handlers = {PartBegin: self._on_begin, PartChunk: self._on_chunk,
                         PartEnd: self._on_end}

    # ------------------------------------------------------------ fetches
    def fetch(self, command: Fetch) -> None:
        """Start fetching a part from its holders, in order."""
        self._fetch_next(_FetchState(command, deque(command.holders)))

    def _fetch_next(self, fetch: _FetchState) -> None:
        command, part = fetch.command, fetch.command.part
        while fetch.holders:
            address, key = fetch.holders.popleft()
            if address == self.transport.address:
                fetch.tried.append({"holder": address, "error": "that is this daemon"})
                continue
            link = self.transport.link(address, key)
            xfer = secrets.randbits(62)
            stream = InStream(xfer=xfer, kind="fetch", peer=address,
                              send=self.transport.link_sender(address),
                              on_finish=self._fetch_step(fetch, address), stats=link.stats,
                              owner=part.owner, iteration=part.iteration, path=command.path,
                              pending_get=PartGet(xfer, part.session, part.owner,
                                                  part.iteration))
            self.streams[xfer] = stream
            log.info("fetching rank %d's part of iteration %d from %s", part.owner,
                     part.iteration, address)
            self._send_get(stream)
            return
        self.emit(FetchDone(command.fetch_id, False, None, None, fetch.tried))

    def _fetch_step(self, fetch: _FetchState, address: str) -> Callable:
        def step(ok: bool, error: str | None) -> None:
            command = fetch.command
            if ok:
                self.emit(FetchDone(command.fetch_id, True, command.path, address, fetch.tried))
                return
            log.warning("fetching rank %d's part of iteration %d from %s failed: %s; trying "
                        "the next holder", command.part.owner, command.part.iteration, address,
                        error)
            fetch.tried.append({"holder": address, "error": error})
            self._fetch_next(fetch)
        return step

    def _send_get(self, stream: InStream) -> None:
        """Ask the holder for the part (again at each tick while it would block)."""
        if stream.pending_get is not None and send_quietly(stream.send, stream.pending_get):
            stream.pending_get = None

    # ------------------------------------------------------------ sender's messages
    def _on_begin(self, body: PartBegin, frames, send: Sender, from_router: bool,
                  peer: str) -> None:
        stream = self.streams.get(body.xfer)
        if stream is None and from_router:
            self._accept_replica(body, send, peer)
        elif stream is not None and stream.writer is None:
            try:
                stream.begin(body.size, body.crc)
            except OSError as exc:
                self._end(stream, False, f"cannot store the fetched part at {stream.path}: {exc}")
                return
            send_quietly(stream.send, PartAck(stream.xfer, 0))

    def _accept_replica(self, body: PartBegin, send: Sender, peer: str) -> None:
        try:
            if body.session is None or body.owner is None or body.iteration is None:
                raise ValueError("a pushed part must name its session, owner and iteration")
            session = self.store.session(body.session)
            path = session.part_path(body.iteration, body.owner)
            stream = InStream(xfer=body.xfer, kind="replica", peer=peer, send=send,
                              on_finish=lambda ok, error: None, owner=body.owner,
                              iteration=body.iteration, path=path)
            stream.begin(body.size, None)
        except (LocalStoreError, ValueError, OSError) as exc:
            log.warning("refused a replica from %s: %s", peer, exc)
            send_quietly(send, PartDone(body.xfer, False, f"holder refused: {exc}"))
            return
        self.streams[body.xfer] = stream
        log.info("receiving rank %d's part of iteration %d (%d bytes) into %s", body.owner,
                 body.iteration, body.size, path)
        send_quietly(send, PartAck(body.xfer, 0))

    def _on_chunk(self, body: PartChunk, frames, send, from_router, peer) -> None:
        stream = self.streams.get(body.xfer)
        if stream is None or not frames:
            return
        problem = stream.chunk(body.offset, frames[0])
        if problem is not None:
            self._end(stream, False, problem)
            return
        send_quietly(stream.send, PartAck(stream.xfer, stream.received))

    def _on_end(self, body: PartEnd, frames, send, from_router, peer) -> None:
        stream = self.streams.get(body.xfer)
        if stream is None:
            return
        if body.abort:
            self._end(stream, False, body.error or "the sender gave up", reply=False)
        elif stream.writer is None or stream.received != stream.size:
            self._end(stream, False, f"stream ended after {stream.received} of "
                                     f"{stream.size} bytes")
        elif stream.expected_crc is not None and body.crc != stream.expected_crc:
            self._end(stream, False, f"the holder's copy changed while it was sent "
                                     f"(crc32 {body.crc} vs recorded {stream.expected_crc})")
        else:
            self._complete(stream, body.crc)

    def _complete(self, stream: InStream, crc: int | None) -> None:
        try:
            stream.writer.finish(crc)
        except (ChecksumMismatchError, OSError) as exc:
            stream.writer = None  # finish() already removed the dirty file
            self._end(stream, False, str(exc))
            return
        self.store.note_verified(stream.path)
        log.info("%s %s durable (%d bytes, crc32 %08x)",
                 "replica" if stream.kind == "replica" else "fetched part", stream.path,
                 stream.size, crc or 0)
        send_quietly(stream.send, PartDone(stream.xfer, True))
        self._end(stream, True, None)

    # ------------------------------------------------------------ mechanics
    def _end(self, stream: InStream, ok: bool, error: str | None, reply: bool = True) -> None:
        if self.streams.pop(stream.xfer, None) is None:
            return
        if not ok:
            stream.discard()
            if reply:
                send_quietly(stream.send, PartDone(stream.xfer, False, error))
            log.warning("receiving %s from %s failed: %s", stream.path, stream.peer, error)
        if stream.stats is not None:
            stream.stats.stream_ended(ok, error)
        stream.on_finish(ok, error)

    def tick(self, now: float) -> None:
        """Fail streams without progress; resend a fetch request that would have blocked."""
        timeout = knobs.PEER_TIMEOUT.get()
        for stream in list(self.streams.values()):
            if now - stream.last_progress > timeout:
                self._end(stream, False, f"{stream.peer} sent nothing for {timeout:.0f}s "
                                         "(peer down or stuck)")
            else:
                self._send_get(stream)

    def close(self, reason: str) -> None:
        """End every stream (the daemon is stopping)."""
        for stream in list(self.streams.values()):
            self._end(stream, False, reason)

    def describe(self) -> list[dict]:
        """Streams in flight, for the status document."""
        return [{"direction": "in", "kind": s.kind, "peer": s.peer, "request_id": None,
                 "owner": s.owner, "iteration": s.iteration, "size": s.size,
                 "bytes_done": s.received} for s in self.streams.values()]
