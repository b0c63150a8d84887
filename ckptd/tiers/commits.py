"""The commits of tiered DCP checkpoints: each ``.metadata``, waiting for its files.

Owns :class:`PendingCommit` and the table of commits in flight and recently finished. A
commit is handed to the coordinator's daemon at staging time (``handover``) or asked for
at finalize (``commit_file``); it is written at the target only once every file it names
is durable there with its checksum record, whichever node flushed it, and never after a
save of this daemon that it depends on has failed. The flusher does the copying;
:class:`ckptd.tiers.service.TierService` owns this table and tells it when files land.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptd import knobs
from ckptd.checksum import Checksum
from ckptd.protocol import CommitFileReply, ErrorCode, HandoverReply
from ckptd.server.endpoint import Call
from ckptd.storage.durable import write_small_file
from ckptd.storage.previous import previous_name
from ckptd.tiers.copy import FlushFile
from ckptd.tiers.flusher import FlushFailure, FlushJob
from ckptd.tiers.stage import commit_key

log = logging.getLogger(__name__)

METADATA_NAME = ".metadata"
#: Finished commits remembered, so a late ``commit_file`` learns their outcome.
_RECENT_COMMITS = 64


@dataclass
class PendingCommit:
    """A DCP checkpoint's ``.metadata``, waiting for the files it names."""

    key: str
    path: str             # the .metadata's final path at the target
    files: list           # names inside the checkpoint directory
    record: bool          # files carry checksum records (not torch's exact files)
    local: str            # its bytes, durable in the stage directory
    size: int
    crc32: int
    deadline: float
    waiters: list = field(default_factory=list)  # commit_file calls owed an answer
    outcome: str = "pending"                     # pending, committed, failed
    error: str | None = None
    errno: int | None = None
    job: FlushJob | None = None  # its flush (to settle the .metadata it replaces)
    #: Where the .metadata saved before into this directory is kept until this commit
    #: ends (a copy held in its rename lands after a deadline gave it up). Journaled: a
    #: resumed commit finds the link its earlier daemon made, and keeps nothing else.
    previous: str = ""

    @property
    def directory(self) -> str:
        """The checkpoint directory."""
        return os.path.dirname(self.path)

    def answer(self) -> None:
        """Answer every ``commit_file`` waiting for this commit."""
        waiters, self.waiters = self.waiters, []
        for call in waiters:
            answer_commit(call, self)

    def to_journal(self) -> dict:
        """Its journal entry."""
        return {"kind": "commit", "path": self.path, "files": self.files,
                "record": self.record, "local": self.local, "size": self.size,
                "crc32": self.crc32, "deadline": self.deadline, "previous": self.previous}


def answer_commit(call: Call, commit: PendingCommit) -> None:
    """The reply ``commit_file`` gets for a finished commit."""
    if commit.outcome == "committed":
        call.reply(CommitFileReply(path=commit.path, size=commit.size))
    else:
        call.fail(ErrorCode.WRITE_FAILED, f"could not commit {commit.path}: {commit.error}",
                  "the checkpoint is not committed; earlier checkpoints are intact",
                  errno=commit.errno, path=commit.path)


class TierCommits:
    """The commits of one tiered daemon, pending and recently finished.

    Parameters
    ----------
    tier : TierService
        For the stage directory, the flusher and retention (the flusher exists once the
        service has started).
    """

    def __init__(self, tier) -> None:
        self.tier = tier
        self.pending: dict[str, PendingCommit] = {}
        self.recent: OrderedDict[str, PendingCommit] = OrderedDict()
        self.committed_total = 0

    def on_handover(self, call: Call, body, path: str) -> HandoverReply:
        """A coordinator hands over its checkpoint's commit (``handover``)."""
        metadata_path = os.path.join(path, METADATA_NAME)
        commit = self._new(metadata_path, bytes(call.frames[0]), list(body.files),
                           not body.stock_files)
        log.info("commit of %s handed over: %d file(s) to wait for", path, len(commit.files))
        return HandoverReply(path=metadata_path, files=len(commit.files))

    def on_commit_file(self, call: Call, path: str, data: bytes, stock: bool):
        """``commit_file`` on a tiered daemon: the handed-over commit's outcome, or a new
        commit of files already flushed (stock ``dcp.save``, whose writes waited)."""
        from ckptd.server.endpoint import DEFERRED

        commit = self.pending.get(path) or self.recent.get(path)
        if commit is None:
            commit = self._new(path, data, [], not stock)
        if commit.outcome == "pending":
            commit.waiters.append(call)
            return DEFERRED
        answer_commit(call, commit)
        return DEFERRED

    def _new(self, path: str, data: bytes, files: list, record: bool) -> PendingCommit:
        previous = self.pending.get(path)
        if previous is not None:  # a new save into the same directory: the old commit is void
            self.end(previous, "superseded by a newer save to the same path", None)
        self.recent.pop(path, None)
        key = commit_key(path)
        local = os.path.join(self.tier.stage.local_dir(key), METADATA_NAME)
        write_small_file(local, data, checksum=True)
        checksum = Checksum.from_json(open(local + ".ckptd-sum").read())
        commit = PendingCommit(key, path, files, record, local, checksum.size, checksum.value,
                               time.time() + knobs.FLUSH_DEADLINE.get(),
                               previous=previous_name(path))
        self.tier.stage.record(key, commit.to_journal())
        self._start(commit)
        return commit

    def _start(self, commit: PendingCommit, resumed: bool = False) -> None:
        self.pending[commit.path] = commit
        requires = [(os.path.join(commit.directory, name), commit.record)
                    for name in commit.files]
        file = FlushFile(commit.local, commit.path, commit.size, commit.crc32, commit.record,
                         previous=commit.previous)
        if resumed:
            file.recall_attempts()
        job = FlushJob(commit.key, commit.directory, [file], commit.deadline,
                       lambda job, failure: self._committed(commit, failure),
                       requires=requires)
        commit.job = job
        self.tier.flusher.submit(job)

    def check(self, directory: str) -> None:
        """A file of ``directory`` reached its target: a commit may be complete now."""
        flusher = self.tier.flusher
        for commit in self.pending.values():
            if commit.directory == directory:
                job = flusher.jobs.get(commit.key)
                if job is not None:
                    for state in job.states:
                        if state.task is None and not state.done:
                            state.retry_at = 0.0
        flusher.tick()

    def _committed(self, commit: PendingCommit, failure: FlushFailure | None) -> None:
        if failure is None:
            commit.outcome = "committed"
            self.committed_total += 1
            log.info("committed %s (%d file(s) durable at the target)", commit.path,
                     len(commit.files))
            self._forget(commit)
            if self.tier.retention is not None:
                self.tier.retention.committed_one(commit.directory, "dcp", commit.files)
        else:
            self.end(commit, failure.message, failure.errno)

    def end(self, commit: PendingCommit, reason: str, errno: int | None) -> None:
        """Give a commit up: it will never be written."""
        if commit.outcome != "pending":
            return
        self.tier.flusher.cancel(commit.key)
        commit.outcome, commit.error, commit.errno = "failed", reason, errno
        log.error("commit of %s abandoned: %s", commit.path, reason)
        self._forget(commit)

    def abandon_needing(self, directory: str, names: set, reason: str) -> None:
        """A save of ``directory`` failed: give up every commit that names its files."""
        for commit in list(self.pending.values()):
            if commit.directory == directory and names & set(commit.files):
                self.end(commit, reason, None)

    def _forget(self, commit: PendingCommit) -> None:
        self.pending.pop(commit.path, None)
        if commit.outcome == "committed":
            self.tier.settlements.done(commit.job)
        else:
            self.tier.settlements.failed(commit.job)
        self.tier.stage.remove_local(commit.key)
        self.tier.stage.forget(commit.key)
        self.recent[commit.path] = commit
        while len(self.recent) > _RECENT_COMMITS:
            self.recent.popitem(last=False)
        commit.answer()

    def under_way_in(self, path: str) -> bool:
        """Whether a commit of checkpoint directory ``path`` is pending."""
        return any(c.directory == path for c in self.pending.values())

    def resume(self, key: str, entry: dict) -> None:
        """Start again a commit the journal holds (the daemon restarted)."""
        commit = PendingCommit(key, entry["path"], list(entry["files"]), bool(entry["record"]),
                               entry["local"], int(entry["size"]), int(entry["crc32"]),
                               float(entry["deadline"]),
                               # an entry written before the name was journaled: a new one
                               previous=str(entry.get("previous")
                                            or previous_name(entry["path"])))
        log.info("resuming the commit of %s from the journal", commit.path)
        self._start(commit, resumed=True)
