"""Checksums of written parts and the sidecar file that records them.

Every file ckptd writes gets ``<file>.ckptd-sum`` beside it: a small JSON document with
the record's version, the algorithm, the value and the size. Writers produce it while
writing (the daemon's ``ckptd.storage.durable`` writes it); loaders (ours, and ``ckptd
verify``) check a file against it before trusting the bytes, with the algorithm the record
names, so files written before the algorithm changed still verify.

Algorithms: ``crc32c`` (version 2 records; carry-less-multiply folding through the
``crc32c-rs`` package, ~20 GB/s a core, or the CPU's CRC32 instruction through the
``crc32c`` package, ~13 GB/s; both release the GIL) and ``crc32`` (zlib; the
version 1 records written before, and still selectable with ``CKPTD_CHECKSUM``).
Shared by the daemon and the client; importable without torch. ``__all__`` is what
``ckpt_client`` may use.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import zlib
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "SIDECAR_SUFFIX", "TMP_MARKER", "CORRUPT_MARKER", "ALGORITHM", "ALGORITHMS", "Algorithm",
    "ChecksumMismatchError", "Checksum", "ChecksumWriter", "algorithm_named", "sidecar_path",
    "checksum_file", "checksum_bytes", "read_sidecar", "verify_file", "check_matches",
    "verify_tree", "crc32_combine", "combine_pieces",
]

SIDECAR_SUFFIX = ".ckptd-sum"
#: Every temporary name ckptd writes under ends with this (never a checkpoint file).
TMP_MARKER = ".ckptd-tmp"
#: A part that failed its checksum is renamed ``<name>.corrupt-<time>``: kept, never loaded.
CORRUPT_MARKER = ".corrupt-"
#: ``<part>.ckptd-verified``: the daemon's note that it verified that very file (a cache,
#: not a checkpoint file: it has no record of its own).
VERIFIED_SUFFIX = ".ckptd-verified"
#: The algorithm of records that do not name one (none did before version 2).
ALGORITHM = "crc32"
_READ_CHUNK = 16 * 1024 * 1024
#: Version of the record written now; version 1 records (no ``version`` key) are crc32.
RECORD_VERSION = 2


class ChecksumMismatchError(Exception):
    """A file's bytes do not match the checksum recorded beside it."""


def _load_crc32c() -> Callable[..., int] | None:
    """The fastest CRC32C at hand: ``crc32c_rs`` folds with the CPU's carry-less multiply
    (~20 GB/s a core here), the ``crc32c`` package runs the CRC32 instruction (~13 GB/s);
    both release the GIL and compute the same values."""
    try:
        import crc32c_rs
        return crc32c_rs.crc32c
    except ImportError:
        pass
    try:
        import crc32c
        return crc32c.crc32c
    except ImportError:  # declared in pyproject.toml; a stripped image may lack both
        return None


_crc32c_update = _load_crc32c()


def _crc32c(data, value: int = 0) -> int:
    if _crc32c_update is None:
        raise ChecksumMismatchError(
            "this record is crc32c but neither the 'crc32c-rs' nor the 'crc32c' package is "
            "installed: pip install crc32c-rs") from None
    return _crc32c_update(data, value)


@dataclass(frozen=True)
class Algorithm:
    """A CRC: how to extend one over bytes, and its (bit-reflected) polynomial for folding."""

    name: str
    update: Callable[..., int]  # update(buffer, crc_so_far) -> crc
    polynomial: int


#: Every algorithm a record may name.
ALGORITHMS: dict[str, Algorithm] = {
    "crc32": Algorithm("crc32", zlib.crc32, 0xEDB88320),
    "crc32c": Algorithm("crc32c", _crc32c, 0x82F63B78),
}


def algorithm_named(name: str) -> Algorithm:
    """The algorithm a record names.

    Raises
    ------
    ChecksumMismatchError
        For a name this ckptd does not know (a record written by a newer one).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ChecksumMismatchError(
            f"unknown checksum algorithm {name!r} (known: {', '.join(ALGORITHMS)}); "
            "was the file written by a newer ckptd?") from None


@dataclass(frozen=True)
class Checksum:
    """The recorded checksum of one file."""

    value: int
    size: int
    algorithm: str = ALGORITHM

    def to_json(self) -> str:
        """Serialize for the sidecar file (a version 1 record for crc32, as before)."""
        doc = {"algorithm": self.algorithm, "value": f"{self.value:08x}", "size": self.size}
        if self.algorithm != "crc32":
            doc = {"version": RECORD_VERSION, **doc}
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> "Checksum":
        """Parse a sidecar file's content (any version)."""
        doc = json.loads(text)
        version = int(doc.get("version", 1))
        if version > RECORD_VERSION:
            raise ValueError(f"record version {version} is newer than this ckptd's "
                             f"({RECORD_VERSION})")
        algorithm = doc.get("algorithm", ALGORITHM)
        algorithm_named(algorithm)
        return cls(int(doc["value"], 16), int(doc["size"]), algorithm)


class ChecksumWriter:
    """A write-only stream that checksums what passes through it to ``target``."""

    def __init__(self, target, algorithm: str = ALGORITHM) -> None:
        self._target = target
        self.algorithm = algorithm_named(algorithm)
        self.crc = 0
        self.size = 0
        #: The OSError that stopped writing, kept because serializers that call
        #: ``write`` (torch.save) may re-raise it as a RuntimeError without the errno.
        self.error: OSError | None = None

    def write(self, data) -> int:
        """Write all of ``data`` (retrying short writes) and fold it into the checksum."""
        view = memoryview(data).cast("B")
        self.crc = self.algorithm.update(view, self.crc)
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
        return Checksum(self.crc, self.size, self.algorithm.name)


def sidecar_path(path: str) -> str:
    """Where the checksum of ``path`` is recorded."""
    return path + SIDECAR_SUFFIX


def checksum_file(path: str, algorithm: str = ALGORITHM) -> Checksum:
    """Compute the checksum of a file on disk, reading it in large pieces into one
    reused buffer (no page-cache-sized copies of the file held)."""
    update = algorithm_named(algorithm).update
    crc, size = 0, 0
    buffer = bytearray(_READ_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while done := f.readinto(buffer):
            crc = update(memoryview(buffer)[:done], crc)
            size += done
    return Checksum(crc, size, algorithm)


def checksum_bytes(data, algorithm: str = ALGORITHM) -> Checksum:
    """Compute the checksum of an in-memory buffer."""
    view = memoryview(data).cast("B")
    return Checksum(algorithm_named(algorithm).update(view, 0), len(view), algorithm)


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
    except (ValueError, KeyError, ChecksumMismatchError) as exc:
        raise ChecksumMismatchError(f"checksum record of {path} is unreadable: {exc}") from None


def verify_file(path: str) -> Checksum:
    """Check ``path`` against its sidecar; return the checksum when they agree.

    Raises
    ------
    ChecksumMismatchError
        If the sidecar is missing, or the size or checksum differs.
    """
    expected = read_sidecar(path)
    actual = checksum_file(path, expected.algorithm)
    check_matches(path, actual, expected)
    return actual


def check_matches(path: str, actual: Checksum, expected: Checksum) -> None:
    """Raise :class:`ChecksumMismatchError` unless ``actual`` is what was recorded."""
    if (actual.value, actual.size, actual.algorithm) != (
            expected.value, expected.size, expected.algorithm):
        raise ChecksumMismatchError(
            f"{path} is corrupted: {expected.algorithm} {actual.value:08x} over {actual.size} "
            f"bytes, but {expected.value:08x} over {expected.size} bytes was recorded; "
            "do not load it, use another copy")


def verify_tree(path: str) -> list[str]:
    """Verify a file, or every checkpoint file under a directory, against its record.

    Files ckptd writes (``.metadata``, ``*.distcp``, ``*.pt`` and everything else except
    sidecars, verification notes, temporaries and parts set aside as corrupted) must each
    have a matching sidecar.

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
                    or name.endswith(VERIFIED_SUFFIX) or CORRUPT_MARKER in name):
                continue
            full = os.path.join(directory, name)
            verify_file(full)
            checked.append(full)
    return sorted(checked)


# ------------------------------------------------------------------ crc of pieces
# A file written or received in pieces (by several threads, over several connections) is
# checksummed piece by piece; the file's checksum is folded from the pieces' (zlib's
# crc32_combine, which Python's zlib does not export): appending n bytes to a message
# multiplies its CRC by x^(8n) modulo the polynomial, and x^(2^k) is kept per k.

def _multiply(a: int, b: int, polynomial: int) -> int:
    """a * b modulo the (bit-reflected) polynomial."""
    product, mask = 0, 1 << 31
    while mask:
        if a & mask:
            product ^= b
        b = (b >> 1) ^ polynomial if b & 1 else b >> 1
        mask >>= 1
    return product


@functools.lru_cache(maxsize=None)
def _x_to_the_2_to_the(k: int, polynomial: int) -> int:
    """x^(2^k) modulo the polynomial."""
    if k == 0:
        return 1 << 30  # x^1, reflected
    half = _x_to_the_2_to_the(k - 1, polynomial)
    return _multiply(half, half, polynomial)


@functools.lru_cache(maxsize=256)
def _x_to_the_8(nbytes: int, polynomial: int) -> int:
    """x^(8 * nbytes) modulo the polynomial. Kept per length: a file's pieces are mostly
    of a few lengths (the write chunk, the bounce buffer), so folding a piece in costs one
    multiplication instead of one per bit of its length."""
    power, k = 1 << 31, 3  # x^0, reflected
    while nbytes:
        if nbytes & 1:
            power = _multiply(_x_to_the_2_to_the(k, polynomial), power, polynomial)
        nbytes >>= 1
        k += 1
    return power


def _shift(crc: int, nbytes: int, polynomial: int) -> int:
    """``crc`` times x^(8 * nbytes)."""
    return _multiply(_x_to_the_8(nbytes, polynomial), crc, polynomial)


def crc32_combine(crc1: int, crc2: int, len2: int, algorithm: str = "crc32") -> int:
    """The CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    if len2 <= 0:
        return crc1
    return _shift(crc1, len2, ALGORITHMS[algorithm].polynomial) ^ crc2


def combine_pieces(pieces, algorithm: str = ALGORITHM) -> Checksum:
    """The checksum of a file from its pieces' ``(offset, length, crc)``.

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
        crc = crc32_combine(crc, piece_crc, length, algorithm)
        size += length
    return Checksum(crc, size, algorithm)
