"""Checksums of written parts and the sidecar file that records them.

Every file ckptd writes gets ``<file>.ckptd-sum`` beside it: a small JSON document with
the algorithm, the value and the size. Writers produce it while writing (the daemon's
``ckptd.storage.durable`` writes it); loaders (ours, and ``ckptd verify``) check a file
against it before trusting the bytes. Shared by the daemon and the client; importable
without torch. ``__all__`` is what ``ckpt_client`` may use.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import zlib
from dataclasses import dataclass

__all__ = [
    "SIDECAR_SUFFIX", "TMP_MARKER", "CORRUPT_MARKER", "ALGORITHM", "ChecksumMismatchError", "Checksum",
    "ChecksumWriter", "sidecar_path", "checksum_file", "checksum_bytes", "read_sidecar",
    "verify_file", "check_matches", "verify_tree", "crc32_combine", "combine_pieces",
]

SIDECAR_SUFFIX = ".ckptd-sum"
#: Every temporary name ckptd writes under ends with this (never a checkpoint file).
TMP_MARKER = ".ckptd-tmp"
#: A part that failed its checksum is renamed ``<name>.corrupt-<time>``: kept, never loaded.
CORRUPT_MARKER = ".corrupt-"
ALGORITHM = "crc32"
_READ_CHUNK = 16 * 1024 * 1024


class ChecksumMismatchError(Exception):
    """A file's bytes do not match the checksum recorded beside it."""


@dataclass(frozen=True)
class Checksum:
    """The recorded checksum of one file."""

    value: int
    size: int
    algorithm: str = ALGORITHM

    def to_json(self) -> str:
        """Serialize for the sidecar file."""
        return json.dumps({"algorithm": self.algorithm, "value": f"{self.value:08x}",
                           "size": self.size})

    @classmethod
    def from_json(cls, text: str) -> "Checksum":
        """Parse a sidecar file's content."""
        doc = json.loads(text)
        return cls(int(doc["value"], 16), int(doc["size"]), doc["algorithm"])


class ChecksumWriter:
    """A write-only stream that checksums what passes through it to ``target``."""

    def __init__(self, target) -> None:
        self._target = target
        self.crc = 0
        self.size = 0
        #: The OSError that stopped writing, kept because serializers that call
        #: ``write`` (torch.save) may re-raise it as a RuntimeError without the errno.
        self.error: OSError | None = None

    def write(self, data) -> int:
        """Write all of ``data`` (retrying short writes) and fold it into the checksum."""
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        return self._write_all(view)

    def _write_all(self, view: memoryview) -> int:
        done = 0
        try:
            while done < view.nbytes:
                written = self._target.write(view[done:])
                if not written:
                    raise OSError(errno.EIO, "write returned no progress")
                done += written
        except OSError as exc:
            self.error = exc
            raise
        self.size += done
        return done

    def tell(self) -> int:
        """Bytes written so far."""
        return self.size

    def flush(self) -> None:
        """Flush the underlying stream."""
        self._target.flush()

    def result(self) -> Checksum:
        """The checksum of everything written."""
        return Checksum(self.crc, self.size)


def sidecar_path(path: str) -> str:
    """Where the checksum of ``path`` is recorded."""
    return path + SIDECAR_SUFFIX


def checksum_file(path: str) -> Checksum:
    """Compute the checksum of a file on disk."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return Checksum(crc, size)


def checksum_bytes(data) -> Checksum:
    """Compute the checksum of an in-memory buffer."""
    view = memoryview(data).cast("B")
    return Checksum(zlib.crc32(view), len(view))


def read_sidecar(path: str) -> Checksum:
    """The checksum recorded beside ``path``.

    Raises
    ------
    ChecksumMismatchError
        If the sidecar is missing or unreadable.
    """
    try:
        with open(sidecar_path(path)) as f:
            return Checksum.from_json(f.read())
    except FileNotFoundError:
        raise ChecksumMismatchError(
            f"{path} has no checksum record ({sidecar_path(path)} is missing); "
            "it was not written completely by ckptd") from None
    except (ValueError, KeyError) as exc:
        raise ChecksumMismatchError(f"checksum record of {path} is unreadable: {exc}") from None


def verify_file(path: str) -> Checksum:
    """Check ``path`` against its sidecar; return the checksum when they agree.

    Raises
    ------
    ChecksumMismatchError
        If the sidecar is missing, or the size or checksum differs.
    """
    expected = read_sidecar(path)
    actual = checksum_file(path)
    check_matches(path, actual, expected)
    return actual


def check_matches(path: str, actual: Checksum, expected: Checksum) -> None:
    """Raise :class:`ChecksumMismatchError` unless ``actual`` is what was recorded."""
    if (actual.value, actual.size) != (expected.value, expected.size):
        raise ChecksumMismatchError(
            f"{path} is corrupted: {expected.algorithm} {actual.value:08x} over {actual.size} "
            f"bytes, but {expected.value:08x} over {expected.size} bytes was recorded; "
            "do not load it, use another copy")


def verify_tree(path: str) -> list[str]:
    """Verify a file, or every checkpoint file under a directory, against its record.

    Files ckptd writes (``.metadata``, ``*.distcp``, ``*.pt`` and everything else except
    sidecars, temporaries and parts set aside as corrupted) must each have a matching
    sidecar.

    Returns
    -------
    list of str
        Paths verified, sorted.

    Raises
    ------
    ChecksumMismatchError
        On the first mismatch or missing record.
    """
    if os.path.isfile(path):
        verify_file(path)
        return [path]
    checked = []
    for directory, _, names in os.walk(path):
        for name in sorted(names):
            if (name.endswith(SIDECAR_SUFFIX) or name.endswith(TMP_MARKER)
                    or CORRUPT_MARKER in name):
                continue
            full = os.path.join(directory, name)
            verify_file(full)
            checked.append(full)
    return sorted(checked)


# ------------------------------------------------------------------ crc32 of pieces
# A file received in pieces over several connections is checksummed piece by piece, as
# each piece arrives; the file's crc32 is then folded from the pieces' crc32 (zlib's
# crc32_combine, which Python's zlib does not export). Appending n zero bytes to a
# message is a linear map of its crc32 over GF(2): a 32x32 matrix, kept per length.

def _gf2_times(matrix: tuple, vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_compose(outer: tuple, inner: tuple) -> tuple:
    return tuple(_gf2_times(outer, column) for column in inner)


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple:
    """The matrix that turns crc32(A) into crc32(A + nbytes zero bytes) (pre/post
    conditioning aside, as in zlib)."""
    one_bit = (0xEDB88320,) + tuple(1 << n for n in range(31))
    power = _gf2_compose(one_bit, one_bit)        # 2 zero bits
    power = _gf2_compose(power, power)            # 4
    power = _gf2_compose(power, power)            # 8 = one zero byte
    result = tuple(1 << n for n in range(32))     # identity
    while nbytes:
        if nbytes & 1:
            result = _gf2_compose(power, result)
        nbytes >>= 1
        if nbytes:
            power = _gf2_compose(power, power)
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


def combine_pieces(pieces) -> Checksum:
    """The checksum of a file from its pieces' ``(offset, length, crc32)``.

    Raises
    ------
    ValueError
        If the pieces do not tile ``[0, size)`` without gaps or overlaps.
    """
    crc, size = 0, 0
    for offset, length, piece_crc in sorted(pieces):
        if offset != size:
            raise ValueError(f"pieces leave a gap or overlap at byte {size} (next piece at "
                             f"{offset})")
        crc = crc32_combine(crc, piece_crc, length)
        size += length
    return Checksum(crc, size)
