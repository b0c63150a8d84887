"""Reusing a DCP save's local plan while the state dict keeps its structure.

With ``enable_cache`` a training loop saves the same structure again and again: the same
keys, the same tensor shapes and dtypes, only the values change. Planning that from
scratch (DCP's flatten, its local plan, resolving each item through the planner) costs a
few µs per leaf on every save, most of a zero-stall save's call. This module owns the
shortcut: one walk of the state dict yields a structural signature; while it equals the
previous save's, the cached local plan is reused and each item's value is fetched by the
path recorded when the plan was made. A changed structure, a planner that changes how
items are planned or resolved, or a tensor DCP would shard falls back to planning.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from ckptd import knobs
from ckpt_client.dcp.leaf_bytes import exact_key, save_settings, worth_keeping
from ckpt_client.dcp.planner_methods import keeps_default_methods
from ckpt_client.transport.flatten import describe

#: DefaultSavePlanner methods whose behaviour the shortcut reproduces; a planner that
#: overrides any of them plans the long way.
_REPRODUCED = ("set_up_planner", "create_local_plan", "resolve_data", "lookup_object",
               "transform_object")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Exact types of the usual non-tensor leaves (their signature entry is their type).
_LEAF_TYPES = frozenset({int, float, str, bytes, bool, type(None)})


class _Unsupported(Exception):
    """A value the shortcut does not handle (DTensor, ShardedTensor, tensor subclasses)."""


def structure_of(state_dict: Any) -> tuple | None:
    """The structural signature of ``state_dict``, or ``None`` if it holds a value only
    DCP's own planning handles.

    Two state dicts with equal signatures produce equal local plans under
    ``DefaultSavePlanner``: the signature has every container's type and keys (or
    length), every tensor's dtype, shape, layout, ``requires_grad`` and pinning, and
    every other leaf's type.
    """
    signature: list = []

    # Exact types first: an abstract-class check (Mapping) on every leaf of every save
    # costs more than the rest of the walk.
    def walk(value: Any) -> None:
        kind = type(value)
        if kind in _LEAF_TYPES:
            signature.append(kind)
        elif kind in _PLAIN_TENSORS or isinstance(value, torch.Tensor):
            if kind not in _PLAIN_TENSORS:
                raise _Unsupported
            signature.append((value.dtype, value.shape, value.layout, value.requires_grad,
                              value.is_pinned()))
        elif kind is dict or isinstance(value, Mapping):
            signature.append((type(value), tuple(value)))
            for entry in value.values():
                walk(entry)
        elif isinstance(value, (list, tuple)):
            signature.append((type(value), len(value)))
            for entry in value:
                walk(entry)
        else:
            signature.append(type(value))

    try:
        walk(state_dict)
    except _Unsupported:
        return None
    finally:
        walk = None  # it calls itself through its cell: a garbage cycle every save otherwise
    return tuple(signature)


def planner_allows_reuse(planner: SavePlanner) -> bool:
    """Whether ``planner`` plans and resolves items exactly as ``DefaultSavePlanner``."""
    return (keeps_default_methods(planner, _REPRODUCED) and planner.flatten_state_dict
            and planner.flatten_sharded_tensors
            and not getattr(planner, "_enable_plan_caching", False))


def _real_paths(state_dict: Any, mappings: dict) -> dict[str, tuple]:
    """Each flattened key's path of real keys (DCP's mappings hold ``str(key)``)."""
    by_text: dict[int, dict] = {}  # id(mapping) -> {str(key): key}, built on first need
    paths = {}
    for fqn, dcp_path in mappings.items():
        value, path = state_dict, []
        for element in dcp_path:
            if isinstance(value, Mapping) and element not in value:
                keys = by_text.get(id(value))
                if keys is None:
                    keys = by_text[id(value)] = {str(k): k for k in value}
                element = keys[element]
            path.append(element)
            value = value[element]
        paths[fqn] = tuple(path)
    return paths


class ReusablePlan:
    """The local plan of one save and how to find each item's value again.

    Parameters
    ----------
    signature : tuple
        :func:`structure_of` the state dict the plan was made for.
    local_plan : SavePlan
        The plan ``DefaultSavePlanner`` made for it.
    state_dict : Any
        That state dict (only read here, to record paths; not kept).
    mappings : dict
        The planner's flatten mappings for it.
    """

    def __init__(self, signature: tuple, local_plan: SavePlan, state_dict: Any,
                 mappings: dict) -> None:
        self.signature = signature
        self.local_plan = local_plan
        self.paths = _real_paths(state_dict, mappings)
        self._pickled: dict[str, tuple[tuple, bytes]] = {}  # fqn -> (exact key, bytes)
        self._described: dict[str, list] = {}  # fqn -> a tensor item's description
        self._routed: tuple | None = None  # (plan, its items' routes): see _routes
        #: (plan, the descriptions :meth:`buffers` made for it, its byte items' indices)
        self._buffers: tuple | None = None

    def sources(self, plan: SavePlan, state_dict: Any, planner: SavePlanner) -> list:
        """The data of each of ``plan``'s items in ``state_dict`` (which has this plan's
        structure): its tensors (not detached: the copy into the pool runs without
        autograd) and ``io.BytesIO``, as the planner would resolve."""
        sources, settings = [], None
        for item, path, is_bytes in self._routes(plan):
            value = state_dict
            for key in path:
                value = value[key]
            if not is_bytes:
                sources.append(value)
                continue
            fqn = item.index.fqn
            # By the exact value (0.0 == -0.0, but they pickle apart) and torch.save's
            # settings, not by equality.
            key = exact_key(value)
            if key is not None:  # the settings read once a save: a config lookup each
                settings = settings or save_settings()
                key = (settings, key)
            kept = self._pickled.get(fqn)
            if key is not None and kept is not None and kept[0] == key:
                sources.append(io.BytesIO(kept[1]))
                continue
            data = planner.transform_object(item, value)
            if key is not None and worth_keeping(data.getbuffer().nbytes):
                self._pickled[fqn] = (key, data.getvalue())
            else:
                self._pickled.pop(fqn, None)
            sources.append(data)
        return sources

    def _routes(self, plan: SavePlan) -> list:
        """Per item of ``plan``: the item, its path, whether it is a byte item (made once
        per plan: a save resolves a thousand-odd items with it)."""
        if self._routed is None or self._routed[0] is not plan:
            byte_io, paths = WriteItemType.BYTE_IO, self.paths
            self._routed = (plan, [(item, paths[item.index.fqn], item.type == byte_io)
                                   for item in plan.items])
        return self._routed[1]

    def buffers(self, plan: SavePlan, sources: list) -> list:
        """The ``[dtype, shape, nbytes]`` descriptions of :meth:`sources`' result: a
        tensor item's as first described (its dtype and shape are part of the signature
        this plan is reused under, so they cannot have changed), a byte item's made now.

        While ``plan`` is the same plan and every byte item keeps its size, this is the
        very list of the save before (checked over the byte items only): the staging
        after it then finds its file grouping, extent layout and pool views by identity,
        without a pass over a thousand-odd descriptions.
        """
        last = self._buffers
        if last is not None and last[0] is plan and knobs.DCP_KEEP_DESCRIPTIONS.get() \
                and all(sources[i].getbuffer().nbytes == last[1][i][2] for i in last[2]):
            return last[1]
        described, buffers, byte_items = self._described, [], []
        for index, (item, source) in enumerate(zip(plan.items, sources)):
            if isinstance(source, io.BytesIO):
                buffers.append(describe(source))
                byte_items.append(index)
                continue
            kept = described.get(item.index.fqn)
            if kept is None:
                kept = described[item.index.fqn] = describe(source)
            buffers.append(kept)
        self._buffers = (plan, buffers, byte_items)
        return buffers
