"""A writer job as a file to write, and the jobs a writer holds until their bytes are staged.

Owns two things of a writer process (:mod:`ckptd.storage.writer_process`):

- :class:`FileJob`: what a job's handler makes of it (the path, how the file is written,
  how large it will be), run once its bytes are in the pool. Its file can be *made ready*
  before that (:meth:`FileJob.make_ready`: the temporary created, its space allocated),
  which is what a job sent ahead does while the trainer still copies: those steps took
  5-10 ms a file after "staged" here (``fallocate`` of a GiB-sized file on ext4 alone
  3-10 ms), and the disk stood idle meanwhile.
- :class:`ParkedJobs`: the jobs sent ahead, ready and waiting for their ``start`` (or a
  cancel: their temporary is removed, nothing of them stays).

A torch file's job sent ahead may lack its skeleton (the trainer sends it with STAGED):
its size is guessed from the last file of the same tensors (exact while the structure
holds: only the skeleton's values change) and corrected before the first write.

No sockets, no torch.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptd.storage.durable import FileWrite

log = logging.getLogger(__name__)


@dataclass
class FileJob:
    """One file a writer job writes (see the module docstring).

    Attributes
    ----------
    path : str
        The final name.
    body : callable or None
        ``body(stream)`` writes the file's bytes; None while a torch file waits for its
        skeleton (then ``complete(skeleton) -> (size, body)`` makes it).
    checksum, direct : bool
        As for :class:`ckptd.storage.durable.FileWrite`.
    size : int
        Bytes allocated before the first write (a guess while ``body`` is None).
    extra : dict
        More of the job's result, filled as the file is written (an items file's placements).
    """

    path: str
    body: Callable[[Any], Any] | None
    checksum: bool = True
    direct: bool = False
    size: int = 0
    complete: Callable[[bytes], tuple[int, Callable[[Any], Any]]] | None = None
    extra: dict = field(default_factory=dict)
    file: FileWrite | None = None

    def make_ready(self) -> None:
        """Create the temporary and allocate its space now, ahead of the bytes. Not where
        the directory does not exist yet (a save aborted while staging must leave no new
        directory either), nor where it fails: the file is then made when the job runs,
        and any error is the job's there."""
        if not os.path.isdir(os.path.dirname(self.path) or "."):
            return
        try:
            self.file = FileWrite(self.path, self.checksum, self.direct, self.size)
        except OSError as exc:
            log.debug("could not make %s ready ahead (%s): made when its job runs", self.path, exc)

    def run(self, skeleton: bytes, progress: Callable[[str, int], None]) -> dict:
        """Write and commit the file (``skeleton``: a torch file's, if its job had none);
        returns :meth:`FileWrite.run`'s result and :attr:`extra`."""
        try:
            if self.body is None:
                if not skeleton or self.complete is None:
                    raise ValueError(f"the job for {self.path} was sent without its skeleton "
                                     "and started without one (a daemon bug)")
                self.size, self.body = self.complete(skeleton)
                if self.file is not None:
                    self.file.reserve(self.size)
            file, self.file = self.file, None
            if file is None:
                file = FileWrite(self.path, self.checksum, self.direct, self.size)
        except BaseException:
            self.discard()
            raise
        return {**file.run(self.body, progress), **self.extra}

    def discard(self) -> None:
        """Remove the temporary made ahead, if any."""
        if self.file is not None:
            self.file.discard()
            self.file = None


@dataclass
class Prepared:
    """A job message decoded and its file made (ready, if sent ahead), or why not."""

    msg: Any                        # the job's protocol.Message
    job: Any = None                 # its decoded body
    file: FileJob | None = None
    error: BaseException | None = None  # raised when it runs: its result says it then

    @property
    def path(self) -> str | None:
        """The file's path, as far as the message tells it."""
        path = self.msg.body.get("path") if isinstance(self.msg.body, dict) else None
        return path if isinstance(path, str) else None

    def discard(self) -> None:
        """Nothing of it stays (after a run: nothing to do)."""
        if self.file is not None:
            self.file.discard()


class ParkedJobs:
    """The jobs a writer was sent ahead, by job id, waiting for their start or cancel."""

    def __init__(self) -> None:
        self._jobs: dict[int, Prepared] = {}
        self._dropped: deque[int] = deque(maxlen=256)  # answered when dropped, recent first

    def answered(self, job_id: int) -> bool:
        """Whether job ``job_id`` was parked here and dropped (answered then)."""
        return job_id in self._dropped

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def ids(self) -> list[int]:
        """The ids of the jobs waiting."""
        return list(self._jobs)

    def park(self, job_id: int, prepared: Prepared) -> None:
        """Hold ``prepared`` until :meth:`take` or :meth:`drop`."""
        self._jobs[job_id] = prepared

    def take(self, job_id: int) -> Prepared | None:
        """The job to run now (None: it was dropped already)."""
        return self._jobs.pop(job_id, None)

    def drop(self, job_id: int) -> Prepared | None:
        """Remove the job and its temporary (its save stopped); returns it."""
        prepared = self._jobs.pop(job_id, None)
        if prepared is not None:
            prepared.discard()
            self._dropped.appendleft(job_id)
        return prepared

    def drop_all(self) -> None:
        """The writer exits: no temporary of a job never started stays."""
        for job_id in list(self._jobs):
            self.drop(job_id)
