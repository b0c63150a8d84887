"""A save's files: its writer jobs, their results, the files it replaced, and removal.

Owns what each save format writes and where (:func:`jobs_for`), submitting those jobs to
the writers (*ahead*, as soon as a save's staging begins, where its files are known then:
:meth:`SaveWrites.write_ahead`; the writers make the files ready while the trainer copies,
start writing what it reports copied, :meth:`SaveWrites.copied`, and finish once the save
is staged), turning each writer result into a ``written`` entry for the lifecycle, the
files a save replaced while it runs (kept under :mod:`ckptd.storage.previous` names:
put back when the save fails, dropped once it is done), deleting what a failed or aborted
save wrote, and how the writers last wrote under each root (``write_modes``, for
``ckptd status``). Phases are the lifecycle's; it must not answer trainers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from ckptd import knobs
from ckptd.protocol import Copied, ErrorCode, Phase, SaveFormat
from ckptd.server.endpoint import RequestError
from ckptd.server.lifecycle import DEVICE_COPY, SaveLifecycle
from ckptd.server.local_parts import clear_gaps, part_ranges
from ckptd.server.requests import SaveRequest
from ckptd.storage.durable import remove_written
from ckptd.storage.jobs import WriteItems, WriteJob, WriteResult, WriteTorch
from ckptd.storage.layout import check_prediction
from ckptd.storage.previous import drop_previous, previous_name, restore_previous
from ckptd.storage.roots import AllowedRoots

log = logging.getLogger(__name__)


class SaveWrites:
    """The files of save requests (see the module docstring).

    Parameters
    ----------
    daemon : ckptd.server.daemon.Daemon
        For the pool, the writers, the tier service, the allowed roots and the config.
    lifecycle : SaveLifecycle
        Told each writer result (it alone decides the phase).
    """

    def __init__(self, daemon, lifecycle: SaveLifecycle) -> None:
        self.daemon = daemon
        self.lifecycle = lifecycle
        #: How the writers last wrote a checkpoint file under each root (or the local
        #: directory): "direct" or "buffered: <why>", for ``ckptd status``.
        self.write_modes: dict[str, str] = {}
        #: The jobs sent ahead of each request still staging: (all of them, those whose
        #: writer has not answered). A held job is answered only if its save stopped or
        #: its writer died; then the save writes its files afresh once staged.
        self._ahead: dict[int, tuple[list[WriteJob], list[WriteJob]]] = {}

    @staticmethod
    def goes_ahead(request: SaveRequest) -> bool:
        """Whether ``request``'s writer jobs are sent when its staging begins: its files
        are known then (not a local part, whose header the daemon completes once staged,
        nor a tiered save, placed in the stage directory once staged)."""
        return (knobs.WRITE_AHEAD.get() and not request.tiered
                and request.format in (SaveFormat.TORCH, SaveFormat.DCP))

    def write_ahead(self, request: SaveRequest) -> None:
        """Send the writer jobs of a request whose staging just began, held
        (:meth:`ckptd.storage.writer_pool.WriterPool.start` releases them in :meth:`write`)."""
        if not self.goes_ahead(request) or request.id in self._ahead:
            return
        finished = self._job_done(request)
        jobs: list[WriteJob] = []
        alive: list[WriteJob] = []

        def on_done(job: WriteJob, result: WriteResult) -> None:
            if not job.held:
                finished(job, result)
            elif job in alive:  # answered while held: stopped, or its writer died
                alive.remove(job)

        keep = lambda path: request.previous.setdefault(path, previous_name(path))  # noqa: E731
        try:
            for job in jobs_for(request, on_done, keep=keep):
                job.held = True
                jobs.append(job)
        except Exception:  # never fatal here: its jobs are made again once it is staged
            log.exception("request %d (rank %d): its writer jobs could not be sent ahead",
                          request.id, request.rank)
            return
        alive.extend(jobs)
        self._ahead[request.id] = (jobs, alive)
        try:
            for job in jobs:
                self.daemon.writers.submit(job)
        except Exception:  # as above; a job never submitted must not be "started" later
            log.exception("request %d (rank %d): its writer jobs could not be sent ahead",
                          request.id, request.rank)
            self.drop_ahead(request)

    def copied(self, request: SaveRequest, body: Copied) -> None:
        """The trainer's copy into ``request``'s extent got to ``body.through``: the jobs
        sent ahead write up to there while it copies the rest.

        At the first report they are started (if every one is still parked at its writer,
        a torch file's skeleton is known and every file's directory exists: an aborted
        save must leave no new directory), each writer told how far the copy got; later
        reports raise that. A writer writes what is copied, waits for the rest, and
        renames nothing before :meth:`write` says all is staged. From the start the
        writers hold the extent and are the request's pending jobs (``writing_early``):
        an abort, failure or deadline cancels them as after staging.

        Raises
        ------
        RequestError
            BAD_REQUEST: a point past the extent, or a skeleton for a save of another format.
        """
        if body.skeleton is not None and request.format != SaveFormat.TORCH:
            raise RequestError(ErrorCode.BAD_REQUEST, f"request {request.id} is a "
                               f"{request.format} save: only torch saves have a skeleton")
        if request.phase != Phase.STAGING or DEVICE_COPY in request.copiers:
            return  # a late report (the save ended or is staged) is no news
        if body.through > request.extent.length:
            raise RequestError(ErrorCode.BAD_REQUEST, f"request {request.id}: copied up to "
                               f"byte {body.through} of a {request.bytes_total}-byte save")
        if body.skeleton:
            request.skeleton = body.skeleton
        through = request.extent.offset + body.through
        if request.written_early:  # each job keeps how far it was told (WriteJob.through)
            for job in request.jobs:
                if through > (job.through or 0):
                    self.daemon.writers.staged_through(job, through)
            return
        jobs, alive = self._ahead.get(request.id, ([], []))
        if (not jobs or len(alive) < len(jobs) or not all(map(self.daemon.writers.parked, jobs))
                or (request.format == SaveFormat.TORCH and not request.skeleton)
                or not all(os.path.isdir(os.path.dirname(job.path)) for job in jobs)):
            return
        request.written_early = True
        self._start_jobs(request, jobs, through)
        self.lifecycle.writing_early(request, len(jobs))

    def _start_jobs(self, request: SaveRequest, jobs: list[WriteJob],
                    through: int | None = None) -> None:
        request.jobs = list(jobs)
        for job in jobs:
            job.on_stuck = lambda job, pid: self._given_up(request, job, pid)
            skeleton = request.format == SaveFormat.TORCH and not job.body.skeleton
            self.daemon.writers.start(job, replace(job.body, skeleton=request.skeleton)
                                      if skeleton else None, through)

    def _start_ahead(self, request: SaveRequest) -> int | None:
        """Start the jobs sent ahead of ``request`` (None: none were, or not all of them
        are still waiting: those are dropped and the files written afresh); those started
        early (:meth:`copied`) hear that every byte is staged."""
        jobs, alive = self._ahead.pop(request.id, ([], []))
        if request.written_early:
            for job in request.jobs:  # those not answered yet
                self.daemon.writers.staged_through(job, None)
            return len(request.jobs)
        if not jobs or len(alive) < len(jobs):
            for job in alive:
                self.daemon.writers.cancel(job)
            return None
        self._start_jobs(request, jobs)
        return len(jobs)

    def drop_ahead(self, request: SaveRequest) -> None:
        """``request`` stopped before it was staged: its writers drop the jobs sent ahead
        (each removes the temporary it made ready)."""
        for job in self._ahead.pop(request.id, ([], []))[1]:
            if not job.cancelled:
                self.daemon.writers.cancel(job)

    def write(self, request: SaveRequest) -> int:
        """Submit a staged request's writer jobs (start those sent ahead); returns how
        many (a tiered save's files are written into the stage directory)."""
        started = self._start_ahead(request)
        if started is not None:
            return started
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
            job.on_stuck = lambda job, pid: self._given_up(request, job, pid)
            self.daemon.writers.submit(job)
        return len(jobs)

    def _given_up(self, request: SaveRequest, job: WriteJob, pid: int):
        """``job``'s writer was given up as stuck (and SIGKILLed): returns what to do once
        the process has really exited.

        The file the job replaces is put back only then, not when the save fails: a call
        the writer made before the kill (the rename of its file or of its checksum record,
        held by a hung target) is still in the kernel and lands when the target answers.
        Put back earlier, the old file would be replaced again by that late rename (or
        left with the failed save's record beside it); and on a target that holds the
        rename, the directory stays locked meanwhile, so putting it back would block the
        serve loop instead of telling the ranks. Once the process is gone no call of it
        can land any more, and the writer pool keeps the path busy until then, so no
        later save of the path can be undone by it.
        """
        release = self.lifecycle.writer_stuck(request, pid)
        previous = request.previous.pop(job.path, None)
        if previous is None:
            return release

        def exited() -> None:
            restore_previous(job.path, previous, None)
            release()
        return exited

    def cancel(self, request: SaveRequest) -> None:
        """A stopped save's writer jobs not answered yet: their files must not be renamed
        into place (those renamed already are removed when their results come)."""
        self.drop_ahead(request)
        for job in request.jobs:
            self.daemon.writers.cancel(job)

    def remove_outputs(self, request: SaveRequest) -> None:
        """Delete what a failed or aborted save wrote (for a tiered save: also at the
        target, and the commits that needed it are abandoned)."""
        self.drop_ahead(request)
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
        roots = AllowedRoots.of([*self.daemon.roots.roots, *([local_dir] if local_dir else [])])
        root = roots.root_of(os.path.realpath(path))
        if root is not None:
            self.write_modes[root] = mode


def jobs_for(request: SaveRequest, on_done, place=None, keep=None, part_ranges=None):
    """The writer jobs of a staged request: what each save format writes, and where
    (``place(target path) -> path written``: a tiered save's local copy; ``keep(path) ->
    name``: where the writer keeps the file it replaces, :mod:`ckptd.storage.previous`;
    ``part_ranges``: the pool ranges of a local part,
    :func:`ckptd.server.local_parts.part_ranges`)."""
    place = place or (lambda path: path)
    keep = keep or (lambda path: "")
    if request.format == SaveFormat.LOCAL:  # a part is raw pool ranges, header included
        items = [[offset, nbytes, "bytes", [nbytes]] for offset, nbytes in part_ranges]
        yield WriteJob(WriteItems(request.path, os.path.basename(request.path), items,
                                  request.bytes_total), on_done)
        return
    # One comprehension over every buffer (thousands, on every save), no call per item.
    base = request.extent.offset
    items = [[base + offset, nbytes, dtype, shape]
             for offset, (dtype, shape, nbytes) in zip(request.offsets, request.buffers)]
    if request.format == SaveFormat.TORCH:
        yield WriteJob(WriteTorch(place(request.path), request.skeleton, items,
                                  request.bytes_total, previous=keep(request.path)), on_done)
    else:
        for name, indices in request.files:
            path = os.path.join(request.path, name)
            mine = [items[i] for i in indices]
            yield WriteJob(WriteItems(place(path), name, mine, sum(item[1] for item in mine),
                                      stock=request.stock_files, previous=keep(path)), on_done)
