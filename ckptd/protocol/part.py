"""The local-checkpoint part file: its header and where its tensors lie, for both sides.

A part starts with a magic, an 8-byte little-endian header length and a msgpack header
(skeleton, buffer descriptions, owner, iteration, session). Two layouts, told apart by
the magic, both read:

- version 2 (``PART_MAGIC_V2``, written now): the file mirrors the staging extent
  (:func:`ckptd.protocol.layout_extent` over the header and the tensors): every tensor
  starts on a 64-byte boundary of the file, every tensor of 64 KiB and more on a 4 KiB
  one, and the gaps are zeros. So the daemon writes a part from its page-aligned extent
  with O_DIRECT as it is, and a loader reads it with O_DIRECT straight into page-aligned
  memory where every tensor is in place for its dtype;
- version 1 (``PART_MAGIC``, written before): the tensors' bytes follow the header back to
  back, without padding.

Owns that layout (:func:`part_layout`) and the frame size parts stream in between daemons.
It must not do I/O itself: callers hand it bytes or a ``read`` function.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ckptd.protocol.errors import ProtocolError
from ckptd.protocol.framing import MAX_HEADER_BYTES, pack_value, unpack_value
from ckptd.protocol.layout import layout_extent
from ckptd.protocol.names import ErrorCode

__all__ = ["PART_MAGIC", "PART_MAGIC_V2", "PART_FRAME_BYTES", "encode_part_header",
           "decode_part_header", "read_part_header", "part_version", "part_layout"]

#: First bytes of a version 1 part (tensors back to back after the header).
PART_MAGIC = b"CKPTDPT1"
#: First bytes of a version 2 part (the file mirrors the staging extent).
PART_MAGIC_V2 = b"CKPTDPT2"
_MAGICS = {PART_MAGIC: 1, PART_MAGIC_V2: 2}
#: Replication streams parts in frames of this size: ZeroMQ measured here moves about
#: 3 GB/s with 4-16 MiB zero-copy frames and much less with 64 MiB ones.
PART_FRAME_BYTES = 4 * 1024 * 1024


def encode_part_header(skeleton: bytes, buffers: Sequence[list], owner: int, iteration: int,
                       session: str, version: int = 2) -> bytes:
    """The first bytes of a part file: magic, header length, msgpack header.

    The buffers' raw bytes follow where :func:`part_layout` puts them (``version`` 2:
    at their staging-extent offsets; 1: back to back), so a part is readable without
    unpickling anything and streams as one byte range.
    """
    header = pack_value({"skeleton": skeleton, "buffers": [list(b) for b in buffers],
                         "owner": owner, "iteration": iteration, "session": session})
    magic = {v: m for m, v in _MAGICS.items()}[version]
    return magic + len(header).to_bytes(8, "little") + header


def part_version(prefix: bytes) -> int:
    """The layout version of a part starting with ``prefix`` (0: not a part)."""
    return _MAGICS.get(bytes(prefix[:len(PART_MAGIC)]), 0)


def part_layout(version: int, header_bytes: int, nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each tensor starts in a part file, and the file's size.

    Parameters
    ----------
    version : int
        The part's layout version (:func:`part_version`).
    header_bytes : int
        Bytes of magic, length and msgpack header (the ``data_offset`` of
        :func:`decode_part_header`).
    nbytes : sequence of int
        Each tensor's size, in part order.
    """
    if version == 1:
        offsets, cursor = [], header_bytes
        for size in nbytes:
            offsets.append(cursor)
            cursor += size
        return offsets, cursor
    offsets, _ = layout_extent([header_bytes, *nbytes])
    ends = [o + n for o, n in zip(offsets, [header_bytes, *nbytes])]
    return offsets[1:], max(ends)


def decode_part_header(prefix: bytes) -> tuple[dict, int]:
    """Parse the header at the start of a part file.

    Returns
    -------
    (header, data_offset)
        The header map (with ``version``, the layout's, taken from the magic) and where
        the header ends.

    Raises
    ------
    ProtocolError
        If ``prefix`` does not start with a complete, valid part header.
    """
    fixed = len(PART_MAGIC) + 8
    version = part_version(prefix)
    if len(prefix) < fixed or not version:
        raise ProtocolError(ErrorCode.MALFORMED, "not a ckptd local-checkpoint part",
                            "the file does not start with the part magic")
    length = int.from_bytes(prefix[len(PART_MAGIC):fixed], "little")
    if length > MAX_HEADER_BYTES or len(prefix) < fixed + length:
        raise ProtocolError(ErrorCode.MALFORMED, f"part header of {length} bytes is truncated "
                            "or too large")
    header = unpack_value(bytes(prefix[fixed:fixed + length]))
    if not isinstance(header, dict) or not isinstance(header.get("buffers"), list):
        raise ProtocolError(ErrorCode.MALFORMED, "part header is not a map with 'buffers'")
    header["version"] = version  # from the magic: where the tensors lie (part_layout)
    return header, fixed + length


def read_part_header(read: Callable[[int], bytes]) -> tuple[dict, int]:
    """Read and parse a part header from a stream (``read(n)`` returns up to ``n`` bytes).

    Raises
    ------
    ProtocolError
        As :func:`decode_part_header`.
    """
    fixed = read(len(PART_MAGIC) + 8)
    length = int.from_bytes(fixed[len(PART_MAGIC):], "little") if len(fixed) == len(PART_MAGIC) + 8 else 0
    return decode_part_header(fixed + read(min(length, MAX_HEADER_BYTES)))
