"""Turning a state dict into what the daemon stages: a msgpack skeleton and a list of buffers.

The skeleton is the state dict's structure with every tensor replaced by a
:class:`ckptd.protocol.TensorRef`; the buffers are the tensors (as they are: never copied
nor detached here; the copy into the pool runs without autograd) and raw byte items, each
described as ``[dtype, shape, nbytes]``. Only plain values travel in the skeleton (dict,
list, tuple, str, bytes, numbers, bool, None): nothing is pickled. Owns the rules for what
can be saved; knows nothing of connections.
"""

from __future__ import annotations

import io
from typing import Any, NamedTuple

import torch

from ckptd import protocol


#: torch dtype -> protocol name, filled on first use (a save names each dtype ~1000 times).
_DTYPE_NAMES: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name for a torch dtype."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if name not in protocol.BUFFER_DTYPES:
            raise TypeError(f"tensors of dtype {dtype} cannot be checkpointed through ckptd")
        _DTYPE_NAMES[dtype] = name
    return name


def plain_tensor(value: torch.Tensor, where: str) -> torch.Tensor:
    """The tensor to stage for ``value``: detached, dense; subclasses are refused."""
    if value.is_quantized or value.layout != torch.strided:
        raise TypeError(f"{where}: {value.layout} / quantized tensors are not supported; "
                        "convert them (e.g. .dequantize() or .to_dense()) before saving")
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where}: tensor subclass {type(value).__name__} is not supported; "
                        "save its plain local tensor instead")
    return value.detach()


class _Refused(Exception):
    """A value flatten cannot save; ``where`` grows as the walk unwinds, so the location
    string is built only for the value that fails, not for every leaf of every save."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value
        self.where = ""


class Flattened(NamedTuple):
    """A state dict taken apart for staging.

    Attributes
    ----------
    skeleton : bytes
        The msgpack skeleton.
    tensors : list of torch.Tensor
        The state dict's own tensors, in the skeleton's reference order.
    layout : list of (torch.dtype, torch.Size)
        Per tensor, what its buffer description is made of (:func:`buffers_of`); cheaper
        to take and to compare than the description itself, so a save of the layout of
        the save before is recognised without describing each tensor again.
    on_cpu : bool
        Whether every tensor is a CPU tensor.
    """

    skeleton: bytes
    tensors: list
    layout: list
    on_cpu: bool


_PLAIN_LEAVES = (str, bytes, int, float, bool)
#: Exact types of plain tensors and of plain leaves, checked first: most values of a state
#: dict are one of them.
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_PLAIN_TYPES = frozenset({str, bytes, int, float, bool, type(None)})


def flatten_state_dict(state_dict: Any) -> Flattened:
    """Split a state dict into its msgpack skeleton and its tensors.

    Raises
    ------
    TypeError
        For values other than tensors, dicts, lists, tuples, str, bytes, int, float,
        bool and None (naming the key where it was found), and for tensors of a dtype
        the protocol does not carry.
    """
    tensors: list[torch.Tensor] = []
    layout: list = []
    cuda: list = []
    names, strided = _DTYPE_NAMES, torch.strided
    ref = protocol.packed_tensor_ref  # packed natively: no encoder hook per tensor
    tensor_types, plain_types = _PLAIN_TENSORS, _PLAIN_TYPES

    # The walk runs once per value on every save (thousands of them): containers handle
    # their tensors and plain leaves in their own loop, exact types first, and a tensor
    # is described by what is cheapest to read (its dtype and shape objects).
    def take(value: torch.Tensor) -> Any:
        dtype = value.dtype
        if dtype not in names and (value.is_quantized or not dtype_name(dtype)):
            raise _Refused(value)  # dtype_name raises for dtypes the protocol lacks
        if value.layout is not strided:
            raise _Refused(value)
        if value.is_cuda:
            cuda.append(value)
        layout.append((dtype, value.shape))
        tensors.append(value)
        return ref(len(tensors) - 1)

    def walk(value: Any) -> Any:
        kind = type(value)
        if kind in tensor_types:
            return take(value)
        if kind in plain_types:
            return value
        if kind is dict or isinstance(value, dict):
            out = {}
            try:
                for key, item in value.items():
                    kind = type(item)
                    if kind in plain_types:
                        out[key] = item
                    elif kind in tensor_types:
                        out[key] = take(item)
                    else:
                        out[key] = walk(item)
            except _Refused as exc:
                exc.where = f".{key}{exc.where}"
                raise
            return out
        if kind is list or kind is tuple or isinstance(value, (list, tuple)):
            items = []
            try:
                for index, item in enumerate(value):
                    kind = type(item)
                    if kind in plain_types:
                        items.append(item)
                    elif kind in tensor_types:
                        items.append(take(item))
                    else:
                        items.append(walk(item))
            except _Refused as exc:
                exc.where = f"[{index}]{exc.where}"
                raise
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, _PLAIN_LEAVES):
            return value
        raise _Refused(value)  # tensor subclasses too: plain_tensor says why

    try:
        skeleton = walk(state_dict)
    except _Refused as exc:
        if isinstance(exc.value, torch.Tensor):
            plain_tensor(exc.value, f"state_dict{exc.where}")  # raises with the fix
        raise TypeError(f"state_dict{exc.where} is a {type(exc.value).__name__}, which ckptd "
                        "cannot store without pickling; store it as a tensor or a plain "
                        "value") from None
    finally:
        # walk calls itself through its closure cell, a reference cycle that would keep
        # this save's tensors (on a GPU, their device memory) alive until the collector's
        # next full pass; emptying the cell lets reference counting free them.
        walk = None
    return Flattened(protocol.pack_value(skeleton), tensors, layout, not cuda)


def buffers_of(layout: list) -> list:
    """The ``[dtype, shape, nbytes]`` descriptions of a :attr:`Flattened.layout`."""
    names = _DTYPE_NAMES
    return [[names[dtype], list(shape), shape.numel() * dtype.itemsize]
            for dtype, shape in layout]


def describe(source: torch.Tensor | io.BytesIO | bytes) -> list:
    """The ``[dtype, shape, nbytes]`` entry for one buffer."""
    if isinstance(source, torch.Tensor):
        return [_DTYPE_NAMES.get(source.dtype) or dtype_name(source.dtype), list(source.shape),
                source.nbytes]
    data = source.getbuffer() if isinstance(source, io.BytesIO) else memoryview(source)
    return ["bytes", [data.nbytes], data.nbytes]
