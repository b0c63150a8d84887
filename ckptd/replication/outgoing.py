"""Parts this daemon sends: pushes to holders, and a holder's copy served to a fetcher.

Owns the replicator thread's side of outgoing streams (the bytes move on the bulk
connections of :mod:`.bulk_send`):

- *push*: after staging, the owner's daemon streams a part straight from the staging pool
  to each clique mate's daemon while its writers write the local copy; each holder's
  outcome goes back to the serve loop as a :class:`~ckptd.replication.commands.PushDone`;
- *serve*: asked with ``PART_GET`` (on the control link), a holder streams its copy to the
  bulk address of the daemon whose CURVE key authenticated the request (never to a daemon
  the request names: a peer cannot make a holder push onto a third daemon), checksumming
  what it reads: a copy that no longer matches its
  record is never completed, and is marked unverified here.

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
from ckptd.checksum import ChecksumMismatchError, read_sidecar
from ckptd.replication.bulk_send import BulkSender
from ckptd.replication.send_job import SendJob
from ckptd.replication.bulk_wire import Begin
from ckptd.replication.commands import CancelPush, Push, PushDone, Sent
from ckptd.replication.sealing import raw_key
from ckptd.replication.streams import FileSource, PoolItems
from ckptd.replication.transport import PeerTransport, Sender, send_quietly
from ckptd.replication.wire import PartGet, PartRefused
from ckptd.storage.local_store import LocalStore, LocalStoreError

log = logging.getLogger(__name__)


class Outgoing:
    """The part streams this daemon sends (see the module docstring).

    Parameters
    ----------
    transport : PeerTransport
        Control links, peer keys and bulk addresses.
    store : LocalStore
        Where served parts come from.
    pool : mmap.mmap
        The staging pool, mapped read-only (pushes read from it).
    sender : BulkSender
        The bulk connections.
    emit : callable
        Hands a :class:`PushDone` to the serve loop.
    """

    def __init__(self, transport: PeerTransport, store: LocalStore, pool: mmap.mmap,
                 sender: BulkSender, emit: Callable[[object], None]) -> None:
        self.transport = transport
        self.store = store
        self.pool = pool
        self.sender = sender
        self.emit = emit
        self._pushes: dict[int, tuple] = {}   # xfer -> (request id, holder, bytes)
        self._serving: dict[int, str] = {}    # xfer -> path of the copy served
        #: Peer message type -> handler ``(body, frames, send, from_router, peer)``.
        self.handlers = {PartGet: self._on_get}

    # ------------------------------------------------------------ pushes
    def push(self, command: Push) -> None:
        """Start streaming a staged part to each of its holders."""
        part = command.part
        for address, key, bulk in command.holders:
            source = PoolItems(self.pool, command.items)
            xfer = secrets.randbits(62)
            job = SendJob(xfer, "push", address, source,
                          Begin(part.session, part.owner, part.iteration,
                                algorithm=knobs.CHECKSUM.get()),
                          self.transport.stats_of(address), request_id=command.request_id,
                          owner=part.owner, iteration=part.iteration)
            self._pushes[xfer] = (command.request_id, address, source.size)
            self.transport.link(address, key)  # heartbeats tell whether it is alive
            log.info("request %d (rank %d) replicating %d bytes of iteration %d to %s",
                     command.request_id, part.owner, source.size, part.iteration, address)
            self.sender.send(bulk, raw_key(key), address, job)

    def cancel(self, command: CancelPush) -> None:
        """Stop the pushes of an aborted save (each still reports its outcome)."""
        self.sender.cancel(lambda job: job.kind == "push" and job.request_id == command.request_id,
                           f"the save was stopped: {command.reason}")

    def on_sent(self, event: Sent) -> None:
        """A push or a served copy ended."""
        push = self._pushes.pop(event.xfer, None)
        if push is not None:
            request_id, holder, size = push
            if event.ok:
                log.info("request %d replica durable on %s", request_id, holder)
            self.emit(PushDone(request_id=request_id, holder=holder, error=event.error,
                               ok=event.ok, nbytes=size if event.ok else 0))
        path = self._serving.pop(event.xfer, None)
        if path is not None and event.corrupted:
            self.store.note_verified(path, ok=False)

    # ------------------------------------------------------------ serving a fetch
    def _on_get(self, body: PartGet, frames, send: Sender, from_router: bool, peer: str) -> None:
        """``peer`` is the daemon whose CURVE key authenticated the request: the part goes
        to that daemon's bulk listener and to no one else, whoever the body names."""
        if not from_router or body.xfer in self._serving:
            return  # a repeated request for a stream under way
        key, bulk = self.transport.known.get(peer), self.transport.bulk.get(peer)
        if key is None or bulk is None:
            self._refuse(send, body, peer, f"{self.transport.address} does not know the asking "
                                           f"daemon ({peer}): its key is not in the trainers' "
                                           "table of this session")
            return
        if body.requester and body.requester != peer:
            self._refuse(send, body, peer, f"{peer} asked for a copy to go to "
                                           f"{body.requester}: a holder sends a part only to "
                                           "the daemon that asks for it")
            return
        path = None
        try:
            path = self.store.session(body.session).part_path(body.iteration, body.owner)
            if self.store.cached_verification(path) is False:
                raise ChecksumMismatchError(f"{path} is corrupted (it failed its checksum)")
            recorded = read_sidecar(path)
            source = FileSource(path)
        except FileNotFoundError:
            self._refuse(send, body, peer, f"{self.transport.address} holds no part of rank "
                                           f"{body.owner} for iteration {body.iteration}")
            return
        except (LocalStoreError, ChecksumMismatchError, OSError) as exc:
            self._refuse(send, body, peer, f"{self.transport.address}: {exc}")
            return
        job = SendJob(body.xfer, "serve", peer, source,
                      Begin(body.session, body.owner, body.iteration, recorded.value,
                            recorded.algorithm),
                      self.transport.stats_of(peer), expected_crc=recorded.value,
                      owner=body.owner, iteration=body.iteration)
        self._serving[body.xfer] = path
        log.info("serving %s (%d bytes) to %s", path, source.size, peer)
        self.sender.send(bulk, raw_key(key), peer, job)

    @staticmethod
    def _refuse(send: Sender, body: PartGet, peer: str, error: str) -> None:
        log.warning("refused to serve rank %d's part of iteration %d to %s: %s", body.owner,
                    body.iteration, peer, error)
        send_quietly(send, PartRefused(body.xfer, error))

    # ------------------------------------------------------------ timers, status
    def tick(self, now: float) -> None:
        """Fail streams without progress."""
        self.sender.expire(now, knobs.PEER_TIMEOUT.get())

    def close(self, reason: str) -> None:
        """End every stream and close the bulk connections (the daemon is stopping)."""
        self.sender.cancel(lambda job: True, reason)
        self.sender.close()

    def peers_in_use(self) -> set[str]:
        """Peers a push or a served copy is streaming to now (their links stay open)."""
        return {job.peer for _, job in self.sender.jobs()}

    def lag_by_peer(self, now: float) -> dict[str, float]:
        """Age of the oldest push still streaming to each peer."""
        lag: dict[str, float] = {}
        for _, job in self.sender.jobs():
            if job.kind == "push":
                lag[job.peer] = max(lag.get(job.peer, 0.0), now - job.started)
        return lag

    def describe(self) -> list[dict]:
        """Streams in flight, for the status document."""
        return [{"direction": "out", "kind": job.kind, "peer": job.peer,
                 "request_id": job.request_id, "owner": job.owner, "iteration": job.iteration,
                 "size": job.size, "bytes_done": job.acked_bytes}
                for _, job in self.sender.jobs()]
