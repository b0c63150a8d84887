"""Which bytes of the staging pool make a local part's file.

A staged local part sits in its extent as :func:`ckptd.protocol.layout_extent` placed it:
the part header first, then each tensor. Owns the rule that turns that into the file's
bytes, for the writer and for replication alike (so a replica is byte for byte the
owner's file, and its checksum the same):

- a version 2 part (:data:`ckptd.protocol.PART_MAGIC_V2`) *is* the extent from its first
  byte to the end of its last tensor: one range, page-aligned at both ends of the pool
  and the file, so the writer sends the tensor bodies to the disk with O_DIRECT as they
  are. The alignment gaps between buffers are zeroed first (:func:`clear_gaps`): the pool
  is reused, and a file must not carry what an earlier save left there;
- a version 1 part (an older trainer) is its buffers back to back: one range each.

Runs in the serve loop, after every byte is staged and before any writer or sender
reads the extent. No I/O.
"""

from __future__ import annotations

from ckptd import protocol


def _version(pool, request) -> int:
    return protocol.part_version(bytes(pool.view(request.extent)[:len(protocol.PART_MAGIC)]))


def part_ranges(pool, request) -> list[tuple[int, int]]:
    """``(pool offset, nbytes)`` of the byte ranges whose concatenation is the part file."""
    base = request.extent.offset
    sizes = [b[2] for b in request.buffers]
    if _version(pool, request) == 2:
        return [(base, max(o + n for o, n in zip(request.offsets, sizes)))]
    return [(base + o, n) for o, n in zip(request.offsets, sizes)]


def clear_gaps(pool, request) -> None:
    """Zero the alignment gaps between a version 2 part's buffers in its extent."""
    if _version(pool, request) != 2:
        return
    view, cursor = pool.view(request.extent), 0
    for offset, (_, _, nbytes) in sorted(zip(request.offsets, request.buffers)):
        if offset > cursor:
            view[cursor:offset] = bytes(offset - cursor)
        cursor = max(cursor, offset + nbytes)
