"""Liveness of one peer daemon: a heartbeat with a miss budget.

A :class:`PeerHealth` decides when the next ``PEER_PING`` is due, records ``PEER_PONG`` s,
and judges the peer ``up`` (answered within the budget), ``down`` (silent for more than
:data:`ckptd.knobs.PEER_MISS_BUDGET` intervals) or ``unknown`` (not heard yet, still
within the budget), and when a down peer's link deserves a fresh dial. It only keeps
time; sending is the replicator's business.

Pattern: ipyparallel's heart monitor, one object per peer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ckptd import knobs

log = logging.getLogger(__name__)

UP, DOWN, UNKNOWN = "up", "down", "unknown"
#: A down peer is redialed only after its link had this many intervals to connect.
REDIAL_AFTER_INTERVALS = 5


@dataclass
class PeerHealth:
    """Heartbeat bookkeeping of one peer.

    Parameters
    ----------
    address : str
        The peer (for log lines).
    """

    address: str
    dialed_at: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0
    last_pong: float | None = None
    state: str = UNKNOWN

    def ping_due(self, now: float) -> bool:
        """Whether to send a ping now (and count it as sent)."""
        if now - self.last_ping < knobs.PEER_PING_INTERVAL.get():
            return False
        self.last_ping = now
        return True

    def pong(self, now: float) -> None:
        """The peer answered a ping."""
        self.last_pong = now

    def assess(self, now: float) -> str:
        """Judge the peer; log when the judgement changes."""
        budget = knobs.PEER_MISS_BUDGET.get() * knobs.PEER_PING_INTERVAL.get()
        silent_for = now - (self.last_pong if self.last_pong is not None else self.dialed_at)
        state = (UP if self.last_pong is not None and silent_for <= budget
                 else DOWN if silent_for > budget else UNKNOWN)
        if state != self.state:
            (log.info if state == UP else log.warning)("peer %s is %s", self.address, state)
            self.state = state
        return state

    def wants_redial(self, now: float) -> bool:
        """A down peer whose link had time to connect: a fresh dial may reach it (a
        connection refused during a peer's restart is not retried forever)."""
        return (self.state == DOWN
                and now - self.dialed_at > REDIAL_AFTER_INTERVALS * knobs.PEER_PING_INTERVAL.get())

    def last_heard(self, now: float) -> float | None:
        """Seconds since the last pong (None: never heard)."""
        return None if self.last_pong is None else now - self.last_pong

    def redialed(self) -> "PeerHealth":
        """The same history for a freshly dialed link."""
        return PeerHealth(self.address, time.monotonic(), self.last_ping, self.last_pong,
                          self.state)
