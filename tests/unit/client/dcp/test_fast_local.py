"""The short route's local walk hands out the previous save's objects only where DCP
would make equal ones.

:mod:`ckpt_client.dcp.fast_local` keeps what each position of the state dict planned
and reuses it on the next save; each case here plans a sequence of state dicts that
change between saves (a tensor's dtype, shape, ``requires_grad`` or pinning, a leaf
turned container, a key of another type with an equal value) and compares every save
with stock ``DefaultSavePlanner``: the local plan, the global plan and metadata, as
objects and as pickled bytes, and the flattened dict and mappings.
"""

from __future__ import annotations

import enum
import pickle
import random

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckpt_client.dcp import fast_local, fast_plan


def _same(a, b) -> None:
    assert a == b
    assert pickle.dumps(a) == pickle.dumps(b)


def _fresh(text: str) -> str:
    return "".join(list(text))  # an equal string, a new object


def _planned_as_stock(state: dict) -> None:
    stock = DefaultSavePlanner()
    fast = DefaultSavePlanner()
    plan = fast_plan.local_plan(fast, state, True)
    try:
        stock.set_up_planner(state, None, True)
    except ValueError as exc:  # a key DCP flattens twice: DCP's own walk raises it
        assert "duplicated flatten key" in str(exc) and plan is None
        return
    stock_plan = stock.create_local_plan()
    assert plan is not None
    _same(plan, stock_plan)
    assert fast.mappings == stock.mappings and list(fast.state_dict) == list(stock.state_dict)
    assert all(fast.state_dict[k] is v for k, v in stock.state_dict.items())
    # DCP's key strings are one object in the item, the flattened dict and the mappings
    assert [i.index.fqn for i in plan.items] == list(fast.state_dict)
    for item, key, path_key in zip(plan.items, fast.state_dict, fast.mappings):
        assert item.index.fqn is key is path_key
    stock_global, stock_md = stock.create_global_plan([stock_plan])
    made = fast_plan.global_plan(fast, [plan])
    assert made is not None
    _same(made[0], stock_global)
    _same(made[1], stock_md)


def _saved_in_turn(*states: dict) -> None:
    for state in states:
        _planned_as_stock(state)
    for state in states:  # and each again after the others
        _planned_as_stock(state)


@pytest.mark.parametrize("change", [
    lambda t: t.to(torch.bfloat16),
    lambda t: t.reshape(-1),
    lambda t: t[:1].clone(),
    lambda t: torch.nn.Parameter(t.clone()),
    lambda t: t.clone().requires_grad_(True),
    lambda t: t.to_sparse(),
    lambda t: torch.tensor(1.5),
], ids=["dtype", "shape", "size", "parameter", "requires_grad", "layout", "scalar"])
@pytest.mark.parametrize("where", ["top", "nested", "listed"])
def test_a_tensor_changed_between_saves_is_planned_afresh(change, where):
    base = torch.randn(2, 3)

    def state(t):
        if where == "top":
            return {"t": t, "other": torch.ones(2)}
        if where == "nested":
            return {"model": {"block": {"t": t}}, "other": torch.ones(2)}
        return {"model": [torch.ones(1), t], "other": torch.ones(2)}

    _saved_in_turn(state(base), state(change(base)), state(base.clone()))


def test_a_tensor_pinned_between_saves_is_planned_afresh(monkeypatch):
    pinned: set = set()
    unpinned = torch.Tensor.is_pinned
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: id(self) in pinned or unpinned(self, *a))
    plain, held = torch.randn(3), torch.randn(3)
    pinned.add(id(held))
    _saved_in_turn({"w": {"x": plain}}, {"w": {"x": held}}, {"w": {"x": plain.clone()}})


def test_a_planned_item_described_anew_after_its_save_is_not_handed_out_again():
    state = {"m": {"w": torch.randn(4)}}
    fast = DefaultSavePlanner()
    item = fast_plan.local_plan(fast, state, True).items[0]
    item.tensor_data.properties.pin_memory = True  # another attribute than the shape's
    _planned_as_stock(state)
    item = fast_plan.local_plan(DefaultSavePlanner(), state, True).items[0]
    item.tensor_data.chunk.extra = 1  # a new attribute pickles too
    _planned_as_stock(state)


@pytest.mark.parametrize("leaf", [
    torch.ones(2), 3, 2.5, "text", b"bytes", None, (1, torch.ones(1)), [1, 2], [],
    [torch.ones(1), 2], {"inner": torch.ones(1)}, {}, [{"x": 1}], [[torch.zeros(1)]],
], ids=lambda leaf: type(leaf).__name__ + str(len(leaf)) if hasattr(leaf, "__len__")
    and not isinstance(leaf, torch.Tensor) else type(leaf).__name__)
def test_a_position_whose_kind_of_leaf_or_container_changes_is_planned_as_dcp(leaf):
    before = {"model": {"a": torch.ones(3), "b": torch.ones(3)}, "x": torch.ones(3),
              "steps": [torch.ones(1), torch.ones(2)]}
    after = {"model": {"a": leaf, "b": leaf}, "x": leaf, "steps": [leaf, leaf]}
    _saved_in_turn(before, after, before)


class Key(str, enum.Enum):
    """A key equal to its value whose ``str()`` is another string."""

    A = "a"


class Text(str):
    def __str__(self) -> str:
        return "other"


@pytest.mark.parametrize("key", [1, "1", True, 1.0, Key.A, "a", Text("a")],
                         ids=["int", "str", "bool", "float", "str_enum", "str_a", "str_subclass"])
def test_a_key_of_another_type_with_an_equal_value_gets_its_own_key_string(key):
    one = {"m": {1: torch.ones(2), "a": {"x": torch.ones(1)}, 0: [torch.ones(1)]}}
    other = {"m": {key: torch.ones(2), "y": {key: torch.ones(1)}}}
    _saved_in_turn(one, other, one)


def test_a_list_and_a_mapping_with_the_same_keys_plan_apart():
    # an int key's string is its digits, as a list index's: but the paths hold "0" and 0
    _saved_in_turn({"s": [torch.ones(1), torch.ones(2)]}, {"s": {0: torch.ones(1), 1: torch.ones(2)}},
                   {"s": {"0": torch.ones(1), "1": torch.ones(2)}})


def test_new_key_strings_each_save_share_as_dcps_do():
    def state(fresh):
        k = _fresh if fresh else (lambda text: text)
        step = {k("step"): torch.tensor(1.0), k("exp_avg"): torch.ones(2)}
        return {k("model"): {k(f"layers.{i}.w"): torch.ones(2) for i in range(3)},
                k("optim"): {k("state"): {i: dict(step) for i in range(12)}},
                k("top"): torch.ones(1), k("n"): 5}
    _saved_in_turn(state(False), state(True), state(True), state(False))


def test_a_refused_walk_keeps_the_previous_saves_positions():
    good = {"a": {"b": torch.ones(1)}, "c": 1}
    _planned_as_stock(good)
    kept = fast_local._last
    assert fast_plan.local_plan(DefaultSavePlanner(), {"a": {"b": torch.ones(1)}, "a.b": 1},
                                True) is None
    assert fast_local._last is kept
    _planned_as_stock(good)


def test_a_key_flattened_twice_is_left_to_dcp_where_the_rest_is_as_before():
    for state in ({"a": {"b": torch.ones(1)}, "c": {"d": 1}},
                  {"a.b": 1, "a": {"b": torch.ones(1)}, "c": {"d": 1}},
                  {"c.d": 1, "a": {"b": torch.ones(1)}, "c": {"d": 1}}):
        _planned_as_stock(state)  # stock raises for the last two; the short route refuses


def test_only_the_stock_planner_keeps_and_gets_the_previous_items():
    class Sub(DefaultSavePlanner):
        pass

    state = {"m": {"w": torch.ones(2)}, "n": 1}
    first = fast_plan.local_plan(DefaultSavePlanner(), state, True)
    sub = fast_plan.local_plan(Sub(), state, True)
    assert not any(a is b for a, b in zip(first.items, sub.items))
    assert fast_local._last == {}, "a subclass's items are not kept"
    again = fast_plan.local_plan(DefaultSavePlanner(), state, True)
    assert not any(a is b for a, b in zip(sub.items, again.items))


def test_an_unchanged_save_hands_out_the_previous_items():
    state = {"m": {"w": torch.ones(2), "b": 1}, "top": torch.ones(1), "list": [torch.ones(1)]}
    first = fast_plan.local_plan(DefaultSavePlanner(), state, True)
    again = fast_plan.local_plan(DefaultSavePlanner(), dict(state), True)
    assert all(a is b for a, b in zip(first.items, again.items))


def _random_state(rng: random.Random, step: int) -> dict:
    """A training-like state dict whose parts change at random from save to save."""
    def tensor():
        shape = rng.choice([(2,), (2, 3), (3,), ()])
        t = torch.zeros(shape, dtype=rng.choice([torch.float32, torch.bfloat16]))
        return t.requires_grad_(rng.random() < 0.2) if t.is_floating_point() else t

    def leaf(depth):
        roll = rng.random()
        if roll < 0.5:
            return tensor()
        if roll < 0.65:
            return rng.choice([1, 1.0, True, "s", None, (1, 2), [1, 2], b"b"])
        if roll < 0.8 and depth < 3:
            return {rng.choice(["a", "b", 0, 1, "0"]): leaf(depth + 1) for _ in range(3)}
        if depth < 3:
            return [leaf(depth + 1) for _ in range(rng.randint(0, 3))]
        return tensor()

    k = _fresh if rng.random() < 0.5 else (lambda text: text)
    return {k("model"): {k(f"w{i}"): tensor() for i in range(rng.randint(2, 5))},
            k("optim"): {k("state"): {i: {k("step"): torch.tensor(float(step)),
                                          k("exp_avg"): tensor()}
                                      for i in range(rng.randint(1, 4))}},
            k("extra"): leaf(0), rng.choice(["n", 7]): leaf(1)}


def test_random_changes_over_many_saves_plan_as_dcp():
    rng = random.Random(1234)
    for step in range(80):
        _planned_as_stock(_random_state(rng, step))
