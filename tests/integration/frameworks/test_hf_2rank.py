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

from frameworks_common import assert_same, wait_for  # noqa: E402
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



def _accelerate_save_then_load(rank, world_size, directory, gate_dir):
    """One rank: a DDP-prepared model, AdamW and a scheduler; save_state, train on, then
    load_state must bring back exactly what was saved (RNG included, per rank)."""
    import copy

    import gates
    from accelerate import Accelerator
    from ckpt_client.integrations.hf import load_state, save_state

    # what torchrun would have set; the gloo group itself is already up (multirank)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1")
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world_size, accelerator.state
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def train_step():
        accelerator.backward(model(torch.randn(8, 16)).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    def snapshot():
        return copy.deepcopy({"model": accelerator.unwrap_model(model).state_dict(),
                              "optim": optimizer.state_dict(), "lr": scheduler.state_dict(),
                              "rng": torch.get_rng_state()})

    train_step()
    saved = snapshot()
    save_state(accelerator, directory)
    train_step()  # training goes on while the daemon writes; the save must not see it
    gates.reach(gate_dir, f"loading-rank{rank}")
    load_state(accelerator, directory)  # rank 1 reads the file rank 0 handed over
    assert_same(snapshot(), saved, f"rank {rank}")
    return True


def test_accelerate_two_ranks_save_and_load_state(daemon, tmp_path):
    """Only the rank Accelerate saves on hands the weights to the daemon, and a rank
    that did not save them still waits, in ``load_state``, until they are durable: the
    daemon's writers stay paused until both ranks are about to load."""
    pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
    import gates
    from faults import writers_paused
    from multirank import collect, start_ranks, values

    directory = os.path.join(daemon.roots[0], "accelerate-ddp")
    gate_dir = tmp_path / "gates"
    gate_dir.mkdir()
    with writers_paused(daemon):
        processes, results = start_ranks(_accelerate_save_then_load, 2, daemon.socket,
                                         tmp_path, args=(directory, str(gate_dir)))
        for rank in (0, 1):
            wait_for(lambda: gates.reached(str(gate_dir), f"loading-rank{rank}")
                     or not processes[rank].is_alive(), 120, f"rank {rank} at load_state")
        assert not os.path.exists(os.path.join(directory, "pytorch_model.bin"))
    assert values(collect(processes, results)) == [True, True]
    weights = [r for r in daemon.status()["requests"] if r["path"].endswith("pytorch_model.bin")]
    assert [(r["rank"], r["phase"]) for r in weights] == [(0, "done")], weights
    assert sorted(n for n in os.listdir(directory) if n.startswith("random_states")) == \
        ["random_states_0.pkl", "random_states_1.pkl"]
