"""``StorageWriter``: a DCP storage writer whose bytes the node's ckptd writes.

:class:`DaemonStorageWriter` (exported as ``ckpt_client.dcp.StorageWriter``) plugs into
stock ``torch.distributed.checkpoint.save``: ``write_data`` stages the plan's items with
the daemon and waits until they are durable; ``finish`` has the daemon commit
``.metadata``. :func:`ckpt_client.dcp.async_save` uses the same writer to stage and to
turn the daemon's results into DCP write results. Each save's files carry a per-save
token in their names, so a save into a directory that already holds a checkpoint never
overwrites the files that checkpoint's ``.metadata`` points to.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading

from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriterBase
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd.protocol import SaveFormat, Stage
from ckpt_client.dcp.commit import commit_metadata, metadata_bytes
from ckpt_client.dcp.files import DCP_SUFFIX, grouping, resolve_items
from ckpt_client.dcp.stager import current_ticket, take_ticket
from ckpt_client.errors import CheckpointException
from ckpt_client.queue.request import wait_for_daemon_saves
from ckpt_client.transport.connection import DaemonConnection, connect
from ckpt_client.transport.daemon_save import DaemonSave
from ckpt_client.transport.flatten import describe
from ckpt_client.transport.handover import stage
from ckpt_client.transport.sent_ahead import SentAhead, dropped_on_error


class DaemonStorageWriter(_StorageWriterBase):
    """A DCP ``StorageWriter`` whose bytes are written by the node's ckptd.

    Parameters
    ----------
    path : str or PathLike
        Checkpoint directory.
    socket : str, optional
        Daemon socket (see :func:`ckpt_client.connect`).
    files_per_rank : int, optional
        Files each rank writes (default: the daemon's writer count).
    """

    def __init__(self, path: str | os.PathLike = "", *, socket: str | None = None,
                 files_per_rank: int | None = None) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path)) if path else ""
        self.socket = socket
        self.files_per_rank = files_per_rank
        self.save_id = secrets.token_hex(8)
        self.is_coordinator = False
        self.rank = 0

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    @property
    def connection(self) -> DaemonConnection:
        """This process's connection to its daemon."""
        return connect(self.socket)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point at a new checkpoint directory and start a new save id."""
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = secrets.token_hex(8)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        """Remember whether this rank commits ``.metadata``."""
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", self.rank)

    def storage_meta(self) -> StorageMeta:
        """Identify this save in the metadata (for a :class:`Stager`'s save, DCP's first
        call, before it plans: the save may be staged ahead with the remembered plan)."""
        ticket = current_ticket()
        if ticket is not None:
            ticket.stage_ahead(self)
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add locally."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each rank its file-name prefix."""
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
                for i, p in enumerate(plans)]

    # ------------------------------------------------------------------ writing
    def _chunks(self, plan: SavePlan, buffers: list, connection: DaemonConnection) -> list:
        """``[(members, files)]``: the requests a save of ``buffers`` is staged in (plan
        item indices, ``[file name, [positions]]``), at least one file per daemon writer
        and each request at most the pool's size; the file names carry a new token."""
        token = secrets.token_hex(4)
        chunks, number = [], 0
        for members, file_positions in grouping(buffers, self.files_per_rank or connection.writers,
                                                connection.pool_size):
            files = []
            for positions in file_positions:
                files.append([f"{plan.storage_data.prefix}{token}_{number}{DCP_SUFFIX}",
                              positions])
                number += 1
            chunks.append((members, files))
        return chunks

    def whole_stage(self, plan: SavePlan, buffers: list,
                    connection: DaemonConnection) -> Stage | None:
        """The STAGE through ``connection`` of a save of ``plan``'s items described by
        ``buffers`` (CPU tensors and byte items), if it goes in one request; ``None`` if it
        is streamed in several. Sent ahead, it is taken up by :meth:`stage` (``ahead``)."""
        chunks = self._chunks(plan, buffers, connection)
        if len(chunks) != 1:
            return None
        return Stage(format=SaveFormat.DCP, path=os.path.abspath(self.path), buffers=buffers,
                     files=chunks[0][1])

    def stage(self, plan: SavePlan, planner: SavePlanner, zero_stall: bool = False,
              sources: list | None = None, hold: threading.Event | None = None,
              buffers: list | None = None, caller_waits: bool = False,
              on_cpu: bool = False, ahead: SentAhead | None = None) -> tuple[DaemonSave, ...]:
        """Hand this rank's items to the daemon; returns once they are staged (or queued,
        with ``zero_stall``).

        Items are grouped into files (at least one per daemon writer). A rank whose items
        do not fit the daemon's staging pool at once is streamed: its files go in several
        requests, each at most the pool's size, each staged when the previous ones have
        made room (back-pressure). Only a single item larger than the whole pool is
        refused. ``sources``: the items' data when the caller resolved them already
        (``buffers``: their descriptions, if it has them too). ``hold`` (zero-stall
        only): nothing reaches the writers before it is set; ``caller_waits`` (zero-stall
        only): the caller waits for staging before it returns (see
        :func:`ckpt_client.transport.handover.stage`); ``on_cpu``: every source is a CPU
        tensor (no CUDA export, no check of each source); ``ahead``: the STAGE of
        :meth:`whole_stage`, sent before the sources were looked up (used if this save
        is that one request, else dropped).
        """
        with dropped_on_error(ahead):
            if sources is None:
                sources = resolve_items(plan, planner)
            if buffers is None:
                buffers = [describe(s) for s in sources]
            connection = self.connection
            chunks = self._chunks(plan, buffers, connection)
        if ahead is not None and len(chunks) == 1 and ahead.connection is connection and \
                [f[1] for f in chunks[0][1]] == [f[1] for f in ahead.body.files]:
            chunks = [(chunks[0][0], ahead.body.files)]  # the names the daemon was told
        elif ahead is not None:
            ahead.drop("the save's items go into other files (or through another connection) "
                       "than the STAGE sent ahead named")
            ahead = None
        saves = []
        for members, files in chunks:
            # One chunk of everything: the very lists (a save whose buffers are the very
            # list of the save before finds its layout and pool views without a compare).
            whole = len(chunks) == 1 and len(members) == len(sources)
            try:
                saves.append(stage(connection, SaveFormat.DCP, self.path,
                                   sources if whole else [sources[i] for i in members],
                                   files=files, zero_stall=zero_stall, hold=hold,
                                   buffers=buffers if whole else [buffers[i] for i in members],
                                   caller_waits=caller_waits, on_cpu=on_cpu,
                                   ahead=ahead))
            except BaseException:
                for earlier in saves:  # a save is whole or nothing: drop the chunks before
                    earlier.abort(f"chunk {len(saves) + 1} of {len(chunks)} of the same save "
                                  "could not be staged (its error reaches the trainer)")
                raise
            finally:
                ahead = None  # the one chunk's stage took it (used or dropped)
            saves[-1].items = members  # plan item index of each staged buffer
        return tuple(saves)

    @staticmethod
    def write_results(saves, plan: SavePlan, predicted: bool = False) -> list[WriteResult]:
        """DCP write results of finished saves (offsets as the daemon wrote them), or with
        ``predicted``, of staged tiered saves (offsets as the daemon will write them)."""
        results = []
        for save in (saves if isinstance(saves, (list, tuple)) else (saves,)):
            file_items = {entry[0]: entry[1] for entry in save.files}
            plan_index = getattr(save, "items", None) or list(range(len(plan.items)))
            files = (list(save.placements.items()) if predicted
                     else [(w.name, w.items) for w in save.last.written])
            for name, placed in files:
                for index, (offset, length) in zip(file_items[name], placed):
                    item = plan.items[plan_index[index]]
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name,
                                                                         offset, length)))
        return results

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Stage, wait until durable, and return the write results (stock ``dcp.save``).

        When the state dict came from a :class:`Stager` (stock ``dcp.async_save``), the
        trainer is released as soon as the items are staged, before they are durable.
        """
        ticket = take_ticket()
        ahead = ticket.ahead if ticket is not None else None
        try:
            saves = ahead.adopt(plan) if ahead is not None else self.stage(plan, planner)
        except BaseException as exc:
            if ticket is not None:
                ticket.punch(exc)
                ticket.done_with_state()
            raise
        if ticket is not None:
            ticket.punch()
            ticket.remember(plan, planner)
            ticket.done_with_state()
        try:
            wait_for_daemon_saves(saves)  # not execute_sync: no collective inside write_data
        except CheckpointException as exc:
            raise OSError(f"ckptd could not write rank {self.rank}'s part of {self.path}: "
                          f"{exc}") from None
        results = self.write_results(saves, ahead.plan if ahead is not None else plan)
        if ahead is not None:  # staged ahead: items the final plan dropped are not its
            wanted = {item.index for item in plan.items}
            results = [r for r in results if r.index in wanted]
        future: Future = Future()
        future.set_result(results)
        return future

    def metadata_bytes(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """The ``.metadata`` file of this save, from every rank's write results."""
        return metadata_bytes(metadata, results, self.storage_meta())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit ``.metadata`` through the daemon (temp file, fsync, rename); a tiered
        daemon answers once every file it names is durable at the target."""
        commit_metadata(self.connection, self.path, metadata, results, self.storage_meta())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any local path is a valid checkpoint id."""
        return isinstance(checkpoint_id, (str, os.PathLike))


#: The name users import (``ckpt_client.dcp.StorageWriter``, as the reference names it):
#: a ``StorageWriter`` for stock ``dcp.save``.
StorageWriter = DaemonStorageWriter
