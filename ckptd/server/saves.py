"""The save service: the client messages about saves, and the work each step needs.

Handlers (registered on the client endpoint): ``stage`` (build a request, reserve or queue
for staging space, or hand CUDA handles to the stager), ``staged`` (the trainer's copy is
in), ``poll``, ``forget``, ``abort``, and ``commit_file`` / ``handover`` (a checkpoint's
commit, by :class:`ckptd.server.file_commits.FileCommits`). It also implements
:class:`ckptd.server.lifecycle.SaveEffects`: answering a queued STAGE, turning a staged
request into writer jobs, removing what a failed save wrote (putting back the files it
replaced, :mod:`ckptd.storage.previous`), and feeding writer results and device-copy
results back to the lifecycle.

Phases and extents are the lifecycle's; files are the writers'; replication is the local
service's. This module decides *what* to write for each save format.
"""

from __future__ import annotations

import logging
import os

from ckptd import protocol
from ckptd.protocol import (Abort, AbortReply, CommitFile, ErrorCode, Forget, ForgetReply,
                            Handover, Phase, Poll, PollReply, RequestState, SaveFormat, Stage,
                            Staged, StagedReply, StageReply)
from ckptd.server.endpoint import DEFERRED, Call, RequestError
from ckptd.server.file_commits import FileCommits
from ckptd.server.local_parts import clear_gaps, part_ranges
from ckptd.server.lifecycle import CLIENT_COPY, DEVICE_COPY, SaveLifecycle
from ckptd.server.ranks import RankInfo, RankRegistry
from ckptd.server.requests import RequestTable, SaveRequest
from ckptd.staging.pool import PoolTooSmallError
from ckptd.storage.durable import remove_written
from ckptd.storage.previous import drop_previous, previous_name, restore_previous
from ckptd.storage.layout import check_prediction, predict_placements
from ckptd.storage.jobs import WriteItems, WriteJob, WriteResult, WriteTorch
from ckptd.storage.roots import AllowedRoots, PathRefusedError

log = logging.getLogger(__name__)


class SaveService:
    """Save requests from reservation to durable files (see the module docstring).

    Parameters
    ----------
    daemon : ckptd.server.daemon.Daemon
        For the shared components: pool, writers, CUDA stager, local service, ranks.
    """

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.table: RequestTable = daemon.table
        self.ranks: RankRegistry = daemon.ranks
        self.roots: AllowedRoots = daemon.roots
        self.lifecycle: SaveLifecycle | None = None  # made once the pool exists (start)
        self.device: DeviceCopies | None = None
        self.commits = FileCommits(daemon)
        #: How the writers last wrote a checkpoint file under each root (or the local
        #: directory): "direct" or "buffered: <why>", for ``ckptd status``.
        self.write_modes: dict[str, str] = {}

    def start(self) -> None:
        """Bind to the staging pool and the CUDA stager (created at daemon start)."""
        self.lifecycle = SaveLifecycle(self.daemon.pool, self.table, self)
        self.device = DeviceCopies(self.daemon.cuda, self.ranks, self.table, self.lifecycle)

    def cancel_device_copy(self, request: SaveRequest) -> None:
        """An aborted or failed save's device copy: stop it, or release its handles."""
        self.device.cancel(request)

    def routes(self) -> dict:
        """Message body type -> handler, for the client endpoint."""
        return {Stage: self.on_stage, Staged: self.on_staged, Poll: self.on_poll,
                Forget: self.on_forget, Abort: self.on_abort,
                CommitFile: self.commits.on_commit_file, Handover: self.commits.on_handover}

    # ------------------------------------------------------------------ handlers
    def on_stage(self, call: Call, body: Stage):
        """Reserve staging space (or queue for it, back-pressure) and start filling it.

        The trainer copies its CPU buffers into the extent it is answered with; buffers
        described by a CUDA IPC spec are copied by the daemon's stager (mixed transport:
        one request, both copiers), starting as soon as the extent is leased. A tiered
        save first gets room in the stage directory's budget (or waits, or is refused).
        """
        tier = self.daemon.tier
        if tier is not None and tier.wants(body.format):
            self.ranks.of(call.routing_id)  # an unregistered caller is refused before it waits
            return tier.admit(call, body, self._stage_now)
        return self._stage_now(call, body)

    def _stage_now(self, call: Call, body: Stage):
        try:
            request = self._admit(call, body)
        except RequestError:
            self.device.release_unopened(body.cuda, call.routing_id)
            raise
        if request.phase == Phase.WAITING_FOR_POOL:
            request.pending_reply = call
            return DEFERRED
        self.device.start(request)
        log.info("request %d (rank %d) staging %d bytes for %s (%s)", request.id, request.rank,
                 request.bytes_total, request.path, request.transport_summary())
        return self._extent_reply(request)

    def _admit(self, call: Call, body: Stage) -> SaveRequest:
        rank = self.ranks.of(call.routing_id)
        if self.daemon.stopping:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "ckptd is shutting down",
                               "the save was not started; retry once a daemon is running")
        request = self._new_request(rank, body)
        # A save's deadlines count from its STAGE's arrival (a tiered one may have waited
        # for the stage budget before it became a request).
        request.created_at = call.received_at
        copiers = self._copiers_of(request)
        if DEVICE_COPY in copiers:
            self.device.check(rank.rank)
        try:
            self.lifecycle.admit(request, copiers)
        except PoolTooSmallError as exc:
            raise RequestError(ErrorCode.POOL_TOO_SMALL, f"rank {rank.rank}: {exc}",
                               "Otherwise save fewer bytes per rank at once: a DCP save larger "
                               "than the pool streams through it in chunks, but one torch.save "
                               "file or local part must fit whole") from None
        self.daemon.note_busy()
        return request

    @staticmethod
    def _copiers_of(request: SaveRequest) -> tuple[str, ...]:
        """Who fills the extent: the trainer (buffers without a spec; also an empty
        save, which the trainer confirms), the CUDA stager (buffers with one), or both."""
        specs = request.cuda_specs or [None] * len(request.buffers)
        device = any(spec is not None for spec in specs)
        client = any(spec is None for spec in specs) or not specs
        return ((CLIENT_COPY,) if client else ()) + ((DEVICE_COPY,) if device else ())

    def _new_request(self, rank: RankInfo, body: Stage) -> SaveRequest:
        try:
            if body.format == SaveFormat.LOCAL:  # the store names the part: session, iteration, rank
                path = self.daemon.local.part_path_for(rank.rank, body.session, body.iteration)
            else:
                path = self.roots.check(body.path)
        except PathRefusedError as exc:
            raise RequestError(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
        offsets, length = protocol.layout_extent([b[2] for b in body.buffers])
        request_id = self.table.new_id()
        tier = self.daemon.tier
        tiered = tier is not None and tier.wants(body.format)
        request = SaveRequest(
            id=request_id, stage_key=tier.key_for(request_id) if tiered else None,
            rank=rank.rank, routing_id=rank.routing_id, format=body.format,
            path=path, buffers=body.buffers, offsets=offsets, extent_length=length,
            skeleton=body.skeleton, files=body.files if body.format == SaveFormat.DCP else [],
            cuda_specs=body.cuda, session=body.session, iteration=body.iteration,
            stock_files=body.format == SaveFormat.DCP and body.stock_files,
            trainer_pid=rank.pid,
            near=self.daemon.placement.near(body.cuda, rank.pid))
        if tiered and body.format == SaveFormat.DCP:
            # Known now, so the coordinator can hand its commit over at staging time.
            request.placements = predict_placements(body.buffers, body.files,
                                                    request.stock_files)
        return request

    @staticmethod
    def _extent_reply(request: SaveRequest) -> StageReply:
        return StageReply(request_id=request.id, offset=request.extent.offset,
                          length=request.extent.length, phase=request.phase,
                          placements=request.placements)

    def _own_request(self, routing_id: bytes, request_id) -> SaveRequest:
        request = self.table.get(request_id)
        if request is None or request.routing_id != routing_id:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST,
                               f"no request {request_id!r} of this connection is known",
                               "was the daemon restarted? save again")
        return request

    def on_staged(self, call: Call, body: Staged):
        """The trainer copied its buffers in; answered once every byte is staged (a device
        copy of the same request may still be running), or the save failed."""
        request = self._own_request(call.routing_id, body.request_id)
        if request.finished:  # e.g. its device copy failed before our STAGED arrived
            if request.lease is not None and request.lease.has(CLIENT_COPY):
                self.lifecycle.copied(request, CLIENT_COPY)  # its copy is over: free it
            raise RequestError(request.failure_code,
                               request.error or f"request {request.id} was {request.phase}",
                               "the save did not happen; save again")
        if request.phase != Phase.STAGING and request.phase != Phase.WRITING \
                and request.phase != Phase.REPLICATING:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"request {request.id} is {request.phase}, not staging")
        if request.lease.has(CLIENT_COPY):
            if request.phase == Phase.STAGING and request.lease.holds == {CLIENT_COPY}:
                # The trainer's copy was the last one: every byte is in the extent now.
                # It is answered before the writers are set up (a job per file, the
                # format's layout), which the trainer need not wait for; a failure there
                # fails the request, and the trainer learns it from its next poll.
                call.reply(StagedReply(request_id=request.id, phase=Phase.WRITING,
                                       ipc_kept=list(request.ipc_kept)))
                try:
                    self.lifecycle.copied(request, CLIENT_COPY)
                except Exception as exc:
                    self.lifecycle.fail(request, f"starting its writers failed: "
                                                 f"{type(exc).__name__}: {exc}")
                    raise
                return DEFERRED
            self.lifecycle.copied(request, CLIENT_COPY)
        if request.phase == Phase.STAGING:  # the device copy answers it (staged())
            request.pending_reply = call
            return DEFERRED
        return self._staged_reply(request)

    @staticmethod
    def _staged_reply(request: SaveRequest) -> StagedReply:
        """Every byte is staged; ``ipc_kept``: buffers whose CUDA export the daemon holds
        open, which the trainer may send again (it exports the others afresh)."""
        return StagedReply(request_id=request.id, phase=request.phase,
                           ipc_kept=list(request.ipc_kept))

    def on_poll(self, call: Call, body: Poll) -> PollReply:
        """Phase and results of this connection's requests."""
        return PollReply(requests={rid: self._poll_entry(call.routing_id, rid)
                                   for rid in body.request_ids})

    def _poll_entry(self, routing_id: bytes, request_id: int) -> RequestState:
        request = self.table.get(request_id)
        if request is None or request.routing_id != routing_id:  # never another client's
            return RequestState(phase="unknown", error=f"ckptd (pid {os.getpid()}) has no "
                                f"request {request_id}; the daemon that took it is gone")
        return request.poll_entry()

    def on_forget(self, call: Call, body: Forget) -> ForgetReply:
        """Drop finished requests (and the files of failed ones, when asked)."""
        forgotten = []
        for request_id in body.request_ids:
            request = self.table.get(request_id)
            if request is None or request.routing_id != call.routing_id or not request.finished:
                continue
            if body.delete_files:
                self.remove_outputs(request)
            self.table.forget(request_id)
            forgotten.append(request_id)
        return ForgetReply(forgotten=forgotten)

    def on_abort(self, call: Call, body: Abort) -> AbortReply:
        """Drop in-flight requests of this connection."""
        self.ranks.of(call.routing_id)
        aborted = []
        for request in self.table.of_connection(call.routing_id):
            if body.request_ids is None or request.id in body.request_ids:
                self.lifecycle.abort(request, f"dropped by the trainer: {body.reason}")
                aborted.append(request.id)
        return AbortReply(aborted=aborted)

    # ------------------------------------------------------------------ ranks that leave
    def abort_connection(self, routing_id: bytes, reason: str, only_unstaged: bool = False) -> None:
        """Abort a connection's in-flight saves (all, or those not staged yet).

        A tiered save whose bytes are staged was handed over: the daemon finishes it and
        its target sees it whole, trainer or no trainer.
        """
        for request in self.table.holding_space():
            if request.routing_id == routing_id and request.finished:  # a failed save may
                # still hold its extent for the trainer's copy (a staging deadline)
                self.lifecycle.trainer_gone(request)
        for request in self.table.of_connection(routing_id):
            unstaged = request.phase in (Phase.STAGING, Phase.WAITING_FOR_POOL)
            if request.tiered and not unstaged:
                log.info("request %d (rank %d, %s) continues without its trainer: it was "
                         "handed over", request.id, request.rank, request.path)
                continue
            if not only_unstaged or unstaged:
                self.lifecycle.abort(request, reason)

    def abandon_all(self, reason: str) -> None:
        """Fail every in-flight save (shutdown after the drain timeout)."""
        for request in self.table.in_flight():
            if request.phase == Phase.FLUSHING:  # its journal entry resumes it next start
                log.warning("request %d (rank %d, %s) is left to the next daemon: its flush "
                            "is in the stage directory's journal", request.id, request.rank,
                            request.path)
                continue
            log.warning("request %d (rank %d, %s) abandoned at shutdown in phase %s",
                        request.id, request.rank, request.path, request.phase)
            self.lifecycle.fail(request, reason)

    # ------------------------------------------------------------------ SaveEffects
    def space_granted(self, request: SaveRequest) -> None:
        """A queued request got its extent: answer its STAGE, start its device copy."""
        call, request.pending_reply = request.pending_reply, None
        self.device.start(request)
        if call is not None:
            call.reply(self._extent_reply(request))

    def staged(self, request: SaveRequest) -> None:
        """Every byte is in the extent: answer a STAGED that waited for the device copy."""
        call, request.pending_reply = request.pending_reply, None
        if call is not None:
            call.reply(self._staged_reply(request))

    def write(self, request: SaveRequest) -> int:
        """Submit a staged request's writer jobs; returns how many (a tiered save's files
        are written into the stage directory)."""
        place = self.daemon.tier.place(request) if request.tiered else None
        keep = None if request.tiered else lambda path: request.previous.setdefault(
            path, previous_name(path))  # a tiered save's local copy replaces nothing
        ranges = None
        if request.format == SaveFormat.LOCAL:
            clear_gaps(self.daemon.pool, request)
            ranges = part_ranges(self.daemon.pool, request)
        jobs = list(jobs_for(request, self._job_done(request), place, keep, ranges))
        request.jobs = list(jobs)
        for job in jobs:
            job.on_stuck = lambda job, pid: self.lifecycle.writer_stuck(request, pid)
            self.daemon.writers.submit(job)
        return len(jobs)

    def replicate(self, request: SaveRequest) -> list[str]:
        """Local parts stream to their holders while they are written."""
        return self.daemon.local.start_replication(request)

    def cancel_replication(self, request: SaveRequest) -> None:
        """Stop an aborted local part's pushes."""
        self.daemon.local.cancel_replication(request)

    def remove_outputs(self, request: SaveRequest) -> None:
        """Delete what a failed or aborted save wrote (for a tiered save: also at the
        target, and the commits that needed it are abandoned)."""
        if request.tiered:
            self.daemon.tier.discard(request)
        for entry in request.written:
            previous = request.previous.pop(entry["path"], None)
            if previous is not None:  # the file it replaced goes back (a later one stays)
                restore_previous(entry["path"], previous, entry.get("file_id"))
            remove_written(entry["path"], entry.get("file_id"))
        request.written = []
        self.drop_kept_files(request)  # what it kept of files it never replaced

    def drop_kept_files(self, request: SaveRequest) -> None:
        """Drop what a save kept of the files it replaced (it is done, or they are back),
        except for files still being written: their writers answer later."""
        writing = {job.path for job in request.jobs}
        for path in [p for p in request.previous if p not in writing]:
            drop_previous(request.previous.pop(path))

    def flush(self, request: SaveRequest) -> None:
        """A tiered save is durable locally: hand it to the flusher."""
        self.daemon.tier.flush(request)

    def resumed_request(self, key: str, entry: dict, files: list) -> SaveRequest:
        """A tiered save a previous daemon left in the journal, flushing again."""
        total = sum(f.size for f in files)
        request = SaveRequest(
            id=self.table.new_id(), rank=int(entry["rank"]), routing_id=b"",
            format=str(entry["format"]), path=str(entry["target"]),
            buffers=[["bytes", [total], total]], offsets=[0], extent_length=0,
            phase=Phase.FLUSHING, stage_key=key)
        request.written = [{"name": os.path.basename(f.target), "path": f.local,
                            "size": f.size, "crc32": f.crc32} for f in files]
        request.staged_at = request.created_at
        self.table.add(request)
        return request

    def _job_done(self, request: SaveRequest):
        def on_done(job: WriteJob, result: WriteResult) -> None:
            request.jobs = [j for j in request.jobs if j is not job]
            written = None
            wrong = check_prediction(request.placements, getattr(job.body, "name", None),
                                     result.items) if result.ok else None
            if wrong is not None:
                log.error("request %d (rank %d): %s", request.id, request.rank, wrong)
                result = WriteResult(ok=False, path=result.path, error=wrong)
            if result.ok and result.write_mode:
                self._note_write_mode(result.path, result.write_mode)
            if result.ok:
                written = {"name": getattr(job.body, "name", None), "path": result.path,
                           "size": result.size, "crc32": result.crc32,
                           "algorithm": result.algorithm, "items": result.items,
                           "file_id": result.file_id,
                           "timing": {"writer": job.writer, "started_at": result.started_at,
                                      "synced_at": result.synced_at or result.started_at,
                                      "ended_at": result.started_at + result.seconds}}
            if not result.ok and job.path in request.previous:  # renamed, then failed or died?
                # Put the old file back now, while no later save of the path can have begun.
                restore_previous(job.path, request.previous.pop(job.path), None)
            self.lifecycle.job_done(request, result.path or job.path, result.ok, written,
                                    job.nbytes, result.error, result.errno)
            if request.phase == Phase.DONE:
                self.drop_kept_files(request)
        return on_done

    def _note_write_mode(self, path: str, mode: str) -> None:
        local_dir = self.daemon.config.local_dir
        roots = AllowedRoots.of([*self.roots.roots, *([local_dir] if local_dir else [])])
        root = roots.root_of(os.path.realpath(path))
        if root is not None:
            self.write_modes[root] = mode


def jobs_for(request: SaveRequest, on_done, place=None, keep=None, part_ranges=None):
    """The writer jobs of a staged request: what each save format writes, and where
    (``place(target path) -> path written``: a tiered save's local copy; ``keep(path) ->
    name``: where the writer keeps the file it replaces, :mod:`ckptd.storage.previous`;
    ``part_ranges``: the pool ranges of a local part,
    :func:`ckptd.server.local_parts.part_ranges`)."""
    base = request.extent.offset
    place = place or (lambda path: path)
    keep = keep or (lambda path: "")

    def item(index: int) -> list:
        dtype, shape, nbytes = request.buffers[index]
        return [base + request.offsets[index], nbytes, dtype, shape]

    if request.format == SaveFormat.LOCAL:  # a part is raw pool ranges, header included
        items = [[offset, nbytes, "bytes", [nbytes]] for offset, nbytes in part_ranges]
        yield WriteJob(WriteItems(request.path, os.path.basename(request.path), items,
                                  request.bytes_total), on_done)
    elif request.format == SaveFormat.TORCH:
        yield WriteJob(WriteTorch(place(request.path), request.skeleton,
                                  [item(i) for i in range(len(request.buffers))],
                                  request.bytes_total, previous=keep(request.path)), on_done)
    else:
        for name, indices in request.files:
            path = os.path.join(request.path, name)
            yield WriteJob(WriteItems(place(path), name, [item(i) for i in indices],
                                      sum(request.buffers[i][2] for i in indices),
                                      stock=request.stock_files, previous=keep(path)), on_done)


class DeviceCopies:
    """The save service's hand-over to the CUDA stager (``None`` on a node without CUDA).

    Owns nothing of a request: it starts a request's device copy once the lifecycle
    leased its extent, cancels it (or releases never-opened handles) when the save ends
    early, and reports results to the lifecycle, which alone decides the phase.
    """

    def __init__(self, cuda, ranks: RankRegistry, table: RequestTable,
                 lifecycle: SaveLifecycle) -> None:
        self.cuda, self.ranks, self.table, self.lifecycle = cuda, ranks, table, lifecycle

    def check(self, rank: int) -> None:
        """Refuse CUDA handles on a daemon without a device."""
        if self.cuda is None:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"rank {rank}: this daemon has no CUDA device",
                               "send CPU copies through the staging pool instead")

    def release_unopened(self, specs: list | None, routing_id: bytes) -> None:
        """Handles of a refused request: handed over, never to be opened."""
        if specs and self.cuda is not None:
            self.cuda.release(specs, self._pid(routing_id))

    def _pid(self, routing_id: bytes) -> int | None:
        try:
            return self.ranks.of(routing_id).pid
        except RequestError:  # never registered: nothing of it can be held open
            return None

    def start(self, request: SaveRequest) -> None:
        """Queue the request's device-to-host copy into its leased extent."""
        if DEVICE_COPY not in request.copiers:
            return
        from ckptd.staging.cuda import CudaJob

        rank = self.ranks.of(request.routing_id)
        self.cuda.submit(CudaJob(request.id, request.extent.offset, request.offsets,
                                 request.buffers, request.cuda_specs, rank.pid))

    def cancel(self, request: SaveRequest) -> None:
        """Stop the copy of a save that ended early, or release its handles if queued."""
        if self.cuda is None:
            return
        if request.lease is None:  # still queued for space: its copy never started
            self.cuda.release(request.cuda_specs, self._pid(request.routing_id))
        else:
            self.cuda.cancel(request.id)

    def on_copied(self, result) -> None:
        """A :class:`ckptd.staging.cuda.CudaStaged` arrived from the stager."""
        request = self.table.find(result.request_id)
        if request is not None:
            request.ipc_kept = list(result.kept)
            self.lifecycle.copied(request, DEVICE_COPY, result.error, result.code)
