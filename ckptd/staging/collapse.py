"""Giving a new staging pool on a tmpfs without huge pages 2 MiB pages all the same.

Owns :func:`fold_into_huge_pages`: before a new pool file gets its pages, it asks the
kernel (``MADV_COLLAPSE``, Linux 6.1) for a 2 MiB page for every 2 MiB of the file.

Why: the writers write the pool to disk with ``O_DIRECT``. The kernel pins every page of
the buffer, and a disk request holds at most ``max_segments`` physically contiguous runs
(254 on the virtio disks here): from a pool on scattered 4 KiB pages a request is cut at
~1 MiB, and 512x more pages are pinned than from 2 MiB pages; the time to durable from
``/dev/shm`` was 1.05-1.1x the raw write where a pool on huge pages met it. A tmpfs
mounted without ``huge=`` (``/dev/shm`` as most systems set it up) gives its files 4 KiB
pages whatever ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says: that setting,
``deny`` and ``force`` apart, is for the kernel's internal shm mount (SysV shared memory,
shared anonymous mappings). ``MADV_COLLAPSE`` gives a tmpfs file huge pages all the same
(unless ``shmem_enabled`` is ``deny``), so the default pool directory gets what
``--pool-dir`` on a ``huge=`` tmpfs gives, with nothing to mount.

The kernel folds only ranges that hold at least one page and whose addresses are 2 MiB-
aligned with their file offsets: one page is faulted in in each 2 MiB of a mapping made at
such an address (:class:`ckptd.aligned_mapping.AlignedMapping`), then the whole is folded
at once: a zeroed 2 MiB page replaces each range's single 4 KiB one, so nearly nothing is
copied. What it costs is finding free 2 MiB blocks: nothing where memory has them, up to
~1.6 s a GiB measured here where the kernel must compact memory first (a one-off at the
daemon's start, like mounting a ``huge=`` tmpfs). A range the kernel cannot give a huge page
(``ENOMEM``, ``EAGAIN``) keeps 4 KiB pages, filled in by the caller's populate as before.

Pattern: best effort at creation, before the pages are in use. No threads, no extents.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time

from ckptd.aligned_mapping import HUGE_PAGE, AlignedMapping, libc

log = logging.getLogger(__name__)

__all__ = ["fold_into_huge_pages"]

_MADV_COLLAPSE = 25  # Linux 6.1; Python's mmap module does not name it
_MADV_POPULATE_WRITE = 23  # Linux 5.14
SMALL_PAGE = 4096


def _one_page_per_range(address: int, size: int) -> int:
    """Fault one 4 KiB page in each 2 MiB (the kernel folds only ranges holding a page);
    0 or the errno. ``MADV_POPULATE_WRITE``, not a store: a full tmpfs answers a store
    with SIGBUS, this with an error (the caller's populate then says ENOSPC)."""
    for offset in range(0, size, HUGE_PAGE):
        if libc.madvise(address + offset, SMALL_PAGE, _MADV_POPULATE_WRITE) != 0:
            return ctypes.get_errno() or errno.EIO
    return 0


def fold_into_huge_pages(fd: int, size: int) -> int:
    """Give the new, empty file ``fd`` of ``size`` bytes a huge page per whole 2 MiB.

    Returns
    -------
    int
        Bytes now on huge pages (0 where the kernel cannot fold tmpfs pages; a partial
        fold counts what the kernel reported done, which may undercount).
    """
    whole = size - size % HUGE_PAGE
    if whole == 0:
        return 0
    started = time.monotonic()
    try:
        mapping = AlignedMapping(fd, whole)
    except OSError as exc:
        log.info("staging pool left on 4 KiB pages: %s", exc)
        return 0
    try:
        failure = _one_page_per_range(mapping.address, whole)
        if failure == 0 and libc.madvise(mapping.address, whole, _MADV_COLLAPSE) != 0:
            failure = ctypes.get_errno() or errno.EIO
    finally:
        mapping.close()
    seconds = time.monotonic() - started
    if failure == 0:
        log.info("staging pool given %d MiB of huge pages in %.2fs (MADV_COLLAPSE; "
                 "CKPTD_POOL_COLLAPSE=0 leaves it on 4 KiB pages)", whole >> 20, seconds)
        return whole
    log.info("staging pool: the kernel folded %s of it into huge pages (MADV_COLLAPSE: %s, "
             "in %.2fs)", "none" if failure == errno.EINVAL else "part", os.strerror(failure),
             seconds)
    return 0
