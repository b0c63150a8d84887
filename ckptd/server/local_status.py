"""The status document's sections about local checkpoints and replication.

Builds, from a :class:`ckptd.server.local.LocalService`, what ``ckptd status`` shows under
``peers`` (health and counters, from the replicator's snapshot), ``local_checkpoints``
(parts held here, own or replica, and whether the memory tier keeps them),
``replication`` (this daemon's addresses, key, protection and streams in flight),
``redundancy`` (where the copies of this node's latest parts are, reachable now) and
``memory_tier``. Reads only; the schema is documented in ``docs/operations.md``.
"""

from __future__ import annotations


def sections(service) -> dict:
    """Every local-checkpoint section of the status document."""
    peers = _peers(service)
    health = {p["address"]: p["health"] for p in peers}
    return {"peers": peers, "local_checkpoints": _checkpoints(service),
            "replication": _replication(service),
            "redundancy": service.redundancy.describe(health),
            "memory_tier": (service.resident.describe() if service.resident is not None
                            else {"parts": 0, "bytes": 0})}


def _peers(service) -> list:
    """Peer daemons and their health."""
    replicator = service.replicator
    return list(replicator.snapshot["peers"]) if replicator is not None else []


def _checkpoints(service) -> list:
    """Local checkpoint parts held here (own and replicas)."""
    if service.store is None:
        return []
    held = []
    for session in service.store.sessions():
        peers = service.sessions.get(session.session_id)
        for part in service.store.inventory(session, verify=False):
            entry = peers.entry_of(part["owner"]) if peers else None
            kind = "unknown" if not entry else "own" if entry[0] == service.address else "replica"
            if service.address is None:
                kind = "own"
            resident = service.resident.lookup(session.session_id, part["owner"],
                                               part["iteration"]) is not None
            held.append({**part, "kind": kind, "resident": resident})
    return held


def _replication(service) -> dict:
    """This daemon's peer addresses, key, protection and the part streams in flight."""
    replicator = service.replicator
    if replicator is None:
        return {"address": None, "public_key": None, "bulk_address": None,
                "encryption": None, "streams": []}
    return {"address": service.address, "public_key": replicator.public_key,
            "bulk_address": replicator.bulk_address, "encryption": replicator.protection,
            "streams": list(replicator.snapshot["streams"])}
