"""Honest redundancy: where the durable copies of this node's local parts are, now.

Owns, per local-checkpoint session and owner rank of this node, the latest finished save
of that rank's part: the iteration, how many copies the clique asks for, and which
daemons hold a durable copy (this node's own, and each holder whose replica stream
ended ``done``). Its :meth:`RedundancyLedger.describe` counts a copy as *reachable* only
on this node or on a peer not judged down by its heartbeats, so a node that died after the
save lowers the job's redundancy in ``ckptd status`` and the metrics at once.

No I/O; the serve loop records, the status document reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.server.requests import SaveRequest


@dataclass
class PartCopies:
    """Where one part's durable copies are."""

    session: str
    owner: int
    iteration: int
    wanted: int          # copies the clique asks for, the owner's own included
    copies: list         # daemon addresses holding a durable copy, this one first
    failed: dict         # holder -> why its replica failed


class RedundancyLedger:
    """The latest finished part of each (session, owner) saved through this daemon."""

    def __init__(self) -> None:
        self._parts: dict[tuple, PartCopies] = {}

    def record(self, request: SaveRequest, own_address: str | None) -> None:
        """A local save is done: remember where its copies are."""
        replicas = request.replicas
        holders = replicas.holders if replicas is not None else {}
        done = [a for a, h in holders.items() if h["state"] == "done"]
        key = (request.session, request.rank)
        previous = self._parts.get(key)
        if previous is not None and previous.iteration > request.iteration:
            return
        self._parts[key] = PartCopies(
            request.session, request.rank, request.iteration,
            1 + (replicas.wanted if replicas is not None else 0),
            [own_address or "this node", *done],
            replicas.failures if replicas is not None else {})

    def describe(self, peer_health: dict) -> list[dict]:
        """Each part's copies now (``peer_health``: address -> ``up``/``down``/...)."""
        out = []
        for part in sorted(self._parts.values(), key=lambda p: (p.session, p.owner)):
            reachable = 1 + sum(1 for a in part.copies[1:]
                                if peer_health.get(a, "down") in ("up", "unknown"))
            out.append({"session": part.session, "owner": part.owner,
                        "iteration": part.iteration, "wanted": part.wanted,
                        "copies": list(part.copies), "reachable": reachable,
                        "reduced": reachable < part.wanted, "failed": dict(part.failed)})
        return out
