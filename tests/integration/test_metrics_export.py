"""Metrics from the real daemon: ``--metrics-textfile`` and ``--metrics-listen``.

The exported text is parsed back with prometheus_client's parser; saves are real saves
through ``ckpt_client``.
"""

import http.client
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from ckpt_client import TorchAsyncCheckpoint
from conftest import free_port, wait_for

parser = pytest.importorskip(
    "prometheus_client.parser",
    reason="prometheus-client is in the test extra: pip install -e '.[test]'")


def samples(text: str) -> dict:
    """``(name, frozenset(labels)) -> value`` for every sample; fails on bad syntax."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def get(name: str, parsed: dict, **labels) -> float | None:
    wanted = set(labels.items())
    found = [v for (n, l), v in parsed.items() if n == name and wanted <= set(l)]
    return found[0] if len(found) == 1 else None


def read_textfile(path: str) -> dict:
    try:
        with open(path) as f:
            return samples(f.read())
    except FileNotFoundError:
        return {}


def scrape(port: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        return samples(response.read().decode())
    finally:
        connection.close()


def test_textfile_and_endpoint_follow_real_saves(start_daemon, tmp_path):
    textfile = str(tmp_path / "textfile" / "ckptd.prom")
    os.makedirs(os.path.dirname(textfile))
    port = free_port()
    daemon = start_daemon(extra_args=["--metrics-textfile", textfile,
                                      "--metrics-listen", f"127.0.0.1:{port}",
                                      "--metrics-label", "slurm_job_id=9"])
    up = wait_for(lambda: get("ckptd_up", read_textfile(textfile), slurm_job_id="9"), 30,
                  "ckptd_up 1 in the textfile")
    assert up == 1

    state = {"w": torch.ones(1 << 16), "b": torch.zeros(1 << 10)}  # 266240 bytes
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    try:
        for step in range(2):
            checkpoint.async_save(state, os.path.join(daemon.roots[0], f"s{step}.pt"))
            checkpoint.finalize_async_save(blocking=True)
    finally:
        checkpoint.close()

    def two_saves_exported():
        parsed = read_textfile(textfile)
        return parsed if get("ckptd_saves_total", parsed, outcome="done") == 2 else None

    parsed = wait_for(two_saves_exported, 30, "two done saves in the textfile")
    assert get("ckptd_bytes_written_total", parsed) >= 2 * 266240
    assert get("ckptd_save_duration_seconds_count", parsed) == 2
    assert get("ckptd_save_duration_seconds_bucket", parsed, le="+Inf") == 2
    assert get("ckptd_save_duration_seconds_sum", parsed) > 0
    assert get("ckptd_staging_pool_bytes", parsed, state="used") == 0
    assert get("ckptd_staging_pool_size_bytes", parsed) == 256 << 20
    assert get("ckptd_writers", parsed, state="alive") == 2
    assert get("ckptd_last_success_timestamp_seconds", parsed) > 0

    scraped = scrape(port)
    assert get("ckptd_saves_total", scraped, outcome="done", slurm_job_id="9") == 2
    assert get("ckptd_info", scraped, socket=daemon.socket) == 1
    assert not [n for n in os.listdir(os.path.dirname(textfile)) if n != "ckptd.prom"], \
        "temporary files left beside the textfile"

    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.process.wait(60) == 0
    assert read_textfile(textfile) == {("ckptd_up", frozenset({("slurm_job_id", "9")})): 0}
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    sock = str(tmp_path / "run" / "ckptd.sock")
    return subprocess.run([sys.executable, "-m", "ckptd", "serve", "--socket", sock,
                           "--root", str(tmp_path), "--pool-size", "16M", "--writers", "1",
                           *args], capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)


def test_a_non_loopback_endpoint_is_refused_before_anything_starts(tmp_path):
    result = serve(tmp_path, "--metrics-listen", f"0.0.0.0:{free_port()}")
    assert result.returncode == 2
    assert "not a loopback address" in result.stderr and "--metrics-allow-remote" in result.stderr
    assert not os.path.exists(tmp_path / "run" / "ckptd.sock")


@pytest.mark.parametrize("label", ["9lives=1", "nolabel", "state=x"])
def test_a_bad_metrics_label_is_refused(tmp_path, label):
    result = serve(tmp_path, "--metrics-label", label)
    assert result.returncode == 2 and "--metrics-label" in result.stderr


def test_a_metrics_port_in_use_stops_the_start_with_a_hint(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = serve(tmp_path, "--metrics-listen", f"127.0.0.1:{taken.getsockname()[1]}")
    assert result.returncode == 1
    assert "choose another --metrics-listen port" in result.stderr
    assert not os.path.exists(tmp_path / "run" / "ckptd.sock"), "the socket must be removed"


# ---------------------------------------------------------------- phase-duration histograms

def phase_counts(parsed: dict) -> dict:
    """``(phase, peer) -> count`` of the phase-duration histogram."""
    return {(dict(labels)["phase"], dict(labels)["peer"]): value
            for (name, labels), value in parsed.items()
            if name == "ckptd_phase_duration_seconds_count"}


def dcp_save_of_two_files(rank, world_size, directory):
    from ckpt_client import AsyncCallsQueue, dcp

    queue = AsyncCallsQueue()
    state = {"a": torch.ones(1 << 14), "b": torch.zeros(1 << 12), "step": 3}
    queue.schedule_async_request(dcp.async_save(state, directory))
    return queue.maybe_finalize_async_calls(blocking=True)


def test_phase_histograms_move_after_a_real_save(start_daemon, tmp_path):
    """A real two-rank DCP save: staging (one per rank), a write and an fsync per file,
    one commit (the ``.metadata``), in the textfile with the sums they add up to."""
    from multirank import run_ranks, values

    textfile = str(tmp_path / "ckptd.prom")
    daemon = start_daemon(extra_args=["--metrics-textfile", textfile])
    before = wait_for(lambda: read_textfile(textfile) or None, 30, "the first textfile")
    assert phase_counts(before) == {}, "no phase can have a duration before any save"
    directory = os.path.join(daemon.roots[0], "dcp")
    assert values(run_ranks(dcp_save_of_two_files, 2, daemon.socket, tmp_path,
                            args=(directory,))) == [[0], [0]]
    files = [n for n in os.listdir(directory) if n.endswith(".distcp")]

    def moved():
        parsed = read_textfile(textfile)
        return parsed if phase_counts(parsed).get(("commit", "")) else None

    parsed = wait_for(moved, 30, "the commit's duration in the textfile")
    counts = phase_counts(parsed)
    staged = [r for r in daemon.status()["requests"] if r["staged_at"] is not None]
    assert {r["rank"] for r in staged} == {0, 1}
    assert counts == {("staging", ""): len(staged), ("write", ""): len(files),
                      ("fsync", ""): len(files), ("commit", ""): 1}
    for phase in ("staging", "write", "fsync", "commit"):
        total = get("ckptd_phase_duration_seconds_sum", parsed, phase=phase)
        inf = get("ckptd_phase_duration_seconds_bucket", parsed, phase=phase, le="+Inf")
        assert total is not None and total >= 0 and inf == counts[(phase, "")]
    status = daemon.status()["phase_durations"]
    assert {(s["phase"], s["count"]) for s in status["series"]} == \
        {("staging", len(staged)), ("write", len(files)), ("fsync", len(files)), ("commit", 1)}


def test_replication_durations_are_kept_per_peer(tmp_path):
    """Two nodes replicating each other's local parts: each daemon times its stream to
    the other, labelled with that peer's address."""
    from multirank import run_ranks, values
    from test_local_checkpoints import Nodes
    from test_replication import save_once

    nodes = Nodes(tmp_path, 2)
    try:
        values(run_ranks(save_once, 2, nodes.sockets(1), tmp_path,
                         args=(nodes.roots(1), 1, 2, 5)))
        for node, peer_address in ((0, nodes.addresses[1]), (1, nodes.addresses[0])):
            series = nodes.daemons[node].status()["phase_durations"]["series"]
            [stream] = [s for s in series if s["phase"] == "replication"]
            assert stream["peer"] == peer_address and stream["count"] == 1
            assert stream["sum"] > 0
    finally:
        nodes.stop_all()
