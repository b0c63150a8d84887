"""The exporter: a real textfile and a real HTTP endpoint on loopback, and the checks of
the listen address."""

import http.client
import os
import socket
import stat

import pytest

from ckptd.metrics import MetricsAddressError, MetricsExporter, parse_listen_address, write_textfile

from metrics_fixtures import busy_ledger, families, snapshot, value  # noqa: F401


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
