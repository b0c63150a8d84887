"""The replicator's mailbox vocabulary: commands from the serve loop, events back to it,
and what the bulk connection threads report to the replicator.

Plain frozen dataclasses that cross threads inside one process through
:class:`ckptd.mailbox.Mailbox`: nothing is serialized, so the sender's constructor is the
only place a command is built and the class is its type (unlike the peer wire's bodies,
which :mod:`.wire` and :mod:`.bulk_wire` check on arrival because they come from another
daemon). Each side dispatches on the class through one handler table. A holder is ``(control address, public key, bulk address)`` as
the trainers' table names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PartRef:
    """Which part: ``owner``'s part of ``iteration`` in local-checkpoint ``session``."""

    session: str
    owner: int
    iteration: int


# ---------------------------------------------------------------- serve loop -> replicator

@dataclass(frozen=True)
class SetPeers:
    """The trainers' table: peer daemons (address, public key), every key allowed in, and
    the daemons this one replicates with (kept linked; any other is dialed on demand)."""

    peers: list          # [(address, key, bulk address)] of this session's daemons
    allowed_keys: list   # keys of every registered session's daemons
    mates: list = field(default_factory=list)  # addresses of the clique mates' daemons


@dataclass(frozen=True)
class ConnectPeers:
    """Dial the clique mates now (every daemon has the key table by then)."""


@dataclass(frozen=True)
class StopReplicator:
    """Drop streams in flight and end the thread."""


@dataclass(frozen=True)
class Push:
    """Stream a staged part from the pool to its holders."""

    request_id: int
    part: PartRef
    holders: list   # [(address, key, bulk address)] in holder order
    items: list     # [(pool offset, nbytes)] back to back


@dataclass(frozen=True)
class CancelPush:
    """Stop the pushes of an aborted save (each answers with a failed :class:`PushDone`)."""

    request_id: int
    reason: str = "the save ended"  # why: each push's failure names it


@dataclass(frozen=True)
class Fetch:
    """Get a part this node lacks from the holders, trying them in order."""

    fetch_id: int
    part: PartRef
    path: str       # where the part goes on this node
    holders: list   # [(address, key, bulk address)]


# ---------------------------------------------------------------- replicator -> serve loop

@dataclass(frozen=True)
class PushDone:
    """One holder's replica of a push is durable (``ok``) or failed."""

    request_id: int
    holder: str
    error: str | None  # None when ok
    ok: bool
    nbytes: int


@dataclass(frozen=True)
class FetchDone:
    """A fetch ended: the part is at ``path``, or no holder had a verified copy."""

    fetch_id: int
    ok: bool
    path: str | None
    holder: str | None
    tried: list     # [{"holder", "error"}] of holders that failed first


# ---------------------------------------------------------------- bulk threads -> replicator

@dataclass(frozen=True)
class Sent:
    """A part this daemon streamed (a push or a served fetch) ended."""

    xfer: int
    ok: bool
    error: str | None
    corrupted: bool = False  # serving: this daemon's own copy failed its checksum


@dataclass(frozen=True)
class Received:
    """A part streamed to this daemon (a replica or a fetched part) ended."""

    xfer: int
    kind: str           # "replica" or "fetch"
    ok: bool
    error: str | None
    path: str | None
    peer: str           # the sender's control address (or its key, if unknown)
    size: int
