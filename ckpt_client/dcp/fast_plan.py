"""``DefaultSavePlanner``'s plans, made without its per-item overhead.

A DCP save plans on every call unless its plan is cached: flatten the state dict (DCP
walks it twice: once to flatten, once more for sharded tensors), one ``WriteItem`` per
leaf, deduplication across ranks, index hints and the global metadata, then each item's
data looked up again by its key. For the thousand-odd leaves of a training state that is
tens of µs per tensor, most of what a blocking save costs over the copy. This module owns
the short route for the default planner: one walk that flattens and plans (in
:mod:`ckpt_client.dcp.fast_local`), a global plan built directly, and item data taken
from the flattened dict.

Every function here yields objects equal to what ``DefaultSavePlanner`` makes, built in
the same order from the same values (so they pickle byte for byte alike: the
``.metadata`` file does not change), and takes the short route only where that is so by
construction. Anything else goes DCP's own way, whole: a planner that overrides a
planning method, plan caching, DTensor, ``ShardedTensor``, tensor subclasses, objects
that plan themselves, and global plans that need DCP's validation (sharded chunks, keys
that collide) or would raise.
"""

from __future__ import annotations

import dataclasses
import io
from collections import ChainMap, defaultdict
from operator import is_

import torch
from torch._utils import _element_size
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)

from ckptd import knobs
from ckpt_client.dcp.fast_local import PLAIN_TENSORS as _PLAIN_TENSORS
from ckpt_client.dcp.fast_local import local_plan, tensor_item  # noqa: F401 (this route's API)
from ckpt_client.dcp.leaf_bytes import exact_key, save_settings, worth_keeping
from ckpt_client.dcp.planner_methods import keeps_default_methods

_TENSOR = WriteItemType.TENSOR
_BYTE_IO = WriteItemType.BYTE_IO

#: The planner methods each route reproduces; a planner overriding one plans DCP's way.
_LOCAL = ("set_up_planner", "create_local_plan")
_GLOBAL = ("create_global_plan", "_create_global_plan", "_dedup_save_plans")
_RESOLVE = ("resolve_data", "lookup_object", "transform_object")


def _default_methods(planner: SavePlanner, names: tuple) -> bool:
    return (knobs.DCP_FAST_PLAN.get() and keeps_default_methods(planner, names)
            and not getattr(planner, "_enable_plan_caching", False))


def _tensors_plan_themselves() -> bool:
    # DCP asks any object with these hooks to plan and resolve itself, before it checks
    # for plain tensors.
    return any(hasattr(kind, hook) for kind in _PLAIN_TENSORS
               for hook in ("__create_write_items__", "__get_tensor_shard__"))


def plans_locally(planner: SavePlanner) -> bool:
    """Whether :func:`local_plan` may stand in for ``set_up_planner`` + ``create_local_plan``."""
    return (_default_methods(planner, _LOCAL) and planner.flatten_state_dict
            and planner.flatten_sharded_tensors and _version._derived_version != "2_3"
            and not _tensors_plan_themselves())


def plans_globally(planner: SavePlanner) -> bool:
    """Whether :func:`global_plan` may stand in for ``create_global_plan``."""
    return _default_methods(planner, _GLOBAL)


def resolves(planner: SavePlanner) -> bool:
    """Whether :func:`sources` may stand in for ``resolve_data`` on each item."""
    return (_default_methods(planner, _RESOLVE)
            and isinstance(getattr(planner, "state_dict", None), dict)
            and not _tensors_plan_themselves())


# ------------------------------------------------------------------ the global plan

class _LastSave:
    """What the previous save made that the next one may hand out again: each tensor
    item's item in the global plan (DCP's rewrite of an item depends on the item alone
    once its key is known to be planned once), and the ``torch.save`` bytes of its
    immutable non-tensor leaves, keyed by the exact value and the serialization
    settings. Only the previous save's entries are kept, so a changed structure leaves
    nothing behind. Nothing here refers to a tensor."""

    def __init__(self) -> None:
        self.pickled: dict = {}
        #: id(local item) -> (that item, its item in the global plan): the id is only
        #: trusted while the entry holds the item itself alive. ``finals`` for the
        #: coordinator's global plan, ``own_finals`` for a rank rebuilding its own.
        self.finals: dict = {}
        self.own_finals: dict = {}
        #: A single-rank save's (local items, final items, metadata keys, metadata
        #: entries, their fields as made): what :func:`_again` hands out again.
        self.single: tuple | None = None


_LAST = _LastSave()
_NOTHING = (None, None)


def _replacer(cls: type, name: str):
    """``dataclasses.replace(obj, name=value)`` for ``cls``, without its generic checks."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    def replace(obj, value):
        return cls(**{n: (value if n == name else getattr(obj, n)) for n in names})
    return replace


_with_items = _replacer(SavePlan, "items")
_with_index = _replacer(WriteItem, "index")


def _storage_size(item: WriteItem, element_sizes: dict) -> int | None:
    """``item.tensor_storage_size()``, with the element size looked up once per dtype."""
    data = item.tensor_data
    if data is None:
        return None
    dtype = data.properties.dtype
    element = element_sizes.get(dtype)
    if element is None:
        element = element_sizes[dtype] = _element_size(dtype)
    count = 1
    for extent in data.size:
        count *= extent
    return count * element


def _dedup(all_plans: list[SavePlan], to_lowest_rank: bool) -> list[list]:
    """DCP's ``dedup_save_plans``, keyed by ``(fqn, offset)`` (what a ``MetadataIndex``
    compares and hashes) so that the keys hash in C; the sets of plan indices are built
    in the same order, so ties go the same way."""
    where: dict = defaultdict(set)
    item_of: dict = {}
    if len(all_plans) == 1:  # nothing to deduplicate against: every item stays
        return [list(all_plans[0].items)]
    kept = []
    for plan_idx, plan in enumerate(all_plans):
        keys = set()
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            keys.add(key)
            where[key].add(plan_idx)
            item_of[key] = item
        kept.append(keys)
    sizes = [0] * len(all_plans)
    element_sizes: dict = {}
    for key, plan_indices in where.items():
        if len(plan_indices) == 1:
            (chosen,) = plan_indices
        elif to_lowest_rank:
            chosen = min(plan_indices)
        else:
            chosen = min(plan_indices, key=sizes.__getitem__)
        sizes[chosen] += _storage_size(item_of[key], element_sizes) or 1
        for plan_idx in plan_indices:
            if plan_idx != chosen:
                kept[plan_idx].discard(key)
    return [[item for item in plan.items if (item.index.fqn, item.index.offset) in keys]
            for plan, keys in zip(all_plans, kept)]


def _whole_chunk(data: TensorWriteData) -> bool:
    """The item writes its whole tensor: DCP's validation finds nothing to report."""
    chunk = data.chunk
    return (chunk is not None and not any(chunk.offsets) and chunk.sizes == data.size
            and len(chunk.offsets) == len(data.size) and all(s >= 0 for s in data.size))


def global_plan(planner: DefaultSavePlanner, all_plans: list[SavePlan]
                ) -> tuple[list[SavePlan], Metadata] | None:
    """``planner.create_global_plan(all_plans)``, leaving the planner as it does; ``None``
    (planner untouched) where DCP's own code must run: items that are not whole plain
    tensors or byte items, keys that collide, anything DCP validates or refuses."""
    made = _again(all_plans) or _planned(all_plans, planner.dedup_save_to_lowest_rank)
    if made is None:
        return None
    plans, md = made
    metadata = Metadata(md)
    if planner.flatten_state_dict:  # a ChainMap of one map lists it as it is: 0.2 ms less
        maps = [p.planner_data for p in plans]
        merged = dict(maps[0]) if len(maps) == 1 else dict(ChainMap(*maps))
        metadata = dataclasses.replace(metadata, planner_data=merged)
    planner.global_plan = plans
    planner.metadata = metadata
    return plans, metadata


def _again(all_plans: list[SavePlan]) -> tuple[list[SavePlan], dict] | None:
    """A single rank's global plan and metadata entries made of the previous ones, when
    its local items are the very items of the previous single-rank save (the local walk
    hands them out again while DCP would make equal ones): the same final items, and
    the same metadata entries while each is as it was made (they are not frozen)."""
    last = _LAST.single
    if last is None or len(all_plans) != 1 or type(all_plans[0]) is not SavePlan:
        return None
    plan = all_plans[0]
    items, finals, fqns, entries, fields = last
    if (len(plan.items) != len(items) or not all(map(is_, plan.items, items))
            or list(map(vars, entries)) != fields):
        return None
    return [_with_items(plan, list(finals))], dict(zip(fqns, entries))


def _planned(all_plans: list[SavePlan], to_lowest_rank: bool
             ) -> tuple[list[SavePlan], dict] | None:
    """The global plan and the metadata entries DCP makes, item by item."""
    finals = _LAST.finals
    _LAST.single = None
    for plan in all_plans:
        if type(plan) is not SavePlan:
            return None
        for item in plan.items:
            if finals.get(id(item), _NOTHING)[0] is item:
                continue  # checked when its final item was made
            if type(item) is not WriteItem or type(item.index) is not MetadataIndex:
                return None
            if item.type is _TENSOR:
                if item.tensor_data is None or not _whole_chunk(item.tensor_data):
                    return None
            elif item.type is not _BYTE_IO:
                return None
    kept = _dedup(all_plans, to_lowest_rank)
    md: dict = {}
    plans = []
    made: dict = {}
    fields = []  # each metadata entry's fields as made (the chunk list a copy)
    for plan, items in zip(all_plans, kept):
        new_items = []
        for item in items:
            fqn = item.index.fqn
            if fqn in md:
                return None  # DCP refuses a key planned twice
            if item.type is _BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                fields.append({})
                new_items.append(item)
                continue
            data = item.tensor_data
            md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size,
                                            chunks=[data.chunk])
            fields.append({"properties": data.properties, "size": data.size,
                           "chunks": [data.chunk]})
            known = finals.get(id(item), _NOTHING)
            final = (known[1] if known[0] is item
                     else _with_index(item, MetadataIndex(fqn, item.index.offset, 0)))
            made[id(item)] = (item, final)
            new_items.append(final)
        plans.append(_with_items(plan, new_items))
    _LAST.finals = made
    if len(all_plans) == 1:
        _LAST.single = (tuple(all_plans[0].items), tuple(plans[0].items), tuple(md),
                        tuple(md.values()), fields)
    return plans, md


def final_items(items: list) -> list:
    """Each of a rank's local ``items`` (whole plain tensors and byte items) as the global
    plan has it: a tensor's index hint set to its first (only) chunk, as DCP rewrites it."""
    known, made, out = _LAST.own_finals, {}, []
    for item in items:
        if item.type is _BYTE_IO:
            out.append(item)
            continue
        entry = known.get(id(item), _NOTHING)
        final = (entry[1] if entry[0] is item
                 else _with_index(item, MetadataIndex(item.index.fqn, item.index.offset, 0)))
        made[id(item)] = (item, final)
        out.append(final)
    _LAST.own_finals = made
    return out


def create_global_plan(planner: SavePlanner, all_plans: list[SavePlan]
                       ) -> tuple[list[SavePlan], Metadata]:
    """``planner.create_global_plan(all_plans)``, the short way where it applies."""
    made = global_plan(planner, all_plans) if plans_globally(planner) else None
    return made if made is not None else planner.create_global_plan(all_plans)


# ------------------------------------------------------------------ resolving items

def sources(plan: SavePlan, planner: DefaultSavePlanner) -> list:
    """``[planner.resolve_data(item) for item in plan.items]``: plain tensors straight
    from the flattened state dict (what DCP's lookup returns for them), immutable leaves
    as the bytes ``torch.save`` wrote for the same value in the previous save,
    everything else through the planner."""
    flat = planner.state_dict
    settings = None
    known, made = _LAST.pickled, {}
    out = []
    for item in plan.items:
        value = flat.get(item.index.fqn, flat)
        kind = type(value)
        offset = item.index.offset
        if (item.type is _TENSOR and kind in _PLAIN_TENSORS and offset is not None
                and len(offset) == value.dim() and not any(offset)):
            out.append(value)
        elif (item.type is _BYTE_IO and offset is None and value is not flat
              and not isinstance(value, torch.Tensor)):
            key = exact_key(value)
            if key is not None:
                settings = settings or save_settings()
                key = (settings, key)
                data = known.get(key)
                if data is not None:
                    made[key] = data
                    out.append(io.BytesIO(data))
                    continue
            stream = io.BytesIO()
            torch.save(value, stream)
            if key is not None and worth_keeping(stream.getbuffer().nbytes):
                made[key] = stream.getvalue()
            out.append(stream)
        else:
            out.append(planner.resolve_data(item))
    _LAST.pickled = made
    return out
