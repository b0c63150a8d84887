"""The short route's local plan: one walk that flattens a state dict and plans it.

DCP's default planner flattens the state dict (each leaf under a key string joined from
its path) and then makes one ``WriteItem`` per leaf. :func:`local_plan` does both in one
walk, and its objects are DCP's, equal and shared alike (see
:mod:`ckpt_client.dcp.fast_plan`). A training loop saves one structure again and again,
so the walk keeps, for each position of the state dict (a key under the same keys
above it), what the previous save made there, and hands it out again where DCP would
make an equal object: a byte leaf's item (frozen, it depends on the key string alone),
a tensor's item while the tensor keeps its size, dtype, layout, ``requires_grad`` and
pinning and the item's description is as it was made. A repeated leaf so costs no
string work: its key string comes with its item. Each leaf's path tuple is built from
this save's keys, as DCP builds it (the pickled plan shares key strings as DCP's does).

A position is known by equal keys of the same exact type (a ``str`` or an ``int``, whose
key strings follow from their values) all the way down, so its joined key string is
the same. Only the previous save's positions are kept; nothing here refers to a tensor
or a leaf's value. Must not: plan anything DCP plans differently (it raises
:class:`Fallback`, or leaves the leaf to DCP's own function), or keep what a planner
other than stock ``DefaultSavePlanner`` made (it may edit its items in place).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_bytesio

from ckpt_client.dcp.planner_methods import is_stock

#: Exact types the short route plans as plain tensors (a subclass may plan itself).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Exact types that are never containers, tensors or self-planning objects.
_SCALARS = frozenset({int, float, str, bytes, bool, complex, type(None)})
#: Exact leaf types DCP always writes as one byte item (a terminal list, any tuple).
_BYTE_LEAVES = _SCALARS | {list, tuple}
_TENSOR = WriteItemType.TENSOR
_CONTIGUOUS = torch.contiguous_format
#: The kinds of position (a spot's second field).
_TENSOR_SPOT, _BYTES_SPOT, _MAPPING_SPOT, _LIST_SPOT = "tensor", "bytes", "mapping", "list"


class Fallback(Exception):
    """Something the short route does not reproduce: DCP's own code handles it."""


def tensor_item(fqn: str, sizes: torch.Size, size: torch.Size, dtype: torch.dtype,
                layout: torch.layout, requires_grad: bool, pin_memory: bool) -> WriteItem:
    """DCP's ``_create_write_item_for_tensor``, its objects made in the same way (the
    chunk's ``sizes`` and the tensor's ``size`` are two equal objects, as DCP's two
    ``tensor.size()`` calls make them)."""
    offsets = torch.Size([0] * len(size))
    return WriteItem(
        index=MetadataIndex(fqn, offsets), type=_TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype, layout=layout,
                                        requires_grad=requires_grad,
                                        memory_format=_CONTIGUOUS, pin_memory=pin_memory),
            size=size))


def _terminal(value: Any) -> bool:
    """DCP's rule: a list is a leaf unless it holds a tensor or a container that is not
    a leaf; a mapping never is; anything else always is."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if type(entry) in _SCALARS:  # never a container or a tensor: no abstract checks
            continue
        if isinstance(entry, (Mapping, list)) and not _terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def _renamed(item: WriteItem, fqn: str) -> WriteItem:
    """``item`` under an equal key string of its own (a tensor's description is the same
    objects: nothing else in a plan refers to them)."""
    return WriteItem(index=MetadataIndex(fqn, item.index.offset), type=item.type,
                     tensor_data=item.tensor_data)


class _Walk:
    """One save's walk: the plan it makes and what it keeps for the next save.

    A spot (what a position keeps) is a tuple ``(key, kind, ...)``: a tensor's
    ``(key, kind, item, (size, dtype, layout, requires_grad, pinned), properties,
    their fields as made, chunk, its fields as made)``; a byte leaf's ``(key, kind,
    item)``; a container's ``(key, kind, {child key: spot})``. Spots are never changed:
    the next save's reuse them or makes new ones."""

    def __init__(self, is_coordinator: bool) -> None:
        self.is_coordinator = is_coordinator
        self.items: list = []
        #: DCP's flattened state dict and mappings, under the items' own key strings.
        self.keyed: dict = {}
        self.paths: dict = {}

    def mapping(self, mapping: Mapping, path: tuple, seen: dict) -> dict:
        """Walk ``mapping``'s entries (at ``path``; ``seen``: the spots of its keys in the
        previous save); the spots of this save's. Only ``str`` and ``int`` keys are kept:
        an equal key is then one of the same type, with the same key string."""
        made = {}
        place, keyed, paths, items = self.place, self.keyed, self.paths, self.items
        for key, value in mapping.items():
            kind = type(key)
            if kind is str:
                spot = seen.get(key)
                name = key
            elif kind is int:
                spot = seen.get(key)
                name = str(key)
            else:  # an equal key of another type (1.0, True, a str enum) may not give
                # the same key string: its position is not kept
                place(value, path + (str(key),), None, None)
                continue
            if (spot is not None and spot[1] is _TENSOR_SPOT and type(value) in PLAIN_TENSORS
                    and path and spot[3] == (value.size(), value.dtype, value.layout,
                                             value.requires_grad, value.is_pinned())
                    and vars(spot[4]) == spot[5] and vars(spot[6]) == spot[7]):
                # the usual case, inline: a tensor as it was, below the top level
                item = spot[2]
                fqn = item.index.fqn
                if fqn in keyed:
                    raise Fallback
                keyed[fqn] = value
                paths[fqn] = path + (name,)
                items.append(item)
                made[key] = spot
                continue
            made[key] = place(value, path + (name,), key, spot)
        return made

    def listed(self, values: list, path: tuple, seen: dict) -> dict:
        """As :meth:`mapping`, for a list DCP walks into (its paths hold the index)."""
        made = {}
        place = self.place
        for number, value in enumerate(values):
            made[number] = place(value, path + (number,), number, seen.get(number))
        return made

    def place(self, value: Any, path: tuple, key: Any, spot: tuple | None) -> tuple | None:
        """Flatten and plan ``value`` at ``path``; the spot kept for its position."""
        kind = type(value)
        if kind in PLAIN_TENSORS:
            return self.tensor(value, path, key, spot)
        if kind in _BYTE_LEAVES and (kind is not list or _terminal(value)):
            kept = spot[2] if spot is not None and spot[1] is _BYTES_SPOT else None
            fqn, item = self.enter(path, value, kept)
            if item is None:
                item = _create_write_item_for_bytesio(fqn, value)
            self.items.append(item)
            return spot if item is kept else (key, _BYTES_SPOT, item)
        if kind is dict or isinstance(value, Mapping):
            seen = spot[2] if spot is not None and spot[1] is _MAPPING_SPOT else {}
            return (key, _MAPPING_SPOT, self.mapping(value, path, seen))
        if _terminal(value):
            if isinstance(value, ShardedTensor):
                raise Fallback  # DCP rewrites nested sharded tensors before planning
            # DTensor, subclasses, objects: DCP's own code for this one entry
            fqn, _ = self.enter(path, value, None)
            self.items.extend(create_default_local_save_plan({fqn: value},
                                                             self.is_coordinator).items)
            return None
        seen = spot[2] if spot is not None and spot[1] is _LIST_SPOT else {}
        return (key, _LIST_SPOT, self.listed(value, path, seen))

    def tensor(self, value: torch.Tensor, path: tuple, key: Any, spot: tuple | None) -> tuple:
        """A plain tensor's item: the spot's while DCP would make an equal one."""
        shape = (value.size(), value.dtype, value.layout, value.requires_grad,
                 value.is_pinned())
        if (spot is not None and spot[1] is _TENSOR_SPOT and spot[3] == shape
                and vars(spot[4]) == spot[5] and vars(spot[6]) == spot[7]):
            _, item = self.enter(path, value, spot[2])
            self.items.append(item)
            return spot if item is spot[2] else spot[:2] + (item,) + spot[3:]  # renamed
        fqn, _ = self.enter(path, value, None)
        item = tensor_item(fqn, shape[0], value.size(), *shape[1:])
        self.items.append(item)
        data = item.tensor_data
        return (key, _TENSOR_SPOT, item, shape, data.properties, dict(vars(data.properties)),
                data.chunk, dict(vars(data.chunk)))

    def enter(self, path: tuple, value: Any, item: WriteItem | None) -> tuple:
        """Enter ``value`` at ``path`` in the flattened dict, under ``item``'s key string
        (a previous save's item: renamed where DCP's string is the path's own) or, with
        no ``item``, the one DCP joins; ``(key string, item)``."""
        if item is not None:
            fqn = item.index.fqn
            if len(path) == 1 and fqn is not path[0]:  # DCP's key is the path's own string
                fqn = path[0]
                item = _renamed(item, fqn)
        else:
            fqn = ".".join(map(str, path))
        if fqn in self.keyed:
            raise Fallback  # DCP raises its own error for the duplicated key
        self.keyed[fqn] = value
        self.paths[fqn] = path
        return fqn, item


#: Per position of the previous save's state dict (stock planner only), its spot.
_last: dict = {}


def local_plan(planner: DefaultSavePlanner, state_dict: Any,
               is_coordinator: bool) -> SavePlan | None:
    """``planner.set_up_planner(state_dict, ...)`` then ``planner.create_local_plan()``,
    leaving the planner as they do; ``None`` (planner untouched) where DCP's own walk
    must run (a sharded tensor, a duplicated key, a non-dict state dict)."""
    global _last
    if type(state_dict) is not dict:
        return None
    # Only stock DCP's own planner gets the previous save's items: a subclass (or any
    # later step) may edit them in place (torch's FP16 planner rewrites each dtype), and
    # a tensor's item is checked against its fields as made for edits made anyway.
    shares = is_stock(planner)
    walk = _Walk(is_coordinator)
    try:
        made = walk.mapping(state_dict, (), _last if shares else {})
    except Fallback:
        return None
    _last = made if shares else {}
    planner.mappings = walk.paths
    planner.state_dict = walk.keyed
    planner.is_coordinator = is_coordinator
    planner.plan = SavePlan(walk.items, planner_data=walk.paths)
    return planner.plan
