"""Metrics: the status document as Prometheus text, parsed back with prometheus_client.

Documents come from the real ``RequestTable.snapshot`` (the producer of the status schema);
the textfile and the HTTP endpoint are real files and real sockets.
"""

import http.client
import os
import socket
import stat

import pytest

from ckptd.protocol import Hello
from ckptd.server.ranks import RankRegistry
from ckptd.server.requests import RequestTable, SaveRequest
from ckptd.metrics import (DURATION_BUCKETS, MetricsAddressError, MetricsExporter, SaveStats,
                           parse_listen_address, render, write_textfile)
from ckptd.protocol import Phase

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
                        "free_bytes": 3 << 18, "waiting_requests": 2, "pinned": False},
                  writers=[{"index": 0, "pid": 1, "alive": True, "jobs": 1},
                           {"index": 1, "pid": 2, "alive": False, "jobs": 0}],
                  peers=[], local_checkpoints=[])
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


def test_every_documented_family_is_rendered_and_parses(busy_ledger):
    stats = SaveStats()
    stats.observe(snapshot(busy_ledger)["requests"])
    fams = families(render(snapshot(busy_ledger), stats))
    expected = {
        "ckptd_up": "gauge", "ckptd_info": "gauge", "ckptd_start_time_seconds": "gauge",
        "ckptd_draining": "gauge", "ckptd_bytes_written": "counter", "ckptd_saves": "counter",
        "ckptd_save_duration_seconds": "histogram",
        "ckptd_last_success_timestamp_seconds": "gauge", "ckptd_requests_in_flight": "gauge",
        "ckptd_in_flight_bytes": "gauge", "ckptd_recent_errors": "gauge",
        "ckptd_staging_pool_size_bytes": "gauge", "ckptd_staging_pool_bytes": "gauge",
        "ckptd_staging_pool_waiting_requests": "gauge", "ckptd_ranks_registered": "gauge",
        "ckptd_writers": "gauge", "ckptd_replication_lag_seconds": "gauge", "ckptd_peers": "gauge",
        "ckptd_local_checkpoint_parts": "gauge", "ckptd_local_checkpoint_bytes": "gauge",
        "ckptd_local_part_copies": "gauge", "ckptd_local_parts_reduced_redundancy": "gauge",
        "ckptd_memory_tier_bytes": "gauge",
    }
    # prometheus_client strips the _total suffix from counter family names.
    assert {name: fam.type for name, fam in fams.items()} == expected
    for fam in fams.values():
        assert fam.documentation, f"{fam.name} has no HELP text"


def test_values_follow_the_status_document(busy_ledger):
    doc = snapshot(busy_ledger)
    stats = SaveStats()
    stats.observe(doc["requests"])
    fams = families(render(doc, stats))
    assert value(fams, "ckptd_up") == 1
    assert value(fams, "ckptd_bytes_written", "ckptd_bytes_written_total") == 4096 + 8192
    assert value(fams, "ckptd_saves", "ckptd_saves_total", outcome="done") == 2
    assert value(fams, "ckptd_saves", "ckptd_saves_total", outcome="failed") == 1
    assert value(fams, "ckptd_saves", "ckptd_saves_total", outcome="aborted") == 1
    assert value(fams, "ckptd_staging_pool_bytes", state="used") == 1 << 18
    assert value(fams, "ckptd_staging_pool_bytes", state="free") == 3 << 18
    assert value(fams, "ckptd_staging_pool_size_bytes") == 1 << 20
    assert value(fams, "ckptd_staging_pool_waiting_requests") == 2
    assert value(fams, "ckptd_ranks_registered") == 2
    assert value(fams, "ckptd_writers", state="alive") == 1
    assert value(fams, "ckptd_writers", state="dead") == 1
    assert value(fams, "ckptd_requests_in_flight", phase="writing") == 1
    assert value(fams, "ckptd_requests_in_flight", phase="waiting_for_pool") == 1
    assert value(fams, "ckptd_requests_in_flight", phase="staging") == 0
    assert value(fams, "ckptd_requests_in_flight", phase="replicating") == 0
    assert value(fams, "ckptd_in_flight_bytes", state="staged") == 6000
    assert value(fams, "ckptd_in_flight_bytes", state="written") == 300
    assert value(fams, "ckptd_recent_errors") == 1
    assert value(fams, "ckptd_replication_lag_seconds") == 0
    assert value(fams, "ckptd_last_success_timestamp_seconds") == 1040.0
    info = fams["ckptd_info"].samples[0].labels
    assert info == {"version": "0.1.0", "host": "node7", "socket": "/run/ckptd/x.sock"}


def test_duration_histogram_is_cumulative_and_counts_each_save_once(busy_ledger):
    stats = SaveStats()
    doc = snapshot(busy_ledger)
    for _ in range(3):  # the daemon offers the same requests on every tick
        stats.observe(doc["requests"])
    fams = families(render(doc, stats))
    buckets = {s.labels["le"]: s.value for s in fams["ckptd_save_duration_seconds"].samples
               if s.name.endswith("_bucket")}
    assert [float(b) for b in buckets if b != "+Inf"] == list(DURATION_BUCKETS)
    assert buckets["1.0"] == 0 and buckets["2.5"] == 1 and buckets["30.0"] == 1
    assert buckets["60.0"] == 2 and buckets["+Inf"] == 2
    counts = list(buckets.values())
    assert counts == sorted(counts), "histogram buckets must be cumulative"
    assert value(fams, "ckptd_save_duration_seconds", "ckptd_save_duration_seconds_count") == 2
    assert value(fams, "ckptd_save_duration_seconds",
                 "ckptd_save_duration_seconds_sum") == pytest.approx(41.5)


def test_a_request_that_finishes_later_is_counted_when_it_finishes():
    ledger = Ledger()
    r = request(ledger, Phase.WRITING, 10)
    stats = SaveStats()
    stats.observe([r.describe()])
    assert stats.count == 0
    r.bytes_written = 10
    r.phase, r.finished_at = Phase.DONE, 1005.0  # as the save lifecycle ends it
    stats.observe([r.describe()])
    stats.observe([r.describe()])
    assert stats.count == 1 and stats.last_success == r.finished_at


def peer(address: str, health: str = "up", lag_s: float = 0.0, sent: int = 0) -> dict:
    return {"address": address, "health": health, "lag_s": lag_s, "last_heard_s": 0.5,
            "bytes_sent": sent, "bytes_received": 7, "streams_ok": 3, "streams_failed": 1,
            "last_error": None}


def test_replication_metrics_follow_the_peers(busy_ledger):
    doc = snapshot(busy_ledger, peers=[peer("tcp://127.0.0.2:7740", lag_s=1.5, sent=100),
                                       peer("tcp://127.0.0.3:7740", "down", lag_s=7.0, sent=50)],
                   local_checkpoints=[{"kind": "own", "size": 10}, {"kind": "replica", "size": 30},
                                      {"kind": "replica", "size": 2}])
    fams = families(render(doc))
    assert value(fams, "ckptd_replication_lag_seconds") == 7.0
    assert value(fams, "ckptd_peers") == 2
    assert value(fams, "ckptd_peer_up", peer="tcp://127.0.0.2:7740") == 1
    assert value(fams, "ckptd_peer_up", peer="tcp://127.0.0.3:7740") == 0
    assert value(fams, "ckptd_replication_bytes_sent", "ckptd_replication_bytes_sent_total",
                 peer="tcp://127.0.0.3:7740") == 50
    assert value(fams, "ckptd_replication_bytes_received", "ckptd_replication_bytes_received_total",
                 peer="tcp://127.0.0.2:7740") == 7
    assert value(fams, "ckptd_replication_streams", "ckptd_replication_streams_total",
                 peer="tcp://127.0.0.2:7740", outcome="failed") == 1
    assert value(fams, "ckptd_local_checkpoint_parts", kind="replica") == 2
    assert value(fams, "ckptd_local_checkpoint_parts", kind="own") == 1
    assert value(fams, "ckptd_local_checkpoint_bytes") == 42


def test_without_replication_the_lag_is_zero_and_no_peer_series_exist(busy_ledger):
    fams = families(render(snapshot(busy_ledger)))
    assert value(fams, "ckptd_replication_lag_seconds") == 0
    assert "ckptd_peer_up" not in fams


def test_a_stopped_daemon_exports_only_up_zero():
    fams = families(render(None, const_labels={"slurm_job_id": "42"}))
    assert list(fams) == ["ckptd_up"]
    assert fams["ckptd_up"].samples[0].value == 0
    assert fams["ckptd_up"].samples[0].labels == {"slurm_job_id": "42"}


def test_constant_labels_and_awkward_values_survive_escaping(busy_ledger):
    awkward = 'a "quoted"\\path\nwith newline'
    doc = snapshot(busy_ledger, socket=awkward)
    fams = families(render(doc, const_labels={"slurm_job_id": "77"}))
    for fam in fams.values():
        for sample in fam.samples:
            assert sample.labels.get("slurm_job_id") == "77", sample
    assert fams["ckptd_info"].samples[0].labels["socket"] == awkward


def test_textfile_is_replaced_whole_and_readable_by_others(tmp_path):
    path = tmp_path / "ckptd.prom"
    write_textfile(str(path), "ckptd_up 1\n")
    with open(path) as reader:  # a reader that opened the old file keeps a whole old file
        write_textfile(str(path), "ckptd_up 0\n")
        assert reader.read() == "ckptd_up 1\n"
    assert path.read_text() == "ckptd_up 0\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(tmp_path) == ["ckptd.prom"], "temporary file left behind"


def test_textfile_in_a_missing_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_textfile(str(tmp_path / "missing" / "ckptd.prom"), "ckptd_up 1\n")


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)),
    ("127.0.0.5:0", ("127.0.0.5", 0)),
    ("localhost:9000", ("127.0.0.1", 9000)),
    ("[::1]:9464", ("::1", 9464)),
])
def test_loopback_addresses_are_accepted(text, expected):
    assert parse_listen_address(text) == expected


@pytest.mark.parametrize("text", ["0.0.0.0:9464", "10.1.2.3:9464", "[::]:9464"])
def test_non_loopback_addresses_are_refused_unless_allowed(text):
    with pytest.raises(MetricsAddressError, match="not a loopback address"):
        parse_listen_address(text)
    assert parse_listen_address(text, allow_remote=True)[1] == 9464


@pytest.mark.parametrize("text", ["9464", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000",
                                  "node7:9464", ":9464"])
def test_malformed_addresses_are_refused(text):
    with pytest.raises(MetricsAddressError):
        parse_listen_address(text)


def _get(address, path="/metrics"):
    connection = http.client.HTTPConnection(*address, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type"), response.read().decode()
    finally:
        connection.close()


def test_exporter_serves_and_writes_the_same_text_and_ends_with_up_zero(tmp_path, busy_ledger):
    textfile = tmp_path / "ckptd.prom"
    exporter = MetricsExporter(str(textfile), ("127.0.0.1", 0), {"slurm_job_id": "5"},
                               interval=3600)
    exporter.start()
    try:
        doc = snapshot(busy_ledger)
        exporter.tick(doc["requests"], lambda: doc)
        status_code, content_type, body = _get(exporter.bound_address)
        assert status_code == 200 and content_type.startswith("text/plain; version=0.0.4")
        assert body == textfile.read_text()
        fams = families(body)
        assert value(fams, "ckptd_saves", "ckptd_saves_total", outcome="done", slurm_job_id="5") == 2
        assert _get(exporter.bound_address, "/other")[0] == 404
        # Within the interval a tick counts requests but does not render again.
        exporter.tick(doc["requests"], lambda: pytest.fail("rendered before the interval"))
    finally:
        address = exporter.bound_address
        exporter.close()
    assert value(families(textfile.read_text()), "ckptd_up", slurm_job_id="5") == 0
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=5).close()


def test_exporter_survives_an_unwritable_textfile(tmp_path, busy_ledger, caplog):
    exporter = MetricsExporter(str(tmp_path / "missing" / "ckptd.prom"), interval=0)
    doc = snapshot(busy_ledger)
    exporter.tick(doc["requests"], lambda: doc)
    exporter.tick(doc["requests"], lambda: doc)
    warnings = [r for r in caplog.records if "metrics export failed" in r.getMessage()]
    assert len(warnings) == 1, "the same failure should be logged once, not every tick"
    assert value(families(exporter.text), "ckptd_up") == 1  # the endpoint text still updates


def test_exporter_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        exporter = MetricsExporter(listen=taken.getsockname())
        with pytest.raises(OSError, match="choose another --metrics-listen port"):
            exporter.start()


def test_redundancy_and_the_memory_tier_follow_the_status_document(busy_ledger):
    redundancy = [{"session": "job", "owner": 0, "iteration": 5, "wanted": 2,
                   "copies": ["tcp://a:1", "tcp://b:1"], "reachable": 2, "reduced": False,
                   "failed": {}},
                  {"session": "job", "owner": 1, "iteration": 5, "wanted": 2,
                   "copies": ["tcp://a:1"], "reachable": 1, "reduced": True,
                   "failed": {"tcp://b:1": "no progress"}}]
    fams = families(render(snapshot(busy_ledger, redundancy=redundancy,
                                    memory_tier={"parts": 2, "bytes": 8192})))
    assert value(fams, "ckptd_local_part_copies", session="job", owner="0") == 2
    assert value(fams, "ckptd_local_part_copies", session="job", owner="1") == 1
    assert value(fams, "ckptd_local_parts_reduced_redundancy") == 1
    assert value(fams, "ckptd_memory_tier_bytes") == 8192
