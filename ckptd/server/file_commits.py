"""Commits of whole checkpoints: ``commit_file`` and, on a tiered daemon, ``handover``.

``commit_file`` writes one small file (DCP ``.metadata``) atomically through a writer and
answers once it is durable, or fails it at the whole-save deadline (the writer pool then
makes sure the file never lands); on a daemon with ``--stage-dir`` the tier service commits it
instead, at the target, once every file it names is there. ``handover`` gives a tiered
daemon a DCP checkpoint's commit at staging time (see :mod:`ckptd.tiers.service`). No
save request, extent or phase is involved.
"""

from __future__ import annotations

import logging
import time

from ckptd import knobs
from ckptd.protocol import CommitFile, CommitFileReply, ErrorCode, Handover, HandoverReply
from ckptd.server.endpoint import DEFERRED, Call, RequestError
from ckptd.storage.jobs import WriteBytes, WriteJob, WriteResult
from ckptd.storage.roots import PathRefusedError

log = logging.getLogger(__name__)


class FileCommits:
    """The ``commit_file`` and ``handover`` handlers.

    Parameters
    ----------
    daemon : ckptd.server.daemon.Daemon
        For the ranks, the allowed roots, the writers and the tier service.
    """

    def __init__(self, daemon) -> None:
        self.daemon = daemon

    def _checked_path(self, call: Call, path: str) -> tuple:
        rank = self.daemon.ranks.of(call.routing_id)
        try:
            path = self.daemon.roots.check(path)
        except PathRefusedError as exc:
            raise RequestError(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
        if len(call.frames) != 1:
            raise RequestError(ErrorCode.BAD_REQUEST, "this message needs exactly one payload "
                               "frame (the file's bytes)")
        return rank, path

    def on_handover(self, call: Call, body: Handover) -> HandoverReply:
        """A tiered DCP save's commit, given at staging time."""
        _, path = self._checked_path(call, body.path)
        if self.daemon.tier is None:
            raise RequestError(ErrorCode.NOT_CONFIGURED, "this daemon has no --stage-dir",
                               "commit with commit_file at finalize instead")
        return self.daemon.tier.on_handover(call, body, path)

    def on_commit_file(self, call: Call, body: CommitFile):
        """Write one small file atomically; answer once it is durable."""
        rank, path = self._checked_path(call, body.path)
        if self.daemon.tier is not None:  # the flusher writes it, once its files are there
            return self.daemon.tier.on_commit_file(call, path, bytes(call.frames[0]),
                                                   body.stock_files)

        def answer_when_durable(job: WriteJob, result: WriteResult) -> None:
            if result.ok:
                log.info("committed %s for rank %d", path, rank.rank)
                table = self.daemon.table
                table.timeline.add_file_commit(
                    path, job.writer, result.started_at, result.synced_at or result.started_at,
                    result.started_at + result.seconds)
                table.phases.observe("commit", result.seconds)
                call.reply(CommitFileReply(path=path, size=result.size))
            else:
                call.fail(ErrorCode.WRITE_FAILED, f"could not write {path}: {result.error}",
                          "check free space and permissions of the checkpoint directory",
                          errno=result.errno, path=path)

        data = bytes(call.frames[0])
        job = WriteJob(WriteBytes(path, len(data), stock=body.stock_files), answer_when_durable,
                       frames=[data])
        # The commit is a save's last step: the whole-save deadline bounds it, however
        # slowly its write progresses (the stall check only sees no progress at all).
        limit = knobs.SAVE_DEADLINE.get()
        job.deadline = time.monotonic() + limit
        job.deadline_of = f"{limit:g}s ({knobs.SAVE_DEADLINE.env})"
        self.daemon.writers.submit(job)
        return DEFERRED
