"""A torch-format save's STAGE, sent before the state dict is walked.

A training loop saves the same structure again and again: the same tensors, dtypes and
shapes, only the values change. A STAGE needs nothing else (the skeleton, whose plain
values such as step counters change every save, can follow in STAGED), so while the
structure holds, the STAGE goes out first with the previous save's layout, and the
daemon reserves the extent while this process walks the state dict: its round trip
overlaps the walk instead of adding to the blocking call. If the walk finds another
layout (or fails), the request sent ahead is dropped, aborted and forgotten once its
reply came, and the save stages the ordinary way.

Owns the remembered layout of each connection's last default save; knows nothing of
copies.
"""

from __future__ import annotations

import os
import weakref

from ckptd.protocol import MessageType, SaveFormat, Stage
from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport.daemon_save import DaemonSave

#: connection -> buffers ([dtype, shape, nbytes] each) of its last default torch save.
_layouts: "weakref.WeakKeyDictionary[DaemonConnection, list]" = weakref.WeakKeyDictionary()


def remember_layout(connection: DaemonConnection, buffers: list) -> None:
    """The layout the next save through ``connection`` is sent ahead with."""
    _layouts[connection] = buffers


class SentAhead:
    """A STAGE sent with a guessed layout, whose reply the save reads (or drops)."""

    def __init__(self, connection: DaemonConnection, body: Stage, msg_id: int) -> None:
        self.connection = connection
        self.body = body
        self.msg_id = msg_id

    @classmethod
    def send(cls, connection: DaemonConnection, path: str | os.PathLike,
             may_send) -> "SentAhead | None":
        """Send the STAGE of a torch save of ``path`` with the last save's layout, if
        there was one and ``may_send()`` (nothing else of the connection still on its way
        to the daemon: saves must reach it in the order they were made)."""
        buffers = _layouts.get(connection)
        if buffers is None or not may_send():
            return None
        body = Stage(format=SaveFormat.TORCH, path=os.path.abspath(path), buffers=buffers)
        try:
            return cls(connection, body, connection.send(MessageType.STAGE, body))
        except DaemonUnavailableError:
            return None  # the ordinary STAGE meets (and reports) the same

    def matches(self, body: Stage) -> bool:
        """Whether ``body`` asks for what was sent ahead, skeleton aside."""
        return (body.buffers == self.body.buffers and body.path == self.body.path
                and body.format == self.body.format and not body.files and body.cuda is None
                and body.session is None and not body.stock_files)

    def drop(self, reason: str) -> None:
        """The save will not use it: once the daemon answered, abort and forget the
        request (nothing was copied into it, nothing is written)."""
        _layouts.pop(self.connection, None)
        try:
            reply = self.connection.reply_to(self.msg_id, MessageType.STAGE,
                                             timeout=waits.stage_reply(self.connection.deadlines))
        except (DaemonRequestError, DaemonUnavailableError):
            return  # refused or gone: there is no request to drop
        DaemonSave(self.connection, reply.request_id, self.body.path).abort(reason)
