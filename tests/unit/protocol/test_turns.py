"""The channel's turns: a thread's own signal handler is served, never left waiting
behind its own thread, and a wait interrupted by an exception leaves no turn stuck.

What a signal handler does is done here by calling :class:`Turns` again on the thread
that holds (or waits for) a turn, exactly as a handler run on that thread would. Each
scenario runs on a thread of its own, so a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import sys
import threading

import pytest

from conftest import wait_for
from ckptd.protocol import Turns


def finishes(scenario, *args) -> dict:
    """Run ``scenario(*args)`` on a thread; what it returned or raised, or a hang."""
    outcome: dict = {}

    def run():
        try:
            outcome["returned"] = scenario(*args)
        except BaseException as exc:  # the test reads it
            outcome["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a thread's own re-entrant request waits forever"
    return outcome


def test_a_signal_handler_of_the_thread_at_the_socket_shares_its_turn():
    turns = Turns()

    def holder_interrupted_by_its_handler():
        with turns:  # waiting between socket operations, say on a held POLL's reply
            with turns:  # the handler's call
                inner = turns.waiting
            with turns:  # a second call of the same handler
                pass
        return inner

    assert finishes(holder_interrupted_by_its_handler) == {"returned": 0}
    assert finishes(lambda: turns.__enter__() and turns.__exit__(None, None, None)) \
        == {"returned": None}, "the turn was given back"


def test_a_signal_handler_that_interrupts_a_socket_operation_is_refused_clearly():
    turns = Turns()

    def handler_during_a_send():
        with turns, turns.busy():
            with turns:
                pass

    outcome = finishes(handler_during_a_send)
    assert isinstance(outcome.get("raised"), RuntimeError), outcome
    assert "signal handler" in str(outcome["raised"]) and "flag" in str(outcome["raised"])
    assert finishes(lambda: turns.__enter__() and turns.__exit__(None, None, None)) \
        == {"returned": None}, "the refusal kept no turn"


def test_a_signal_handler_of_a_thread_waiting_for_its_turn_goes_just_ahead_of_it():
    """Thread B waits for its turn behind A (at the socket) and C's request comes after;
    B's handler asks: it is served when A gives the turn back, before B and before C."""
    turns = Turns()
    order, events = [], []
    turns.on_event = events.append
    b_queued, release, handled = threading.Event(), threading.Event(), threading.Event()

    def handler():
        with turns:
            order.append("b's handler")

    real_wait = turns._changed.wait

    def wait_then_handle(timeout=None):  # B's wait is interrupted by its signal handler
        if threading.current_thread().name == "b" and b_queued.is_set() \
                and release.is_set() and not handled.is_set():
            handled.set()
            handler()
        return real_wait(timeout)

    turns._changed.wait = wait_then_handle
    turns.__enter__()  # A

    def take(name):
        with turns:
            order.append(name)

    b = threading.Thread(target=take, args=("b",), name="b", daemon=True)
    b.start()
    wait_for(lambda: turns.waiting == 1, 10, "b queued")
    b_queued.set()
    c = threading.Thread(target=take, args=("c",), name="c", daemon=True)
    c.start()
    wait_for(lambda: turns.waiting == 2, 10, "c queued")
    release.set()
    wait_for(lambda: turns.waiting == 3, 10, "b's handler queued ahead of b")
    turns.__exit__(None, None, None)
    for thread in (b, c):
        thread.join(30)
        assert not thread.is_alive()
    assert order == ["b's handler", "b", "c"]
    assert events.count("ask") == 4 and events.count("got") == 4  # a, b, c, the handler


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


def test_a_signal_handler_using_its_threads_turn_lends_it_to_the_threads_waiting():
    """A thread holds the turn (between socket operations) when its signal handler calls
    in, and that call needs another thread to take a turn (a background stager's STAGED
    that the daemon waits for): each time the handler gives the turn back, the threads
    waiting take theirs, and the interrupted thread holds the turn again when its handler
    returns, with nobody else holding it. Queued behind its own thread for the whole
    handler, the other thread waited forever."""
    turns = Turns()
    holders, other_took = [], threading.Event()

    def other():
        with turns:
            holders.append(("other", turns._owner == threading.get_ident()))
            other_took.set()

    def holder_interrupted_by_its_handler():
        me = threading.get_ident()
        with turns:  # waiting between socket operations, say on a held POLL's reply
            helper = threading.Thread(target=other, daemon=True)
            helper.start()
            wait_for(lambda: turns.waiting == 1, 10, "the other thread in line")
            # The handler: slices at the socket until the other thread's turn came
            slices = 0
            while not other_took.is_set() and slices < 1000:
                with turns:
                    slices += 1
            # The handler returned: did the other thread get its turn meanwhile, and
            # does this thread hold the turn again?
            outcome = other_took.is_set(), turns._owner == me
        helper.join(30)
        return outcome

    assert finishes(holder_interrupted_by_its_handler) == {"returned": (True, True)}
    assert holders == [("other", True)]
    assert finishes(lambda: turns.__enter__() and turns.__exit__(None, None, None)) \
        == {"returned": None}, "the turn was given back"


def test_an_exception_landing_as_a_turn_is_given_back_leaves_it_free():
    """A KeyboardInterrupt lands in the first Python call the giving back of a turn makes
    (where a signal's exception is raised, on entering a function) while another thread
    waits: the turn is free all the same and the other thread takes it."""
    turns = Turns()
    turns.__enter__()
    got = []

    def take():
        with turns:
            got.append("other")

    other = threading.Thread(target=take, daemon=True)
    other.start()
    wait_for(lambda: turns.waiting == 1, 10, "the other thread in line")
    raised = []

    def tracer(frame, event, arg):
        if event == "call" and not raised and frame.f_back is not None \
                and frame.f_back.f_code is Turns.__exit__.__code__:
            raised.append(frame.f_code.co_name)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            turns.__exit__(None, None, None)
    finally:
        sys.settrace(None)
    other.join(30)
    assert raised, "giving the turn back made no Python call for the exception to land in"
    assert got == ["other"], "the turn stayed with nobody"
