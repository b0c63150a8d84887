"""The daemon refuses a save that found no staging space within ``CKPTD_STAGE_TIMEOUT``.

A real daemon with a small pool; one save holds the pool (its writer SIGSTOPped, so its
staged bytes stay leased); a second save's STAGE waits for space and is refused once the
daemon's staging-space deadline passes. The trainer hears it from the daemon (its own
wait is longer), with the knob, the bytes and what to do (a larger ``--pool-size`` or
fewer saves); the save holding the pool still commits once its writer resumes, and a
save after that succeeds.
"""

from __future__ import annotations

import os

import torch

from conftest import wait_for
from faults import writers_paused
from ckpt_client import CheckpointException, DaemonRequestError, TorchAsyncCheckpoint

MIB_OF_FLOATS = 1 << 18  # float32 elements in one MiB


def test_a_save_with_no_staging_space_is_refused_after_the_stage_timeout(start_daemon):
    daemon = start_daemon(pool_size="8M", writers=1, env={"CKPTD_STAGE_TIMEOUT": "2"})
    root = daemon.roots[0]
    holder, refused = (TorchAsyncCheckpoint(socket=daemon.socket) for _ in range(2))
    a_path, b_path = os.path.join(root, "a.pt"), os.path.join(root, "b.pt")
    try:
        with writers_paused(daemon):
            holder.async_save({"w": torch.ones(6 * MIB_OF_FLOATS)}, a_path)
            wait_for(lambda: any(r["path"] == a_path and r["phase"] == "writing"
                                 for r in daemon.status()["requests"]), 60,
                     "save A to hold the pool while it is written")
            error = None
            try:
                refused.async_save({"w": torch.full((6 * MIB_OF_FLOATS,), 2.0)}, b_path)
                refused.finalize_async_save(blocking=True)
            except (CheckpointException, DaemonRequestError) as exc:
                error = exc
            assert error is not None, "a save with no staging space was not refused"
            message = str(error)
            assert "no staging space within 2s (CKPTD_STAGE_TIMEOUT)" in message, message
            assert "rank 0" in message and f"{6 << 20} bytes" in message, message
            assert "--pool-size" in message and "save again" in message, message
            assert not os.path.exists(b_path)
        holder.finalize_async_save(blocking=True)
        refused.async_save({"w": torch.full((6 * MIB_OF_FLOATS,), 3.0)}, b_path)
        refused.finalize_async_save(blocking=True)
    finally:
        holder.close()
        refused.close()
    assert torch.load(a_path, weights_only=True)["w"][0] == 1.0
    assert torch.load(b_path, weights_only=True)["w"][0] == 3.0
