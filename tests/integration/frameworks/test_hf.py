"""Transformers ``Trainer`` through ``CkptdTrainer``, and Accelerate state through ckptd.

A one-layer GPT-2 trains with a checkpoint every 2 steps and ``save_total_limit=2``; while
the daemon writes checkpoint-6 (its writers paused) the trainer is SIGKILLed.
checkpoint-6 must not be marked complete (stock ``get_last_checkpoint`` would pick it),
``train(resume_from_checkpoint=True)`` must restore exactly the model, optimizer and
scheduler state of checkpoint-4, and the RNG state (Python, numpy, torch CPU) Trainer
keeps in ``rng_state.pth``, and rotation must go on deleting durable checkpoints only.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from frameworks_common import KilledRun, assert_same  # noqa: E402


def checkpoints(output: str) -> list[str]:
    return sorted((n for n in os.listdir(output) if n.startswith("checkpoint-")),
                  key=lambda n: int(n.split("-")[1]))


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(daemon, tmp_path):
    from transformers.trainer_utils import get_last_checkpoint
    from ckpt_client.integrations.hf import COMPLETE_MARKER, last_complete_checkpoint

    output = os.path.join(daemon.roots[0], "hf")
    run = KilledRun(daemon, tmp_path, "hf_run.py", output)
    run.kill_mid_save(12)

    assert get_last_checkpoint(output).endswith("checkpoint-6")  # what stock would resume
    assert not os.path.exists(os.path.join(output, "checkpoint-6", COMPLETE_MARKER))
    assert last_complete_checkpoint(output).endswith("checkpoint-4")
    weights = torch.load(os.path.join(output, "checkpoint-4", "pytorch_model.bin"),
                         weights_only=True)  # stock torch.load reads the daemon's file
    assert_same(weights, run.reference("step-4")["model"])

    run.resume(10)
    resumed = run.reference("resumed")
    assert resumed["step"] == 4
    assert_same(resumed, run.reference("step-4"))  # RNG state included (resumed["rng"])
    assert checkpoints(output) == ["checkpoint-8", "checkpoint-10"]
    assert all(os.path.exists(os.path.join(output, n, COMPLETE_MARKER))
               for n in checkpoints(output))


def test_accelerate_save_and_load_state(daemon, tmp_path, monkeypatch):
    pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
    from accelerate import Accelerator
    from ckpt_client.integrations.hf import load_state, save_state

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = copy.deepcopy(optimizer.state_dict())
    directory = os.path.join(daemon.roots[0], "accelerate")
    save_state(accelerator, directory)
    with torch.no_grad():  # training goes on; the saved state must not see it
        for p in model.parameters():
            p.add_(1.0)
    load_state(accelerator, directory)
    assert_same(model.state_dict(), expected)
    assert os.path.exists(os.path.join(directory, "pytorch_model.bin.ckptd-sum"))
    assert_same(optimizer.state_dict()["state"], expected_optim["state"])
