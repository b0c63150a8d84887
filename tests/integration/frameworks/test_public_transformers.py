"""Transformers ``Trainer``'s own checkpoint and resume expectations, against ``CkptdTrainer``.

Each test re-states what one of Transformers' Trainer tests expects
(``tests/trainer/test_trainer_checkpointing.py``, where the checkpoint tests of
``tests/trainer/test_trainer.py`` live in Transformers 5) and checks it of
:class:`ckpt_client.integrations.hf.CkptdTrainer` with a real daemon: a one-layer GPT-2
built from a config (no download, no dropout so that runs repeat exactly), CPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from frameworks_common import assert_same  # noqa: E402
from test_hf import checkpoints  # noqa: E402
from hf_run import Tokens  # noqa: E402


def trainer(output: str, max_steps: int, save_steps: int, **args):
    from ckpt_client.integrations.hf import CkptdTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128,
                                       n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    arguments = TrainingArguments(output_dir=output, max_steps=max_steps, save_steps=save_steps,
                                  per_device_train_batch_size=4, learning_rate=1e-2,
                                  logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                  dataloader_num_workers=0, disable_tqdm=True, **args)
    return CkptdTrainer(model=model, args=arguments, train_dataset=Tokens())


def params(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def same_state(first, second) -> None:
    """As upstream's ``check_trainer_state_are_the_same``: the trainer states agree,
    except for wall-clock figures in the log."""
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second",
              "total_flos", "train_loss")
    logs = [[{k: v for k, v in entry.items() if k not in timing} for entry in state.log_history]
            for state in (first, second)]
    assert logs[0] == logs[1]
    assert (first.global_step, first.max_steps) == (second.global_step, second.max_steps)


@pytest.fixture
def output(shared_daemon, monkeypatch, request):
    monkeypatch.setenv("CKPTD_SOCKET", shared_daemon.socket)
    return os.path.join(shared_daemon.roots[0], request.node.name)


def test_can_resume_training(output):
    """Mirrors ``TrainerResumeTrainingTest.test_can_resume_training``: resuming from an
    earlier checkpoint ends with exactly the weights and trainer state of the
    uninterrupted run; a bogus checkpoint and ``resume_from_checkpoint=True`` on a
    directory without checkpoints fail with the stock messages. Also
    ``test_training_with_resume_from_checkpoint_false`` (``False`` trains from scratch)."""
    full = trainer(output, max_steps=6, save_steps=2)
    full.train(resume_from_checkpoint=False)
    expected, state = params(full), full.state
    for step in (2, 4):
        resumed = trainer(output, max_steps=6, save_steps=2)
        resumed.train(resume_from_checkpoint=os.path.join(output, f"checkpoint-{step}"))
        assert_same(params(resumed), expected, f"resumed from checkpoint-{step}")
        same_state(resumed.state, state)

    fresh = os.path.join(os.path.dirname(output), f"{os.path.basename(output)}-fresh")
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        trainer(fresh, 2, 2).train(resume_from_checkpoint=os.path.join(output, "checkpoint-4-bogus"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer(fresh, 2, 2).train(resume_from_checkpoint=True)


def test_saved_checkpoints_and_rotation(output):
    """Mirrors ``TrainerCheckpointSaveTest.test_save_checkpoints`` (every ``save_steps``
    a ``checkpoint-N`` with the config, weights, optimizer, scheduler, trainer state and
    RNG files, its trainer state at step N) and
    ``TrainerCheckpointRotationTest.test_checkpoint_rotation`` (``save_total_limit=2``
    keeps the two newest); here each kept checkpoint is also marked complete and its
    weights read by stock ``torch.load`` equal the model's at that step."""
    from ckpt_client.integrations.hf import COMPLETE_MARKER

    run = trainer(output, max_steps=5, save_steps=1, save_total_limit=2)
    run.train()
    assert checkpoints(output) == ["checkpoint-4", "checkpoint-5"]
    for name in checkpoints(output):
        directory = os.path.join(output, name)
        for needed in ("config.json", "pytorch_model.bin", "optimizer.pt", "scheduler.pt",
                       "trainer_state.json", "rng_state.pth", COMPLETE_MARKER):
            assert os.path.exists(os.path.join(directory, needed)), f"{name}/{needed}"
        with open(os.path.join(directory, "trainer_state.json")) as f:
            assert json.load(f)["global_step"] == int(name.split("-")[1])
    weights = torch.load(os.path.join(output, "checkpoint-5", "pytorch_model.bin"),
                         weights_only=True)
    assert_same({k: weights[k] for k in weights}, {k: params(run)[k] for k in weights})
