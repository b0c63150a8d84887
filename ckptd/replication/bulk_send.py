"""Sending parts on the bulk path: several authenticated tcp connections per peer.

Owns the sending side of every part stream (a push to a holder, or a holder's copy
served to a fetcher): the :class:`~ckptd.replication.send_job.SendJob` s on a
:class:`Lane` per peer:

- a job is ``BEGIN`` (answered ``READY``), its chunks (each answered ``ACK`` once the
  receiver wrote it), then ``END`` once every chunk is acknowledged (answered ``DONE`` once
  the part is durable there). Chunks of one job spread over the lane's connections
  (:data:`ckptd.knobs.PEER_STREAMS`), read straight out of the staging pool (or the part
  file), never copied before sealing;
- each connection has a writing thread (takes work, seals, sends; at most
  :data:`ckptd.knobs.REPLICATION_WINDOW` unacknowledged chunks) and a reading thread
  (answers). A connection that breaks puts what it had in flight back at the head of the
  queue and is dialed again: an interrupted transfer resumes where it was, on the
  connections that work, instead of being dropped;
- serving a fetch checksums the bytes it reads and sends ``ABORT`` instead of ``END`` when
  this daemon's copy no longer matches its record: a corrupted copy is never completed;
- every outcome is posted as a :class:`~ckptd.replication.commands.Sent`; a job without
  progress for :data:`ckptd.knobs.PEER_TIMEOUT` is failed by :meth:`BulkSender.expire`
  (called on the replicator's tick): a slow link is not a dead one, a cut one is reported;
- a dial that finds the peer's daemon gone (a restarted daemon with another key answers
  at its bulk address, :class:`~.bulk_connection.PeerGoneError`; or dials there keep
  being refused while no connection moves a byte, :mod:`.refusals`) ends every job of
  that lane at once: what the receiver held went with it, so no job there can resume, and
  a restarted peer would otherwise cost each its whole deadline. A dial that fails drops
  the work of finished jobs: a lane without live jobs stops dialing.

Liveness is not judged here: heartbeats travel on the ZeroMQ control link, never behind
part bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from ckptd import knobs
from ckptd.checksum import algorithm_named
from ckptd.replication.bulk_connection import (BulkConnection, BulkConnectionError, Frame, Kind,
                                              PeerGoneError)
from ckptd.replication.bulk_wire import Abort, Done, End, Ready, control_body, send_control
from ckptd.replication.commands import Sent
from ckptd.replication.refusals import Refusals
from ckptd.replication.send_job import SendJob, io_timeout

log = logging.getLogger(__name__)

BEGIN, END, ABORT = "begin", "end", "abort"


class _Connection:
    """One connection of a lane (a slot redialed for the lane's life), what it has in
    flight, and when bytes last moved on it (guarded by the lane's lock)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.channel: BulkConnection | None = None
        self.inflight: dict = {}   # (xfer, item) -> job
        self.broken: str | None = None
        # When bytes last moved on a channel of this slot that is closed now: bytes that
        # moved shortly before a connection closed still say the peer was there then.
        self._moved_before = 0.0

    def chunks_in_flight(self) -> int:
        return sum(1 for (_, item) in self.inflight if isinstance(item, int))

    def last_moved(self) -> float:
        """When bytes last moved on this slot's connections, the closed ones included."""
        if self.channel is None:
            return self._moved_before
        return max(self._moved_before, self.channel.last_activity)

    def detach(self) -> None:
        """The channel closed: keep when bytes last moved on it, then forget it."""
        if self.channel is not None:
            self._moved_before = max(self._moved_before, self.channel.last_activity)
        self.channel = None


class Lane:
    """The connections to one peer's bulk listener and the work queued for them.

    Parameters
    ----------
    address : tuple
        ``(host, port)`` of the peer's bulk listener.
    peer_key : bytes
        The peer's raw public key (its daemon must hold the secret).
    peer : str
        The peer's control address, for logs and status.
    credentials : tuple
        ``(own secret, own public key, protection)``.
    post : callable
        Hands a :class:`Sent` to the replicator.
    """

    def __init__(self, address: tuple, peer_key: bytes, peer: str, credentials: tuple,
                 post: Callable[[object], None]) -> None:
        self.address, self.peer_key, self.peer = address, peer_key, peer
        self._credentials = credentials
        self._post = post
        self.lock = threading.Condition()
        self.queue: deque = deque()      # (job, item): item is BEGIN, END, ABORT or an offset
        self.jobs: dict[int, SendJob] = {}
        self.connections: list[_Connection] = []
        self.last_error: str | None = None
        self.refusals = Refusals()
        self.dials = 0                   # dials made: an idle lane must not add any
        #: The bulk path's handler table on the sending end: frame kind -> handler.
        self._answer_handlers = {Kind.ACK: self._on_ack, Kind.READY: self._on_ready,
                                 Kind.DONE: self._on_outcome, Kind.ABORT: self._on_outcome}
        self.stopped = False
        self.created = time.monotonic()

    # ------------------------------------------------------------ work (any thread)
    def add(self, job: SendJob) -> None:
        """Start streaming ``job``."""
        with self.lock:
            self.jobs[job.xfer] = job
            self.queue.append((job, BEGIN))
            self._grow()
            self.lock.notify_all()

    def end_job(self, job: SendJob, ok: bool, error: str | None, notify_peer: bool = False,
                corrupted: bool = False) -> None:
        """Finish ``job`` once (lock held by the caller); post its outcome."""
        if job.finished:
            return
        job.finished = True
        self.jobs.pop(job.xfer, None)
        if notify_peer:
            self.queue.appendleft((job, ABORT))
            job.abort_reason = error
        if job.sending == 0:
            job.source.close()
        job.stats.stream_ended(ok, error)
        self.lock.notify_all()
        self._post(Sent(job.xfer, ok, error, corrupted))

    def _grow(self) -> None:
        wanted = max(1, knobs.PEER_STREAMS.get())
        while len(self.connections) < wanted:
            connection = _Connection(len(self.connections))
            self.connections.append(connection)
            threading.Thread(target=self._run, args=(connection,), daemon=True,
                             name=f"ckptd-bulk-out-{self.address[0]}-{connection.index}").start()

    def last_activity(self) -> float:
        """When bytes last moved on any of this lane's connections, those since closed
        included (0: never)."""
        with self.lock:
            return max((c.last_moved() for c in self.connections), default=0.0)

    def stop(self) -> None:
        """Close every connection; threads end."""
        with self.lock:
            self.stopped = True
            channels = [c.channel for c in self.connections if c.channel is not None]
            self.lock.notify_all()
        for channel in channels:
            channel.close()

    # ------------------------------------------------------------ writing thread
    def _run(self, connection: _Connection) -> None:
        backoff = 0.1
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.stopped or self.queue, timeout=1.0)
                if self.stopped:
                    return
                if not self.queue:
                    continue
                self.dials += 1
            own_secret, own_public, protection = self._credentials
            try:
                channel = BulkConnection.dial(self.address, own_secret, own_public, self.peer_key,
                                       protection, knobs.PEER_HANDSHAKE_TIMEOUT.get(),
                                       io_timeout())
            except BulkConnectionError as exc:
                with self.lock:
                    dial_failed(self, exc)
                    self.lock.wait_for(lambda: self.stopped, timeout=backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            with self.lock:
                connection.channel, connection.broken = channel, None
                self.refusals.dialed()
            reader = threading.Thread(target=self._read, args=(connection, channel), daemon=True,
                                      name=f"ckptd-bulk-ack-{self.address[0]}-{connection.index}")
            reader.start()
            try:
                self._write(connection, channel)
            except BulkConnectionError as exc:
                self._broke(connection, exc)
            finally:
                channel.close()
                reader.join()
                self._requeue(connection)

    def _next_item(self, connection: _Connection):
        """The next work for this connection (lock held); None when it should close."""
        window = max(1, knobs.REPLICATION_WINDOW.get())
        while True:
            if self.stopped or connection.broken:
                return None
            window_full = connection.chunks_in_flight() >= window
            for index, (job, item) in enumerate(self.queue):
                if job.finished and item != ABORT:
                    continue
                if isinstance(item, int) and window_full:
                    continue
                del self.queue[index]
                return job, item
            # drop work of finished jobs so the queue does not grow
            self.queue = deque(w for w in self.queue if not w[0].finished or w[1] == ABORT)
            self.lock.wait(timeout=1.0)

    def _write(self, connection: _Connection, channel: BulkConnection) -> None:
        while True:
            with self.lock:
                work = self._next_item(connection)
                if work is None:
                    return
                job, item = work
                if item != ABORT:
                    connection.inflight[(job.xfer, item)] = job
                job.sending += 1
            try:
                self._send(channel, job, item)
            finally:
                with self.lock:
                    job.sending -= 1
                    if job.finished and job.sending == 0:
                        job.source.close()

    def _send(self, channel: BulkConnection, job: SendJob, item) -> None:
        if item == BEGIN:
            send_control(channel, job.xfer, job.begin, extra=job.size)
        elif item == ABORT:
            send_control(channel, job.xfer, Abort(job.abort_reason))
        elif item == END:
            send_control(channel, job.xfer, End(job.size), extra=job.size)
        else:
            frame = job.source.frame(item)
            if job.expected_crc is not None:  # recorded before its ACK can arrive
                crc = algorithm_named(job.begin.algorithm).update(frame, 0)
                with self.lock:
                    job.crcs[item] = (len(frame), crc)
            channel.send(Kind.CHUNK, job.xfer, offset=item, payload=frame)

    def _requeue(self, connection: _Connection) -> None:
        """What a broken connection had in flight goes back to the head of the queue."""
        with self.lock:
            busy = bool(connection.inflight)
            for (_, item), job in connection.inflight.items():
                if not job.finished:
                    self.queue.appendleft((job, item))
            connection.inflight.clear()
            connection.detach()
            if connection.broken and busy and not self.stopped:
                self.last_error = connection.broken
                log.info("bulk connection %d to %s broke (%s); resuming on the others",
                         connection.index, self.peer, connection.broken)
            self.lock.notify_all()

    # ------------------------------------------------------------ reading thread
    def _read(self, connection: _Connection, channel: BulkConnection) -> None:
        try:
            while True:
                frame = channel.receive()
                with self.lock:
                    self._answer(connection, frame)
        except BulkConnectionError as exc:
            self._broke(connection, exc)

    def _broke(self, connection: _Connection, exc: BulkConnectionError) -> None:
        """Note the first reason a connection broke (its threads both see it) and wake
        whoever waits on the lane."""
        with self.lock:
            connection.broken = connection.broken or str(exc)
            self.lock.notify_all()

    def _answer(self, connection: _Connection, frame: Frame) -> None:
        """A receiver's answer (lock held)."""
        handler = self._answer_handlers.get(frame.kind)
        if handler is None:
            raise BulkConnectionError(f"a receiver sent a frame of kind {frame.kind}")
        handler(connection, frame, self.jobs.get(frame.xfer))
        self.lock.notify_all()

    def _on_ack(self, connection: _Connection, frame: Frame, job: SendJob | None) -> None:
        connection.inflight.pop((frame.xfer, frame.offset), None)
        if job is not None and frame.offset not in job.acked:
            job.acknowledge(frame.offset)
            self._maybe_end(job)

    def _on_ready(self, connection: _Connection, frame: Frame, job: SendJob | None) -> None:
        connection.inflight.pop((frame.xfer, BEGIN), None)
        ready: Ready = control_body(frame)
        if job is None:
            return
        if not ready.ok:
            self.end_job(job, False, f"{self.peer} refused: {ready.error}")
            return
        job.last_progress = time.monotonic()
        self.queue.extend((job, offset) for offset in job.offsets())
        self._maybe_end(job)

    def _on_outcome(self, connection: _Connection, frame: Frame, job: SendJob | None) -> None:
        connection.inflight.pop((frame.xfer, END), None)
        outcome: Done | Abort = control_body(frame)
        if job is not None:
            ok = isinstance(outcome, Done) and outcome.ok
            self.end_job(job, ok, None if ok else f"{self.peer}: {outcome.error}")

    def _maybe_end(self, job: SendJob) -> None:
        if job.end_queued or job.acked_bytes < job.size:
            return
        corruption = job.corruption()
        if corruption is not None:
            self.end_job(job, False, corruption, notify_peer=True, corrupted=True)
            return
        job.end_queued = True
        self.queue.append((job, END))


def dial_failed(lane: Lane, exc: BulkConnectionError) -> None:
    """A dial of ``lane`` failed (its lock held): end its jobs if that says the peer is
    gone, and drop the work no dial is for any more."""
    lane.last_error = str(exc)
    connected = any(c.channel is not None for c in lane.connections)
    gone = exc if isinstance(exc, PeerGoneError) else lane.refusals.failed(
        exc, time.monotonic(), connected, lane.last_activity())
    if gone is not None:
        end_lost_jobs(lane, gone)
    # telling an unreachable peer that a transfer ended is best effort, and a finished
    # job's work must not keep the lane dialing
    lane.queue = deque(w for w in lane.queue if w[1] != ABORT and not w[0].finished)


def end_lost_jobs(lane: Lane, exc: PeerGoneError) -> None:
    """The daemon ``lane`` streams to is gone (its lock held): end every job now; none can
    resume, and waiting would cost each its whole no-progress deadline."""
    for job in list(lane.jobs.values()):
        reason = (f"{_what(job)}: rank {job.owner}'s part of iteration {job.iteration} to "
                  f"{lane.peer} was lost: {exc}")
        BulkSender.log_end(job, reason)
        lane.end_job(job, False, reason)


def _what(job: SendJob) -> str:
    """How a failure names what the job was doing."""
    return "phase 'replicating'" if job.kind == "push" else "serving a fetch"


class BulkSender:
    """Every lane of this daemon (one per peer and key), and the jobs on them.

    Parameters
    ----------
    credentials : tuple
        ``(own secret, own public key, protection)`` (raw keys).
    post : callable
        Hands a :class:`Sent` to the replicator (from any thread).
    """

    def __init__(self, credentials: tuple, post: Callable[[object], None]) -> None:
        self._credentials = credentials
        self._post = post
        self._lanes: dict[tuple, Lane] = {}

    def send(self, bulk_address: str, peer_key: bytes, peer: str, job: SendJob) -> None:
        """Start streaming ``job`` to the daemon at ``bulk_address`` (``host:port``)."""
        host, _, port = bulk_address.rpartition(":")
        address = (host, int(port))
        lane = self._lanes.get((address, peer_key))
        if lane is None:
            for (other, key), old in list(self._lanes.items()):
                if other == address and key != peer_key:  # the peer restarted: new key
                    old.stop()
                    with old.lock:  # its jobs are lost with that daemon: they end now
                        end_lost_jobs(old, PeerGoneError(
                            f"the daemon at {bulk_address} has another key now: the one "
                            "streamed to was restarted"))
                    del self._lanes[(other, key)]
            lane = self._lanes[(address, peer_key)] = Lane(address, peer_key, peer,
                                                           self._credentials, self._post)
        lane.add(job)

    def jobs(self) -> list[tuple["Lane", SendJob]]:
        """Every unfinished job with its lane."""
        found = []
        for lane in self._lanes.values():
            with lane.lock:
                found += [(lane, job) for job in lane.jobs.values()]
        return found

    def cancel(self, predicate: Callable[[SendJob], bool], reason: str) -> None:
        """End the jobs ``predicate`` selects (their receivers are told)."""
        for lane, job in self.jobs():
            if predicate(job):
                with lane.lock:
                    self.log_end(job, reason)
                    lane.end_job(job, False, reason, notify_peer=True)

    def expire(self, now: float, timeout: float) -> None:
        """Fail jobs that made no progress for ``timeout`` seconds: no chunk acknowledged
        and no byte moving on their lane's connections (a chunk crossing a slow link is
        progress; a cut link is not)."""
        for lane, job in self.jobs():
            if now - max(job.last_progress, lane.last_activity()) > timeout:
                reason = (f"{_what(job)}: rank {job.owner}'s part of iteration {job.iteration} to "
                          f"{job.peer} made no progress for {timeout:.0f}s (link down or peer "
                          f"stuck; last connection error: {lane.last_error or 'none'})")
                with lane.lock:
                    self.log_end(job, reason)
                    lane.end_job(job, False, reason, notify_peer=True)

    def drop_idle(self, now: float, idle: float, keep: set) -> None:
        """Close the lanes of peers outside ``keep`` (control addresses) that have no job
        and moved no byte for ``idle`` seconds: a copy served to a far fetcher must not
        leave connections and threads behind."""
        for name, lane in list(self._lanes.items()):  # jobs are added on this thread only
            if lane.peer not in keep and not (lane.jobs or lane.queue) \
                    and now - max(lane.last_activity(), lane.created) > idle:
                log.info("closed the idle bulk connections to %s", lane.peer)
                lane.stop()
                del self._lanes[name]

    @staticmethod
    def log_end(job: SendJob, reason: str) -> None:
        log.warning("%s of rank %s's part (iteration %s) to %s ended: %s", job.kind, job.owner,
                    job.iteration, job.peer, reason)

    def close(self) -> None:
        """Stop every lane (the daemon is stopping)."""
        for lane in self._lanes.values():
            lane.stop()
        self._lanes.clear()
