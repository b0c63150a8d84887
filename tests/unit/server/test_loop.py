"""The serve loop wakes for a step due at a time of its own (a held POLL's bound), not
at its next housekeeping tick, and runs it even when a housekeeping step fails."""

from __future__ import annotations

import time

from ckptd.server.loop import EventLoop


def test_a_due_step_runs_though_the_tick_is_far_off_and_its_steps_fail():
    loop = EventLoop()
    ticks, ran = [], []

    def failing_housekeeping():
        ticks.append(time.monotonic())
        raise RuntimeError("a housekeeping bug")

    loop.every(lambda: 600.0, failing_housekeeping)  # runs once now, then not in this test
    due = time.monotonic() + 0.05
    loop.when_due(lambda: None if ran else due, lambda: ran.append(time.monotonic()))
    give_up = time.monotonic() + 60  # a bound on a broken loop, not a timing check
    loop.run(lambda: bool(ran) or time.monotonic() > give_up)
    assert len(ticks) == 1 and len(ran) == 1
    assert ran[0] >= due  # never before it was due


def test_a_due_time_that_cannot_be_read_is_logged_and_the_loop_goes_on(caplog):
    loop = EventLoop()
    ran = []

    def broken_due():
        raise RuntimeError("a bug reading the due time")

    loop.when_due(broken_due, lambda: ran.append("never"))
    loop.every(lambda: 600.0, lambda: ran.append("tick"))
    loop.run(lambda: bool(ran))
    assert ran == ["tick"] and "a bug reading the due time" in caplog.text
