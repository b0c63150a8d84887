"""Lightning DDP on two gloo ranks with ``CkptdCheckpointIO``: SIGKILL of both ranks
mid-save, then ``Trainer.fit(ckpt_path="last")`` on two ranks.

Lightning launches rank 1 itself and hands checkpoints to the plugin on rank 0 only,
with a barrier after each save; ``ModelCheckpoint(save_top_k=2, save_last=True)`` saves
every 2 steps. While the daemon writes step 6 (its writers paused) the whole process
group is SIGKILLed. ``last.ckpt`` must still be step 4's, rotation must have deleted only
durable files, and both resumed ranks (rank 1 loads the file through the plugin too)
must hold exactly the model, optimizer and scheduler state rank 0 saved at step 4.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

from frameworks_common import assert_same, files_under  # noqa: E402
from two_rank_run import TwoRankRun  # noqa: E402


def checkpoint_files(ckpt: str) -> list[str]:
    return [n for n in files_under(ckpt) if not n.endswith(".ckptd-sum")]


# the two-rank runs of the other frameworks stand for this path in the default suite
@pytest.mark.slow
def test_ddp_two_ranks_killed_mid_save_resume_from_last_exactly(daemon, tmp_path):
    ckpt = os.path.join(daemon.roots[0], "lightning-ddp")
    run = TwoRankRun(daemon, tmp_path, "lightning_2rank_run.py", ckpt)
    run.kill_mid_save(12)

    names = checkpoint_files(ckpt)
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], names
    assert torch.load(os.path.join(ckpt, "last.ckpt"), weights_only=True)["global_step"] == 4

    run.resume(8)
    saved = run.reference("step-4")
    for rank in (0, 1):
        assert_same(run.reference("resumed", rank), saved, f"rank {rank}")
    names = checkpoint_files(ckpt)
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], names
