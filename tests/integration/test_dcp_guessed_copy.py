"""A blocking ``ckpt_client.dcp.async_save`` copies with the previous save's plan while it
plans, and keeps that copy only when the plan comes out the same.

Real daemon, one process. The planner is DCP's default one with a gate in
``create_global_plan`` (a real planner that waits or fails, not a mock): while the gate
holds the second save's planning, the daemon must already hold that save's request (the
copy began before planning ended). A save whose tensors changed dtype (a copy that
succeeds, into views of the old layout) or whose planning fails must drop the guessed
copy unwritten, and every checkpoint must load, through stock ``dcp.load``, with exactly
the values and dtypes of its own call.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from conftest import wait_for
from test_dcp_stage_ahead import GatedPlanner  # DCP's default planner, gated
from ckpt_client import AsyncCallsQueue, dcp
from ckptd.protocol import Phase


def training_state(step: int, dtype=torch.float32) -> dict:
    """Tensors and non-tensor leaves whose values (and pickled sizes) change each step."""
    gen = torch.Generator().manual_seed(step)
    return {"model": {f"layer{i}.weight": torch.randn(32, 16, generator=gen).to(dtype)
                      for i in range(6)},
            "optim": {"step": step * 1000, "lr": 0.1 / step, "note": "x" * step,
                      "moments": [torch.randn(16, generator=gen) for _ in range(3)]}}


def assert_loads(path: str, expected: dict) -> None:
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
              "optim": {"step": 0, "lr": 0.0, "note": "",
                        "moments": [torch.zeros_like(t) for t in expected["optim"]["moments"]]}}
    DCP.load(target, storage_reader=FileSystemReader(path))
    for key, value in expected["model"].items():
        assert target["model"][key].dtype == value.dtype and torch.equal(target["model"][key], value)
    assert all(torch.equal(a, b) for a, b in zip(target["optim"]["moments"],
                                                 expected["optim"]["moments"]))
    assert {k: target["optim"][k] for k in ("step", "lr", "note")} == \
        {k: expected["optim"][k] for k in ("step", "lr", "note")}
    # Every file written is one the metadata points to: a dropped copy wrote nothing.
    metadata = FileSystemReader(path).read_metadata()
    named = {info.relative_path for info in metadata.storage_data.values()}
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == sorted(named)


def requests_for(daemon, path: str) -> list:
    return [r for r in daemon.status()["requests"] if r["path"] == path]


def save(queue: AsyncCallsQueue, state: dict, path: str, **options) -> None:
    queue.schedule_async_request(dcp.async_save(state, path, **options))
    queue.maybe_finalize_async_calls(blocking=True)


def test_a_blocking_save_copies_with_the_previous_plan_while_it_plans(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    open_gate = threading.Event()
    open_gate.set()
    save(queue, training_state(1), os.path.join(root, "s1"), planner=GatedPlanner(open_gate))

    second, path = training_state(2), os.path.join(root, "s2")
    expected = {"model": {k: v.clone() for k, v in second["model"].items()},
                "optim": {**second["optim"], "moments": [t.clone() for t in second["optim"]["moments"]]}}
    shut = threading.Event()
    planner, made = GatedPlanner(shut), []
    call = threading.Thread(target=lambda: made.append(dcp.async_save(second, path,
                                                                      planner=planner)))
    call.start()
    try:
        assert planner.entered.wait(60), "the save never reached its global plan"
        # Planning is held: the copy with the first save's plan is already at the daemon.
        wait_for(lambda: requests_for(daemon, path), 30, "the guessed copy's request")
        assert not made, "the save returned before its planning ended"
    finally:
        shut.set()
        call.join(120)
    queue.schedule_async_request(made[0])
    queue.maybe_finalize_async_calls(blocking=True)
    assert_loads(path, expected)
    assert [r["phase"] for r in requests_for(daemon, path)] == [Phase.DONE]
    queue.close()


def test_a_changed_dtype_drops_the_guessed_copy_unwritten(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    dtypes = {1: torch.float32, 2: torch.float32, 3: torch.float64, 4: torch.float64,
              5: torch.float64, 6: torch.float32}
    for step, dtype in dtypes.items():
        state = training_state(step, dtype)
        save(queue, state, os.path.join(root, f"s{step}"))
        assert_loads(os.path.join(root, f"s{step}"), training_state(step, dtype))
    wait_for(lambda: all(r["phase"] in Phase.FINISHED for r in daemon.status()["requests"]),
             30, "every request to settle")
    phases = {step: sorted(r["phase"] for r in requests_for(daemon, os.path.join(root, f"s{step}")))
              for step in dtypes}
    # Steps 3 and 6 changed dtype under a guess: copied with the old plan, then dropped.
    # Step 4 follows a change, so it copies after planning; step 5's guess holds again.
    assert phases == {1: [Phase.DONE], 2: [Phase.DONE], 3: [Phase.ABORTED, Phase.DONE],
                      4: [Phase.DONE], 5: [Phase.DONE], 6: [Phase.ABORTED, Phase.DONE]}
    queue.close()


def test_a_cached_save_copies_after_its_plan_reuse(daemon, monkeypatch):
    """``enable_cache`` reuses the plan (next to no planning to overlap): no guess, and a
    changed dtype is planned and staged once."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    for step, dtype in ((1, torch.float32), (2, torch.float32), (3, torch.float64)):
        save(queue, training_state(step, dtype), os.path.join(root, f"c{step}"),
             enable_cache=True)
        assert_loads(os.path.join(root, f"c{step}"), training_state(step, dtype))
        assert [r["phase"] for r in requests_for(daemon, os.path.join(root, f"c{step}"))] \
            == [Phase.DONE]
    queue.close()


def test_a_save_whose_planning_fails_drops_its_guessed_copy(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    gate = threading.Event()
    gate.set()
    for step in (1, 2):
        save(queue, training_state(step), os.path.join(root, f"s{step}"),
             planner=GatedPlanner(gate))
    failing = os.path.join(root, "failing")
    with pytest.raises(RuntimeError, match="global planning failed"):
        dcp.async_save(training_state(3), failing, planner=GatedPlanner(gate, fail=True))
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "the pool to be freed")
    assert requests_for(daemon, failing), "no copy was guessed for the failing save"
    assert all(r["phase"] == Phase.ABORTED for r in requests_for(daemon, failing))
    assert not os.path.exists(failing) or not os.listdir(failing)
    # The next save is whole.
    save(queue, training_state(4), os.path.join(root, "s4"))
    assert_loads(os.path.join(root, "s4"), training_state(4))
    queue.close()
