"""Direct writes of a file that arrives in pieces, out of order, from several threads.

Owns the positional counterpart of :class:`ckptd.storage.direct_io.DirectFileWriter`:
a replica or a fetched part comes off the network in chunks (several connections, any
order), each written at its offset by the thread that received it. With ``O_DIRECT`` those
bytes go from the connection's page-aligned buffer to the device: no copy into the page
cache, no page cache left behind on the holder (written through the page cache, a
replica cost its receiver several times the CPU of receiving it, and filled its memory
with bytes nobody reads back soon).

A piece is written direct when its offset and its buffer start on a page and it ends on a
page or at the file's end; that last unaligned tail goes through a page-aligned bounce page
padded with zeros, and the file is cut to its size at :meth:`DirectPieces.finish`. Any
other piece (a sender that chunks differently) switches the file to buffered writes for
good, so nothing is refused and no padding ever lands on another piece's bytes; its pages
are then dropped after the fsync like any buffered checkpoint file. Space is allocated up
front (``fallocate``, where it pays: not on tmpfs), so the threads' writes land inside the
file instead of each extending it under the inode's lock.

Pattern: aligned positional writes + bounce page + truncate. No sockets, no checksums.
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import logging
import mmap
import os
import threading

from ckptd.storage.direct_io import PAGE, allocating_ahead_pays, buffer_address, fallocate

log = logging.getLogger(__name__)

__all__ = ["DirectPieces"]


def _pwrite_all(fd: int, view: memoryview, offset: int, where: str) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        if not written:
            raise OSError(errno_mod.EIO, "pwrite returned no progress", where)
        view, offset = view[written:], offset + written


class DirectPieces:
    """Positional writes into one file opened with ``O_DIRECT`` (thread-safe).

    Parameters
    ----------
    fd : int
        The new, empty file, with ``O_DIRECT`` set.
    where : str
        Its path, for messages.
    size : int
        Bytes the file will have (allocated here, where the filesystem can; a full one
        makes the writes themselves say ENOSPC).

    Attributes
    ----------
    buffered : bool
        Whether a piece that could not be written direct switched the file to buffered
        writes (its pages then belong to the page cache until dropped).
    """

    def __init__(self, fd: int, where: str, size: int) -> None:
        self._fd = fd
        self._where = where
        self.size = size
        self._lock = threading.Lock()
        self._end = 0
        self.buffered = False
        if size > 0 and allocating_ahead_pays(fd):
            fallocate(fd, 0, 0, size)

    def write(self, offset: int, view: memoryview) -> None:
        """Write all of ``view`` (a byte view) at ``offset``."""
        nbytes = view.nbytes
        if not self.buffered and (offset % PAGE or (buffer_address(view) or 1) % PAGE
                                  or (nbytes % PAGE and offset + nbytes != self.size)):
            self._go_buffered(offset)
        if self.buffered:
            _pwrite_all(self._fd, view, offset, self._where)
        else:
            body = nbytes - nbytes % PAGE
            if body:
                _pwrite_all(self._fd, view[:body], offset, self._where)
            if body < nbytes:
                self._write_tail(offset + body, view[body:])
        with self._lock:
            self._end = max(self._end, offset + nbytes)

    def _write_tail(self, offset: int, tail: memoryview) -> None:
        bounce = mmap.mmap(-1, PAGE)  # page-aligned and zero-filled, as O_DIRECT needs
        try:
            bounce[:tail.nbytes] = tail
            with memoryview(bounce) as page:  # past the file's end: cut at finish
                _pwrite_all(self._fd, page, offset, self._where)
        finally:
            bounce.close()

    def _go_buffered(self, offset: int) -> None:
        with self._lock:
            if self.buffered:
                return
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self.buffered = True
        log.info("%s: a piece at byte %d does not start and end on pages; the rest of the "
                 "file is written through the page cache", self._where, offset)

    def finish(self) -> None:
        """Cut the file to the end of its last byte (padding and allocation ahead)."""
        with self._lock:
            end = self._end
        if os.fstat(self._fd).st_size != end:
            os.ftruncate(self._fd, end)
