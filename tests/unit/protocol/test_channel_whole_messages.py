"""An exception that lands between two frames of a message (a signal handler's,
KeyboardInterrupt) never leaves half a message on the channel's socket: the peer reads
whole requests only, and a reply read in part is finished and kept for its waiter.

The exception is raised by a profile hook the moment the socket took (or gave) the first
frame of a message, exactly where a signal handler's exception is raised: when the
call that moved the frame returns. A real ROUTER socket is the daemon's side.
"""

from __future__ import annotations

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
