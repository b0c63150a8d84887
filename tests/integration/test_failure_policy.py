"""``failure_policy``: a save that fails on one rank (a real ENOSPC: a 1 MiB tmpfs), then
three that succeed, on two gloo ranks, with ``"raise"`` and with ``"warn"``.

``"raise"``: the failure raises ``CheckpointException`` on both ranks naming rank 1, and
the next saves still work. ``"warn"``: nothing raises; both ranks log it and keep it in
``failed_calls``; the failed call's finalize functions never run and nothing of it stays
on disk, not even the healthy rank's file; ``maybe_finalize_async_calls`` returns only the
indices that finalized.
"""

from __future__ import annotations

import logging
import os

import pytest

from faults import small_tmpfs
from multirank import run_ranks, values

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def fail_once_then_succeed(rank, world_size, ok_root, full_root, policy):
    import torch

    from ckpt_client import AsyncCallsQueue, CheckpointException, async_torch_save

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ckpt_client").addHandler(handler)
    queue = AsyncCallsQueue(failure_policy=policy)
    finalized, raised, ran = [], None, []
    for step in range(4):
        # step 0: 4 MiB into rank 1's 1 MiB tmpfs fails (ENOSPC) on rank 1 only
        root = full_root if step == 0 and rank == 1 else ok_root
        request = async_torch_save({"w": torch.full((1 << 20,), float(step))},
                                   os.path.join(root, f"rank{rank}_step{step}.pt"))
        request.add_finalize_fn(lambda step=step: ran.append(step))
        queue.schedule_async_request(request)
        try:
            finalized += queue.maybe_finalize_async_calls(blocking=True)
        except CheckpointException as exc:
            raised = (step, exc.failing_ranks, str(exc))
    failed = [(idx, exc.failing_ranks) for idx, exc in queue.failed_calls]
    logged = [r.getMessage() for r in records if r.levelno >= logging.ERROR
              and "failure_policy='warn'" in r.getMessage()]
    return finalized, raised, failed, ran, logged


@needs_root
@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_a_save_failing_on_one_rank_then_three_that_succeed(daemon, tmp_path, policy):
    ok_root = os.path.join(daemon.roots[0], "ok")
    os.makedirs(ok_root)
    with small_tmpfs(os.path.join(daemon.roots[0], "full"), "1m") as full_root:
        outcomes = values(run_ranks(fail_once_then_succeed, 2, daemon.socket, tmp_path,
                                    args=(ok_root, full_root, policy)))
    for rank, (finalized, raised, failed, ran, logged) in enumerate(outcomes):
        assert ran == [1, 2, 3], "the failed call's finalize functions must not run"
        if policy == "raise":
            step, failing, text = raised
            assert step == 0 and failing == [1] and "No space left" in text, raised
            assert finalized == [1, 2, 3] and failed == [] and logged == []
        else:
            assert raised is None
            assert finalized == [1, 2, 3], "only the calls that finalized successfully"
            assert failed == [(0, [1])]
            assert len(logged) == 1 and "rank 1" in logged[0] and "No space left" in logged[0]
    assert sorted(os.listdir(ok_root)) == [f"rank{r}_step{s}.pt{x}" for r in (0, 1)
                                           for s in (1, 2, 3) for x in ("", ".ckptd-sum")], \
        "nothing of the failed save stays, not even the healthy rank's file"
