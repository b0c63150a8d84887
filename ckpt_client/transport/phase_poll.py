"""Asking the daemon for a save's phase: one POLL, held by the daemon until the save moves on.

A caller that blocks on a save's outcome asks with ``hold``: the POLL says which phase
this rank last saw the save in, and the daemon holds it until the save leaves that phase
(at once if it has), or for at most :func:`poll_hold` seconds, well inside the call
timeout. A blocked finalize so costs the daemon one POLL per phase change instead of one
every few milliseconds, and hears of each change as soon as the daemon makes it. The wait
for the reply is an ordinary call's (:meth:`DaemonConnection.call`) plus the hold: a dead
daemon is still noticed between slices of it, and a daemon is called silent (the
connection marked not answering) only once it let a whole call timeout pass beyond the
hold it granted, as for any other request.
A daemon that cannot hold a POLL (it says so in its hello) is asked at
:data:`POLL_INTERVAL` instead.

Owns the POLL's body, how long it is held and the pacing between asks; what a reply
means for the save is :class:`ckpt_client.transport.daemon_save.DaemonSave`'s business.
"""

from __future__ import annotations

import time

from ckptd import knobs
from ckptd.protocol import MessageType, Poll, RequestState
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport.silent_daemon import recheck_wait

__all__ = ["POLL_INTERVAL", "poll_hold", "ask_phase"]

#: Seconds between two asks while a caller blocks on a save's outcome, where the daemon
#: cannot hold a POLL (an older one): a phase change is a few requests away, and a client
#: thread asking more often only loads the daemon.
POLL_INTERVAL = 0.01


def poll_hold(connection: DaemonConnection) -> float:
    """Seconds a blocked caller asks the daemon to hold a POLL: ``CKPTD_POLL_HOLD``, no
    longer than the daemon holds one (0 for a daemon that answers at once) nor than half
    an ordinary call's wait, so a silent daemon is still noticed within a few call
    timeouts (the reply is waited for the call timeout beyond the hold)."""
    return max(0.0, min(knobs.POLL_HOLD.get(), connection.poll_hold_s,
                        knobs.CALL_TIMEOUT.get() / 2))


def ask_phase(connection: DaemonConnection, request_id: int, seen: str, hold: bool,
              recheck: bool = False) -> RequestState:
    """The daemon's word on ``request_id``, last seen in phase ``seen``.

    Parameters
    ----------
    hold : bool
        The caller blocks until the save moves on: the daemon answers when it leaves
        ``seen``, or after :func:`poll_hold` seconds.
    recheck : bool
        The one short recheck of a connection marked not answering: never held, and
        given up after :func:`~ckpt_client.transport.silent_daemon.recheck_wait`.

    Raises
    ------
    DaemonUnavailableError, DaemonRequestError
        As :meth:`DaemonConnection.call`.
    """
    hold_s = 0.0 if recheck or not hold else poll_hold(connection)
    if hold and not hold_s and not recheck:
        time.sleep(POLL_INTERVAL)  # a daemon that answers at once is asked at intervals
    body = (Poll(request_ids=[request_id], wait_seconds=hold_s, seen={request_id: seen})
            if hold_s else Poll(request_ids=[request_id]))
    asked = time.monotonic()
    # A held reply is due at the end of the hold: only a call timeout beyond it is silence.
    reply = connection.call(MessageType.POLL, body,
                            timeout=knobs.CALL_TIMEOUT.get() + hold_s if hold_s else None,
                            quiet_limit=recheck_wait() if recheck else None)
    state = reply.requests[request_id]
    if hold_s and state.phase == seen and time.monotonic() - asked < POLL_INTERVAL:
        # Answered at once with nothing new (the daemon stops, or another thread said
        # goodbye): whatever the cause, the next ask must not follow in a spin.
        time.sleep(POLL_INTERVAL)
    return state
