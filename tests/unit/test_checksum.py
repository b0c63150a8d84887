"""Checksum sidecars: recorded while writing, verified before trusting bytes."""

import pytest

from ckptd.checksum import (ChecksumMismatchError, ChecksumWriter, checksum_bytes, read_sidecar,
                            verify_file)


def write_sidecar(path: str, checksum) -> None:
    """The record a writer leaves beside a file (here written by hand)."""
    with open(path + ".ckptd-sum", "w") as f:
        f.write(checksum.to_json())


def test_writer_checksum_matches_the_file_and_verifies(tmp_path):
    path = tmp_path / "part"
    with open(path, "wb") as f:
        stream = ChecksumWriter(f)
        stream.write(b"abc")
        stream.write(memoryview(b"defgh"))
    write_sidecar(str(path), stream.result())
    assert stream.result() == checksum_bytes(b"abcdefgh")
    assert verify_file(str(path)).size == 8


def test_a_flipped_byte_is_detected(tmp_path):
    path = tmp_path / "part"
    path.write_bytes(b"0123456789")
    write_sidecar(str(path), checksum_bytes(b"0123456789"))
    data = bytearray(path.read_bytes())
    data[4] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="corrupted"):
        verify_file(str(path))


def test_a_missing_or_broken_record_is_an_error(tmp_path):
    path = tmp_path / "part"
    path.write_bytes(b"x")
    with pytest.raises(ChecksumMismatchError, match="no checksum record"):
        verify_file(str(path))
    (tmp_path / "part.ckptd-sum").write_text("{not json")
    with pytest.raises(ChecksumMismatchError, match="unreadable"):
        read_sidecar(str(path))


def test_a_file_checksummed_in_pieces_out_of_order_has_the_whole_files_crc():
    import os
    import zlib

    from ckptd.checksum import combine_pieces, crc32_combine

    data = os.urandom(3 * 4096 + 17)
    cuts = [0, 100, 4096, 9000, len(data)]
    pieces = [(a, b - a, zlib.crc32(data[a:b])) for a, b in zip(cuts, cuts[1:])]
    assert combine_pieces(reversed(pieces)) == checksum_bytes(data)
    assert crc32_combine(zlib.crc32(data[:5]), zlib.crc32(data[5:]), len(data) - 5) == \
        zlib.crc32(data)
    with pytest.raises(ValueError, match="gap"):
        combine_pieces(pieces[:1] + pieces[2:])


# ---------------------------------------------------------------- record versions

import json  # noqa: E402
import zlib  # noqa: E402

import crc32c  # noqa: E402

from ckptd.checksum import Checksum, checksum_file  # noqa: E402


def test_new_records_are_version_2_crc32c_and_old_crc32_records_still_verify(tmp_path):
    data = bytes(range(256)) * 300
    path = tmp_path / "part"
    path.write_bytes(data)
    # a record as ckptd wrote them before records had a version: zlib's crc32
    (tmp_path / "part.ckptd-sum").write_text(json.dumps(
        {"algorithm": "crc32", "value": f"{zlib.crc32(data):08x}", "size": len(data)}))
    assert verify_file(str(path)) == Checksum(zlib.crc32(data), len(data), "crc32")
    write_sidecar(str(path), checksum_bytes(data, "crc32c"))
    record = json.loads((tmp_path / "part.ckptd-sum").read_text())
    assert record["version"] == 2 and record["algorithm"] == "crc32c"
    assert verify_file(str(path)).value == crc32c.crc32c(data)
    assert checksum_file(str(path), "crc32c") == read_sidecar(str(path))


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_a_flipped_byte_is_caught_whatever_the_records_algorithm(tmp_path, algorithm):
    path = tmp_path / "part"
    path.write_bytes(b"x" * 5000)
    write_sidecar(str(path), checksum_bytes(path.read_bytes(), algorithm))
    data = bytearray(path.read_bytes())
    data[4321] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=f"corrupted: {algorithm} "):
        verify_file(str(path))


def test_a_record_from_a_newer_ckptd_is_unreadable_not_trusted(tmp_path):
    path = tmp_path / "part"
    path.write_bytes(b"x")
    (tmp_path / "part.ckptd-sum").write_text(json.dumps(
        {"version": 3, "algorithm": "crc32c", "value": "0", "size": 1}))
    with pytest.raises(ChecksumMismatchError, match="unreadable.*newer"):
        verify_file(str(path))
    (tmp_path / "part.ckptd-sum").write_text(json.dumps(
        {"version": 2, "algorithm": "blake9", "value": "0", "size": 1}))
    with pytest.raises(ChecksumMismatchError, match="unknown checksum algorithm"):
        verify_file(str(path))


def test_crc32c_pieces_fold_into_the_whole_files():
    import os

    from ckptd.checksum import combine_pieces

    data = os.urandom(5 * 4096 + 3)
    cuts = [0, 7, 4096, 4097, 3 * 4096, len(data)]
    pieces = [(a, b - a, crc32c.crc32c(data[a:b])) for a, b in zip(cuts, cuts[1:])]
    assert combine_pieces(pieces, "crc32c") == checksum_bytes(data, "crc32c")
