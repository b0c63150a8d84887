"""The copies of one part of a CUDA save, as (destination, source) tensor views, built once.

Owns turning a part's buffer descriptions (the trainer's storage, element offset, size,
stride, dtype) into views of the opened storages and of the staging pool, checked against
what the request declared, so the device worker issues the whole part as one
``torch._foreach_copy_`` instead of a Python loop of view-building and ``copy_`` calls per
tensor. A contiguous tensor is copied as its bytes: a slice of a byte view of its storage
(one per storage, however many tensors share it) into a slice of the pool, no dtype views;
any other keeps its dtype, size and stride.

Building and checking a view costs ~20 µs a tensor in Python, several times the copy of a
typical tensor on an H100; a training job saves the same parameters into the same place
save after save, so :class:`ReusedViews` keeps each trainer's views from its last save
and rebuilds only the entries whose description, place or storage changed.

Device-agnostic (only tensor views; no stream, event or CUDA call), so it is tested on the
CPU with storages standing in for opened exports.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from ckptd import protocol
from ckptd.protocol.ipc import ipc_export_id, release_ipc_counters
from ckptd.staging.exports import OpenExports, SaveMappings, stage_part

__all__ = ["ReusedViews"]


def _contiguous(size: list, stride: list) -> bool:
    expected = 1
    for dim, step in zip(reversed(size), reversed(stride)):
        if dim != 1 and step != expected:
            return False
        expected *= dim
    return True


class _Layout(NamedTuple):
    """What a description asks for, checked before its export is opened."""

    dtype: object
    size: list
    stride: list
    first: int    # the first element, in the storage
    nbytes: int


def _checked(torch, spec: dict, declared: int) -> _Layout:
    """A description's layout, refused before anything of the trainer's is mapped: a
    dtype that is no tensor's, bytes other than declared, a negative offset or stride."""
    name = spec.get("dtype")
    if name not in protocol.BUFFER_DTYPES or name == "bytes":
        raise ValueError(f"unsupported dtype {name!r} in a CUDA IPC description")
    dtype = getattr(torch, name)
    size, stride, first = list(spec["size"]), list(spec["stride"]), int(spec["offset"])
    nbytes = math.prod(size) * dtype.itemsize
    if nbytes != declared:
        raise ValueError(f"IPC tensor of {nbytes} bytes does not match the {declared} "
                         "bytes the request declared; refusing to write past its extent")
    if first < 0 or any(step < 0 for step in stride) or len(stride) != len(size):
        raise ValueError(f"IPC tensor with offset {first} and strides {stride} for size "
                         f"{size}: not a tensor's layout")
    return _Layout(dtype, size, stride, first, nbytes)


def _views(torch, layout: _Layout, start: int, pool_tensor, storage,
           byte_views: dict) -> tuple:
    """``(destination, source)`` of one checked layout over its opened storage."""
    dtype, size, stride, first, nbytes = layout
    # Checked here, not left to torch: a byte slice would be cut short silently, and
    # set_ grows a resizable storage instead of refusing.
    reach = (first + sum((dim - 1) * step for dim, step in zip(size, stride)) + 1
             if nbytes else 0) * dtype.itemsize
    if reach > storage.nbytes():
        raise ValueError(f"IPC tensor of {nbytes} bytes at element {first} reaches byte "
                         f"{reach} of its storage of {storage.nbytes()} bytes")
    destination = pool_tensor[start:start + nbytes]
    if _contiguous(size, stride):
        whole = byte_views.get(id(storage))
        if whole is None:
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            byte_views[id(storage)] = whole
        begin = first * dtype.itemsize
        return destination, whole[begin:begin + nbytes]
    source = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, first, size,
                                                                      stride)
    return destination.view(dtype).view(size), source


class _Entry(NamedTuple):
    """One buffer's views as the last save of a trainer built them."""

    spec: dict
    start: int
    declared: int
    export: tuple
    storage: object
    destination: object
    source: object


class ReusedViews:
    """One trainer's copy views on one device, kept from its last save for the next.

    An entry is reused when the new save describes the same buffer (an equal description:
    the same export, hence the same storage, view and dtype), puts it at the same place in
    the pool with the same declared size, and the export is still held open as the same
    storage; every other entry is checked and built afresh. A view keeps its storage
    mapped, and a mapped export's release unpaid, so only views over exports still held
    open are kept from one save to the next (:meth:`stage`).
    """

    def __init__(self) -> None:
        self._last: list = []  # per entry of the last part: an _Entry, or None (forgotten)

    def stage(self, exports: OpenExports, specs: list, open_export, copy,
              release: Callable = release_ipc_counters) -> set:
        """:func:`~ckptd.staging.exports.stage_part` (``copy(mappings)`` calls
        :meth:`copies`), then forget the views over whatever it did not keep open,
        whether the part succeeded or failed. Returns the export ids kept open."""
        try:
            return stage_part(exports, specs, open_export, copy, release)
        finally:
            self._keep_held(exports)

    def copies(self, torch, specs: list, starts: list, expected: list, pool_tensor,
               mappings: SaveMappings) -> tuple[list, list]:
        """``(destinations, sources)`` of a part's buffers, reusing what the last part of
        this trainer built.

        Parameters
        ----------
        torch
            The torch module (imported by the daemon only where CUDA staging runs).
        specs : list of dict
            Each buffer's IPC description: ``dtype``, ``size``, ``stride`` and ``offset`` (in
            elements, into its storage).
        starts : list of int
            Where each buffer's bytes go in the pool (absolute offsets).
        expected : list of int
            The bytes the request declared for each buffer.
        pool_tensor
            The staging pool as one uint8 tensor.
        mappings : SaveMappings
            The save's: opens, or finds held, each export (only for a description that passed
            the checks that need no storage) and records that the save used it.

        Raises
        ------
        ValueError
            For a dtype that is not a tensor's, a description whose bytes differ from what the
            request declared, or one that reaches past its storage: nothing is copied then.
        """
        last = self._last if len(self._last) == len(specs) else ()
        entries, destinations, sources = [], [], []
        byte_views: dict[int, object] = {}
        for i, (spec, start, declared) in enumerate(zip(specs, starts, expected)):
            entry = last[i] if last else None
            if (entry is None or entry.spec != spec or entry.start != start
                    or entry.declared != declared or not mappings.reuse(entry.export, spec,
                                                                        entry.storage)):
                layout = _checked(torch, spec, declared)
                storage = mappings.storage(spec)
                entry = _Entry(spec, start, declared, ipc_export_id(spec), storage,
                               *_views(torch, layout, start, pool_tensor, storage,
                                       byte_views))
            entries.append(entry)
            destinations.append(entry.destination)
            sources.append(entry.source)
        self._last = entries
        return destinations, sources

    @property
    def exports(self) -> set:
        """The export ids whose storages the kept views reference (tests, diagnostics)."""
        return {entry.export for entry in self._last if entry is not None}

    def _keep_held(self, exports: OpenExports) -> None:
        # Forgotten in place: a temporary saved once must not cost the views of the
        # parameters around it.
        self._last = [entry if entry is not None and exports.get(entry.export) is entry.storage
                      else None for entry in self._last]
