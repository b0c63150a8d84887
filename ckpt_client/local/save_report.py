"""The report of one finalized local save: which daemons hold a durable copy of the part.

Owns turning the daemon's replication outcome (holders and their states) into
``LocalCheckpointManager.last_save_report``; it only reads the save, it keeps no state.
"""

from __future__ import annotations


def save_report(iteration: int, replication: dict, own_address: str) -> dict:
    """``last_save_report`` of ``iteration``, from the daemon's replication outcome.

    ``own_address`` names this node's daemon, listed first among the copies.
    """
    holders = replication.get("holders", {})
    replicated_to = sorted(a for a, h in holders.items() if h["state"] == "done")
    return {
        "iteration": iteration,
        "copies": [own_address, *replicated_to],
        "wanted_copies": 1 + int(replication.get("wanted") or 0),
        "replicated_to": replicated_to,
        "failed": {a: h["error"] for a, h in holders.items() if h["state"] != "done"},
        "reduced_redundancy": bool(replication.get("reduced_redundancy")),
    }
