"""Where each item of a DCP ``.distcp`` file will land, known before a byte is written.

A tiered DCP save is handed over at staging time: its coordinator gives the daemon the
``.metadata`` it will commit, and that names each item's offset and length in its file.
Owns the one rule of where items go, which the writers follow (:func:`item_start`,
:func:`storage_alignment`): one after the other, each tensor as one ``torch.save``
archive, each byte item raw. In ckptd's files a tensor the staging pool keeps on a page
(``PAGE_ALIGNED_FROM`` bytes and more) starts its archive on a 4 KiB boundary of the file
with its bytes on the next one, so they go to the disk with O_DIRECT straight from the
pool; its other records and every smaller tensor's archive (which the writer copies
through its bounce buffer anyway) use torch's default 64-byte alignment, back to back: a
page per record and per small item made a DCP file of the optimizer state 4 % larger
than its tensors. Stock files keep torch's layout. A tensor archive's size depends only
on its dtype and shape (the zip records, the pickle, the alignment padding and the zip64
thresholds are all fixed by them). So the layout is
computed here by running the archive writer of :mod:`ckptd.storage.torch_format` over a
stream that only counts, with a tensor whose pages are never touched (an anonymous
mapping), once per distinct dtype and shape. The writer's real placements are checked
against this prediction (:func:`check_prediction`), so a wrong one fails the save instead
of committing a wrong ``.metadata``.

No torch; pure functions.
"""

from __future__ import annotations

import functools
import math
import mmap

from ckptd.protocol.layout import PAGE_ALIGNED_FROM
from ckptd.storage.torch_format import (DEFAULT_ALIGNMENT, DTYPES, PAGE_ALIGNMENT, raw_tensor,
                                        write_tensor_file)


def on_a_page(nbytes: int, stock: bool) -> bool:
    """Whether a tensor item of ``nbytes`` starts on a page of its file (and its bytes on
    the next): a ckptd file's tensor whose staged bytes are page-aligned."""
    return not stock and nbytes >= PAGE_ALIGNED_FROM


def item_start(cursor: int, nbytes: int | None, stock: bool) -> int:
    """Where the next item of a ``.distcp`` file starts when the file has ``cursor`` bytes:
    a large tensor's archive (``nbytes`` its tensor's bytes) in a ckptd file on the next
    page, anything else (``nbytes`` None for a byte item) right there."""
    if nbytes is not None and on_a_page(nbytes, stock):
        return -(-cursor // PAGE_ALIGNMENT) * PAGE_ALIGNMENT
    return cursor


def storage_alignment(nbytes: int, stock: bool) -> int:
    """Where a tensor item's storage record starts inside its archive (its other records
    always use torch's default, :data:`DEFAULT_ALIGNMENT`)."""
    return PAGE_ALIGNMENT if on_a_page(nbytes, stock) else DEFAULT_ALIGNMENT


class _CountingSink:
    """A stream that counts what is written and keeps nothing."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        nbytes = memoryview(data).nbytes
        self.size += nbytes
        return nbytes


@functools.lru_cache(maxsize=4096)
def tensor_archive_size(dtype: str, shape: tuple, stock: bool = False) -> int:
    """Bytes of a ``.distcp`` file's archive of a contiguous tensor of ``dtype`` and
    ``shape`` (ckptd's layout, or torch's default one for ``stock`` files)."""
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))  # untouched anonymous pages cost nothing
    try:
        view = memoryview(pages)[:nbytes]
        sink = _CountingSink()
        write_tensor_file(sink, raw_tensor(view, dtype, list(shape)),
                          alignment=storage_alignment(nbytes, stock),
                          record_alignment=DEFAULT_ALIGNMENT)
        view.release()
        return sink.size
    finally:
        pages.close()


def item_size(buffer: list, stock: bool = False) -> int:
    """Bytes one staged buffer ``[dtype, shape, nbytes]`` takes in its file."""
    dtype, shape, nbytes = buffer
    if dtype == "bytes":
        return nbytes
    return tensor_archive_size(dtype, tuple(shape), stock)


def file_size(buffers: list, stock: bool = False) -> int:
    """Bytes of a ``.distcp`` file holding ``buffers`` (``[dtype, shape, nbytes]`` each),
    in order."""
    cursor = 0
    for buffer in buffers:
        cursor = item_start(cursor, _tensor_bytes(buffer), stock) + item_size(buffer, stock)
    return cursor


def _tensor_bytes(buffer: list) -> int | None:
    """A staged buffer's tensor bytes, None for a byte item."""
    return None if buffer[0] == "bytes" else buffer[2]


def predict_placements(buffers: list, files: list, stock: bool = False) -> dict:
    """``{file name: [[start, length], ...]}`` for a DCP request's ``files``
    (``[name, [buffer indices]]``), as the writers will place them."""
    placements = {}
    for name, indices in files:
        cursor, spots = 0, []
        for index in indices:
            start = item_start(cursor, _tensor_bytes(buffers[index]), stock)
            length = item_size(buffers[index], stock)
            spots.append([start, length])
            cursor = start + length
        placements[name] = spots
    return placements


def check_prediction(predicted: dict | None, name: str, items: list | None) -> str | None:
    """Why the writer's placements of file ``name`` differ from the prediction (None if
    they agree, or nothing was predicted)."""
    if predicted is None or name not in predicted:
        return None
    if [list(p) for p in (items or [])] != predicted[name]:
        return (f"the items of {name} landed at {items}, not where the hand-over said "
                f"({predicted[name]}); the checkpoint is not committed")
    return None
