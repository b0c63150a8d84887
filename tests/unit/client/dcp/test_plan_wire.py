"""The plan collectives' packed payloads deliver exactly what pickled plans deliver.

Several ranks' plans go through the two routes a gather and a scatter can take: stock
(each ``SavePlan`` pickled and unpickled, as ``gather_object``/``scatter_object_list``
do) and packed (:mod:`ckpt_client.dcp.plan_wire`, pickled the same way). The global
metadata and every rank's final plan must be equal and pickle byte for byte alike.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckpt_client.dcp import fast_plan, plan_wire
from ckpt_client.dcp.writer import DaemonStorageWriter


def _wire(value):
    return pickle.loads(pickle.dumps(value))


def rank_state(rank: int, step: int, odd: bool = False) -> dict:
    g = torch.Generator().manual_seed(step)
    state = {"model": {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g),
                       "scale": torch.ones(3, dtype=torch.bfloat16), "empty": torch.empty(0, 2),
                       "scalar": torch.tensor(1.5), f"r{rank}": torch.full((rank + 1,), 1.0)},
             "step": step, "note": f"rank{rank}", "lr": 0.5, "ids": [rank, 2]}
    if odd and rank % 2:
        state["model"]["odd"] = torch.zeros(64)
    return state


def _stock_round(states: list) -> tuple:
    locals_ = []
    for rank, state in enumerate(states):
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, None, rank == 0)
        locals_.append(planner.create_local_plan())
    coordinator = DefaultSavePlanner()
    plans, metadata = coordinator.create_global_plan([_wire(p) for p in locals_])
    plans = DaemonStorageWriter("/tmp/never").prepare_global_plan(plans)
    return metadata, [_wire(p) for p in plans]


def _packed_round(states: list) -> tuple:
    locals_, payloads = [], []
    for rank, state in enumerate(states):
        planner = DefaultSavePlanner()
        plan = fast_plan.local_plan(planner, state, rank == 0)
        locals_.append(plan)
        payloads.append(_wire(plan_wire.pack_local(plan)))
    received = [plan_wire.unpack_local(p) for p in payloads]
    received[0] = locals_[0]  # the coordinator plans with its own plan as it is
    coordinator = DefaultSavePlanner()
    plans, metadata = fast_plan.create_global_plan(coordinator, received)
    plans = DaemonStorageWriter("/tmp/never").prepare_global_plan(plans)
    finals = [_wire(plan_wire.pack_final(*each)) for each in zip(received, plans, payloads)]
    return metadata, [plan_wire.unpack_final(f, local) for f, local in zip(finals, locals_)], \
        payloads, finals


@pytest.mark.parametrize("world_size", [2, 3])
def test_packed_plans_give_the_coordinator_and_every_rank_what_pickled_plans_give(world_size):
    for step in (1, 2, 3):  # later rounds reuse what the previous one made
        states = [rank_state(r, step, odd=step == 3) for r in range(world_size)]
        stock_md, stock_plans = _stock_round(states)
        md, plans, payloads, finals = _packed_round(states)
        assert all(type(p) is plan_wire.PackedLocalPlan for p in payloads)
        assert all(type(f) is plan_wire.KeptItems for f in finals)
        assert md == stock_md and pickle.dumps(md) == pickle.dumps(stock_md)
        for mine, stock in zip(plans, stock_plans):
            assert mine == stock and pickle.dumps(mine) == pickle.dumps(stock)
        moved = sum(len(p.items) for p in plans)
        assert moved < sum(len(fast_plan.local_plan(DefaultSavePlanner(), s, False).items)
                           for s in states), "the case must exercise deduplication"


class Subclass(torch.Tensor):
    pass


def test_a_plan_that_is_not_the_plain_kind_travels_whole():
    state = {"x": torch.ones(2), "sub": torch.ones(2).as_subclass(Subclass)}
    plan = fast_plan.local_plan(DefaultSavePlanner(), state, True)
    assert plan_wire.pack_local(plan) is not plan  # a subclass still plans as a tensor item
    import dataclasses
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    item = plan.items[0]
    shard = dataclasses.replace(item, tensor_data=dataclasses.replace(
        item.tensor_data, chunk=ChunkStorageMetadata(torch.Size([1]), torch.Size([1]))))
    sharded = dataclasses.replace(plan, items=[shard])
    assert plan_wire.pack_local(sharded) is sharded
    assert plan_wire.unpack_local(sharded) is sharded
    assert plan_wire.unpack_final(sharded, plan) is sharded


def test_a_final_plan_the_coordinator_changed_otherwise_travels_whole():
    states = [rank_state(r, 1) for r in range(2)]
    locals_ = [fast_plan.local_plan(DefaultSavePlanner(), s, r == 0) for r, s in enumerate(states)]
    payloads = [_wire(plan_wire.pack_local(p)) for p in locals_]
    received = [plan_wire.unpack_local(p) for p in payloads]
    plans, _ = fast_plan.create_global_plan(DefaultSavePlanner(), received)
    import dataclasses
    changed = dataclasses.replace(plans[1], planner_data={"other": ("other",)})
    assert plan_wire.pack_final(received[1], changed, payloads[1]) is changed
    reordered = dataclasses.replace(plans[1], items=list(reversed(plans[1].items)))
    assert plan_wire.pack_final(received[1], reordered, payloads[1]) is reordered
