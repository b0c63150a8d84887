"""When refused dials mean that a lane's peer daemon is gone.

Owns one judgement of the sending side of the bulk path: a refused connection, or a
handshake closed without an answer (:class:`~.bulk_connection.DialRefusedError`), is what
a daemon that exited or restarted gives, but also what a passing reject on the path gives
while the daemon lives (a firewall reload, a load balancer's reject, a full accept queue,
a middlebox reset). Ending a lane's jobs at the first one would drop transfers that were
still moving on the lane's other connections. So the peer counts as gone only when

- :data:`REFUSALS_IN_A_ROW` dials in a row met a refusal (any other outcome starts over),
- over at least twice :data:`ckptd.knobs.PEER_HANDSHAKE_TIMEOUT` (a passing reject is
  over by then; a dead peer still ends far sooner than its no-progress deadline), and
- no connection of the lane is up, nor moved a byte within that time.

A restarted daemon that says so (``REPLACED``) is not judged here: that answer is final.
"""

from __future__ import annotations

from ckptd import knobs
from ckptd.replication.bulk_connection import (BulkConnectionError, DialRefusedError,
                                              PeerGoneError)

#: Refused dials in a row before the peer can count as gone (each connection of a lane
#: dials, so with several connections they come quickly: the time span is what decides).
REFUSALS_IN_A_ROW = 3


def refusal_window() -> float:
    """Seconds dials must keep being refused, with no byte moving, before the peer is
    gone."""
    return 2 * knobs.PEER_HANDSHAKE_TIMEOUT.get()


class Refusals:
    """The refused dials in a row of one lane (guarded by that lane's lock)."""

    def __init__(self) -> None:
        self.count = 0
        self.since = 0.0

    def dialed(self) -> None:
        """A dial got through: whatever refused before has passed."""
        self.count = 0

    def failed(self, exc: BulkConnectionError, now: float, connected: bool,
               last_activity: float) -> PeerGoneError | None:
        """A dial failed with ``exc`` at ``now``; ``connected``: another connection of the
        lane is up; ``last_activity``: when bytes last moved on one. Returns why the peer
        is gone, or ``None`` while it may yet answer."""
        if not isinstance(exc, DialRefusedError):
            self.count = 0  # no longer "in a row"
            return None
        if self.count == 0:
            self.since = now
        self.count += 1
        window = refusal_window()
        if (self.count < REFUSALS_IN_A_ROW or now - self.since < window or connected
                or now - last_activity < window):
            return None
        count, self.count = self.count, 0  # the jobs it ends are gone; new ones start over
        return PeerGoneError(f"{exc}; {count} dials in a row over {now - self.since:.0f}s met "
                             "that and no connection moved a byte: the daemon there exited "
                             "or was restarted")
