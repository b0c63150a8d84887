"""torchtitan with ``CkptdCheckpointManager``: its own manager, optimizer and scheduler
containers and loop, a real daemon; SIGKILL while the daemon writes, then resume.

The run saves every 2 steps (``keep_latest_k=2``); while the daemon writes step 6 (its
writers paused) the trainer is SIGKILLed. Step 6 must not be a loadable checkpoint
(no ``.metadata``), and the resumed run must restore exactly the model, optimizer,
scheduler and train state saved at step 4, then go on saving with its retention.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")

from frameworks_common import KilledRun, assert_same  # noqa: E402


def complete_steps(folder: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(folder)
                  if os.path.exists(os.path.join(folder, n, ".metadata")))


# "async" runs the same path with the blocking stager: slow, to keep the suite's budget
@pytest.mark.parametrize("mode", ["async_with_pinned_mem",
                                  pytest.param("async", marks=pytest.mark.slow)])
def test_killed_mid_save_resumes_exactly(daemon, tmp_path, mode):
    base = os.path.join(daemon.roots[0], mode)
    run = KilledRun(daemon, tmp_path, "torchtitan_run.py", base, extra=(mode,))
    run.kill_mid_save(12)
    folder = os.path.join(base, "checkpoint")
    assert complete_steps(folder) == [2, 4]
    # stock DCP reads what the daemon wrote
    model = run.reference("step-4")["model"]
    loaded = {k: torch.zeros_like(v) for k, v in model.items()}
    dcp.load(loaded, checkpoint_id=os.path.join(folder, "step-4"), no_dist=True)
    assert_same(loaded, model)

    run.resume(10)
    assert_same(run.reference("resumed"), run.reference("step-4"))
    assert complete_steps(folder)[-2:] == [8, 10]
    assert 2 not in complete_steps(folder)  # keep_latest_k purged the oldest




@pytest.mark.slow
def test_retention_counts_only_complete_steps(daemon, tmp_path):
    """``keep_latest_k=2`` keeps two loadable steps: torchtitan's own retention counted
    every ``step-N`` folder, so one an aborted save left without ``.metadata`` (and the
    save in flight) took the place of loadable steps, and a crash then could leave
    nothing to resume from.

    Slow (~10 s: three trainer processes, two of them killed); the adapter's kill and
    resume test above stays in the normal suite."""
    base = os.path.join(daemon.roots[0], "retention")
    run = KilledRun(daemon, tmp_path, "torchtitan_run.py", base, extra=("async_with_pinned_mem",))
    run.kill_mid_save(12)  # steps 2 and 4 durable, killed while step 6 is written
    folder = os.path.join(base, "checkpoint")
    assert complete_steps(folder) == [2, 4]
    # the daemon dropped the killed save's files; a save by stock DCP's own writer that
    # failed mid-way (an item it cannot pickle) leaves its step folder without .metadata
    interrupted = os.path.join(folder, "step-6")
    with pytest.raises(DCPCheckpointException, match="pickle"):
        dcp.save({"w": torch.ones(4), "unpicklable": lambda: None}, checkpoint_id=interrupted,
                 no_dist=True)
    assert os.path.isdir(interrupted) and not os.path.exists(os.path.join(interrupted, ".metadata"))

    # resumed from step 4 with interval 5 (changed on restart): killed while its first
    # save (step 5) is written, once retention ran beside the incomplete step 6
    run.kill_resumed_mid_save(12, "saved-after-resume", "interval=5", "hold")
    assert complete_steps(folder) == [2, 4]
    run.resume(10)  # interval 2: saves 6 (into the interrupted folder), 8, 10
    assert_same(run.reference("resumed"), run.reference("step-4"))
    assert complete_steps(folder) == [6, 8, 10]
