"""Reading a local-checkpoint part file: one pass, checksummed as it is read.

A part is a msgpack header (:func:`ckptd.protocol.read_part_header`) followed by the raw
bytes of its tensors back to back; nothing is unpickled. The crc32 of every byte is folded
in while reading, and compared with the record beside the file at the end, so a part is
read once and never trusted unverified.
"""

from __future__ import annotations

import zlib

import torch

from ckptd import protocol
from ckptd.checksum import Checksum, check_matches, read_sidecar, verify_file


class _ChecksummingReader:
    """Reads a file once, folding every byte into a crc32 as it goes."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "rb")
        self.crc = 0
        self.size = 0

    def read(self, n: int) -> bytes:
        data = self._file.read(n)
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        got = self._file.readinto(view)
        self.crc = zlib.crc32(view[:got], self.crc)
        self.size += got
        return got

    def close(self) -> None:
        self._file.close()


def _parse_part(path: str, f: _ChecksummingReader) -> tuple[dict, list]:
    try:
        header, _ = protocol.read_part_header(f.read)
    except protocol.ProtocolError as exc:
        raise ValueError(f"{path}: {exc.message}") from None
    tensors = []
    for dtype, shape, nbytes in header["buffers"]:
        if dtype not in protocol.BUFFER_DTYPES or dtype == "bytes":
            raise ValueError(f"{path}: buffer dtype {dtype!r} is not a tensor dtype")
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes and f.readinto(memoryview(raw.numpy())) != nbytes:
            raise ValueError(f"{path} is truncated: a {nbytes}-byte tensor is incomplete")
        tensors.append(raw.view(getattr(torch, dtype)).view(shape))
    if f.read(1):
        raise ValueError(f"{path} has bytes after its last tensor")
    return header, tensors


def read_part(path: str) -> tuple[dict, dict]:
    """Read a local-checkpoint part in one pass, checking its checksum as it is read.

    Returns
    -------
    (state_dict, header)
        Tensors are fresh CPU tensors; nothing is unpickled.

    Raises
    ------
    ChecksumMismatchError
        If the part does not match the checksum recorded beside it.
    ValueError
        If the part is malformed (bad header, unknown dtype, truncated).
    """
    expected = read_sidecar(path)
    stream = _ChecksummingReader(path)
    try:
        header, tensors = _parse_part(path, stream)
    except ValueError:
        verify_file(path)  # corruption is reported as such, not as a malformed part
        raise
    finally:
        stream.close()
    check_matches(path, Checksum(stream.crc, stream.size), expected)
    return protocol.fill_skeleton(protocol.unpack_value(header["skeleton"]), tensors), header
