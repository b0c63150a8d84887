"""A small torchtitan-managed training run through ``CkptdCheckpointManager``.

``python torchtitan_run.py BASE REFS GATES STEPS MODE [interval=N] [resume [hold]]``: one
gloo rank, a few linear layers with torchtitan's own ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer`` (warmup + linear decay), checkpoint interval N (default 2),
``keep_latest_k=2``, ``async_mode=MODE``. The loop is torchtitan's: save after the step,
``maybe_wait_for_staging()`` before ``optimizers.step()``. Each saved step's state is also
kept plainly in REFS; with ``resume`` the run loads the newest checkpoint and records
what it restored; with ``hold`` too, it stops after its first save, once retention has
done its work, at the gate ``saved-after-resume``.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

import gates
from ckpt_client.integrations.torchtitan import CkptdCheckpointManager


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict) -> None:
        self.step = int(state_dict["step"])


def snapshot(model, optimizers, schedulers, state) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizers.state_dict(),
                          "lr": schedulers.state_dict(), "step": state.step})


def build_training(model, steps: int, mode: str, base: str, interval: int = 2) -> tuple:
    """torchtitan's optimizer and scheduler containers, the train state and our checkpoint
    manager around ``model``, as both the one-rank and the two-rank runs train it."""
    optimizers = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]).build(
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps)
    state = TrainState()
    checkpointer = CkptdCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=interval, keep_latest_k=2,
        async_mode=mode).build(dataloader=None, model_parts=[model], optimizers=optimizers,
                               lr_schedulers=schedulers, states={"train_state": state},
                               sd_adapter=None, base_folder=base)
    return optimizers, schedulers, state, checkpointer


def train_step(model, batch, checkpointer, optimizers, schedulers) -> None:
    """One step as torchtitan's trainer takes it: the staging wait comes before the update."""
    model(batch).square().mean().backward()
    checkpointer.maybe_wait_for_staging()
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()


def main() -> None:
    base, refs, gate_dir, steps, mode = sys.argv[1:6]
    flags = sys.argv[6:]
    resume = "resume" in flags
    interval = int(next((f.split("=")[1] for f in flags if f.startswith("interval=")), 2))
    dist.init_process_group("gloo", init_method=f"file://{refs}/store-{resume}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    optimizers, schedulers, state, checkpointer = build_training(model, int(steps), mode, base, interval)
    if resume:
        assert checkpointer.load(step=-1), "nothing to resume from"
        torch.save(snapshot(model, optimizers, schedulers, state), os.path.join(refs, "resumed.pt"))
    data = torch.randn(int(steps) + 1, 8, 64)
    while state.step < int(steps):
        state.step += 1
        if not resume and state.step == 7:
            checkpointer.maybe_wait_for_staging()
            gates.reach(gate_dir, "staged6", hold=True)
        train_step(model, data[state.step], checkpointer, optimizers, schedulers)
        if checkpointer.save(state.step):
            torch.save(snapshot(model, optimizers, schedulers, state),
                       os.path.join(refs, f"step-{state.step}.pt"))
            if "hold" in flags:
                checkpointer.maybe_wait_for_staging()  # the save is with the daemon
                # retention queued its deletions in save(): let the purge thread do them all
                checkpointer.purge_queue.put(None)
                checkpointer.purge_thread.join()
                gates.reach(gate_dir, "saved-after-resume", hold=True)
        if not resume and state.step == 4:
            checkpointer.maybe_wait_for_saving()
            gates.reach(gate_dir, "durable4", hold=True)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
