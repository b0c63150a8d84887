"""Test helpers: whether this kernel can give tmpfs files huge pages, and how many a file has.

No mocks: the answers come from the kernel's version and settings and from a real mapping's
``smaps``.
"""

from __future__ import annotations

import os
import re

from ckptd.aligned_mapping import HUGE_PAGE, AlignedMapping
from ckptd.staging.pool_directory import huge_page_bytes


def kernel_version(release: str) -> tuple[int, int]:
    """``(major, minor)`` of a kernel release string (``5.15-rc1``, ``6.18.44-fc-v595``);
    ``(0, 0)`` where it has none."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def kernel_folds_tmpfs_pages() -> str | None:
    """Why this kernel cannot give tmpfs files huge pages with MADV_COLLAPSE, or None."""
    if kernel_version(os.uname().release) < (6, 1):
        return f"MADV_COLLAPSE needs Linux 6.1; this is {os.uname().release}"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            setting = f.read()
    except OSError:
        return "this kernel has no transparent huge pages"
    if "[deny]" in setting:
        return f"shmem_enabled is {setting.strip()}: tmpfs huge pages are denied"
    return None


def file_huge_bytes(path: str, size: int) -> int:
    """Bytes of the file on huge pages, as a fresh 2 MiB-aligned mapping of it maps them."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = AlignedMapping(fd, size)
    finally:
        os.close(fd)
    try:
        assert mapping.address % HUGE_PAGE == 0
        sum(mapping.view[offset] for offset in range(0, size, 4096))  # fault every page in
        return huge_page_bytes(mapping.address)
    finally:
        mapping.close()
