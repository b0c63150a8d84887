"""torchtitan's checkpoint manager on two gloo ranks with an FSDP-sharded model.

``python torchtitan_2rank_run.py BASE REFS GATES STEPS MODE [resume]``: as
:mod:`torchtitan_run`, but the process starts a second rank (:mod:`two_ranks`), and the
model is sharded with FSDP2 (``fully_shard`` on a CPU device mesh), so each rank's DCP
save holds only its own shard of every weight and Adam moment. Each rank keeps its local
shards of every saved step in ``REFS/step-N-rankR.pt``; with ``resume`` both ranks load
the newest checkpoint and record what they restored (``resumed-rankR.pt``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import gates
import two_ranks
from torchtitan_run import build_training, snapshot, train_step


def local_shards(value):
    """This rank's part of a state: DTensors become their local shards."""
    if isinstance(value, DTensor):
        return value.to_local().clone()
    if isinstance(value, dict):
        return {k: local_shards(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_shards(v) for v in value)
    return value


def all_ranks_reach(gate_dir: str, name: str) -> None:
    """Every rank got here (a barrier); rank 0 then waits at the test's gate."""
    dist.barrier()
    if dist.get_rank() == 0:
        gates.reach(gate_dir, name, hold=True)


def main() -> None:
    rank, second = two_ranks.start_second_rank()
    base, refs, gate_dir, steps, mode = sys.argv[1:6]
    resume = sys.argv[6:] == ["resume"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers, schedulers, state, checkpointer = build_training(model, int(steps), mode, base)

    def record(name: str) -> None:
        torch.save(local_shards(snapshot(model, optimizers, schedulers, state)),
                   os.path.join(refs, f"{name}-rank{rank}.pt"))

    if resume:
        assert checkpointer.load(step=-1), "nothing to resume from"
        record("resumed")
    data = torch.randn(int(steps) + 1, dist.get_world_size(), 8, 64)
    while state.step < int(steps):
        state.step += 1
        if not resume and state.step == 7:  # both ranks' save of step 6 staged
            checkpointer.maybe_wait_for_staging()
            all_ranks_reach(gate_dir, "staged6")
        train_step(model, data[state.step, rank], checkpointer, optimizers, schedulers)
        if checkpointer.save(state.step):
            record(f"step-{state.step}")
        if not resume and state.step == 4:  # both ranks' saves of steps 2 and 4 durable
            checkpointer.maybe_wait_for_saving()
            all_ranks_reach(gate_dir, "durable4")
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    dist.destroy_process_group()
    two_ranks.join_second_rank(second)


if __name__ == "__main__":
    main()
