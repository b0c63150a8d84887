"""What a save does about a daemon that does not answer: the words, and what it leaves.

A save stops waiting for its daemon (for its outcome, or for its turn to be staged in the
background) when a call of its own goes unanswered, or when an earlier call on the same
connection did (the connection's "not answering" mark,
:attr:`~ckpt_client.transport.connection.DaemonConnection.not_answering`): then asking
again would only cost another call timeout per save, except for one recheck per mark with
a short wait (:func:`recheck_wait`), which a daemon that was only slow answers (and which
waits on like any call once a late answer shows the daemon answers again). This module
says how long that recheck waits, builds the error that
says which of the two happened, and sends what a resumed daemon must still read (the
abort and the forget of a given-up save; the abort that names a STAGE whose reply did not
come, :func:`stage_reply`) without waiting for replies. It keeps no state:
the mark is the connection's, ``gave_up`` is the save's.
"""

from __future__ import annotations

import time

from ckptd import knobs
from ckptd.protocol import Abort, Body, Forget, MessageType
from ckpt_client.errors import DaemonNotAnsweringError, DaemonUnavailableError
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection

__all__ = ["not_waited_for", "leave_dropped", "tell_quietly", "gave_up_message", "recheck_wait",
           "stage_reply"]


def recheck_wait() -> float:
    """Seconds the one recheck of a connection marked not answering waits for its reply:
    as long as a hello may take (a daemon that serves at all answers that soon), never
    longer than an ordinary call's wait."""
    return min(knobs.HELLO_TIMEOUT.get(), knobs.CALL_TIMEOUT.get())


def not_waited_for(connection: DaemonConnection) -> DaemonUnavailableError:
    """Why a save on ``connection`` is not waited for: an earlier call on it went
    unanswered (or the daemon has died since)."""
    try:
        connection.ensure_daemon_alive()
    except DaemonUnavailableError as exc:
        return exc
    silence = connection.not_answering
    if silence is None:  # another thread was answered meanwhile: it answers again
        what = "stopped answering for a while"
    else:
        what = (f"did not answer an earlier {silence.msg_type} request on this connection "
                f"within {waits.as_text(silence.timeout)} ({time.monotonic() - silence.since:.0f}s ago)")
    return DaemonNotAnsweringError(
        connection.socket_path, f"the ckptd daemon (pid {connection.daemon_pid}) {what}, so "
                                f"this save was not waited for again", connection.daemon_pid)


def tell_quietly(connection: DaemonConnection, msg_type: str, body: Body) -> None:
    """Send a request without waiting for its reply; a transport already gone leaves
    nothing for the daemon to act on, so its failure is not an error here."""
    try:
        connection.tell(msg_type, body)
    except DaemonUnavailableError:
        pass


def leave_dropped(connection: DaemonConnection, request_id: int, reason: str,
                  copying: bool = False) -> None:
    """Queue an abort, then a forget that deletes the files, for ``request_id``: a daemon
    that resumes drops the save if it is still in flight, and removes what it wrote if its
    writers finished meanwhile (it may have handled their results before it reads the
    abort), so nothing of a save the rank reports as failed stays."""
    tell_quietly(connection, MessageType.ABORT, Abort(request_ids=[request_id],
                                                      reason=reason[:1000], copying=copying))
    tell_quietly(connection, MessageType.FORGET, Forget(request_ids=[request_id],
                                                        delete_files=True))


def stage_reply(connection: DaemonConnection, msg_id: int):
    """The reply to the STAGE request sent as ``msg_id``.

    If it does not come within :func:`ckpt_client.transport.waits.stage_reply` (longer
    than the daemon's own wait for room), or the transport fails, an abort that
    names that STAGE message is left queued before the error is raised: this process
    never learns the request id, so a daemon that resumes (or was only slow) and makes
    the request anyway would otherwise hold its staging space until its staging
    deadline, and the next saves could find the pool full.

    Raises
    ------
    DaemonUnavailableError, DaemonRequestError
        As :meth:`DaemonConnection.reply_to`.
    """
    try:
        return connection.reply_to(msg_id, MessageType.STAGE,
                                   timeout=waits.stage_reply(connection.deadlines))
    except DaemonUnavailableError as exc:
        tell_quietly(connection, MessageType.ABORT, Abort(
            request_ids=[], stages=[msg_id],
            reason=f"the trainer gave up waiting for the reply to its STAGE: {exc}"[:1000]))
        raise


def gave_up_message(rank: int, path: str, seen: str, error: DaemonUnavailableError,
                    socket_path: str) -> str:
    """The failure a given-up save reports: what happened, which daemon, what to do."""
    return (f"rank {rank}: gave up on the save of {path} (last seen in phase {seen!r}): "
            f"{error}. The daemon is dead or stopped (check: ckptd status --socket "
            f"{socket_path}); the save is abandoned and the previous checkpoint is intact; "
            f"save again once a daemon answers")
