"""The client endpoint: one ROUTER socket, one handler table, every request gets a reply.

Owns the socket trainers (and ``ckptd status``) talk to. :meth:`ClientEndpoint.serve_one`
decodes a message, checks its body against the typed schema of its type
(:class:`ckptd.protocol.Body`), and calls the handler registered for it with a
:class:`Call`: the handle to answer that one request. A handler returns a reply body (the
type :data:`ckptd.protocol.REPLIES` declares for that request), or :data:`DEFERRED` when
the answer comes later (staging space freed, a file durable, a part fetched) through
``call.reply`` / ``call.fail``; whoever holds the call owes the answer. Any exception
becomes a structured error reply and the endpoint keeps serving; so does a reply of the
wrong type, which is a daemon bug the trainer must hear about rather than misread.

A request may name the daemon *incarnation* it was made for (every ``ckpt_client``
request does, from its hello): one that names another incarnation was meant for a daemon
that was restarted at this socket since, and is refused before any handler sees it, so a
trainer can never mistake the new daemon's request 1 for its own lost one.

Pattern: ipyparallel's hub: ``msg_type -> handler``; errors are replies, never crashes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from ckptd import protocol
from ckptd.protocol import Body, ErrorCode, MessageType, reply_type_for

log = logging.getLogger(__name__)

#: A handler's return value when it answers later through its :class:`Call`.
DEFERRED = object()


class RequestError(Exception):
    """A request the daemon refuses; becomes an error reply with a code and a hint."""

    def __init__(self, code: str, message: str, hint: str = "", **context) -> None:
        super().__init__(message)
        self.code, self.message, self.hint, self.context = code, message, hint, context


@dataclass
class Call:
    """One client request and the right to answer it, exactly once.

    Attributes
    ----------
    routing_id : bytes
        The client connection (ROUTER routing id).
    msg_id : int
        The request's id, echoed in the answer.
    frames : list
        Raw payload frames that came after the header.
    reply_type : type
        The body that answers this request (``dict``: the status document).
    received_at : float
        Wall-clock time it arrived: a deferred answer's deadline counts from here.
    """

    endpoint: "ClientEndpoint"
    routing_id: bytes
    msg_id: int
    frames: list = field(default_factory=list)
    answered: bool = False
    reply_type: type = dict
    received_at: float = field(default_factory=time.time)

    def reply(self, body: Body | dict) -> None:
        """Answer with the request's reply body (ignored if already answered).

        A body of another type is not sent: the trainer gets an ``internal`` error reply
        naming both types, since it could not read the body anyway.
        """
        if type(body) is not self.reply_type:
            log.error("daemon bug: message %d answered with a %s, not a %s", self.msg_id,
                      type(body).__name__, self.reply_type.__name__)
            self.fail(ErrorCode.INTERNAL, f"the daemon answered with a {type(body).__name__} "
                      f"where a {self.reply_type.__name__} is due",
                      "this is a ckptd bug; the daemon keeps serving")
            return
        self._answer(MessageType.REPLY, body if isinstance(body, dict) else body.to_wire())

    def fail(self, code: str, message: str, hint: str = "", **context) -> None:
        """Answer with an error reply (ignored if already answered)."""
        self._answer(MessageType.ERROR, protocol.error_body(code, message, hint, **context))

    def _answer(self, msg_type: str, body: dict) -> None:
        if self.answered:
            return
        self.answered = True
        self.endpoint.send(self.routing_id, msg_type, self.msg_id, body)


#: ``handler(call, body) -> reply body | DEFERRED``
Handler = Callable[[Call, Body], object]


class ClientEndpoint:
    """The ROUTER socket clients talk to, and its dispatch table.

    Parameters
    ----------
    context : zmq.Context
        The daemon's context.
    incarnation : str
        This daemon's random incarnation token.
    """

    def __init__(self, context: zmq.Context, incarnation: str) -> None:
        self.incarnation = incarnation
        self.socket = context.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._routes: dict[str, tuple[type, Handler, type]] = {}

    def route(self, body_type: type, handler: Handler, message_type: str | None = None) -> None:
        """Send messages of ``body_type`` (or named ``message_type``) to ``handler``.

        Raises
        ------
        KeyError
            If the protocol declares no reply body for that message type.
        """
        message_type = message_type or body_type.message_type
        self._routes[message_type] = (body_type, handler, reply_type_for(message_type))

    def bind(self, endpoint: str) -> None:
        """Bind the socket."""
        self.socket.bind(endpoint)

    def serve_one(self) -> None:
        """Receive one message and answer it (now, or later through its Call)."""
        frames = self.socket.recv_multipart(copy=False)
        routing_id, payload = frames[0].bytes, frames[1:]
        call = Call(self, routing_id, -1)
        try:
            message = protocol.decode([f.buffer for f in payload])
            call.msg_id, call.frames = message.id, message.frames
            self._check_incarnation(message.body.get("incarnation"))
            route = self._routes.get(message.type)
            if route is None:
                raise RequestError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {message.type!r}",
                                   f"known types: {', '.join(sorted(self._routes))}")
            body_type, handler, call.reply_type = route
            result = handler(call, body_type.from_wire(message.body))
        except (protocol.ProtocolError, RequestError) as exc:
            log.warning("refused a message from %s: %s", routing_id.hex(), exc.message)
            call.fail(exc.code, exc.message, exc.hint, **getattr(exc, "context", {}))
            return
        except Exception as exc:  # keep serving whatever one handler did
            log.exception("handler failed for message %d", call.msg_id)
            call.fail(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",
                      "this is a ckptd bug; the daemon keeps serving")
            return
        if result is not DEFERRED:
            call.reply(result)

    def _check_incarnation(self, claimed) -> None:
        if claimed is None or claimed == self.incarnation:
            return
        raise RequestError(
            ErrorCode.DAEMON_RESTARTED,
            f"this request was made for ckptd incarnation {claimed!r}, which is gone: the "
            f"daemon at this socket was restarted (now incarnation {self.incarnation!r}, "
            f"pid {os.getpid()})", "saves that daemon held were lost; save them again")

    def send(self, routing_id: bytes, msg_type: str, msg_id: int, body: dict) -> None:
        """Send one message to a client; a client that is gone is not an error."""
        try:
            self.socket.send_multipart([routing_id, *protocol.encode(msg_type, msg_id, body)])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that client is gone
            log.info("could not reply to %s (message %d): %s", routing_id.hex(), msg_id, exc)

    def close(self, linger: float = 0.0) -> None:
        """Close the socket; answers already sent get ``linger`` seconds to leave."""
        self.socket.close(linger=int(linger * 1000))
