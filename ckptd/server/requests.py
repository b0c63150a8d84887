"""The daemon's books: save requests, their replicas, and the history status shows.

Owns :class:`SaveRequest` (everything about one save of one rank, from reservation to
durable files and replicas), :class:`ReplicaSet` (where a local part's copies went) and
:class:`RequestTable` (requests not yet forgotten, recent history, totals, recent
failures, and the status document built from them, schema :data:`STATUS_SCHEMA`).

No sockets, no I/O. Fields are read by anyone; ``phase``, the lease and the counters of
progress are written only by :class:`ckptd.server.lifecycle.SaveLifecycle`.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from ckptd import knobs
from ckptd.protocol import ErrorCode, Phase, RequestState, WrittenFile
from ckptd.server.phase_durations import PhaseDurations
from ckptd.server.stale import StaleSaveDetector
from ckptd.server.timeline import Timeline

STATUS_SCHEMA = 1


@dataclass
class ReplicaSet:
    """The replicas a local part should have, and how each holder's stream ended.

    Attributes
    ----------
    wanted : int
        Copies the clique asks for besides the owner's own.
    holders : dict
        Holder address -> ``{"state": "sending"|"done"|"failed", "error", "bytes"}``.
    """

    wanted: int
    holders: dict = field(default_factory=dict)

    @classmethod
    def sending_to(cls, wanted: int, addresses: list[str]) -> "ReplicaSet":
        """Replicas about to stream to ``addresses``."""
        now = time.time()
        return cls(wanted, {a: {"state": "sending", "error": None, "bytes": 0, "started_at": now,
                                "ended_at": None} for a in addresses})

    def finished(self, holder: str, ok: bool, error: str | None, nbytes: int) -> None:
        """Record how the stream to ``holder`` ended."""
        if holder in self.holders:
            self.holders[holder].update(state="done" if ok else "failed", error=error,
                                        bytes=nbytes, ended_at=time.time())

    @property
    def sending(self) -> bool:
        """Whether a stream is still running."""
        return any(h["state"] == "sending" for h in self.holders.values())

    @property
    def failures(self) -> dict:
        """Holder -> reason, for the streams that failed."""
        return {a: h["error"] for a, h in self.holders.items() if h["state"] == "failed"}

    @property
    def reduced_redundancy(self) -> bool:
        """Fewer holders than wanted, or a holder failed."""
        return len(self.holders) < self.wanted or bool(self.failures)

    def to_wire(self) -> dict:
        """As the poll reply and the status document show it."""
        return {"wanted": self.wanted, "reduced_redundancy": self.reduced_redundancy,
                "holders": self.holders}


@dataclass
class SaveRequest:
    """One save of one rank, from reservation to durable files."""

    id: int
    rank: int
    routing_id: bytes
    format: str
    path: str
    buffers: list  # [dtype, shape, nbytes] in staging order; never changes once built
    offsets: list  # relative to the extent, from protocol.layout_extent
    extent_length: int
    skeleton: bytes = b""
    files: list = field(default_factory=list)  # DCP: [name, [buffer indices]]
    stock_files: bool = False      # protocol.STOCK_FILES: torch's exact files, no records
    cuda_specs: list | None = None  # per buffer: a CUDA IPC spec (daemon copies) or None
    copiers: tuple = ()            # who fills the extent (holds on it until they report)
    written_early: bool = False    # its writers started while the trainer still copied
    session: str | None = None     # local parts: the session and iteration
    iteration: int | None = None
    phase: str = Phase.STAGING
    near: int | None = None        # the NUMA node its bytes come from (None: anywhere)
    ipc_kept: list = field(default_factory=list)  # buffers whose CUDA export stays open
    lease: object | None = None    # ExtentLease while the request holds staging space
    pending_reply: object | None = None  # a Call still owed an answer (deferred STAGE)
    jobs_pending: int = 0
    bytes_written: int = 0
    written: list = field(default_factory=list)  # results of finished jobs
    #: path -> where the file it replaces is kept until the save ends (put back if it fails)
    previous: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    replicas: ReplicaSet | None = None
    placements: dict | None = None  # tiered DCP: where the writers will put each item
    stage_key: str | None = None   # tiered saves: its name in the stage directory
    stage_message: int | None = None  # the id of the STAGE message that asked for it
    flush: object | None = None    # tiered saves: its ckptd.tiers.flusher.FlushJob
    trainer_pid: int | None = None  # for the timeline's rows
    created_at: float = field(default_factory=time.time)
    granted_at: float | None = None  # when it got staging space it had to wait for
    staged_at: float | None = None
    local_durable_at: float | None = None  # tiered: when its stage-directory copy was durable
    finished_at: float | None = None
    stale_of: str | None = None  # the previous save whose bytes this one repeats
    staging_since: float | None = None  # when it got its staging space
    jobs: list = field(default_factory=list)  # its writer jobs not answered yet (WriteJob)
    forget_when_written: bool = False  # FORGET came while its writers still worked
    progress_at: float = field(default_factory=time.monotonic)  # last step of its own

    def moved(self) -> None:
        """The request took a step (space, a copy, a file, a replica): not stuck."""
        self.progress_at = time.monotonic()

    def progress(self) -> dict:
        """How far it is and whether it is stuck: ``bytes_done`` (files finished plus the
        bytes of files being written), ``slowest_file`` (the file in flight whose last
        progress is oldest), ``stalled_s`` (seconds since the request or any of its files
        last moved) and ``stuck`` (in flight and stalled past :data:`knobs.STUCK_AFTER`)."""
        now = time.monotonic()
        started = [j for j in self.jobs if j.progress_at is not None]
        slowest = min(started, key=lambda j: j.progress_at, default=None)
        last = max([self.progress_at] + [j.progress_at for j in started])
        stalled = 0.0 if self.finished else now - last
        return {
            "bytes_done": self.bytes_written + sum(j.bytes_done for j in self.jobs),
            "slowest_file": None if slowest is None else {
                "rank": self.rank, "path": slowest.path, "phase": slowest.phase,
                "bytes_done": slowest.bytes_done, "bytes_total": slowest.nbytes,
                "age_s": now - slowest.progress_at},
            "stalled_s": stalled,
            "stuck": (not self.finished and self.phase != Phase.WAITING_FOR_POOL
                      and stalled > knobs.STUCK_AFTER.get()),
        }

    # The two sums below are taken once: ``buffers`` and ``cuda_specs`` never change
    # after the request is built, and every poll (a trainer polls a save in flight every
    # few milliseconds) and status entry reads them, over thousands of buffers.
    @cached_property
    def bytes_total(self) -> int:
        """Bytes this request stages."""
        return sum(b[2] for b in self.buffers)

    @cached_property
    def _cuda_bytes(self) -> int:
        if not self.cuda_specs:
            return 0
        return sum(b[2] for b, spec in zip(self.buffers, self.cuda_specs) if spec is not None)

    @property
    def transport_bytes(self) -> dict:
        """Bytes copied by the trainer through shared memory, and by the daemon from CUDA."""
        return {"shm": self.bytes_total - self._cuda_bytes, "cuda": self._cuda_bytes}

    def transport_summary(self) -> str:
        """How the bytes travel, for log lines."""
        moved = self.transport_bytes
        return ", ".join(f"{k} {v} bytes" for k, v in moved.items() if v) or "empty"

    @property
    def tiered(self) -> bool:
        """Whether this save goes through the stage directory."""
        return self.stage_key is not None

    @property
    def error(self) -> str | None:
        """The first failure, as one line."""
        return self.errors[0]["message"] if self.errors else None

    @property
    def error_code(self) -> str | None:
        """The protocol error code of the first failure, when it has a specific one."""
        return self.errors[0].get("code") if self.errors else None

    @property
    def failure_code(self) -> str:
        """The code a trainer's call about this ended request is refused with."""
        return self.error_code or (ErrorCode.ABORTED if self.phase == Phase.ABORTED
                                   else ErrorCode.INTERNAL)

    @property
    def extent(self):
        """The staging extent while the request holds one, else ``None``."""
        return self.lease.extent if self.lease is not None and not self.lease.released else None

    @property
    def finished(self) -> bool:
        """Whether the outcome is decided (it may still hold staging space)."""
        return self.phase in Phase.FINISHED

    def add_error(self, message: str, path: str | None = None, errno: int | None = None,
                  code: str | None = None) -> None:
        """Record a failure (prefixed with the rank, as every rank will read it); ``code``
        is a :class:`ckptd.protocol.ErrorCode` the trainer acts on (e.g. a retry)."""
        entry = {"rank": self.rank, "path": path or self.path, "errno": errno,
                 "message": f"rank {self.rank}: {message}"}
        if code is not None:
            entry["code"] = code
        self.errors.append(entry)

    def describe(self) -> dict:
        """This request's status entry."""
        return {
            "id": self.id, "rank": self.rank, "format": self.format, "path": self.path,
            "phase": self.phase, "bytes_total": self.bytes_total,
            "bytes_written": self.bytes_written, "created_at": self.created_at,
            "staged_at": self.staged_at, "finished_at": self.finished_at,
            "local_durable_at": self.local_durable_at,
            "error": self.error, "transport_bytes": self.transport_bytes,
            "stale_of": self.stale_of, "written_early": self.written_early,
            "replication": self.replicas.to_wire() if self.replicas is not None else None,
            "flush": self.flush_progress(),
            **self.progress(),
        }

    def flush_progress(self) -> dict | None:
        """``attempt``, ``next_retry_at``, ``bytes_done``, ``bytes_total``, ``target`` of
        a flushing save; None in every other phase."""
        if self.phase != Phase.FLUSHING or self.flush is None:
            return None
        progress = self.flush.progress()
        progress["target"] = self.path
        return progress

    def poll_entry(self) -> RequestState:
        """What ``poll`` answers about this request."""
        return RequestState(
            phase=self.phase, bytes_total=self.bytes_total, bytes_written=self.bytes_written,
            error=self.error, errors=list(self.errors), transport_bytes=self.transport_bytes,
            written=[WrittenFile(**entry) for entry in self.written]
            if self.phase == Phase.DONE else [],
            stale_of=self.stale_of if self.phase == Phase.DONE else None,
            replication=self.replicas.to_wire() if self.replicas is not None else None,
            flush=self.flush_progress() if self.tiered else None)


class RequestTable:
    """Save requests by id, the recent history, and the daemon's totals."""

    def __init__(self) -> None:
        self.requests: dict[int, SaveRequest] = {}
        self.recent: deque = deque(maxlen=knobs.RECENT_REQUESTS.get())
        self.errors: deque = deque(maxlen=knobs.RECENT_ERRORS.get())
        self.saves_done = 0
        self.saves_failed = 0
        self.bytes_written = 0
        self._next_id = 1
        self.timeline = Timeline()
        self.stale = StaleSaveDetector()
        self.stale_saves = 0
        self.phases = PhaseDurations()
        # Forgotten requests whose extent is still held (a device copy, a writer job or a
        # push still answers): out of sight, but their holders' reports find them here.
        self._retiring: dict[int, SaveRequest] = {}

    @property
    def next_id(self) -> int:
        """The id :meth:`new_id` gives next."""
        return self._next_id

    def new_id(self) -> int:
        """A request id unique for this daemon's life."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        return request_id

    def add(self, request: SaveRequest) -> None:
        """Start tracking ``request``."""
        self.requests[request.id] = request

    def get(self, request_id) -> SaveRequest | None:
        """The request with this id, if not forgotten."""
        return self.requests.get(request_id)

    def find(self, request_id) -> SaveRequest | None:
        """The request with this id, also if forgotten while its extent is still held."""
        return self.requests.get(request_id) or self._retiring.get(request_id)

    def space_released(self, request: SaveRequest) -> None:
        """``request`` gave its extent back: nothing will report about it any more."""
        self._retiring.pop(request.id, None)

    def in_flight(self) -> list[SaveRequest]:
        """Requests whose outcome is not decided yet."""
        return [r for r in self.requests.values() if not r.finished]

    def holding_space(self) -> list[SaveRequest]:
        """Requests that still hold staging space (finished or not, forgotten or not)."""
        return [r for r in (*self.requests.values(), *self._retiring.values())
                if r.extent is not None]

    def of_connection(self, routing_id: bytes) -> list[SaveRequest]:
        """Unfinished requests of one client connection."""
        return [r for r in self.in_flight() if r.routing_id == routing_id]

    def record_outcome(self, request: SaveRequest) -> None:
        """Count a finished request, remember its failure, if any, its spans and how long
        each of its phases took."""
        self.timeline.record(request, request.trainer_pid)
        self.phases.observe_request(request)
        if request.phase == Phase.DONE:
            self.saves_done += 1
            self.bytes_written += request.bytes_written
            request.stale_of = self.stale.check(request)
            self.stale_saves += request.stale_of is not None
        elif request.phase == Phase.FAILED:
            self.saves_failed += 1
            self.errors.append({"time": request.finished_at, "request": request.id,
                                "rank": request.rank, "path": request.path,
                                "error": request.error})

    def forget(self, request_id: int) -> SaveRequest | None:
        """Drop a request from the active table, keeping it in history."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.recent.append(request)
            if request.extent is not None:
                self._retiring[request_id] = request
        return request

    def forget_unclaimed(self, now: float) -> None:
        """Drop finished requests nobody polled for :data:`knobs.UNCLAIMED_RESULT_SECONDS`."""
        limit = knobs.UNCLAIMED_RESULT_SECONDS.get()
        for request in list(self.requests.values()):
            if request.finished_at and request.extent is None and now - request.finished_at > limit:
                self.forget(request.id)

    def snapshot(self, ranks: list[dict], **daemon_fields) -> dict:
        """The status document (schema :data:`STATUS_SCHEMA`)."""
        shown = list(self.requests.values()) + [r for r in self.recent
                                                if r.id not in self.requests]
        shown.sort(key=lambda r: r.id)
        return {
            "schema": STATUS_SCHEMA,
            **daemon_fields,
            "ranks": ranks,
            "requests": [r.describe() for r in shown[-knobs.RECENT_REQUESTS.get():]],
            "saves": saves_in_flight(self.in_flight()),
            "totals": {"saves_done": self.saves_done, "saves_failed": self.saves_failed,
                       "bytes_written": self.bytes_written, "stale_saves": self.stale_saves},
            "recent_errors": list(self.errors),
            "phase_durations": self.phases.describe(),
        }


def saves_in_flight(requests: list[SaveRequest]) -> list[dict]:
    """One entry per save in flight, all ranks' requests of it together (one path, or one
    local iteration): each rank's phase, bytes, the slowest file, and whether it is stuck."""
    groups: dict[tuple, list[SaveRequest]] = {}
    for request in requests:
        key = ((request.format, request.session, request.iteration)
               if request.format == "local" else (request.format, request.path))
        groups.setdefault(key, []).append(request)
    saves = []
    for members in groups.values():
        members.sort(key=lambda r: r.rank)
        progress = [r.progress() for r in members]
        slow = [p["slowest_file"] for p in progress if p["slowest_file"] is not None]
        saves.append({
            "path": members[0].path if members[0].format != "local" else None,
            "format": members[0].format, "iteration": members[0].iteration,
            "requests": [r.id for r in members],
            "phases": {str(r.rank): r.phase for r in members},
            "bytes_done": sum(p["bytes_done"] for p in progress),
            "bytes_total": sum(r.bytes_total for r in members),
            "created_at": min(r.created_at for r in members),
            "slowest_file": max(slow, key=lambda f: f["age_s"], default=None),
            "stalled_s": max(p["stalled_s"] for p in progress),
            "stuck": any(p["stuck"] for p in progress),
        })
    return saves


def host_name() -> str:
    """This node's short host name."""
    return os.uname().nodename.split(".")[0]
