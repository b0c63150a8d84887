"""Part streams between two daemons, one object per direction, with flow control.

- sources: :class:`PoolItems` (a staged part read straight out of the staging pool, its
  buffers back to back) and :class:`FileSource` (a part file on disk, for a fetch);
- :class:`OutStream`: a part this daemon sends (a push to a holder, or a holder's copy
  served to a fetcher). :meth:`OutStream.pump` sends ``PART_BEGIN``, then chunks while at
  most :data:`ckptd.knobs.REPLICATION_WINDOW` frames are unacknowledged, then
  ``PART_END`` with the crc32;
- :class:`InStream`: a part this daemon receives, written through a
  :class:`ckptd.storage.local_store.PartWriter` (dirty name, fsync, checksum, rename).

A stream only moves bytes and keeps its counters; starting, finishing and timing out
streams is the job of :mod:`ckptd.replication.outgoing` and :mod:`.incoming`.
"""

from __future__ import annotations

import bisect
import mmap
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from ckptd import knobs
from ckptd.protocol import PART_FRAME_BYTES
from ckptd.replication.transport import PeerStats, Sender
from ckptd.replication.wire import PartBegin, PartChunk, PartEnd
from ckptd.storage.local_store import PartWriter


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
    """Reads a part file from disk for a fetch."""

    def __init__(self, path: str) -> None:
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


@dataclass(kw_only=True)
class Stream:
    """What every part stream has: its id, its peer, how to send, and how it ends.

    ``on_finish(ok, error)`` is called once when the stream ends.
    """

    xfer: int
    kind: str
    peer: str
    send: Sender
    on_finish: Callable[[bool, str | None], None]
    stats: PeerStats | None = None
    owner: int | None = None
    iteration: int | None = None
    last_progress: float = field(default_factory=time.monotonic)


@dataclass(kw_only=True)
class OutStream(Stream):
    """A part this daemon sends: ``kind`` is ``"push"`` (to a holder) or ``"serve"`` (a
    holder's copy, to a fetcher)."""

    source: object
    begin: PartBegin
    request_id: int | None = None
    begin_sent: bool = False
    sent: int = 0
    acked: int = -1  # -1 until the receiver acknowledged PART_BEGIN
    crc: int = 0
    end_sent: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        """Bytes of the part."""
        return self.source.size

    def acknowledged(self, received: int) -> None:
        """The receiver has ``received`` bytes."""
        self.acked = received
        self.last_progress = time.monotonic()

    def pump(self) -> None:
        """Send what the window allows; stop where a send would block (retried later).

        Raises
        ------
        ckptd.replication.transport.PeerGone
            If the peer is unreachable.
        """
        if not self.begin_sent:
            self.begin_sent = self.send(self.begin)
            return
        if self.acked < 0:
            return
        window = knobs.REPLICATION_WINDOW.get() * PART_FRAME_BYTES
        while self.sent < self.size and self.sent - self.acked < window:
            frame = self.source.frame(self.sent)
            crc = zlib.crc32(frame, self.crc)
            if not self.send(PartChunk(self.xfer, self.sent), [frame]):
                return
            self.crc = crc
            self.sent += len(frame)
            if self.stats is not None:
                self.stats.bytes_sent += len(frame)
        if self.sent == self.size and not self.end_sent:
            self.end_sent = self.send(PartEnd(self.xfer, crc=self.crc, size=self.size))


@dataclass(kw_only=True)
class InStream(Stream):
    """A part this daemon receives: ``kind`` is ``"replica"`` (pushed to it) or
    ``"fetch"`` (asked for)."""

    path: str
    writer: PartWriter | None = None
    size: int = -1
    expected_crc: int | None = None
    pending_get: object | None = None  # a PART_GET still to send (fetches)

    @property
    def received(self) -> int:
        """Bytes written so far."""
        return self.writer.size if self.writer else 0

    def begin(self, size: int, expected_crc: int | None) -> None:
        """The sender announced the part: open the dirty file."""
        self.size = size
        self.expected_crc = expected_crc
        self.writer = PartWriter(self.path)
        self.last_progress = time.monotonic()

    def chunk(self, offset: int, frame) -> str | None:
        """Write one frame; the reason to give up, or ``None``."""
        if self.writer is None or offset != self.received:
            return f"chunk at offset {offset} arrived, expected {self.received}"
        try:
            self.writer.write(frame)
        except OSError as exc:
            return f"writing {self.path} failed: {exc}"
        self.last_progress = time.monotonic()
        if self.stats is not None:
            self.stats.bytes_received += len(frame)
        return None

    def discard(self) -> None:
        """Drop what was received."""
        if self.writer is not None:
            self.writer.discard()
            self.writer = None
