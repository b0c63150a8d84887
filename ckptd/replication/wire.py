"""The peer control channel's vocabulary: what one daemon says to another over ZeroMQ.

Framed like every ckptd message (msgpack header, :mod:`ckptd.protocol`), sent over the
CURVE-authenticated peer sockets (:mod:`ckptd.replication.transport`). Each body is a
typed :class:`ckptd.protocol.Body`, checked on arrival.

Only small messages travel here, so a heartbeat never waits behind part bytes:
``PEER_PING`` / ``PEER_PONG`` are the heartbeat; ``PART_GET`` asks a holder to stream a part
to the requester's bulk address (a fetch), and ``PART_REFUSED`` is a holder's answer when
it cannot. Part bytes themselves go over the bulk path (:mod:`.bulk_connection`).
"""

from __future__ import annotations

from ckptd.protocol import Body, check

__all__ = ["PeerPing", "PeerPong", "PartGet", "PartRefused", "PEER_MESSAGES"]


def _non_negative():
    return check(lambda v: v >= 0, "a non-negative integer")


class PeerPing(Body, message="peer_ping"):
    """Heartbeat: are you there?"""

    t: float = 0.0


class PeerPong(Body, message="peer_pong"):
    """Heartbeat answer (echoes the ping's time)."""

    t: float = 0.0


class PartGet(Body, message="part_get"):
    """Ask a holder to stream ``owner``'s part of ``iteration`` to the asking daemon.

    The holder sends it to the daemon whose CURVE key authenticated this request, and to no
    one else; ``requester``, when given, must name that same daemon (a request naming
    another one is refused). Sent again until the stream begins (the holder ignores a
    transfer it already serves), so a lost message costs a resend, not the fetch.
    """

    xfer: int
    session: str
    owner: int = _non_negative()
    iteration: int = _non_negative()
    requester: str = ""  # optional, checked against the authenticated sender; never trusted


class PartRefused(Body, message="part_refused"):
    """A holder cannot serve a ``PART_GET`` (no such part, or its copy is corrupted)."""

    xfer: int
    error: str = ""


#: Every peer message type, by name.
PEER_MESSAGES = {cls.message_type: cls for cls in (PeerPing, PeerPong, PartGet, PartRefused)}
