"""Whether a filesystem takes direct writes, decided once per filesystem.

Owns :func:`write_mode_of`: ``statx``'s DIO alignment where the kernel reports it, else
whether the filesystem accepts ``O_DIRECT`` at all, decided once per filesystem and
logged once. Where it does not (ramfs, some FUSE and network mounts, or an alignment above
a page), files are written buffered and their pages dropped from the page cache after the
fsync (:func:`drop_cached_pages`). :func:`probe_directory` tells ``ckptd status`` which
mode a root gets. The writing itself is :mod:`ckptd.storage.direct_io`'s.
No torch; no sockets.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import logging
import os
import struct
import threading
from dataclasses import dataclass

from ckptd.storage.direct_io import PAGE

log = logging.getLogger(__name__)

__all__ = ["WriteMode", "write_mode_of", "probe_directory", "drop_cached_pages"]

_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256
_DIO_ALIGN_OFFSET = 152  # stx_dio_mem_align, stx_dio_offset_align (u32 each)


@dataclass(frozen=True)
class WriteMode:
    """How files on one filesystem are written.

    Attributes
    ----------
    mode : str
        ``"direct"`` (O_DIRECT from the pool) or ``"buffered"`` (through the page cache).
    reason : str
        Why, in words (for the log and ``ckptd status``).
    """

    mode: str
    reason: str

    @property
    def direct(self) -> bool:
        """Whether files are written with O_DIRECT."""
        return self.mode == "direct"


def _dio_alignment(fd: int) -> tuple[int, int] | None:
    """``(memory, offset)`` alignment the filesystem of ``fd`` reports for direct I/O:
    None where the kernel does not say (then only trying tells), (0, 0) where it refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buffer) != 0:
        return None
    if not struct.unpack_from("<I", buffer, 0)[0] & _STATX_DIOALIGN:
        return None
    return struct.unpack_from("<II", buffer, _DIO_ALIGN_OFFSET)


def _decide(fd: int) -> WriteMode:
    """The write mode of the filesystem of ``fd`` (a file opened for writing, or a
    directory); may set O_DIRECT on ``fd`` to try."""
    alignment = _dio_alignment(fd)
    if alignment is not None:
        memory, offset = alignment
        if not memory or not offset:
            return WriteMode("buffered", "the filesystem reports no direct I/O (statx)")
        if memory > PAGE or offset > PAGE:
            return WriteMode("buffered", f"direct I/O needs {offset}-byte offsets and "
                             f"{memory}-byte buffers, more than a {PAGE}-byte page (statx)")
        return WriteMode("direct", f"statx: {offset}-byte offsets, {memory}-byte buffers")
    return WriteMode("direct", "the filesystem accepts O_DIRECT (no statx DIO alignment)")


_modes: dict[int, WriteMode] = {}
_modes_lock = threading.Lock()


def write_mode_of(fd: int, where: str) -> WriteMode:
    """The write mode of the filesystem holding ``fd`` (a file just created for writing),
    decided and logged once per filesystem; sets ``O_DIRECT`` on ``fd`` when it is direct.

    Parameters
    ----------
    fd : int
        The new file.
    where : str
        Its path, for the one log line.
    """
    device = os.fstat(fd).st_dev
    with _modes_lock:
        known = _modes.get(device)
    mode = known or _decide(fd)
    if mode.direct:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            name = errno_mod.errorcode.get(exc.errno or 0, str(exc.errno))
            mode = WriteMode("buffered", f"the filesystem refuses O_DIRECT ({name})")
    if mode != known:
        with _modes_lock:
            _modes[device] = mode
        log.info("filesystem of %s (device %d:%d): files written %s, %s; buffered files "
                 "leave the page cache after their fsync", os.path.dirname(where),
                 os.major(device), os.minor(device), mode.mode, mode.reason)
    return mode


def probe_directory(directory: str) -> WriteMode:
    """The write mode files under ``directory`` get (for ``ckptd status``): creates and
    removes a hidden probe file there."""
    name = os.path.join(directory, f".ckptd-probe.{os.getpid()}.{os.urandom(4).hex()}.ckptd-tmp")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return WriteMode("unknown", f"cannot create a file there: {exc.strerror}")
    try:
        os.unlink(name)
        return write_mode_of(fd, name)
    finally:
        os.close(fd)


def drop_cached_pages(fd: int) -> None:
    """Drop a durable file's pages from the page cache: nobody reads them back soon, and
    they would push out what the trainers use."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # advice only
