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
    torch.distributed.checkpoint.load(loaded, checkpoint_id=os.path.join(folder, "step-4"), no_dist=True)
    assert_same(loaded, model)

    run.resume(10)
    assert_same(run.reference("resumed"), run.reference("step-4"))
    assert complete_steps(folder)[-2:] == [8, 10]
    assert 2 not in complete_steps(folder)  # keep_latest_k purged the oldest

