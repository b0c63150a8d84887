"""The daemon's books: registered ranks, save requests and their phases, recent history.

Plain dataclasses plus the status snapshot built from them (a stable schema, version
:data:`STATUS_SCHEMA`, that ``ckptd status --json`` prints as is). Holds no sockets and
does no I/O; the serve loop mutates it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

from ckptd.pool import Extent
from ckptd.protocol import Phase

STATUS_SCHEMA = 1
RECENT_REQUESTS = 32
RECENT_ERRORS = 16


@dataclass
class RankInfo:
    """One trainer process registered with the daemon."""

    identity: bytes
    rank: int
    pid: int
    world_size: int
    registered_at: float = field(default_factory=time.time)

    def is_alive(self) -> bool:
        """Whether the trainer process still exists (zombies count as gone)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        return state not in ("Z", "X")


@dataclass
class SaveRequest:
    """One save of one rank, from reservation to durable files."""

    id: int
    rank: int
    identity: bytes
    format: str
    path: str
    buffers: list  # [dtype, shape, nbytes] in staging order
    offsets: list  # relative to the extent, from protocol.layout_extent
    extent_length: int
    skeleton: bytes = b""
    files: list = field(default_factory=list)  # DCP: [name, [buffer indices]]
    transport: str = "shm"
    stock_files: bool = False  # protocol.STOCK_FILES: torch's exact files, no sidecars
    phase: str = Phase.STAGING
    extent: Extent | None = None
    reply_to: tuple | None = None  # (identity, msg id) of a reply still owed
    device_copy_pending: bool = False  # the CUDA staging thread is copying into the extent
    jobs_pending: int = 0
    bytes_written: int = 0
    written: list = field(default_factory=list)  # results of finished jobs
    errors: list = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    staged_at: float | None = None
    finished_at: float | None = None
    local: dict | None = None  # local checkpoints: {"session", "iteration"}
    replication: dict | None = None  # local checkpoints: holders, states, reduced_redundancy

    @property
    def bytes_total(self) -> int:
        """Bytes this request stages."""
        return sum(b[2] for b in self.buffers)

    @property
    def error(self) -> str | None:
        """The first failure, as one line."""
        return self.errors[0]["message"] if self.errors else None

    def finish(self, phase: str) -> None:
        """Enter a final phase."""
        self.phase = phase
        self.finished_at = time.time()

    def describe(self) -> dict:
        """This request's status entry."""
        return {
            "id": self.id, "rank": self.rank, "format": self.format, "path": self.path,
            "phase": self.phase, "bytes_total": self.bytes_total,
            "bytes_written": self.bytes_written, "created_at": self.created_at,
            "staged_at": self.staged_at, "finished_at": self.finished_at,
            "error": self.error, "replication": self.replication,
        }


@dataclass
class Ledger:
    """Everything the daemon knows about its clients and their saves."""

    ranks: dict = field(default_factory=dict)       # identity -> RankInfo
    requests: dict = field(default_factory=dict)    # id -> SaveRequest (not yet forgotten)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    errors: deque = field(default_factory=lambda: deque(maxlen=RECENT_ERRORS))
    saves_done: int = 0
    saves_failed: int = 0
    bytes_written: int = 0
    _next_id: int = 1

    def new_request_id(self) -> int:
        """A request id unique for this daemon's life."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        return request_id

    def in_flight(self) -> list:
        """Requests that still hold staging space or writers."""
        return [r for r in self.requests.values() if r.phase not in Phase.FINISHED]

    def record_outcome(self, request: SaveRequest) -> None:
        """Count a finished request and remember its failure, if any."""
        if request.phase == Phase.DONE:
            self.saves_done += 1
            self.bytes_written += request.bytes_written
        elif request.phase == Phase.FAILED:
            self.saves_failed += 1
            self.errors.append({"time": request.finished_at, "request": request.id,
                                "rank": request.rank, "path": request.path,
                                "error": request.error})

    def forget(self, request_id: int) -> SaveRequest | None:
        """Drop a finished request from the active table, keeping it in history."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.recent.append(request)
        return request

    def snapshot(self, **daemon_fields) -> dict:
        """The status document (schema :data:`STATUS_SCHEMA`)."""
        shown = list(self.requests.values()) + [r for r in self.recent
                                                if r.id not in self.requests]
        shown.sort(key=lambda r: r.id)
        return {
            "schema": STATUS_SCHEMA,
            **daemon_fields,
            "ranks": [{"rank": r.rank, "pid": r.pid, "alive": r.is_alive(),
                       "world_size": r.world_size, "registered_at": r.registered_at,
                       "requests_in_flight": sum(1 for q in self.in_flight()
                                                 if q.identity == r.identity)}
                      for r in sorted(self.ranks.values(), key=lambda r: r.rank)],
            "requests": [r.describe() for r in shown[-RECENT_REQUESTS:]],
            "totals": {"saves_done": self.saves_done, "saves_failed": self.saves_failed,
                       "bytes_written": self.bytes_written},
            "recent_errors": list(self.errors),
        }


def host_name() -> str:
    """This node's short host name."""
    return os.uname().nodename.split(".")[0]
