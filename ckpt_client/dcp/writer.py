"""``torch.distributed.checkpoint`` (DCP) through the daemon.

Two ways in:

- :class:`DaemonStorageWriter` (also exported as ``StorageWriter``) plugs into stock
  ``torch.distributed.checkpoint.save``: ``write_data`` stages the plan's items with the
  daemon and waits until they are durable; ``finish`` has the daemon commit ``.metadata``.
- :func:`async_save` plans like ``dcp.save`` (optionally reusing a cached plan), stages,
  and returns an :class:`AsyncRequest` whose finalize step gathers every rank's write
  results and has the coordinator commit ``.metadata`` last (temp, fsync, rename).

Files are DCP's own ``.distcp`` layout (each tensor ``torch.save``-d at a recorded offset)
so stock ``dcp.load(..., storage_reader=FileSystemReader(path))`` reads them, resharding
included. Each rank's files carry a per-save token in their names, so a save into a
directory that already holds a checkpoint never overwrites the files that checkpoint's
``.metadata`` points to.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import secrets
import threading
import time
from functools import partial

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (CURRENT_DCP_VERSION, _StorageInfo,
                                                     _StoragePrefix)
from torch.distributed.checkpoint.filesystem import FileSystemReader as _StockReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriterBase
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd import knobs, protocol
from ckptd.checksum import verify_file
from ckptd.protocol import CommitFile, MessageType, SaveFormat
from ckpt_client.queue.calls_queue import AsyncRequest, wait_for_daemon_saves
from ckpt_client.collectives import Group
from ckpt_client.transport.connection import DaemonConnection, connect
from ckpt_client.dcp.plan_reuse import ReusablePlan, planner_allows_reuse, structure_of
from ckpt_client.dcp.stager import current_ticket, take_ticket
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.queue import spans
from ckpt_client.queue.gcpause import collector_paused
from ckpt_client.transport.handover import DaemonSave, RefusedSave, stage
from ckpt_client.dcp.commit_handover import hand_over

METADATA_NAME = ".metadata"
DCP_SUFFIX = ".distcp"


def item_nbytes(source) -> int:
    """Bytes of one resolved DCP item (a tensor or an ``io.BytesIO``)."""
    if isinstance(source, torch.Tensor):
        return source.numel() * source.element_size()
    return source.getbuffer().nbytes


def split_into_files(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of items of ``sizes`` bytes grouped into ``count`` files of balanced size."""
    count = max(1, min(count, len(sizes)))
    groups: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for index in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
        target = totals.index(min(totals))
        groups[target].append(index)
        totals[target] += sizes[index]
    return [sorted(g) for g in groups if g]


def chunk_files(sources: list, count: int, pool_size: int) -> list[list[list[int]]]:
    """Group ``sources`` into files, and the files into requests that fit the pool.

    Returns
    -------
    list of chunks
        Each chunk is a list of files (lists of source indices) whose staged layout is at
        most ``pool_size`` bytes; one chunk when everything fits at once.
    """
    return _chunk_sizes(tuple(item_nbytes(s) for s in sources), count, pool_size)


@functools.lru_cache(maxsize=8)
def _chunk_sizes(sizes: tuple, count: int, pool_size: int) -> list[list[list[int]]]:
    """:func:`chunk_files` by item sizes: a training loop saves the same sizes again and
    again, so the grouping (a sort and a layout per file) is worked out once. Callers
    only read the result."""
    total = protocol.layout_extent(sizes)[1]
    if total > pool_size:  # more, smaller files, so that chunks can be packed
        count = max(count, -(-total // max(pool_size // 2, 1)))
    chunks: list[list[list[int]]] = []
    used = 0
    for group in split_into_files(sizes, count):
        need = protocol.layout_extent([sizes[i] for i in group])[1]
        if chunks and used + need <= pool_size:
            chunks[-1].append(group)
            used += need
        else:
            chunks.append([group])
            used = need
    return chunks or [[]]


def resolve_items(plan: SavePlan, planner: SavePlanner) -> list:
    """The data of each of ``plan``'s items: detached tensors and ``io.BytesIO``."""
    sources = []
    for item in plan.items:
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            data = data.detach()
        elif not isinstance(data, io.BytesIO):
            raise TypeError(f"planner resolved {item.index.fqn} to {type(data).__name__}")
        sources.append(data)
    return sources


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
    def stage(self, plan: SavePlan, planner: SavePlanner, zero_stall: bool = False,
              sources: list | None = None,
              hold: threading.Event | None = None) -> tuple[DaemonSave, ...]:
        """Hand this rank's items to the daemon; returns once they are staged (or queued,
        with ``zero_stall``).

        Items are grouped into files (at least one per daemon writer). A rank whose items
        do not fit the daemon's staging pool at once is streamed: its files go in several
        requests, each at most the pool's size, each staged when the previous ones have
        made room (back-pressure). Only a single item larger than the whole pool is
        refused. ``sources``: the items' data when the caller resolved them already.
        ``hold`` (zero-stall only): nothing reaches the writers before it is set.
        """
        if sources is None:
            sources = resolve_items(plan, planner)
        connection = self.connection
        token = secrets.token_hex(4)
        chunks = chunk_files(sources, self.files_per_rank or connection.writers,
                             connection.pool_size)
        saves, number = [], 0
        for chunk in chunks:
            members = sorted(i for group in chunk for i in group)
            position = {index: at for at, index in enumerate(members)}
            files = []
            for group in chunk:
                files.append([f"{plan.storage_data.prefix}{token}_{number}{DCP_SUFFIX}",
                              [position[i] for i in group]])
                number += 1
            try:
                saves.append(stage(connection, SaveFormat.DCP, self.path,
                                   [sources[i] for i in members], files=files,
                                   zero_stall=zero_stall, hold=hold))
            except BaseException:
                for earlier in saves:  # a save is whole or nothing: drop the chunks before
                    earlier.abort(f"chunk {len(saves) + 1} of {len(chunks)} of the same save "
                                  "could not be staged (its error reaches the trainer)")
                raise
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
            raise
        if ticket is not None:
            ticket.punch()
            ticket.remember(plan, planner)
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
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results
                                 for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        return pickle.dumps(metadata)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit ``.metadata`` through the daemon (temp file, fsync, rename); a tiered
        daemon answers once every file it names is durable at the target."""
        self.connection.call(MessageType.COMMIT_FILE,
                             CommitFile(path=os.path.join(self.path, METADATA_NAME)),
                             frames=[self.metadata_bytes(metadata, results)],
                             timeout=knobs.FLUSH_DEADLINE.get() if self.connection.tiered
                             else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any local path is a valid checkpoint id."""
        return isinstance(checkpoint_id, (str, os.PathLike))


#: Name required by the spec: a ``StorageWriter`` for stock ``dcp.save``.
StorageWriter = DaemonStorageWriter


class VerifyingFileSystemReader(_StockReader):
    """Stock DCP ``FileSystemReader`` that checks every file against its ckptd checksum.

    ``.metadata`` is verified before it is unpickled, and each data file before the
    first byte of it is used; a mismatch raises
    :class:`ckptd.checksum.ChecksumMismatchError` naming the file, so a corrupted part
    is never loaded silently.

    Parameters
    ----------
    path : str or PathLike
        Checkpoint directory.
    """

    def __init__(self, path: str | os.PathLike, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self._verified: set[str] = set()

    def _verify(self, relative_path: str) -> None:
        if relative_path not in self._verified:
            verify_file(os.path.join(os.fspath(self.path), relative_path))
            self._verified.add(relative_path)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """Verify, then read, ``.metadata``."""
        self._verify(METADATA_NAME)
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        """Verify every file the plan touches, then read as stock DCP does."""
        for item in plan.items:
            self._verify(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Verify every file of a ckptd-written checkpoint directory (or single file).

    Returns
    -------
    list of str
        The files verified.

    Raises
    ------
    ckptd.checksum.ChecksumMismatchError
        On the first file whose bytes do not match its record (or that has none).
    """
    from ckptd.checksum import verify_tree

    return verify_tree(os.fspath(path))


# ---------------------------------------------------------------------- planning

@dataclasses.dataclass
class _CachedPlan:
    local_plan: SavePlan
    central_plan: SavePlan
    metadata: Metadata | None


_plan_cache: dict = {}
#: Per cache key, the last local plan and how to resolve its items without planning.
_reusable_plans: dict = {}
#: Cache keys whose last global plan took items away from a rank (replicated tensors
#: deduplicated): staging before the global plan would copy bytes nobody writes.
_plans_that_moved_items: set = set()


def _cache_key(group: Group, planner: SavePlanner) -> tuple:
    return (id(group.group), group.size, type(planner).__name__)


def _local_plan(state_dict, writer: DaemonStorageWriter, planner: SavePlanner,
                group: Group) -> SavePlan:
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                           is_coordinator=group.is_coordinator)
    writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
    return writer.prepare_local_plan(planner.create_local_plan())


def _plan_or_reuse(state_dict, writer: DaemonStorageWriter, planner: SavePlanner,
                   group: Group, enable_cache: bool) -> tuple[SavePlan, ReusablePlan | None]:
    """The local plan; with the :class:`ReusablePlan` that resolves its items when the
    previous save's plan was reused (the planner was then not set up), else ``None``."""
    if not (enable_cache and planner_allows_reuse(planner)):
        return _local_plan(state_dict, writer, planner, group), None
    key = _cache_key(group, planner)
    signature = structure_of(state_dict)
    known = _reusable_plans.get(key)
    if signature is not None and known is not None and known.signature == signature:
        writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
        return known.local_plan, known
    local_plan = _local_plan(state_dict, writer, planner, group)
    if signature is None:
        _reusable_plans.pop(key, None)
    else:
        _reusable_plans[key] = ReusablePlan(signature, local_plan, state_dict, planner.mappings)
    return local_plan, None


def _global_plan(local_plan: SavePlan, writer: DaemonStorageWriter, planner: SavePlanner,
                 group: Group, enable_cache: bool) -> tuple[SavePlan, Metadata | None]:
    cache_key = _cache_key(group, planner)
    cached = _plan_cache.get(cache_key) if enable_cache else None
    if enable_cache:
        # One int all-reduce replaces gathering and scattering whole plans.
        if group.all_true(cached is not None and cached.local_plan == local_plan):
            return cached.central_plan, cached.metadata
    gathered = group.gather_to_coordinator(local_plan)
    metadata = None
    plans = None
    if group.is_coordinator:
        plans, metadata = planner.create_global_plan(gathered)
        plans = writer.prepare_global_plan(plans)
    central_plan = group.scatter_from_coordinator(plans)
    if enable_cache:
        _plan_cache[cache_key] = _CachedPlan(local_plan, central_plan, metadata)
    return central_plan, metadata


class _EarlyStaging:
    """Staging this rank's items while the global plan is still being made.

    The global plan of DCP's default planner only assigns the rank's file prefix and may
    drop replicated items another rank writes; the items themselves come from the local
    plan. So the copy (on the background stager, with the GIL released) can start right
    after the local plan and overlap the plan collectives. The copied bytes are held back
    from the writers (no STAGED yet) until the final plan is known: they are released
    when it has exactly the staged items under the same prefix; otherwise they are
    aborted unwritten and the final plan is staged (and the next save of that group
    stages after planning). A replicated model is so written once on the first save
    too, not once per rank.
    """

    def __init__(self, local_plan: SavePlan, writer: DaemonStorageWriter,
                 planner: SavePlanner, group: Group) -> None:
        self.plan = dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{group.rank}_"))
        self.key = _cache_key(group, planner)
        self.release = threading.Event()
        self.saves = writer.stage(self.plan, planner, zero_stall=True, hold=self.release)

    @staticmethod
    def worthwhile(planner: SavePlanner, group: Group) -> bool:
        """Whether this planner's final plan is predictable from the local one."""
        return (type(planner) is DefaultSavePlanner
                and not getattr(planner, "_enable_plan_caching", False)
                and _cache_key(group, planner) not in _plans_that_moved_items)

    def adopt(self, final_plan: SavePlan, zero_stall: bool) -> tuple | None:
        """The early saves, if they stage exactly ``final_plan``; else ``None`` (aborted)."""
        if (final_plan.storage_data != self.plan.storage_data
                or [i.index for i in final_plan.items] != [i.index for i in self.plan.items]):
            _plans_that_moved_items.add(self.key)
            return self._abort("early staging dropped: the global plan differs from the "
                               "local one (items deduplicated or moved to another rank); "
                               "the final plan is staged instead")
        self.release.set()
        if not zero_stall:
            try:
                for save in self.saves:
                    save.wait_staged()
            except CheckpointException as exc:
                # staged again, to fail exactly as a direct save does
                return self._abort(f"early staging failed ({exc}); the final plan is "
                                   "staged again to report the failure as a direct save does")
        return self.saves

    def _abort(self, reason: str) -> None:
        for save in self.saves:
            save.abort(reason)
        self.release.set()  # after the aborts: the held jobs see them and stop unwritten
        return None

    def drop(self, exc: BaseException) -> None:
        """Planning failed: the held saves must never be written."""
        self._abort(f"early staging dropped: planning the save failed "
                    f"({type(exc).__name__}: {exc})")


def _finalize(writer: DaemonStorageWriter, saves: tuple, plan: SavePlan,
              metadata: Metadata | None, group: Group) -> None:
    gathered = group.gather_to_coordinator(writer.write_results(saves, plan))
    error = None
    if group.is_coordinator:
        try:
            writer.finish(dataclasses.replace(metadata), gathered)
        except Exception as exc:  # every rank must learn that the commit failed
            error = f"committing {os.path.join(writer.path, METADATA_NAME)} failed: {exc}"
    error = group.broadcast_from_coordinator(error)
    if error:
        raise CheckpointException("checkpoint was written but not committed",
                                  {group.coordinator_global: error})


@collector_paused
def async_save(state_dict, checkpoint_id: str | os.PathLike, *, process_group=None,
               planner: SavePlanner | None = None, enable_cache: bool = False,
               zero_stall: bool = False) -> AsyncRequest:
    """Save ``state_dict`` as a DCP checkpoint through the daemon, asynchronously.

    Call on all ranks of ``process_group``. Blocks through planning and staging (or, with
    ``zero_stall``, through planning only); the daemon then writes while training goes
    on. Schedule the returned request on an :class:`~ckpt_client.AsyncCallsQueue`: its
    finalize step commits ``.metadata`` (by the coordinator, after every rank's files
    are durable).

    Parameters
    ----------
    state_dict : dict
        As for ``torch.distributed.checkpoint.save``.
    checkpoint_id : str or PathLike
        Checkpoint directory (must lie under one of the daemon's ``--root``).
    process_group : ProcessGroup, optional
        Group to save over (default: the default group, or none).
    planner : SavePlanner, optional
        Default: ``DefaultSavePlanner()``.
    enable_cache : bool
        Reuse the plan and global metadata of the previous save with the same structure:
        with the default planner the local plan is not made again (each item is fetched
        by the path recorded when it was planned), and the plan gather/scatter is
        skipped (one small all-reduce confirms every rank hit).
    zero_stall : bool
        Return once the save is planned and queued; the bytes are staged in the
        background, and the state must not change until ``wait_staged`` /
        ``AsyncCallsQueue.wait_for_staging`` returns (``guard_optimizer`` does that).

    Returns
    -------
    AsyncRequest
    """
    started = time.time()
    planner = planner or DefaultSavePlanner()
    writer = DaemonStorageWriter(checkpoint_id)
    group = Group(process_group)
    local_plan, reuse = _plan_or_reuse(state_dict, writer, planner, group, enable_cache)
    early = None
    if reuse is None and _EarlyStaging.worthwhile(planner, group):
        try:
            early = _EarlyStaging(local_plan, writer, planner, group)
        except (DaemonRequestError, DaemonUnavailableError):
            early = None  # the direct staging below meets (and reports) the same refusal
    try:
        central_plan, metadata = _global_plan(local_plan, writer, planner, group, enable_cache)
        final_plan = planner.finish_plan(central_plan)
    except BaseException as exc:
        if early is not None:
            early.drop(exc)
        raise
    planned = time.time()
    try:
        saves = early.adopt(final_plan, zero_stall) if early is not None else None
        sources = reuse.sources(final_plan, state_dict, planner) if reuse is not None else None
        saves = saves or writer.stage(final_plan, planner, zero_stall=zero_stall,
                                      sources=sources)
    except (DaemonRequestError, DaemonUnavailableError) as exc:
        if not group.distributed:
            raise
        # The other ranks are about to wait in the completion collective: report the
        # refusal there, as a failure every rank raises, instead of raising alone.
        saves = (RefusedSave(group.rank, str(exc)),)
    if writer.connection.tiered and not zero_stall:
        hand_over(writer, saves, final_plan, metadata, group)
    spans.note(saves, "planning", started, planned)
    spans.note(saves, "blocked in dcp.async_save", started, time.time())
    return AsyncRequest(daemon_saves=saves,
                        finalize_fns=[partial(_finalize, writer, saves, final_plan, metadata, group)])
