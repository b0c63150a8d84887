"""A save's STAGE, sent before its state dict is walked (a torch save) or its items are
looked up (a blocking DCP save's guessed copy, :mod:`ckpt_client.dcp.guessed_plan`).

A training loop saves the same structure again and again: the same tensors, dtypes and
shapes, only the values change. A STAGE needs nothing else (the skeleton, whose plain
values such as step counters change every save, can follow in STAGED), so while the
structure holds, the STAGE goes out first with the previous save's layout, and the
daemon reserves the extent while this process walks the state dict: its round trip
overlaps the walk instead of adding to the blocking call. If the walk finds another
layout (or fails), the request sent ahead is dropped, aborted and forgotten once its
reply came (on a connection marked not answering, without waiting: an abort naming the
STAGE is left for the daemon), and the save stages the ordinary way. A layout is guessed only for a kind of
state dict (its top-level keys) whose last two saves had it, so a trainer that saves
several structures through one connection guesses each from its own kind, and
structures that alternate within a kind are never guessed. The STAGE sent ahead names the
request of the last save of its kind instead of repeating its thousand buffer descriptions
(the daemon keeps that layout), so the daemon decodes and checks almost nothing before it
answers; a daemon that no longer keeps it refuses, and the save sends its buffers then.

Owns the remembered layouts of each connection's default torch saves (the DCP guess
keeps its own) and a STAGE sent ahead until a save takes it or drops it; knows nothing
of copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from typing import Any, Iterator

from ckptd import knobs
from ckptd.protocol import Abort, MessageType, SaveFormat, Stage
from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport.daemon_save import DaemonSave
from ckpt_client.transport.silent_daemon import stage_reply, tell_quietly

#: connection -> {kind: (buffers, whether the last two saves of that kind had them,
#: layout, request id)}: the buffers a list of [dtype, shape, nbytes] per tensor, the
#: layout the (dtype, shape) pairs they were made from (:attr:`Flattened.layout`), the
#: request id the daemon staged the last of them as.
_layouts: "weakref.WeakKeyDictionary[DaemonConnection, dict]" = weakref.WeakKeyDictionary()


def kind_of(state_dict: Any) -> tuple:
    """What tells one connection's state dicts apart before they are walked (a model's
    from its optimizer's): the container's type and top-level keys (or length)."""
    if isinstance(state_dict, dict):
        return (dict, tuple(state_dict))
    if isinstance(state_dict, (list, tuple)):
        return (type(state_dict), len(state_dict))
    return (type(state_dict),)


def remember_layout(connection: DaemonConnection, kind: tuple, layout: list,
                    buffers: list, request_id: int | None) -> None:
    """``buffers`` (made from ``layout``) describe the save of ``kind`` just staged as
    ``request_id``: the next save of that kind is sent ahead with them once two saves in
    a row had them (structures that alternate under one kind never are, so they never
    pay for a wrong guess)."""
    kinds = _layouts.setdefault(connection, {})
    last = kinds.pop(kind, None)
    kinds[kind] = (buffers, last is not None and (last[0] is buffers or last[0] == buffers),
                   layout, request_id)
    while kinds and len(kinds) > knobs.SENT_AHEAD_KINDS.get():
        kinds.pop(next(iter(kinds)))


class SentAhead:
    """A STAGE sent with a guessed layout, whose reply the save reads (or drops)."""

    def __init__(self, connection: DaemonConnection, kind: tuple, body: Stage,
                 msg_id: int, layout: list | None = None, wait_on_drop: bool = True) -> None:
        self.connection = connection
        self.kind = kind
        self.body = body
        self.msg_id = msg_id
        self.layout = layout  # what body.buffers were made from
        #: False: :meth:`drop` never waits for the reply (a caller that drops it on its
        #: way to planning must not wait there for pool room)
        self.wait_on_drop = wait_on_drop
        self._dropped = False

    @classmethod
    def send(cls, connection: DaemonConnection, kind: tuple, path: str | os.PathLike,
             may_send) -> "SentAhead | None":
        """Send the STAGE of a torch save of ``path`` with the layout the saves of
        ``kind`` kept, if they kept one and ``may_send()`` (nothing else of the
        connection still on its way to the daemon: saves must reach it in the order they
        were made)."""
        steady = _layouts.get(connection, {}).get(kind)
        if steady is None or not steady[1] or not may_send():
            return None
        body = Stage(format=SaveFormat.TORCH, path=os.path.abspath(path), buffers=steady[0])
        return cls.send_body(connection, body, steady[3], kind=kind, layout=steady[2])

    @classmethod
    def send_body(cls, connection: DaemonConnection, body: Stage, layout_of: int | None, *,
                  kind: tuple | None = None, layout: list | None = None,
                  wait_on_drop: bool = True) -> "SentAhead | None":
        """Send ``body``'s STAGE now; with ``layout_of``, naming that earlier request of
        the connection (whose buffers are ``body.buffers``) instead of sending them.
        ``None`` if the daemon is gone (the ordinary STAGE meets and reports it)."""
        # A tiered daemon sizes its stage budget from the buffers: it gets them.
        wire = body if layout_of is None or connection.tiered else \
            dataclasses.replace(body, buffers=[], layout_of=layout_of)
        try:
            return cls(connection, kind, body, connection.send(MessageType.STAGE, wire), layout,
                       wait_on_drop)
        except DaemonUnavailableError:
            return None

    def buffers_for(self, layout: list) -> list | None:
        """The buffers sent ahead if ``layout`` is the one they were made from (comparing
        layouts costs less than describing every tensor again), else ``None``."""
        return self.body.buffers if layout == self.layout else None

    def matches(self, connection: DaemonConnection, body: Stage) -> bool:
        """Whether ``body``, staged through ``connection``, asks for what was sent ahead
        there, skeleton aside."""
        sent = self.body
        return (connection is self.connection and body.buffers == sent.buffers and body.path == sent.path
                and body.format == sent.format and body.files == sent.files
                and body.cuda is None and body.session is None
                and body.stock_files == sent.stock_files)

    def drop(self, reason: str) -> None:
        """The save will not use it: once the daemon answered, abort and forget the
        request (nothing was copied into it, nothing is written). Dropping twice is
        dropping once.

        On a connection marked not answering (or made with ``wait_on_drop=False``) it
        returns at once, like every other give-up on such a connection: an abort naming
        the STAGE message is left queued, so the daemon drops the request that STAGE
        makes, and its reply is discarded on arrival (waiting for it would cost a whole
        STAGE reply's wait)."""
        if self._dropped:
            return
        self._dropped = True
        _layouts.get(self.connection, {}).pop(self.kind, None)
        if self.connection.not_answering is not None or not self.wait_on_drop:
            self.connection.channel.drop(self.msg_id)
            tell_quietly(self.connection, MessageType.ABORT, Abort(
                request_ids=[], stages=[self.msg_id], reason=reason[:1000]))
            return
        try:
            reply = stage_reply(self.connection, self.msg_id)
        except (DaemonRequestError, DaemonUnavailableError):
            return  # refused or gone: there is no request to drop
        DaemonSave(self.connection, reply.request_id, self.body.path).abort(reason)


@contextlib.contextmanager
def dropped_on_error(ahead: SentAhead | None) -> Iterator[None]:
    """Drop ``ahead`` if the block raises (then re-raise): a save that fails before it
    takes over its STAGE sent ahead must not leave the daemon holding the extent until its
    staging deadline, nor the reply unread in the channel."""
    try:
        yield
    except BaseException as exc:
        if ahead is not None:
            ahead.drop(f"the save failed before it was staged: {type(exc).__name__}: {exc}")
        raise
