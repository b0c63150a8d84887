"""A one-way mailbox between two threads of the daemon, that a ZeroMQ poller can wait on.

The serve loop waits in ``zmq.Poller``; worker threads (the CUDA stagers, the replicator)
wait in theirs. A :class:`Mailbox` carries Python objects (typed message dataclasses) from
one producer thread to one consumer thread through a ``queue.Queue``, and rings an inproc
PAIR socket so that the consumer's poller wakes up. Nothing is serialized: both ends live
in one process.

Pattern: a queue plus a doorbell socket. Exactly one thread may :meth:`post` (ZeroMQ
sockets are not thread-safe); exactly one thread polls :attr:`doorbell` and calls
:meth:`drain`.
"""

from __future__ import annotations

import itertools
import queue
from typing import Any, Callable

import zmq

_names = itertools.count()


class Mailbox:
    """Objects from one thread to another, with a socket the receiver can poll.

    Parameters
    ----------
    context : zmq.Context
        Context both threads use (inproc endpoints live in one context).
    name : str
        For the inproc endpoint's name (debugging).
    """

    def __init__(self, context: zmq.Context, name: str) -> None:
        endpoint = f"inproc://ckptd-mailbox-{name}-{next(_names)}"
        self._items: queue.Queue = queue.Queue()
        #: The receiving side: register it with the consumer's poller.
        self.doorbell = context.socket(zmq.PAIR)
        self.doorbell.linger = 0
        self.doorbell.bind(endpoint)
        self._bell = context.socket(zmq.PAIR)
        self._bell.linger = 0
        self._bell.connect(endpoint)

    def post(self, item: Any) -> None:
        """Queue ``item`` and wake the receiver (producer thread only)."""
        self._items.put(item)
        try:
            self._bell.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:  # the receiver has unread rings queued already: it will wake
            pass

    def drain(self, handle: Callable[[Any], None]) -> None:
        """Hand every queued item to ``handle`` in order (receiver thread only)."""
        while self.doorbell.poll(0):
            self.doorbell.recv()
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return
            handle(item)

    def close(self) -> None:
        """Close both sockets (after both threads stopped using them)."""
        self.doorbell.close(linger=0)
        self._bell.close(linger=0)
