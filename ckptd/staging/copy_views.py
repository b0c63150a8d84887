"""The copies of one part of a CUDA save, as (destination, source) tensor views.

Owns turning a part's buffer descriptions (the trainer's storage, element offset, size,
stride, dtype) into views of the opened storages and of the staging pool, checked against
what the request declared, so the device worker issues the whole part as one
``torch._foreach_copy_`` instead of a Python loop of view-building and ``copy_`` calls per
tensor (about 50 µs a tensor on an H100, where the copies themselves take a fraction of
that). A contiguous tensor is copied as its bytes: a slice of a byte view of its storage
(one per storage, however many tensors share it) into a slice of the pool, no dtype views;
any other keeps its dtype, size and stride.

Device-agnostic (only tensor views; no stream, event or CUDA call), so it is tested on the
CPU with storages standing in for opened exports.
"""

from __future__ import annotations

import math
from typing import Callable

from ckptd import protocol

__all__ = ["part_copies"]


def _contiguous(size: list, stride: list) -> bool:
    expected = 1
    for dim, step in zip(reversed(size), reversed(stride)):
        if dim != 1 and step != expected:
            return False
        expected *= dim
    return True


def part_copies(torch, specs: list, starts: list, expected: list, pool_tensor,
                storage_of: Callable) -> tuple[list, list]:
    """``(destinations, sources)`` of one part's buffers.

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
    storage_of : callable
        ``spec -> storage`` (the opened export's ``UntypedStorage``).

    Raises
    ------
    ValueError
        For a dtype that is not a tensor's, a description whose bytes differ from what the
        request declared, or one that reaches past its storage: nothing is copied then.
    """
    destinations, sources = [], []
    byte_views: dict[int, object] = {}  # id(storage) -> uint8 tensor over all of it
    for spec, start, declared in zip(specs, starts, expected):
        name = spec.get("dtype")
        if name not in protocol.BUFFER_DTYPES or name == "bytes":
            raise ValueError(f"unsupported dtype {name!r} in a CUDA IPC description")
        dtype = getattr(torch, name)
        size, stride, first = list(spec["size"]), list(spec["stride"]), int(spec["offset"])
        nbytes = math.prod(size) * dtype.itemsize
        if nbytes != declared:
            raise ValueError(f"IPC tensor of {nbytes} bytes does not match the {declared} "
                             "bytes the request declared; refusing to write past its extent")
        storage = storage_of(spec)
        # Checked here, not left to torch: a byte slice would be cut short silently, and
        # set_ grows a resizable storage instead of refusing.
        if first < 0 or any(step < 0 for step in stride) or len(stride) != len(size):
            raise ValueError(f"IPC tensor with offset {first} and strides {stride} for size "
                             f"{size}: not a tensor's layout")
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
            sources.append(whole[begin:begin + nbytes])
        else:
            sources.append(torch.empty(0, dtype=dtype, device=storage.device).set_(
                storage, first, size, stride))
            destination = destination.view(dtype).view(size)
        destinations.append(destination)
    return destinations, sources
