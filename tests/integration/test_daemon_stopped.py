"""A daemon SIGSTOPped in the middle of a two-rank gloo save: the client's give-up path.

A stopped daemon (SIGSTOP, a hung node) answers nothing, so the daemon cannot judge the
save's deadline: the trainers' own limit (``CKPTD_CALL_TIMEOUT``, 3 s here) ends their
wait. What must hold: both ranks get the same ``CheckpointException`` naming every rank,
the file and the phase each last saw; ``ckptd status`` says the daemon does not answer
while it is stopped (the operator's view of a save stuck on a frozen daemon); once the
daemon resumes it drops the save (each rank left an abort queued) instead of committing
what the ranks were told failed; the previous checkpoint loads; the same job's next save
succeeds. The one-rank version, with the abort's details, is in test_deadlines.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from conftest import wait_for
from faults import writers_paused
from multirank import collect, start_ranks, values
from test_rank_lost import request_of, save_c_and_load_a_and_c, signal_and_wait, state


def save_through_a_stopped_daemon(rank, world_size, root, signals):
    """Save A; on "go" save B and finalize it (the test stops the daemon meanwhile);
    on "resumed" save C; load A."""
    from ckpt_client import AsyncCallsQueue, CheckpointException, dcp

    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(state(rank, 1), os.path.join(root, "A")))
    queue.maybe_finalize_async_calls(blocking=True)
    signal_and_wait(signals, f"a{rank}", "go")
    queue.schedule_async_request(dcp.async_save(state(rank, 2), os.path.join(root, "B")))
    open(os.path.join(signals, f"finalizing{rank}"), "w").close()
    outcome = None
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointException as exc:
        outcome = (exc.failing_ranks, exc.failures)
    signal_and_wait(signals, f"b{rank}", "resumed")
    return outcome, save_c_and_load_a_and_c(rank, root, queue)


def test_a_stopped_daemon_fails_the_save_on_every_rank_and_never_commits_it(daemon, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("CKPTD_CALL_TIMEOUT", "3")  # the ranks inherit it
    root = daemon.roots[0]
    b_path = os.path.join(root, "B")
    signals = tmp_path / "signals"
    signals.mkdir()
    processes, results = start_ranks(save_through_a_stopped_daemon, 2, daemon.socket,
                                     tmp_path, args=(root, str(signals)))
    wait_for(lambda: all((signals / f"a{r}").exists() for r in range(2)), 180, "save A")
    with writers_paused(daemon):  # B stays in flight until the daemon is stopped
        (signals / "go").touch()
        wait_for(lambda: all((signals / f"finalizing{r}").exists() for r in range(2)) and all(
            (request_of(daemon, b_path, r) or {}).get("phase") == "writing"
            for r in range(2)), 120, "both ranks finalizing B while it is written")
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            status = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket",
                                     daemon.socket, "--timeout", "1"],
                                    capture_output=True, text=True, timeout=60)
            wait_for(lambda: all((signals / f"b{r}").exists() for r in range(2)), 60,
                     "both ranks to give up on save B")
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    assert status.returncode == 4, (status.returncode, status.stdout, status.stderr)
    assert "sent no status" in status.stdout + status.stderr, status
    wait_for(lambda: all((request_of(daemon, b_path, r) or {}).get("phase") == "aborted"
                         for r in range(2)), 60, "the resumed daemon to drop save B")
    wait_for(lambda: not os.path.exists(b_path) or os.listdir(b_path) == [], 30,
             "no file of save B to remain")
    (signals / "resumed").touch()
    outcomes = values(collect(processes, results, timeout=180))
    assert outcomes[0][0] == outcomes[1][0], "every rank must see the same failure"
    for (failing, failures), loaded in outcomes:
        assert failing == [0, 1], failures
        for rank in (0, 1):
            message = failures[rank]
            assert message.startswith(f"rank {rank}: gave up on the save of {b_path}")
            assert "(last seen in phase 'writing')" in message and "did not answer" in message
            assert f"ckptd status --socket {daemon.socket}" in message
        assert loaded[0] == 1.0 and loaded[1] == 3.0
    assert not os.path.exists(os.path.join(b_path, ".metadata"))
