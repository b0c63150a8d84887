"""The ``data.pkl`` record of a torch checkpoint file, pickled without torch.

Owns how ``torch.save`` pickles a state dict: the dtypes and their storage classes, the
tensor as bytes (:class:`RawTensor`, a view of the staging pool, never copied), and a
pickler that writes protocol 2 exactly as torch's C pickler does (memo by object identity,
batches of 1000, interned constants; tensors as ``torch._utils._rebuild_tensor_v2/_v3``
calls whose storages are persistent ids ``data/0, data/1, ...``).

Must not import torch (nor numpy): writer processes produce torch's format without it.
"""

from __future__ import annotations

import math
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from ckptd.protocol import TensorRef

__all__ = ["DTYPES", "DtypeFormat", "RawTensor", "raw_tensor", "contiguous_strides",
           "pickle_skeleton"]


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
