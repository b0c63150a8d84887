"""``AsyncRequest``: one checkpoint save to finish in the background, then finalize.

Names and semantics follow the reference API: a request carries its work (saves already
handed to the daemon, or a Python ``async_fn``) and its ``finalize_fns``; the queue
(:mod:`ckpt_client.queue.calls_queue`) starts it and finalizes it once every rank is
done, or ``execute_sync`` does both in this process.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from ckpt_client.collectives import agree_on_completion
from ckpt_client.errors import CheckpointException
from ckpt_client.transport.daemon_save import wait_until_finished


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
        args = preloaded_args(self)  # a malformed request raises here, on every rank alike
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
        wait_until_finished([save])
        if save.error:
            failures[save.rank] = save.error
        save.forget(delete_files=bool(save.error))
    if failures:
        raise CheckpointException("checkpoint save failed", failures)


def preloaded_args(request: AsyncRequest) -> tuple:
    args = list(request.async_fn_args)
    if request.preload_fn is None:
        return tuple(args)
    if len(args) < 2:
        raise ValueError(
            f"AsyncRequest: preload_fn's result replaces async_fn_args[1] (as in the reference "
            f"API), but async_fn_args has {len(args)} item(s); put a placeholder (None) there")
    args[1] = request.preload_fn()
    return tuple(args)
