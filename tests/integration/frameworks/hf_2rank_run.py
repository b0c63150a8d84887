"""``CkptdTrainer`` under DDP on two gloo ranks (driven by test_hf_2rank).

``python hf_2rank_run.py OUTPUT REFS GATES MAX_STEPS [resume]``: the run of :mod:`hf_run`
with a second rank (:mod:`two_ranks` sets torchrun's environment and starts it;
``Trainer`` then trains with DistributedDataParallel on gloo). Each rank keeps, per save,
its state and its torch RNG state in ``REFS/step-N-rankR.pt`` (``Trainer`` saves every
rank's RNG in ``rng_state_R.pth``); with ``resume`` each rank records what it restored.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import two_ranks
from ckpt_client.integrations.hf import CkptdTrainer
from hf_run import Record, Tokens


class RecordEachRank(Record):
    """:class:`hf_run.Record` per rank: files named by rank, the torch RNG state beside
    the training state, and the test's gates on rank 0 only (rank 1 goes on into the
    step and waits in DDP's gradient all-reduce)."""

    def __init__(self, refs: str, gate_dir: str, resume: bool, rank: int) -> None:
        super().__init__(refs, gate_dir, resume)
        self.rank = rank

    def snapshot(self, state, model, optimizer, lr_scheduler) -> dict:
        return {**super().snapshot(state, model, optimizer, lr_scheduler),
                "rng": torch.get_rng_state()}

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self._record(f"step-{state.global_step}", state, model, optimizer, lr_scheduler)

    def on_step_begin(self, args, state, control, model=None, optimizer=None,
                      lr_scheduler=None, **kw):
        if self.resume and self.first:
            self._record("resumed", state, model, optimizer, lr_scheduler)
        elif not self.resume and self.rank == 0:
            super().on_step_begin(args, state, control, **kw)
        self.first = False

    def _record(self, name: str, state, model, optimizer, lr_scheduler) -> None:
        torch.save(self.snapshot(state, model, optimizer, lr_scheduler),
                   os.path.join(self.refs, f"{name}-rank{self.rank}.pt"))


def main() -> None:
    rank, second = two_ranks.start_second_rank()
    output, refs, gate_dir, max_steps = sys.argv[1:5]
    resume = sys.argv[5:] == ["resume"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128,
                                       n_positions=16))
    args = TrainingArguments(output_dir=output, max_steps=int(max_steps), save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=2,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2,
                             logging_steps=1000, report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo")
    assert args.world_size == 2, f"expected two ranks, Trainer sees {args.world_size}"
    record = RecordEachRank(refs, gate_dir, resume, rank)
    trainer = CkptdTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[record])
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=True if resume else None)
    # as a torchrun script ends: a live gloo group aborts the interpreter's exit
    torch.distributed.destroy_process_group()
    two_ranks.join_second_rank(second)


if __name__ == "__main__":
    main()
