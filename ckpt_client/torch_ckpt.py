"""``TorchAsyncCheckpoint``: ``torch.save`` made asynchronous by the daemon.

By default the state dict is staged (copied into the daemon's pool) before ``async_save``
returns; with ``zero_stall=True`` it returns once the save is queued and the bytes are
staged in the background (``wait_for_staging`` / ``guard_optimizer`` before the weights
change). The daemon writes a file that plain ``torch.load(path, weights_only=True)``
reads, under a temporary name, fsynced, then renamed.
"""

from __future__ import annotations

import os
import time
from typing import IO, Any

import torch

from ckptd.protocol import SaveFormat
from ckpt_client.queue import spans
from ckpt_client.queue.calls_queue import AsyncCallsQueue
from ckpt_client.queue.gcpause import collector_paused
from ckpt_client.queue.request import AsyncRequest, wait_for_daemon_saves
from ckpt_client.transport.connection import DaemonConnection, connect
from ckpt_client.transport.flatten import buffers_of, flatten_state_dict
from ckpt_client.transport.handover import handover_for, stage
from ckpt_client.transport.sent_ahead import SentAhead, kind_of


@collector_paused
def async_torch_save(state_dict, path: str | os.PathLike,
                     connection: DaemonConnection | None = None,
                     zero_stall: bool = False) -> AsyncRequest:
    """Stage ``state_dict`` with the daemon and return the request that completes it.

    Returns once the tensors are staged (changing them afterwards does not change the
    file), or with ``zero_stall=True`` once the save is queued (then do not change them
    before :meth:`AsyncRequest.wait_staged`). Schedule the result on an
    :class:`AsyncCallsQueue`.
    """
    started = time.time()
    connection = connection or connect()
    # The STAGE goes out first, with the last save's layout, so the daemon reserves the
    # extent while the state dict is walked (dropped if the layout changed).
    kind = None if zero_stall else kind_of(state_dict)
    ahead = None if zero_stall else SentAhead.send(connection, kind, path,
                                                   handover_for(connection).idle)
    try:
        flat = flatten_state_dict(state_dict)
        buffers = ahead.buffers_for(flat.layout) if ahead is not None else None
        buffers = buffers or buffers_of(flat.layout)
    except BaseException:
        if ahead is not None:
            ahead.drop("the state dict could not be saved")
        raise
    save = stage(connection, SaveFormat.TORCH, os.fspath(path), flat.tensors,
                 skeleton=flat.skeleton, zero_stall=zero_stall, ahead=ahead, buffers=buffers,
                 on_cpu=flat.on_cpu,
                 remember=(kind, flat.layout) if kind is not None else None)
    spans.note((save,), "blocked in async_torch_save", started, time.time())
    return AsyncRequest(daemon_saves=(save,))


class TorchAsyncCheckpoint:
    """Asynchronous ``torch.save`` through ckptd, with the reference's interface.

    Parameters
    ----------
    persistent_queue : bool
        Passed to the internal :class:`AsyncCallsQueue`.
    socket : str, optional
        Daemon socket (see :func:`ckpt_client.connect`).
    failure_policy : str
        ``"raise"`` or ``"warn"``, as for :class:`AsyncCallsQueue` (failed saves are then
        in :attr:`failed_calls`).
    """

    def __init__(self, persistent_queue: bool = True, socket: str | None = None, *,
                 failure_policy: str = "raise") -> None:
        self._queue = AsyncCallsQueue(persistent=persistent_queue, failure_policy=failure_policy)
        self._socket = socket

    @property
    def failed_calls(self) -> list:
        """``(call_idx, CheckpointException)`` of saves that failed under ``"warn"``."""
        return self._queue.failed_calls

    def async_save(self, state_dict, *args, zero_stall: bool = False, **kwargs) -> None:
        """Save ``state_dict`` to ``args[0]`` (or ``f=`` / ``path=``) in the background.

        Parameters
        ----------
        zero_stall : bool
            False (default): blocks until the daemon has staged the tensors. True: returns
            once the save is queued; the tensors must not change until
            :meth:`wait_for_staging` returns (``ckpt_client.guard_optimizer(optimizer,
            checkpoint)`` does that before every ``optimizer.step()``).
        """
        path = args[0] if args else kwargs.get("f", kwargs.get("path"))
        if path is None:
            raise TypeError("async_save needs a destination path")
        request = async_torch_save(state_dict, path, connect(self._socket), zero_stall=zero_stall)
        self._queue.schedule_async_request(request)

    def get_num_unfinalized_calls(self) -> int:
        """Number of saves handed over and not yet finalized.

        A save stays counted, even once durable, until :meth:`finalize_async_save`
        finalizes it; so after ``finalize_async_save(blocking=False)`` a count of 0 means
        every save handed over so far is durable (or failed and was raised or, under
        ``failure_policy="warn"``, recorded in :attr:`failed_calls`).

        Returns
        -------
        int
            Saves scheduled by :meth:`async_save` that are not finalized yet.
        """
        return self._queue.get_num_unfinalized_calls()

    def wait_for_staging(self, timeout: float | None = None) -> None:
        """Return once every scheduled save's bytes are staged (at once if they are).

        Raises
        ------
        CheckpointException
            If staging failed (the daemon refused a save or died).
        TimeoutError
            If ``timeout`` seconds passed first.
        """
        self._queue.wait_for_staging(timeout)

    def save(self, state_dict: Any, f: str | os.PathLike | IO[bytes], **kwargs) -> None:
        """Save ``state_dict`` to ``f`` now (the reference's synchronous ``torch.save``).

        To a path, through the daemon: returns when the file is durable (written under a
        temporary name, fsynced, renamed). To a file object, or with ``torch.save`` keyword
        arguments, it is ``torch.save`` in this process, as in the reference.

        Raises
        ------
        CheckpointException
            If the daemon could not write the file.
        """
        if kwargs or not isinstance(f, (str, os.PathLike)):
            torch.save(state_dict, f, **kwargs)
            return
        wait_for_daemon_saves(async_torch_save(state_dict, f, connect(self._socket)).daemon_saves)

    def finalize_async_save(self, blocking: bool = False, no_dist: bool = True,
                            terminate: bool = False) -> None:
        """Finalize finished saves (all of them with ``blocking=True``).

        Raises
        ------
        CheckpointException
            If a save failed.
        """
        self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=no_dist)
        if terminate:
            self.close()

    def close(self, abort: bool = False) -> None:
        """Finish (or with ``abort=True`` drop) every pending save."""
        self._queue.close(abort=abort)
