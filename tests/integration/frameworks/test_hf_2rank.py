"""``CkptdTrainer`` under DDP on two gloo ranks: SIGKILL of both ranks mid-save, resume.

A one-layer GPT-2 trains on two ranks with a checkpoint every 2 steps and
``save_total_limit=2``. Rank 0 hands the weights, optimizer and scheduler to the daemon;
every rank writes its own ``rng_state_R.pth`` (``Trainer``'s synchronous writer). While
the daemon writes checkpoint-6 (its writers paused) the whole process group is
SIGKILLed: checkpoint-6 must not be marked complete, and
``train(resume_from_checkpoint=True)`` on two ranks must restore on each rank exactly
the model, optimizer, scheduler and torch RNG state of checkpoint-4; rotation then goes
on deleting durable checkpoints only.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from frameworks_common import assert_same  # noqa: E402
from test_hf import checkpoints  # noqa: E402
from two_rank_run import TwoRankRun  # noqa: E402


@pytest.mark.slow  # the two-rank torchtitan run stands for this path in the default suite
def test_ddp_two_ranks_killed_mid_save_resume_from_the_last_complete_checkpoint(daemon, tmp_path):
    from ckpt_client.integrations.hf import COMPLETE_MARKER, last_complete_checkpoint

    output = os.path.join(daemon.roots[0], "hf-ddp")
    run = TwoRankRun(daemon, tmp_path, "hf_2rank_run.py", output)
    run.kill_mid_save(12)

    assert not os.path.exists(os.path.join(output, "checkpoint-6", COMPLETE_MARKER))
    complete = last_complete_checkpoint(output)
    assert complete is not None and complete.endswith("checkpoint-4"), complete
    saved = [run.reference("step-4", rank) for rank in (0, 1)]
    assert_same(torch.load(os.path.join(complete, "pytorch_model.bin"), weights_only=True),
                saved[0]["model"])  # stock torch.load reads the daemon's file
    for rank in (0, 1):  # each rank's RNG, in the file Trainer wrote for it
        rng = torch.load(os.path.join(complete, f"rng_state_{rank}.pth"), weights_only=False)
        assert torch.equal(rng["cpu"], saved[rank]["rng"]), f"rank {rank}"

    run.resume(10)
    for rank in (0, 1):
        resumed = run.reference("resumed", rank)
        assert resumed["step"] == 4
        assert_same(resumed, saved[rank], f"rank {rank}")
    assert checkpoints(output) == ["checkpoint-8", "checkpoint-10"]
    assert all(os.path.exists(os.path.join(output, n, COMPLETE_MARKER))
               for n in checkpoints(output))


