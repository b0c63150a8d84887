"""``AsyncCallsQueue``: async calls kept in order and finalized together on every rank.

``maybe_finalize_async_calls`` finalizes the oldest calls once *every* rank is done,
agreed by one small all-reduce over the default process group (on whatever device its
backend needs); a failure anywhere raises :class:`CheckpointException` on every rank.
Each call's background part is a :class:`~ckpt_client.queue.runners.Runner`; this module
owns their order and the agreement, never how they run.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import NamedTuple

from ckpt_client.collectives import agree_on_completion, introduce
from ckpt_client.errors import CheckpointException
from ckpt_client.queue import spans
from ckpt_client.queue.failures import FailedCalls
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.queue.runners import HelperOptions, Runner, runner_for

log = logging.getLogger(__name__)


class _ActiveCall(NamedTuple):
    idx: int
    request: AsyncRequest
    runner: Runner


# ---------------------------------------------------------------- the queue

class AsyncCallsQueue:
    """Keeps async calls in order and finalizes them when every rank is done.

    The keywords after ``persistent`` are the reference's worker settings. Saves made by
    our save functions run in ckptd, whose writers have their own settings; the settings
    below apply to the helper processes that run hand-built Python ``async_fn``.

    Parameters
    ----------
    persistent : bool
        Accepted for compatibility with the reference API; the daemon is the
        persistent worker, so both values behave alike.
    is_daemon : bool
        Helper processes are daemonic (they cannot start child processes, so
        ``FileSystemWriterAsync(is_multiproc_io=True)`` is refused, as in the reference).
    cpu_priority : int
        Nice value (0-19) helper processes raise themselves to. ckptd's writers keep
        their own CPU policy (``CKPTD_WRITER_NICE``, ``CKPTD_WRITER_SCHED``).
    io_priority : int, optional
        Ignored (logged once when set): the daemon's writers do the I/O, at the I/O class
        ckptd is configured with (``CKPTD_WRITER_IO_CLASS``, default ``best-effort:7``).
    sigterm_timeout : float
        ``close(abort=True)``: seconds a helper process gets after SIGTERM before SIGKILL.
    cpu_shm_mode : bool
        Ignored (logged once when set): the staging transport is chosen per save, e.g.
        ``FileSystemWriterAsync(use_cpu_shm_for_gpu_tensors=True)``.
    poll_interval : float
        Seconds between checks while ``blocking=True`` waits for a hand-built Python
        ``async_fn``. Saves that run in ckptd are not polled at intervals: the daemon
        holds each question until the save changes phase, so a blocking finalize hears
        of it at once and costs the daemon one answer per phase change.
    failure_policy : str
        ``"raise"`` (default): a failed save raises ``CheckpointException`` on every rank.
        ``"warn"``: it is logged on every rank, appended to :attr:`failed_calls` as
        ``(call_idx, exception)``, its finalize functions do not run (nothing of it is
        committed) and later saves go on.

    Attributes
    ----------
    failed_calls : list of (int, CheckpointException)
        Calls that failed under ``failure_policy="warn"``, oldest first.
    """

    def __init__(self, persistent: bool = True, is_daemon: bool = True, cpu_priority: int = 10,
                 io_priority: int | None = None, sigterm_timeout: float = 30.0,
                 cpu_shm_mode: bool = False, *, poll_interval: float = 0.01,
                 failure_policy: str = "raise") -> None:
        self._failures = FailedCalls(failure_policy)
        self.failed_calls = self._failures.calls
        self.persistent = persistent
        self.poll_interval = poll_interval
        self.helper_options = HelperOptions(is_daemon, cpu_priority, sigterm_timeout)
        if io_priority is not None:
            _log_once("io_priority", "AsyncCallsQueue(io_priority=%r) has no effect: ckptd's "
                      "writers do the I/O at the daemon's I/O class (CKPTD_WRITER_IO_CLASS, "
                      "default best-effort:7)", io_priority)
        if cpu_shm_mode:
            _log_once("cpu_shm_mode", "AsyncCallsQueue(cpu_shm_mode=True) has no effect: choose "
                      "the staging transport per save, e.g. "
                      "FileSystemWriterAsync(use_cpu_shm_for_gpu_tensors=True)")
        self._active: deque[_ActiveCall] = deque()
        self._next_idx = 0
        _live_queues.add(self)

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` and queue it for finalization; call on all ranks.

        Returns
        -------
        int
            The call's index (as returned by :meth:`maybe_finalize_async_calls`).
        """
        introduce()  # once per process: a rank lost before its finalize is then known
        idx = self._next_idx
        self._next_idx += 1
        request = async_request._replace(call_idx=idx)
        request = request if request.is_frozen else request.freeze()
        self._active.append(_ActiveCall(idx, request, runner_for(request, self.helper_options)))
        return idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize, oldest first, the calls that are done on all ranks; call on all ranks.

        Parameters
        ----------
        blocking : bool
            Wait until every queued call is finalized.
        no_dist : bool
            Judge completion on this rank alone, without a collective.

        Returns
        -------
        list of int
            Indices of the calls finalized now (successfully: with
            ``failure_policy="warn"`` a failed call is in :attr:`failed_calls` instead).

        Raises
        ------
        CheckpointException
            On every rank, if any rank's save failed (``failure_policy="raise"``); names
            the failing ranks.
        """
        finalized = []
        while self._active:
            call = self._active[0]
            done, error = call.runner.poll()
            while blocking and not done:
                done, error = call.runner.wait(self.poll_interval)
            all_done, failures = agree_on_completion(done, error, no_dist)
            if not all_done:
                break
            self._active.popleft()
            call.runner.cleanup(failed=bool(failures))
            if failures:
                spans.report(call.request.daemon_saves)
                self._failures.failed(call.idx, CheckpointException(
                    f"async checkpoint call {call.idx} failed", failures))
                continue
            started = time.time()
            for fn in call.request.finalize_fns:
                fn()
            spans.note(call.request.daemon_saves, "finalize", started, time.time())
            spans.report(call.request.daemon_saves)
            finalized.append(call.idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Number of calls scheduled and not yet finalized."""
        return len(self._active)

    def wait_for_staging(self, timeout: float | None = None) -> None:
        """Return once every scheduled call's bytes are staged (at once if they are).

        Local to this rank (no collective). See :meth:`AsyncRequest.wait_staged`.

        Raises
        ------
        CheckpointException
            If staging of a scheduled save failed (``failure_policy="warn"``: logged
            instead; the save fails when it is finalized).
        TimeoutError
            If ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for call in list(self._active):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                call.request.wait_staged(left)
            except CheckpointException as exc:
                self._failures.staging_failed(exc)

    def close(self, abort: bool = False) -> None:
        """Finalize everything (``abort=False``), or drop in-flight calls (``abort=True``).

        After ``close(abort=True)`` nothing of the dropped calls keeps running and the
        queue can be used again.
        """
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
            return
        self._abort_all("the trainer called AsyncCallsQueue.close(abort=True)")

    def _abort_all(self, reason: str) -> None:
        """Drop every in-flight call; ``reason`` is what the daemon logs for each save."""
        while self._active:
            call = self._active.popleft()
            call.runner.abort(reason)

    def __del__(self) -> None:
        if getattr(self, "_active", None):
            log.warning("AsyncCallsQueue dropped with %d unfinalized call(s); "
                        "call close() to finalize them", len(self._active))


_live_queues: "weakref.WeakSet[AsyncCallsQueue]" = weakref.WeakSet()
_logged_once: set[str] = set()


def _log_once(key: str, message: str, *args) -> None:
    if key not in _logged_once:
        _logged_once.add(key)
        log.info(message, *args)


def abort_async_checkpoints() -> None:
    """Drop the in-flight saves of every :class:`AsyncCallsQueue` of this process.

    ``close(abort=True)`` on each: nothing of those saves keeps running (the daemon
    discards their writes) and every queue stays usable. Meant for in-process restarts;
    unlike the reference, nothing needs restarting afterwards (the daemon keeps running).
    """
    for queue in list(_live_queues):
        queue._abort_all("the trainer called abort_async_checkpoints()")


#: The reference API's name for :func:`abort_async_checkpoints`.
abort_nvrx_checkpoint = abort_async_checkpoints
