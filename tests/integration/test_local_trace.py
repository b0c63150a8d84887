"""``ckptd trace`` of local-checkpoint saves: the trainer's own spans, as the save ran.

A real ``LocalCheckpointManager`` save through a real daemon, blocking and asynchronous.
The trace must show the trainer's blocking time (``blocked in
LocalCheckpointManager.save``) and its finalize on the rank's trainer row, nested and
ordered as the save really ran: a blocking save holds the trainer from before staging to
after the commit; an asynchronous one only through staging, its finalize after the part
is durable. Format checks are test_trace.py's.
"""

from __future__ import annotations

import json
import os

import pytest

from test_local_checkpoints import state_of
from test_trace import check_format, run_trace, within


@pytest.mark.parametrize("is_async", [False, True], ids=["blocking", "async"])
def test_local_saves_show_the_trainers_blocking_time_and_finalize(start_daemon, tmp_path,
                                                                    is_async):
    from ckpt_client import AsyncCallsQueue, BasicTensorAwareStateDict, LocalCheckpointManager

    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    manager = LocalCheckpointManager(local_dir / "ckpt", socket=daemon.socket)
    assert manager.find_latest() == -1
    state = BasicTensorAwareStateDict(state_of(0, 3, big_mib=4))
    if is_async:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(manager.save(state, 3, is_async=True))
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    else:
        manager.save(state, 3)
    assert manager.find_latest() == 3

    out = tmp_path / "trace.json"
    run = run_trace(daemon.socket, out)
    assert run.returncode == 0, run.stderr
    events = check_format(json.load(open(out)))
    iteration_dir = str(local_dir / "ckpt" / manager.session_id / "iter_0000003") \
        if manager.session_id else str(local_dir / "ckpt" / "iter_0000003")
    (save,) = [e for e in events if e.get("cat") == "save"]
    assert save["args"]["path"] == iteration_dir, save
    part = [e for e in events if e["ph"] != "M"
            and e.get("args", {}).get("path", "").startswith(iteration_dir)]
    (staging,) = [e for e in part if e["name"].startswith("staging (")]
    (write,) = [e for e in part if e["cat"] == "write"]
    (fsync,) = [e for e in part if e["cat"] == "fsync"]
    (done,) = [e for e in part if e["ph"] == "i"]
    assert done["name"] == "rank 0 done"
    trainer = [e for e in events if e.get("cat") == "trainer"]
    assert {e["pid"] for e in trainer} == {staging["pid"]}, "the rank's own row"
    assert sorted(e["name"] for e in trainer) == sorted(
        ["blocked in LocalCheckpointManager.save", "finalize"]), trainer
    spans = {e["name"]: e for e in trainer}
    blocked, finalize = spans["blocked in LocalCheckpointManager.save"], spans["finalize"]
    assert all(within(e, save) for e in part + trainer)
    # As it ran: the call stages (inside it), the writer writes and syncs the part after
    # staging, the part is durable, then the finalize commits.
    assert within(staging, blocked)
    assert staging["ts"] + staging["dur"] <= write["ts"] <= fsync["ts"] <= done["ts"]
    assert finalize["ts"] >= done["ts"]
    if is_async:
        assert blocked["ts"] + blocked["dur"] <= finalize["ts"], "the call returned first"
    else:
        assert within(write, blocked) and within(finalize, blocked), \
            "a blocking save holds the trainer through the commit"
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names[(staging["pid"], blocked["tid"])] == "trainer"
