"""torch's checkpoint file format, written without torch.

Owns the bytes of a ``torch.save`` file: what a writer process puts on disk for
``TorchAsyncCheckpoint`` (one file of a nested state dict) and for every tensor item of a
DCP ``.distcp`` file (one complete archive per item, as DCP's ``FileSystemWriter`` does).
Stock ``torch.load(path, weights_only=True)`` reads the result, with or without
``mmap=True``, and so does ``torch.distributed.checkpoint.load``.

The records are torch's: ``archive/data.pkl`` (:mod:`ckptd.storage.torch_pickle`),
``.format_version``, ``.storage_alignment``, ``byteorder``, one ``data/<key>`` per tensor,
``version`` and ``.data/serialization_id``, in torch's zip container
(:mod:`ckptd.storage.torch_zip`). Tensor bytes are streamed straight from the buffers given
(memoryviews of the staging pool), never copied.

Two promises, both held by the tests against torch itself:

- ckptd's own files (``alignment=PAGE_ALIGNMENT``, no zip CRCs) are byte for byte what
  ``torch.save`` writes with ``torch.utils.serialization.config.save.storage_alignment =
  4096`` and ``compute_crc32 = False``: every record's data starts on a 4 KiB boundary of
  the archive, which is what lets a writer put tensor bytes on disk with O_DIRECT straight
  from the staging pool. torch's loader reads the alignment from the file and never checks
  zip CRCs; the ``.ckptd-sum`` record beside the file checksums every byte instead.
- the stock files of ``FileSystemWriterAsync`` (``alignment=DEFAULT_ALIGNMENT``,
  ``crc32=True``) are byte for byte what torch 2.13's ``torch.save`` writes by default.

ckptd's DCP tensor items (:func:`write_tensor_file`) are one archive per tensor with its
storage on the alignment the layout gives and the other records on ``record_alignment``
(:func:`ckptd.storage.layout.storage_alignment`): for a small tensor that is the
default ``torch.save`` without CRCs byte for byte; for a large one no single torch
setting writes it (torch pads every record alike), but torch's loader finds each record
from its own header, so ``torch.load`` and DCP read it all the same (tested).

(A torch built against another C++ library than libstdc++ would write another
serialization id; torch.load only logs it, so such files differ from ours in those 40 bytes
only.)

Must not import torch (nor numpy): the point of this module is that writer processes do
not pay ~150 MB of resident memory for torch just to produce its file format.
"""

from __future__ import annotations

import functools
import math
import mmap
import sys
from typing import Any, Sequence

from ckptd.protocol import TensorRef
from ckptd.storage.torch_pickle import (DTYPES, DtypeFormat, RawTensor, contiguous_strides,
                                        pickle_skeleton, raw_tensor)
from ckptd.storage.torch_zip import DEFAULT_ALIGNMENT, ArchiveWriter, serialization_names_hash

__all__ = ["DTYPES", "DtypeFormat", "RawTensor", "raw_tensor", "contiguous_strides",
           "pickle_skeleton", "write_torch_file", "write_tensor_file", "write_archive",
           "write_head_records", "tensor_archive_template",
           "DEFAULT_ALIGNMENT", "PAGE_ALIGNMENT"]

#: The storage alignment of ckptd's own files: a page, O_DIRECT's unit.
PAGE_ALIGNMENT = 4096
_FORMAT_VERSION = b"1"    # records are numbered, not sorted (torch/serialization.py)
_FILE_VERSION = b"3\n"    # caffe2::serialize::kProducedFileFormatVersion
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
# Below this a tensor item is written in one piece with its records (one copy of a few KiB
# is cheaper than three writes); from it, its bytes go to the stream from their buffer.
_ONE_PIECE_BELOW = 64 << 10


def write_torch_file(stream: Any, skeleton: Any, tensors: Sequence[RawTensor], *,
                     crc32: bool = False, max_write: int | None = None,
                     alignment: int = DEFAULT_ALIGNMENT) -> int:
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
    alignment : int
        Where each record's data starts (a multiple of it from the archive's first byte),
        recorded in ``.storage_alignment``: :data:`PAGE_ALIGNMENT` for ckptd's files,
        :data:`DEFAULT_ALIGNMENT` for torch's default ones.

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
    return write_archive(stream, skeleton, tensors, crc32, max_write, alignment).position


def write_archive(stream: Any, skeleton: Any, tensors: Sequence[RawTensor], crc32: bool,
                  max_write: int | None, alignment: int,
                  record_alignment: int | None = None) -> ArchiveWriter:
    """The archive of :func:`write_torch_file`, written; returns its writer (positions).

    ``record_alignment`` (default: ``alignment``) places the records that are not
    storages (the pickle, the version records, the serialization id); torch's writer
    aligns them all alike, torch's loader finds each record from its header.
    """
    data_pkl, storages = pickle_skeleton(skeleton, tensors)
    archive = ArchiveWriter(stream, crc32, max_write, record_alignment or alignment)
    write_head_records(archive, data_pkl)
    archive.record(".storage_alignment", str(alignment).encode())
    archive.record("byteorder", sys.byteorder.encode())
    for key, tensor in enumerate(storages):
        archive.record(f"data/{key}", tensor.data, alignment)
    archive.record("version", _FILE_VERSION)
    names_hash = serialization_names_hash(len(storages))
    serialization_id = f"{names_hash:020d}{archive.descriptor_crcs:020d}"
    archive.record(".data/serialization_id", serialization_id.encode())
    archive.close()
    return archive


def write_head_records(archive: ArchiveWriter, data_pkl: bytes) -> None:
    """The records every archive starts with, up to the ones fixed by the alignment:
    ``data.pkl`` (the skeleton) and ``.format_version``."""
    archive.record("data.pkl", data_pkl)
    archive.record(".format_version", _FORMAT_VERSION)


def write_tensor_file(stream: Any, tensor: RawTensor, *, crc32: bool = False,
                      max_write: int | None = None, alignment: int = DEFAULT_ALIGNMENT,
                      record_alignment: int | None = None) -> int:
    """Write one tensor as ``torch.save(tensor, stream)`` would (a DCP tensor item).

    Parameters and result as for :func:`write_torch_file`, plus ``record_alignment``
    (default: ``alignment``), where the records other than the tensor's start: a DCP item
    of ckptd's puts only its tensor's bytes on a page (the six other records on torch's
    default 64 bytes: a page each would add 24 KiB to every item). Without zip CRCs every
    byte but the tensor's is fixed by its dtype and shape, so those bytes are built once
    per dtype and shape (:func:`tensor_archive_template`) and the item is three writes:
    a DCP save of thousands of tensors builds no archive per tensor.
    """
    data = tensor.data
    if crc32 or (data.nbytes >= 8 and data[:4] == _DESCRIPTOR_SIGNATURE):
        # zip CRCs are data; so is the serialization id of a tensor whose bytes start like
        # a data descriptor (torch's writer counts such a write as one)
        return write_archive(stream, TensorRef(0), [tensor], crc32, max_write, alignment,
                             record_alignment).position
    head, tail = tensor_archive_template(tensor.dtype, tensor.shape, alignment,
                                         record_alignment or alignment)
    if data.nbytes < _ONE_PIECE_BELOW:
        stream.write(b"".join((head, data, tail)))
    else:
        stream.write(head)
        step = max_write or data.nbytes
        for start in range(0, data.nbytes, step):
            stream.write(data[start:start + step])
        stream.write(tail)
    return len(head) + data.nbytes + len(tail)


class _TemplateSink:
    """Keeps what an archive writer writes, except the writes of the tensor's own buffer."""

    def __init__(self, tensor_buffer: Any) -> None:
        self.buffer, self.tensor_buffer, self.skipped = bytearray(), tensor_buffer, False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.obj is self.tensor_buffer:
            self.skipped = True
        else:
            self.buffer += view
        return view.nbytes


@functools.lru_cache(maxsize=4096)
def tensor_archive_template(dtype: str, shape: tuple, alignment: int,
                            record_alignment: int) -> tuple[bytes, bytes]:
    """The bytes of ``torch.save(tensor)`` (no zip CRCs) before and after the tensor's bytes,
    for a contiguous tensor of ``dtype`` and ``shape`` whose bytes do not start with a zip
    data descriptor's signature: the archive is written once, around a tensor whose pages
    are never touched (an anonymous mapping).

    Returns
    -------
    (bytes, bytes)
        The head (records up to the tensor's data, which starts on ``alignment``) and the
        tail (its data descriptor, the last records and the central directory).
    """
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))
    try:
        view = memoryview(pages)[:nbytes]
        sink = _TemplateSink(pages)
        archive = write_archive(sink, TensorRef(0), [raw_tensor(view, dtype, list(shape))],
                                 False, None, alignment, record_alignment)
        view.release()
    finally:
        pages.close()
    start = archive.data_starts[4]  # data.pkl, .format_version, .storage_alignment, byteorder
    written = bytes(sink.buffer)
    return written[:start], written[start if sink.skipped else start + nbytes:]
