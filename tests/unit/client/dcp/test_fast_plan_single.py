"""A single rank's global plan is made of the previous one while its items are the same.

:func:`ckpt_client.dcp.fast_plan.global_plan` hands out the previous single-rank save's
final items and metadata entries when the local walk handed out the very same items;
these cases check that it does, and that whatever changed or was edited since is made
again, equal to stock ``DefaultSavePlanner``'s, as objects and as pickled bytes.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ckpt_client.dcp import fast_plan


def _same(a, b) -> None:
    assert a == b
    assert pickle.dumps(a) == pickle.dumps(b)


def _global_as_stock(state: dict):
    stock = DefaultSavePlanner()
    stock.set_up_planner(state, None, True)
    stock_plans, stock_md = stock.create_global_plan([stock.create_local_plan()])
    fast = DefaultSavePlanner()
    made = fast_plan.global_plan(fast, [fast_plan.local_plan(fast, state, True)])
    assert made is not None
    _same(made[0], stock_plans)
    _same(made[1], stock_md)
    return made


def _state() -> dict:
    return {"model": {"w": torch.ones(2, 2), "b": torch.zeros(2)}, "step": 3,
            "optim": {"state": {0: {"exp_avg": torch.ones(2, 2)}}}}


def test_an_unchanged_save_gets_the_previous_final_items_and_entries():
    first = _global_as_stock(_state())
    again = _global_as_stock(_state())
    assert all(a is b for a, b in zip(first[0][0].items, again[0][0].items))
    assert again[0][0].items is not first[0][0].items, "each plan's own list"
    entries, kept = first[1].state_dict_metadata, again[1].state_dict_metadata
    assert entries is not kept and all(entries[k] is kept[k] for k in entries)


@pytest.mark.parametrize("edit", [
    lambda entry: entry.chunks.append(ChunkStorageMetadata(torch.Size([1, 0]),
                                                           torch.Size([1, 2]))),
    lambda entry: setattr(entry, "chunks", []),
    lambda entry: setattr(entry, "size", torch.Size([4])),
    lambda entry: setattr(entry, "extra", 1),
], ids=["chunk_added", "chunks_replaced", "size", "new_attribute"])
def test_a_metadata_entry_edited_after_its_save_is_made_again(edit):
    _global_as_stock(_state())
    made = _global_as_stock(_state())
    edit(made[1].state_dict_metadata["model.w"])
    _global_as_stock(_state())


def test_a_byte_entry_edited_after_its_save_is_made_again():
    _global_as_stock(_state())
    made = _global_as_stock(_state())
    made[1].state_dict_metadata["step"].extra = 1
    _global_as_stock(_state())


def test_a_changed_item_or_structure_plans_item_by_item():
    _global_as_stock(_state())
    changed = _state()
    changed["model"]["b"] = torch.zeros(3)
    _global_as_stock(changed)
    grown = _state()
    grown["model"]["extra"] = torch.ones(1)
    _global_as_stock(grown)
    _global_as_stock(_state())


def test_several_ranks_in_between_plan_item_by_item():
    state = _state()
    first = DefaultSavePlanner()
    plan = fast_plan.local_plan(first, state, True)
    assert fast_plan.global_plan(first, [plan]) is not None
    other = DefaultSavePlanner()
    other.set_up_planner({"x": torch.ones(1)}, None, False)
    coordinator = DefaultSavePlanner()
    stock = DefaultSavePlanner().create_global_plan([plan, other.create_local_plan()])
    made = fast_plan.global_plan(coordinator, [plan, other.create_local_plan()])
    _same(made[0], stock[0])
    _same(made[1], stock[1])
    _global_as_stock(state)
