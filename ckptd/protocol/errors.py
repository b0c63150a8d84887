"""The exceptions of the wire contract and the shape of an error reply.

Owns :class:`ProtocolError` (a message that breaks the schema), the two ways a request
on the client channel fails to get a good answer (:class:`ReplyTimeout`,
:class:`ErrorReply`), and :func:`error_body`, the one way an error reply is built. It must
not know how messages are framed or sent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProtocolError", "ReplyTimeout", "ErrorReply", "error_body"]


class ProtocolError(Exception):
    """A message that does not follow this schema.

    Parameters
    ----------
    code : str
        One of :class:`ErrorCode`.
    message : str
        What was wrong, for a human.
    hint : str
        What to do about it.
    """

    def __init__(self, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint


class ReplyTimeout(Exception):
    """No reply arrived in time."""


class ErrorReply(Exception):
    """The peer answered with an error reply.

    Attributes
    ----------
    body : dict
        The error body: ``code``, ``message``, ``hint`` and context fields.
    """

    def __init__(self, body: dict) -> None:
        super().__init__(body.get("message", "error"))
        self.body = body
        self.code = body.get("code")


def error_body(code: str, message: str, hint: str = "", **context: Any) -> dict:
    """The body of an error reply: a code, what happened, what to do, and context."""
    return {"code": code, "message": message, "hint": hint, **context}
