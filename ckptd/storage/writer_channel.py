"""A writer process's end of its channel to the daemon.

Owns what the writer hears and says besides its jobs' results: :class:`ProgressReporter`
(how the job in hand moves, so the daemon can tell a slow file from a stuck one) and
:class:`Inbox` (the channel read ahead while a job runs: a cancel of the job in hand, and
how far the bytes of a job started while its trainer still copies are staged, are taken
as they come; the other messages wait their turn).

No torch.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import time
from collections import deque

import zmq

from ckptd import knobs, protocol
from ckptd.storage.jobs import CancelJob, StagedThrough, WriteProgress

log = logging.getLogger(__name__)

#: A job's bytes staged up to here: all of them.
ALL = float("inf")


class ProgressReporter:
    """Tells the daemon how the job in hand moves (:class:`WriteProgress`): at every phase
    change, and between them at most every :data:`knobs.WRITER_PROGRESS_INTERVAL` seconds.

    Without it the daemon could not tell a slow file from a write stuck in the kernel: a
    writer blocked in ``write()`` or ``fsync()`` sends nothing, and that silence is what
    its stall deadline measures.
    """

    def __init__(self, sock: zmq.Socket | None) -> None:
        self.sock, self.job_id, self.bytes_done = sock, 0, 0
        self._phase, self._sent_at = "", 0.0
        self._interval = knobs.WRITER_PROGRESS_INTERVAL.get()

    def start(self, job_id: int) -> None:
        """A new job: its first report is its ``create`` phase."""
        self.job_id, self._phase = job_id, ""
        self("create", 0)

    def __call__(self, phase: str, bytes_done: int) -> None:
        now, self.bytes_done = time.monotonic(), bytes_done
        if self.sock is None or (phase == self._phase and now - self._sent_at < self._interval):
            return
        self._phase, self._sent_at = phase, now
        self.sock.send_multipart(protocol.encode(
            WriteProgress.message_type, self.job_id, WriteProgress(phase, bytes_done).to_wire()))


class Inbox:
    """The writer's channel, read ahead: while a job runs, the messages that came meanwhile
    are taken, so that a cancel of the job in hand is seen before its file is renamed into
    place; the others wait here, in order, for their turn.

    Parameters
    ----------
    sock : zmq.Socket or None
        The channel to the daemon (None: jobs run in this process, nothing is cancelled).
    parked : container of int
        Ids of the jobs sent ahead and waiting for their start (their cancels count too).
    """

    def __init__(self, sock: zmq.Socket | None, parked=()) -> None:
        self.sock = sock
        self.parked = parked
        self.parent = os.getppid()  # the daemon
        self.waiting: deque = deque()  # decoded messages, or the ProtocolError of one
        self.cancelled: set[int] = set()  # ids of jobs the daemon dropped
        self.in_hand: int | None = None  # the job being executed
        #: Jobs started while their trainer copies: the pool offset their bytes are staged
        #: below (:data:`ALL` once every one is).
        self.staged: dict[int, float] = {}

    def next(self, timeout_ms: int):
        """The next message (a :class:`protocol.Message`, or the
        :class:`protocol.ProtocolError` of an undecodable one); None after ``timeout_ms``."""
        if not self.waiting and self.sock is not None and self.sock.poll(timeout_ms):
            self.read_ahead()
        return self.waiting.popleft() if self.waiting else None

    def read_ahead(self) -> None:
        """Take every message already there, without waiting."""
        while self.sock is not None and self.sock.poll(0):
            try:
                msg = protocol.decode(self.sock.recv_multipart())
            except protocol.ProtocolError as exc:  # answered in its turn, never fatal
                self.waiting.append(exc)
                continue
            if msg.type in (CancelJob.message_type, StagedThrough.message_type):
                # Both always follow their job on the channel, so the job is in hand,
                # waiting here, or answered already (then there is nothing to do).
                if msg.id == self.in_hand or msg.id in self.parked or any(
                        isinstance(m, protocol.Message) and m.id == msg.id for m in self.waiting):
                    self._note(msg)
            else:
                self.waiting.append(msg)

    def _note(self, msg: protocol.Message) -> None:
        if msg.type == CancelJob.message_type:
            self.cancelled.add(msg.id)
            return
        try:
            through = StagedThrough.from_wire(msg.body).through
        except protocol.ProtocolError:  # from our own daemon: a bug; the rest waits for all
            log.exception("job %d: undecodable staged_through", msg.id)
            return
        self.staged_up_to(msg.id, through)

    def staged_up_to(self, job_id: int, through: int | None) -> None:
        """Job ``job_id``'s bytes below pool offset ``through`` (None: all) are staged."""
        self.staged[job_id] = max(self.staged.get(job_id, -1), ALL if through is None else through)

    def wait_staged(self, job_id: int, end: float, progress: "ProgressReporter") -> None:
        """Return once job ``job_id``'s bytes below pool offset ``end`` are staged (at once
        for a job started with all of them), reporting the ``staging`` phase meanwhile so
        the daemon does not take the wait for a stuck write.

        Raises
        ------
        OSError
            ECANCELED if the daemon drops the job meanwhile (its save stopped while its
            trainer copied), or ESRCH if the daemon is gone.
        """
        interval = max(1, int(1000 * knobs.WRITER_PROGRESS_INTERVAL.get()))
        while self.staged.get(job_id, ALL) < end:
            if self.is_cancelled(job_id):
                raise OSError(errno_mod.ECANCELED, "the daemon dropped this save (aborted or "
                              "failed) while its trainer was still copying it")
            if self.staged.get(job_id, ALL) >= end:
                return
            if os.getppid() != self.parent:
                raise OSError(errno_mod.ESRCH, "the daemon is gone while this file waited for "
                              "its trainer's copy")
            if self.sock is None:  # run in-process: nothing can say more is staged
                raise OSError(errno_mod.EIO, "a job started before its bytes were staged "
                              "has no channel to hear the rest of its copy on")
            progress("staging", progress.bytes_done)
            self.sock.poll(interval)

    def is_cancelled(self, job_id: int) -> bool:
        """Whether the daemon dropped job ``job_id`` (asked now, reading ahead)."""
        self.read_ahead()
        return job_id in self.cancelled

    def start(self, job_id: int) -> None:
        """Job ``job_id`` is being executed now."""
        self.in_hand = job_id

    def done(self, job_id: int) -> None:
        """Job ``job_id`` was answered: its cancel, if any, can be forgotten. Only its own:
        jobs do not come in the order of their ids (the daemon holds back a job whose path
        is busy and sends later ones first), so a waiting job may have a lower id."""
        self.cancelled.discard(job_id)
        self.staged.pop(job_id, None)
        if self.in_hand == job_id:
            self.in_hand = None
