"""The plan collectives' payloads, compact where a plan is the default planner's plain kind.

An uncached DCP save over several ranks gathers every rank's local plan to the
coordinator and scatters each rank's final plan back: as pickled ``SavePlan`` objects,
a thousand-odd ``WriteItem`` dataclasses a rank, pickled and unpickled on both ends (the
most part of planning on two ranks). This module owns a smaller form for the usual
plan (whole plain tensors and byte items): a local plan travels as one tuple of plain
values per item (with the plan's own key strings and mappings, so that what the
coordinator rebuilds shares its objects as an unpickled plan does), and a final plan
travels as the positions of the local items it keeps and its storage data, which the
rank applies to its own local plan. What each end gets is equal to what the pickled
plans give; any other plan travels whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from ckpt_client.dcp.fast_plan import final_items, tensor_item

_TENSOR = WriteItemType.TENSOR
_BYTE_IO = WriteItemType.BYTE_IO
_CONTIGUOUS = torch.contiguous_format


@dataclass
class PackedLocalPlan:
    """A local plan of whole plain tensors and byte items, as plain values."""

    #: ``(fqn,)`` for a byte item; ``(fqn, size, dtype, layout, requires_grad,
    #: pin_memory)`` for a tensor written whole.
    items: list
    planner_data: Any


@dataclass
class KeptItems:
    """A final plan: the rank's local items at ``positions`` (a tensor's index hint set
    to its first chunk), with the coordinator's storage data."""

    positions: list
    storage_data: Any


def _plain(item: WriteItem) -> tuple | None:
    index = item.index
    if (type(item) is not WriteItem or type(index) is not MetadataIndex
            or index.index is not None or item.bytes_io_data is not None):
        return None
    if item.type is _BYTE_IO:
        return (index.fqn,) if index.offset is None and item.tensor_data is None else None
    data = item.tensor_data
    if item.type is not _TENSOR or data is None or type(data) is not TensorWriteData:
        return None
    chunk, props, size = data.chunk, data.properties, data.size
    if (type(chunk) is not ChunkStorageMetadata or type(props) is not TensorProperties
            or props.memory_format != _CONTIGUOUS or chunk.sizes != size
            or len(chunk.offsets) != len(size) or any(chunk.offsets)
            or index.offset != chunk.offsets):
        return None
    return (index.fqn, tuple(size), props.dtype, props.layout, props.requires_grad,
            props.pin_memory)


def pack_local(plan: SavePlan) -> PackedLocalPlan | SavePlan:
    """``plan`` as it goes to the coordinator: packed, or whole if not the plain kind."""
    if type(plan) is not SavePlan or plan.storage_data is not None or not plan.usable:
        return plan
    items = []
    for item in plan.items:
        packed = _plain(item)
        if packed is None:
            return plan
        items.append(packed)
    return PackedLocalPlan(items, plan.planner_data)


def unpack_local(payload: PackedLocalPlan | SavePlan) -> SavePlan:
    """The local plan a rank sent, as the coordinator plans with it."""
    if type(payload) is not PackedLocalPlan:
        return payload
    items = [WriteItem(index=MetadataIndex(p[0]), type=_BYTE_IO) if len(p) == 1
             else tensor_item(p[0], torch.Size(p[1]), torch.Size(p[1]), *p[2:])
             for p in payload.items]
    return SavePlan(items, planner_data=payload.planner_data)


def pack_final(local: SavePlan, final: SavePlan, sent: PackedLocalPlan | SavePlan
               ) -> KeptItems | SavePlan:
    """The coordinator's final plan for a rank whose local plan it got as ``sent``
    (rebuilt as ``local``): which local items it keeps, if every kept item is the local
    one (a tensor's with its index hint 0) and nothing but the storage data changed;
    else the whole plan."""
    if (type(sent) is not PackedLocalPlan or type(final) is not SavePlan or not final.usable
            or final.planner_data is not local.planner_data):
        return final
    positions, at, items = [], 0, local.items
    for item in final.items:
        while at < len(items) and items[at].index.fqn != item.index.fqn:
            at += 1
        if at == len(items):
            return final
        mine = items[at]
        if item is not mine and not (
                type(item) is WriteItem and item.type is _TENSOR and mine.type is _TENSOR
                and item.tensor_data is mine.tensor_data and item.bytes_io_data is None
                and type(item.index) is MetadataIndex and item.index.index == 0
                and item.index.offset == mine.index.offset):
            return final
        positions.append(at)
        at += 1
    return KeptItems(positions, final.storage_data)


def unpack_final(payload: KeptItems | SavePlan, local: SavePlan) -> SavePlan:
    """This rank's final plan from the coordinator's payload and its own local plan."""
    if type(payload) is not KeptItems:
        return payload
    items = final_items([local.items[at] for at in payload.positions])
    return SavePlan(items, storage_data=payload.storage_data,
                    planner_data=local.planner_data, usable=True)
