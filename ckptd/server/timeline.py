"""The timeline of recent saves: a bounded ring of their spans, as Chrome trace events.

Owns the ring (:class:`Timeline`): when a save request of a rank ends, its spans are
taken from what the daemon already recorded about it (when it arrived, got its staging
space, was staged, each file's write and its making durable by which writer, each
replica's stream) and kept under the save they belong to: the checkpoint path (for a
local part, its iteration directory), so every rank's and every chunk's requests of one
save land in one record. A trainer may add its own spans (its blocking time, planning,
finalize) with a ``trace_spans`` message naming its request ids. ``ckptd trace`` asks
for the last N records and writes them as trace-event JSON (``ph`` ``X``/``i``/``M``,
``ts``/``dur`` in wall-clock microseconds, one clock for the daemon, its writers and the
trainers of the node).

Rows: one process per trainer rank (its pid) with a ``trainer`` thread (the trainer's
spans) and a ``staging`` thread (the copy into the pool, by the trainer or the daemon's
device stager); one process for the daemon with a thread per writer (each file: its
``write`` then ``fsync``, the latter covering fsync, checksum record, rename and
directory fsync) and a thread per replication peer.

No I/O, no sockets: fed by the request table, read by the serve loop.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptd import knobs
from ckptd.protocol import Phase, SaveFormat

WRITER_TID_BASE = 100
PEER_TID_BASE = 200
TRAINER_TID, STAGING_TID = 1, 2


def _us(seconds: float) -> int:
    return int(round(seconds * 1_000_000))


@dataclass
class SaveRecord:
    """The spans of one save (every rank, every chunk)."""

    key: str
    started_at: float
    ended_at: float
    events: list = field(default_factory=list)
    request_ids: set = field(default_factory=set)
    ranks: dict = field(default_factory=dict)    # rank -> trainer pid
    peers: dict = field(default_factory=dict)    # peer address -> tid
    outcomes: dict = field(default_factory=dict)  # rank -> phase (the worst of its requests)

    def span(self, name: str, start: float, end: float, pid: int, tid: int,
             cat: str, **args) -> None:
        """Add a complete event (clamped: a clock step never makes a negative duration)."""
        self.events.append({"name": name, "cat": cat, "ph": "X", "ts": _us(start),
                            "dur": max(0, _us(end) - _us(start)), "pid": pid, "tid": tid,
                            "args": args})
        self.started_at, self.ended_at = min(self.started_at, start), max(self.ended_at, end)


def save_key(request) -> str:
    """The save a request belongs to: its checkpoint path (a local part: its iteration)."""
    if request.format == SaveFormat.LOCAL:
        return os.path.dirname(request.path)
    return request.path


class Timeline:
    """The spans of the last saves (bounded by the ``TRACE_SAVES`` knob)."""

    def __init__(self, daemon_pid: int | None = None) -> None:
        self.daemon_pid = daemon_pid or os.getpid()
        self._records: OrderedDict[str, SaveRecord] = OrderedDict()
        self._by_request: dict[int, SaveRecord] = {}

    def record(self, request, trainer_pid: int | None) -> None:
        """Take the spans of ``request``, which just ended."""
        key = save_key(request)
        record = self._records.get(key)
        if record is None or self._later_save(record, request):
            record = SaveRecord(key, request.created_at, request.created_at)
            self._records.pop(key, None)
            self._records[key] = record
        self._records.move_to_end(key)
        record.request_ids.add(request.id)
        self._by_request[request.id] = record
        pid = trainer_pid or -1 - request.rank  # a rank whose pid is unknown keeps a row
        record.ranks[request.rank] = pid
        worst = record.outcomes.get(request.rank, Phase.DONE)
        record.outcomes[request.rank] = request.phase if request.phase != Phase.DONE else worst
        self._request_spans(record, request, pid)
        self._trim()

    @staticmethod
    def _later_save(record: SaveRecord, request) -> bool:
        """Whether ``request`` belongs to a later save of the record's path (a file saved
        over each epoch): its rank already ended a request there before this one arrived.
        A rank that arrives after the others ended is still the same save (ranks do not
        start a save together, and a fast rank's request may end before a slow rank's
        starts)."""
        return request.rank in record.ranks and request.created_at > record.ended_at

    def _request_spans(self, record: SaveRecord, request, pid: int) -> None:
        common = {"request": request.id, "rank": request.rank, "path": request.path}
        end = request.finished_at or request.created_at
        granted = request.granted_at or request.created_at
        if request.granted_at is not None:
            record.span("waiting for staging space", request.created_at, granted, pid,
                        STAGING_TID, "staging", **common)
        copy = "device copy" if request.transport_bytes.get("cuda") else "copy"
        staged = request.staged_at or end
        record.span(f"staging ({copy})", granted, staged, pid, STAGING_TID, "staging",
                    bytes=request.bytes_total, **common)
        for written in request.written:
            timing = written.get("timing")
            if not timing:
                continue
            tid = WRITER_TID_BASE + timing["writer"]
            name = os.path.basename(written["path"])
            record.span(f"write {name}", timing["started_at"], timing["synced_at"],
                        self.daemon_pid, tid, "write", bytes=written.get("size", 0), **common)
            record.span(f"fsync {name}", timing["synced_at"], timing["ended_at"],
                        self.daemon_pid, tid, "fsync", **common)
        if request.replicas is not None:
            for address, holder in request.replicas.holders.items():
                if holder.get("started_at") is None:
                    continue
                tid = record.peers.setdefault(address, PEER_TID_BASE + len(record.peers))
                record.span(f"replicate rank {request.rank} -> {address}",
                            holder["started_at"], holder.get("ended_at") or end,
                            self.daemon_pid, tid, "replication", state=holder["state"],
                            bytes=holder.get("bytes", 0), **common)
        record.events.append({"name": f"rank {request.rank} {request.phase}", "cat": "outcome",
                              "ph": "i", "s": "p", "ts": _us(end), "pid": pid,
                              "tid": STAGING_TID, "args": {**common, "error": request.error}})
        record.ended_at = max(record.ended_at, end)

    def add_file_commit(self, path: str, writer: int, started_at: float, synced_at: float,
                        ended_at: float) -> None:
        """A small file committed for a save (DCP ``.metadata``, the coordinator's
        finalize): shown on its writer's row, under the save of its directory."""
        record = self._records.get(os.path.dirname(path))
        if record is None:
            return
        name = os.path.basename(path)
        tid = WRITER_TID_BASE + writer
        record.span(f"write {name}", started_at, synced_at, self.daemon_pid, tid, "finalize",
                    path=path)
        record.span(f"fsync {name}", synced_at, ended_at, self.daemon_pid, tid, "finalize",
                    path=path)

    def add_trainer_spans(self, request_ids: list[int], rank: int, pid: int,
                          spans: list) -> bool:
        """Spans a trainer measured itself (``[name, start, end]`` wall-clock seconds)
        for the save of ``request_ids``; False when that save is no longer kept."""
        record = next((self._by_request[r] for r in request_ids if r in self._by_request), None)
        if record is None:
            return False
        record.ranks.setdefault(rank, pid)
        for name, start, end in spans:
            record.span(str(name), float(start), float(end), record.ranks[rank], TRAINER_TID,
                        "trainer", rank=rank)
        return True

    def _trim(self) -> None:
        while len(self._records) > knobs.TRACE_SAVES.get():
            _, dropped = self._records.popitem(last=False)
            for request_id in dropped.request_ids:
                self._by_request.pop(request_id, None)

    def trace_events(self, last: int) -> list[dict]:
        """The last ``last`` saves as trace events, with the rows' names."""
        records = list(self._records.values())[-last:] if last > 0 else []
        events: list[dict] = []
        named: set = set()

        def name_row(pid: int, tid: int | None, name: str) -> None:
            if (pid, tid) in named:
                return
            named.add((pid, tid))
            kind = "process_name" if tid is None else "thread_name"
            events.append({"name": kind, "ph": "M", "pid": pid, "tid": tid or 0,
                           "args": {"name": name}})

        name_row(self.daemon_pid, None, f"ckptd (pid {self.daemon_pid})")
        for record in records:
            for rank, pid in record.ranks.items():
                name_row(pid, None, f"rank {rank} (pid {pid})" if pid > 0 else f"rank {rank}")
                name_row(pid, TRAINER_TID, "trainer")
                name_row(pid, STAGING_TID, "staging")
            for address, tid in record.peers.items():
                name_row(self.daemon_pid, tid, f"replication to {address}")
            for event in record.events:
                if event["pid"] == self.daemon_pid and WRITER_TID_BASE <= event["tid"] < PEER_TID_BASE:
                    name_row(self.daemon_pid, event["tid"],
                             f"writer {event['tid'] - WRITER_TID_BASE}")
            events.append({"name": f"save {record.key}", "cat": "save", "ph": "X",
                           "ts": _us(record.started_at),
                           "dur": max(0, _us(record.ended_at) - _us(record.started_at)),
                           "pid": self.daemon_pid, "tid": 0,
                           "args": {"path": record.key, "outcomes": record.outcomes}})
            events.extend(record.events)
        name_row(self.daemon_pid, 0, "saves")
        return events
