"""Where part streams read from: the staging pool's items back to back, or a part file."""

import mmap

import pytest

from ckptd.protocol import PART_FRAME_BYTES
from ckptd.replication.streams import FileSource, PoolItems


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


def test_a_large_buffer_is_streamed_without_a_copy(pool):
    items = PoolItems(pool, [(4096, 2 * PART_FRAME_BYTES)])
    frame = items.frame(PART_FRAME_BYTES)
    assert isinstance(frame, memoryview), "a slice of one buffer is a view of the pool"
    assert bytes(frame) == pool[4096 + PART_FRAME_BYTES:4096 + 2 * PART_FRAME_BYTES]


def test_a_file_source_reads_frames_at_any_position(tmp_path):
    path = tmp_path / "part"
    data = bytes(range(256)) * (PART_FRAME_BYTES // 256 + 3)
    path.write_bytes(data)
    source = FileSource(str(path))
    try:
        assert source.size == len(data)
        assert source.frame(PART_FRAME_BYTES) == data[PART_FRAME_BYTES:]
        assert source.frame(0) == data[:PART_FRAME_BYTES]
    finally:
        source.close()
