"""One part streamed to one peer on the bulk path, and how long a peer may stay silent.

Owns the state of a single transfer (:class:`SendJob`): which chunks the receiver has
acknowledged, how many bytes that is, the checksums of what was read when serving a copy
(so a copy that no longer matches its record is never completed), and when it last made
progress. The lanes and connections that move its chunks are
:mod:`ckptd.replication.bulk_send`'s; nothing here touches a socket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ckptd import knobs
from ckptd.checksum import combine_pieces
from ckptd.protocol import PART_FRAME_BYTES
from ckptd.replication.bulk_wire import Begin


def io_timeout() -> float:
    """Seconds a bulk connection's peer may leave bytes unacknowledged (or keepalive
    probes unanswered) before the kernel drops the connection."""
    return max(knobs.PEER_TIMEOUT.get(), 1.0)


@dataclass(eq=False)
class SendJob:
    """One part streamed to one peer.

    ``begin`` is the ``BEGIN`` body (which part, and the recorded crc32 when serving);
    ``expected_crc`` makes the job check the bytes it reads against that record.
    """

    xfer: int
    kind: str                     # "push" or "serve"
    peer: str                     # the receiver's control address (status, logs)
    source: object                # PoolItems or FileSource: .size, .frame(position), .close()
    begin: Begin
    stats: object                 # the peer's PeerStats
    expected_crc: int | None = None
    request_id: int | None = None
    owner: int | None = None
    iteration: int | None = None
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    acked: set = field(default_factory=set)          # chunk offsets the receiver wrote
    acked_bytes: int = 0
    crcs: dict = field(default_factory=dict)         # offset -> (length, crc32), serving
    end_queued: bool = False
    finished: bool = False
    abort_reason: str | None = None
    sending: int = 0                                 # chunks being read/sent right now

    @property
    def size(self) -> int:
        """Bytes of the part."""
        return self.source.size

    def offsets(self) -> list[int]:
        """Chunk offsets not acknowledged yet."""
        return [o for o in range(0, self.size, PART_FRAME_BYTES) if o not in self.acked]

    def chunk_length(self, offset: int) -> int:
        """Bytes of the chunk at ``offset``."""
        return min(PART_FRAME_BYTES, self.size - offset)

    def acknowledge(self, offset: int) -> None:
        """The receiver wrote the chunk at ``offset``."""
        length = self.chunk_length(offset)
        self.acked.add(offset)
        self.acked_bytes += length
        self.last_progress = time.monotonic()
        self.stats.add(sent=length)

    def corruption(self) -> str | None:
        """Why the bytes read do not match the recorded crc32 (serving), else ``None``."""
        if self.expected_crc is None:
            return None
        checksum = combine_pieces(((o, n, c) for o, (n, c) in self.crcs.items()),
                                  self.begin.algorithm)
        if checksum.value == self.expected_crc:
            return None
        return (f"this daemon's copy is corrupted: {checksum.algorithm} {checksum.value:08x} read, "
                f"{self.expected_crc:08x} recorded; not sent")
