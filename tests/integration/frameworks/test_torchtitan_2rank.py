"""torchtitan on two gloo ranks (FSDP2 on CPU) through ``CkptdCheckpointManager``.

Both ranks save their shards of the model and the Adam state every 2 steps through the
daemon (``keep_latest_k=2``); while the daemon writes step 6 (its writers paused) both
ranks are SIGKILLed at once. Step 6 must not be loadable (no ``.metadata``), stock DCP
must read step 4 as the two ranks' shards put together, and the resumed ranks must each
hold exactly the shards they saved at step 4 (model, optimizer, scheduler, train step).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")

from frameworks_common import assert_same  # noqa: E402
from test_torchtitan import complete_steps  # noqa: E402
from two_rank_run import TwoRankRun  # noqa: E402


def test_two_fsdp_ranks_killed_mid_save_resume_their_own_shards(daemon, tmp_path):
    mode = "async_with_pinned_mem"
    base = os.path.join(daemon.roots[0], mode)
    run = TwoRankRun(daemon, tmp_path, "torchtitan_2rank_run.py", base, extra=(mode,))
    run.kill_mid_save(12)
    folder = os.path.join(base, "checkpoint")
    assert complete_steps(folder) == [2, 4]

    # stock DCP, without a process group, reads step 4 whole: rank 0's rows, then rank 1's
    shards = [run.reference("step-4", rank)["model"] for rank in (0, 1)]
    whole = {k: torch.cat([shards[0][k], shards[1][k]]) for k in shards[0]}
    assert all(not torch.equal(shards[0][k], shards[1][k]) for k in whole)
    loaded = {k: torch.zeros_like(v) for k, v in whole.items()}
    dcp.load(loaded, checkpoint_id=os.path.join(folder, "step-4"), no_dist=True)
    assert_same(loaded, whole)

    run.resume(10)
    for rank in (0, 1):
        assert_same(run.reference("resumed", rank), run.reference("step-4", rank),
                    f"rank {rank}")
    assert complete_steps(folder)[-2:] == [8, 10]
    assert 2 not in complete_steps(folder)  # keep_latest_k purged the oldest
