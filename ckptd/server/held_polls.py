"""POLL's handler, and the POLLs the daemon holds until a save they ask about moves on.

:class:`PollAnswers` answers ``poll``: the phase and results of some of the connection's
requests. A trainer blocked on a save says which phase it last saw each request in and how
long it is willing to wait (``wait_seconds``, capped by ``CKPTD_POLL_HOLD_MAX``): when none
of them moved on since, the poll is parked in :class:`HeldPolls` instead of answered,
and it is answered (with the requests' state as it is then) exactly once, by the first of:

- a listed request changed phase (:meth:`HeldPolls.changed`, which the lifecycle's one
  phase setter reports through the save service; the answers go out after the serve
  loop's round, :meth:`HeldPolls.answer_changed`, so a reply never shows a step half
  done, and several changes in one round make one reply);
- its wait ran out (:meth:`HeldPolls.expire`: the serve loop wakes at the earliest
  bound, :meth:`HeldPolls.next_due`, not at its next housekeeping tick, so a trainer's
  call timeout, which outlasts the bound it asked for, never runs out first);
- its trainer said goodbye (:meth:`HeldPolls.release_connection`: answered before the
  goodbye's own reply, so a thread still waiting on it hears first);
- the daemon stops (:meth:`HeldPolls.close`).

A trainer whose process is gone is not answered: its polls are dropped
(:meth:`HeldPolls.drop_connection`), as nobody reads the socket any more.

:class:`HeldPolls` does not know what a request or a phase is: :class:`PollAnswers`
decides what to park and builds each answer, so the index stays a small timed one. Only
reads the request table.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from ckptd import knobs
from ckptd.protocol import ErrorCode, Poll, PollReply, RequestState
from ckptd.server.endpoint import DEFERRED, Call
from ckptd.server.requests import RequestTable

log = logging.getLogger(__name__)

#: ``answer(call, request_ids)``: reply to ``call`` with the state of ``request_ids`` now.
Answer = Callable[[Call, list], None]


@dataclass(eq=False)
class _Held:
    """One parked POLL."""

    call: Call
    request_ids: list
    due: float  # monotonic time its wait runs out
    answered: bool = field(default=False)


class HeldPolls:
    """Parked POLLs by the requests they wait on (see the module docstring).

    Parameters
    ----------
    answer : callable
        ``answer(call, request_ids)`` replies to a held poll with the state now.
    """

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self._by_request: dict[int, list[_Held]] = {}
        self._held: list[_Held] = []
        self._changed: set[int] = set()

    def __len__(self) -> int:
        return len(self._held)

    def describe(self) -> dict:
        """The status document's ``held_polls``: how many POLLs are held, and for how many
        trainer connections (each a thread blocked on a save, waiting for its news)."""
        return {"held": len(self._held),
                "connections": len({held.call.routing_id for held in self._held})}

    def hold(self, call: Call, request_ids: list, seconds: float) -> None:
        """Park ``call`` (a POLL about ``request_ids``) for at most ``seconds``."""
        held = _Held(call, list(request_ids), time.monotonic() + seconds)
        self._held.append(held)
        for request_id in held.request_ids:
            self._by_request.setdefault(request_id, []).append(held)

    def changed(self, request_id: int) -> None:
        """``request_id`` changed phase: the polls waiting on it are answered after this
        round of the serve loop (:meth:`answer_changed`)."""
        if request_id in self._by_request:
            self._changed.add(request_id)

    def answer_changed(self) -> None:
        """Answer the polls that wait on a request that changed phase since the last call."""
        if not self._changed:
            return
        changed, self._changed = self._changed, set()
        self._release([held for request_id in changed
                       for held in self._by_request.get(request_id, ())])

    def next_due(self) -> float | None:
        """When the first held poll's wait runs out (monotonic); ``None``: none is held."""
        return min((held.due for held in self._held), default=None)

    def expire(self, now: float | None = None) -> None:
        """Answer the polls whose wait ran out (the requests' state as it is)."""
        now = time.monotonic() if now is None else now
        self._release([held for held in self._held if held.due <= now])

    def release_connection(self, routing_id: bytes) -> None:
        """Answer every poll of ``routing_id`` now (its trainer says goodbye)."""
        self._release([held for held in self._held if held.call.routing_id == routing_id])

    def drop_connection(self, routing_id: bytes) -> None:
        """Forget the polls of ``routing_id`` unanswered: its process is gone."""
        self._remove([held for held in self._held if held.call.routing_id == routing_id])

    def close(self) -> None:
        """The daemon stops: answer every poll still held."""
        self._release(list(self._held))

    def _release(self, leaving: list) -> None:
        for held in self._remove(leaving):
            try:
                self._answer(held.call, held.request_ids)
            except Exception:  # one bad answer must not leave the others unanswered
                log.exception("answering a held poll failed")
                held.call.fail(ErrorCode.INTERNAL, "answering the held poll failed",
                               "this is a ckptd bug; the daemon keeps serving")

    def _remove(self, leaving: list) -> list:
        """Take ``leaving`` out of the index (each once, even if listed twice)."""
        gone = []
        for held in leaving:
            if held.answered:
                continue
            held.answered = True
            gone.append(held)
            for request_id in held.request_ids:
                waiting = self._by_request.get(request_id)
                if waiting is not None:
                    waiting.remove(held)
                    if not waiting:
                        del self._by_request[request_id]
        if gone:
            self._held = [held for held in self._held if not held.answered]
        return gone


class PollAnswers:
    """Answers ``poll`` from the request table, at once or once something moved.

    Parameters
    ----------
    table : RequestTable
        Whose requests the polls ask about.

    Attributes
    ----------
    held : HeldPolls
        The polls waiting for news (the daemon wires its events to it).
    """

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.held = HeldPolls(lambda call, request_ids: call.reply(
            self._reply(call.routing_id, request_ids)))

    def on_poll(self, call: Call, body: Poll):
        """Phase and results of this connection's requests: at once, or, for a poll that
        may wait about requests all still in the phase the trainer saw them in, once one
        of them moves on or the wait runs out."""
        wait = min(body.wait_seconds, knobs.POLL_HOLD_MAX.get())
        if wait > 0 and body.request_ids and all(
                self._unchanged(call.routing_id, rid, body.seen.get(rid))
                for rid in body.request_ids):
            self.held.hold(call, body.request_ids, wait)
            return DEFERRED
        return self._reply(call.routing_id, body.request_ids)

    def _unchanged(self, routing_id: bytes, request_id: int, seen: str | None) -> bool:
        """Whether this connection's request is still in flight in the phase ``seen``."""
        request = self.table.get(request_id)
        return (seen is not None and request is not None and request.routing_id == routing_id
                and not request.finished and request.phase == seen)

    def _reply(self, routing_id: bytes, request_ids: list) -> PollReply:
        return PollReply(requests={rid: self._entry(routing_id, rid) for rid in request_ids})

    def _entry(self, routing_id: bytes, request_id: int) -> RequestState:
        request = self.table.get(request_id)
        if request is None or request.routing_id != routing_id:  # never another client's
            return RequestState(phase="unknown", error=f"ckptd (pid {os.getpid()}) has no "
                                f"request {request_id}; the daemon that took it is gone")
        return request.poll_entry()
