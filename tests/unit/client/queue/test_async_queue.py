"""AsyncRequest / AsyncCallsQueue with hand-built requests (no daemon, one process)."""

import os
import signal

import pytest

from ckpt_client import AsyncCallsQueue, AsyncRequest, CheckpointException


def write_marker(path, text):
    with open(path, "w") as f:
        f.write(text)


def fail_loudly():
    raise OSError(28, "No space left on device", "/ckpt/part")


def block_on(path):
    # Waits on a pipe that the test never writes: stays in flight until killed.
    os.read(os.open(path, os.O_RDONLY), 1)


def test_frozen_request_refuses_more_finalize_fns():
    request = AsyncRequest(finalize_fns=[])
    request.add_finalize_fn(lambda: None)
    frozen = request.freeze()
    assert frozen.is_frozen and len(frozen.finalize_fns) == 1
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.add_finalize_fn(lambda: None)


def test_requests_do_not_share_finalize_lists():
    first, second = AsyncRequest(), AsyncRequest()
    first.add_finalize_fn(print)
    assert second.finalize_fns == []


def test_hand_built_async_fn_runs_in_a_helper_process_then_finalizes_in_order(tmp_path):
    order = []
    queue = AsyncCallsQueue()
    for i in range(3):
        marker = tmp_path / f"m{i}"
        request = AsyncRequest(write_marker, (str(marker), f"call {i}"))
        request.add_finalize_fn(lambda i=i, marker=marker: order.append((i, marker.read_text())))
        assert queue.schedule_async_request(request) == i
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0, 1, 2]
    assert order == [(0, "call 0"), (1, "call 1"), (2, "call 2")]
    assert queue.get_num_unfinalized_calls() == 0


def test_execute_sync_does_the_same_work_in_process(tmp_path):
    marker = tmp_path / "m"
    finalized = []
    request = AsyncRequest(write_marker, (str(marker), "sync"), finalize_fns=[lambda: finalized.append(1)])
    request.execute_sync()
    assert marker.read_text() == "sync" and finalized == [1]


def test_a_failing_async_fn_raises_checkpoint_exception_with_the_reason():
    queue = AsyncCallsQueue()
    finalized = []
    queue.schedule_async_request(AsyncRequest(fail_loudly, finalize_fns=[lambda: finalized.append(1)]))
    with pytest.raises(CheckpointException, match="No space left on device") as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert info.value.failing_ranks == [0]
    assert finalized == [], "finalize functions must not run after a failure"


def test_close_with_abort_stops_the_helper_and_leaves_the_queue_usable(tmp_path):
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(block_on, (str(fifo),)))
    runner = queue._active[0].runner
    assert queue.maybe_finalize_async_calls(no_dist=True) == []
    queue.close(abort=True)
    assert not runner.process.is_alive()
    assert queue.get_num_unfinalized_calls() == 0
    queue.schedule_async_request(AsyncRequest(write_marker, (str(tmp_path / "after"), "ok")))
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [1]


@pytest.fixture
def trainer_sigterm_handler():
    """The trainer installs a Python SIGTERM handler that only records the signal, as
    Lightning and torchelastic do; the one before it is put back after the test."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_abort_right_after_start_ends_the_helper_by_sigterm_despite_the_trainers_handler(
        tmp_path, trainer_sigterm_handler):
    # The abort's SIGTERM reaches the helper while it may still carry the trainer's handler
    # (fork copies it): a helper that swallowed it would be killed only after
    # sigterm_timeout, by SIGKILL.
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    queue = AsyncCallsQueue(sigterm_timeout=30.0)
    queue.schedule_async_request(AsyncRequest(block_on, (str(fifo),)))
    helper = queue._active[0].runner.process
    queue.close(abort=True)
    assert helper.exitcode == -signal.SIGTERM
    assert trainer_sigterm_handler == [], "the trainer itself was never signalled"
