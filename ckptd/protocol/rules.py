"""Rules both sides must compute the same way, so neither has to tell the other.

Owns the session-id rule (a safe single path component), the order in which a clique's
nodes hold a rank's replicas, and which addresses are loopback. Pure functions only: no
I/O, no state.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["check_session_id", "holder_order", "is_loopback_address"]

_SESSION_RE = re.compile(r"[A-Za-z0-9_.\-]{0,128}")


def check_session_id(session_id: Any) -> str:
    """Return ``session_id`` if it is a safe single path component (or empty).

    Raises
    ------
    ValueError
        For ids with ``/``, ``..`` or characters other than letters, digits, ``_.-``.
    """
    if (not isinstance(session_id, str) or not _SESSION_RE.fullmatch(session_id)
            or session_id in (".", "..")):
        raise ValueError(f"session id {session_id!r} is not a plain name; use letters, "
                         "digits, '_', '.', '-' (at most 128)")
    return session_id


def holder_order(clique: Sequence[int], owner: int) -> list[int]:
    """The clique mates that keep ``owner``'s replicas, in the order they are used.

    The mates after the owner in clique order, wrapping around: the daemon pushes to
    them in this order and the client fetches from them in this order, so both agree.
    """
    at = list(clique).index(owner)
    return list(clique[at + 1:]) + list(clique[:at])


def is_loopback_address(address: str) -> bool:
    """Whether ``tcp://host:port``, ``host:port`` or a host names a loopback address (one
    only the same host, in the same network namespace, can reach)."""
    import ipaddress

    host = address.removeprefix("tcp://")
    if host.startswith("[") or host.count(":") == 1:
        host = host.rpartition(":")[0]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whoever resolves it decides
        return False
