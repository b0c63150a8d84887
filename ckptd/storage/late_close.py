"""Removing a file's name now and paying for its data later, off the caller's thread.

Owns the process's one background thread that closes descriptors of unlinked files.
Freeing a large file is the slow part of removing it: 37 ms for a 1 GiB checkpoint on
tmpfs (its pages), milliseconds for the extents of one on disk. The daemon drops the file
a save replaced from its serve loop, where every rank's next request would wait that
long; so :func:`unlink_freeing_later` opens the file, removes the name (the directory is
clean at once, as a save's end promises) and hands the last descriptor to this thread,
whose ``close`` frees the data.

No sockets, no torch. After a ``fork`` the child starts a thread of its own if it needs
one (the parent's thread is not in the child; descriptors are close-on-exec).
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading

from ckptd.filesystems import BTRFS_MAGIC, EXT4_MAGIC, TMPFS_MAGIC, XFS_MAGIC, statfs

__all__ = ["unlink_freeing_later", "wait_for_closes"]

log = logging.getLogger(__name__)


class _Closer:
    """A queue of descriptors and the thread that closes them, in order."""

    def __init__(self) -> None:
        self.fds: queue.Queue = queue.Queue()
        self.closed = 0  # descriptors closed so far (tests, diagnostics)
        self.thread = threading.Thread(target=self._run, name="ckptd-late-close",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fd = self.fds.get()
            try:
                os.close(fd)
            except OSError as exc:  # nothing to do about it but say so
                log.debug("closing a dropped file's descriptor %d: %s", fd, exc)
            finally:
                self.closed += 1
                self.fds.task_done()


_closer: _Closer | None = None
_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _closer, _lock
    _closer, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _the_closer() -> _Closer:
    global _closer
    with _lock:
        if _closer is None:
            _closer = _Closer()
        return _closer


#: Where an unlinked file that is still open just waits for its last close. A FUSE layer
#: (without hard_remove) or NFS renames it to a hidden ``.fuse_hidden*`` / ``.nfs*`` name
#: instead, and their close can block on the server: there the name goes the plain way.
_FREED_IN_PLACE = (TMPFS_MAGIC, EXT4_MAGIC, XFS_MAGIC, BTRFS_MAGIC)


def unlink_freeing_later(name: str) -> bool:
    """Remove ``name`` now; a regular file's data is freed later, by a background close.

    Only on a local filesystem (tmpfs, ext4, xfs, btrfs) and for a regular file; anything
    else (a link or FIFO someone planted, a network or FUSE mount) is only unlinked, and
    nothing is followed or opened for I/O. Returns whether ``name`` existed.
    """
    try:  # O_PATH: pins the inode without opening the file for I/O (no device's open)
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = None  # gone, or out of descriptors: the unlink below decides
    try:
        if fd is not None and not (stat.S_ISREG(os.fstat(fd).st_mode)
                                   and statfs(fd)[0] in _FREED_IN_PLACE):
            os.close(fd)
            fd = None
        os.unlink(name)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    finally:
        if fd is not None:
            _the_closer().fds.put(fd)


def wait_for_closes() -> int:
    """Block until every descriptor handed over so far is closed; returns how many this
    process closed late in all (tests, diagnostics)."""
    closer = _closer
    if closer is None:
        return 0
    closer.fds.join()
    return closer.closed
