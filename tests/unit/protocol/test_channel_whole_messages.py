"""An exception that lands between two frames of a message (a signal handler's,
KeyboardInterrupt) never leaves half a message on the channel's socket: the peer reads
whole requests only, and a reply read in part is finished and kept for its waiter. One
that lands while a reply read whole is decoded and kept never loses it either.

The exception is raised by a profile hook the moment the socket took (or gave) the first
frame of a message, exactly where a signal handler's exception is raised: when the
call that moved the frame returns. A real ROUTER socket is the daemon's side.
"""

from __future__ import annotations

import signal
import sys

import pytest
import zmq

from ckptd import protocol


class Landed(Exception):
    """What the hook raises (a signal handler's exception, say)."""


def raise_after_first_frame(moved: str):
    """A profile hook raising :class:`Landed` once, mid-message: when a frame of a message
    was ``moved`` (``"send"`` or ``"recv"``) by the socket and more follow (pyzmq's
    Python ``send`` returning, or the C call that moved or stored a frame returning in a
    multipart loop: pyzmq's own, or the channel's)."""
    state = {"frames": 0, "raised": False}

    def hook(frame, event, arg):
        if state["raised"]:
            return
        if event == "return" and frame.f_code.co_name == moved \
                and "zmq" in frame.f_code.co_filename:
            state["frames"] += 1
        elif event == "c_return" and getattr(arg, "__name__", "") in (moved, "extend", "append") \
                and frame.f_code.co_name in ("_send_whole", "_recv_whole", "send_multipart",
                                             "recv_multipart"):
            state["frames"] += 1
        else:
            return
        if state["frames"] == 1:
            state["raised"] = True
            raise Landed("landed between two frames")

    return hook, state


@pytest.fixture
def pair():
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.bind("inproc://whole-messages")
    channel = protocol.Channel("inproc://whole-messages", context)
    yield server, channel
    channel.close()
    server.close(linger=0)
    context.term()


def test_a_request_interrupted_between_frames_reaches_the_peer_whole(pair):
    server, channel = pair
    hook, state = raise_after_first_frame("send")
    sys.setprofile(hook)
    try:
        with pytest.raises(Landed):
            channel.send("ping", {"n": 1}, frames=[b"payload-1", b"payload-2"])
    finally:
        sys.setprofile(None)
    assert state["raised"], "the hook never saw a frame go"
    later = channel.send("ping", {"n": 2}, frames=[b"payload-3"])
    assert server.poll(10_000)
    _, *frames = server.recv_multipart()
    first = protocol.decode(frames)
    assert (first.body, [bytes(f) for f in first.frames]) == \
        ({"n": 1}, [b"payload-1", b"payload-2"]), "the interrupted request arrived whole"
    assert server.poll(10_000)
    _, *frames = server.recv_multipart()
    second = protocol.decode(frames)
    assert (second.id, second.body, [bytes(f) for f in second.frames]) == \
        (later, {"n": 2}, [b"payload-3"]), "the next request is not glued onto it"


def test_a_reply_interrupted_between_frames_is_read_whole_and_kept_for_its_waiter(pair):
    server, channel = pair
    first, second = channel.send("ping", {"n": 1}), channel.send("ping", {"n": 2})
    routing = []
    for _ in range(2):
        assert server.poll(10_000)
        routing.append(server.recv_multipart()[0])
    server.send_multipart([routing[0], *protocol.encode("reply", first, {"n": 1},
                                                        [b"tail-a", b"tail-b"])])
    server.send_multipart([routing[1], *protocol.encode("reply", second, {"n": 2},
                                                        [b"tail-c"])])
    hook, state = raise_after_first_frame("recv")
    sys.setprofile(hook)
    try:
        with pytest.raises(Landed):
            channel.wait(second, timeout=10)
    finally:
        sys.setprofile(None)
    assert state["raised"], "the hook never saw a frame read"
    kept = channel.wait(first, timeout=10)  # read whole, kept although its reader stopped
    assert (kept.body, [bytes(f) for f in kept.frames]) == ({"n": 1}, [b"tail-a", b"tail-b"])
    third = channel.send("ping", {"n": 3})
    assert server.poll(10_000)
    routing_id, *_ = server.recv_multipart()
    server.send_multipart([routing_id, *protocol.encode("reply", third, {"n": 3})])
    assert channel.wait(third, timeout=10).body == {"n": 3}, \
        "no leftover frame is read as a message of its own"


def signal_at_the_nth_step_of_a_read(n: int, calls: list):
    """A profile hook that raises SIGUSR1 at the ``n``-th step (a function of the channel
    or of the framing code entered or left, a call from them returning: where Python runs
    a pending signal's handler) once the channel began reading a reply; ``calls`` counts
    the steps seen."""
    state = {"reading": False}

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "_read":
            state["reading"] = True
        if not state["reading"] or not (code.co_qualname.startswith("Channel.")
                                        or code.co_filename.endswith("framing.py")):
            return
        calls.append((code.co_qualname, event, getattr(arg, "__name__", None)))
        if len(calls) == n:
            sys.setprofile(None)
            signal.raise_signal(signal.SIGUSR1)

    return hook


def test_a_reply_read_off_the_socket_reaches_its_waiter_wherever_a_signal_lands(pair):
    """A real signal whose handler raises (KeyboardInterrupt) lands at each step of the
    channel's reading a reply in turn, its decoding and keeping it for its waiter
    included: the reply is never lost, its waiter gets it at once (lost, it waited for
    the reply until its timeout)."""
    server, channel = pair

    def interrupt(signum, frame):
        raise KeyboardInterrupt("a signal's handler raised")

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        n = 0
        while True:
            n += 1
            msg_id = channel.send("ping", {"n": n})
            assert server.poll(10_000)
            routing_id, *frames = server.recv_multipart()
            server.send_multipart([routing_id, *protocol.encode("reply", msg_id, {"n": n},
                                                                [b"tail"])])
            assert channel.socket.poll(10_000)
            steps: list = []
            sys.setprofile(signal_at_the_nth_step_of_a_read(n, steps))
            try:
                channel.collect()
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            finally:
                sys.setprofile(None)
            where = steps[n - 1] if interrupted else "nowhere"
            try:
                reply = channel.wait(msg_id, timeout=2)
            except protocol.ReplyTimeout:
                pytest.fail(f"the reply was lost: the signal landed at {where}")
            assert (reply.body, [bytes(f) for f in reply.frames]) == ({"n": n}, [b"tail"]), where
            if not interrupted:
                break
        assert n > 10, f"the read took only {n} steps: the hook does not see it"
    finally:
        signal.signal(signal.SIGUSR1, previous)
