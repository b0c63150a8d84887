"""The save service: the client messages about saves, and the work each step needs.

Handlers (registered on the client endpoint): ``stage`` (build a request, reserve or queue
for staging space, or hand CUDA handles to the stager), ``copied`` (the trainer's copy got
that far: writers may start), ``staged`` (the trainer's copy is in), ``poll`` (:class:`ckptd.server.held_polls.PollAnswers`: at once, or once a request
it names changes phase), ``forget``, ``abort``, and ``commit_file`` / ``handover`` (a checkpoint's
commit, by :class:`ckptd.server.file_commits.FileCommits`). It also implements
:class:`ckptd.server.lifecycle.SaveEffects`: answering a queued STAGE, handing a staged
request to :class:`ckptd.server.save_writes.SaveWrites` (its writer jobs, their results,
the files it replaced, removing what a failed save wrote) and its device copy to
:class:`ckptd.server.device_copies.DeviceCopies`.

Phases and extents are the lifecycle's; files are the writers' and :class:`SaveWrites`';
replication is the local service's; what a STAGE becomes is built by
:mod:`ckptd.server.new_requests`. This module owns the requests' admission and the replies
to trainers.
"""

from __future__ import annotations

import logging
import time

from ckptd.protocol import (Abort, AbortReply, CommitFile, Copied, Empty, ErrorCode, Forget,
                            ForgetReply, Handover, Phase, Poll, SaveFormat, Stage, Staged,
                            StagedReply, StageReply)
from ckptd.server.device_copies import DeviceCopies
from ckptd.server.endpoint import DEFERRED, Call, RequestError
from ckptd.server.file_commits import FileCommits
from ckptd.server.held_polls import PollAnswers
from ckptd.server.lifecycle import CLIENT_COPY, DEVICE_COPY, SaveLifecycle
from ckptd.server.new_requests import (copiers_of, named_by, request_from_journal,
                                       request_from_stage)
from ckptd.server.ranks import RankRegistry
from ckptd.server.requests import RequestTable, SaveRequest
from ckptd.server.save_writes import SaveWrites
from ckptd.staging.pool import PoolTooSmallError
from ckptd.storage.roots import AllowedRoots

log = logging.getLogger(__name__)


def _copy_ended(request: SaveRequest, copied_at: float | None) -> float | None:
    """When the trainer's copy ended, by its own clock reading (the node's clock), kept
    between the space's grant and now: a clock reading is only trusted that far."""
    if copied_at is None:
        return None
    return max(request.granted_at or request.created_at, min(copied_at, time.time()))


def _take_late_skeleton(request: SaveRequest, skeleton: bytes | None,
                        lifecycle: SaveLifecycle) -> None:
    """A torch save's skeleton that came with STAGED: its STAGE was sent before the
    trainer had walked its state dict.

    Raises
    ------
    RequestError
        BAD_REQUEST: a skeleton for another format, or a torch save that still has none
        (its STAGE was sent ahead without one and so was its STAGED). No writer could
        write that one's file: it is failed here (its extent freed, the trainer's copy
        being over) rather than by its writer with an unpack error.
    """
    if skeleton is not None and request.format != SaveFormat.TORCH:
        raise RequestError(ErrorCode.BAD_REQUEST, f"request {request.id} is a "
                           f"{request.format} save: only torch saves have a skeleton")
    if skeleton is not None:
        request.skeleton = skeleton
    if request.format == SaveFormat.TORCH and not request.skeleton:
        refused = RequestError(ErrorCode.BAD_REQUEST,
                               f"request {request.id} ({request.path}) is a torch save with "
                               "no skeleton: its STAGE carried none, so its STAGED must (a "
                               "client bug: send the state dict's skeleton with STAGED)")
        lifecycle.fail(request, refused.message, code=refused.code)
        raise refused


def _staged_reply(request: SaveRequest) -> StagedReply:
    """Every byte is staged; ``ipc_kept``: buffers whose CUDA export the daemon holds
    open, which the trainer may send again (it exports the others afresh)."""
    return StagedReply(request_id=request.id, phase=request.phase,
                       ipc_kept=list(request.ipc_kept))


def _extent_reply(request: SaveRequest) -> StageReply:
    """A STAGE's answer: the request and the extent it was leased."""
    return StageReply(request_id=request.id, offset=request.extent.offset,
                      length=request.extent.length, phase=request.phase,
                      placements=request.placements)


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
        self.writes: SaveWrites | None = None
        self.commits = FileCommits(daemon)
        self.polls = PollAnswers(self.table)

    def start(self) -> None:
        """Bind to the staging pool and the CUDA stager (created at daemon start)."""
        self.lifecycle = SaveLifecycle(self.daemon.pool, self.table, self)
        self.device = DeviceCopies(self.daemon.cuda, self.ranks, self.table, self.lifecycle)
        self.writes = SaveWrites(self.daemon, self.lifecycle)
        # SaveEffects that are SaveWrites' own: a stopped save's files and writer jobs
        self.remove_outputs, self.cancel_writes = self.writes.remove_outputs, self.writes.cancel

    def cancel_device_copy(self, request: SaveRequest) -> None:
        """An aborted or failed save's device copy: stop it, or release its handles."""
        self.device.cancel(request)

    def routes(self) -> dict:
        """Message body type -> handler, for the client endpoint."""
        return {Stage: self.on_stage, Copied: self.on_copied, Staged: self.on_staged,
                Poll: self.polls.on_poll,
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
            return tier.admission.admit(call, body, self._stage_now, refused=lambda: (
                self.device.release_unopened(body.cuda, call.routing_id)))
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
        if not self.writes.goes_ahead(request):
            return _extent_reply(request)
        call.reply(_extent_reply(request))  # the trainer copies while the writers get ready
        self.writes.write_ahead(request)
        return DEFERRED

    def _admit(self, call: Call, body: Stage) -> SaveRequest:
        rank = self.ranks.of(call.routing_id)
        if self.daemon.stopping:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "ckptd is shutting down",
                               "the save was not started; retry once a daemon is running")
        request = request_from_stage(self.daemon, rank, body)
        # A save's deadlines count from its STAGE's arrival (a tiered one may have waited
        # for the stage budget before it became a request).
        request.created_at = call.received_at
        request.stage_message = call.msg_id  # what an ABORT names if the reply never came
        copiers = copiers_of(request)
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

    def _own_request(self, routing_id: bytes, request_id) -> SaveRequest:
        request = self.table.find(request_id)  # forgotten, yet holding its extent for a copy
        if request is None or request.routing_id != routing_id:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST,
                               f"no request {request_id!r} of this connection is known",
                               "was the daemon restarted? save again")
        return request

    def on_staged(self, call: Call, body: Staged):
        """The trainer copied its buffers in; answered once every byte is staged (a device
        copy of the same request may still be running), or the save failed."""
        request = self._own_request(call.routing_id, body.request_id)
        _take_late_skeleton(request, body.skeleton, self.lifecycle)
        if request.finished:  # e.g. its device copy failed before our STAGED arrived
            if request.lease is not None and request.lease.has(CLIENT_COPY):
                self.lifecycle.copied(request, CLIENT_COPY)  # its copy is over: free it
            raise RequestError(request.failure_code,
                               request.error or f"request {request.id} was {request.phase}",
                               "the save did not happen; save again")
        if request.phase not in (Phase.STAGING, Phase.WRITING, Phase.REPLICATING):
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
                    self.lifecycle.copied(request, CLIENT_COPY,
                                          ended_at=_copy_ended(request, body.copied_at))
                except Exception as exc:
                    self.lifecycle.fail(request, f"starting its writers failed: "
                                                 f"{type(exc).__name__}: {exc}")
                    raise
                return DEFERRED
            self.lifecycle.copied(request, CLIENT_COPY,
                                  ended_at=_copy_ended(request, body.copied_at))
        if request.phase == Phase.STAGING:  # the device copy answers it (staged())
            request.pending_reply = call
            return DEFERRED
        return _staged_reply(request)

    def on_copied(self, call: Call, body: Copied) -> Empty:
        """The trainer's copy got to ``body.through`` (:meth:`SaveWrites.copied`); it does
        not wait for this answer."""
        self.writes.copied(self._own_request(call.routing_id, body.request_id), body)
        return Empty()

    def on_forget(self, call: Call, body: Forget) -> ForgetReply:
        """Drop finished requests (and the files of failed ones, when asked)."""
        forgotten = []
        for request_id in body.request_ids:
            request = self.table.get(request_id)
            if request is None or request.routing_id != call.routing_id or not request.finished:
                continue
            if request.jobs:  # stopped while writing: what they write goes when they answer
                request.forget_when_written = True
                forgotten.append(request_id)
                continue
            if body.delete_files:
                self.remove_outputs(request)
            self.table.forget(request_id)
            forgotten.append(request_id)
        return ForgetReply(forgotten=forgotten)

    def on_abort(self, call: Call, body: Abort) -> AbortReply:
        """Drop in-flight requests of this connection (:func:`named_by`)."""
        self.ranks.of(call.routing_id)
        aborted = []
        for request in self.table.of_connection(call.routing_id):
            if named_by(body, request):
                self.lifecycle.abort(request, f"dropped by the trainer: {body.reason}", body.copying)
                aborted.append(request.id)
        if body.stages and self.daemon.tier is not None:  # not requests yet: still waiting
            self.daemon.tier.admission.drop(call.routing_id, set(body.stages))
        return AbortReply(aborted=aborted)

    # ------------------------------------------------------------------ ranks that leave
    def abort_connection(self, routing_id: bytes, reason: str, only_unstaged: bool = False) -> None:
        """Abort a connection's in-flight saves (all, or those not staged yet).

        A tiered save whose bytes are staged was handed over: the daemon finishes it and
        its target sees it whole, trainer or no trainer.
        """
        if self.daemon.tier is not None:  # its STAGEs still waiting for the stage budget
            self.daemon.tier.admission.drop_connection(routing_id, reason)
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
            call.reply(_extent_reply(request))
        self.writes.write_ahead(request)

    def staged(self, request: SaveRequest) -> None:
        """Every byte is in the extent: answer a STAGED that waited for the device copy."""
        call, request.pending_reply = request.pending_reply, None
        if call is not None:
            call.reply(_staged_reply(request))

    def write(self, request: SaveRequest) -> int:
        """Submit a staged request's writer jobs (:class:`SaveWrites`)."""
        return self.writes.write(request)

    def replicate(self, request: SaveRequest) -> list[str]:
        """Local parts stream to their holders while they are written."""
        return self.daemon.local.start_replication(request)

    def cancel_replication(self, request: SaveRequest) -> None:
        """Stop an aborted local part's pushes."""
        self.daemon.local.cancel_replication(request)

    def flush(self, request: SaveRequest) -> None:
        """A tiered save is durable locally: hand it to the flusher."""
        self.daemon.tier.flush(request)

    def phase_changed(self, request: SaveRequest) -> None:
        """The polls held on ``request`` are answered once this round's steps are over."""
        self.polls.held.changed(request.id)

    def resumed_request(self, key: str, entry: dict, files: list) -> SaveRequest:
        """A tiered save a previous daemon left in the journal, flushing again."""
        return request_from_journal(self.table, key, entry, files)
