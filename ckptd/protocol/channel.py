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
another thread's request or reply waiting for more than one slice. A signal handler that
calls the daemon while its own thread waits on it (a launcher's "save now" signal during
a blocking finalize) uses that thread's turn between socket operations instead of
queueing behind it, and lends it to the threads waiting each time it gives it back
(:class:`Turns`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Callable

from ckptd.protocol.errors import ErrorReply, ProtocolError, ReplyTimeout
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
    that asks again queues behind every thread already waiting.

    A signal handler runs on a thread that may already hold a turn or wait for one (a
    blocking finalize waits on a held POLL for seconds): asking in line behind itself it
    would wait forever. So a thread's own handler is served first: while the thread holds
    the turn and is not in the middle of a socket operation (its holder marks those with
    :meth:`busy`), the handler uses the turn (nested, as the thread is suspended
    meanwhile), and each time it gives it back the turn is lent to the threads waiting
    then (one turn each: the handler's call may need them, a background stager's STAGED
    say) before its thread takes it back, so the interrupted code goes on holding it.
    While the thread waits for its turn, the handler's request goes just ahead of it. A
    handler that interrupts a socket operation cannot be served (a message half sent or
    read would mix with its own): :meth:`__enter__` raises :class:`RuntimeError`.

    An exception that interrupts a wait for a turn (KeyboardInterrupt, a launcher's
    signal exception) takes the thread's place out of the line and passes on any turn it
    took; waiters recheck at short intervals, so a wake-up lost to one is never waited
    for. A thread taking its turn back from a lend waits on through such an exception and
    raises it once it holds the turn again; giving a turn back clears it first. Python
    checks for a pending signal on entering a function and after each call, so one that
    lands in the few steps around this class's code (entering or leaving its methods, or
    while another exception is handled) can still leave a turn held.

    Parameters
    ----------
    on_event : callable, optional
        Called with ``"ask"`` when a thread gets in line and ``"got"`` when it takes the
        turn, under the lock, so the order seen is the order served (tests record it).
    """

    #: Seconds between two looks at the line by a thread waiting for its turn.
    RECHECK_SECONDS = 0.1

    def __init__(self, on_event: Callable[[str], None] | None = None) -> None:
        # Reentrant: a signal handler may ask while its thread is inside this class. A C
        # lock: leaving it runs no Python code, where a signal's exception could land.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque = deque()  # one (token, thread) per request waiting, in order
        self._owner: int | None = None  # the thread holding the turn (one store: atomic)
        self._lent: list[int] = []  # per turn a handler uses nested in its thread's: who
        self._busy = False  # the owner is in the middle of a socket operation
        self.on_event = on_event

    def __enter__(self) -> "Turns":
        me = threading.get_ident()
        with self._lock:
            if self._owner == me:
                if self._busy:
                    raise RuntimeError(
                        "ckpt_client was called from a signal handler while this thread was "
                        "in the middle of sending or reading a message to the ckptd daemon; "
                        "the handler cannot use the connection now. Have the handler set a "
                        "flag (or hand the work to another thread) and make the call from "
                        "your loop")
                self._lent.append(me)  # this thread is suspended in its own handler meanwhile
                return self
            token = (object(), me)
            # A request of this thread's signal handler goes just ahead of the thread's
            # own (which cannot take its turn before the handler returns).
            mine = next((i for i, (_, who) in enumerate(self._queue) if who == me), None)
            if mine is None:
                self._queue.append(token)
            else:
                self._queue.insert(mine, token)
            try:
                self._event("ask")
                while self._owner is not None or self._queue[0] is not token:
                    self._changed.wait(self.RECHECK_SECONDS)
                self._owner = me
                self._queue.remove(token)
                self._event("got")
            except BaseException:  # interrupted: nobody must wait on a place or turn left
                if token in self._queue:
                    self._queue.remove(token)
                if self._owner == me:
                    self._owner = None
                self._changed.notify_all()
                raise
        return self

    def __exit__(self, *exc_info) -> None:
        me = threading.get_ident()
        if self._lent and self._lent[-1] == me:
            self._lend_and_take_back(me)
            return
        self._busy = False
        self._owner = None  # first: free whatever lands below (waiters recheck anyway)
        with self._lock:
            if self._queue:
                self._changed.notify_all()  # the head of the queue goes next

    def _lend_and_take_back(self, me: int) -> None:
        """A signal handler's turn, nested in its thread's, ends: the threads waiting now
        take one turn each, then the thread takes its own back (before any later one)."""
        interrupted: BaseException | None = None
        with self._lock:
            self._lent.pop()
            if not self._queue or any(who == me for _, who in self._queue):
                # Nobody to lend it to; or the handler landed while its thread was taking
                # the turn (its place not yet out of the line): the thread keeps it.
                return
            token = (object(), me)
            self._queue.append(token)
            self._event("ask")
            self._owner = None
            self._changed.notify_all()
            while self._owner is not None or self._queue[0] is not token:
                try:
                    self._changed.wait(self.RECHECK_SECONDS)
                except BaseException as exc:  # the interrupted code needs its turn first
                    interrupted = exc
            self._owner = me
            self._queue.remove(token)
            self._event("got")
        if interrupted is not None:
            raise interrupted

    def _event(self, what: str) -> None:
        if self.on_event is not None:
            self.on_event(what)

    def busy(self) -> "_Busy":
        """Mark, for the turn's holder, a socket operation that a signal handler of its
        thread must not interleave with (``with turns.busy(): socket.send...``)."""
        return _Busy(self)

    @property
    def waiting(self) -> int:
        """How many requests wait for their turn."""
        return len(self._queue)


class _Busy:
    """The holder of a turn is in the middle of a socket operation (see :class:`Turns`)."""

    def __init__(self, turns: Turns) -> None:
        self._turns = turns

    def __enter__(self) -> None:
        self._turns._busy = True

    def __exit__(self, *exc_info) -> None:
        self._turns._busy = False


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
        self._forked_from: int | None = None  # the parent's pid, in a forked child
        self._lock = Turns()
        self._awaited: set[int] = set()       # ids some thread still waits for
        self._arrived: dict[int, Message] = {}  # their replies, when another thread read them
        self._unread: list = []  # the frames of a reply read and not yet delivered
        #: Called with the id of every reply read off the socket, kept or discarded (during
        #: the caller's turn at the socket: it must not call the channel).
        self.on_reply: Callable[[int], None] | None = None

    def send(self, msg_type: str, body: dict | None = None, frames=()) -> int:
        """Send a request without waiting; returns its id."""
        self._check_not_inherited()
        with self._lock:
            # One statement (no call in it for a signal handler to run at): a request of
            # this thread's signal handler gets another id.
            msg_id, self._next_id = self._next_id, self._next_id + 1
            self._awaited.add(msg_id)
            try:
                message = encode(msg_type, msg_id, body, frames)  # a handler may run here
                with self._lock.busy():
                    self._send_whole(message)
            except BaseException:  # nobody will wait for this id: its reply is dropped
                self._awaited.discard(msg_id)
                raise
        return msg_id

    def _send_whole(self, message: list) -> None:
        """Send ``message``'s frames; an exception that lands between two of them (a
        signal handler's, KeyboardInterrupt) is raised only once the last frame went.

        pyzmq's ``send_multipart`` is a Python loop: interrupted, it would leave half a
        message that the socket glues to the next request (the daemon misreads both).
        """
        zmq = self._zmq
        last = len(message) - 1
        # Each frame is sent and counted inside one C call (``extend`` over ``map`` of
        # the compiled send): no exception can land after a frame went and before it is
        # counted, so the rest of an interrupted message is sent exactly once.
        send, sent = zmq.backend.Socket.send, []
        try:
            for index, frame in enumerate(message):
                flags = zmq.SNDMORE if index < last else 0
                sent.extend(map(send, (self.socket,), (frame,), (flags,), (False,)))
        finally:
            while 0 < len(sent) <= last:  # interrupted mid-message: finish it
                flags = zmq.SNDMORE if len(sent) < last else 0
                sent.extend(map(send, (self.socket,), (message[len(sent)],), (flags,),
                                (False,)))

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
        self._check_not_inherited()
        deadline = time.monotonic() + timeout
        try:
            with self._lock:  # again, after a wait for it that timed out: keep its reply
                self._awaited.add(msg_id)
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
                self._deliver()  # one a read interrupted by an exception left
                if msg_id in self._arrived:
                    return self._arrived.pop(msg_id)
                # Short polls during one turn at the socket, so other threads get theirs
                # (to send, or to read the replies it delivers for them) between slices.
                left = deadline - time.monotonic()
                if self.socket.poll(max(1, int(min(left, SLICE_SECONDS) * 1000))):
                    self._read()  # kept for its waiter (this thread's own, read just above)
                    continue
            if time.monotonic() >= deadline:
                return None

    def _read(self) -> None:
        """Read one reply off the socket (the caller holds the turn and saw it waiting)
        and keep it for its waiter; none if it is gone (a signal handler of this thread,
        sharing its turn, read it between the poll and now).

        The frames are read into the channel's own list (:attr:`_unread`), not a local
        one: an exception that lands anywhere after they were read (in decoding them, in
        keeping the reply, or in the caller right after this returns) leaves them there,
        and the next turn at the socket (any thread's) delivers them. A local list would
        lose the reply for whichever thread waits for it.
        """
        self._deliver()  # one an interrupted read left: read next into an empty list
        try:
            with self._lock.busy():
                self._recv_whole(self._unread)
        except self._zmq.Again:
            return
        finally:
            self._deliver()  # also when interrupted: the message was read whole

    def _deliver(self) -> None:
        """Keep the reply read into :attr:`_unread` for its waiter, tell :attr:`on_reply`,
        then empty the list (the caller holds the turn).

        Every step before the list is emptied can be done again: a signal's exception
        that lands in one leaves the reply to be delivered by the next turn (kept twice
        is kept once; ``on_reply`` may hear of it twice, never not at all).
        """
        frames = self._unread
        if not frames:
            return
        try:
            reply = decode(frames)
        except ProtocolError:  # never readable: do not try it again at every turn
            self._forget(frames)
            raise
        if reply.id in self._awaited:
            self._arrived[reply.id] = reply
        try:
            if self.on_reply is not None:
                self.on_reply(reply.id)
        finally:
            self._forget(frames)

    def _forget(self, frames: list) -> None:
        # A signal handler of this thread may have delivered this reply and read the next
        # one meanwhile (it shares the turn between socket operations): keep that one.
        if self._unread is frames:
            self._unread = []

    def _recv_whole(self, frames: list) -> None:
        """Append one message's frames to ``frames`` (``zmq.Again`` if none waits); an
        exception that lands between two frames is raised only once the last was read.

        pyzmq's ``recv_multipart`` is a Python loop: interrupted, it would leave the tail
        of a message on the socket, read next as a message of its own.
        """
        zmq = self._zmq
        # Each frame is received and appended inside one C call (as in _send_whole), so
        # none is lost between the two when an exception lands.
        recv, args = zmq.backend.Socket.recv, ((self.socket,), (zmq.NOBLOCK,))
        try:
            frames.extend(map(recv, *args))
            while self.socket.get(zmq.RCVMORE):
                frames.extend(map(recv, *args))
        finally:
            # A message's frames arrive together: the rest is there to read.
            while frames and self.socket.get(zmq.RCVMORE):
                frames.extend(map(recv, *args))

    def collect(self) -> None:
        """Read the replies already waiting on the socket, without blocking: each is kept
        for its waiter or dropped, and :attr:`on_reply` hears of it (when nobody waits
        on the socket, a late answer would otherwise stay unread).

        Raises
        ------
        ProtocolError
            If a reply cannot be decoded.
        """
        self._check_not_inherited()
        with self._lock:
            self._deliver()  # one a read interrupted by an exception left
            while self.socket.poll(0):
                self._read()

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
        """Close the socket (in turn: no other thread is using it then); a channel this
        process inherited across a fork is left alone (the socket is its parent's)."""
        if self._forked_from is not None:
            return
        with self._lock, self._lock.busy():
            self.socket.close(linger=0)

    def forsake(self, parent_pid: int) -> None:
        """This process is a fork of ``parent_pid``, which made this channel: the socket
        and its turns are the parent's (a thread that held the turn then does not exist
        here). Never touch the socket again, not even to close it; calls fail at once."""
        self._forked_from = parent_pid
        self._lock = Turns()

    def _check_not_inherited(self) -> None:
        if self._forked_from is not None:
            raise self._zmq.ZMQError(
                self._zmq.ENOTSOCK, f"this channel to {self.endpoint} belongs to process "
                f"{self._forked_from}, which forked this one (pid {os.getpid()}); connect "
                f"again in this process")
