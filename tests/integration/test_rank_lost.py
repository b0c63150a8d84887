"""A rank SIGKILLed between staging a save and finalizing it, in a real two-rank gloo job.

The fault: rank 1's process is killed (as the OOM killer or a lost node would) after its
``dcp.async_save`` returned and before it calls ``maybe_finalize_async_calls``, while the
daemon is still writing the save (its writers are SIGSTOPped for that window, so the kill
lands mid-write on every run, not only when the write is slow). Rank 0 is already in the
finalize. What must hold: the daemon aborts rank 1's request naming the trainer that
exited (status shows it); rank 0 gets a ``CheckpointException`` naming rank 1 and the
phase it was lost in, not gloo's "Connection closed by peer"; nothing of the save is
visible (no ``.metadata``, no file of either rank); the previous checkpoint loads; a new
job (the old group is broken, as after any lost rank) saves and loads again.

Not checked here: "status shows the save stuck". Nothing is stuck in this fault: the
daemon learns of the dead trainer within a tick and the survivors from the collective at
once; the stuck flag is for saves that stop moving (tests/integration/test_deadlines.py).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from conftest import wait_for
from faults import writers_paused
from multirank import collect, run_ranks, start_ranks, values


def state(rank: int, value: float) -> dict:
    return {f"w{rank}": torch.full((1 << 16,), float(value))}


def signal_and_wait(signals: str, done: str, name: str, timeout: float = 180.0) -> None:
    """Say ``done``, then wait (in a rank) for the test to create ``name``."""
    open(os.path.join(signals, done), "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(signals, name)):
        assert time.monotonic() < deadline, f"the test never said {name}"
        time.sleep(0.02)  # polling a file the test creates; no event crosses processes


def save_then_lose_rank_1(rank, world_size, root, signals):
    """Save A; on "go" stage B; rank 1 then waits to be killed, rank 0 finalizes B."""
    from ckpt_client import AsyncCallsQueue, CheckpointException, dcp

    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(state(rank, 1), os.path.join(root, "A")))
    queue.maybe_finalize_async_calls(blocking=True)
    signal_and_wait(signals, f"a{rank}", "go")
    queue.schedule_async_request(dcp.async_save(state(rank, 2), os.path.join(root, "B")))
    if rank == 1:
        signal_and_wait(signals, "staged1", "never", timeout=600)  # killed in here
    outcome = None
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointException as exc:
        outcome = (exc.failing_ranks, exc.failures)
    loaded = state(rank, 0)
    DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, "A")),
             process_group=None, no_dist=True)
    return outcome, float(loaded[f"w{rank}"][0]), queue.get_num_unfinalized_calls()


def save_and_load_again(rank, world_size, root):
    """A new job after the loss: saves C, loads A and C."""
    from ckpt_client import AsyncCallsQueue

    return save_c_and_load_a_and_c(rank, root, AsyncCallsQueue())


def save_c_and_load_a_and_c(rank: int, root: str, queue) -> list[float]:
    """Save C on ``queue`` (then closed); this rank's value in A and in C."""
    from ckpt_client import dcp

    queue.schedule_async_request(dcp.async_save(state(rank, 3), os.path.join(root, "C")))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    loaded = []
    for name in ("A", "C"):
        into = state(rank, 0)
        DCP.load(into, storage_reader=FileSystemReader(os.path.join(root, name)))
        loaded.append(float(into[f"w{rank}"][0]))
    return loaded


def request_of(daemon, path: str, rank: int) -> dict | None:
    found = [r for r in daemon.status()["requests"]
             if r["rank"] == rank and r["path"].startswith(path)]
    return found[-1] if found else None


def test_a_rank_killed_between_stage_and_finalize_fails_the_save_on_the_others(daemon,
                                                                              tmp_path):
    root = daemon.roots[0]
    signals = tmp_path / "signals"
    signals.mkdir()
    processes, results = start_ranks(save_then_lose_rank_1, 2, daemon.socket, tmp_path,
                                     args=(root, str(signals)))
    wait_for(lambda: all((signals / f"a{r}").exists() for r in range(2)), 180, "save A")
    b_path = os.path.join(root, "B")
    with writers_paused(daemon):
        (signals / "go").touch()
        wait_for(lambda: (signals / "staged1").exists(), 120, "rank 1 to stage save B")
        wait_for(lambda: all((request_of(daemon, b_path, r) or {}).get("phase") == "writing"
                             for r in range(2)), 60, "both ranks' B requests to be writing")
        victim = processes[1].pid
        os.kill(victim, signal.SIGKILL)
        aborted = wait_for(lambda: (request_of(daemon, b_path, 1) or {}).get("phase")
                           == "aborted" and request_of(daemon, b_path, 1), 30,
                           "the daemon to abort the dead rank's request")
        assert f"trainer process {victim} exited" in str(aborted), aborted
        assert request_of(daemon, b_path, 0)["phase"] == "writing", "rank 0's save dropped too"
    outcomes = collect(processes, results, timeout=120)
    assert outcomes[1].exitcode == -signal.SIGKILL
    (failing, failures), value_of_a, unfinalized = values(outcomes[:1])[0]
    assert failing == [1], failures
    message = failures[1]
    assert message.startswith("rank 1 was lost between staging this save and finalizing it")
    assert "phase 'finalize'" in message and "Connection closed" not in message
    assert value_of_a == 1.0 and unfinalized == 0
    assert not os.path.exists(os.path.join(b_path, ".metadata"))
    wait_for(lambda: os.listdir(b_path) == [], 30, "no file of the failed save B to remain")
    assert values(run_ranks(save_and_load_again, 2, daemon.socket, tmp_path,
                            args=(root,), name="again")) == [[1.0, 3.0], [1.0, 3.0]]


# ------------------------------------------------------------------ late is not lost

def one_late_one_lost(rank, world_size, root, signals):
    """Save A (rank 2 is stopped before its finalize, then continued); save B (rank 2
    stopped again, rank 1 killed after staging). Returns B's (failing ranks, failures)."""
    import logging

    from ckpt_client import AsyncCallsQueue, CheckpointException, dcp

    class Waiting(logging.Handler):  # what a rank says when it waits for a late one
        def emit(self, record):
            if "not known to be gone" in record.getMessage():
                open(os.path.join(signals, f"waiting{rank}"), "w").close()

    logging.getLogger("ckpt_client.arrivals").addHandler(Waiting())
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(state(rank, 1), os.path.join(root, "A")))
    if rank == 2:
        signal_and_wait(signals, "ready-a2", "go-a")  # stopped in here
    queue.maybe_finalize_async_calls(blocking=True)
    signal_and_wait(signals, f"a{rank}", "go-b")
    queue.schedule_async_request(dcp.async_save(state(rank, 2), os.path.join(root, "B")))
    if rank == 1:
        signal_and_wait(signals, "staged1", "never", timeout=600)  # killed in here
    if rank == 2:
        signal_and_wait(signals, "staged2", "go-b2")  # stopped in here, then late
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        return None
    except CheckpointException as exc:
        return exc.failing_ranks, exc.failures


def test_a_late_rank_is_waited_for_and_only_the_dead_one_is_named(daemon, tmp_path):
    """Three gloo ranks. Save A: rank 2 is SIGSTOPped before its finalize and continued;
    the save succeeds. Save B: rank 2 is stopped again and rank 1 SIGKILLed; rank 0's
    collective breaks at once (gloo: "Connection closed by peer", rank 1 is its ring
    neighbour) while rank 2 has not reached the check. Rank 0 must not name the late
    rank 2 lost: it waits for it, and every rank names rank 1 alone, with the evidence
    (its process exited)."""
    root = daemon.roots[0]
    signals = tmp_path / "signals"
    signals.mkdir()
    processes, results = start_ranks(one_late_one_lost, 3, daemon.socket, tmp_path,
                                     args=(root, str(signals)))
    victim, late = processes[1].pid, processes[2].pid
    try:
        wait_for(lambda: (signals / "ready-a2").exists(), 180, "rank 2 to stage save A")
        os.kill(late, signal.SIGSTOP)
        (signals / "go-a").touch()
        wait_for(lambda: all(request_of(daemon, os.path.join(root, "A"), r) for r in (0, 1)),
                 60, "ranks 0 and 1 to hand save A over (they finalize, rank 2 is stopped)")
        os.kill(late, signal.SIGCONT)
        wait_for(lambda: all((signals / f"a{r}").exists() for r in range(3)), 120,
                 "save A to finalize on every rank")
        assert os.path.exists(os.path.join(root, "A", ".metadata"))
        (signals / "go-b").touch()
        wait_for(lambda: (signals / "staged2").exists(), 60, "rank 2 to stage save B")
        os.kill(late, signal.SIGSTOP)
        wait_for(lambda: (signals / "staged1").exists(), 60, "rank 1 to stage save B")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: (signals / "waiting0").exists(), 60,
                 "rank 0 to wait for the late rank 2 (not to name it lost)")
        (signals / "go-b2").touch()
    finally:
        os.kill(late, signal.SIGCONT)
    outcomes = collect(processes, results, timeout=180)
    assert outcomes[1].exitcode == -signal.SIGKILL
    for failing, failures in values([outcomes[0], outcomes[2]]):
        assert failing == [1], failures
        assert failures[1].startswith("rank 1 was lost between staging this save and "
                                      "finalizing it")
        assert f"its process (pid {victim}) exited" in failures[1]
    assert not os.path.exists(os.path.join(root, "B", ".metadata"))
