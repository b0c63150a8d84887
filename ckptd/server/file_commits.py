"""Commits of whole checkpoints: ``commit_file`` and, on a tiered daemon, ``handover``.

``commit_file`` writes one small file (DCP ``.metadata``) atomically through a writer and
answers once it is durable, or fails it at the whole-save deadline; on a daemon with
``--stage-dir`` the tier service commits it instead, at the target, once every file it
names is there. ``handover`` gives a tiered daemon a DCP checkpoint's commit at staging
time (see :mod:`ckptd.tiers.service`). No save request, extent or phase is involved.

A commit failed at its deadline may still land: its writer is replaced, but a rename it had
begun (held by a hung target) completes when the target answers. So the file a commit
replaces is kept aside (:mod:`ckptd.storage.previous`), and once the given-up writer has
exited the old file is put back, or a file that appeared where there was none is removed
(:class:`CommitReplaces`).
"""

from __future__ import annotations

import logging
import os
import time

from ckptd import knobs
from ckptd.protocol import CommitFile, CommitFileReply, ErrorCode, Handover, HandoverReply
from ckptd.server.endpoint import DEFERRED, Call, RequestError
from ckptd.storage.durable import remove_written
from ckptd.storage.jobs import WriteBytes, WriteJob, WriteResult
from ckptd.storage.previous import drop_previous, previous_name, restore_previous
from ckptd.storage.roots import PathRefusedError

log = logging.getLogger(__name__)


class CommitReplaces:
    """The file one commit replaces: kept aside while the commit is written, dropped once
    it is durable, put back if it fails; if its writer is given up as stuck, only once that
    process has exited (:meth:`given_up`), when no late rename of it can land any more.

    Parameters
    ----------
    path : str
        The file the commit writes (checked already).
    """

    def __init__(self, path: str) -> None:
        self.path, self.previous = path, previous_name(path)
        # Read before any writer touches the path: whether something there could be kept.
        self.existed = os.path.lexists(path)
        self.stuck = False

    def done(self, ok: bool) -> None:
        """The writer answered (or the commit failed at its deadline)."""
        if self.stuck:  # its writer may still rename: wait for it to exit
            return
        if ok:
            drop_previous(self.previous)
        else:
            restore_previous(self.path, self.previous, None)

    def given_up(self, job: WriteJob, pid: int):
        """``job``'s writer (``pid``) was given up as stuck: returns what to do once it has
        exited. The writer pool keeps the path busy until then, so no later commit of it
        can be undone here."""
        self.stuck = True

        def exited() -> None:
            if restore_previous(self.path, self.previous, None):
                log.warning("the failed commit of %s landed after its writer (pid %d) was "
                            "given up; the previous file is back", self.path, pid)
            elif not self.existed and os.path.lexists(self.path):
                remove_written(self.path)
                log.warning("the failed commit of %s landed after its writer (pid %d) was "
                            "given up; removed it", self.path, pid)
        return exited


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

        replaces = CommitReplaces(path)

        def answer_when_durable(job: WriteJob, result: WriteResult) -> None:
            replaces.done(result.ok)
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
        job = WriteJob(WriteBytes(path, len(data), stock=body.stock_files,
                                  previous=replaces.previous), answer_when_durable,
                       frames=[data], on_stuck=replaces.given_up)
        # The commit is a save's last step: the whole-save deadline bounds it, however
        # slowly its write progresses (the stall check only sees no progress at all).
        limit = knobs.SAVE_DEADLINE.get()
        job.deadline = time.monotonic() + limit
        job.deadline_of = f"{limit:g}s ({knobs.SAVE_DEADLINE.env})"
        self.daemon.writers.submit(job)
        return DEFERRED
