"""Phase-duration histograms: fed from the daemon's books (a real ``RequestTable``), carried
by the status document, rendered as one Prometheus histogram family with phase and peer
labels, parsed back with prometheus_client's own parser."""

import pytest

from ckptd.metrics import render
from ckptd.protocol import Phase
from ckptd.server.phase_durations import PHASE_BUCKETS, PhaseDurations
from ckptd.server.requests import ReplicaSet

from metrics_fixtures import Ledger, families, request, snapshot, value


def finished_local_part(ledger: Ledger):
    """A part staged in 0.2 s, its file written in 1.5 s and made durable in 0.03 s,
    streamed to one peer in 4 s (the other stream failed)."""
    part = request(ledger, Phase.DONE, 4096, written=4096, duration=10.0)
    part.staging_since, part.staged_at = 1000.0, 1000.2
    part.written = [{"path": "/l/rank_0.part", "size": 4096,
                     "timing": {"writer": 0, "started_at": 1000.2, "synced_at": 1001.7,
                                "ended_at": 1001.73}}]
    part.replicas = ReplicaSet(2, {
        "tcp://10.0.0.2:7740": {"state": "done", "error": None, "bytes": 4096,
                                "started_at": 1000.2, "ended_at": 1004.2},
        "tcp://10.0.0.3:7740": {"state": "failed", "error": "peer down", "bytes": 0,
                                "started_at": 1000.2, "ended_at": 1030.2}})
    return part


def test_a_finished_request_feeds_each_phase_that_ran_to_its_end():
    ledger = Ledger()
    ledger.record_outcome(finished_local_part(ledger))
    ledger.table.phases.observe("commit", 0.004)
    doc = snapshot(ledger)
    series = {(s["phase"], s["peer"]): s for s in doc["phase_durations"]["series"]}
    assert set(series) == {("staging", None), ("write", None), ("fsync", None),
                           ("replication", "tcp://10.0.0.2:7740"), ("commit", None)}
    assert series["staging", None]["sum"] == pytest.approx(0.2)
    assert series["write", None]["counts"][PHASE_BUCKETS.index(2.5)] == 1
    assert series["fsync", None]["counts"][PHASE_BUCKETS.index(0.05)] == 1
    assert series["commit", None]["counts"][0] == 1  # 4 ms: the first bucket (le 0.005)

    fams = families(render(doc))
    hist = "ckptd_phase_duration_seconds"
    assert fams[hist].type == "histogram"
    assert value(fams, hist, f"{hist}_count", phase="staging", peer="") == 1
    assert value(fams, hist, f"{hist}_bucket", phase="staging", peer="", le="0.1") == 0
    assert value(fams, hist, f"{hist}_bucket", phase="staging", peer="", le="0.25") == 1
    assert value(fams, hist, f"{hist}_bucket", phase="write", peer="", le="+Inf") == 1
    assert value(fams, hist, f"{hist}_sum", phase="replication",
                 peer="tcp://10.0.0.2:7740") == pytest.approx(4.0)
    assert not [s for s in fams[hist].samples if s.labels.get("peer") == "tcp://10.0.0.3:7740"]


def test_histograms_accumulate_and_a_sample_above_every_bound_counts_in_inf_only():
    durations = PhaseDurations()
    for seconds in (0.3, 0.3, 5000.0):
        durations.observe("staging", seconds)
    [entry] = durations.describe()["series"]
    assert entry["count"] == 3 and entry["counts"][-1] == 1
    assert sum(entry["counts"]) == 3 and entry["sum"] == pytest.approx(5000.6)
    with pytest.raises(ValueError, match="unknown phase 'copy'"):
        durations.observe("copy", 1.0)


def test_a_status_document_without_phase_durations_renders_an_empty_family():
    ledger = Ledger()
    doc = snapshot(ledger)
    del doc["phase_durations"]  # a daemon from before the key: the schema is additive
    fams = families(render(doc))
    assert fams["ckptd_phase_duration_seconds"].samples == []
