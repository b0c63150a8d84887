"""How a queued request's background part runs: the runner protocol and its implementations.

A runner is what :class:`~ckpt_client.AsyncCallsQueue` holds for each call and asks
(:class:`Runner`): ``poll() -> (done, error)``, ``wait(interval) -> (done, error)`` (the
same, once the call may have moved on: what a blocking finalize loops on),
``cleanup(failed)`` once every rank is done, ``abort(reason)`` to drop the call. Requests
made by our save functions are running in the daemon already (:class:`DaemonRunner`); a
request built by hand with a Python ``async_fn`` runs in a forked helper process of the
trainer, as in the reference (:class:`ProcessRunner`); an ``async_fn`` that knows a
better way to run provides ``start_async(args, kwargs, options) -> Runner``
(``FileSystemWriterAsync``'s save function hands its files to the daemon,
:mod:`ckpt_client.megatron.write_runners`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ckptd.protocol import Phase
from ckpt_client.queue.request import AsyncRequest, preloaded_args

log = logging.getLogger(__name__)


class Runner(ABC):
    """The background part of one queued call, as the queue sees it."""

    @abstractmethod
    def poll(self) -> tuple[bool, str | None]:
        """``(done, error)``: whether this rank's part ended, and why it failed if it did.

        Must not block; called again after it returned ``done``, it answers the same.
        """

    def wait(self, interval: float) -> tuple[bool, str | None]:
        """What :meth:`poll` answers, once the call may have moved on: a blocking
        finalize's loop. This default waits ``interval`` seconds; a runner that hears of
        progress (a daemon that holds a POLL until the save changes phase) waits for that
        instead, for a bounded time.
        """
        time.sleep(interval)
        return self.poll()

    @abstractmethod
    def cleanup(self, failed: bool) -> None:
        """Every rank is done (``failed``: on some rank the call failed); release what is
        left (the daemon's record of the saves; their files when ``failed``)."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Drop the call: when this returns, nothing of it keeps running. ``reason``
        (what made the trainer drop it) is what the daemon logs."""


class DaemonRunner(Runner):
    """The async part is done by ckptd: ask it how the saves are going."""

    def __init__(self, request: AsyncRequest) -> None:
        self.saves = request.daemon_saves

    def poll(self) -> tuple[bool, str | None]:
        for save in self.saves:
            if not save.finished:
                return False, None
        return self._outcome()

    def wait(self, interval: float) -> tuple[bool, str | None]:
        """Ask about the first save not known to be finished with a POLL the daemon holds
        until it moves on: one POLL per phase change (``interval`` is not needed)."""
        for save in self.saves:
            if save.last.phase not in Phase.FINISHED \
                    and save.poll(hold=True).phase not in Phase.FINISHED:
                return False, None
        return self._outcome()

    def _outcome(self) -> tuple[bool, str | None]:
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


def _start_with_sigterm_held(process: multiprocessing.process.BaseProcess) -> None:
    """Start ``process`` with SIGTERM blocked in this thread, then put the mask back.

    A forked child inherits the trainer's SIGTERM handler, which in a trainer with its own
    Python handler (Lightning, torchelastic) only sets a flag the helper never reads: an
    abort's SIGTERM landing before the child has reset its disposition would be swallowed,
    and the helper killed only after ``sigterm_timeout``. Blocked, it stays pending until
    :func:`_take_default_sigterm` has run in the child. A SIGTERM for the trainer that
    arrives meanwhile is delivered when the mask is put back.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _take_default_sigterm() -> None:
    """In the helper: SIGTERM ends it (the default action), whatever the parent had.

    Resets the disposition before unblocking, so a SIGTERM already pending ends the helper
    here. Right for every start method: a forked child has the parent's handler and mask,
    a spawned or forkserver one inherits an ignored SIGTERM and the mask through exec.
    ``async_fn`` may still install its own handler afterwards to clean up.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _run_in_child(fn, args, kwargs, conn, cpu_priority=None, send_result=False) -> None:
    import gc

    _take_default_sigterm()
    gc.disable()  # freeing CUDA tensors inherited through fork would crash the child
    try:
        _lower_cpu_priority(cpu_priority)
        value = fn(*args, **kwargs)
        conn.send((None, value if send_result else None))
    except BaseException:
        conn.send((traceback.format_exc(limit=5), None))
    finally:
        conn.close()


class ProcessRunner(Runner):
    """The async part is a Python function: run it in a forked helper process.

    With ``send_result=True`` the function's return value comes back as ``result``.
    """

    def __init__(self, request: AsyncRequest, options: HelperOptions = HelperOptions(),
                 send_result: bool = False) -> None:
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        args = preloaded_args(request)
        self._sigterm_timeout = options.sigterm_timeout
        self.process = context.Process(target=_run_in_child, daemon=options.daemonic,
                                       args=(request.async_fn, args, request.async_fn_kwargs, send,
                                             options.cpu_priority, send_result))
        _start_with_sigterm_held(self.process)
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
            log.warning("async_fn helper process %d did not exit within %.0f s of SIGTERM "
                        "(sigterm_timeout); killing it with SIGKILL", self.process.pid,
                        self._sigterm_timeout)
            self.process.kill()
        self.process.join()
        self._receive.close()


class NoopRunner(Runner):
    """Nothing runs in the background (a request without work, or one that ended before
    it started)."""

    def poll(self) -> tuple[bool, str | None]:
        return True, None

    def cleanup(self, failed: bool) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass


def runner_for(request: AsyncRequest, options: HelperOptions) -> Runner:
    """The runner that starts ``request``'s background part (and is asked about it)."""
    if request.daemon_saves:
        return DaemonRunner(request)
    start_async = getattr(request.async_fn, "start_async", None)
    if start_async is not None:
        return start_async(preloaded_args(request), request.async_fn_kwargs, options)
    if request.async_fn is not None:
        return ProcessRunner(request, options)
    return NoopRunner()
