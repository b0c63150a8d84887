"""``DefaultSavePlanner``'s plans, made without its per-item overhead.

A DCP save plans on every call unless its plan is cached: flatten the state dict (DCP
walks it twice: once to flatten, once more for sharded tensors), one ``WriteItem`` per
leaf, deduplication across ranks, index hints and the global metadata, then each item's
data looked up again by its key. For the thousand-odd leaves of a training state that is
tens of µs per tensor, most of what a blocking save costs over the copy. This module owns
the short route for the default planner: one walk that flattens and plans, a global plan
built directly, and item data taken from the flattened dict.

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
from collections.abc import Mapping
from typing import Any

import torch
from torch._utils import _element_size
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)

from ckptd import knobs
from ckpt_client.dcp.leaf_bytes import exact_key, save_settings, worth_keeping
from ckpt_client.dcp.planner_methods import is_stock, keeps_default_methods

#: Exact types the short route plans as plain tensors (a subclass may plan itself).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Exact types that are never containers, tensors or self-planning objects.
_SCALARS = frozenset({int, float, str, bytes, bool, complex, type(None)})
_TENSOR = WriteItemType.TENSOR
_BYTE_IO = WriteItemType.BYTE_IO
_CONTIGUOUS = torch.contiguous_format

#: The planner methods each route reproduces; a planner overriding one plans DCP's way.
_LOCAL = ("set_up_planner", "create_local_plan")
_GLOBAL = ("create_global_plan", "_create_global_plan", "_dedup_save_plans")
_RESOLVE = ("resolve_data", "lookup_object", "transform_object")


class _Fallback(Exception):
    """Something the short route does not reproduce: DCP's own code handles it."""


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


# ------------------------------------------------------------------ the local plan

def _flatten(state_dict: Mapping) -> tuple[dict, dict]:
    """DCP's ``flatten_state_dict`` (its traversal rules exactly), with exact-type checks
    before the abstract ones it makes on every value."""
    flat: dict = {}
    mappings: dict = {}

    def terminal(value: Any) -> bool:  # DCP's rule: a list is a leaf unless it holds
        if isinstance(value, Mapping):  # a tensor or a container that is not a leaf
            return False
        if not isinstance(value, list):
            return True
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not terminal(entry):
                return False
            if isinstance(entry, torch.Tensor):
                return False
        return True

    def visit(path: tuple, value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in flat:
            raise _Fallback  # DCP raises its own error for the duplicated key
        flat[fqn] = value
        mappings[fqn] = path

    def walk(path: tuple, value: Any) -> None:
        kind = type(value)
        if kind in _SCALARS or kind in _PLAIN_TENSORS:
            visit(path, value)
        elif kind is dict or isinstance(value, Mapping):
            for key, entry in value.items():
                walk(path + (str(key),), entry)
        elif terminal(value):
            visit(path, value)
        elif isinstance(value, (list, tuple)):
            for number, entry in enumerate(value):
                walk(path + (number,), entry)

    try:
        for key, value in state_dict.items():
            walk((str(key),), value)
    finally:
        walk = terminal = None  # they call themselves through their cells: no garbage cycle
    return flat, mappings


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


def _tensor_item(fqn: str, tensor: torch.Tensor) -> WriteItem:
    return tensor_item(fqn, tensor.size(), tensor.size(), tensor.dtype, tensor.layout,
                       tensor.requires_grad, tensor.is_pinned())


def _as_made(item: WriteItem) -> tuple:
    """``item`` with copies of its description's mutable fields as it was made: the
    description's objects are not frozen, and a planner or storage writer may edit
    them in place after planning (a changed value shows; an equal one of another type,
    which no DCP code makes, would not)."""
    data = item.tensor_data
    return item, dict(vars(data.properties)), dict(vars(data.chunk))


def _intact(entry: tuple) -> bool:
    data = entry[0].tensor_data
    return vars(data.properties) == entry[1] and vars(data.chunk) == entry[2]


def _renamed(item: WriteItem, fqn: str) -> WriteItem:
    """``item`` under an equal key string of its own (the tensor's description is the
    same objects: nothing else in a plan refers to them)."""
    return WriteItem(index=MetadataIndex(fqn, item.index.offset), type=item.type,
                     tensor_data=item.tensor_data)


class _LastSave:
    """What the previous save made that the next one may hand out again: its tensor
    items, keyed by everything DCP reads to make one (so a hit is the very item DCP
    would make again), each one's item in the global plan (DCP's rewrite of an item
    depends on the item alone once its key is known to be planned once), and the
    ``torch.save`` bytes of its immutable non-tensor leaves, keyed by the exact value
    and the serialization settings. Only the previous save's entries are kept, so a
    changed structure leaves nothing behind. Nothing here refers to a tensor."""

    def __init__(self) -> None:
        self.items: dict = {}
        self.pickled: dict = {}
        #: id(local item) -> (that item, its item in the global plan): the id is only
        #: trusted while the entry holds the item itself alive. ``finals`` for the
        #: coordinator's global plan, ``own_finals`` for a rank rebuilding its own.
        self.finals: dict = {}
        self.own_finals: dict = {}


_LAST = _LastSave()
_NOTHING = (None, None)


def local_plan(planner: DefaultSavePlanner, state_dict: Any,
               is_coordinator: bool) -> SavePlan | None:
    """``planner.set_up_planner(state_dict, ...)`` then ``planner.create_local_plan()``,
    leaving the planner as they do; ``None`` (planner untouched) where DCP's own walk
    must run (a sharded tensor, a duplicated key, a non-dict state dict)."""
    if type(state_dict) is not dict:
        return None
    try:
        flat, mappings = _flatten(state_dict)
    except _Fallback:
        return None
    # Only stock DCP's own planner gets the previous save's items: a subclass (or any
    # later step) may edit them in place (torch's FP16 planner rewrites each dtype), and
    # a hit is checked against its key for edits made anyway.
    shares = is_stock(planner)
    known, made = (_LAST.items if shares else {}), {}
    items: list = []
    # DCP's plan shares each key's string between the item, the flattened dict and the
    # mappings (and, for a top-level key, with the path): a reused item brings its own
    # string, so the dicts take that one, or the item is renamed, to pickle alike.
    keyed, paths = {}, {}
    for fqn, value in flat.items():
        path = mappings[fqn]
        kind = type(value)
        if kind in _PLAIN_TENSORS:
            key = (fqn, value.size(), value.dtype, value.layout, value.requires_grad,
                   value.is_pinned())
            entry = known.get(key)
            if entry is None or not _intact(entry):
                entry = _as_made(_tensor_item(fqn, value))
            item = entry[0]
            if item.index.fqn is not fqn:
                if len(path) == 1:  # DCP's key is the path's own string here
                    item = _renamed(item, fqn)
                    entry = (item,) + entry[1:]  # the same description
                else:
                    fqn = item.index.fqn
            made[key] = entry
            items.append(item)
        elif isinstance(value, ShardedTensor):
            return None  # DCP rewrites nested sharded tensors before planning
        else:  # DTensor, subclasses, objects: DCP's own code for this one entry
            items.extend(create_default_local_save_plan({fqn: value}, is_coordinator).items)
        keyed[fqn], paths[fqn] = value, path
    _LAST.items = made if shares else {}
    planner.mappings = paths
    planner.state_dict = keyed
    planner.is_coordinator = is_coordinator
    planner.plan = SavePlan(items, planner_data=paths)
    return planner.plan


# ------------------------------------------------------------------ the global plan

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
    finals = _LAST.finals
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
    kept = _dedup(all_plans, planner.dedup_save_to_lowest_rank)
    md: dict = {}
    plans = []
    made: dict = {}
    for plan, items in zip(all_plans, kept):
        new_items = []
        for item in items:
            fqn = item.index.fqn
            if fqn in md:
                return None  # DCP refuses a key planned twice
            if item.type is _BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                new_items.append(item)
                continue
            data = item.tensor_data
            md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size,
                                            chunks=[data.chunk])
            known = finals.get(id(item), _NOTHING)
            final = (known[1] if known[0] is item
                     else _with_index(item, MetadataIndex(fqn, item.index.offset, 0)))
            made[id(item)] = (item, final)
            new_items.append(final)
        plans.append(_with_items(plan, new_items))
    _LAST.finals = made
    metadata = Metadata(md)
    if planner.flatten_state_dict:  # a ChainMap of one map lists it as it is: 0.2 ms less
        maps = [p.planner_data for p in plans]
        merged = dict(maps[0]) if len(maps) == 1 else dict(ChainMap(*maps))
        metadata = dataclasses.replace(metadata, planner_data=merged)
    planner.global_plan = plans
    planner.metadata = metadata
    return plans, metadata


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
