"""The first DCP save of a job writes a replicated model once, not once per rank.

``dcp.async_save`` starts copying a rank's items into the daemon's pool from the local
plan, while the global plan is still being agreed. Deduplication then gives each
replicated item to one rank, so the early copies of the other ranks are dropped. They
must be dropped before a writer sees them: the daemon starts writing a request when it
is told the request is staged, so a dropped early request must never have been staged.
"""

import os
import time

import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from ckpt_client import AsyncCallsQueue, dcp
from conftest import wait_for
from multirank import run_ranks, values

LAYERS = 4


def replicated_model() -> dict:
    """What every rank of a data-parallel job holds alike (2 MiB a layer)."""
    return {**{f"layer{i}.weight": torch.full((512, 1024), float(i)) for i in range(LAYERS)},
            "step": 7}


def requests_of(socket: str, directory: str) -> list:
    from ckptd.status import query_status

    code, doc, why = query_status(socket, timeout=10)
    assert code == 0, why
    return [r for r in doc["requests"] if r["path"] == directory]


def first_save(rank, world_size, socket, directory):
    if rank == 1:
        # Rank 0 plans and stages alone first, as a rank that reaches the save early does:
        # its early copy gets as far as it ever can before the global plan (which needs
        # this rank) decides what it writes. Before the fix that is "staged and being
        # written"; since, it stays held at staging, which this wait cannot tell from a
        # slow copy, so it gives up after a few seconds and the save goes on either way.
        wait_for(lambda: requests_of(socket, directory), 60, "rank 0's early staging")
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not any(
                r["staged_at"] for r in requests_of(socket, directory)):
            time.sleep(0.02)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(replicated_model(), directory))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
              for k, v in replicated_model().items()}
    DCP.load(loaded, storage_reader=FileSystemReader(directory))
    return all(torch.equal(loaded[k], v) for k, v in replicated_model().items()
               if isinstance(v, torch.Tensor)) and loaded["step"] == 7


def test_the_first_save_of_a_replicated_model_writes_it_once(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "first")
    assert values(run_ranks(first_save, 2, daemon.socket, tmp_path,
                            args=(daemon.socket, directory))) == [True, True]
    wait_for(lambda: all(r["phase"] in ("done", "failed", "aborted")
                         for r in requests_of(daemon.socket, directory)),
             30, "every request of the save to settle")
    requests = sorted(requests_of(daemon.socket, directory), key=lambda r: r["id"])
    used = {r["rank"]: r for r in requests}  # each rank's last request is its final plan's
    dropped = [r for r in requests if r is not used[r["rank"]]]
    # Deduplication moved items on the first save: at least rank 0's early copy (it held
    # the whole model) was dropped.
    assert any(r["rank"] == 0 for r in dropped), requests
    for r in dropped:
        assert r["staged_at"] is None and r["phase"] == "aborted" and r["bytes_written"] == 0, (
            f"rank {r['rank']}'s dropped early staging reached the writers: {r}")
    assert all(r["phase"] == "done" for r in used.values()), requests
    # Each replicated layer was written by one rank: what the daemon wrote for the save,
    # and what its files hold, is the model once (plus DCP's headers and page padding).
    files = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    on_disk = sum(os.path.getsize(os.path.join(directory, n)) for n in files)
    written = sum(r["bytes_written"] for r in requests)
    model_bytes = sum(v.nbytes for v in replicated_model().values() if isinstance(v, torch.Tensor))
    assert model_bytes <= written < 1.5 * model_bytes, (written, model_bytes)
    assert model_bytes <= on_disk < 1.5 * model_bytes, (on_disk, model_bytes)
