"""Turning a state dict into what the daemon stages: a msgpack skeleton and a list of buffers.

The skeleton is the state dict's structure with every tensor replaced by a
:class:`ckptd.protocol.TensorRef`; the buffers are the tensors (detached, never copied
here) and raw byte items, each described as ``[dtype, shape, nbytes]``. Only plain values
travel in the skeleton (dict, list, tuple, str, bytes, numbers, bool, None): nothing is
pickled. Owns the rules for what can be saved; knows nothing of connections.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ckptd import protocol
from ckptd.protocol import TensorRef


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


_PLAIN_LEAVES = (str, bytes, int, float, bool)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Exact types of plain leaves, checked first: most leaves of a state dict are one.
_PLAIN_TYPES = frozenset({str, bytes, int, float, bool, type(None)})


def flatten_state_dict(state_dict: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Split a state dict into its msgpack skeleton and its tensors.

    Raises
    ------
    TypeError
        For values other than tensors, dicts, lists, tuples, str, bytes, int, float,
        bool and None (naming the key where it was found).
    """
    tensors: list[torch.Tensor] = []
    strided = torch.strided
    ref = protocol.packed_tensor_ref  # packed natively: no encoder hook per tensor

    # The walk runs once per leaf on every save (thousands of them), so it tests exact
    # types first and leaves isinstance to the rarer subclasses (OrderedDict, ...).
    def walk(value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN_TENSORS:
            if value.is_quantized or value.layout != strided:
                raise _Refused(value)
            tensors.append(value.detach())
            return ref(len(tensors) - 1)
        if kind in _PLAIN_TYPES:
            return value
        if kind is dict or isinstance(value, dict):
            out = {}
            for k, v in value.items():
                try:
                    out[k] = walk(v)
                except _Refused as exc:
                    exc.where = f".{k}{exc.where}"
                    raise
            return out
        if kind is list or kind is tuple or isinstance(value, (list, tuple)):
            items = []
            for i, v in enumerate(value):
                try:
                    items.append(walk(v))
                except _Refused as exc:
                    exc.where = f"[{i}]{exc.where}"
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
    return protocol.pack_value(skeleton), tensors


def describe(source: torch.Tensor | io.BytesIO | bytes) -> list:
    """The ``[dtype, shape, nbytes]`` entry for one buffer."""
    if isinstance(source, torch.Tensor):
        return [_DTYPE_NAMES.get(source.dtype) or dtype_name(source.dtype), list(source.shape),
                source.nbytes]
    data = source.getbuffer() if isinstance(source, io.BytesIO) else memoryview(source)
    return ["bytes", [data.nbytes], data.nbytes]
