"""Shared by the metrics tests: status documents from the real ``RequestTable.snapshot``
(the producer of the status schema), and exposition text parsed back with
prometheus_client's own parser."""

import os

import pytest

from ckptd.protocol import Hello, Phase
from ckptd.server.ranks import RankRegistry
from ckptd.server.requests import RequestTable, SaveRequest

parser = pytest.importorskip(
    "prometheus_client.parser",
    reason="prometheus-client is in the test extra: pip install -e '.[test]'")


def families(text: str) -> dict:
    """Parse exposition text; name -> family (fails on any syntax error)."""
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    matches = [s.value for s in fams[family].samples
               if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, f"{sample or family}{labels}: {matches}"
    return matches[0]


class Ledger:
    """The daemon's books as the status document sees them: requests and ranks."""

    def __init__(self) -> None:
        self.table = RequestTable()
        self.ranks = RankRegistry()

    def record_outcome(self, request: SaveRequest) -> None:
        self.table.record_outcome(request)

    def snapshot(self, **fields) -> dict:
        in_flight = lambda routing_id: len(self.table.of_connection(routing_id))
        return self.table.snapshot(self.ranks.describe(in_flight), **fields)


def request(ledger: Ledger, phase: str, nbytes: int, written: int = 0, rank: int = 0,
            created: float = 1000.0, duration: float | None = None) -> SaveRequest:
    r = SaveRequest(id=ledger.table.new_id(), rank=rank, routing_id=b"id%d" % rank,
                    format="torch", path=f"/ckpt/{rank}.pt", buffers=[["uint8", [nbytes], nbytes]],
                    offsets=[0], extent_length=nbytes, phase=phase, bytes_written=written,
                    created_at=created)
    if duration is not None:
        r.finished_at = created + duration
    ledger.table.add(r)
    return r


def snapshot(ledger: Ledger, **overrides) -> dict:
    fields = dict(version="0.1.0", pid=os.getpid(), host="node7", socket="/run/ckptd/x.sock",
                  started_at=900.0, uptime_s=200.0, state="serving", roots=["/ckpt"],
                  pool={"path": "/dev/shm/p", "size_bytes": 1 << 20, "used_bytes": 1 << 18,
                        "free_bytes": 3 << 18, "waiting_requests": 2, "pinned": False,
                        "directory": "/dev/shm", "filesystem": "tmpfs", "huge": "always",
                        "huge_page_bytes": 1 << 21},
                  writers=[{"index": 0, "pid": 1, "alive": True, "jobs": 1},
                           {"index": 1, "pid": 2, "alive": False, "jobs": 0}],
                  held_polls={"held": 3, "connections": 2}, peers=[], local_checkpoints=[])
    fields.update(overrides)
    return ledger.snapshot(**fields)


@pytest.fixture
def busy_ledger() -> Ledger:
    """Two finished saves (1.5 s and 40 s), one failure, one abort, two in flight."""
    ledger = Ledger()
    ledger.ranks.register(b"id0", Hello(0, os.getpid(), 2))
    ledger.ranks.register(b"id1", Hello(1, os.getpid(), 2))
    for duration, nbytes in ((1.5, 4096), (40.0, 8192)):
        done = request(ledger, Phase.DONE, nbytes, written=nbytes, duration=duration)
        ledger.record_outcome(done)
    failed = request(ledger, Phase.FAILED, 100, duration=2.0)
    failed.errors.append({"rank": 0, "path": failed.path, "errno": 28,
                          "message": "rank 0: writing /ckpt/0.pt failed: errno 28 No space left"})
    ledger.record_outcome(failed)
    request(ledger, Phase.ABORTED, 100, duration=0.5)
    staged = request(ledger, Phase.WRITING, 1000, written=300, rank=1)
    staged.staged_at = 1001.0
    request(ledger, Phase.WAITING_FOR_POOL, 5000, rank=1)
    return ledger


def peer(address: str, health: str = "up", lag_s: float = 0.0, sent: int = 0) -> dict:
    return {"address": address, "health": health, "lag_s": lag_s, "last_heard_s": 0.5,
            "bytes_sent": sent, "bytes_received": 7, "streams_ok": 3, "streams_failed": 1,
            "last_error": None}
