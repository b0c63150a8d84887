"""Checksum sidecars: recorded while writing, verified before trusting bytes."""

import pytest

from ckptd.checksum import (ChecksumMismatchError, ChecksumWriter, checksum_bytes, read_sidecar,
                            verify_file, write_sidecar)


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


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_record_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    import os
    import subprocess

    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        filler = mount / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        with pytest.raises(OSError):
            write_sidecar(str(mount / "part"), checksum_bytes(b"x"))
        assert sorted(os.listdir(mount)) == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
