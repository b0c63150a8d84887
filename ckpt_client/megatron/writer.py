"""``FileSystemWriterAsync``: the reference's asynchronous DCP storage writer, written by ckptd.

The flow is the reference's, so Megatron-style code runs unchanged:

1. planning (:func:`ckpt_client.save_state_dict_async_plan`) calls
   :meth:`FileSystemWriterAsync.prepare_write_data`, which resolves the plan's items and
   decides which file each goes to;
2. :meth:`~FileSystemWriterAsync.get_save_function_and_args` returns ``(save_fn,
   preload_fn, args)``. ``preload_fn`` stages the items with the daemon and returns once
   they are copied (training may change its tensors right after); its result replaces
   ``args[1]``. ``save_fn`` waits for the daemon's writers (scheduled on an
   :class:`~ckpt_client.AsyncCallsQueue` it does not wait: the queue polls it);
3. :meth:`~FileSystemWriterAsync.retrieve_write_results` returns the DCP write results, or
   a wrapped exception naming why the write failed (``Worker failure: ...``);
4. the coordinator's :meth:`~FileSystemWriterAsync.finish` commits ``.metadata`` through
   the daemon (temporary name, fsync, rename).

The files are exactly torch's ``FileSystemWriter`` files: the same names
(``[<separation_hint>]__<rank>_<n>.distcp``) and bytes, with no ``.ckptd-sum`` sidecar
beside them (``ckptd.protocol.STOCK_FILES``); the checksums ckptd computed while writing
go into ``.metadata`` instead, as its ``ckptd_checksums`` attribute (file -> [crc32, size]).

A custom ``open_file`` (the reference's hook for tests) cannot run inside the daemon:
with one, this trainer writes the files through it, in a forked helper process on a queue
(in-process for a synchronous run), and commits ``.metadata`` itself as stock DCP does.
How the save function runs is :mod:`ckpt_client.megatron.write_runners`'s.
"""

from __future__ import annotations

import builtins
import dataclasses
import os
from functools import partial
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd.protocol import SaveFormat
from ckpt_client.collectives import rank_and_world
from ckpt_client.dcp.commit import commit_metadata
from ckpt_client.dcp.files import DCP_SUFFIX, item_nbytes, resolve_items, split_into_files
from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError
from ckpt_client.megatron.results import (WriteResultList, WriteResultsSlot, is_wrapped_failure,
                                          wrap_failure)
from ckpt_client.megatron.write_runners import SaveFunction, StagedWrite
from ckpt_client.transport.connection import connect
from ckpt_client.transport.daemon_save import RefusedSave
from ckpt_client.transport.handover import stage

@dataclasses.dataclass
class _FileEntry:
    name: str
    indices: list  # into the plan's items: byte items first, then tensors, as torch writes


@dataclasses.dataclass
class _PreparedWrite:
    """What ``prepare_write_data`` resolved: the plan, its data, and the files."""

    path: str
    plan: SavePlan
    sources: list  # resolved data of plan.items[i]
    files: list  # _FileEntry


class FileSystemWriterAsync(FileSystemWriter):
    """DCP storage writer for asynchronous saves whose files ckptd writes.

    Use it with :func:`ckpt_client.save_state_dict_async_plan` (see the module docstring),
    or with stock ``torch.distributed.checkpoint.save`` (``write_data`` then waits until
    the files are durable). One writer per save.

    Parameters
    ----------
    path : str or PathLike
        Checkpoint directory (under one of the daemon's ``--root``).
    *args, **kwargs
        As for ``FileSystemWriter``; ``thread_count`` is the number of files per rank
        (the daemon's writer processes write them in parallel). ``single_file_per_rank``
        must stay True.
    separation_hint : str, optional
        Items whose name starts with it go to separate files named with it as prefix
        (``thread_count`` must be at least 2; half of it is used per group).
    use_msc : bool
        Accepted for filesystem paths (written by the daemon as any other); ``msc://``
        URLs are refused.
    is_multiproc_io : bool
        The daemon's writers are processes anyway; as in the reference, combining it with
        ``AsyncCallsQueue(is_daemon=True)`` fails the save with "Invalid Setup!".
    use_cached_data_structure : bool
        Accepted; the daemon already keeps CUDA IPC mappings across saves.
    use_cpu_shm_for_gpu_tensors : bool
        Stage CUDA tensors by copying them into the shared-memory pool in this process
        instead of handing the daemon CUDA IPC handles.
    open_file : callable, optional
        Open files with this instead (``open_file(path, "wb")``); the trainer then writes
        them itself (see the module docstring).
    socket : str, optional
        Daemon socket (see :func:`ckpt_client.connect`).
    """

    can_run_decentralized_global_plan: bool = True

    def __init__(self, path: str | os.PathLike, *args, separation_hint: str | None = None,
                 use_msc: bool = False, is_multiproc_io: bool = False,
                 use_cached_data_structure: bool = False,
                 use_cpu_shm_for_gpu_tensors: bool = False,
                 open_file: Callable | None = None, socket: str | None = None, **kwargs) -> None:
        if str(path).startswith("msc://"):
            raise ValueError(f"FileSystemWriterAsync: {path} is a Multi-Storage Client URL; "
                             "ckptd writes filesystem paths only, so give the mounted path")
        super().__init__(path, *args, **kwargs)
        if not self.single_file_per_rank:
            raise NotImplementedError("FileSystemWriterAsync writes one set of files per rank; "
                                      "single_file_per_rank=False is not supported")
        if separation_hint and self.thread_count < 2:
            raise ValueError(f"FileSystemWriterAsync(separation_hint={separation_hint!r}) needs "
                             f"thread_count >= 2, not {self.thread_count}")
        self.checkpoint_dir = path
        # Resolved once, on every rank: a path-like object may do work in __fspath__.
        self._directory = os.path.abspath(os.fspath(self.path))
        self.separation_hint = separation_hint
        self.use_msc = use_msc
        self.is_multiproc_io = is_multiproc_io
        self.use_cached_data_structure = use_cached_data_structure
        self.use_cpu_shm_for_gpu_tensors = use_cpu_shm_for_gpu_tensors
        self.open_file = None if open_file in (None, builtins.open) else open_file
        self.socket = socket
        self.has_data_to_write = False
        self.results_queue: WriteResultsSlot | None = None
        self._prepared: _PreparedWrite | None = None

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return str(self.checkpoint_dir)

    # ------------------------------------------------------------------ planning
    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """This rank's part of the global plan, without asking the others (file prefix
        ``__<rank>_``, as the coordinator would give)."""
        rank, _ = rank_and_world()
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{rank}_"))

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Resolve the plan's data and decide the files (step 1 of the flow).

        Nothing is copied here; ``preload_fn`` stages the data.
        """
        sources = resolve_items(plan, planner)
        self._prepared = _PreparedWrite(self._directory, plan, sources,
                                        self._files_for(plan, sources))
        self.has_data_to_write = bool(plan.items)
        self.results_queue = WriteResultsSlot()

    def _files_for(self, plan: SavePlan, sources: list) -> list[_FileEntry]:
        if not sources:
            return []
        count = self.thread_count // 2 if self.separation_hint else self.thread_count
        groups = split_into_files([item_nbytes(s) for s in sources], count)
        by_prefix = {"": groups}
        if self.separation_hint:
            hinted = lambda i: plan.items[i].index.fqn.startswith(self.separation_hint)
            by_prefix = {"": [[i for i in g if not hinted(i)] for g in groups],
                         self.separation_hint: [[i for i in g if hinted(i)] for g in groups]}
        files = []
        for prefix, prefix_groups in by_prefix.items():
            for group in prefix_groups:
                if not group:
                    continue
                is_bytes = lambda i: plan.items[i].type == WriteItemType.BYTE_IO
                order = [i for i in group if is_bytes(i)] + [i for i in group if not is_bytes(i)]
                name = f"{prefix}{plan.storage_data.prefix}{len(files)}{DCP_SUFFIX}"
                files.append(_FileEntry(name, order))
        return files

    # ------------------------------------------------------------------ writing
    def get_save_function_and_args(self) -> tuple[Callable | None, Callable | None, list]:
        """``(save_fn, preload_fn, args)`` for an :class:`~ckpt_client.AsyncRequest`.

        Returns
        -------
        tuple
            ``(None, None, [])`` when this rank has nothing to write; else ``save_fn``,
            ``preload_fn`` (stages the data; its result replaces ``args[1]``) and ``args``
            (``[rank, None, results_slot]``).
        """
        if not self.has_data_to_write:
            return None, None, []
        rank, _ = rank_and_world()
        preload = self._write_buckets if self.open_file is not None else self._stage_with_daemon
        return (SaveFunction(self.open_file, self.is_multiproc_io), partial(preload, rank),
                [rank, None, self.results_queue])

    def _stage_with_daemon(self, rank: int) -> StagedWrite:
        prepared = self._prepared
        files = [[f.name, f.indices] for f in prepared.files]
        try:
            save = stage(connect(self.socket), SaveFormat.DCP, prepared.path, prepared.sources,
                         files=files, stock_files=True,
                         allow_cuda_ipc=not self.use_cpu_shm_for_gpu_tensors)
        except (DaemonRequestError, DaemonUnavailableError) as exc:
            # reported by retrieve_write_results on every rank, not raised on this one alone
            save = RefusedSave(rank, str(exc))
        return StagedWrite(save, prepared.plan)

    def _write_buckets(self, rank: int) -> list:
        prepared = self._prepared
        buckets = []
        for entry in prepared.files:
            data = [(prepared.plan.items[i], _on_cpu(prepared.sources[i])) for i in entry.indices]
            buckets.append((os.path.join(prepared.path, entry.name), entry.name, data))
        return buckets

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write ``plan``'s items and wait until durable (for stock ``dcp.save``)."""
        self.prepare_write_data(plan, planner)
        save_fn, preload_fn, args = self.get_save_function_and_args()
        if save_fn is not None:
            args[1] = preload_fn()
            save_fn(*args)
        results = self.retrieve_write_results()
        if is_wrapped_failure(results):
            raise OSError(str(results[0]))
        future: Future = Future()
        future.set_result(results)
        return future

    def retrieve_write_results(self) -> WriteResultList | tuple:
        """This rank's write results, or DCP's wrapped exception if the write failed.

        Returns
        -------
        WriteResultList or (WorkerFailure, StackSummary)
        """
        if not self.has_data_to_write:
            return WriteResultList()
        outcome = self.results_queue.take() if self.results_queue is not None else None
        if outcome is None:
            return wrap_failure("no write results: the save function did not run (or ran "
                                "twice); schedule the request or call execute_sync() first")
        if isinstance(outcome, str):
            return wrap_failure(outcome)
        return outcome

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit ``.metadata`` (coordinator; after every rank's files are durable)."""
        if self.open_file is not None:
            super().finish(metadata, results)
            return
        commit_metadata(connect(self.socket), self._directory, metadata, results,
                        self.storage_meta(), stock_files=True)


def _on_cpu(data):
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return data.to("cpu")
    return data
