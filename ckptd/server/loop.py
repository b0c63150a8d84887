"""The serve loop: one thread waits on every socket of the daemon and runs what is ready.

Owns the poller. Components register the sockets they read (:meth:`EventLoop.watch`:
the client endpoint, each writer, the CUDA stagers' and the replicator's mailboxes),
periodic housekeeping (:meth:`EventLoop.every`), what is due at a time of its own
(:meth:`EventLoop.when_due`: a held POLL's bound, answered on time, not at the next
housekeeping tick) and what runs once a round's events are all handled (:meth:`EventLoop.after_round`: answers that must not show a step half
done). A step that raises is logged and the loop keeps serving: a bug in one handler
must not take the node's checkpoints down.

Pattern: a single-threaded reactor over ``zmq.Poller``; all daemon state is touched
from this thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

log = logging.getLogger(__name__)


class EventLoop:
    """Poll registered sockets and run periodic steps until told to stop."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._readers: dict[zmq.Socket, Callable[[], None]] = {}
        self._timers: list[list] = []  # [period_fn, next_due, step]
        self._after: list[Callable[[], None]] = []
        self._due: list[tuple] = []  # (due_fn, step)

    def watch(self, sock: zmq.Socket, on_readable: Callable[[], None]) -> None:
        """Call ``on_readable()`` whenever ``sock`` has a message."""
        self._readers[sock] = on_readable
        self._poller.register(sock, zmq.POLLIN)

    def unwatch(self, sock: zmq.Socket) -> None:
        """Stop polling ``sock`` (before it is closed)."""
        if self._readers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def every(self, period: Callable[[], float], step: Callable[[], None]) -> None:
        """Run ``step()`` every ``period()`` seconds (read each time: a knob)."""
        self._timers.append([period, time.monotonic(), step])

    def when_due(self, due: Callable[[], float | None], step: Callable[[], None]) -> None:
        """Run ``step()`` once the monotonic time ``due()`` returns has come (``None``:
        nothing is due); the loop's wait for sockets ends then, whatever the tick."""
        self._due.append((due, step))

    def after_round(self, step: Callable[[], None]) -> None:
        """Run ``step()`` after every round, once the ready sockets and due timers are
        served (it must be cheap when it has nothing to do)."""
        self._after.append(step)

    def run(self, finished: Callable[[], bool]) -> None:
        """Serve until ``finished()`` returns True (checked between rounds)."""
        while not finished():
            now = time.monotonic()
            wake = min((t[1] for t in self._timers), default=now + 1.0)
            for due, _ in self._due:
                when = _due_time(due)
                if when is not None and when < wake:
                    wake = when
            for sock, _ in self._poller.poll(max(0, int((wake - now) * 1000)) + 1):
                keep_serving(self._readers[sock])
            now = time.monotonic()
            for timer in self._timers:
                if now >= timer[1]:
                    keep_serving(timer[2])
                    timer[1] = time.monotonic() + timer[0]()
            now = time.monotonic()
            for due, step in self._due:  # on their own: a failing timer step skips none
                when = _due_time(due)
                if when is not None and now >= when:
                    keep_serving(step)
            for step in self._after:
                keep_serving(step)


def _due_time(due: Callable[[], float | None]) -> float | None:
    """When ``due`` says its step is due; a bug in it is logged and reads as not due."""
    try:
        return due()
    except Exception:
        log.exception("internal error in %s; the daemon keeps serving",
                      getattr(due, "__qualname__", due))
        return None


def keep_serving(step: Callable, *args) -> None:
    """Run one step of a loop; a bug in it is logged, and the loop goes on."""
    try:
        step(*args)
    except Exception:
        log.exception("internal error in %s; the daemon keeps serving",
                      getattr(step, "__qualname__", step))
