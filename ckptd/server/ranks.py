"""The trainer processes registered with this daemon, and whether they are still alive.

Owns the rank registry: a connection says ``hello`` (rank, pid, world size) before it may
save; a rank is forgotten when it says goodbye or its process is gone (checked on each
housekeeping tick with :func:`ckptd.protocol.process_alive`, the same rule the client
uses to watch its daemon). What happens to a gone rank's saves is the save service's
business.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptd.protocol import ErrorCode, Hello, SaveFormat, process_alive
from ckptd.server.endpoint import RequestError


@dataclass
class RankInfo:
    """One trainer process registered with the daemon."""

    routing_id: bytes
    rank: int
    pid: int
    world_size: int
    registered_at: float = field(default_factory=time.time)
    #: format (torch, DCP) -> request id -> (buffers, offsets, extent length) of this
    #: connection's last saves of that format, which a later STAGE of it may name instead
    #: of sending its buffers again (:mod:`ckptd.server.new_requests` names and keeps
    #: them). Apart, so that the many requests of DCP saves never push torch layouts out.
    layouts: dict = field(default_factory=lambda: {SaveFormat.TORCH: OrderedDict(),
                                                   SaveFormat.DCP: OrderedDict()})

    def is_alive(self) -> bool:
        """Whether the trainer process still exists (zombies count as gone)."""
        return process_alive(self.pid)


class RankRegistry:
    """Connections that said hello, by ROUTER routing id."""

    def __init__(self) -> None:
        self._ranks: dict[bytes, RankInfo] = {}

    def register(self, routing_id: bytes, hello: Hello) -> RankInfo:
        """Record (or replace) the rank behind ``routing_id``."""
        rank = RankInfo(routing_id, hello.rank, hello.pid, hello.world_size)
        self._ranks[routing_id] = rank
        return rank

    def remove(self, routing_id: bytes) -> RankInfo | None:
        """Forget a connection; returns what was known of it."""
        return self._ranks.pop(routing_id, None)

    def of(self, routing_id: bytes) -> RankInfo:
        """The rank behind ``routing_id``.

        Raises
        ------
        RequestError
            If that connection never said hello.
        """
        rank = self._ranks.get(routing_id)
        if rank is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, "this connection has not said hello",
                               "call ckpt_client.connect() before saving")
        return rank

    def gone(self) -> list[RankInfo]:
        """Registered ranks whose process no longer exists."""
        return [rank for rank in self._ranks.values() if not rank.is_alive()]

    def __len__(self) -> int:
        return len(self._ranks)

    def describe(self, in_flight_of) -> list[dict]:
        """Status entries, by rank; ``in_flight_of(routing_id)`` counts unfinished saves."""
        return [{"rank": r.rank, "pid": r.pid, "alive": r.is_alive(), "world_size": r.world_size,
                 "registered_at": r.registered_at, "requests_in_flight": in_flight_of(r.routing_id)}
                for r in sorted(self._ranks.values(), key=lambda r: r.rank)]
