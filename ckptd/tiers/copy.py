"""One file copied from the stage directory to its target, on a worker thread.

Owns :class:`FlushFile` (a local copy and where it goes) and :class:`CopyTask` (one
attempt at copying it). An attempt streams the local file in chunks (never the whole
file in memory) into a fresh hidden temporary at the target, checksumming what it writes;
it commits (fsync, checksum record, rename, directory fsync) only when the bytes written
match the checksum the local write recorded, so a local copy damaged after it was written
never reaches the target's final name. Before it renames, an attempt notes its file's id
beside the local copy (durable), so a daemon resuming the flush after a crash knows that
file at the target as this save's own. Progress (bytes, time of the last completed write)
is published for the flusher's stall watchdog; a task the flusher abandons stops at its
next chunk and discards its temporary, and one stuck in a ``write`` or ``fsync`` that
never returns is simply left behind (the retry uses another temporary name).

Also owns the classification of copy errors: :data:`FAIL_FAST_ERRNOS` end the save at
once (retrying cannot help), everything else is retried until the flush deadline.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
import time
from dataclasses import dataclass, field

from ckptd import knobs
from ckptd.checksum import (ALGORITHM, Checksum, ChecksumMismatchError, read_sidecar,
                            sidecar_path)
from ckptd.storage.directories import fsync_directory
from ckptd.storage.durable import DurableFile
from ckptd.storage.previous import drop_previous, keep_aside

#: A full, over-quota, read-only or forbidden target does not heal by itself in minutes.
FAIL_FAST_ERRNOS = frozenset({errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EROFS,
                              errno_mod.EACCES, errno_mod.EPERM})


@dataclass
class FlushFile:
    """A durable local copy and the target it goes to.

    Attributes
    ----------
    local : str
        The file in the stage directory.
    target : str
        Its final name at the target.
    size, crc32 : int
        As the local write recorded them.
    record : bool
        Write a checksum record beside it at the target (not for torch's exact files).
    previous : str
        Where the file it replaces at the target is kept until its save is over
        (:mod:`ckptd.tiers.settle`); "" keeps nothing.
    kept : bool or None
        Whether something was kept there (None: no attempt of this daemon got that far).
    earlier : list
        ``[st_dev, st_ino]`` of each file an earlier daemon's attempts may have renamed
        onto the target (a flush resumed from the journal, :meth:`recall_attempts`).
    """

    local: str
    target: str
    size: int
    crc32: int
    record: bool = True
    previous: str = ""
    kept: bool | None = None
    #: One attempt decides what is kept: a later one could find an earlier one's new
    #: file at the target already and must not keep that as the previous file.
    keeping: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    earlier: list = field(default_factory=list, compare=False)

    @property
    def attempts_log(self) -> str:
        """Beside the local copy: the file id of every attempt that may rename, one a line."""
        return self.local + ".ckptd-attempts"

    def note_attempt(self, file_id: list) -> None:
        """Make ``file_id`` durable in :attr:`attempts_log` before its attempt renames (on
        the worker thread): a daemon killed after the rename leaves its successor no other
        way to tell this save's file at the target from a later save's. A save whose local
        directory is gone (it was given up) raises ``FileNotFoundError``: it never renames."""
        new = not os.path.exists(self.attempts_log)
        fd = os.open(self.attempts_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, f"{file_id[0]} {file_id[1]}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            fsync_directory(os.path.dirname(self.attempts_log))

    def recall_attempts(self) -> "FlushFile":
        """Learn the file ids an earlier daemon's attempts noted (a resumed flush); a line
        torn by its crash is skipped (its attempt had not renamed yet)."""
        try:
            with open(self.attempts_log) as noted:
                lines = noted.read().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            fields = line.split()
            if len(fields) == 2 and all(f.isdigit() for f in fields):
                self.earlier.append([int(fields[0]), int(fields[1])])
        return self

    def to_json(self) -> dict:
        """For the journal."""
        return {"local": self.local, "target": self.target, "size": self.size,
                "crc32": self.crc32, "record": self.record, "previous": self.previous}

    @classmethod
    def from_json(cls, doc: dict) -> "FlushFile":
        """From the journal."""
        # The same previous name: a resumed attempt finds the link the last daemon made
        # (keep_aside's EEXIST) and keeps it, instead of keeping a file it renamed there.
        return cls(str(doc["local"]), str(doc["target"]), int(doc["size"]),
                   int(doc["crc32"]), bool(doc.get("record", True)),
                   str(doc.get("previous", "")))


class CopyError(OSError):
    """A copy failed; ``fail_fast`` says whether retrying is pointless."""

    def __init__(self, errno: int | None, message: str, path: str, fail_fast: bool) -> None:
        super().__init__(errno, message, path)
        self.fail_fast = fail_fast


class Abandoned(Exception):
    """The flusher gave up on this attempt (a stall, or the save ended)."""


class NotYet(Exception):
    """A commit's files are not all durable at the target yet (other nodes still flush)."""


def errno_name(number: int | None) -> str:
    """``ENOSPC`` for 28; ``?`` when there is none."""
    return errno_mod.errorcode.get(number or 0, "?")


class CopyTask:
    """One attempt at copying ``file`` to its target (run :meth:`run` on a worker thread).

    Attributes written by the worker, read by the flusher: ``bytes_done``,
    ``last_progress`` (monotonic time of the last completed write or step), ``done``.
    ``abandoned`` is written by the flusher only.
    """

    def __init__(self, file: FlushFile, attempt: int, requires: list | None = None) -> None:
        self.file = file
        self.attempt = attempt
        self.requires = requires or []  # (path, record): durable at the target first
        self.bytes_done = 0
        self.last_progress = time.monotonic()
        self.abandoned = False
        self.done = False
        self.thread: threading.Thread | None = None
        #: ``[st_dev, st_ino]`` of its temporary: the file at the target if it renamed.
        self.file_id: list | None = None

    def start(self, on_finished) -> None:
        """Run on a new daemon thread; ``on_finished(task, error)`` is called from it."""
        def run() -> None:
            error = None
            try:
                self.run()
            except (CopyError, Abandoned, NotYet) as exc:
                error = exc
            except OSError as exc:
                error = CopyError(exc.errno, exc.strerror or str(exc),
                                  exc.filename or self.file.target,
                                  exc.errno in FAIL_FAST_ERRNOS)
            except Exception as exc:  # a bug must still end the attempt, as a retry
                error = CopyError(None, f"{type(exc).__name__}: {exc}", self.file.target, False)
            self.done = True
            on_finished(self, error)

        self.thread = threading.Thread(target=run, daemon=True,
                                       name=f"ckptd-flush-{os.path.basename(self.file.target)}")
        self.thread.start()

    def _progress(self, nbytes: int = 0) -> None:
        if self.abandoned:
            raise Abandoned(self.file.target)
        self.bytes_done += nbytes
        self.last_progress = time.monotonic()

    def run(self) -> None:
        """Copy, verify, commit. Raises :class:`CopyError`, :class:`Abandoned` or
        :class:`NotYet`."""
        missing = [path for path, record in self.requires
                   if not present_at_target(path, record)]
        if missing:
            raise NotYet(f"{len(missing)} file(s) not durable at the target yet, e.g. "
                         f"{missing[0]}")
        self._progress()
        expected = self._expected()
        self._keep_previous()
        chunk = bytearray(knobs.FLUSH_CHUNK_BYTES.get())
        view = memoryview(chunk)
        with open(self.file.local, "rb", buffering=0) as source:
            with DurableFile(self.file.target, checksum=self.file.record,
                             algorithm=expected.algorithm) as durable:
                info = os.fstat(durable.stream.fileno())
                self.file_id = [info.st_dev, info.st_ino]
                self._progress()
                while True:
                    got = source.readinto(chunk)
                    if not got:
                        break
                    durable.stream.write(view[:got])
                    self._progress(got)
                written = durable.stream.result()
                if (written.value, written.size) != (expected.value, expected.size):
                    raise CopyError(errno_mod.EIO, (
                        f"local copy {self.file.local} is corrupt: it reads as {written.algorithm} "
                        f"{written.value:08x}, {written.size} bytes, but was written as "
                        f"{expected.value:08x}, {expected.size} bytes; not committed"),
                        self.file.local, fail_fast=True)
                # fsync before the rename, then look again: a copy abandoned while its
                # fsync hung must not rename into place after its save was given up.
                os.fsync(durable.stream.fileno())
                self._progress()
                self.file.note_attempt(self.file_id)
                durable.commit()

    def _keep_previous(self) -> None:
        """Keep the file at the target aside, once per file, before any attempt renames."""
        file = self.file
        if not file.previous:
            return
        with file.keeping:
            if file.kept is None:
                try:
                    file.kept = keep_aside(file.target, file.previous)
                except FileExistsError:  # an earlier attempt's link landed after it failed
                    file.kept = True     # (or the earlier daemon's, on a resumed flush)
                    return
                if file.kept and file.earlier and _file_id(file.previous) in file.earlier:
                    # A resumed flush to a path that was new: the earlier daemon's attempt
                    # renamed this save's file there, which is no previous checkpoint.
                    drop_previous(file.previous)
                    file.kept = False

    def _expected(self) -> Checksum:
        """What the local write recorded (its checksum record, else the journal's)."""
        algorithm = ALGORITHM  # files without a record were checksummed with crc32
        if self.file.record:
            try:
                recorded = read_sidecar(self.file.local)
            except ChecksumMismatchError as exc:
                raise CopyError(errno_mod.EIO, f"{exc}; not committed", self.file.local,
                                fail_fast=True) from None
            if (recorded.value, recorded.size) != (self.file.crc32, self.file.size):
                raise CopyError(errno_mod.EIO, f"the local copy's checksum record "
                                f"{sidecar_path(self.file.local)} differs from the write's "
                                f"result; not committed", self.file.local, fail_fast=True)
            algorithm = recorded.algorithm
        if not os.path.exists(self.file.local):
            raise CopyError(errno_mod.ENOENT, f"the local copy {self.file.local} is missing; "
                            "not committed", self.file.local, fail_fast=True)
        return Checksum(self.file.crc32, self.file.size, algorithm)


def _file_id(path: str) -> list | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return [info.st_dev, info.st_ino]


def remove_at_target(paths: list[str]) -> None:
    """Remove files (and their checksum records) a failed save put at its target; run on a
    worker thread, since the target may hang."""
    for path in paths:
        for candidate in (path, sidecar_path(path)):
            try:
                os.unlink(candidate)
            except OSError:
                pass


def present_at_target(path: str, record: bool) -> bool:
    """Whether ``path`` is durable at the target: it exists and, with ``record``, its
    checksum record exists and gives its size."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return False
    if not record:
        return True
    try:
        return read_sidecar(path).size == size
    except (OSError, ChecksumMismatchError):
        return False
