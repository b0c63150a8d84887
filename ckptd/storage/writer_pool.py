"""The daemon's side of the writer processes: start them, route jobs, reap the dead.

Owns the writer processes and the jobs in flight: :meth:`WriterPool.submit` assigns a job
to the least-loaded live writer (or a backlog while all are restarting, so the serve loop
never blocks), :meth:`handle` records a job's progress and completes it when its result
arrives, :meth:`reap_dead` fails the jobs of a writer that died, removes its temporaries
and starts a new one, and :meth:`check_stalls` gives up on a writer whose file made no
progress for the stall timeout (stuck in the kernel): its job fails, a fresh writer takes
its place and its other jobs, and the stuck process is kept by
:class:`ckptd.storage.stalls.StuckWriters` until it really exits. It knows files and byte
ranges, not ranks or requests: each job carries its own completion callback. One writer's socket and process are a
:class:`ckptd.storage.writer_slot.WriterSlot`. A job may be submitted *held* (sent ahead
of the end of its staging: the writer makes its file ready) and started later
(:meth:`WriterPool.start`); until then it is no writer's load and no stall.

Pattern: one ZeroMQ PAIR socket per writer, bound here and polled by the serve loop.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque

import zmq

from ckptd import knobs, protocol
from ckptd.storage import priority
from ckptd.storage.jobs import REPLY_TYPES, WriteJob, WriteProgress, WriterReady, WriteResult
from ckptd.storage.late_close import wait_for_closes
from ckptd.storage.leftovers import WrittenDirectories, sweep_temporaries
from ckptd.storage.stalls import StuckWriters, deadline_message, stall_message
from ckptd.storage.writer_slot import WriterSlot

log = logging.getLogger(__name__)


def pick_writer(job: WriteJob, live: list[WriterSlot],
                kept: list[WriterSlot]) -> WriterSlot | None:
    """The writer ``job`` goes to now, the least-loaded of ``live``, or None: it waits.

    A job with a deadline goes only to an idle writer, so its deadline counts its own
    write; while it waits, the least-loaded writer is kept for it (added to ``kept``,
    which later jobs pass over), else a steady stream of later jobs could keep every
    writer busy until its deadline passed. The kept writer's load only falls, so it is
    the first to be idle.
    """
    free = [s for s in live if s not in kept]
    if job.deadline is not None and free:
        idle = [s for s in free if not s.load]
        if not idle:
            kept.append(min(free, key=lambda s: s.load))
            return None
        free = idle
    # jobs sent ahead count here: they are its work once their saves are staged
    return min(free, key=lambda s: len(s.jobs)) if free else None


class WriterPool:
    """Starts ``count`` writer processes and routes jobs and results.

    ``context``: the daemon's (the serve loop polls the sockets); ``runtime_dir``: private,
    for the writers' ipc endpoints; ``pool_path``, ``pool_size``: the staging pool the
    writers map; ``log_level``: theirs; ``journal``: where the directories jobs write
    into are noted (swept after a crash).
    """

    def __init__(self, count: int, context: zmq.Context, runtime_dir: str,
                 pool_path: str, pool_size: int, log_level: str = "INFO",
                 journal: WrittenDirectories | None = None) -> None:
        self.pool_path, self.pool_size, self.log_level = pool_path, pool_size, log_level
        priority.check(knobs.WRITER_SCHED.get(), knobs.WRITER_IO_CLASS.get())
        self.journal = journal
        #: The writer channel's handler table on this end: reply type -> handler.
        self._reply_handlers = {WriterReady: self._on_ready, WriteProgress: self._on_progress,
                                WriteResult: self._on_result}
        self._next_job_id = 1
        self._backlog: deque[WriteJob] = deque()
        self.context, self.runtime_dir = context, runtime_dir
        self._generation = 0  # a replacement writer gets a fresh endpoint
        self._watch = self._unwatch = lambda sock: None  # the serve loop's, once attached
        self.stuck = StuckWriters()
        self.slots = [WriterSlot.bind(context, runtime_dir, i, 0) for i in range(count)]
        for slot in self.slots:
            self._spawn(slot)

    def attach(self, watch, unwatch) -> None:
        """Have the serve loop poll every writer socket, now and as writers are replaced:
        ``watch(sock)`` and ``unwatch(sock)``."""
        self._watch, self._unwatch = watch, unwatch
        for slot in self.slots:
            watch(slot.socket)

    def _spawn(self, slot: WriterSlot) -> None:
        slot.spawn(self.pool_path, self.pool_size, self.log_level, self.journal)

    def wait_ready(self, timeout: float) -> None:
        """Block until every writer has mapped the pool and said so (``RuntimeError``: a
        writer exited or did not report within ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            slot.wait_ready(deadline, timeout, self.handle)

    def submit(self, job: WriteJob) -> None:
        """Queue ``job`` for the live writer with the fewest jobs in flight.

        Never blocks: with no writer ready (all restarting), jobs wait in a backlog that
        is sent when a writer reports ready.
        """
        job.id = self._next_job_id
        self._next_job_id += 1
        if self.journal is not None:
            self.journal.note(os.path.dirname(job.path))
        self._backlog.append(job)
        self._dispatch()

    def start(self, job: WriteJob, body=None, through: int | None = None) -> None:
        """``job``, submitted held, is staged now: write it (``body``: its body complete,
        when it went ahead without a torch file's skeleton). ``through``: only the pool's
        bytes below it are staged yet (a job :meth:`parked` only; see
        :meth:`staged_through`)."""
        job.body, job.held, job.through = body or job.body, False, through
        if (slot := self._slot_of(job)) is not None:  # else sent as any job (or early) later
            slot.start(job, b"" if body is None else body.skeleton, through)

    def staged_through(self, job: WriteJob, through: int | None) -> None:
        """``job``, started while its bytes were staged, may write the pool's bytes below
        ``through`` (None: all; only then does it rename its file into place)."""
        job.through = through if through is None else max(through, job.through or 0)
        if (slot := self._slot_of(job)) is not None:
            slot.staged_through(job.id, through)

    def parked(self, job: WriteJob) -> bool:
        """Whether ``job``, submitted held, waits at its writer (not in the backlog)."""
        return job.held and self._slot_of(job) is not None

    def _slot_of(self, job: WriteJob) -> WriterSlot | None:
        return next((s for s in self.slots if s.jobs.get(job.id) is job), None)

    def cancel(self, job: WriteJob) -> None:
        """Tell ``job``'s writer to drop it, its save stopped (:meth:`WriterSlot.cancel`);
        a held job not sent yet is just forgotten."""
        job.cancelled = True
        if job.held and job in self._backlog:
            self._backlog.remove(job)
        elif (slot := self._slot_of(job)) is not None:
            slot.cancel(job.id)

    def _dispatch(self) -> None:
        """Send waiting jobs to the least-loaded ready writers, in submission order, except
        that a path with a job in flight waits for it: two saves of one path (an aborted
        one still writing, and the next) then rename in order, and the first one's
        cleanup can never take the second one's file (a job with a deadline: see
        :func:`pick_writer`)."""
        if self._backlog:
            # Files that finished saves replaced are freed by a background close; their
            # space is back before a new file claims any (a filesystem that holds one
            # checkpoint and the next must not see ENOSPC for a few milliseconds).
            wait_for_closes()
        busy = {job.path for slot in self.slots for job in slot.jobs.values()}
        busy |= self.stuck.paths()  # until a stuck writer exits, its rename may still land
        waiting: deque[WriteJob] = deque()
        kept: list[WriterSlot] = []  # each one drains for a deadline job waiting for it
        while self._backlog:
            job = self._backlog.popleft()
            live = [s for s in self.slots if s.ready and s.process and s.process.poll() is None]
            slot = None if job.path in busy else pick_writer(job, live, kept)
            if slot is None:
                waiting.append(job)
                continue
            if not slot.send(job):  # its process went away after saying ready
                slot.ready = False
                self._backlog.appendleft(job)
                continue
            job.writer = slot.index
            busy.add(job.path)
            if job.cancelled:  # its save stopped while it waited here: right behind it
                slot.cancel(job.id)
        waiting.extend(self._backlog)
        self._backlog = waiting

    def handle(self, sock: zmq.Socket) -> None:
        """Read one message from a writer's socket and complete its job."""
        slot = next((s for s in self.slots if s.socket is sock), None)
        msg = protocol.decode(sock.recv_multipart())
        if slot is None:  # a writer given up on as stuck: nobody waits for its word
            return
        slot.last_heard = time.monotonic()
        if msg.type not in REPLY_TYPES:
            log.warning("writer %d sent a %r message, which is not a writer reply",
                        slot.index, msg.type)
            return
        reply = REPLY_TYPES[msg.type].from_wire(msg.body)
        self._reply_handlers[type(reply)](slot, msg.id, reply)

    def _on_ready(self, slot: WriterSlot, msg_id: int, reply: WriterReady) -> None:
        slot.ready = True
        self._dispatch()

    def _on_progress(self, slot: WriterSlot, msg_id: int, reply: WriteProgress) -> None:
        job = slot.jobs.get(msg_id)
        if job is not None:
            job.phase, job.bytes_done = reply.phase, reply.bytes_done
            job.progress_at = time.monotonic()

    def _on_result(self, slot: WriterSlot, msg_id: int, reply: WriteResult) -> None:
        job = slot.jobs.pop(msg_id, None)
        if job is not None:
            job.on_done(job, reply)
            self._dispatch()  # a job waiting for this path (or a free writer) may go now

    def reap_dead(self) -> None:
        """Fail the jobs of writers that died, remove their temporaries, start new ones."""
        for slot in self.slots:
            if slot.process is None or slot.process.poll() is None:
                continue
            code, dead_pid = slot.process.returncode, slot.process.pid
            log.error("writer process %d (pid %d) died with %s; failing %d job(s) and restarting it",
                      slot.index, dead_pid, code, len(slot.jobs))
            jobs, slot.jobs = slot.jobs, {}
            self._spawn(slot)
            for directory in {os.path.dirname(job.path) for job in jobs.values()}:
                sweep_temporaries(directory, dead_pid)
            for job in jobs.values():
                job.on_done(job, WriteResult(ok=False, path=job.path,
                                             error=f"writer process died (exit status {code})"))

    def check_stalls(self, timeout: float) -> None:
        """Give up on writers whose file made no progress for ``timeout`` seconds; let go
        of those given up on earlier that have exited since."""
        if self.stuck.reap():
            self._dispatch()  # a job waiting for a stuck writer's path may go now
        now = time.monotonic()
        for slot in list(self.slots):
            working = [job for job in slot.jobs.values() if not job.held]
            if working and now - slot.last_heard > timeout:  # it works through them in order
                self._replace_stuck(slot, working[0], now - slot.last_heard, timeout)

    def check_deadlines(self) -> None:
        """Fail jobs past their own deadline (see :attr:`WriteJob.deadline`): one still
        waiting for a writer leaves the queue; one being written, slow progress or none,
        has its writer replaced as a stuck one, so the file can never land afterwards."""
        now = time.monotonic()
        for job in [j for j in self._backlog if j.deadline is not None and now > j.deadline]:
            self._backlog.remove(job)
            job.on_done(job, WriteResult(ok=False, path=job.path, errno=errno.ETIMEDOUT,
                                         error=deadline_message(job, None)))
        for slot in list(self.slots):
            if any(j.deadline is not None and now > j.deadline for j in slot.jobs.values()):
                while slot.socket.poll(0):  # a result already sent is taken, not thrown away
                    self.handle(slot.socket)
            late = [j for j in slot.jobs.values() if j.deadline is not None and now > j.deadline]
            if late:
                self._replace_stuck(slot, late[0], now - slot.last_heard, 0.0,
                                    deadline_message(late[0], slot.process.pid))

    def _replace_stuck(self, slot: WriterSlot, job: WriteJob, waited: float,
                       timeout: float, error: str | None = None) -> None:
        """Fail ``job`` (with ``error``, else as stalled), keep its writer until it exits,
        start a fresh one in its place."""
        pid = slot.process.pid
        log.error("writer %d (pid %d): %s %s; replacing the writer", slot.index, pid, job.path,
                  error or f"stalled in {job.phase} for {waited:.0f}s")
        others = [j for j in slot.jobs.values() if j is not job]
        slot.jobs = {}

        def close_socket(stuck=slot) -> None:
            self._unwatch(stuck.socket)
            stuck.close()

        self.stuck.add(slot.process, job, close_socket)
        self._generation += 1
        fresh = WriterSlot.bind(self.context, self.runtime_dir, slot.index, self._generation)
        self.slots[self.slots.index(slot)] = fresh
        self._watch(fresh.socket)
        self._spawn(fresh)
        for other in reversed(others):  # not started: the new writer takes them, in order
            other.phase, other.progress_at = "queued", None
            self._backlog.appendleft(other)
        job.on_done(job, WriteResult(ok=False, path=job.path, errno=errno.ETIMEDOUT,
                                     error=error or stall_message(job, waited, timeout, pid)))

    @property
    def jobs_in_flight(self) -> int:
        """Jobs sent and not yet answered."""
        return len(self._backlog) + sum(len(s.jobs) for s in self.slots)

    def describe(self) -> list[dict]:
        """Per-writer state for status (:meth:`WriterSlot.describe`)."""
        return [slot.describe() for slot in self.slots]

    def stop(self, timeout: float = 5.0) -> None:
        """Ask writers to exit; kill those that do not, and remove their leftovers."""
        for slot in self.slots:
            slot.ask_to_stop()
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            slot.stop(deadline, timeout)
        self.stuck.reap()
        self.stuck.abandon()
