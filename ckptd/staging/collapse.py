"""Giving a new staging pool on a tmpfs without huge pages 2 MiB pages all the same.

Owns :func:`fold_into_huge_pages`: before a new pool file gets its pages, it asks the
kernel (``MADV_COLLAPSE``, Linux 6.1) for a huge page for every whole huge page of the file.

Why: the writers write the pool to disk with ``O_DIRECT``. The kernel pins every page of
the buffer, and a disk request holds at most ``max_segments`` physically contiguous runs
(254 on the virtio disks here): from a pool on scattered 4 KiB pages a request is cut at
~1 MiB, and 512x more pages are pinned than from 2 MiB pages. Measured here
(``benchmarks/RESULTS_WRITE_PATH.md``, two runs), folding took a save from ``/dev/shm``
from 1.04-1.10x the time of a raw direct write of its bytes to 1.02-1.05x, about what a
``huge=`` tmpfs gives (1.01-1.06x). A tmpfs
mounted without ``huge=`` (``/dev/shm`` as most systems set it up) gives its files 4 KiB
pages whatever ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says: that setting,
``deny`` and ``force`` apart, is for the kernel's internal shm mount (SysV shared memory,
shared anonymous mappings). ``MADV_COLLAPSE`` gives a tmpfs file huge pages all the same
(unless ``shmem_enabled`` is ``deny``), so the default pool directory gets what
``--pool-dir`` on a ``huge=`` tmpfs gives, with nothing to mount.

The kernel folds only ranges that hold at least one page and whose addresses are aligned
with their file offsets: one page is faulted in in each huge page's range of a mapping made
at such an address (:class:`ckptd.aligned_mapping.AlignedMapping`), then the range is
folded: a zeroed huge page replaces its single 4 KiB one, so nearly nothing is copied.
What it costs is finding free 2 MiB blocks: nothing where memory has them, up to ~1.6 s a
GiB measured here where the kernel must compact memory first. That happens at the daemon's
start, before it answers anyone, so it is done :data:`FOLD_SLICE` at a time and stops once
``CKPTD_POOL_FOLD_BUDGET`` seconds have passed (20 by default: the worst case must not
delay the start beyond what a starting trainer waits; ``CKPTD_POOL_COLLAPSE=0`` switches
folding off). A range the kernel cannot fold (``EAGAIN`` is retried once), and what the
budget leaves, keeps 4 KiB pages, faulted in by the caller's populate.

What is on huge pages is counted, not inferred from ``madvise``'s answer (which is an
error when any range failed, however many folded): the whole mapping is faulted in and
its ``smaps`` read before it is closed.

Pattern: best effort at creation, before the pages are in use. No threads, no extents.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time

from ckptd import knobs
from ckptd.aligned_mapping import HUGE_PAGE, AlignedMapping, libc
from ckptd.staging.pool_directory import huge_page_bytes

log = logging.getLogger(__name__)

__all__ = ["FOLD_SLICE", "fold_into_huge_pages"]

#: Bytes folded by one ``madvise`` call between looks at the budget.
FOLD_SLICE = 1 << 30

_MADV_COLLAPSE = 25  # Linux 6.1; Python's mmap module does not name it
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PR_GET_THP_DISABLE = 42
SMALL_PAGE = 4096


def _errno_of(result: int) -> int:
    return 0 if result == 0 else (ctypes.get_errno() or errno.EIO)


def _one_page_per_range(address: int, size: int) -> int:
    """Fault one 4 KiB page in each huge page's range (the kernel folds only ranges holding
    a page); 0 or the errno. ``MADV_POPULATE_WRITE``, not a store: a full tmpfs answers a
    store with SIGBUS, this with an error (the caller's populate then says ENOSPC)."""
    for offset in range(0, size, HUGE_PAGE):
        failure = _errno_of(libc.madvise(address + offset, SMALL_PAGE, _MADV_POPULATE_WRITE))
        if failure:
            return failure
    return 0


def _fold(address: int, size: int) -> int:
    """``MADV_COLLAPSE`` over one slice, once more after ``EAGAIN``; 0 or the errno."""
    failure = _errno_of(libc.madvise(address, size, _MADV_COLLAPSE))
    if failure == errno.EAGAIN:  # the kernel's word for a transient failure: one more try
        failure = _errno_of(libc.madvise(address, size, _MADV_COLLAPSE))
    return failure


def _why_refused(failure: int) -> str:
    text = f"MADV_COLLAPSE: {os.strerror(failure)} (errno {failure})"
    if failure == errno.EINVAL and libc.prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1:
        return (f"{text}; transparent huge pages are disabled for this process (prctl "
                "PR_SET_THP_DISABLE, inherited from its parent or set by the container runtime)")
    if failure == errno.EINVAL:
        return f"{text}; this kernel cannot fold tmpfs pages (Linux 6.1 or later) or denies it"
    return text


def fold_into_huge_pages(fd: int, size: int, budget: float | None = None,
                         slice_bytes: int = FOLD_SLICE) -> int:
    """Give the new, empty file ``fd`` of ``size`` bytes a huge page per whole huge page,
    ``slice_bytes`` at a time while less than ``budget`` seconds (default
    ``CKPTD_POOL_FOLD_BUDGET``) have passed; its pages
    are all faulted in afterwards. Logs one line saying how much and, if not all, why.

    Returns
    -------
    int
        Bytes of the file now on huge pages, as a mapping aligned to them maps them.
    """
    budget = knobs.POOL_FOLD_BUDGET.get() if budget is None else budget
    whole = size - size % HUGE_PAGE
    if whole == 0:
        return 0
    slice_bytes = max(slice_bytes - slice_bytes % HUGE_PAGE, HUGE_PAGE)
    started = time.monotonic()
    try:
        mapping = AlignedMapping(fd, whole)
    except OSError as exc:
        log.info("staging pool left on 4 KiB pages: %s", exc)
        return 0
    why, offset = None, 0
    try:
        while offset < whole:
            if time.monotonic() - started >= budget:
                why = (f"folding stopped after its {budget:g} s budget "
                       "(CKPTD_POOL_FOLD_BUDGET)")
                break
            length = min(slice_bytes, whole - offset)
            failure = _one_page_per_range(mapping.address + offset, length)
            if failure:
                why = (f"faulting in a page per huge page to fold failed (MADV_POPULATE_WRITE: "
                       f"{os.strerror(failure)}, errno {failure})")
                break
            failure = _fold(mapping.address + offset, length)
            if failure and why is None:  # the slice may hold folded ranges: go on
                why = _why_refused(failure)
            offset += length
        folding = time.monotonic() - started
        # the caller's populate names a full tmpfs: here only what got mapped is counted
        libc.madvise(mapping.address, whole, _MADV_POPULATE_WRITE)
        folded = huge_page_bytes(mapping.address)
    finally:
        mapping.close()
    if why is None and folded == whole:
        log.info("staging pool given %d MiB of huge pages in %.2fs (MADV_COLLAPSE; "
                 "CKPTD_POOL_COLLAPSE=0 leaves it on 4 KiB pages)", whole >> 20, folding)
    else:
        log.info("staging pool given %d of %d MiB of huge pages in %.2fs; the rest stays on "
                 "4 KiB pages: %s", folded >> 20, whole >> 20, folding,
                 why or "the kernel could not give some ranges a huge page")
    return folded
