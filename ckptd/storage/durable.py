"""Durable writes: the one way ckptd puts bytes into a file.

Every file the daemon writes (checkpoint data, checksum records, DCP ``.metadata``, local
parts and replicas, the ``committed`` marker, the ready file, the metrics textfile) goes
through :class:`DurableFile` or :func:`write_small_file`:

1. create a hidden temporary in the destination directory, relative to a directory file
   descriptor, with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and a name that carries the writer's
   pid (so leftovers of a dead writer can be attributed) and a random token (so nobody can
   plant a symlink at it in advance): a link at that name is never followed, an existing
   file is never reused;
2. write (checkpoint data with O_DIRECT straight from the staging pool where the
   filesystem allows it, :mod:`ckptd.storage.direct_io`; other files buffered), fsync it
   while its checksum record is written and fsynced beside it (``<file>.ckptd-sum``);
3. rename the record, then the file onto its final name (``rename`` replaces a link at
   the destination instead of following it), and fsync the directory.

A file that has its final name is therefore always complete. The directories it lands in
are opened without following links and created durably by :mod:`ckptd.storage.directories`.

Pattern: temp + fsync + rename + directory fsync, in one place. No torch, no sockets.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ckptd import knobs
from ckptd.checksum import ALGORITHM, TMP_MARKER, Checksum, ChecksumWriter, sidecar_path
from ckptd.storage.directories import DIRECTORY_FLAGS, open_directory
from ckptd.storage.direct_io import DirectFileWriter
from ckptd.storage.direct_pieces import DirectPieces
from ckptd.storage.write_modes import drop_cached_pages, write_mode_of

_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SYNC_FILE_RANGE_WRITE = 2


def temporary_name(path: str, pid: int | None = None) -> str:
    """A fresh hidden name for writing ``path``: ``.<name>.<pid>.<random>.ckptd-tmp``.

    The pid attributes a leftover to its writer; the random token makes the name
    impossible to guess before the write starts.
    """
    head, tail = os.path.split(path)
    owner = os.getpid() if pid is None else pid
    return os.path.join(head, f".{tail}.{owner}.{secrets.token_hex(6)}{TMP_MARKER}")


def is_temporary_of(name: str, final_name: str, pid: int | None = None) -> bool:
    """Whether directory entry ``name`` is a temporary of ``final_name`` (by ``pid``, if given)."""
    prefix = f".{final_name}." if pid is None else f".{final_name}.{pid}."
    return name.startswith(prefix) and name.endswith(TMP_MARKER)


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return function


_sync_file_range = _load_sync_file_range()
_crc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-crc")
# A file's fsync runs here while its checksum record is written (a process may commit
# several files at once from its threads: a receiver's replicas, a tier's flush).
_sync_threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckptd-fsync")


class DurableFileStream(ChecksumWriter):
    """The stream a buffered file's bytes are written into: checksums large chunks on a
    helper thread while the kernel copies them (the CRCs and writes all release the GIL),
    and starts writeback early (``sync_file_range``) so the final fsync has little left."""

    def __init__(self, raw, algorithm: str = ALGORITHM,
                 progress: Callable[[str, int], None] | None = None) -> None:
        super().__init__(raw, algorithm)
        self._fd = raw.fileno()
        self._written_back = 0
        self.progress = progress

    def fileno(self) -> int:
        """The file descriptor written to."""
        return self._fd

    def write(self, data) -> int:
        """Write all of ``data``; the checksum is computed alongside the write."""
        view = memoryview(data).cast("B")
        if view.nbytes < knobs.CHECKSUM_OVERLAP_MIN_BYTES.get():
            done = super().write(view)
        else:
            checksum = _crc_thread.submit(self.algorithm.update, view, self.crc)
            try:
                done = self._write_all(view)
            finally:
                self.crc = checksum.result()
        self._start_writeback()
        if self.progress is not None:
            self.progress("write", self.size)
        return done

    def _start_writeback(self) -> None:
        pending = self.size - self._written_back
        if _sync_file_range is not None and pending >= knobs.WRITEBACK_EVERY_BYTES.get():
            _sync_file_range(self._fd, self._written_back, pending, _SYNC_FILE_RANGE_WRITE)
            self._written_back = self.size


class DurableFile:
    """A file being written under a hidden, exclusively created temporary name.

    Use as a context manager: leaving the block with an exception discards the
    temporary; :meth:`commit` makes the file durable under its final name.

    Parameters
    ----------
    path : str
        The final name (its directory is created, durably, if missing).
    checksum : bool
        Record the file's checksum beside it (``<path>.ckptd-sum``).
    mode : int
        Permission bits of the new file.
    operator_path : bool
        False (checkpoint data): the directory is walked from ``/`` without following any
        link, and created durably where missing. True (a ready file, the metrics textfile:
        places the operator chose): it is opened as given and must exist.
    direct : bool
        Checkpoint data: written with O_DIRECT where the filesystem allows it and
        ``CKPTD_WRITE_MODE`` is ``direct``; where it refuses, buffered and dropped from
        the page cache after the fsync.
    algorithm : str, optional
        Of the checksum (default: ``CKPTD_CHECKSUM`` for recorded files, crc32 otherwise);
        a copy of a recorded file keeps its algorithm.
    pieces_of : int, optional
        The file arrives in pieces of a file of this size, written with :meth:`write_at`
        from any thread and in any order (a replica), instead of through :attr:`stream`.
    size_hint : int
        Bytes a direct file will hold at least (its space is allocated before the first
        write; 0: unknown).

    Attributes
    ----------
    stream : DurableFileStream or DirectFileWriter
        Where the file's bytes go (checksummed as they pass).
    """

    def __init__(self, path: str, checksum: bool = True, mode: int = 0o644,
                 operator_path: bool = False, dir_fd: int | None = None,
                 direct: bool = False, algorithm: str | None = None,
                 progress: Callable[[str, int], None] | None = None,
                 pieces_of: int | None = None, size_hint: int = 0) -> None:
        self.path = path
        self.directory = os.path.dirname(path) or "."
        self.with_checksum = checksum
        if dir_fd is not None:  # a file beside another one (its checksum record)
            self._dir_fd = os.dup(dir_fd)
        elif operator_path:
            self._dir_fd = os.open(self.directory, DIRECTORY_FLAGS)
        else:
            self._dir_fd, _ = open_directory(os.path.abspath(self.directory))
        try:
            self.tmp_name, fd = self._create_temporary(mode)
        except BaseException:
            os.close(self._dir_fd)
            raise
        # Held until the file has its final name: a sweeper that can take this lock knows
        # the writer is gone (ckptd.storage.leftovers), whatever its pid says.
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._raw = open(fd, "wb", buffering=0, closefd=True)
        self._done = False
        if algorithm is None:  # new records get the configured algorithm
            algorithm = knobs.CHECKSUM.get() if checksum else ALGORITHM
        wants_direct = direct and knobs.WRITE_MODE.get() == "direct"
        use_direct = False
        #: How this file is written, for ``ckptd status`` ("" for small files).
        self.write_mode = "buffered (CKPTD_WRITE_MODE=buffered)" if direct else ""
        if wants_direct:
            try:
                mode = write_mode_of(fd, self.tmp_path)
            except BaseException:
                self.discard()
                raise
            use_direct = mode.direct
            self.write_mode = "direct" if use_direct else f"buffered: {mode.reason}"
        # A filesystem that refuses O_DIRECT still keeps the page cache clean of checkpoints.
        self._drop_pages = wants_direct and not use_direct
        self.stream: DurableFileStream | DirectFileWriter = (
            DirectFileWriter(fd, algorithm, size_hint) if use_direct
            else DurableFileStream(self._raw, algorithm))
        self._pieces: DirectPieces | None = None
        if use_direct and pieces_of is not None:
            try:
                self._pieces = DirectPieces(fd, self.tmp_path, pieces_of)
            except BaseException:
                self.discard()
                raise
        self.stream.progress = progress
        if progress is not None:  # the temporary exists: from here on, bytes are written
            progress("write", 0)

    def _create_temporary(self, mode: int) -> tuple[str, int]:
        for _ in range(8):  # a collision of 48 random bits means someone is guessing
            name = os.path.basename(temporary_name(self.path))
            try:
                return name, os.open(name, _OPEN_FLAGS, mode, dir_fd=self._dir_fd)
            except FileExistsError:
                continue
        raise FileExistsError(errno_mod.EEXIST, "could not create a fresh temporary name",
                              os.path.join(self.directory, name))

    @property
    def tmp_path(self) -> str:
        """The temporary's full path (for messages)."""
        return os.path.join(self.directory, self.tmp_name)

    def commit(self, fsync: bool = True, sync_directory: bool = True,
               checksum: Checksum | None = None) -> Checksum:
        """fsync, record the checksum, rename into place, fsync the directory.

        Parameters
        ----------
        fsync : bool
            Make the bytes durable (False only for files worthless after a crash, such as
            the metrics textfile, where atomicity alone matters).
        sync_directory : bool
            fsync the directory after the rename (False when the caller renames more
            files into it and syncs once, as a checksum record before its file).
        checksum : Checksum, optional
            The checksum to record, when the bytes did not pass through :attr:`stream`
            (written at offsets with :meth:`write_at` and checksummed piece by piece).

        Returns
        -------
        Checksum
            Of the bytes written.
        """
        progress = self.stream.progress or (lambda phase, nbytes: None)
        try:
            if self._pieces is not None:
                self._pieces.finish()
            elif isinstance(self.stream, DirectFileWriter):
                self.stream.finish()
            checksum = checksum or self.stream.result()
            record = self._sync_with_record(checksum, fsync, progress)
            if self._drop_pages or (self._pieces is not None and self._pieces.buffered):
                drop_cached_pages(self._raw.fileno())
            if record is not None:  # synced already: renamed into place before the file
                record.commit(fsync=False, sync_directory=False)
            os.replace(self.tmp_name, os.path.basename(self.path),
                       src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            if fsync and sync_directory:
                os.fsync(self._dir_fd)
        except BaseException:
            self.discard()
            raise
        self._finish()
        return checksum

    def _sync_with_record(self, checksum: Checksum, fsync: bool, progress) -> "DurableFile | None":
        """fsync the file while its checksum record's temporary is written and fsynced
        beside it (through the same directory descriptor), then enter the ``commit`` phase;
        returns the record, not renamed yet. One after the other, the record's making and
        fsync added ~1.5 ms a file here; side by side, ~1."""
        if fsync:
            progress("fsync", self.stream.size)
        synced = _sync_threads.submit(os.fsync, self._raw.fileno()) if fsync else None
        record = None
        try:
            if self.with_checksum:
                record = DurableFile(sidecar_path(self.path), checksum=False, dir_fd=self._dir_fd)
                record.stream.write(checksum.to_json().encode())
                if fsync:
                    os.fsync(record.stream.fileno())
            if synced is not None:
                synced.result()
            progress("commit", self.stream.size)
        except BaseException:
            if synced is not None:
                synced.exception()  # over before the file's descriptor may be closed
            if record is not None:
                record.discard()
            raise
        return record

    def write_at(self, offset: int, data) -> None:
        """Write all of ``data`` at ``offset`` (pieces arriving out of order; thread-safe,
        not checksummed here: pass the checksum to :meth:`commit`). A file made with
        ``pieces_of`` on a filesystem that takes direct writes gets them here."""
        view = memoryview(data).cast("B")
        if self._pieces is not None:
            self._pieces.write(offset, view)
            return
        fd = self._raw.fileno()
        while view.nbytes:
            written = os.pwrite(fd, view, offset)
            if not written:
                raise OSError(errno_mod.EIO, "pwrite returned no progress", self.tmp_path)
            view, offset = view[written:], offset + written

    def discard(self) -> None:
        """Remove the temporary (a write that failed or was abandoned)."""
        if self._done:
            return
        if isinstance(getattr(self, "stream", None), DirectFileWriter):
            self.stream.abort()  # no write may still target the descriptor closed below
        try:
            os.unlink(self.tmp_name, dir_fd=self._dir_fd)
        except OSError:
            pass
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._raw.close()  # releases the lock: the file has its final name, or is gone
        os.close(self._dir_fd)

    def __enter__(self) -> "DurableFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.discard()  # no-op after commit; an abandoned or failed write leaves nothing


class FileWrite:
    """A checkpoint file made ready before its bytes are (temporary created, space
    allocated), written and committed by :meth:`run` later, or :meth:`discard`-ed
    (parameters: those of :func:`write_file_atomically`)."""

    def __init__(self, path: str, checksum: bool = True, direct: bool = False,
                 size_hint: int = 0) -> None:
        self.path = path
        self.durable = DurableFile(path, checksum=checksum, direct=direct, size_hint=size_hint)

    def reserve(self, size: int) -> None:
        """The file will hold ``size`` bytes (known only now): allocate what is missing
        before the first write, while no write of the file is in flight."""
        if isinstance(self.durable.stream, DirectFileWriter):
            self.durable.stream.reserve(size)

    def run(self, write_body: Callable[[ChecksumWriter], Any],
            progress: Callable[[str, int], None] | None = None) -> dict:
        """Write the file through ``write_body(stream)`` and commit it; returns what
        :func:`write_file_atomically` does."""
        durable = self.durable
        with durable:
            durable.stream.progress = progress
            if progress is not None:
                progress("write", 0)
            try:
                write_body(durable.stream)
            except Exception as exc:
                error = durable.stream.error
                if error is not None and error is not exc:
                    raise error from exc  # keep the errno the serializer hid
                raise
            info = os.fstat(durable.stream.fileno())  # the same inode after the rename
            synced_at = time.time()
            result = durable.commit()
        return {"path": self.path, "size": result.size, "crc32": result.value,
                "algorithm": result.algorithm, "file_id": [info.st_dev, info.st_ino],
                "write_mode": durable.write_mode, "synced_at": synced_at}

    def discard(self) -> None:
        """Remove the temporary: the file is not written after all."""
        self.durable.discard()


def write_file_atomically(path: str, write_body: Callable[[ChecksumWriter], Any],
                          checksum: bool = True, direct: bool = False,
                          progress: Callable[[str, int], None] | None = None,
                          size_hint: int = 0) -> dict:
    """Write ``path`` through ``write_body(stream)`` as a :class:`DurableFile`
    (``direct``: checkpoint data, O_DIRECT where possible; ``size_hint``: bytes it will
    hold at least, allocated up front; ``progress(phase, bytes_done)``: told of every write
    and of the start of the ``fsync`` and ``commit`` phases).

    Returns ``{"path", "size", "crc32", "algorithm", "file_id", "write_mode",
    "synced_at"}`` of the committed file: ``file_id`` is its ``[st_dev, st_ino]`` (tells it
    from a later file at the path), ``synced_at`` when making it durable began.
    """
    return FileWrite(path, checksum, direct, size_hint).run(write_body, progress)


def write_small_file(path: str, data: bytes, *, checksum: bool = False, mode: int = 0o644,
                     fsync: bool = True, operator_path: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically (a ready file, a marker, a textfile).

    Parameters
    ----------
    checksum : bool
        Also record a checksum beside it.
    fsync : bool
        As for :meth:`DurableFile.commit`.
    operator_path : bool
        As for :class:`DurableFile`.
    """
    with DurableFile(path, checksum=checksum, mode=mode, operator_path=operator_path) as durable:
        durable.stream.write(data)
        durable.commit(fsync=fsync)


def remove_quietly(path: str) -> None:
    """Unlink ``path`` if it exists; errors are not news here."""
    try:
        os.unlink(path)
    except OSError:
        pass


def temporaries_of(path: str, pid: int | None = None) -> list[str]:
    """Leftover temporaries of ``path`` (written by ``pid``, or by anyone)."""
    head, tail = os.path.split(path)
    try:
        names = os.listdir(head or ".")
    except OSError:
        return []
    return [os.path.join(head, n) for n in names if is_temporary_of(n, tail, pid)]


def remove_written(path: str, file_id: list | None = None) -> None:
    """Remove a file ckptd wrote, its checksum record and temporaries of it nobody writes.

    With ``file_id`` (from :func:`write_file_atomically`), only that very file: if a later
    save replaced it at ``path`` meanwhile, it stays (an aborted save whose write finished
    late must not delete the next save's file).
    """
    from ckptd.storage.leftovers import sweep_temporaries

    if file_id is not None:
        try:
            info = os.stat(path)
        except OSError:
            return
        if [info.st_dev, info.st_ino] != list(file_id):
            return
    for candidate in (path, sidecar_path(path)):
        remove_quietly(candidate)
    directory, name = os.path.split(path)
    if temporaries_of(path):
        sweep_temporaries(directory, name_prefix=f".{name}.")
