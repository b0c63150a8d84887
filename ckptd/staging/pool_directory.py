"""Where the staging pool lives: the directory's filesystem, and whether it gives huge pages.

The pool is a file that the daemon, its writers, its replicator and the trainers all map
by path, so it must be memory that is never written back: a tmpfs (``/dev/shm`` by
default) or a hugetlbfs. A pool on a disk filesystem would be written back behind every
save and read in again on a fault; it is refused with the directory, its filesystem and
the fix.

Huge pages matter for the writers: an O_DIRECT write pins every page of its buffer, and a
pool on 4 KiB pages costs one pin per 4 KiB and a request cut short wherever pages are
scattered; on 2 MiB pages both nearly vanish. A tmpfs gets huge pages by its mount's
``huge=`` option: ``always`` or ``within_size`` allocate them, ``advise`` for mappings that
ask with ``MADV_HUGEPAGE`` (which :class:`ckptd.staging.pool.StagingPool` does), and
without the option (``/dev/shm`` as most systems mount it) it has 4 KiB pages whatever
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says (that setting is for the
kernel's internal shm mount, except ``deny`` and ``force``, which override every tmpfs);
there the pool is given them by :mod:`ckptd.staging.collapse`.

Owns the checks (``statfs`` magic for the decision, the mount table for the option's
name) and reading how much of a mapping the kernel maps with huge pages; it must not
create or map pools.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ckptd.filesystems import HUGETLBFS_MAGIC, TMPFS_MAGIC, statfs

SMALL_PAGE = 4096

#: One line for the log of a daemon whose pool landed on 4 KiB pages.
HUGE_PAGE_ADVICE = (
    "direct writes from a pool on huge pages pin 512x fewer pages and reach the disk in "
    "full-size requests: mount a tmpfs with huge pages "
    "(mount -t tmpfs -o huge=within_size,size=<pool size + 1G>,mode=1777 tmpfs /mnt/ckptd-pool) "
    "and pass --pool-dir /mnt/ckptd-pool (CKPTD_POOL_DIR for a daemon ckpt_client starts)")


class PoolDirectoryError(RuntimeError):
    """The pool directory is missing, not a directory, or on a filesystem a pool must not use."""


@dataclass(frozen=True)
class PoolDirectory:
    """A directory checked to be fit for a staging pool.

    Attributes
    ----------
    path : str
        The directory, absolute.
    filesystem : str
        ``tmpfs`` or ``hugetlbfs``.
    huge : str
        tmpfs: the mount's ``huge=`` option (``never``, ``always``, ``within_size``,
        ``advise``); hugetlbfs: ``hugetlbfs``.
    page_size : int
        Bytes a pool's size must be a multiple of (the huge page size on hugetlbfs).
    """

    path: str
    filesystem: str
    huge: str
    page_size: int

    @property
    def may_have_huge_pages(self) -> bool:
        """Whether a pool here can get huge pages at all."""
        return self.huge != "never"


def check_pool_directory(path: str) -> PoolDirectory:
    """Check that ``path`` can hold a staging pool.

    Raises
    ------
    PoolDirectoryError
        If it does not exist, is not a directory, or is on neither tmpfs nor hugetlbfs;
        the message names the directory, its filesystem and what to do.
    """
    path = os.path.realpath(path)  # the pool's path is announced resolved: no symlink in it
    fix = "pass --pool-dir DIR (or set CKPTD_POOL_DIR) naming a tmpfs directory such as /dev/shm"
    if not os.path.exists(path):
        raise PoolDirectoryError(f"staging pool directory {path} does not exist; create it "
                                 f"(mount a tmpfs there) or {fix}")
    if not os.path.isdir(path):
        raise PoolDirectoryError(f"staging pool directory {path} is not a directory; {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PoolDirectoryError(
            f"staging pool directory {path} is not writable by uid {os.geteuid()} (its mode, or "
            f"a read-only mount); mount the tmpfs read-write with mode=1777 (each pool is a "
            f"0600 file named after its user), or {fix}")
    _check_others_cannot_swap_pools(path, fix)
    magic, block_size = _statfs(path)
    fstype, options = mount_of(path)
    if magic == HUGETLBFS_MAGIC:
        return PoolDirectory(path, "hugetlbfs", "hugetlbfs", block_size)
    if magic != TMPFS_MAGIC:
        raise PoolDirectoryError(
            f"staging pool directory {path} is on {fstype} (filesystem magic {magic:#x}), not "
            f"tmpfs: a pool there would be written back to disk behind every save; {fix}, or "
            f"mount one: mount -t tmpfs -o huge=within_size,size=<pool size + 1G> tmpfs {path}")
    huge = next((o.partition("=")[2] for o in options if o.startswith("huge=")), "never")
    return PoolDirectory(path, "tmpfs", huge, SMALL_PAGE)


def _check_others_cannot_swap_pools(path: str, fix: str) -> None:
    """Trainers open the pool by its name: in a directory where another user may rename
    or delete our files (writable by others without the sticky bit), or that another user
    owns, that user could put a file of theirs under our pool's name and read the weights
    our trainers copy into it."""
    info = os.stat(path)
    if info.st_uid not in (0, os.geteuid()):
        raise PoolDirectoryError(
            f"staging pool directory {path} belongs to uid {info.st_uid}, not to root or to "
            f"this daemon's uid {os.geteuid()}: its owner could replace our pool; {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise PoolDirectoryError(
            f"staging pool directory {path} (mode {stat.S_IMODE(info.st_mode):o}) is writable "
            f"by other users without the sticky bit, so they could rename a file of theirs "
            f"over our pool; chmod 1777 {path} (mount the tmpfs with mode=1777), or {fix}")


def _statfs(path: str) -> tuple[int, int]:
    """``(f_type, f_bsize)`` of the filesystem holding ``path``, or the refusal naming it."""
    try:
        return statfs(path)
    except OSError as exc:
        raise PoolDirectoryError(f"cannot statfs staging pool directory {path}: "
                                 f"{exc.strerror} (errno {exc.errno})") from None


def mount_of(path: str) -> tuple[str, list[str]]:
    """The filesystem type and super-block options of the mount holding ``path``
    (``("?", [])`` when the mount table cannot be read)."""
    real = os.path.realpath(path)
    best, found = -1, ("?", [])
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # the last of equal mounts is the visible one
            best, found = len(point), (tail[0], tail[2].split(","))
    return found


def _unescape(text: str) -> str:
    """Mount points in mountinfo escape space, tab, newline and backslash as ``\\ooo``."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1:i + 4].isdigit():
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


#: smaps fields that count huge pages of a shared file mapping (tmpfs; hugetlbfs).
_HUGE_FIELDS = ("ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb")


def huge_page_bytes(address: int, pid: int | str = "self") -> int:
    """Bytes of the mapping starting at ``address`` in process ``pid`` that the kernel maps
    with huge pages (0 when it has none, or the mapping is not found)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                inside = int(head.split("-")[0], 16) == address
            elif inside and head[:-1] in _HUGE_FIELDS:
                total += int(line.split()[1]) * 1024
    return total
