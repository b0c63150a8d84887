"""Where each tensor sits inside a staging extent.

Owns the alignments and :func:`layout_extent`. Both the client (which copies into the
extent) and the daemon (which reads from it) call this, so they agree without sending
offsets around. It must stay pure arithmetic: no memory is touched here.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["TENSOR_ALIGNMENT", "EXTENT_ALIGNMENT", "align_up", "layout_extent"]

#: Alignment of each tensor inside a staging extent: lets any dtype be viewed in place
#: and keeps copies on cache-line boundaries.
TENSOR_ALIGNMENT = 64
#: Alignment of extents in the staging pool (page size, for O_DIRECT-friendly buffers).
EXTENT_ALIGNMENT = 4096


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def layout_extent(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of consecutive buffers inside one staging extent, and its total size.

    Both the client (which copies into the extent) and the daemon (which reads from it)
    call this, so they agree without sending offsets around.
    """
    offsets, cursor = [], 0
    for size in nbytes:
        offsets.append(cursor)
        cursor = align_up(cursor + size, TENSOR_ALIGNMENT)
    return offsets, align_up(max(cursor, 1), EXTENT_ALIGNMENT)
