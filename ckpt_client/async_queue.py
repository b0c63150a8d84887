"""Async requests and the queue that finalizes them in order, together on every rank.

Names and semantics follow the reference API: an :class:`AsyncRequest` carries the work
and its ``finalize_fns``; :class:`AsyncCallsQueue` starts requests, and
``maybe_finalize_async_calls`` finalizes the oldest ones once *every* rank is done,
agreed by one small all-reduce over the default process group (on whatever device its
backend needs). A failure anywhere raises :class:`CheckpointException` on every rank.

Requests made by our save functions are already running in the daemon; a request built
by hand with a Python ``async_fn`` runs in a forked helper process of the trainer, as in
the reference, so existing code keeps working.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from ckpt_client.collectives import agree_on_completion
from ckpt_client.errors import CheckpointException

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
        Run in the trainer before the async part (e.g. a device-to-host copy); if it
        returns a value, that replaces the first positional argument of ``async_fn``.
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

    def execute_sync(self) -> None:
        """Do the whole request in this process: the async part, then finalize.

        Raises
        ------
        CheckpointException
            If a daemon save of this request failed.
        """
        args = _preloaded_args(self)
        if self.async_fn is not None:
            self.async_fn(*args, **self.async_fn_kwargs)
        failures = {}
        for save in self.daemon_saves:
            while not save.finished:
                time.sleep(0.01)
            if save.error:
                failures[save.connection.rank] = save.error
            save.forget(delete_files=bool(save.error))
        if failures:
            raise CheckpointException("checkpoint save failed", failures)
        for fn in self.finalize_fns:
            fn()


def _preloaded_args(request: AsyncRequest) -> tuple:
    if request.preload_fn is None:
        return tuple(request.async_fn_args)
    staged = request.preload_fn()
    if staged is None or not request.async_fn_args:
        return tuple(request.async_fn_args)
    return (staged, *request.async_fn_args[1:])


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

    def abort(self) -> None:
        for save in self.saves:
            save.abort()


def _run_in_child(fn, args, kwargs, conn) -> None:
    import gc

    gc.disable()  # freeing CUDA tensors inherited through fork would crash the child
    try:
        fn(*args, **kwargs)
        conn.send(None)
    except BaseException:
        conn.send(traceback.format_exc(limit=5))
    finally:
        conn.close()


class _ProcessRunner:
    """The async part is a Python function: run it in a forked helper process."""

    def __init__(self, request: AsyncRequest) -> None:
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        args = _preloaded_args(request)
        self.process = context.Process(target=_run_in_child, daemon=True,
                                       args=(request.async_fn, args, request.async_fn_kwargs, send))
        self.process.start()
        send.close()
        self._error: str | None = None
        self._done = False

    def poll(self) -> tuple[bool, str | None]:
        if not self._done:
            if self._receive.poll():
                try:
                    self._error = self._receive.recv()
                except EOFError:
                    pass
            if self.process.is_alive():
                return False, None
            self.process.join()
            self._done = True
            if self.process.exitcode and self._error is None:
                self._error = f"async_fn process exited with status {self.process.exitcode}"
        return True, self._error

    def cleanup(self, failed: bool) -> None:
        self._receive.close()

    def abort(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self._receive.close()


class _NoopRunner:
    def poll(self) -> tuple[bool, str | None]:
        return True, None

    def cleanup(self, failed: bool) -> None:
        pass

    def abort(self) -> None:
        pass


def _runner_for(request: AsyncRequest):
    if request.daemon_saves:
        return _DaemonRunner(request)
    if request.async_fn is not None:
        return _ProcessRunner(request)
    return _NoopRunner()


class _ActiveCall(NamedTuple):
    idx: int
    request: AsyncRequest
    runner: Any


# ---------------------------------------------------------------- the queue

class AsyncCallsQueue:
    """Keeps async calls in order and finalizes them when every rank is done.

    Parameters
    ----------
    persistent : bool
        Accepted for compatibility with the reference API; the daemon is the
        persistent worker, so both values behave alike.
    poll_interval : float
        Seconds between checks while ``blocking=True`` waits.
    """

    def __init__(self, persistent: bool = True, poll_interval: float = 0.01) -> None:
        self.persistent = persistent
        self.poll_interval = poll_interval
        self._active: deque[_ActiveCall] = deque()
        self._next_idx = 0

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
        self._active.append(_ActiveCall(idx, request, _runner_for(request)))
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
            Indices of the calls finalized now.

        Raises
        ------
        CheckpointException
            On every rank, if any rank's save failed; names the failing ranks.
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
                raise CheckpointException(f"async checkpoint call {call.idx} failed", failures)
            for fn in call.request.finalize_fns:
                fn()
            finalized.append(call.idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Number of calls scheduled and not yet finalized."""
        return len(self._active)

    def close(self, abort: bool = False) -> None:
        """Finalize everything (``abort=False``), or drop in-flight calls (``abort=True``).

        After ``close(abort=True)`` nothing of the dropped calls keeps running and the
        queue can be used again.
        """
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
            return
        while self._active:
            call = self._active.popleft()
            call.runner.abort()

    def __del__(self) -> None:
        if getattr(self, "_active", None):
            log.warning("AsyncCallsQueue dropped with %d unfinalized call(s); "
                        "call close() to finalize them", len(self._active))
