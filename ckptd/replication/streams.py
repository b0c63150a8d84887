"""Where the bytes of a part stream come from: the staging pool, or a part file.

- :class:`PoolItems`: a staged part read straight out of the staging pool, its buffers
  back to back (a push starts while the writers still write the local copy);
- :class:`FileSource`: a part file on disk (a holder serving a fetch).

Both hand out chunks of at most :data:`ckptd.protocol.PART_FRAME_BYTES` by position
(``frame(position)``), from any thread; the bulk connections (:mod:`.bulk_send`) decide
which chunk goes where.
"""

from __future__ import annotations

import bisect
import mmap
import os

from ckptd.protocol import PART_FRAME_BYTES


class PoolItems:
    """Reads a part out of the staging pool: its buffers back to back (padding skipped).

    Parameters
    ----------
    pool : mmap.mmap
        The staging pool, mapped read-only.
    items : list of (offset, nbytes)
        The part's buffers in order.
    """

    def __init__(self, pool: mmap.mmap, items: list) -> None:
        self.pool = pool
        self.items = [(int(offset), int(nbytes)) for offset, nbytes in items if int(nbytes) > 0]
        self.starts, cursor = [], 0
        for _, nbytes in self.items:
            self.starts.append(cursor)
            cursor += nbytes
        self.size = cursor

    def frame(self, position: int):
        """The frame at stream ``position``: at most PART_FRAME_BYTES; a slice of one large
        buffer is sent without copying, consecutive small buffers are joined."""
        index = bisect.bisect_right(self.starts, position) - 1
        pieces, length = [], 0
        while index < len(self.items) and length < PART_FRAME_BYTES:
            offset, nbytes = self.items[index]
            skip = position + length - self.starts[index]
            take = min(nbytes - skip, PART_FRAME_BYTES - length)
            pieces.append(memoryview(self.pool)[offset + skip:offset + skip + take])
            length += take
            index += 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        """Nothing to release: the pool stays mapped."""


class FileSource:
    """Reads a part file from disk for a fetch (``pread``: any thread, any order)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size

    def frame(self, position: int) -> bytes:
        """The frame at stream ``position``."""
        return os.pread(self.fd, min(PART_FRAME_BYTES, self.size - position), position)

    def close(self) -> None:
        """Close the file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
