"""The reference's AsyncRequest / AsyncCallsQueue contract, as code written for it uses it.

Hand-built requests with Python ``async_fn`` (run in helper processes of the trainer),
the reference's queue keywords, ``execute_sync`` on real gloo ranks, aborting every
queue at once, and ``CheckpointException`` being torch's.
"""

import logging
import multiprocessing
import os
import signal

import pytest
import torch.distributed.checkpoint as torch_dcp

from ckpt_client import (AsyncCallsQueue, AsyncRequest, CheckpointException,
                         abort_async_checkpoints, abort_nvrx_checkpoint)
from conftest import wait_for
from multirank import run_ranks, values

#: Hand-built requests need no daemon; the ranks get a socket nobody listens on.
NO_DAEMON = "/nonexistent/ckptd.sock"


def record(path, value):
    with open(path, "w") as f:
        f.write(repr(value))


def record_helper_settings(path, _unused):
    record(path, (multiprocessing.current_process().daemon, os.nice(0)))


def write_what_preload_made(path, staged, suffix=""):
    record(path, f"{staged}{suffix}")


def fail_with_enospc(*_):
    raise OSError(28, "No space left on device", "/ckpt/part")


def wait_for_sigterm(ready_path, marker_path):
    def on_sigterm(signum, frame):
        record(marker_path, "got SIGTERM")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    record(ready_path, "handler installed")
    while True:
        signal.pause()


def test_preload_result_replaces_the_second_argument(tmp_path):
    sync_out, queued_out = tmp_path / "sync", tmp_path / "queued"
    AsyncRequest(write_what_preload_made, [str(sync_out), "placeholder"],
                 preload_fn=lambda: "preloaded", async_fn_kwargs={"suffix": "!"}).execute_sync()
    assert sync_out.read_text() == repr("preloaded!")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(write_what_preload_made, (str(queued_out), None),
                                              [], preload_fn=lambda: "staged"))
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    assert queued_out.read_text() == repr("staged")


def test_preload_without_a_second_argument_is_a_clear_error(tmp_path):
    request = AsyncRequest(record, (str(tmp_path / "x"),), preload_fn=lambda: 1)
    with pytest.raises(ValueError, match=r"async_fn_args\[1\]"):
        request.execute_sync()


@pytest.mark.parametrize("is_daemon", [True, False])
def test_reference_keywords_set_how_helper_processes_run(tmp_path, is_daemon):
    out = tmp_path / "settings"
    queue = AsyncCallsQueue(persistent=True, is_daemon=is_daemon, cpu_priority=7,
                            io_priority=None, sigterm_timeout=5.0, cpu_shm_mode=False)
    queue.schedule_async_request(AsyncRequest(record_helper_settings, (str(out), None), []))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    daemonic, nice = eval(out.read_text())
    assert daemonic is is_daemon
    assert nice == max(7, os.nice(0))  # raised to cpu_priority, never lowered


def test_keywords_without_meaning_for_the_daemon_are_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="ckpt_client.queue.calls_queue"):
        AsyncCallsQueue(io_priority=3, cpu_shm_mode=True)
        AsyncCallsQueue(io_priority=2, cpu_shm_mode=True)
    io_lines = [r for r in caplog.records if "io_priority" in r.getMessage()]
    shm_lines = [r for r in caplog.records if "cpu_shm_mode" in r.getMessage()]
    assert len(io_lines) <= 1 and len(shm_lines) <= 1  # once per process (maybe logged earlier)
    for line in io_lines + shm_lines:
        assert "has no effect" in line.getMessage()


def test_abort_sends_sigterm_first_so_the_helper_can_clean_up(tmp_path):
    ready, marker = tmp_path / "ready", tmp_path / "terminated"
    queue = AsyncCallsQueue(sigterm_timeout=30.0)
    queue.schedule_async_request(AsyncRequest(wait_for_sigterm, (str(ready), str(marker)), []))
    wait_for(ready.exists, 60, "the helper to install its SIGTERM handler")
    queue.close(abort=True)
    assert marker.read_text() == repr("got SIGTERM")


def test_abort_nvrx_checkpoint_drops_every_queues_calls_and_they_stay_usable(tmp_path):
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    assert abort_nvrx_checkpoint is abort_async_checkpoints
    queues = [AsyncCallsQueue(), AsyncCallsQueue(persistent=False)]
    for queue in queues:
        queue.schedule_async_request(AsyncRequest(_block_on_fifo, (str(fifo), None), []))
        assert queue.maybe_finalize_async_calls(no_dist=True) == []
    abort_nvrx_checkpoint()
    for queue in queues:
        assert queue.get_num_unfinalized_calls() == 0
        out = tmp_path / f"after-{id(queue)}"
        queue.schedule_async_request(AsyncRequest(record, (str(out), "ok"), []))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert out.read_text() == repr("ok")


def _block_on_fifo(path, _unused):
    os.read(os.open(path, os.O_RDONLY), 1)


def test_checkpoint_exception_is_torchs_and_an_exception():
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(fail_with_enospc, (), []))
    with pytest.raises(torch_dcp.CheckpointException) as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert isinstance(info.value, CheckpointException) and isinstance(info.value, Exception)
    assert info.value.failing_ranks == [0]
    assert "No space left on device" in info.value.failures[0]


# ---------------------------------------------------------------- execute_sync on real ranks

def execute_sync_waits_for_every_rank(rank, world_size, directory):
    """Rank 1's async part only finishes after rank 0's started (a store key), and rank
    0's finalize checks that rank 1's async part is done: only a wait for every rank
    before the finalize functions makes that hold."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    marker = os.path.join(directory, "rank1-async-done")

    def async_part(_, __):
        if rank == 0:
            store.set("rank0-started", "1")
        else:
            store.wait(["rank0-started"])
            record(marker, "done")

    seen = []
    AsyncRequest(async_part, [None, None], [lambda: seen.append(os.path.exists(marker))],
                 preload_fn=lambda: "staged").execute_sync()
    dist.barrier()
    return seen


def execute_sync_shares_a_failure(rank, world_size):
    def async_part(_, __):
        if rank == 1:
            raise OSError(5, "Input/output error", "/ckpt/__1_0.distcp")

    finalized = []
    try:
        AsyncRequest(async_part, [None, None], [lambda: finalized.append(1)]).execute_sync()
    except torch_dcp.CheckpointException as exc:
        return exc.failing_ranks, exc.failures[1], finalized
    return None


def test_execute_sync_waits_for_all_ranks_before_finalizing(tmp_path):
    outcomes = values(run_ranks(execute_sync_waits_for_every_rank, 2, NO_DAEMON, tmp_path,
                                args=(str(tmp_path),)))
    assert outcomes == [[True], [True]]


def test_execute_sync_failure_on_one_rank_raises_on_every_rank(tmp_path):
    outcomes = values(run_ranks(execute_sync_shares_a_failure, 2, NO_DAEMON, tmp_path))
    for failing_ranks, reason, finalized in outcomes:
        assert failing_ranks == [1] and "Input/output error" in reason and finalized == []
