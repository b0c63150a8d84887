"""How the reference flow's save function runs: the daemon writes, or a helper process does.

``FileSystemWriterAsync.get_save_function_and_args`` hands out a :class:`SaveFunction`.
Called directly it writes synchronously; scheduled on an ``AsyncCallsQueue`` it provides
``start_async``, which returns the queue's runner (:class:`~ckpt_client.queue.runners.Runner`):
:class:`DaemonWriteRunner` polls a save the daemon is writing; :class:`HelperWriteRunner`
runs :func:`write_files` through a custom ``open_file`` in a forked helper. Either way the
outcome goes to the writer's :class:`~ckpt_client.megatron.results.WriteResultsSlot`, and
the queue sees success: failures surface in ``save_state_dict_async_finalize``, as in
the reference.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptd.protocol import Phase
from ckpt_client.dcp.writer import DaemonStorageWriter
from ckpt_client.megatron.results import WriteResultList, WriteResultsSlot
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.queue.runners import HelperOptions, NoopRunner, ProcessRunner, Runner
from ckpt_client.transport.daemon_save import wait_until_finished

log = logging.getLogger(__name__)

INVALID_SETUP = ("Invalid Setup! FileSystemWriterAsync(is_multiproc_io=True) asks for writer "
                 "child processes, which the daemonic helper of AsyncCallsQueue(is_daemon=True) "
                 "cannot start (the reference refuses this combination too); use "
                 "AsyncCallsQueue(is_daemon=False) or is_multiproc_io=False")


@dataclasses.dataclass
class StagedWrite:
    """What ``preload_fn`` returns in daemon mode: the staged save and how to read it back."""

    save: Any  # DaemonSave or RefusedSave
    plan: SavePlan


class DaemonWriteRunner(Runner):
    """Polls a staged save; when the daemon is done, leaves the outcome in the slot.

    Failures travel through the slot (as in the reference, they surface in
    ``save_state_dict_async_finalize``), so the queue always sees success.
    """

    def __init__(self, staged: StagedWrite, results: WriteResultsSlot) -> None:
        self.staged = staged
        self.results = results
        self._error: str | None = None
        self._done = False

    def poll(self) -> tuple[bool, str | None]:
        if not self._done:
            save = self.staged.save
            if not save.finished:
                return False, None
            self._done = True
            self._error = save.error
            if self._error:
                self.results.put(self._error)
            else:
                self.results.put(WriteResultList(
                    DaemonStorageWriter.write_results(save, self.staged.plan),
                    {w.name: [w.crc32, w.size] for w in save.last.written}))
        return True, None

    def wait(self, interval: float) -> tuple[bool, str | None]:
        """Asked with a POLL the daemon holds until the save moves on."""
        if not self._done and self.staged.save.poll(hold=True).phase not in Phase.FINISHED:
            return False, None
        return self.poll()

    def cleanup(self, failed: bool) -> None:
        self.staged.save.forget(delete_files=bool(self._error))

    def abort(self, reason: str) -> None:
        self.staged.save.abort(reason)
        self.results.put(f"the save was aborted: {reason}")


class HelperWriteRunner(Runner):
    """Runs :func:`write_files` (custom ``open_file``) in a forked helper process; its
    outcome goes to the slot."""

    def __init__(self, open_file: Callable, buckets: list, rank: int, results: WriteResultsSlot,
                 options: HelperOptions) -> None:
        self.rank = rank
        self.results = results
        self._delivered = False
        self._inner = ProcessRunner(AsyncRequest(write_files, (open_file, buckets, rank)),
                                     options, send_result=True)

    def poll(self) -> tuple[bool, str | None]:
        done, crashed = self._inner.poll()
        if done and not self._delivered:
            self._delivered = True
            self.results.put(f"rank {self.rank}: the writer helper failed: {crashed}" if crashed
                             else self._inner.result)
        return done, None

    def cleanup(self, failed: bool) -> None:
        self._inner.cleanup(failed)

    def abort(self, reason: str) -> None:
        self._inner.abort(reason)
        self.results.put(f"the save was aborted: {reason}")


def write_files(open_file: Callable, buckets: list, rank: int) -> WriteResultList | str:
    """Write DCP files through ``open_file`` as torch does.

    Parameters
    ----------
    open_file : callable
        ``open_file(path, "wb")`` returns a binary file object.
    buckets : list
        ``(path, name, [(write_item, data), ...])`` per file, byte items first.
    rank : int
        Named in the failure reason.

    Returns
    -------
    WriteResultList or str
        The write results, or why writing failed (rank, file, error).
    """
    results = WriteResultList()
    for path, name, entries in buckets:
        try:
            with open_file(path, "wb") as stream:
                for item, data in entries:
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        torch.save(data, stream)
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                stream.flush()
                os.fsync(stream.fileno())
        except Exception as exc:  # the outcome travels to retrieve_write_results
            return f"rank {rank}: writing {path} failed: {type(exc).__name__}: {exc}"
    return results


class SaveFunction:
    """The ``async_fn`` FileSystemWriterAsync hands out: ``save_fn(rank, staged, results)``.

    Called directly it finishes the write synchronously; an ``AsyncCallsQueue`` starts it
    with :meth:`start_async` instead and polls.
    """

    def __init__(self, open_file: Callable | None, is_multiproc_io: bool) -> None:
        self.open_file = open_file  # None: the daemon writes
        self.is_multiproc_io = is_multiproc_io

    def __call__(self, rank: int, staged, results: WriteResultsSlot) -> None:
        if self.open_file is not None:
            results.put(write_files(self.open_file, staged, rank))
            return
        runner = DaemonWriteRunner(staged, results)
        wait_until_finished([staged.save])
        runner.poll()
        runner.cleanup(failed=False)

    def start_async(self, args: tuple, kwargs: dict, options: HelperOptions):
        """Start the write in the background; returns the queue's runner."""
        rank, staged, results = args
        if self.is_multiproc_io and options.daemonic:
            log.error("rank %d: %s", rank, INVALID_SETUP)
            if isinstance(staged, StagedWrite):
                staged.save.abort(f"the save was set up wrongly: {INVALID_SETUP}")
            results.put(f"rank {rank}: {INVALID_SETUP}")
            return NoopRunner()  # ended before it started: nothing to poll or stop
        if self.open_file is not None:
            return HelperWriteRunner(self.open_file, staged, rank, results, options)
        return DaemonWriteRunner(staged, results)
