"""Where each tensor sits inside a staging extent.

Owns the alignments and :func:`layout_extent`. Both the client (which copies into the
extent) and the daemon (which reads from it) call this, so they agree without sending
offsets around. It must stay pure arithmetic: no memory is touched here.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["TENSOR_ALIGNMENT", "PAGE_ALIGNMENT", "PAGE_ALIGNED_FROM", "EXTENT_ALIGNMENT",
           "align_up", "tensor_alignment", "layout_extent"]

#: Alignment of each small tensor inside a staging extent: lets any dtype be viewed in
#: place and keeps copies on cache-line boundaries.
TENSOR_ALIGNMENT = 64
#: Alignment of each large tensor: a page, so a writer can hand its bytes to an O_DIRECT
#: write as they are (ckptd's files put such a tensor on a 4 KiB boundary of the file too).
PAGE_ALIGNMENT = 4096
#: Tensors of this many bytes and more are page-aligned; smaller ones travel through the
#: writer's bounce buffer anyway, and aligning thousands of them would waste pool space.
PAGE_ALIGNED_FROM = 64 * 1024
#: Alignment of extents in the staging pool (page size, for O_DIRECT-friendly buffers).
EXTENT_ALIGNMENT = 4096


def tensor_alignment(nbytes: int) -> int:
    """Where a tensor of ``nbytes`` may start inside an extent (a multiple of this)."""
    return PAGE_ALIGNMENT if nbytes >= PAGE_ALIGNED_FROM else TENSOR_ALIGNMENT


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def layout_extent(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of consecutive buffers inside one staging extent, and its total size.

    Both the client (which copies into the extent) and the daemon (which reads from it)
    call this, so they agree without sending offsets around.
    """
    # align_up and tensor_alignment written out: both ends run this on every save, once
    # per tensor, and the calls cost more than the arithmetic.
    offsets, cursor = [], 0
    small, page, page_from = TENSOR_ALIGNMENT, PAGE_ALIGNMENT, PAGE_ALIGNED_FROM
    for size in nbytes:
        alignment = page if size >= page_from else small
        cursor = -(-cursor // alignment) * alignment
        offsets.append(cursor)
        cursor = -(-(cursor + size) // small) * small
    return offsets, align_up(max(cursor, 1), EXTENT_ALIGNMENT)
