"""The flusher: copies every tiered save's files to their target, whatever the target does.

Owns :class:`FlushJob` (the files of one save, or one commit, still to copy, and their
progress) and :class:`Flusher` (the scheduler). The scheduler runs on the serve loop's
thread and never touches the target itself: each copy is a
:class:`ckptd.tiers.copy.CopyTask` on a worker thread, which reports through a mailbox.
Per :meth:`Flusher.tick` it

- starts copies, at most :data:`knobs.FLUSH_PARALLELISM` at once over all saves;
- abandons a copy that made no progress for the stall timeout (``--stall-timeout``: a
  ``write`` or ``fsync`` that never returns): the worker is left behind, the file is retried on a
  fresh temporary name, and nothing else waits for it;
- retries a failed copy after an exponential backoff (:data:`knobs.FLUSH_RETRY_START`,
  doubling, capped at :data:`knobs.FLUSH_RETRY_CAP`), unless its errno is one that fails
  fast (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) or the save's flush deadline has passed;
- reports each job's outcome once, through the job's ``on_done``.

Pattern: a timer-driven scheduler over worker threads; all scheduling state belongs to
the serve loop's thread, workers only publish progress counters and post results.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ckptd import knobs
from ckptd.mailbox import Mailbox
from ckptd.tiers.copy import Abandoned, CopyError, CopyTask, FlushFile, NotYet, errno_name

log = logging.getLogger(__name__)


@dataclass
class FlushFailure:
    """Why a flush ended without reaching its target: the file, the target, the errno."""

    message: str
    path: str
    errno: int | None


@dataclass
class _FileState:
    file: FlushFile
    attempt: int = 0
    retry_at: float = 0.0  # monotonic; 0: as soon as a copy slot is free
    task: CopyTask | None = None
    tasks: list = field(default_factory=list)  # every attempt, abandoned ones included
    done: bool = False
    last_error: CopyError | None = None


@dataclass
class FlushJob:
    """The files of one save (or one commit) still to reach the target.

    Parameters
    ----------
    key : str
        The stage directory's name for it.
    target : str
        The checkpoint path (for status and messages).
    files : list of FlushFile
        What to copy, in order.
    deadline : float
        Unix time after which a file not yet durable at the target fails the job.
    on_done : callable
        ``on_done(job, failure)``: ``failure`` is None when every file is durable there.
    requires : list of (path, record)
        Files that must already be durable at the target before the first copy starts
        (a commit's ``.metadata`` waits for every data file, whichever node flushes it).
    """

    key: str
    target: str
    files: list
    deadline: float
    on_done: Callable
    requires: list = field(default_factory=list)
    states: list = field(default_factory=list)
    finished: bool = False
    settled: bool = False  # what it replaced at the target is dropped or put back

    def __post_init__(self) -> None:
        self.states = [_FileState(f) for f in self.files]

    @property
    def bytes_total(self) -> int:
        """Bytes to copy."""
        return sum(f.size for f in self.files)

    def progress(self) -> dict:
        """The ``flush`` object ``ckptd status`` shows."""
        running = [s for s in self.states if s.task is not None]
        waiting = [s.retry_at for s in self.states if not s.done and s.task is None
                   and s.attempt > 0]
        next_retry = None
        if not running and waiting:
            next_retry = time.time() + max(0.0, min(waiting) - time.monotonic())
        done = sum(s.file.size for s in self.states if s.done)
        done += sum(min(s.task.bytes_done, s.file.size) for s in running)
        last = next((s.last_error for s in self.states if s.last_error is not None), None)
        return {"attempt": max([s.attempt for s in self.states] + [1]),
                "next_retry_at": next_retry, "bytes_done": done,
                "bytes_total": self.bytes_total, "target": self.target,
                "last_error": str(last) if last is not None else None}


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt ``attempt + 1`` after ``attempt`` failed."""
    start, cap = knobs.FLUSH_RETRY_START.get(), knobs.FLUSH_RETRY_CAP.get()
    return min(cap, start * 2 ** max(0, attempt - 1))


class Flusher:
    """Schedules the copies of every :class:`FlushJob` (see the module docstring).

    Parameters
    ----------
    context : zmq.Context
        For the mailbox the workers report through.
    stall_timeout : float
        Seconds a copy may make no progress before it is abandoned and retried.
    """

    def __init__(self, context, stall_timeout: float) -> None:
        self.stall_timeout = stall_timeout
        self.results = Mailbox(context, "flusher")
        self._post_lock = threading.Lock()  # many workers, one mailbox producer at a time
        self.jobs: dict[str, FlushJob] = {}
        #: Targets being settled after their save's flush ended (ckptd.tiers.settle): no
        #: copy starts there until the thread settling them has returned.
        self.held: dict[str, threading.Thread] = {}
        self.retries = 0
        self.stalls = 0
        self.bytes_flushed = 0

    # ------------------------------------------------------------------ serve loop side
    def submit(self, job: FlushJob) -> None:
        """Start flushing ``job`` (copies begin at once if slots are free)."""
        self.jobs[job.key] = job
        self.tick()

    def cancel(self, key: str) -> FlushJob | None:
        """Stop flushing ``key``: running copies are abandoned (they discard their
        temporaries), nothing more starts, ``on_done`` is not called."""
        job = self.jobs.pop(key, None)
        if job is not None:
            job.finished = True
            for state in job.states:
                if state.task is not None:
                    state.task.abandoned = True
        return job

    def hold(self, targets: list[str], thread: threading.Thread) -> None:
        """Start no copy to ``targets`` while ``thread`` runs."""
        for target in targets:
            self.held[target] = thread

    def _is_held(self, target: str) -> bool:
        thread = self.held.get(target)
        if thread is not None and not thread.is_alive():
            del self.held[target]
            thread = None
        return thread is not None

    def running(self) -> int:
        """Copies running now (abandoned ones not counted)."""
        return sum(1 for job in self.jobs.values() for s in job.states if s.task is not None)

    def tick(self) -> None:
        """Stalls, deadlines, retries due, free copy slots (serve loop housekeeping)."""
        now = time.monotonic()
        stall = self.stall_timeout
        for job in list(self.jobs.values()):
            for state in job.states:
                task = state.task
                if task is not None and now - task.last_progress > stall:
                    task.abandoned = True
                    state.task = None
                    self.stalls += 1
                    self._failed(job, state, CopyError(
                        errno_mod.ETIMEDOUT, f"no progress for {stall:.0f}s (a write or fsync "
                        "that does not return); abandoned, retrying on a fresh temporary",
                        state.file.target, fail_fast=False))
            if not job.finished and time.time() > job.deadline:
                self._deadline_passed(job)
        slots = knobs.FLUSH_PARALLELISM.get() - self.running()
        for job in list(self.jobs.values()):
            for state in job.states:
                if slots <= 0:
                    return
                if state.done or state.task is not None or state.retry_at > now:
                    continue
                if self._is_held(state.file.target):  # what status and the deadline say
                    state.last_error = state.last_error or CopyError(
                        errno_mod.EBUSY, "waiting for an earlier save's copy to this target "
                        "to return (it is stuck there; its file must be settled first)",
                        state.file.target, fail_fast=False)
                    continue
                state.attempt += 1
                if state.attempt > 1:
                    self.retries += 1
                    log.info("flush of %s: attempt %d", state.file.target, state.attempt)
                state.task = CopyTask(state.file, state.attempt, job.requires)
                state.tasks.append(state.task)
                state.task.start(self._post)
                slots -= 1

    def _post(self, task: CopyTask, error: Exception | None) -> None:
        with self._post_lock:
            self.results.post((task, error))

    def on_result(self, item: tuple) -> None:
        """A worker finished (from the mailbox)."""
        task, error = item
        for job in list(self.jobs.values()):
            for state in job.states:
                if state.task is task:
                    state.task = None
                    self._settle(job, state, error)
                    return
        # an abandoned task: its file was retried (or its save ended) already

    def _settle(self, job: FlushJob, state: _FileState, error: Exception | None) -> None:
        if error is None:
            state.done = True
            self.bytes_flushed += state.file.size
            if all(s.done for s in job.states):
                self._finish(job, None)
        elif isinstance(error, NotYet):
            state.attempt -= 1  # waiting for other nodes' files is not a failed attempt
            state.retry_at = time.monotonic() + knobs.FLUSH_COMMIT_POLL.get()
        elif isinstance(error, Abandoned):
            pass
        else:
            self._failed(job, state, error)

    def _failed(self, job: FlushJob, state: _FileState, error: CopyError) -> None:
        state.last_error = error
        where = f"{state.file.target} ({errno_name(error.errno)})"
        if error.fail_fast:
            log.error("flush of %s failed: %s; not retried", where, error.strerror)
            self._finish(job, self._failure(job, error))
            return
        wait = backoff(state.attempt)
        if time.time() + wait > job.deadline:
            wait = max(0.0, job.deadline - time.time())
        state.retry_at = time.monotonic() + wait
        log.warning("flush of %s failed (attempt %d): %s; retrying in %.1fs", where,
                    state.attempt, error.strerror, wait)

    def _deadline_passed(self, job: FlushJob) -> None:
        last = next((s.last_error for s in job.states if s.last_error is not None), None)
        pending = next((s for s in job.states if not s.done), None)
        if last is None:
            last = CopyError(errno_mod.ETIMEDOUT, "not copied yet",
                             pending.file.target if pending else job.target, False)
        failure = self._failure(job, last)
        failure.message = (f"flush deadline ({knobs.FLUSH_DEADLINE.env}) passed; last "
                           f"error: {failure.message}")
        self.cancel(job.key)
        job.on_done(job, failure)

    @staticmethod
    def _failure(job: FlushJob, error: CopyError) -> FlushFailure:
        path = error.filename or job.target
        return FlushFailure(f"flushing {path} to target {job.target} failed: errno "
                            f"{error.errno} ({errno_name(error.errno)}) {error.strerror}",
                            path, error.errno)

    def _finish(self, job: FlushJob, failure: FlushFailure | None) -> None:
        self.cancel(job.key)
        job.on_done(job, failure)

    def close(self) -> None:
        """Abandon every copy (shutdown; the journal keeps what is unfinished)."""
        for key in list(self.jobs):
            self.cancel(key)
        self.results.close()
