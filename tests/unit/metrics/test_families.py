"""Metric families: the status document as Prometheus text, parsed back with
prometheus_client."""

from ckptd.metrics import SaveStats, render

from metrics_fixtures import busy_ledger, families, peer, snapshot, value  # noqa: F401


def test_every_documented_family_is_rendered_and_parses(busy_ledger):
    stats = SaveStats()
    stats.observe(snapshot(busy_ledger)["requests"])
    fams = families(render(snapshot(busy_ledger), stats))
    expected = {
        "ckptd_up": "gauge", "ckptd_info": "gauge", "ckptd_start_time_seconds": "gauge",
        "ckptd_draining": "gauge", "ckptd_bytes_written": "counter", "ckptd_saves": "counter",
        "ckptd_stale_saves": "counter",
        "ckptd_save_duration_seconds": "histogram",
        "ckptd_last_success_timestamp_seconds": "gauge", "ckptd_requests_in_flight": "gauge",
        "ckptd_in_flight_bytes": "gauge", "ckptd_recent_errors": "gauge",
        "ckptd_staging_pool_size_bytes": "gauge", "ckptd_staging_pool_bytes": "gauge",
        "ckptd_staging_pool_waiting_requests": "gauge", "ckptd_ranks_registered": "gauge",
        "ckptd_staging_pool_huge_page_bytes": "gauge",
        "ckptd_writers": "gauge", "ckptd_replication_lag_seconds": "gauge", "ckptd_peers": "gauge",
        "ckptd_local_checkpoint_parts": "gauge", "ckptd_local_checkpoint_bytes": "gauge",
        "ckptd_local_part_copies": "gauge", "ckptd_local_parts_reduced_redundancy": "gauge",
        "ckptd_memory_tier_bytes": "gauge", "ckptd_stuck_saves": "gauge",
        "ckptd_stuck_writers": "gauge", "ckptd_phase_duration_seconds": "histogram",
        "ckptd_held_polls": "gauge",
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
    assert value(fams, "ckptd_stale_saves", "ckptd_stale_saves_total") == 0
    assert value(fams, "ckptd_staging_pool_bytes", state="used") == 1 << 18
    assert value(fams, "ckptd_staging_pool_bytes", state="free") == 3 << 18
    assert value(fams, "ckptd_staging_pool_size_bytes") == 1 << 20
    assert value(fams, "ckptd_staging_pool_waiting_requests") == 2
    assert value(fams, "ckptd_staging_pool_huge_page_bytes") == 1 << 21
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
    assert value(fams, "ckptd_stuck_saves") == 0 and value(fams, "ckptd_stuck_writers") == 0
    assert value(fams, "ckptd_held_polls") == 3
    assert value(fams, "ckptd_replication_lag_seconds") == 0
    assert value(fams, "ckptd_last_success_timestamp_seconds") == 1040.0
    info = fams["ckptd_info"].samples[0].labels
    assert info == {"version": "0.1.0", "host": "node7", "socket": "/run/ckptd/x.sock"}


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


def test_tier_metrics_follow_the_tier_section(busy_ledger):
    tier = {"stage_dir": "/stage", "budget_bytes": 1000, "used_bytes": 600, "policy": "wait",
            "waiting_saves": 1, "flushes": 2, "copies_running": 1, "retries": 3, "stalls": 1,
            "bytes_flushed": 5000, "commits_pending": [], "commits_done": 4}
    doc = snapshot(busy_ledger, tier=tier)
    doc["requests"][-1]["flush"] = {"attempt": 2, "next_retry_at": None, "bytes_done": 100,
                                    "bytes_total": 400, "target": "/ckpt/1.pt", "last_error": None}
    fams = families(render(doc))
    assert value(fams, "ckptd_stage_bytes", state="used") == 600
    assert value(fams, "ckptd_stage_bytes", state="budget") == 1000
    assert value(fams, "ckptd_flush_retries", "ckptd_flush_retries_total") == 3
    assert value(fams, "ckptd_flush_stalls", "ckptd_flush_stalls_total") == 1
    assert value(fams, "ckptd_flush_pending_bytes") == 300
    assert "ckptd_stage_bytes" not in families(render(snapshot(busy_ledger, tier=None)))


def test_stuck_saves_and_writers_are_counted(busy_ledger):
    from ckptd import knobs

    with knobs.override(STUCK_AFTER=-1.0):  # any stall counts: the writing save is stuck
        doc = snapshot(busy_ledger, stuck_writers=[{"pid": 1, "path": "/x", "phase": "fsync"}])
    assert [save["stuck"] for save in doc["saves"]] == [True]
    fams = families(render(doc, SaveStats()))
    assert value(fams, "ckptd_stuck_saves") == 1
    assert value(fams, "ckptd_stuck_writers") == 1
