"""A small Lightning training run through ``CkptdCheckpointIO`` (driven by test_lightning).

``python lightning_run.py CKPT_DIR REFS_DIR GATE_DIR MAX_STEPS [resume]``: trains a few
linear layers with Adam and a StepLR scheduler, saving every 2 steps with
``ModelCheckpoint(save_top_k=2, save_last=True)``. Every checkpoint Lightning hands to the
plugin is also kept (synchronously, plainly) in REFS_DIR as the reference of that step;
with ``resume`` the run starts from ``ckpt_path="last"`` and records what it restored.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import gates
from ckpt_client.integrations.lightning import CkptdCheckpointIO


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("gstep", float(self.global_step))
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


class Record(Callback):
    """References of each save, gates for the test, and what a resumed run restored."""

    def __init__(self, refs: str, gate_dir: str, resume: bool) -> None:
        self.refs, self.gate_dir, self.resume = refs, gate_dir, resume

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        reference = {k: copy.deepcopy(checkpoint[k])
                     for k in ("state_dict", "optimizer_states", "lr_schedulers", "global_step")}
        torch.save(reference, os.path.join(self.refs, f"step-{checkpoint['global_step']}.pt"))

    def on_train_start(self, trainer, pl_module) -> None:
        if self.resume:
            torch.save({"state_dict": pl_module.state_dict(),
                        "optimizer_states": [trainer.optimizers[0].state_dict()],
                        "lr_schedulers": [trainer.lr_scheduler_configs[0].scheduler.state_dict()],
                        "global_step": trainer.global_step},
                       os.path.join(self.refs, "resumed.pt"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.resume:
            return
        if trainer.global_step == 5:  # saves of steps 2 and 4 handed over
            trainer.strategy.checkpoint_io.wait_until_durable()
            gates.reach(self.gate_dir, "durable4", hold=True)
        if trainer.global_step == 7:  # the save of step 6 is staged, not yet written
            gates.reach(self.gate_dir, "staged6", hold=True)


def main() -> None:
    ckpt_dir, refs, gate_dir, max_steps = sys.argv[1:5]
    resume = sys.argv[5:] == ["resume"]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
    fit(ckpt_dir, int(max_steps), data, Record(refs, gate_dir, resume), resume, devices=1)


def fit(ckpt_dir: str, max_steps: int, data, record, resume: bool, **placement) -> None:
    """Train the regressor through our plugin, keeping the top two and the last checkpoint
    every two steps, as both the one-rank and the two-rank runs do (``placement``: the
    Trainer's devices and strategy)."""
    trainer = Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[CkptdCheckpointIO()],
        callbacks=[record,
                   ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=2,
                                   monitor="gstep", mode="max", save_last=True)],
        **placement)
    trainer.fit(Regressor(), DataLoader(data, batch_size=4, shuffle=True),
                ckpt_path="last" if resume else None)


if __name__ == "__main__":
    main()
