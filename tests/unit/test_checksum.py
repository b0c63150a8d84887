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
