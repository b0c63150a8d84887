"""Async requests and the queue that finalizes them in order, together on every rank.

Names and semantics follow the reference API: an :class:`AsyncRequest` carries the work
and its ``finalize_fns``; :class:`AsyncCallsQueue` starts requests, and
``maybe_finalize_async_calls`` finalizes the oldest ones once *every* rank is done,
agreed by one small all-reduce over the default process group (on whatever device its
backend needs). A failure anywhere raises :class:`CheckpointException` on every rank.

Requests made by our save functions are already running in the daemon; a request built
by hand with a Python ``async_fn`` runs in a forked helper process of the trainer, as in
the reference, so existing code keeps working. An ``async_fn`` that knows a better way to
run (``FileSystemWriterAsync``'s save function hands its files to the daemon) provides
``start_async(args, kwargs, options) -> runner``; a runner has ``poll() -> (done, error)``,
``cleanup(failed)`` and ``abort()``.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from ckpt_client.collectives import agree_on_completion
from ckpt_client.errors import CheckpointException
from ckpt_client.queue import spans
from ckpt_client.queue.failures import FailedCalls

log = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """A checkpoint save to finish in the background, then finalize on all ranks.

    Parameters
    ----------
    async_fn : callable, optional
        Work to run in a helper process (``None``: nothing, or daemon saves only).
    async_fn_args : tuple
        Positional arguments of ``async_fn``.
    finalize_fns : list of callable
        Run in order on every rank after all ranks finished the async part.
    async_fn_kwargs : dict
        Keyword arguments of ``async_fn``.
    preload_fn : callable, optional
        Run in the trainer before the async part (e.g. a device-to-host copy); its result
        replaces ``async_fn_args[1]``, as in the reference API.
    is_frozen : bool
        Frozen requests accept no more finalize functions.
    call_idx : int
        Index assigned by the queue.
    daemon_saves : tuple
        Saves already handed to ckptd (set by our save functions).
    """

    async_fn: Callable | None = None
    async_fn_args: tuple = ()
    finalize_fns: list = field(default_factory=list)
    async_fn_kwargs: dict = field(default_factory=dict)
    preload_fn: Callable | None = None
    is_frozen: bool = False
    call_idx: int = 0
    daemon_saves: tuple = ()

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append a finalize function (runs after those already added).

        Raises
        ------
        RuntimeError
            If the request is frozen.
        """
        if self.is_frozen:
            raise RuntimeError("cannot add finalize functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def _replace(self, **changes) -> "AsyncRequest":
        """A copy with ``changes`` applied (as on the reference's NamedTuple)."""
        return dataclasses.replace(self, **changes)

    def freeze(self) -> "AsyncRequest":
        """A copy that accepts no more finalize functions."""
        return self._replace(is_frozen=True, finalize_fns=list(self.finalize_fns))

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once the bytes of this request's saves are staged (at once if they are).

        A zero-stall save returns before its bytes are in the daemon's staging pool; the
        tensors it saves must not change until this returns (``guard_optimizer`` makes
        the optimizer wait here). Requests with a Python ``async_fn`` copy what they need
        before they start, so they are always staged.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most (default: as long as staging takes; it cannot hang:
            the daemon's death or refusal ends it with an error).

        Raises
        ------
        CheckpointException
            If staging failed (the daemon refused the save, died, or a copy failed).
        TimeoutError
            If ``timeout`` passed first; staging goes on.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for save in self.daemon_saves:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            save.wait_staged(left)

    def execute_sync(self) -> None:
        """Do the whole request in this process: the async part, then finalize.

        As in the reference, every rank waits for the others before the finalize
        functions run when torch.distributed is initialized (call it on all ranks); here
        that wait is the small all-reduce that also shares failures, so a failure on one
        rank raises on every rank instead of leaving the others in a barrier.

        Raises
        ------
        CheckpointException
            On every rank, if the async part or a daemon save failed on any rank.
        """
        error = None
        args = _preloaded_args(self)  # a malformed request raises here, on every rank alike
        try:
            if self.async_fn is not None:
                self.async_fn(*args, **self.async_fn_kwargs)
            wait_for_daemon_saves(self.daemon_saves)
        except CheckpointException as exc:
            error = "; ".join(exc.failures.values())
        except Exception as exc:  # reported on every rank by the agreement below
            error = f"{type(exc).__name__}: {exc}"
        _, failures = agree_on_completion(True, error, no_dist=False)
        if failures:
            raise CheckpointException("checkpoint save failed", failures)
        for fn in self.finalize_fns:
            fn()


def wait_for_daemon_saves(saves) -> None:
    """Block until the daemon finished ``saves`` (this rank's); forget them there.

    Raises
    ------
    CheckpointException
        On this rank only, naming the failures, if any of them failed.
    """
    failures = {}
    for save in saves:
        while not save.finished:
            time.sleep(0.01)  # polling the daemon for a phase change
        if save.error:
            failures[save.rank] = save.error
        save.forget(delete_files=bool(save.error))
    if failures:
        raise CheckpointException("checkpoint save failed", failures)


def _preloaded_args(request: AsyncRequest) -> tuple:
    args = list(request.async_fn_args)
    if request.preload_fn is None:
        return tuple(args)
    if len(args) < 2:
        raise ValueError(
            f"AsyncRequest: preload_fn's result replaces async_fn_args[1] (as in the reference "
            f"API), but async_fn_args has {len(args)} item(s); put a placeholder (None) there")
    args[1] = request.preload_fn()
    return tuple(args)


# ---------------------------------------------------------------- runners

class _DaemonRunner:
    """The async part is done by ckptd: ask it how the saves are going."""

    def __init__(self, request: AsyncRequest) -> None:
        self.saves = request.daemon_saves

    def poll(self) -> tuple[bool, str | None]:
        for save in self.saves:
            if not save.finished:
                return False, None
        errors = [save.error for save in self.saves if save.error]
        return True, "; ".join(errors) if errors else None

    def cleanup(self, failed: bool) -> None:
        for save in self.saves:
            save.forget(delete_files=failed)

    def abort(self, reason: str) -> None:
        for save in self.saves:
            save.abort(reason)


@dataclass(frozen=True)
class HelperOptions:
    """How helper processes for hand-built Python ``async_fn`` run (the reference's
    worker settings, from :class:`AsyncCallsQueue`)."""

    daemonic: bool = True
    cpu_priority: int | None = 10
    sigterm_timeout: float = 30.0


def _lower_cpu_priority(target: int | None) -> None:
    """Raise this process's nice value to ``target`` (lowering it needs privileges)."""
    if target is None or not 0 <= target <= 19:
        return
    increment = target - os.nice(0)
    if increment > 0:
        os.nice(increment)


def _run_in_child(fn, args, kwargs, conn, cpu_priority=None, send_result=False) -> None:
    import gc

    gc.disable()  # freeing CUDA tensors inherited through fork would crash the child
    try:
        _lower_cpu_priority(cpu_priority)
        value = fn(*args, **kwargs)
        conn.send((None, value if send_result else None))
    except BaseException:
        conn.send((traceback.format_exc(limit=5), None))
    finally:
        conn.close()


class _ProcessRunner:
    """The async part is a Python function: run it in a forked helper process.

    With ``send_result=True`` the function's return value comes back as ``result``.
    """

    def __init__(self, request: AsyncRequest, options: HelperOptions = HelperOptions(),
                 send_result: bool = False) -> None:
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        args = _preloaded_args(request)
        self._sigterm_timeout = options.sigterm_timeout
        self.process = context.Process(target=_run_in_child, daemon=options.daemonic,
                                       args=(request.async_fn, args, request.async_fn_kwargs, send,
                                             options.cpu_priority, send_result))
        self.process.start()
        send.close()
        self._message: tuple | None = None
        self._error: str | None = None
        self.result = None
        self._done = False

    def _receive_message(self) -> None:
        if self._message is None and self._receive.poll():
            try:
                self._message = self._receive.recv()
            except EOFError:
                pass

    def poll(self) -> tuple[bool, str | None]:
        if not self._done:
            self._receive_message()
            if self.process.is_alive():
                return False, None
            self.process.join()
            self._receive_message()  # it may have sent its outcome just before exiting
            self._done = True
            if self._message is not None:
                self._error, self.result = self._message
            elif self.process.exitcode:
                self._error = f"async_fn process exited with status {self.process.exitcode}"
            else:
                self._error = "async_fn process exited without reporting its outcome"
        return True, self._error

    def cleanup(self, failed: bool) -> None:
        self._receive.close()

    def abort(self, reason: str) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM first, as the reference: let it clean up
            self.process.join(self._sigterm_timeout)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self._receive.close()


class _NoopRunner:
    def poll(self) -> tuple[bool, str | None]:
        return True, None

    def cleanup(self, failed: bool) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass


def _runner_for(request: AsyncRequest, options: HelperOptions):
    if request.daemon_saves:
        return _DaemonRunner(request)
    start_async = getattr(request.async_fn, "start_async", None)
    if start_async is not None:
        return start_async(_preloaded_args(request), request.async_fn_kwargs, options)
    if request.async_fn is not None:
        return _ProcessRunner(request, options)
    return _NoopRunner()


class _ActiveCall(NamedTuple):
    idx: int
    request: AsyncRequest
    runner: Any


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
        Seconds between checks while ``blocking=True`` waits.
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
        idx = self._next_idx
        self._next_idx += 1
        request = async_request._replace(call_idx=idx)
        request = request if request.is_frozen else request.freeze()
        self._active.append(_ActiveCall(idx, request, _runner_for(request, self.helper_options)))
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
                time.sleep(self.poll_interval)  # waiting on the daemon/helper, polled
                done, error = call.runner.poll()
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
