"""A connection's "not answering" mark: whether its daemon answers, from what it replied.

The mark (:class:`Silence`) is set when a call waited ``CKPTD_CALL_TIMEOUT`` in vain (the
daemon is stopped: SIGSTOP, a debugger; hung; or dead): the other saves outstanding on
the connection then read it instead of each waiting a call timeout of their own. Any
reply to the unanswered request or to a later one clears it, also a late one nobody waits
for any more (the request channel reports every reply it reads): the daemon read that far
and answers again. A request older than one answered
never sets it (the daemon was only slow on it). :class:`AnswerWatch` owns the mark and the
highest request id answered; the connection feeds it and reads it
(:mod:`ckpt_client.transport.connection`). It does no I/O.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, replace

from ckpt_client.errors import DaemonUnavailableError

log = logging.getLogger(__name__)

__all__ = ["Silence", "AnswerWatch"]


@dataclass(frozen=True)
class Silence:
    """The request a connection's daemon did not answer: the connection's "not answering"
    mark, which the other outstanding saves read instead of waiting again.

    Attributes
    ----------
    msg_type : str
        The unanswered request's type.
    msg_id : int
        Its id: a reply to it or to any later request clears the mark.
    timeout : float
        Seconds it was waited for.
    since : float
        Monotonic time the wait ended.
    error : DaemonUnavailableError
        What that call raised (the daemon silent, or dead).
    rechecked : bool
        Whether a save took the one recheck of this mark (:meth:`AnswerWatch.claim_recheck`).
    """

    msg_type: str
    msg_id: int
    timeout: float
    since: float
    error: DaemonUnavailableError
    rechecked: bool = False


class AnswerWatch:
    """What one connection's daemon answered: the highest request id answered, and the
    "not answering" mark.

    A signal handler that calls the daemon while its own thread is in here (the request
    channel reports a reply during the thread's wait) runs a whole call of its own in the
    middle of this thread's: the lock is re-entrant for it, and every update is made so a
    nested one is never undone. The highest id answered only ever grows, in one C call;
    a mark set or renewed is dropped again if a reply to it came meanwhile.

    Parameters
    ----------
    who : str
        How log lines name this process and its daemon.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self._silence: Silence | None = None
        # [the highest request id that got a reply]: raised by heapq.heappushpop, which
        # keeps the larger of the two in one C call (no handler can run in between).
        self._answered = [0]
        # Threads race on it (a poll and a background staging); re-entrant for a
        # signal handler of the thread inside.
        self._lock = threading.RLock()

    @property
    def mark(self) -> Silence | None:
        """The unanswered request, while no reply to it or a later one came."""
        return self._silence

    def heard(self, msg_id: int) -> None:
        """A reply to ``msg_id`` came (awaited, or late and dropped)."""
        with self._lock:
            heapq.heappushpop(self._answered, msg_id)
            silence = self._silence
            if silence is None or msg_id < silence.msg_id:
                return  # answered before the daemon went silent: says nothing about now
            self._silence = None
        log.info("%s answers again (its %s request went unanswered %.0fs before)", self.who,
                 silence.msg_type, time.monotonic() - silence.since)

    def went_silent(self, msg_id: int, msg_type: str, timeout: float,
                    error: DaemonUnavailableError) -> None:
        """The ``msg_type`` request ``msg_id`` went unanswered for ``timeout`` seconds (or
        the daemon died): mark the connection, unless a later request was answered."""
        with self._lock:
            if msg_id <= self._answered[0]:
                # this one or a later one was answered (its reply read by another thread
                # while this one's wait was ending): the daemon only took long on it
                return
            if self._silence is not None and self._silence.msg_id > msg_id:
                return  # a later request went unanswered already
            first = self._silence is None
            self._silence = Silence(msg_type, msg_id, timeout, time.monotonic(), error,
                                    rechecked=not first and self._silence.rechecked)  # unbroken
            self._unless_answered(msg_id)
        if first:
            log.warning("%s; the other saves outstanding on this connection are given up "
                        "unless one short recheck is answered", error)

    def claim_recheck(self) -> str | None:
        """``None`` (not marked), ``"recheck"`` (the caller takes the one recheck of this
        mark) or ``"silent"`` (another caller took it, and no reply came since)."""
        with self._lock:
            silence = self._silence
            if silence is None or silence.rechecked:
                return None if silence is None else "silent"
            self._silence = replace(silence, rechecked=True)
            self._unless_answered(silence.msg_id)
            return "recheck"

    def _unless_answered(self, msg_id: int) -> None:
        """Drop the mark just stored for ``msg_id`` if a reply to it or a later request
        came since this caller looked (heard in a signal handler that ran meanwhile)."""
        if self._answered[0] >= msg_id:
            self._silence = None
