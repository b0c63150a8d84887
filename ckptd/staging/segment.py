"""The staging pool's file: created once, bound to NUMA nodes, given its pages, mapped.

Every page is reserved at creation: a full tmpfs (or a hugetlbfs without free huge pages)
fails here with a clear error instead of a SIGBUS in the middle of a save. Pages are
faulted in through the daemon's mapping after ``MADV_HUGEPAGE``, so a tmpfs mounted with
``huge=advise`` allocates huge pages too (``fallocate`` allocates without a mapping, and
there without one it takes 4 KiB pages); mounts with ``huge=always``/``within_size`` and
hugetlbfs give them anyway; a tmpfs without huge pages (``/dev/shm`` as most systems set
it up) gets them from :mod:`ckptd.staging.collapse` before its pages are faulted in.
Processes that map the file later (writers, trainers) then get the huge pages mapped as
such, with no advice of their own.

Owns the file's creation and its pages; it must not know about extents or requests
(:mod:`ckptd.staging.pool`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
from dataclasses import dataclass

from ckptd import knobs
from ckptd.aligned_mapping import AlignedMapping, libc
from ckptd.protocol import EXTENT_ALIGNMENT, align_up
from ckptd.staging import numa
from ckptd.staging.collapse import fold_into_huge_pages
from ckptd.staging.pool_directory import PoolDirectory

log = logging.getLogger(__name__)

# Linux's MADV_POPULATE_WRITE (5.14): fault every page in for writing now, through the
# mapping. Python 3.11's mmap module does not name it.
_MADV_POPULATE_WRITE = 23


@dataclass(frozen=True)
class Region:
    """The part ``[start, end)`` of the pool whose pages are bound to NUMA ``node``."""

    start: int
    end: int
    node: int


def create(path: str, size: int, directory: PoolDirectory,
           nodes: list | None) -> tuple[memoryview, list[Region], int, int]:
    """Create the pool file ``path`` of ``size`` bytes, reserve its pages and map it.

    Returns
    -------
    (memoryview, list of Region, int, int)
        The populated shared mapping's bytes (at a huge page boundary; mapped for as long
        as they or a view of them live, unless retired), the NUMA regions (empty: one
        unbound region), the file's descriptor, holding an exclusive ``flock`` for as long
        as the caller keeps it open (a sweeper that cannot see this daemon's pid, from
        another pid namespace sharing the directory, finds the lock taken and leaves the
        pool alone; the mapping keeps no descriptor of its own), and the bytes given huge
        pages by folding (0 where the mount gives them itself: the mapping's own count
        says).

    Raises
    ------
    OSError
        If the pages cannot be reserved; the file is removed and the message says what to
        lower or free.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
        os.ftruncate(fd, size)
        regions = _bind_regions(fd, size, nodes) if nodes and len(nodes) > 1 else []
        folded = (fold_into_huge_pages(fd, size) if directory.filesystem == "tmpfs"
                  and not directory.may_have_huge_pages and knobs.POOL_COLLAPSE.get() else 0)
        return _allocate(fd, size, directory), regions, fd, folded
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise OSError(exc.errno, f"cannot reserve a {size}-byte staging pool at {path}: "
                      f"{exc.strerror}; {_how_to_make_room(directory)}") from None


def _allocate(fd: int, size: int, directory: PoolDirectory) -> memoryview:
    if directory.filesystem == "hugetlbfs":
        # Reserve first: mapping a hugetlbfs file without free huge pages fails with a bare
        # ENOMEM, fallocate with ENOSPC.
        os.posix_fallocate(fd, 0, size)
    # No descriptor of the file kept with the mapping (Python's own mmap keeps a dup): the
    # pool's lock is the caller's descriptor alone, and once the pool is closed its pages
    # are freed even while views of the retired range live on (ckptd.staging.pool).
    mapping = AlignedMapping(fd, size)
    if directory.filesystem == "tmpfs" and directory.may_have_huge_pages:
        # a kernel without THP refuses: small pages, still right
        libc.madvise(mapping.address, size, mmap.MADV_HUGEPAGE)
    try:
        populated = _populate_for_writing(mapping.view)
    except OSError:
        mapping.close()
        os.posix_fallocate(fd, 0, size)  # names the cause (ENOSPC) where the tmpfs is full
        raise
    os.posix_fallocate(fd, 0, size)
    if not populated:  # a kernel older than 5.14: fault the pages in the old way
        mapping.close()
        mapping = AlignedMapping(fd, size, populate=True)
    return mapping.view


def _how_to_make_room(directory: PoolDirectory) -> str:
    where = directory.path
    if directory.filesystem == "hugetlbfs":
        return (f"{where} is a hugetlbfs: reserve more huge pages (sysctl vm.nr_hugepages; "
                "HugePages_Free in /proc/meminfo) or lower --pool-size")
    return f"lower --pool-size or free space in {where} (df {where})"


def _populate_for_writing(mapping: memoryview) -> bool:
    """Fault every page of ``mapping`` in for writing; False where the kernel cannot.

    Raises
    ------
    OSError
        If the pages cannot be had (a full tmpfs gives EFAULT: the caller asks fallocate why).
    """
    if libc.madvise(address(mapping), len(mapping), _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, os.strerror(err))


def _bind_regions(fd: int, size: int, nodes: list) -> list[Region]:
    """Cut the file into one region per node and bind each before its pages are allocated
    (the binding is the file's, so the final mapping and the writers' and trainers'
    mappings share it); no regions where binding fails."""
    share = align_up(-(-size // len(nodes)), EXTENT_ALIGNMENT)
    bounds = [min(i * share, size) for i in range(len(nodes) + 1)]
    bounds[-1] = size
    regions = [Region(a, b, n) for a, b, n in zip(bounds, bounds[1:], nodes) if b > a]
    staging = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    base = address(staging)
    try:
        for region in regions:
            numa.bind_preferred(base + region.start, region.end - region.start, region.node)
    except OSError as exc:
        log.warning("staging pool left unbound to NUMA nodes: %s", exc)
        try:  # no half-bound pool: the regions bound before the failure are undone
            numa.bind_preferred(base, size, None)
        except OSError:
            pass
        return []
    finally:
        staging.close()
    log.info("staging pool split over NUMA nodes %s (%d MiB each)",
             ",".join(str(r.node) for r in regions), share >> 20)
    return regions


def address(mapping: mmap.mmap | memoryview) -> int:
    """Where ``mapping`` starts in this process's address space."""
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view
