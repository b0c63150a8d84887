"""The channel's turns: a wait interrupted by an exception leaves no turn stuck.
"""

from __future__ import annotations

import sys
import threading

from conftest import wait_for
from ckptd.protocol import Turns


def test_an_exception_right_after_a_thread_took_its_turn_passes_the_turn_on():
    """A KeyboardInterrupt lands in thread A just after it left the line to take its
    turn, while B, woken by the same release, already looked and went back to waiting:
    the turn goes on to B instead of staying with nobody."""
    turns = Turns()
    turns.__enter__()  # the main thread holds it while A and B get in line
    got, queued = [], []

    def take(name):
        with turns:
            got.append(name)

    def tracer(frame, event, arg):
        if event != "line":
            return tracer
        if frame.f_code is threading.Condition.wait.__code__ and frame.f_locals.get("gotit") \
                and not queued:
            # A was woken by the release; before it looks, B looks and waits again
            wait_for(lambda: len(turns._changed._waiters) == 1, 10, "b waiting again")
            queued.append("b looked first")
        token = frame.f_locals.get("token") if frame.f_code is Turns.__enter__.__code__ \
            else None
        if token is not None and token not in turns._queue and queued and not got:
            got.append("interrupted")  # A left the line: the exception lands now
            raise KeyboardInterrupt
        return tracer

    def a():
        sys.settrace(lambda frame, event, arg: tracer)
        try:
            take("a")
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)

    first = threading.Thread(target=a, daemon=True)
    first.start()
    wait_for(lambda: turns.waiting == 1, 10, "a queued")
    second = threading.Thread(target=take, args=("b",), daemon=True)
    second.start()
    wait_for(lambda: turns.waiting == 2, 10, "b queued")
    turns.__exit__(None, None, None)
    first.join(30)
    second.join(30)
    assert not second.is_alive(), "b waits forever for a turn nobody holds"
    assert got == ["interrupted", "b"]
