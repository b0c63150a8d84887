"""The bulk path's vocabulary: the typed bodies of its control frames.

A part stream is ``BEGIN`` (sender: which part, and its recorded crc32 when a holder
serves a fetch) -> ``READY`` (receiver: ready, or why not) -> ``CHUNK``/``ACK`` pairs ->
``END`` (sender: every chunk acknowledged) -> ``DONE`` (receiver: durable, or why not);
``ABORT`` ends it early from either side. ``CHUNK`` and ``ACK`` carry no map (part bytes,
or nothing). Each control body here is a :class:`ckptd.protocol.body.Body`: the sender
builds it and :func:`send_control` sends it under its frame kind; the receiver gets it
back checked with :func:`control_body`. The frames themselves are
:mod:`ckptd.replication.bulk_connection`'s; this module must not touch sockets.
"""

from __future__ import annotations

from ckptd.checksum import ALGORITHMS
from ckptd.protocol.body import Body, check
from ckptd.protocol.errors import ProtocolError
from ckptd.replication.bulk_connection import BulkConnection, BulkConnectionError, Frame, Kind

__all__ = ["Begin", "Ready", "End", "Done", "Abort", "CONTROL_BODIES", "send_control",
           "control_body"]


class Begin(Body, message="begin"):
    """Sender: a part starts (its size is the frame's ``extra``)."""

    session: str
    owner: int = check(lambda v: v >= 0, "a rank >= 0")
    iteration: int = check(lambda v: v >= 0, "an iteration >= 0")
    crc: int | None = None  # the holder's recorded checksum when it serves a fetch
    algorithm: str = check(lambda v: v in ALGORITHMS, "a known checksum algorithm",
                           default="crc32")  # of ``crc``, and of the receiver's record


class Ready(Body, message="ready"):
    """Receiver: ready for chunks (``ok``), or why not."""

    ok: bool
    error: str | None = None


class End(Body, message="end"):
    """Sender: every chunk was acknowledged."""

    size: int = check(lambda v: v >= 0, "a byte count >= 0")


class Done(Body, message="done"):
    """Receiver: the part is durable (``ok``), or why not."""

    ok: bool
    error: str | None = None


class Abort(Body, message="abort"):
    """Either side: this transfer is over."""

    error: str | None = None


#: The body of each control frame kind.
CONTROL_BODIES = {Kind.BEGIN: Begin, Kind.READY: Ready, Kind.END: End, Kind.DONE: Done,
                  Kind.ABORT: Abort}
_KIND_OF = {body: kind for kind, body in CONTROL_BODIES.items()}


def send_control(connection: BulkConnection, xfer: int, body: Body, extra: int = 0) -> None:
    """Send ``body`` as the control frame of its kind for transfer ``xfer``.

    Raises
    ------
    BulkConnectionError
        If the connection broke.
    """
    connection.send(_KIND_OF[type(body)], xfer, extra=extra, payload=body.to_wire())


def control_body(frame: Frame) -> Body:
    """The checked body of a control frame.

    Raises
    ------
    BulkConnectionError
        If the payload is not a map, or breaks its kind's schema (a peer that sends
        garbage is disconnected).
    """
    try:
        return CONTROL_BODIES[frame.kind].from_wire(frame.body())
    except KeyError:
        raise BulkConnectionError(f"a frame of kind {frame.kind} carries no body") from None
    except ProtocolError as exc:
        raise BulkConnectionError(f"refused a control frame: {exc.message}") from None
