"""Lightning DDP on two gloo ranks through ``CkptdCheckpointIO`` (driven by test_lightning_2rank).

``python lightning_2rank_run.py CKPT_DIR REFS_DIR GATE_DIR MAX_STEPS [resume]``: the model
and checkpointing of :mod:`lightning_run`, with ``Trainer(strategy="ddp",
accelerator="cpu", devices=2)``: Lightning starts rank 1 by running this script again,
and calls the plugin on rank 0 only. Rank 0 keeps each checkpoint it hands to the plugin
in ``REFS/step-N-rank0.pt``; with ``resume`` every rank records what ``ckpt_path="last"``
restored (``resumed-rankR.pt``).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import TensorDataset

import gates
import two_ranks
from lightning_run import Record, fit


class RecordEachRank(Record):
    """:class:`lightning_run.Record` on two ranks: references and gates of rank 0, what
    each rank restored under its own name."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank == 0:  # the rank whose dict Lightning hands to the plugin
            super().on_save_checkpoint(trainer, pl_module, checkpoint)
            step = checkpoint["global_step"]
            os.replace(os.path.join(self.refs, f"step-{step}.pt"),
                       os.path.join(self.refs, f"step-{step}-rank0.pt"))

    def on_train_start(self, trainer, pl_module) -> None:
        if self.resume:  # each rank writes in a directory of its own, then names the file
            refs, self.refs = self.refs, os.path.join(self.refs, f"rank{trainer.global_rank}")
            os.makedirs(self.refs, exist_ok=True)
            try:
                super().on_train_start(trainer, pl_module)
            finally:
                self.refs, own = refs, self.refs
            os.replace(os.path.join(own, "resumed.pt"),
                       os.path.join(refs, f"resumed-rank{trainer.global_rank}.pt"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # rank 1 goes on into the step and waits in DDP's gradient all-reduce
        if trainer.global_rank == 0:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def main() -> None:
    two_ranks.lead_process_group()
    ckpt_dir, refs, gate_dir, max_steps = sys.argv[1:5]
    resume = sys.argv[5:] == ["resume"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 32), torch.randn(128, 1))  # one epoch: 16 steps
    fit(ckpt_dir, int(max_steps), data, RecordEachRank(refs, gate_dir, resume), resume,
        devices=2, strategy="ddp")


if __name__ == "__main__":
    main()
