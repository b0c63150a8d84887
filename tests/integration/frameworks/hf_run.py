"""A small Transformers ``Trainer`` run through ``CkptdTrainer`` (driven by test_hf).

``python hf_run.py OUTPUT REFS GATES MAX_STEPS [resume]``: a one-layer GPT-2 built from a
config (no download) on random token ids, AdamW with a linear schedule, a checkpoint
every 2 steps, ``save_total_limit=2``. Each save's state is also kept plainly in REFS;
with ``resume`` the run resumes from the newest complete checkpoint and records what it
restored.
"""

from __future__ import annotations

import copy
import os
import random
import sys

import numpy as np

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import gates
from ckpt_client.integrations.hf import CkptdTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (64, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def rng_state() -> dict:
    """The RNG state Trainer keeps in ``rng_state.pth`` (its own synchronous writer)."""
    numpy_state = np.random.get_state()
    return {"python": random.getstate(), "cpu": torch.get_rng_state(),
            "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]]}


class Record(TrainerCallback):
    def __init__(self, refs: str, gate_dir: str, resume: bool) -> None:
        self.refs, self.gate_dir, self.resume, self.trainer = refs, gate_dir, resume, None
        self.first = True

    def snapshot(self, state, model, optimizer, lr_scheduler) -> dict:
        return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict(),
                              "lr": lr_scheduler.state_dict(), "step": state.global_step,
                              "rng": rng_state()})

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        torch.save(self.snapshot(state, model, optimizer, lr_scheduler),
                   os.path.join(self.refs, f"step-{state.global_step}.pt"))

    def on_step_begin(self, args, state, control, model=None, optimizer=None,
                      lr_scheduler=None, **kw):
        if self.resume and self.first:
            torch.save(self.snapshot(state, model, optimizer, lr_scheduler),
                       os.path.join(self.refs, "resumed.pt"))
        self.first = False
        if self.resume:
            return
        if state.global_step == 4:  # checkpoint-4 handed over: let it become complete
            self.trainer.commit_checkpoints(blocking=True)
            gates.reach(self.gate_dir, "durable4", hold=True)
        if state.global_step == 6:  # checkpoint-6 staged, the daemon writing it
            gates.reach(self.gate_dir, "staged6", hold=True)


def main() -> None:
    output, refs, gate_dir, max_steps = sys.argv[1:5]
    resume = sys.argv[5:] == ["resume"]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128,
                                       n_positions=16))
    args = TrainingArguments(output_dir=output, max_steps=int(max_steps), save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2,
                             logging_steps=1000, report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    record = Record(refs, gate_dir, resume)
    trainer = CkptdTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[record])
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=True if resume else None)


if __name__ == "__main__":
    main()
