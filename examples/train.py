"""A small CPU training job that checkpoints through ckptd and resumes from the latest save.

Run with torchrun (two ranks, gloo)::

    torchrun --nproc-per-node 2 examples/train.py --ckpt-dir /tmp/ckptd-demo --steps 20

Every ``--save-every`` steps it calls ``ckpt_client.dcp.async_save`` (blocking only while
the daemon stages the tensors) and keeps training; finished saves are finalized with
``AsyncCallsQueue.maybe_finalize_async_calls`` at the top of each step. Started again
with a larger ``--steps``, it loads the newest complete checkpoint (one whose
``.metadata`` was committed) with stock ``torch.distributed.checkpoint.load`` and goes on.
Uses ``CKPTD_SOCKET`` when set (e.g. by the SLURM prolog); otherwise the client starts a
daemon for this node by itself.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckpt_client import AsyncCallsQueue, connect, dcp

STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest ``step_N`` directory whose ``.metadata`` was committed."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = STEP_DIR.match(name)
        if match and os.path.exists(os.path.join(root, name, ".metadata")):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return max(found) if found else None


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    connect()  # find (or start) this node's daemon before training, not during the first save
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt_dir = os.path.abspath(args.ckpt_dir)
    os.makedirs(ckpt_dir, exist_ok=True)

    start = 0
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        DCP.load(state, storage_reader=FileSystemReader(latest[1]))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start} ({latest[1]})", flush=True)
    elif rank == 0:
        print("no checkpoint found: starting from scratch", flush=True)

    queue = AsyncCallsQueue()
    for step in range(start + 1, args.steps + 1):
        for index in queue.maybe_finalize_async_calls(blocking=False):
            if rank == 0:
                print(f"  checkpoint call {index} finalized", flush=True)
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel by hand: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        if step % args.save_every == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            started = time.perf_counter()
            request = dcp.async_save({"model": model_sd, "optim": optim_sd, "step": step},
                                     os.path.join(ckpt_dir, f"step_{step:06d}"), enable_cache=True)
            queue.schedule_async_request(request)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, saved (blocked "
                      f"{(time.perf_counter() - started) * 1000:.1f} ms)", flush=True)
    queue.maybe_finalize_async_calls(blocking=True)
    if rank == 0:
        print(f"done at step {args.steps}; latest checkpoint: {latest_checkpoint(ckpt_dir)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
