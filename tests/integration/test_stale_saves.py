"""A stale save caught: a rank saving the very bytes of its previous save to a new path.

The daemon compares each successful save's file checksums with the same rank's previous
save; a repeat at a new path is reported on the rank (a warning), in ``ckptd status``
(``requests[].stale_of``, ``totals.stale_saves``) and in the metrics.
"""

from __future__ import annotations

import logging
import os

import torch

from ckpt_client import AsyncCallsQueue, TorchAsyncCheckpoint, dcp
from ckptd.metrics import SaveStats, render


def test_a_save_repeating_the_previous_ones_bytes_is_reported(daemon, monkeypatch, caplog):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root = daemon.roots[0]
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    checkpoint = TorchAsyncCheckpoint()
    with caplog.at_level(logging.WARNING, logger="ckpt_client"):
        for name in ("step_1.pt", "step_2.pt"):  # the step moved on, the tensors did not
            checkpoint.async_save(weights, os.path.join(root, name))
            checkpoint.finalize_async_save(blocking=True)
    warnings = [r.getMessage() for r in caplog.records if "very bytes" in r.getMessage()]
    assert len(warnings) == 1 and "step_2.pt" in warnings[0] and "step_1.pt" in warnings[0]
    weights["w"] += 1  # trained: not stale
    checkpoint.async_save(weights, os.path.join(root, "step_3.pt"))
    checkpoint.finalize_async_save(blocking=True)
    checkpoint.async_save(weights, os.path.join(root, "step_3.pt"))  # saved again in place
    checkpoint.finalize_async_save(blocking=True)

    # DCP: the same check over every file of the rank's save
    queue = AsyncCallsQueue()
    for step in (4, 5):
        queue.schedule_async_request(dcp.async_save({"w": weights["w"]},
                                                    os.path.join(root, f"dcp_{step}")))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

    doc = daemon.status()
    stale = {os.path.basename(r["path"]): r["stale_of"] for r in doc["requests"]}
    assert stale == {"step_1.pt": None, "step_2.pt": os.path.join(root, "step_1.pt"),
                     "step_3.pt": None, "dcp_4": None, "dcp_5": os.path.join(root, "dcp_4")}
    assert doc["totals"]["stale_saves"] == 2
    assert render(doc, SaveStats()).count("ckptd_stale_saves_total 2") == 1
    assert "has the very bytes of the previous save" in daemon.log()
