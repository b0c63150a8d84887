"""The serve loop's side of tiered saves: what is tiered, hand-over, commits, resuming.

Owns, per daemon with ``--stage-dir``:

- the decision that a save is tiered (a DCP or torch-format save to a checkpoint root;
  local-checkpoint parts are local already) and where its files are written locally;
- admission against the stage budget (``--stage-policy``: wait for flushes to free it,
  or refuse at once with ``stage_full``), through its
  :class:`ckptd.tiers.admission.StageAdmission`;
- each tiered request's flush, from the moment its local copy is durable (journal entry
  first) to the moment every file is durable at the target; then the local copy goes;
- the table of DCP commits (:class:`ckptd.tiers.commits.TierCommits`, which keeps them):
  it routes ``handover`` and ``commit_file`` there, tells it when a file lands at its
  target, and abandons the commits a failed save's files were needed by;
- resuming the journal's unfinished flushes and commits when the daemon starts.

The lifecycle still owns every request's phase: this service reports to it
(:meth:`ckptd.server.lifecycle.SaveLifecycle.flush_done`). Nothing here blocks on the
target; the flusher's workers do that.
"""

from __future__ import annotations

import logging
import os
import time

from ckptd import knobs
from ckptd.protocol import HandoverReply, SaveFormat
from ckptd.server.endpoint import Call
from ckptd.storage.previous import previous_name
from ckptd.tiers.copy import FlushFile
from ckptd.tiers.flusher import Flusher, FlushFailure, FlushJob
from ckptd.tiers.admission import StageAdmission
from ckptd.tiers.commits import TierCommits
from ckptd.tiers.retention import Retention
from ckptd.tiers.settle import Settlements
from ckptd.tiers.stage import StageDir

log = logging.getLogger(__name__)


class TierService:
    """Tiered saves of one daemon (see the module docstring).

    Parameters
    ----------
    daemon : ckptd.server.daemon.Daemon
        For the request table, the lifecycle, the roots and the incarnation.
    stage : StageDir
        The stage directory.
    policy : str
        ``wait`` or ``refuse``: what a save that does not fit the budget gets.
    keep_last : int or None
        ``--keep-last``: committed checkpoints kept per parent directory (None: all).
    """

    def __init__(self, daemon, stage: StageDir, policy: str, keep_last: int | None = None) -> None:
        if policy not in ("wait", "refuse"):
            raise ValueError(f"--stage-policy must be wait or refuse, not {policy!r}")
        self.daemon = daemon
        self.stage = stage
        self.flusher: Flusher | None = None
        self.settlements: Settlements | None = None  # with the flusher
        self.commits = TierCommits(self)
        # The request the admission creates takes the table's next id, hence its key.
        self.admission = StageAdmission(stage, policy,
                                        lambda: self.key_for(self.daemon.table.next_id))
        self.retention = None if keep_last is None else Retention(
            os.path.join(stage.path, "retention.json"), keep_last, self._in_flight)

    def start(self, context) -> None:
        """Create the flusher and resume what the journal holds."""
        self.flusher = Flusher(context, self.daemon.config.stall_timeout)
        self.settlements = Settlements(self.flusher)
        self._resume()

    # ------------------------------------------------------------------ admission
    def wants(self, fmt: str) -> bool:
        """Whether a save of this format is tiered."""
        return fmt in (SaveFormat.DCP, SaveFormat.TORCH)

    def key_for(self, request_id: int) -> str:
        """The stage key of this daemon's request ``request_id``."""
        return f"{self.daemon.incarnation}-{request_id}"

    def place(self, request):
        """``target path -> local path`` for a tiered request's writer jobs."""
        local_dir = self.stage.local_dir(request.stage_key)

        def local_path(target: str) -> str:
            relative = os.path.basename(target)
            return os.path.join(local_dir, relative)
        return local_path

    # ------------------------------------------------------------------ flushing a save
    def flush(self, request) -> None:
        """``request``'s local copy is durable: journal it, then copy it to its target."""
        key = request.stage_key
        targets = [self._target_of(request, w) for w in request.written]
        files = [FlushFile(w["path"], target, w["size"], w["crc32"],
                           record=not request.stock_files, previous=previous_name(target))
                 for w, target in zip(request.written, targets)]
        deadline = time.time() + knobs.FLUSH_DEADLINE.get()
        self.stage.record(key, {"kind": "save", "rank": request.rank, "format": request.format,
                                "target": request.path, "deadline": deadline,
                                "files": [f.to_json() for f in files]})
        request.flush = FlushJob(key, request.path, files, deadline,
                                 lambda job, failure: self._flushed(request, job, failure))
        log.info("request %d (rank %d) durable locally; flushing %d file(s), %d bytes to %s",
                 request.id, request.rank, len(files), request.flush.bytes_total, request.path)
        self.flusher.submit(request.flush)

    @staticmethod
    def _target_of(request, written: dict) -> str:
        if request.format == SaveFormat.TORCH:
            return request.path
        return os.path.join(request.path, os.path.basename(written["path"]))

    def _flushed(self, request, job: FlushJob, failure: FlushFailure | None) -> None:
        if failure is None:
            for entry, file in zip(request.written, job.files):
                entry["path"] = file.target  # where the file is now, for the poll reply
                entry["file_id"] = None
            self.settlements.done(job)
            self.stage.remove_local(job.key)
            self.stage.forget(job.key)
            self._release(job.key)
            self.commits.check(request.path)
            if self.retention is not None and request.format == SaveFormat.TORCH:
                self.retention.committed_one(request.path, "torch", [])
        self.daemon.saves.lifecycle.flush_done(request, failure)

    def discard(self, request) -> None:
        """A tiered save failed or was aborted: stop its flush, remove what it put at the
        target and its local copy, and abandon a commit that needs its files."""
        key = request.stage_key
        self.flusher.cancel(key)
        if request.flush is not None:  # its previous files back, its own ones gone
            self.settlements.failed(request.flush)
        targets = [self._target_of(request, w) for w in request.written]
        self.stage.remove_local(key)
        self.stage.forget(key)
        self._release(key)
        if request.format == SaveFormat.DCP:
            names = {os.path.basename(t) for t in targets} | {n for n, _ in request.files}
            self.commits.abandon_needing(request.path, names,
                                         f"a save it needs failed: {request.error}")

    def _release(self, key: str) -> None:
        if self.stage.release(key):
            self.admission.budget_freed()

    def _in_flight(self, path: str) -> bool:
        """Whether a save or a commit to checkpoint ``path`` is still under way."""
        return (self.commits.under_way_in(path)
                or any(r.path == path for r in self.daemon.table.in_flight()))

    # ------------------------------------------------------------------ commits
    def on_handover(self, call: Call, body, path: str) -> HandoverReply:
        """A coordinator hands over its checkpoint's commit (``handover``)."""
        return self.commits.on_handover(call, body, path)

    def on_commit_file(self, call: Call, path: str, data: bytes, stock: bool):
        """``commit_file`` on a tiered daemon (see :class:`TierCommits`)."""
        return self.commits.on_commit_file(call, path, data, stock)

    # ------------------------------------------------------------------ restart
    def _resume(self) -> None:
        entries = self.stage.entries()
        self.stage.sweep(set(entries))
        for key, entry in entries.items():
            try:
                if entry.get("kind") == "commit":
                    self.commits.resume(key, entry)
                else:
                    self._resume_save(key, entry)
            except (KeyError, TypeError, ValueError) as exc:
                log.error("journal entry %s is malformed (%s); not resumed", key, exc)
                self.stage.remove_local(key)
                self.stage.forget(key)

    def _resume_save(self, key: str, entry: dict) -> None:
        files = [FlushFile.from_json(f).recall_attempts() for f in entry["files"]]
        request = self.daemon.saves.resumed_request(key, entry, files)
        self.stage.reserve(key, sum(f.size for f in files))
        request.flush = FlushJob(key, request.path, files, float(entry["deadline"]),
                                 lambda job, failure: self._flushed(request, job, failure))
        log.info("resuming the flush of %s (rank %d, %d file(s)) from the journal",
                 request.path, request.rank, len(files))
        self.flusher.submit(request.flush)

    # ------------------------------------------------------------------ status
    def describe(self) -> dict:
        """The ``tier`` section of the status document."""
        return {"stage_dir": self.stage.path, "budget_bytes": self.stage.budget,
                "used_bytes": self.stage.used_bytes, "policy": self.admission.policy,
                "waiting_saves": len(self.admission.waiting),
                "flushes": len(self.flusher.jobs) if self.flusher else 0,
                "copies_running": self.flusher.running() if self.flusher else 0,
                "retries": self.flusher.retries if self.flusher else 0,
                "stalls": self.flusher.stalls if self.flusher else 0,
                "bytes_flushed": self.flusher.bytes_flushed if self.flusher else 0,
                "commits_pending": list(self.commits.pending),
                "commits_done": self.commits.committed_total}

    def close(self) -> None:
        """Stop copying (the journal keeps what is unfinished for the next daemon)."""
        self.admission.close()
        if self.flusher is not None:
            self.flusher.close()
