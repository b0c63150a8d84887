"""Save statistics: every finished save counted once, in a cumulative histogram."""

import pytest

from ckptd.metrics import DURATION_BUCKETS, SaveStats, render
from ckptd.protocol import Phase

from metrics_fixtures import Ledger, busy_ledger, families, request, snapshot, value  # noqa: F401


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
