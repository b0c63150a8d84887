"""The request channel: a client's DEALER socket that matches replies to requests.

Owns sending a request with a fresh id and waiting for the reply that carries it, from
several threads at once, and telling its owner of every reply it reads (``on_reply``,
late ones nobody waits for included; :meth:`Channel.collect` reads those waiting). Used
by the trainer library and by ``ckptd status``. It must not interpret bodies beyond
turning an error reply into :class:`ErrorReply`; zmq is imported when a channel is made,
so importing this module stays cheap.

Pattern: one socket, used by one thread at a time (ZeroMQ's rule), lent in turns
(:class:`Turns`, first come, first served) for short slices, so a thread that waits a
long time for its reply (a POLL the daemon holds until a save changes phase) never keeps
another thread's request or reply waiting for more than one slice.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from ckptd.protocol.errors import ErrorReply, ReplyTimeout
from ckptd.protocol.framing import Message, decode, encode
from ckptd.protocol.names import MessageType

__all__ = ["Channel", "Turns"]

#: Longest a thread keeps the socket while it waits for a reply: another thread that
#: wants it (to send, or to read its own reply) waits at most this long.
SLICE_SECONDS = 0.01


class Turns:
    """A lock that hands itself out in the order it was asked for (a FIFO ticket lock).

    ``threading.Lock`` is not fair: a thread that releases it and asks again at once
    (a waiter taking its next slice at the socket) gets it back before a blocked thread
    has even woken, and can keep it for as long as its own wait lasts. Here a thread
    that asks again queues behind every thread already waiting. Not reentrant.

    An exception that interrupts a wait for a turn (KeyboardInterrupt, a launcher's
    signal exception) takes the thread's place out of the line and passes on any turn it
    took; waiters recheck at short intervals, so a wake-up lost to one is never waited for.

    Parameters
    ----------
    on_event : callable, optional
        Called with ``"ask"`` when a thread gets in line and ``"got"`` when it takes the
        turn, under the lock, so the order seen is the order served (tests record it).
    """

    #: Seconds between two looks at the line by a thread waiting for its turn.
    RECHECK_SECONDS = 0.1

    def __init__(self, on_event: Callable[[str], None] | None = None) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._queue: deque = deque()  # one (token, thread) per request waiting, in order
        self._owner: int | None = None  # the thread holding the turn
        self.on_event = on_event

    def __enter__(self) -> "Turns":
        me = threading.get_ident()
        with self._changed:
            token = (object(), me)
            self._queue.append(token)
            if self.on_event is not None:
                self.on_event("ask")
            try:
                while self._owner is not None or self._queue[0] is not token:
                    self._changed.wait(self.RECHECK_SECONDS)
                self._owner = me
                self._queue.remove(token)
                if self.on_event is not None:
                    self.on_event("got")
            except BaseException:  # interrupted: nobody must wait on a place or turn left
                if token in self._queue:
                    self._queue.remove(token)
                if self._owner == me:
                    self._owner = None
                self._changed.notify_all()
                raise
        return self

    def __exit__(self, *exc_info) -> None:
        with self._changed:
            self._owner = None
            if self._queue:
                self._changed.notify_all()  # the head of the queue goes next

    @property
    def waiting(self) -> int:
        """How many requests wait for their turn."""
        return len(self._queue)


class Channel:
    """A DEALER socket that sends requests and waits for the matching reply.

    Used by the trainer library and by ``ckptd status``: the one place that matches
    replies to requests. Safe to use from several threads at once (a trainer's main
    thread polls while a background thread stages a zero-stall save): the socket is
    lent in turns (:class:`Turns`), one slice at a time, and a reply that arrives for
    another waiting thread is kept for it.
    Replies to requests nobody waits for any more (they timed out) are discarded, but
    :attr:`on_reply` still hears of them: a late answer says the peer answers again.

    Parameters
    ----------
    endpoint : str
        ZeroMQ endpoint of the daemon.
    context : zmq.Context, optional
        Context to create the socket in (default: the process-wide instance).
    """

    def __init__(self, endpoint: str, context=None) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(endpoint)
        self._next_id = 1
        self._lock = Turns()
        self._awaited: set[int] = set()       # ids some thread still waits for
        self._arrived: dict[int, Message] = {}  # their replies, when another thread read them
        #: Called with the id of every reply read off the socket, kept or discarded (during
        #: the caller's turn at the socket: it must not call the channel).
        self.on_reply: Callable[[int], None] | None = None

    def send(self, msg_type: str, body: dict | None = None, frames=()) -> int:
        """Send a request without waiting; returns its id."""
        with self._lock:
            msg_id = self._next_id
            self._next_id += 1
            self._awaited.add(msg_id)
            self.socket.send_multipart(encode(msg_type, msg_id, body, frames), copy=False)
        return msg_id

    def wait(self, msg_id: int, timeout: float, still_worth_waiting=None,
             slice_seconds: float = 0.1) -> Message:
        """Wait for the reply to ``msg_id``.

        Parameters
        ----------
        timeout : float
            Seconds before :class:`ReplyTimeout`.
        still_worth_waiting : callable, optional
            Called between slices; raise from it to stop waiting (e.g. the daemon died).

        Raises
        ------
        ReplyTimeout, ErrorReply, ProtocolError
        """
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReplyTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s")
                reply = self._receive(msg_id, min(remaining, slice_seconds))
                if reply is not None:
                    if reply.type == MessageType.ERROR:
                        raise ErrorReply(reply.body)
                    return reply
                if still_worth_waiting is not None:
                    still_worth_waiting()
        finally:
            with self._lock:
                self._awaited.discard(msg_id)
                self._arrived.pop(msg_id, None)

    def _receive(self, msg_id: int, seconds: float) -> Message | None:
        """One slice of waiting: ``msg_id``'s reply if it came, else ``None``."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                if msg_id in self._arrived:
                    return self._arrived.pop(msg_id)
                # Short polls during one turn at the socket, so other threads get theirs
                # (to send, or to read the replies it delivers for them) between slices.
                left = deadline - time.monotonic()
                if self.socket.poll(max(1, int(min(left, SLICE_SECONDS) * 1000))):
                    reply = self._read()
                    if reply.id == msg_id:
                        return reply
                    self._keep(reply)  # its waiter reads it in its own turn
                    continue
            if time.monotonic() >= deadline:
                return None

    def _read(self) -> Message:
        """One reply off the socket (the caller holds the lock and saw it waiting)."""
        reply = decode(self.socket.recv_multipart())
        if self.on_reply is not None:
            self.on_reply(reply.id)
        return reply

    def _keep(self, reply: Message) -> None:
        """Keep a reply for the thread that waits for it; a late answer to a request
        nobody waits for any more is dropped."""
        if reply.id in self._awaited:
            self._arrived[reply.id] = reply

    def collect(self) -> None:
        """Read the replies already waiting on the socket, without blocking: each is kept
        for its waiter or dropped, and :attr:`on_reply` hears of it (when nobody waits
        on the socket, a late answer would otherwise stay unread).

        Raises
        ------
        ProtocolError
            If a reply cannot be decoded.
        """
        with self._lock:
            while self.socket.poll(0):
                self._keep(self._read())

    def drop(self, msg_id: int) -> None:
        """Stop keeping the reply to ``msg_id`` (nobody will read it): discarded on arrival."""
        with self._lock:
            self._awaited.discard(msg_id)
            self._arrived.pop(msg_id, None)

    def call(self, msg_type: str, body: dict | None = None, frames=(), timeout: float = 30.0,
             still_worth_waiting=None) -> Message:
        """Send a request and wait for its reply (see :meth:`wait`)."""
        return self.wait(self.send(msg_type, body, frames), timeout, still_worth_waiting)

    def close(self) -> None:
        """Close the socket (in turn: no other thread is using it then)."""
        with self._lock:
            self.socket.close(linger=0)
