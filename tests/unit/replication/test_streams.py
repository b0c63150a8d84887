"""Part streams: frames out of the pool, the flow-control window, in-order receipt."""

import mmap
import zlib

import pytest

from ckptd import knobs
from ckptd.protocol import PART_FRAME_BYTES
from ckptd.replication.streams import InStream, OutStream, PoolItems
from ckptd.replication.wire import PartBegin, PartChunk, PartEnd


@pytest.fixture
def pool():
    memory = mmap.mmap(-1, 3 * PART_FRAME_BYTES)
    for i in range(0, len(memory), 4096):
        memory[i:i + 4096] = bytes([i // 4096 % 251]) * 4096
    yield memory
    memory.close()


def test_pool_items_stream_back_to_back_without_the_padding(pool):
    items = PoolItems(pool, [(0, 10), (64, 0), (128, PART_FRAME_BYTES + 5)])
    assert items.size == 10 + PART_FRAME_BYTES + 5
    first = bytes(items.frame(0))
    assert len(first) == PART_FRAME_BYTES
    assert first[:10] == pool[0:10] and first[10:] == pool[128:128 + PART_FRAME_BYTES - 10]
    assert bytes(items.frame(PART_FRAME_BYTES)) == pool[128 + PART_FRAME_BYTES - 10:
                                                         128 + PART_FRAME_BYTES + 5]


class Wire:
    """Collects what a stream sends; `blocked` makes sends report 'would block'."""

    def __init__(self) -> None:
        self.sent, self.blocked = [], False

    def __call__(self, body, frames=()):
        if self.blocked:
            return False
        self.sent.append((body, [bytes(f) for f in frames]))
        return True


def test_a_sender_keeps_at_most_the_window_unacknowledged(pool):
    wire = Wire()
    source = PoolItems(pool, [(0, 3 * PART_FRAME_BYTES)])
    stream = OutStream(xfer=7, kind="push", peer="tcp://n1:1", send=wire, source=source,
                       begin=PartBegin(7, source.size), on_finish=lambda ok, error: None)
    with knobs.override(REPLICATION_WINDOW=2):
        stream.pump()
        assert [type(b) for b, _ in wire.sent] == [PartBegin]
        stream.pump()
        assert wire.sent[1:] == [], "nothing before the receiver acknowledged the begin"
        stream.acknowledged(0)
        stream.pump()
        assert [b.offset for b, _ in wire.sent[1:]] == [0, PART_FRAME_BYTES]
        wire.blocked = True
        stream.acknowledged(PART_FRAME_BYTES)
        stream.pump()
        assert stream.sent == 2 * PART_FRAME_BYTES, "a blocked send is retried later"
        wire.blocked = False
        stream.pump()
    end = wire.sent[-1][0]
    assert isinstance(end, PartEnd) and end.size == source.size
    data = b"".join(f[0] for b, f in wire.sent if isinstance(b, PartChunk))
    assert end.crc == zlib.crc32(data) and data == pool[:3 * PART_FRAME_BYTES]


def test_a_receiver_refuses_a_chunk_out_of_order(tmp_path):
    stream = InStream(xfer=9, kind="replica", peer="peer", send=Wire(),
                      path=str(tmp_path / "rank_0.part"), on_finish=lambda ok, error: None)
    stream.begin(8, None)
    assert stream.chunk(0, b"abcd") is None and stream.received == 4
    assert "expected 4" in stream.chunk(2, b"cdef")
    stream.discard()
    assert list(tmp_path.iterdir()) == []
