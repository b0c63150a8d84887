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


def test_a_cached_save_copies_with_its_cached_plan_before_checking_it(daemon, monkeypatch):
    """``enable_cache``: the copy starts with the cached plan before the structure check
    that confirms it. While the structure holds the copy is kept (one request a save); a
    changed dtype is copied with the old plan, then dropped unwritten and staged again;
    the save after it copies after its planning, and the one after that guesses again."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    dtypes = {1: torch.float32, 2: torch.float32, 3: torch.float32, 4: torch.float64,
              5: torch.float64, 6: torch.float64, 7: torch.float64, 8: torch.float32}
    for step, dtype in dtypes.items():
        path = os.path.join(root, f"c{step}")
        save(queue, training_state(step, dtype), path, enable_cache=True)
        assert_loads(path, training_state(step, dtype))
    wait_for(lambda: all(r["phase"] in Phase.FINISHED for r in daemon.status()["requests"]),
             30, "every request to settle")
    phases = {step: sorted(r["phase"] for r in requests_for(daemon, os.path.join(root, f"c{step}")))
              for step in dtypes}
    # Step 1 has no plan to guess with; 4 and 8 changed dtype under a guess; 5 follows a
    # dropped guess (it plans first), 6 re-arms the guess, which 7 keeps.
    assert phases == {1: [Phase.DONE], 2: [Phase.DONE], 3: [Phase.DONE],
                      4: [Phase.ABORTED, Phase.DONE], 5: [Phase.DONE], 6: [Phase.DONE],
                      7: [Phase.DONE], 8: [Phase.ABORTED, Phase.DONE]}
    queue.close()


def test_a_cached_save_copies_after_its_structure_check_when_told(daemon, monkeypatch):
    """``CKPTD_DCP_GUESS_CACHED=0`` (the code before): a cached save copies only once its
    plan is confirmed, so a changed dtype is planned and staged once."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    monkeypatch.setenv("CKPTD_DCP_GUESS_CACHED", "0")
    root, queue = daemon.roots[0], AsyncCallsQueue()
    for step, dtype in ((1, torch.float32), (2, torch.float32), (3, torch.float64)):
        save(queue, training_state(step, dtype), os.path.join(root, f"c{step}"),
             enable_cache=True)
        assert_loads(os.path.join(root, f"c{step}"), training_state(step, dtype))
        assert [r["phase"] for r in requests_for(daemon, os.path.join(root, f"c{step}"))] \
            == [Phase.DONE]
    queue.close()


@pytest.mark.parametrize("options", [{"zero_stall": True}, {"enable_cache": True},
                                     {"zero_stall": True, "enable_cache": True}, {}])
def test_saves_of_an_unchanged_plan_load_exactly_as_their_leaves_change_size(
        daemon, monkeypatch, options):
    """A save of the previous save's plan stages with that save's item descriptions
    while every byte item keeps its size: a leaf whose pickled size changes (a string
    that grows by more than ``torch.save``'s padding absorbs), one whose value changes
    within the same size (a step count) and tensors whose values change must each land
    in the save that made them."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    sizes = set()
    for number, step in enumerate((1, 2, 2, 3, 4, 4, 5)):
        path = os.path.join(root, f"k{number}")
        state = training_state(step)
        state["optim"]["step"] += number  # a new value of the same pickled size
        state["optim"]["note"] = "x" * (300 * step)
        expected = {"model": {k: v.clone() for k, v in state["model"].items()},
                    "optim": {**state["optim"],
                              "moments": [t.clone() for t in state["optim"]["moments"]]}}
        save(queue, state, path, **options)
        assert_loads(path, expected)
        sizes.add(stored_lengths(path)["optim.note"])
    assert len(sizes) == 5, f"the note's stored sizes did not change with it: {sizes}"
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


def tensors_state(step: int, dtype: torch.dtype, rows: int, kind: str) -> dict:
    """One kind of state dict (its own top-level keys: the guess is remembered per kind)
    with a tensor whose dtype or shape a test changes, and a leaf that changes each step."""
    gen = torch.Generator().manual_seed(step)
    return {kind: {"x": torch.randn(rows, 64, generator=gen, dtype=torch.float64).to(dtype),
                   "y": torch.randn(8, generator=gen)}, f"{kind}_step": step}


def assert_tensors_load(path: str, expected: dict, kind: str) -> None:
    target = {kind: {k: torch.zeros_like(v) for k, v in expected[kind].items()},
              f"{kind}_step": 0}
    DCP.load(target, storage_reader=FileSystemReader(path))
    for key, value in expected[kind].items():
        got = target[kind][key]
        assert got.dtype == value.dtype and got.shape == value.shape, (key, got.dtype, got.shape)
        assert torch.equal(got, value), f"{path}: {key} differs by {(got - value).abs().max()}"
    assert target[f"{kind}_step"] == expected[f"{kind}_step"]


def stored_lengths(path: str) -> dict:
    """Each item's stored length in bytes, by its fully qualified name."""
    storage = FileSystemReader(path).read_metadata().storage_data
    return {index.fqn: info.length for index, info in storage.items()}


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_failed_planning_leaves_no_stale_layout_for_the_next_guess(daemon, monkeypatch, change):
    """A save whose tensor changed dtype (or shape) and whose planning then failed was
    copied with the previous plan while it planned; the save after it, with the first
    save's dtypes and shapes again, must be copied with the plan's layout, not with the
    failed save's (a float64 tensor copied into float32 views is silently rounded)."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue, kind = daemon.roots[0], AsyncCallsQueue(), f"failed_{change}"
    gate = threading.Event()
    gate.set()
    usual = {"dtype": torch.float64, "rows": 1}
    odd = {"dtype": torch.float32, "rows": 1} if change == "dtype" else \
        {"dtype": torch.float64, "rows": 4}
    save(queue, tensors_state(1, kind=kind, **usual), os.path.join(root, "s1"),
         planner=GatedPlanner(gate))
    failing = os.path.join(root, "failing")
    with pytest.raises(RuntimeError, match="global planning failed"):
        dcp.async_save(tensors_state(2, kind=kind, **odd), failing,
                       planner=GatedPlanner(gate, fail=True))
    assert requests_for(daemon, failing), "no copy was guessed for the failing save"
    for step in (3, 4):  # the first plans (the guess was disarmed), the second guesses
        path = os.path.join(root, f"s{step}")
        save(queue, tensors_state(step, kind=kind, **usual), path, planner=GatedPlanner(gate))
        assert_tensors_load(path, tensors_state(step, kind=kind, **usual), kind)
        assert [r["phase"] for r in requests_for(daemon, path)] == [Phase.DONE]
        # Stock loading narrows a stored tensor to the chunk the metadata names, so a
        # tensor stored with the failed save's larger shape would still load: the stored
        # bytes of each item must be those of the first save, of the same shapes.
        assert stored_lengths(path) == stored_lengths(os.path.join(root, "s1"))
    queue.close()


def test_a_dtype_changed_between_two_successful_saves_is_saved_exactly(daemon, monkeypatch):
    """Each change of dtype is copied, under the guess, into the previous plan's layout
    (a float64 tensor into float32 views is rounded, a float32 one into float64 views
    widened): that copy must be dropped, and every save stored with its own dtype."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, queue, kind = daemon.roots[0], AsyncCallsQueue(), "changing"
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float64, torch.float64,
              torch.float32]
    lengths = {torch.float32: set(), torch.float64: set()}
    for step, dtype in enumerate(dtypes, 1):
        path = os.path.join(root, f"s{step}")
        save(queue, tensors_state(step, dtype, 1, kind), path)
        assert_tensors_load(path, tensors_state(step, dtype, 1, kind), kind)
        lengths[dtype].add(stored_lengths(path)[f"{kind}.x"])
    # Stock loading casts to the target's dtype (a float32 tensor stored widened loads
    # exactly): each save's stored bytes must be those of its own dtype.
    assert len(lengths[torch.float32]) == len(lengths[torch.float64]) == 1
    assert min(lengths[torch.float64]) > min(lengths[torch.float32])
    wait_for(lambda: all(r["phase"] in Phase.FINISHED for r in daemon.status()["requests"]),
             30, "every request to settle")
    aborted = [step for step in range(1, len(dtypes) + 1)
               if Phase.ABORTED in [r["phase"] for r in
                                    requests_for(daemon, os.path.join(root, f"s{step}"))]]
    # A guess is made once a plan held (steps 2, 3, 5 and 6); those of steps 3 and 6 met
    # a changed dtype.
    assert aborted == [3, 6]
    queue.close()


def test_a_guessed_copy_never_released_does_not_keep_the_stager(start_daemon, monkeypatch):
    """A blocking save whose planning hangs holds its guessed copy back from the writers.
    The connection's background stager, which stages every later zero-stall save, must
    give that copy up once the daemon's staging deadline has passed, not wait for ever;
    the hung save, once its planning ends, stages its final plan the ordinary way."""
    deadlines = {"CKPTD_STAGING_DEADLINE": "1", "CKPTD_SERVE_TICK": "0.05"}
    daemon = start_daemon(env=deadlines)
    for name, value in {**deadlines, "CKPTD_CALL_TIMEOUT": "3", "CKPTD_WAIT_MARGIN": "0",
                        "CKPTD_SOCKET": daemon.socket}.items():
        monkeypatch.setenv(name, value)
    root, queue, kind = daemon.roots[0], AsyncCallsQueue(), "hung"
    gate = threading.Event()
    gate.set()
    save(queue, tensors_state(1, torch.float32, 4, kind), os.path.join(root, "s1"),
         planner=GatedPlanner(gate))

    hung, path = threading.Event(), os.path.join(root, "s2")
    planner, made = GatedPlanner(hung), []
    call = threading.Thread(target=lambda: made.append(dcp.async_save(
        tensors_state(2, torch.float32, 4, kind), path, planner=planner)))
    call.start()
    try:
        assert planner.entered.wait(60), "the save never reached its global plan"
        wait_for(lambda: requests_for(daemon, path), 30, "the guessed copy's request")
        other = dcp.async_save(tensors_state(3, torch.float32, 4, "other"),
                               os.path.join(root, "other"), zero_stall=True)
        # Staged behind the held copy on the same background stager.
        wait_for(lambda: all(s.staged for s in other.daemon_saves), 30,
                 "the zero-stall save queued behind the held copy to be staged")
        queue.schedule_async_request(other)
        queue.maybe_finalize_async_calls(blocking=True)
        assert_tensors_load(os.path.join(root, "other"),
                            tensors_state(3, torch.float32, 4, "other"), "other")
    finally:
        hung.set()
        call.join(120)
    queue.schedule_async_request(made[0])
    queue.maybe_finalize_async_calls(blocking=True)
    assert_tensors_load(path, tensors_state(2, torch.float32, 4, kind), kind)
    assert sorted(r["phase"] for r in requests_for(daemon, path)) == \
        sorted([Phase.FAILED, Phase.DONE])
    queue.close()


def ranks_save_then_twice_refused(rank: int, world_size: int, root: str, outside: str) -> None:
    """One save under the daemon's root, then two the daemon refuses (outside its roots),
    then one under the root again, on every rank."""
    from ckpt_client import CheckpointException

    queue = AsyncCallsQueue()
    save(queue, training_state(1), os.path.join(root, "s1"))
    for name in ("refused-a", "refused-b"):
        with pytest.raises(CheckpointException, match="outside the allowed roots"):
            save(queue, training_state(2), os.path.join(outside, name))
    save(queue, training_state(3), os.path.join(root, "s3"))
    queue.close()


def test_a_refused_distributed_save_disarms_the_guess(start_daemon, tmp_path):
    """Two ranks (gloo): a save refused by the daemon (every rank's STAGE refused: the
    ranks learn it in the completion collective) is a save whose staging failed, so the
    next save of the kind plans before it copies, as after any failed save. The daemon
    logs each STAGE it refuses: the first refused save sends two per rank (the guessed
    copy's, and its own again after planning), the second one only its own. Before, the
    refused save re-armed the guess, and every later refused save sent both."""
    from multirank import run_ranks, values

    daemon = start_daemon()
    outside = str(tmp_path / "outside")
    values(run_ranks(ranks_save_then_twice_refused, 2, daemon.socket, tmp_path,
                     args=(daemon.roots[0], outside)))
    log = daemon.log()
    refused = {name: sum(1 for line in log.splitlines() if "refused a message" in line
                         and os.path.join(outside, name) in line)
               for name in ("refused-a", "refused-b")}
    assert refused == {"refused-a": 4, "refused-b": 2}, refused
    assert_loads(os.path.join(daemon.roots[0], "s3"), training_state(3))
