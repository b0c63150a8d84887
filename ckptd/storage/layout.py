"""Where each item of a DCP ``.distcp`` file will land, known before a byte is written.

A tiered DCP save is handed over at staging time: its coordinator gives the daemon the
``.metadata`` it will commit, and that names each item's offset and length in its file.
The writers lay items back to back, each tensor as one ``torch.save`` archive whose size
depends only on its dtype and shape (the zip records, the pickle, the alignment padding
and the zip64 thresholds are all fixed by them), each byte item raw. So the layout is
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

from ckptd.storage.torch_format import DTYPES, raw_tensor, write_tensor_file


class _CountingSink:
    """A stream that counts what is written and keeps nothing."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        nbytes = memoryview(data).nbytes
        self.size += nbytes
        return nbytes


@functools.lru_cache(maxsize=4096)
def tensor_archive_size(dtype: str, shape: tuple) -> int:
    """Bytes of ``torch.save(tensor)`` for a contiguous tensor of ``dtype`` and ``shape``."""
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))  # untouched anonymous pages cost nothing
    try:
        view = memoryview(pages)[:nbytes]
        sink = _CountingSink()
        write_tensor_file(sink, raw_tensor(view, dtype, list(shape)))
        view.release()
        return sink.size
    finally:
        pages.close()


def item_size(buffer: list) -> int:
    """Bytes one staged buffer ``[dtype, shape, nbytes]`` takes in its file."""
    dtype, shape, nbytes = buffer
    if dtype == "bytes":
        return nbytes
    return tensor_archive_size(dtype, tuple(shape))


def predict_placements(buffers: list, files: list) -> dict:
    """``{file name: [[start, length], ...]}`` for a DCP request's ``files``
    (``[name, [buffer indices]]``), as the writers will place them."""
    placements = {}
    for name, indices in files:
        start, spots = 0, []
        for index in indices:
            length = item_size(buffers[index])
            spots.append([start, length])
            start += length
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
