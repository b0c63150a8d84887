"""The peer channel's vocabulary: what one daemon says to another.

Framed like every ckptd message (msgpack header + raw frames, :mod:`ckptd.protocol`), sent
over the CURVE-authenticated peer sockets (:mod:`ckptd.replication.transport`). Each body
is a typed :class:`ckptd.protocol.Body`, checked on arrival.

A part stream is ``PART_BEGIN`` (size, and the crc32 when the sender knows it), then
``PART_CHUNK`` frames (a header plus one raw frame of at most
:data:`ckptd.protocol.PART_FRAME_BYTES`), each acknowledged with ``PART_ACK`` (bytes
received so far: flow control), then ``PART_END`` with the crc32 of the whole stream,
answered by ``PART_DONE`` once the receiver made the part durable. ``PART_GET`` asks a
holder to stream a part back (a fetch); ``PEER_PING`` / ``PEER_PONG`` are the heartbeat.
"""

from __future__ import annotations


from ckptd.protocol import Body, check

__all__ = ["PeerPing", "PeerPong", "PartMessage", "PartGet", "PartBegin", "PartChunk", "PartEnd",
           "PartAck", "PartDone", "PEER_MESSAGES"]

def _non_negative():
    return check(lambda v: v >= 0, "a non-negative integer")


class PeerPing(Body, message="peer_ping"):
    """Heartbeat: are you there?"""

    t: float = 0.0


class PeerPong(Body, message="peer_pong"):
    """Heartbeat answer (echoes the ping's time)."""

    t: float = 0.0


class PartMessage(Body):
    """What every message of a part stream carries: the stream's id (``xfer``)."""

    xfer: int


class PartGet(PartMessage, message="part_get"):
    """Ask a holder to stream ``owner``'s part of ``iteration`` back (a fetch)."""

    session: str
    owner: int = _non_negative()
    iteration: int = _non_negative()


class PartBegin(PartMessage, message="part_begin"):
    """A part stream starts. A push names the part; a fetch reply carries only the size
    (and crc32) of the part asked for."""

    size: int = _non_negative()
    session: str | None = None
    owner: int | None = check(lambda v: v is None or v >= 0, "a rank >= 0", None)
    iteration: int | None = check(lambda v: v is None or v >= 0, "an iteration >= 0", None)
    crc: int | None = None


class PartChunk(PartMessage, message="part_chunk"):
    """One raw frame of the part, at ``offset``."""

    offset: int = _non_negative()


class PartEnd(PartMessage, message="part_end"):
    """All chunks sent (``crc`` of the whole stream), or the sender gave up (``abort``)."""

    crc: int | None = None
    size: int | None = None
    abort: bool = False
    error: str | None = None


class PartAck(PartMessage, message="part_ack"):
    """Receiver: bytes received so far."""

    received: int = _non_negative()


class PartDone(PartMessage, message="part_done"):
    """Receiver: the part is durable and verified, or why not."""

    ok: bool
    error: str | None = None


#: Every peer message type, by name.
PEER_MESSAGES = {cls.message_type: cls for cls in
                 (PeerPing, PeerPong, PartGet, PartBegin, PartChunk, PartEnd, PartAck, PartDone)}
