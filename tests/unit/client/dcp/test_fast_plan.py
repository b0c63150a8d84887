"""The default planner's short route makes exactly DCP's plans, metadata and item data.

Every case plans the same state dict twice, once with stock ``DefaultSavePlanner`` and
once through :mod:`ckpt_client.dcp.fast_plan`, and compares the results as objects and
as pickled bytes (what ``.metadata`` and the plan collectives carry). Each case runs
three times in a row, the later ones with what the previous save left to reuse, the last
on a rebuilt state dict whose key strings are new objects.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from ckpt_client.dcp import fast_plan


class Opaque:
    """A leaf DCP pickles as a whole."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.value == self.value


def _fresh(text: str) -> str:
    return "".join(list(text))  # an equal string, a new object


def training(step: int, fresh: bool = False) -> dict:
    k = _fresh if fresh else (lambda text: text)
    g = torch.Generator().manual_seed(step)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=g))
    return {
        k("model"): {k("layers"): [{k("w"): torch.randn(4, 4, generator=g),
                                    k("b"): torch.randn(4, generator=g).to(torch.bfloat16)}
                                   for _ in range(3)],
                     k("weight"): weight, k("scalar"): torch.tensor(float(step)),
                     k("empty"): torch.empty(0, 3), k("long"): torch.arange(5)},
        k("optim"): {k("state"): {0: {k("exp_avg"): torch.randn(6, 4, generator=g),
                                      k("step"): torch.tensor(step)}},
                     k("param_groups"): [{k("lr"): 0.1 * step, k("betas"): (0.9, 0.999),
                                          k("params"): [0, 1, 2], k("name"): f"g{step}",
                                          k("zero"): -0.0 if step % 2 else 0.0,
                                          k("nan"): float("nan"), k("flag"): step % 2 == 0}]},
        k("step"): step, k("blob"): b"\x00\x01" * step, k("none"): None, k("z"): 1 + 2j,
        k("tuple_of_tensors"): (torch.ones(2), 3), k("strs"): ["a", "a", "b"],
        k("nested_lists"): [[torch.zeros(2)], [1, 2], []], k("empty_dict"): {},
        k("list_of_empty"): [{}], k("ordered"): OrderedDict([(k("x"), torch.ones(1))]),
        k("opaque"): Opaque(step), 7: torch.full((2,), 7.0),
    }


def flat_model(step: int, fresh: bool = False) -> dict:
    k = _fresh if fresh else (lambda text: text)
    g = torch.Generator().manual_seed(step)
    return {k(f"layer.{i}.weight"): torch.randn(3, 3, generator=g) for i in range(4)}


def _stock_local(state: dict) -> tuple[DefaultSavePlanner, SavePlan]:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    return planner, planner.create_local_plan()


def _fast_local(state: dict) -> tuple[DefaultSavePlanner, SavePlan]:
    planner = DefaultSavePlanner()
    assert fast_plan.plans_locally(planner)
    plan = fast_plan.local_plan(planner, state, True)
    assert plan is not None
    return planner, plan


def _same(a, b) -> None:
    assert a == b
    assert pickle.dumps(a) == pickle.dumps(b)


def _same_data(stock: list, fast: list) -> None:
    assert len(stock) == len(fast)
    for s, f in zip(stock, fast):
        if isinstance(s, torch.Tensor):
            assert f is s or (torch.equal(f, s) and f.data_ptr() == s.data_ptr())
        else:
            assert isinstance(f, io.BytesIO) and f.getvalue() == s.getvalue()


@pytest.mark.parametrize("build", [training, flat_model])
def test_one_rank_plans_metadata_and_data_equal_stock_dcp_save_after_save(build):
    for step, fresh in ((1, False), (2, False), (3, True)):
        state = build(step, fresh)
        stock, stock_plan = _stock_local(state)
        fast, fast_plan_ = _fast_local(state)
        _same(fast_plan_, stock_plan)
        assert fast.mappings == stock.mappings
        assert list(fast.state_dict) == list(stock.state_dict)
        assert all(fast.state_dict[k] is v for k, v in stock.state_dict.items())

        stock_global, stock_md = stock.create_global_plan([stock_plan])
        made = fast_plan.global_plan(fast, [fast_plan_])
        assert made is not None
        _same(made[0], stock_global)
        _same(made[1], stock_md)
        assert fast.metadata is made[1] and fast.global_plan is made[0]

        final = stock.finish_plan(stock_global[0])
        _same_data([stock.resolve_data(i) for i in final.items],
                   fast_plan.sources(fast.finish_plan(made[0][0]), fast))


def _rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    shared = {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g),
              "scale": torch.ones(3, dtype=torch.bfloat16)}
    own = {f"r{rank}": torch.full((rank + 1, 2), float(rank))}
    if rank % 2:  # a bigger replicated tensor on odd ranks only: moves dedup's balance
        own["odd"] = torch.zeros(64)
    return {"model": {**shared, **own}, "step": step, "note": f"rank{rank}", "lr": 0.5}


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("to_lowest", [False, True])
def test_many_ranks_global_plan_and_deduplication_equal_stock(world_size, to_lowest):
    for step in (1, 2):
        local = []
        for rank in range(world_size):
            planner = DefaultSavePlanner()
            planner.set_up_planner(_rank_state(rank, step), None, rank == 0)
            plan = planner.create_local_plan()
            # the coordinator's own plan as made here; the others' as a gather delivers them
            local.append(plan if rank == 0 else pickle.loads(pickle.dumps(plan)))
        coordinator = DefaultSavePlanner(dedup_save_to_lowest_rank=to_lowest)
        coordinator_fast = DefaultSavePlanner(dedup_save_to_lowest_rank=to_lowest)
        stock_plans, stock_md = coordinator.create_global_plan(local)
        fast = fast_plan.global_plan(coordinator_fast, local)
        assert fast is not None
        _same(fast[0], stock_plans)
        _same(fast[1], stock_md)
        moved = sum(len(p.items) for p in local) - sum(len(p.items) for p in stock_plans)
        assert moved > 0, "the case must exercise deduplication"


def test_a_global_plan_dcp_would_refuse_or_validate_goes_dcps_way():
    a = _stock_local({"x": torch.ones(2, 2)})[1]
    b = _stock_local({"x": torch.ones(4)})[1]  # same key, other rank, other dimensions
    assert fast_plan.global_plan(DefaultSavePlanner(), [a, b]) is None
    with pytest.raises(AssertionError):
        DefaultSavePlanner().create_global_plan([a, b])
    with pytest.raises(AssertionError):
        fast_plan.create_global_plan(DefaultSavePlanner(), [a, b])

    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    item = a.items[0]
    shard = dataclasses.replace(item, tensor_data=dataclasses.replace(
        item.tensor_data, chunk=ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 2]))))
    assert fast_plan.global_plan(DefaultSavePlanner(), [SavePlan([shard])]) is None


def test_state_dicts_dcp_itself_must_walk_are_left_to_it():
    planner = DefaultSavePlanner()
    assert fast_plan.local_plan(planner, OrderedDict(x=torch.ones(1)), True) is None
    assert fast_plan.local_plan(planner, {"a": {"b": torch.ones(1)}, "a.b": 1}, True) is None
    assert not hasattr(planner, "state_dict"), "a refused state dict leaves the planner untouched"
    with pytest.raises(ValueError, match="duplicated flatten key"):
        planner.set_up_planner({"a": {"b": torch.ones(1)}, "a.b": 1})


class Subclass(torch.Tensor):
    pass


def test_tensor_subclasses_are_planned_and_resolved_by_dcp_itself():
    state = {"plain": torch.ones(2), "sub": torch.ones(3).as_subclass(Subclass)}
    stock, stock_plan = _stock_local(state)
    fast, fast_plan_ = _fast_local(state)
    _same(fast_plan_, stock_plan)
    _same_data([stock.resolve_data(i) for i in stock_plan.items],
               fast_plan.sources(fast_plan_, fast))


class CustomLocal(DefaultSavePlanner):
    def create_local_plan(self):
        return super().create_local_plan()


class CustomGlobal(DefaultSavePlanner):
    def _dedup_save_plans(self, all_plans):
        return super()._dedup_save_plans(all_plans)


class CustomResolve(DefaultSavePlanner):
    def transform_object(self, write_item, object):
        return object * 2 if isinstance(object, torch.Tensor) else super().transform_object(
            write_item, object)


def test_a_planner_that_overrides_a_planning_method_plans_its_own_way():
    local = CustomLocal()
    local.set_up_planner({"x": torch.ones(1)})
    assert not fast_plan.plans_locally(local)
    assert fast_plan.plans_globally(local) and fast_plan.resolves(local)
    assert not fast_plan.plans_globally(CustomGlobal())
    assert fast_plan.plans_locally(CustomGlobal())
    assert not fast_plan.plans_locally(DefaultSavePlanner(flatten_state_dict=False))
    assert not fast_plan.plans_locally(DefaultSavePlanner(enable_plan_caching=True))
    assert not fast_plan.plans_globally(DefaultSavePlanner(enable_plan_caching=True))

    planner = CustomResolve()
    assert not fast_plan.resolves(planner)
    from ckpt_client.dcp.files import resolve_items
    planner.set_up_planner({"x": torch.ones(2)}, None, True)
    plan = planner.create_local_plan()
    assert torch.equal(resolve_items(plan, planner)[0], torch.full((2,), 2.0))


def test_the_save_path_takes_the_custom_planners_methods(monkeypatch):
    from ckpt_client.collectives import Group
    from ckpt_client.dcp import planning
    from ckpt_client.dcp.writer import DaemonStorageWriter

    calls = []

    class Counting(DefaultSavePlanner):
        def create_local_plan(self):
            calls.append("local")
            return super().create_local_plan()

        def create_global_plan(self, all_plans):
            calls.append("global")
            return super().create_global_plan(all_plans)

    planner, writer = Counting(), DaemonStorageWriter("/tmp/never-written")
    plan = planning.local_plan_of({"x": torch.ones(2)}, writer, planner, Group(None))
    planning.global_plan(plan, writer, planner, Group(None), enable_cache=False)
    assert calls == ["local", "global"]


def test_the_bytes_of_a_leaf_follow_torch_saves_settings():
    from torch.serialization import get_crc32_options, set_crc32_options

    state = {"step": 5, "x": torch.ones(1)}
    was = get_crc32_options()
    try:
        for crc in (True, False, True):
            set_crc32_options(crc)
            stock, stock_plan = _stock_local(state)
            fast, fast_plan_ = _fast_local(state)
            _same_data([stock.resolve_data(i) for i in stock_plan.items],
                       fast_plan.sources(fast_plan_, fast))
    finally:
        set_crc32_options(was)


def test_the_knob_turns_the_short_route_off():
    from ckptd import knobs

    with knobs.override(DCP_FAST_PLAN=False):
        assert not fast_plan.plans_locally(DefaultSavePlanner())
        assert not fast_plan.plans_globally(DefaultSavePlanner())
    assert fast_plan.plans_locally(DefaultSavePlanner())


def test_a_reused_plan_pickles_each_leaf_as_it_is_now_not_as_an_equal_one_was():
    # enable_cache's plan reuse keeps a leaf's bytes while the value stays the same:
    # 0.0 and -0.0 are equal but pickle apart, and so do 1 and True.
    from ckpt_client.dcp.plan_reuse import ReusablePlan, structure_of

    first = {"x": torch.ones(1), "zero": 0.0, "one": 1, "many": [0.0, 1]}
    planner, plan = _stock_local(first)
    reuse = ReusablePlan(structure_of(first), plan, first, planner.mappings)
    for zero, many in ((0.0, [0.0, 1]), (-0.0, [-0.0, 1]), (0.0, [0.0, True])):
        state = {"x": torch.ones(1), "zero": zero, "one": 1, "many": many}
        stock, stock_plan = _stock_local(state)
        _same_data([stock.resolve_data(i) for i in stock_plan.items],
                   reuse.sources(plan, state, planner))


class HalfOnDisk(DefaultSavePlanner):
    """torch's FP16 planner pattern, its dtype rewrite made in place in ``finish_plan``."""

    def finish_plan(self, new_plan):
        for item in new_plan.items:
            if item.tensor_data is not None:
                item.tensor_data.properties.dtype = torch.float16
        return new_plan


def _plain_save_equals_stock(state: dict) -> None:
    stock, stock_plan = _stock_local(state)
    fast, fast_plan_ = _fast_local(state)
    _same(fast_plan_, stock_plan)
    stock_global, stock_md = stock.create_global_plan([stock_plan])
    made = fast_plan.global_plan(fast, [fast_plan_])
    _same(made[0], stock_global)
    _same(made[1], stock_md)


def test_a_subclass_editing_its_items_in_place_leaves_the_next_plain_save_as_stock():
    half = HalfOnDisk()
    plan = fast_plan.local_plan(half, {"w": torch.randn(4)}, True)
    plans, _ = fast_plan.create_global_plan(half, [plan])
    half.finish_plan(plans[0])
    _plain_save_equals_stock({"w": torch.randn(4)})
    assert _fast_local({"w": torch.randn(4)})[1].items[0].tensor_data.properties.dtype \
        == torch.float32


@pytest.mark.parametrize("edit", [
    lambda d: setattr(d.properties, "dtype", torch.float16),
    lambda d: setattr(d.properties, "requires_grad", True),
    lambda d: setattr(d.properties, "memory_format", torch.channels_last),
    lambda d: setattr(d.chunk, "sizes", torch.Size([2])),
    lambda d: setattr(d.chunk, "offsets", torch.Size([1])),
], ids=["dtype", "requires_grad", "memory_format", "chunk_sizes", "chunk_offsets"])
def test_a_stock_planners_item_edited_after_its_save_is_not_handed_out_again(edit):
    _, plan = _fast_local({"w": torch.randn(4)})
    edit(plan.items[0].tensor_data)
    _plain_save_equals_stock({"w": torch.randn(4)})


@pytest.mark.parametrize("name", ["set_up_planner", "create_local_plan", "create_global_plan",
                                  "_dedup_save_plans", "resolve_data", "lookup_object",
                                  "transform_object"])
def test_a_method_set_on_the_instance_counts_as_an_override(name):
    from ckpt_client.dcp.plan_reuse import planner_allows_reuse

    planner = DefaultSavePlanner()
    planner.set_up_planner({"x": torch.ones(1)}, None, True)
    assert fast_plan.plans_locally(planner) and fast_plan.plans_globally(planner)
    assert fast_plan.resolves(planner) and planner_allows_reuse(planner)
    setattr(planner, name, getattr(planner, name))  # the same method, as an instance's own
    assert fast_plan.plans_locally(planner) is (name not in fast_plan._LOCAL)
    assert fast_plan.plans_globally(planner) is (name not in fast_plan._GLOBAL)
    assert fast_plan.resolves(planner) is (name not in fast_plan._RESOLVE)
    assert planner_allows_reuse(planner) is (name in fast_plan._GLOBAL)


def test_an_instances_transform_object_is_called_on_the_save_path():
    from ckpt_client.dcp.files import resolve_items

    planner = DefaultSavePlanner()
    planner.transform_object = lambda item, obj: obj * 2
    planner.set_up_planner({"x": torch.ones(2)}, None, True)
    plan = planner.create_local_plan()
    assert torch.equal(resolve_items(plan, planner)[0], torch.full((2,), 2.0))


def test_an_instances_finish_plan_editing_items_leaves_the_next_plain_save_as_stock():
    planner = DefaultSavePlanner()
    planner.finish_plan = HalfOnDisk.finish_plan.__get__(planner)
    plan = fast_plan.local_plan(planner, {"w": torch.randn(4)}, True)
    plans, _ = fast_plan.create_global_plan(planner, [plan])
    planner.finish_plan(plans[0])
    _plain_save_equals_stock({"w": torch.randn(4)})


def test_only_small_leaves_and_their_bytes_are_kept_for_the_next_save():
    import sys

    from ckpt_client.dcp.leaf_bytes import MAX_KEPT_BYTES
    from ckpt_client.dcp.plan_reuse import ReusablePlan, structure_of

    big, big_text = b"\x01" * (1 << 20), "t" * (1 << 20)
    before = sys.getrefcount(big), sys.getrefcount(big_text)
    state = {"x": torch.ones(1), "big": big, "text": big_text, "small": b"\x02" * 100}
    planner, plan = _fast_local(state)
    fast_plan.sources(plan, planner)
    stock, stock_plan = _stock_local(state)
    reuse = ReusablePlan(structure_of(state), stock_plan, state, stock.mappings)
    for _ in range(2):
        reuse.sources(stock_plan, state, stock)
    del planner, plan, stock, stock_plan, state
    assert (sys.getrefcount(big), sys.getrefcount(big_text)) == before
    kept = list(fast_plan._LAST.pickled.values()) + [b for _, b in reuse._pickled.values()]
    assert len(kept) == 2 and all(len(data) <= MAX_KEPT_BYTES for data in kept)


def test_only_short_lists_of_numbers_get_a_key():
    """A key is built on every save, hit or miss: a long list's costs more than the pickle
    it would spare, so only short ones (betas, counters) are keyed, by exact bits."""
    from ckpt_client.dcp.leaf_bytes import MAX_KEYED_ENTRIES, exact_key

    short = [0.9, 0.999, 1, True, None]
    assert exact_key(short) == exact_key(list(short))
    assert exact_key([0.0]) != exact_key([-0.0]) and exact_key([1]) != exact_key([True])
    assert exact_key([1.5] * MAX_KEYED_ENTRIES) is not None
    assert exact_key([1.5] * (MAX_KEYED_ENTRIES + 1)) is None
    assert exact_key([1.5] + list(range(MAX_KEYED_ENTRIES))) is None
    assert exact_key([0.5] * 4096) is None  # 3.4 ms to key against 2.3 ms to pickle, here


def test_with_the_short_route_off_a_single_process_stages_while_it_plans_as_before():
    from ckptd import knobs
    from ckpt_client.collectives import Group
    from ckpt_client.dcp.planning import EarlyStaging

    assert not EarlyStaging.worthwhile(DefaultSavePlanner(), Group(None))
    with knobs.override(DCP_FAST_PLAN=False):
        assert EarlyStaging.worthwhile(DefaultSavePlanner(), Group(None))
