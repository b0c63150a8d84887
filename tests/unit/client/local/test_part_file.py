"""Reading a local part, from its file or from the daemon's memory: every byte checked with
the algorithm its record names (parts written before the checksum changed, crc32 records,
still load), version 1 parts (tensors back to back) as well as version 2 (the file mirrors
the staging extent), direct and buffered reads alike; bit-equal tensors of odd sizes and
dtypes, zero-size ones and ones ending on and just past a 4 KiB boundary; and a flipped byte
never loads, wherever it is."""

import json
import zlib

import pytest
import torch

from ckpt_client.local.part_file import read_part, read_resident
from ckptd import knobs, protocol
from ckptd.checksum import ChecksumMismatchError, checksum_bytes


def odd_tensors() -> dict:
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(3000, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),   # 14 bytes: shifts the rest
        "u8": torch.randint(0, 255, (4093,), dtype=torch.uint8, generator=gen),
        "empty": torch.empty(0, 5, dtype=torch.float64),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(33, generator=gen) > 0.5,
        "page": torch.randn(1024, generator=gen),                # ends exactly on 4 KiB
        "past": torch.randint(0, 9, (4097,), dtype=torch.int8, generator=gen),  # 1 B past
        "big": torch.randn(40_000, generator=gen).to(torch.float16),  # page-aligned in v2
        "half": torch.randn(3, 5, generator=gen).to(torch.float16).t(),  # non-contiguous
        "c": torch.randn(9, dtype=torch.complex64, generator=gen),
    }


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def part_bytes(tensors: dict, version: int) -> bytes:
    """A part file as the daemon writes it (version 2: gaps zeroed)."""
    names = list(tensors)
    buffers = [[str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()]
               for t in tensors.values()]
    skeleton = protocol.pack_value({n: protocol.TensorRef(i) for i, n in enumerate(names)})
    header = protocol.encode_part_header(skeleton, buffers, owner=0, iteration=1, session="",
                                         version=version)
    offsets, size = protocol.part_layout(version, len(header), [b[2] for b in buffers])
    data = bytearray(size)
    data[:len(header)] = header
    for t, offset in zip(tensors.values(), offsets):
        data[offset:offset + len(raw(t))] = raw(t)
    return bytes(data)


def write(tmp_path, data: bytes, record: str = "crc32c"):
    path = tmp_path / "rank_0.part"
    path.write_bytes(data)
    sidecar = tmp_path / "rank_0.part.ckptd-sum"
    if record == "crc32-v1":  # as written before records had a version
        sidecar.write_text(json.dumps({"algorithm": "crc32", "value": f"{zlib.crc32(data):08x}",
                                       "size": len(data)}))
    else:
        sidecar.write_text(checksum_bytes(data, record).to_json())
    return path


def assert_same(state: dict, tensors: dict) -> None:
    assert list(state) == list(tensors)
    for name, tensor in tensors.items():
        got = state[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert raw(got) == raw(tensor), name


@pytest.mark.parametrize("mode", ["direct", "buffered"])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("record", ["crc32-v1", "crc32c"])
def test_a_part_file_loads_bit_equal_and_a_flipped_byte_is_caught(tmp_path, mode, version,
                                                                   record):
    tensors = odd_tensors()
    data = part_bytes(tensors, version)
    path = write(tmp_path, data, record)
    with knobs.override(LOAD_READ_MODE=mode, LOAD_READ_BYTES=8192):  # many reads per thread
        state, header = read_part(str(path))
        assert_same(state, tensors)
        assert header["version"] == version
        if version == 2:  # every tensor is a view of one buffer, none copied out
            assert len({t.untyped_storage().data_ptr() for t in state.values()}) == 1
        for where in (0, len(data) // 2, len(data) - 1):
            flipped = bytearray(data)
            flipped[where] ^= 0x01
            path.write_bytes(bytes(flipped))
            with pytest.raises(ChecksumMismatchError):
                read_part(str(path))


def test_a_truncated_part_is_reported_as_corrupted(tmp_path):
    data = part_bytes(odd_tensors(), 2)
    path = write(tmp_path, data)
    path.write_bytes(data[:-10])
    with pytest.raises(ChecksumMismatchError):
        read_part(str(path))


def test_a_part_of_no_tensors_loads(tmp_path):
    path = write(tmp_path, part_bytes({}, 2))
    state, _ = read_part(str(path))
    assert state == {}


def pool_with(tensors: dict, version: int, base: int = 3 * 4096):
    """A staging pool holding a part where layout_extent puts its buffers (gaps left
    dirty, as a reused pool has them), and what the daemon's inventory says of it."""
    data = part_bytes(tensors, version)
    header_len = protocol.decode_part_header(data)[1]
    sizes = [len(raw(t)) for t in tensors.values()]
    file_offsets, _ = protocol.part_layout(version, header_len, sizes)
    extent, length = protocol.layout_extent([header_len, *sizes])
    pool = torch.full((base + length + 4096,), 0xA5, dtype=torch.uint8)
    items = [[base, header_len]]
    pool[base:base + header_len] = torch.frombuffer(bytearray(data[:header_len]), dtype=torch.uint8)
    for offset, source, size in zip(extent[1:], file_offsets, sizes):
        if size:
            pool[base + offset:base + offset + size] = torch.frombuffer(
                bytearray(data[source:source + size]), dtype=torch.uint8)
        items.append([base + offset, size])
    if version == 2:  # the daemon zeroed the gaps before writing the file
        span = max(o + n for o, n in items) - base
        pool[base:base + span] = torch.frombuffer(bytearray(data[:span]), dtype=torch.uint8)
    record = checksum_bytes(data, "crc32c")
    return pool, {"items": items, "crc": record.value, "size": record.size,
                  "algorithm": "crc32c"}


@pytest.mark.parametrize("version", [1, 2])
def test_a_resident_part_copies_bit_equal_and_changed_memory_is_caught(version):
    tensors = odd_tensors()
    pool, resident = pool_with(tensors, version)
    with knobs.override(LOAD_COPY_BYTES=4096):  # many pieces per thread
        state, _ = read_resident(pool, resident, "rank 0's part")
    assert_same(state, tensors)
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == 1
    for offset, nbytes in resident["items"][1:]:
        if nbytes:
            pool[offset + nbytes - 1] ^= 0x10
            with pytest.raises(ChecksumMismatchError, match="changed"):
                read_resident(pool, resident, "rank 0's part")
            pool[offset + nbytes - 1] ^= 0x10


def test_a_resident_part_outside_the_pool_is_refused():
    pool, resident = pool_with({"w": torch.ones(4)}, 2)
    resident["items"][-1][1] = pool.numel()
    with pytest.raises(ChecksumMismatchError, match="outside"):
        read_resident(pool, resident, "rank 0's part")
