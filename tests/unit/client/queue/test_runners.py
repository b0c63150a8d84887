"""The runner protocol: what the queue holds for each call, and which runner a request gets."""

from __future__ import annotations

import pytest

from ckpt_client import AsyncRequest
from ckpt_client.queue.runners import (DaemonRunner, HelperOptions, NoopRunner, ProcessRunner,
                                       Runner, runner_for)
from ckpt_client.transport.daemon_save import RefusedSave


def test_a_request_without_work_gets_a_runner_that_is_done():
    runner = runner_for(AsyncRequest(), HelperOptions())
    assert isinstance(runner, NoopRunner) and runner.poll() == (True, None)


def test_saves_in_the_daemon_are_asked_about_and_their_failures_reported():
    request = AsyncRequest(daemon_saves=(RefusedSave(3, "pool too small"),))
    runner = runner_for(request, HelperOptions())
    assert isinstance(runner, DaemonRunner)
    assert runner.poll() == (True, "rank 3: pool too small")
    runner.abort("test")  # nothing was staged: nothing to drop, and no error


def test_a_python_async_fn_runs_in_a_helper_process():
    runner = runner_for(AsyncRequest(async_fn=int, async_fn_args=("7",)), HelperOptions())
    try:
        assert isinstance(runner, ProcessRunner)
    finally:
        runner.abort("test over")
    assert not runner.process.is_alive()


def test_an_async_fn_that_knows_how_to_run_provides_its_runner():
    seen = []

    class StartsItself:
        def __call__(self, *args):
            raise AssertionError("not run in a helper: it starts itself")

        def start_async(self, args, kwargs, options):
            seen.append((args, kwargs, options))
            return NoopRunner()

    options = HelperOptions(daemonic=False)
    runner = runner_for(AsyncRequest(async_fn=StartsItself(), async_fn_args=(1, 2),
                                     async_fn_kwargs={"k": 3}), options)
    assert isinstance(runner, NoopRunner) and seen == [((1, 2), {"k": 3}, options)]


def test_a_runner_must_implement_the_whole_protocol():
    class Half(Runner):
        def poll(self):
            return True, None

    with pytest.raises(TypeError, match="abort"):
        Half()
