"""torch's zip container, written as a stream without torch.

Owns the records of a ``torch.save`` archive after its pickle: each record is a local
header, its data and a data descriptor (sizes and CRC come *after* the data, so nothing is
ever sought back); the central directory and the zip64 end records close the archive. It
mirrors torch's miniz (zip64 records, ``FB`` padding that puts each record's first data
byte on the storage alignment, zero timestamps) and ``PyTorchStreamWriter``'s serialization
id (libstdc++ ``std::hash`` of the record names, combined in ``std::unordered_set`` order,
and the CRCs of the data descriptors), so the archive is byte for byte torch's.

Small records are gathered with the headers into few large writes; large ones go to the
stream straight from their buffer (a view of the staging pool), in slices of
``max_write``. The stream decides how bytes reach the disk (buffered or O_DIRECT).

Must not import torch.
"""

from __future__ import annotations

import functools
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

__all__ = ["ArchiveWriter", "DEFAULT_ALIGNMENT", "GATHER_BELOW", "END_RECORDS_SIZE",
           "serialization_names_hash"]

_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
#: Bytes of the records after the central directory (zip64 end, its locator, end).
END_RECORDS_SIZE = _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_UTF8_NAMES = 0x0800      # general purpose flag: names are UTF-8
_HAS_DESCRIPTOR = 0x0008  # general purpose flag: CRC and sizes follow the data
#: torch's default storage alignment (its ``.storage_alignment`` record); ckptd's own files
#: use the page size instead, so every record's data can be written with O_DIRECT.
DEFAULT_ALIGNMENT = 64

_crc_thread: ThreadPoolExecutor | None = None


def _crc_executor() -> ThreadPoolExecutor:
    global _crc_thread
    if _crc_thread is None:
        _crc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-zipcrc")
    return _crc_thread


def _zip64_extra(size: int, offset: int, compressed: int) -> bytes:
    """miniz's zip64 extended information field: the sizes if the record is >= 4 GiB, the
    local header offset if it is >= 4 GiB; b'' when neither is.

    miniz fills the local header's copy before the data is written, with a compressed size
    of 0, and the central directory's copy after, with the real one.
    """
    values = []
    if size >= _U32_MAX:
        values += [size, compressed]
    if offset >= _U32_MAX:
        values.append(offset)
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values)


# Headers, descriptors and records under this size are gathered into one write of up to
# _GATHER_FLUSH bytes: for the thousands of small tensors of an optimizer state, copying a
# few KiB is far cheaper than a write call (and its system call, checksum hand-off and
# writeback check) per piece. Larger records go to the stream straight from their buffer.
GATHER_BELOW = 64 << 10
_GATHER_FLUSH = 1 << 20


class ArchiveWriter:
    """Writes torch's zip records to a stream, in order, and closes the archive.

    Positions are counted from the archive's first byte (a DCP item's archive starts
    wherever the ``.distcp`` file is), as torch's writer counts them.
    """

    def __init__(self, stream: Any, crc32: bool, max_write: int | None,
                 alignment: int = DEFAULT_ALIGNMENT) -> None:
        self.stream = stream
        self.alignment = alignment
        self.crc32 = crc32
        self.max_write = max_write
        self.position = 0
        self.central = bytearray()
        self.records = 0
        self.descriptor_crcs = 0  # PyTorchStreamWriter::combined_uncomp_crc32_
        #: Where each record's data starts, in record order.
        self.data_starts: list[int] = []
        self._gathered = bytearray()

    def _write(self, data: Any, gather: bool = True) -> None:
        view = memoryview(data).cast("B")
        self.position += view.nbytes
        if gather:
            self._gathered += view
            if len(self._gathered) >= _GATHER_FLUSH:
                self._flush()
        else:
            self._flush()
            self.stream.write(view)

    def flush(self) -> None:
        """Write what is gathered (the archive goes on after it)."""
        self._flush()

    def _flush(self) -> None:
        if self._gathered:
            self.stream.write(self._gathered)
            self._gathered = bytearray()

    def record(self, name: str, data: Any, alignment: int | None = None) -> None:
        """One stored (uncompressed) record whose data is the buffer ``data``, starting on
        ``alignment`` (default: the archive's)."""
        data = memoryview(data).cast("B")
        size = data.nbytes
        full_name = f"archive/{name}".encode()
        offset = self.position
        zip64 = _zip64_extra(size, offset, compressed=0)
        # torch pads the extra field so the data starts on the alignment
        # (caffe2::serialize::detail::getPadding), after a 4-byte "FB" field header.
        start = offset + _LOCAL_HEADER.size + len(full_name) + 4 + len(zip64)
        padding = -start % (alignment or self.alignment)
        self.data_starts.append(start + padding)
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = _UTF8_NAMES | (_HAS_DESCRIPTOR if size else 0)
        self._write(_LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0,
                                       len(full_name), len(extra)) + full_name + extra)
        crc = self._write_data(data)
        if size:
            if size >= 8 and data[:4] == _DESCRIPTOR_SIGNATURE:
                # torch's writer takes any write that starts like a data descriptor for
                # one (inline_container.cc, ostream_write_func), including such data.
                self._combine_crc(int.from_bytes(data[4:8], "little"))
            if zip64:
                descriptor = struct.pack("<4sIQQ", _DESCRIPTOR_SIGNATURE, crc, size, size)
            else:
                descriptor = struct.pack("<4sIII", _DESCRIPTOR_SIGNATURE, crc, size, size)
            self._write(descriptor)
            self._combine_crc(crc)
        central_extra = _zip64_extra(size, offset, compressed=size)
        self.central += _CENTRAL_HEADER.pack(
            0x02014B50, 0, 0, flags, 0, 0, 0, crc, min(size, _U32_MAX), min(size, _U32_MAX),
            len(full_name), len(central_extra), 0, 0, 0, 0, min(offset, _U32_MAX))
        self.central += full_name + central_extra
        self.records += 1

    def _write_data(self, data: memoryview) -> int:
        """Stream the record's bytes (in slices of ``max_write``); their CRC-32 if asked."""
        if data.nbytes < GATHER_BELOW:
            self._write(data)
            return zlib.crc32(data) if self.crc32 else 0
        step = self.max_write or data.nbytes
        crc = 0
        for start in range(0, data.nbytes, step):
            piece = data[start:start + step]
            if not self.crc32:
                self._write(piece, gather=False)
                continue
            # zlib.crc32 releases the GIL: the record's CRC runs beside the write.
            pending = _crc_executor().submit(zlib.crc32, piece, crc)
            try:
                self._write(piece, gather=False)
            finally:
                crc = pending.result()
        return crc

    def _combine_crc(self, crc: int) -> None:
        self.descriptor_crcs = _hash_combine(self.descriptor_crcs, crc)

    def close(self) -> None:
        """The central directory, zip64 end record and locator, end record."""
        directory_offset, directory_size = self.position, len(self.central)
        self._write(self.central)
        zip64_end_offset = self.position
        self._write(_ZIP64_END.pack(0x06064B50, _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0,
                                    self.records, self.records, directory_size,
                                    directory_offset))
        self._write(_ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_end_offset, 1))
        self._write(_END.pack(0x06054B50, 0, 0, min(self.records, _U16_MAX),
                              min(self.records, _U16_MAX), min(directory_size, _U32_MAX),
                              min(directory_offset, _U32_MAX), 0))
        self._flush()


# --------------------------------------------------------------------------- serialization id
#
# PyTorchStreamWriter::writeSerializationId: 20 digits of the record names' hashes combined
# in the iteration order of its std::unordered_set<std::string>, then 20 digits of the
# data descriptors' CRCs combined in write order. Deterministic for a given content, so it
# is reproduced here rather than invented: our files stay byte-identical to torch's.

_MASK64 = (1 << 64) - 1
_MURMUR_MUL = 0xC6A4A7935BD1E995
_STD_HASH_SEED = 0xC70F6907
# libstdc++ grows a default unordered_set to 13 buckets on its first insertion, then to
# the first prime of its table >= twice the bucket count each time the element count
# would exceed it (max_load_factor 1): this chain, read off __prime_list.
_BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229,
                  172933, 351061, 712697, 1447153, 2938679, 5967347, 12117689, 24607243,
                  49969847, 101473717, 206062531, 418451333, 849749479, 1725587117,
                  3504151727, 8589934583, 25769803693)


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK64)


def _std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` on 64-bit (``std::_Hash_bytes``)."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    length = len(data)
    aligned = length & ~7
    value = (_STD_HASH_SEED ^ (length * _MURMUR_MUL)) & _MASK64
    for start in range(0, aligned, 8):
        word = int.from_bytes(data[start:start + 8], "little")
        value ^= (shift_mix((word * _MURMUR_MUL) & _MASK64) * _MURMUR_MUL) & _MASK64
        value = (value * _MURMUR_MUL) & _MASK64
    if length & 7:
        value = ((value ^ int.from_bytes(data[aligned:], "little")) * _MURMUR_MUL) & _MASK64
    return shift_mix((shift_mix(value) * _MURMUR_MUL) & _MASK64)


def _unordered_set_order(names: Sequence[str]) -> list[str]:
    """The iteration order of a libstdc++ ``std::unordered_set<std::string>`` after
    inserting the distinct ``names`` in this order.

    The set is one singly-linked list in which each bucket's nodes are adjacent: a node
    joins the front of its bucket's run, or the front of the whole list when its bucket was
    empty; a rehash re-inserts the nodes in list order under the same rule.
    """
    codes = {name: _std_hash(name.encode()) for name in names}
    growth = iter(_BUCKET_COUNTS)
    buckets, next_resize = 1, 0
    runs: dict[int, list[str]] = {}  # bucket -> its nodes, the front of the run last
    first_seen: list[int] = []       # buckets in the order their runs began

    def insert(name: str) -> None:
        bucket = codes[name] % buckets
        if bucket not in runs:
            runs[bucket] = []
            first_seen.append(bucket)
        runs[bucket].append(name)

    def order() -> list[str]:
        return [name for bucket in reversed(first_seen) for name in reversed(runs[bucket])]

    for count, name in enumerate(names):
        if count + 1 > next_resize:
            current = order()
            buckets = next_resize = next(growth)
            runs.clear()
            first_seen.clear()
            for existing in current:
                insert(existing)
        insert(name)
    return order()


@functools.lru_cache(maxsize=64)
def serialization_names_hash(storages: int) -> int:
    """The record-name half of the serialization id, for an archive of ``storages``."""
    names = ["data.pkl", ".format_version", ".storage_alignment", "byteorder",
             *(f"data/{key}" for key in range(storages)), "version"]
    combined = 0
    for name in _unordered_set_order(names):
        combined = _hash_combine(combined, _std_hash(name.encode()))
    return combined
