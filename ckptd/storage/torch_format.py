"""torch's checkpoint file format, written without torch.

Owns the bytes of a ``torch.save`` file: what a writer process puts on disk for
``TorchAsyncCheckpoint`` (one file of a nested state dict) and for every tensor item of a
DCP ``.distcp`` file (one complete archive per item, as DCP's ``FileSystemWriter`` does).
Stock ``torch.load(path, weights_only=True)`` reads the result, with or without
``mmap=True``, and so does ``torch.distributed.checkpoint.load``.

Pattern: a streaming zip writer. Each record is a local header, its data and a data
descriptor (sizes and CRC come *after* the data, so nothing is ever sought back); the
central directory and the zip64 end records close the archive. The records are torch's:
``archive/data.pkl`` (pickle protocol 2 of the structure, tensors as
``torch._utils._rebuild_tensor_v2/_v3`` calls whose storages are persistent ids),
``.format_version``, ``.storage_alignment``, ``byteorder``, one ``data/<key>`` per
tensor (its first byte aligned to 64 through the zip extra field, so ``mmap=True`` can map
it), ``version`` and ``.data/serialization_id``. Tensors of 64 KiB and more are streamed
straight from the buffers given (memoryviews of the staging pool), never copied; smaller
ones are gathered with the headers into few large writes.

The output is byte-for-byte what torch 2.13's ``torch.save`` writes for the same state
dict (``compute_crc32`` on or off), and the tests hold it to that: the pickle mirrors the C
pickler (memo by object identity, batches of 1000, interned constants), the zip mirrors
torch's miniz (zip64 records, ``FB`` padding, zero timestamps), and the serialization id
mirrors ``PyTorchStreamWriter`` (libstdc++ ``std::hash`` of the record names, combined in
``std::unordered_set`` order, and the CRCs of the data descriptors). That lets
``FileSystemWriterAsync`` promise torch's own bytes with no torch in the writer. (A torch
built against another C++ library than libstdc++ would write another serialization id;
torch.load only logs it, so such files differ from ours in those 40 bytes only.)

Must not import torch (nor numpy): the point of this module is that writer processes do
not pay ~150 MB of resident memory for torch just to produce its file format.
"""

from __future__ import annotations

import functools
import math
import pickle
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from ckptd.protocol import TensorRef

__all__ = ["DTYPES", "DtypeFormat", "RawTensor", "raw_tensor", "contiguous_strides",
           "pickle_skeleton", "write_torch_file", "write_tensor_file"]


@dataclass(frozen=True)
class DtypeFormat:
    """How torch pickles the storage of one dtype.

    Attributes
    ----------
    itemsize : int
        Bytes per element.
    storage : tuple of str
        The storage class the persistent id names, as ``(module, name)``.
    dtype_argument : bool
        True for the dtypes torch rebuilds with ``_rebuild_tensor_v3`` (an untyped storage
        counted in bytes, plus the dtype as the last argument); False for the legacy typed
        storages of ``_rebuild_tensor_v2`` (counted in elements).
    """

    itemsize: int
    storage: tuple[str, str]
    dtype_argument: bool = False


def _typed(itemsize: int, storage: str) -> DtypeFormat:
    return DtypeFormat(itemsize, ("torch", storage))


def _untyped(itemsize: int) -> DtypeFormat:
    return DtypeFormat(itemsize, ("torch.storage", "UntypedStorage"), dtype_argument=True)


#: Every dtype a staged buffer may have (``ckptd.protocol.BUFFER_DTYPES`` minus ``bytes``).
#: torch keeps the typed storages of its older dtypes for compatibility and serializes the
#: newer ones (``torch.storage._new_dtypes()``) as untyped storages.
DTYPES: dict[str, DtypeFormat] = {
    "float64": _typed(8, "DoubleStorage"),
    "float32": _typed(4, "FloatStorage"),
    "float16": _typed(2, "HalfStorage"),
    "bfloat16": _typed(2, "BFloat16Storage"),
    "complex64": _typed(8, "ComplexFloatStorage"),
    "complex128": _typed(16, "ComplexDoubleStorage"),
    "int64": _typed(8, "LongStorage"),
    "int32": _typed(4, "IntStorage"),
    "int16": _typed(2, "ShortStorage"),
    "int8": _typed(1, "CharStorage"),
    "uint8": _typed(1, "ByteStorage"),
    "bool": _typed(1, "BoolStorage"),
    "uint16": _untyped(2),
    "uint32": _untyped(4),
    "uint64": _untyped(8),
    "float8_e4m3fn": _untyped(1),
    "float8_e5m2": _untyped(1),
}


@dataclass(frozen=True)
class RawTensor:
    """A C-contiguous CPU tensor as bytes: what one ``data/<key>`` record holds.

    Build it with :func:`raw_tensor`, which checks that the sizes agree.
    """

    data: memoryview
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (and of its storage)."""
        return self.data.nbytes


def raw_tensor(buffer: Any, dtype: str, shape: Sequence[int]) -> RawTensor:
    """Describe ``buffer`` as a tensor of ``dtype`` and ``shape``, without copying it.

    Parameters
    ----------
    buffer
        Any object exporting the buffer protocol (a memoryview of the staging pool).
    dtype : str
        A key of :data:`DTYPES`.
    shape : sequence of int
        ``[]`` for a 0-d tensor.

    Raises
    ------
    ValueError
        For an unknown dtype, a negative dimension, or a buffer whose size is not
        ``prod(shape) * itemsize``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} cannot be written in torch's format "
                         f"(known: {', '.join(sorted(DTYPES))})")
    shape = tuple(shape)
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"shape {list(shape)} is not a list of non-negative integers")
    data = memoryview(buffer).cast("B")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if data.nbytes != expected:
        raise ValueError(f"a {dtype} tensor of shape {list(shape)} has {expected} bytes, "
                         f"the buffer given has {data.nbytes}")
    return RawTensor(data, dtype, shape)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor (a 0-size dimension counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# --------------------------------------------------------------------------- the pickle

_PROTO2, _STOP, _MARK = b"\x80\x02", b".", b"("
_NONE, _NEWTRUE, _NEWFALSE = b"N", b"\x88", b"\x89"
_EMPTY_DICT, _EMPTY_LIST, _EMPTY_TUPLE = b"}", b"]", b")"
_SETITEM, _SETITEMS, _APPEND, _APPENDS = b"s", b"u", b"a", b"e"
_TUPLE, _TUPLE_N = b"t", {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_REDUCE, _BINPERSID = b"R", b"Q"
_BATCHSIZE = 1000  # the C pickler's batch of SETITEMS / APPENDS

# torch's pickle holds these as string constants of its source, which CPython interns; a
# state dict string that *is* the same object (msgpack interns map keys) is memoized with
# them, as in torch's own output.
_STORAGE = sys.intern("storage")
_CPU = sys.intern("cpu")
_LATIN1 = sys.intern("latin1")


class _SkeletonPickler:
    """Pickle protocol 2 of a decoded skeleton, as ``torch.save``'s C pickler writes it.

    Only the types :func:`ckptd.protocol.unpack_value` returns are accepted. Objects are
    memoized by identity, exactly as ``_pickle.Pickler`` does (so equal but distinct
    strings are written twice, one shared object once); every memoized object is kept
    alive until the end so no identity can be reused.
    """

    def __init__(self, tensors: Sequence[RawTensor]) -> None:
        self.out = bytearray(_PROTO2)
        self.tensors = tensors
        self.storages: list[RawTensor] = []  # in key order: data/0, data/1, ...
        self._memo: dict[Any, int] = {}
        self._memo_size = 0  # entries, including those nothing can refer to again
        self._alive: list[Any] = []

    def dumps(self, obj: Any) -> bytes:
        self.save(obj)
        self.out += _STOP
        return bytes(self.out)

    # memo -----------------------------------------------------------------------------
    def _put(self, key: Any = None) -> None:
        """Memoize the object just written under ``key`` (None: one never seen again)."""
        index = self._memo_size
        self._memo_size += 1
        if key is not None:
            self._memo[key] = index
        self.out += (b"q" + bytes((index,)) if index < 256
                     else b"r" + struct.pack("<I", index))

    def _put_object(self, obj: Any) -> None:
        self._alive.append(obj)
        self._put(id(obj))

    def _get(self, index: int) -> None:
        self.out += (b"h" + bytes((index,)) if index < 256
                     else b"j" + struct.pack("<I", index))

    # values ---------------------------------------------------------------------------
    def save(self, obj: Any) -> None:
        kind = type(obj)
        if obj is None:
            self.out += _NONE
        elif obj is True:
            self.out += _NEWTRUE
        elif obj is False:
            self.out += _NEWFALSE
        elif kind is int:
            self._save_int(obj)
        elif kind is float:
            self.out += b"G" + struct.pack(">d", obj)
        elif kind is TensorRef:
            self._save_tensor(obj.index)
        elif id(obj) in self._memo:
            self._get(self._memo[id(obj)])
        elif kind is str:
            self._save_str(obj)
        elif kind is bytes:
            self._save_bytes(obj)
        elif kind is dict:
            self._save_dict(obj)
        elif kind is list:
            self._save_list(obj)
        elif kind is tuple:
            self._save_tuple(obj)
        else:
            raise TypeError(f"a {kind.__name__} cannot be part of a checkpoint skeleton")

    def _save_int(self, value: int) -> None:
        if -0x80000000 <= value <= 0x7FFFFFFF:
            if 0 <= value <= 0xFF:
                self.out += b"K" + bytes((value,))
            elif 0 <= value <= 0xFFFF:
                self.out += b"M" + struct.pack("<H", value)
            else:
                self.out += b"J" + struct.pack("<i", value)
            return
        encoded = pickle.encode_long(value)
        self.out += (b"\x8a" + bytes((len(encoded),)) if len(encoded) < 256
                     else b"\x8b" + struct.pack("<i", len(encoded)))
        self.out += encoded

    def _save_str(self, text: str) -> None:
        encoded = text.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(encoded)) + encoded
        self._put_object(text)

    def _save_bytes(self, data: bytes) -> None:
        # Protocol 2 has no bytes opcode: the C pickler writes _codecs.encode(text, 'latin1').
        # For b'' it writes bytes() instead, a global torch.load(weights_only=True) refuses;
        # the one deliberate difference from torch's bytes: b'' is encoded like the rest.
        self._save_global("_codecs", "encode")
        self._save_tuple((data.decode("latin1"), _LATIN1), fresh=True)
        self.out += _REDUCE
        self._put_object(data)

    def _save_dict(self, mapping: dict) -> None:
        self.out += _EMPTY_DICT
        self._put_object(mapping)
        if len(mapping) == 1:
            for key, value in mapping.items():
                self.save(key)
                self.save(value)
            self.out += _SETITEM
            return
        if not mapping:
            return
        items = iter(mapping.items())
        while True:  # the C pickler closes a full last batch with an empty one
            self.out += _MARK
            count = 0
            for key, value in items:
                self.save(key)
                self.save(value)
                count += 1
                if count == _BATCHSIZE:
                    break
            self.out += _SETITEMS
            if count != _BATCHSIZE:
                return

    def _save_list(self, items: list) -> None:
        self.out += _EMPTY_LIST
        self._put_object(items)
        if len(items) == 1:
            self.save(items[0])
            self.out += _APPEND
            return
        for start in range(0, len(items), _BATCHSIZE):
            self.out += _MARK
            for item in items[start:start + _BATCHSIZE]:
                self.save(item)
            self.out += _APPENDS

    def _save_tuple(self, items: tuple, fresh: bool = False) -> None:
        """A tuple not seen before (the caller checked the memo), memoized after; a
        ``fresh`` one (built here) is never referred to again."""
        if not items:
            self.out += _EMPTY_TUPLE  # never memoized
            return
        if len(items) <= 3:
            for item in items:
                self.save(item)
            self.out += _TUPLE_N[len(items)]
        else:
            self.out += _MARK
            for item in items:
                self.save(item)
            self.out += _TUPLE
        if fresh:
            self._put()
        else:
            self._put_object(items)

    def _save_global(self, module: str, name: str) -> None:
        # Written as bytes, never looked up: no torch import, no stand-in module.
        key = ("global", module, name)
        if key in self._memo:
            self._get(self._memo[key])
            return
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        self._put(key)

    def _save_tensor(self, index: int) -> None:
        """``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())``
        (``_v3`` with the dtype appended for the untyped-storage dtypes)."""
        key = ("tensor", index)
        if key in self._memo:  # the same tensor twice: one storage, as in torch
            self._get(self._memo[key])
            return
        if not 0 <= index < len(self.tensors):
            raise ValueError(f"the skeleton refers to tensor {index}, "
                             f"but {len(self.tensors)} were given")
        tensor = self.tensors[index]
        layout = DTYPES[tensor.dtype]
        self._save_global("torch._utils",
                          "_rebuild_tensor_v3" if layout.dtype_argument else "_rebuild_tensor_v2")
        self.out += _MARK
        # The storage, as torch's persistent_id returns it.
        storage_key = str(len(self.storages))
        self.storages.append(tensor)
        numel = tensor.nbytes if layout.dtype_argument else tensor.nbytes // layout.itemsize
        self.out += _MARK
        self.save(_STORAGE)
        self._save_global(*layout.storage)
        self.save(storage_key)
        self.save(_CPU)
        self._save_int(numel)
        self.out += _TUPLE
        self._put()  # the persistent id tuple, referenced nowhere else
        self.out += _BINPERSID
        self._save_int(0)  # storage offset
        # torch builds both tuples afresh for every tensor: never a memo hit.
        self._save_tuple(tensor.shape, fresh=True)
        self._save_tuple(contiguous_strides(tensor.shape), fresh=True)
        self.out += _NEWFALSE  # requires_grad
        self._save_global("collections", "OrderedDict")  # backward hooks: none
        self.out += _EMPTY_TUPLE + _REDUCE
        self._put()
        if layout.dtype_argument:
            self._save_global("torch", tensor.dtype)
        self.out += _TUPLE
        self._put()  # the argument tuple
        self.out += _REDUCE
        self._put(key)


def pickle_skeleton(skeleton: Any, tensors: Sequence[RawTensor]) -> tuple[bytes, list[RawTensor]]:
    """The ``data.pkl`` record of ``skeleton``, and the storages in key order.

    Parameters
    ----------
    skeleton
        A value as :func:`ckptd.protocol.unpack_value` returns it; each
        :class:`~ckptd.protocol.TensorRef` ``i`` stands for ``tensors[i]``.
    tensors : sequence of RawTensor
        What the references point to (only their dtype and shape are read here).

    Returns
    -------
    (bytes, list of RawTensor)
        The pickle, and the tensors it references (each once), in the order of their
        storage keys ``0, 1, ...``.
    """
    pickler = _SkeletonPickler(tensors)
    return pickler.dumps(skeleton), pickler.storages


# --------------------------------------------------------------------------- the zip

_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_UTF8_NAMES = 0x0800      # general purpose flag: names are UTF-8
_HAS_DESCRIPTOR = 0x0008  # general purpose flag: CRC and sizes follow the data
_ALIGNMENT = 64           # torch's default storage alignment (the .storage_alignment record)
_FORMAT_VERSION = b"1"    # records are numbered, not sorted (torch/serialization.py)
_FILE_VERSION = b"3\n"    # caffe2::serialize::kProducedFileFormatVersion

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
_GATHER_BELOW = 64 << 10
_GATHER_FLUSH = 1 << 20


class _ArchiveWriter:
    """Writes torch's zip records to a stream, in order, and closes the archive.

    Positions are counted from the archive's first byte (a DCP item's archive starts
    wherever the ``.distcp`` file is), as torch's writer counts them.
    """

    def __init__(self, stream: Any, crc32: bool, max_write: int | None) -> None:
        self.stream = stream
        self.crc32 = crc32
        self.max_write = max_write
        self.position = 0
        self.central = bytearray()
        self.records = 0
        self.descriptor_crcs = 0  # PyTorchStreamWriter::combined_uncomp_crc32_
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

    def _flush(self) -> None:
        if self._gathered:
            self.stream.write(self._gathered)
            self._gathered = bytearray()

    def record(self, name: str, data: Any) -> None:
        """One stored (uncompressed) record whose data is the buffer ``data``."""
        data = memoryview(data).cast("B")
        size = data.nbytes
        full_name = f"archive/{name}".encode()
        offset = self.position
        zip64 = _zip64_extra(size, offset, compressed=0)
        # torch pads the extra field so the data starts on the alignment
        # (caffe2::serialize::detail::getPadding), after a 4-byte "FB" field header.
        start = offset + _LOCAL_HEADER.size + len(full_name) + 4 + len(zip64)
        padding = -start % _ALIGNMENT
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
        if data.nbytes < _GATHER_BELOW:
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
def _names_hash(storages: int) -> int:
    """The record-name half of the serialization id, for an archive of ``storages``."""
    names = ["data.pkl", ".format_version", ".storage_alignment", "byteorder",
             *(f"data/{key}" for key in range(storages)), "version"]
    combined = 0
    for name in _unordered_set_order(names):
        combined = _hash_combine(combined, _std_hash(name.encode()))
    return combined


# --------------------------------------------------------------------------- files

def write_torch_file(stream: Any, skeleton: Any, tensors: Sequence[RawTensor], *,
                     crc32: bool = False, max_write: int | None = None) -> int:
    """Write ``skeleton`` filled with ``tensors`` as ``torch.save`` would, to ``stream``.

    Parameters
    ----------
    stream
        Has ``write(buffer)`` that writes all of the buffer (a
        :class:`ckptd.storage.durable.DurableFileStream`, a buffered file, ``BytesIO``).
        Written strictly in order, never sought.
    skeleton
        The structure, as :func:`ckptd.protocol.unpack_value` returns it: dicts, lists,
        tuples, str, bytes, int, float, bool, None and ``TensorRef(i)`` for ``tensors[i]``.
    tensors : sequence of RawTensor
        The tensor bytes (see :func:`raw_tensor`); streamed as they are, not copied. A
        tensor the skeleton does not refer to is not written; one it refers to twice is
        written once and loads as one tensor.
    crc32 : bool
        Record each zip entry's CRC-32 as ``torch.save`` does by default (one more pass
        over the bytes). Off, the CRCs are 0, as torch writes them with
        ``torch.utils.serialization.config.save.compute_crc32 = False``; ``torch.load``
        does not check them either way.
    max_write : int, optional
        Largest single ``write`` call for tensor bytes (so a durable stream can start
        writeback as it goes); default: one call per tensor.

    Returns
    -------
    int
        Bytes written.

    Raises
    ------
    TypeError, ValueError
        For a skeleton value that is not one of the types above, or a ``TensorRef`` out of
        range. Nothing has been written then: the pickle is built before the first write.
    """
    data_pkl, storages = pickle_skeleton(skeleton, tensors)
    archive = _ArchiveWriter(stream, crc32, max_write)
    archive.record("data.pkl", data_pkl)
    archive.record(".format_version", _FORMAT_VERSION)
    archive.record(".storage_alignment", str(_ALIGNMENT).encode())
    archive.record("byteorder", sys.byteorder.encode())
    for key, tensor in enumerate(storages):
        archive.record(f"data/{key}", tensor.data)
    archive.record("version", _FILE_VERSION)
    serialization_id = f"{_names_hash(len(storages)):020d}{archive.descriptor_crcs:020d}"
    archive.record(".data/serialization_id", serialization_id.encode())
    archive.close()
    return archive.position


def write_tensor_file(stream: Any, tensor: RawTensor, *, crc32: bool = False,
                      max_write: int | None = None) -> int:
    """Write one tensor as ``torch.save(tensor, stream)`` would (a DCP tensor item).

    Parameters and result as for :func:`write_torch_file`.
    """
    return write_torch_file(stream, TensorRef(0), [tensor], crc32=crc32, max_write=max_write)
