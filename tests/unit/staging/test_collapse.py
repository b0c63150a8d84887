"""Folding a tmpfs file into huge pages: what is reported is what the kernel mapped.

Real files in /dev/shm (or in a tmpfs mounted for the test, root only), real
``MADV_COLLAPSE`` (Linux 6.1; skipped with the reason elsewhere); a range is kept from
folding by really pinning one of its pages (``vmsplice`` into a pipe holds a reference).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import pytest

from ckptd.aligned_mapping import HUGE_PAGE
from ckptd.staging.collapse import fold_into_huge_pages
from ckptd.staging.pool_directory import check_pool_directory
from hugepages import file_huge_bytes, kernel_folds_tmpfs_pages, kernel_version
import mounts

mounted = mounts.mounted  # the fixture, under its name here

libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@pytest.fixture
def folds():
    reason = kernel_folds_tmpfs_pages()
    if reason:
        pytest.skip(reason)
    if check_pool_directory("/dev/shm").may_have_huge_pages:
        pytest.skip("/dev/shm is mounted with huge pages here: its files need no folding")


@pytest.fixture
def shm_path():
    path = f"/dev/shm/ckptd-test-collapse-{os.getpid()}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def collapse_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ckptd.staging.collapse"]


def test_a_partial_fold_reports_what_really_is_on_huge_pages(folds, shm_path, caplog):
    """One range of the file cannot be folded (a page of it is held by a pipe): the other
    ranges are, and the count says so (it said 0 when madvise answered an error)."""
    size = 8 * HUGE_PAGE
    fd = os.open(shm_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    pinned_at = 2 * HUGE_PAGE + (HUGE_PAGE >> 1)
    read_end = write_end = None
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mapping:
            mapping[pinned_at] = 1
            buffer = (ctypes.c_char * size).from_buffer(mapping)
            read_end, write_end = os.pipe()
            iov = _IoVec(ctypes.addressof(buffer) + pinned_at, 4096)
            held = libc.vmsplice(write_end, ctypes.byref(iov), 1, 0)
            del buffer
            assert held == 4096, os.strerror(ctypes.get_errno())
            with caplog.at_level(logging.INFO, logger="ckptd.staging.collapse"):
                folded = fold_into_huge_pages(fd, size)
        on_huge_pages = file_huge_bytes(shm_path, size)
    finally:
        for end in (read_end, write_end):
            if end is not None:
                os.close(end)
        os.close(fd)
    assert folded == on_huge_pages and 0 < folded <= size - HUGE_PAGE, (folded, on_huge_pages)
    [line] = collapse_lines(caplog)
    assert f"given {folded >> 20} of {size >> 20} MiB" in line and "4 KiB pages" in line, line


def test_a_failure_to_fault_in_pages_is_named_as_such_not_as_a_fold(folds, mounted, caplog):
    """A tmpfs too small for a page per huge page: the log names the populate that failed."""
    directory = mounted("tmpfs", "size=8k")
    path = os.path.join(directory, "pool")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4 * HUGE_PAGE)
        with caplog.at_level(logging.INFO, logger="ckptd.staging.collapse"):
            assert fold_into_huge_pages(fd, 4 * HUGE_PAGE) == 0
    finally:
        os.close(fd)
    [line] = collapse_lines(caplog)
    assert "MADV_POPULATE_WRITE" in line and "MADV_COLLAPSE" not in line, line


def test_folding_goes_slice_by_slice_and_stops_at_its_budget(folds, shm_path, caplog):
    """Folding runs before the daemon answers anyone: it stops once its time budget is
    spent, the rest of the file keeps 4 KiB pages, and one line says so. A budget already
    spent folds nothing; an ample one folds every slice."""
    size = 4 * HUGE_PAGE
    for budget, expected in ((0.0, 0), (3600.0, size)):
        fd = os.open(shm_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="ckptd.staging.collapse"):
                folded = fold_into_huge_pages(fd, size, budget=budget, slice_bytes=HUGE_PAGE)
        finally:
            os.close(fd)
        assert folded == expected == file_huge_bytes(shm_path, size), budget
        os.unlink(shm_path)
        [line] = collapse_lines(caplog)
        assert ("budget" in line) == (budget == 0.0), line


@pytest.mark.parametrize("release,version", [
    ("6.18.44-fc-v595", (6, 18)), ("5.15-rc1", (5, 15)), ("6.1.0", (6, 1)), ("6.10+", (6, 10)),
    ("weird", (0, 0))])
def test_the_kernel_version_the_fold_tests_check_is_read_from_any_release_string(release, version):
    assert kernel_version(release) == version
