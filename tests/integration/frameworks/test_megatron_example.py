"""The Megatron ``--async-save`` example of docs/integrations.md, run exactly as written.

The test takes the documented code block out of the page (so the docs cannot drift from
what is tested), runs its ``train`` on two real gloo ranks with a real daemon, and loads
every checkpoint it wrote with stock ``torch.distributed.checkpoint.load``: it must hold
the model as it was at that iteration, bit for bit.
"""

from __future__ import annotations

import os
import re

import torch

from frameworks_common import assert_same
from multirank import run_ranks, values

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "integrations.md")
MARKER = "# megatron --async-save, with ckptd"


def documented_example() -> str:
    with open(DOC) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    [block] = [b for b in blocks if b.startswith(MARKER)]
    return block


def _run_documented_training(rank, world_size, save_dir):
    import torch.distributed.checkpoint as DCP
    from torch.distributed.checkpoint import FileSystemReader

    namespace: dict = {}
    exec(documented_example(), namespace)  # the docs' code, unchanged
    torch.manual_seed(0)  # replicated model, as under data parallelism
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.randn(7, 4, 32)
    snapshots = {}

    original_step = optimizer.step

    def step_and_remember(*args, **kwargs):
        result = original_step(*args, **kwargs)
        iteration = len(snapshots) + 1
        snapshots[iteration] = {k: v.clone() for k, v in model.state_dict().items()}
        return result

    optimizer.step = step_and_remember  # records the state each iteration saves
    namespace["train"](model, optimizer, 6, 2, save_dir, batches)
    ok = {}
    for iteration in (2, 4, 6):
        loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        DCP.load(loaded, storage_reader=FileSystemReader(f"{save_dir}/iter_{iteration:07d}"))
        assert_same(loaded["model"], snapshots[iteration], f"iteration {iteration}")
        ok[iteration] = True
    return ok


def test_documented_megatron_async_save_runs_and_loads(daemon, tmp_path):
    assert "schedule_async_request" in documented_example()
    save_dir = os.path.join(daemon.roots[0], "megatron")
    outcomes = values(run_ranks(_run_documented_training, 2, daemon.socket, tmp_path,
                                args=(save_dir,), daemon=False))
    assert outcomes == [{2: True, 4: True, 6: True}] * 2
