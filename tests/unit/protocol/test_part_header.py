"""The local-checkpoint part header: written by one side, read back by the other."""

import io

import pytest

from ckptd import protocol
from ckptd.protocol import ProtocolError


def header(**overrides) -> bytes:
    fields = dict(skeleton=b"sk", buffers=[["float32", [2], 8], ["bytes", [3], 3]], owner=4,
                  iteration=12, session="job")
    fields.update(overrides)
    return protocol.encode_part_header(**fields)


@pytest.mark.parametrize("version", [1, 2])
def test_the_header_reads_back_and_says_where_the_data_starts(version):
    raw = header(version=version)
    parsed, data_offset = protocol.decode_part_header(raw + b"\x01" * 11)
    assert data_offset == len(raw)
    assert parsed == {"skeleton": b"sk", "buffers": [["float32", [2], 8], ["bytes", [3], 3]],
                      "owner": 4, "iteration": 12, "session": "job", "version": version}


def test_version_1_parts_put_tensors_back_to_back_version_2_where_the_extent_does():
    sizes = [3, 70_000, 0, 8]
    assert protocol.part_layout(1, 100, sizes) == ([100, 103, 70_103, 70_103], 70_111)
    offsets, size = protocol.part_layout(2, 100, sizes)
    extent, _ = protocol.layout_extent([100, *sizes])
    assert offsets == extent[1:] and size == offsets[-1] + 8
    assert offsets[1] % 4096 == 0 and all(o % 64 == 0 for o in offsets)
    assert protocol.part_layout(2, 100, []) == ([], 100)


def test_the_header_reads_from_a_stream_without_reading_the_data():
    raw = header()
    stream = io.BytesIO(raw + b"DATA")
    parsed, data_offset = protocol.read_part_header(stream.read)
    assert data_offset == len(raw) == stream.tell() and parsed["owner"] == 4
    assert stream.read() == b"DATA"


@pytest.mark.parametrize("damage, complaint", [
    (lambda raw: b"NOTAPART" + raw[8:], "not a ckptd local-checkpoint part"),
    (lambda raw: raw[:5], "not a ckptd local-checkpoint part"),
    (lambda raw: raw[:-1], "truncated"),
    (lambda raw: raw[:8] + (protocol.MAX_HEADER_BYTES + 1).to_bytes(8, "little") + raw[16:],
     "too large"),
])
def test_a_damaged_header_is_refused(damage, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        protocol.decode_part_header(damage(header()))
    with pytest.raises(ProtocolError, match=complaint):
        protocol.read_part_header(io.BytesIO(damage(header())).read)


def test_a_header_without_buffers_is_refused():
    raw = protocol.pack_value({"owner": 1})
    prefix = protocol.PART_MAGIC + len(raw).to_bytes(8, "little") + raw
    with pytest.raises(ProtocolError, match="'buffers'"):
        protocol.decode_part_header(prefix)
