"""``ckptd status`` as operators run it: the real CLI in a subprocess against real sockets.

Covers the exit-code contract (0 running, 3 not running, 4 unknown), the ``--json``
schema documented in docs/operations.md (parsed from the page, so page and code cannot
drift apart), ``--health``, ``--watch`` progress, recent errors with their reasons, and
that the status path never imports torch.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from ckpt_client import CheckpointException, TorchAsyncCheckpoint
from ckptd.status import progress_line, query_status

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPERATIONS_DOC = os.path.join(REPO, "docs", "operations.md")
CLI_TIMEOUT = 120


def run_status(*args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}
    return subprocess.run([sys.executable, "-m", "ckptd", "status", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------ a daemon with history

def save(socket_path: str, path: str, seed: int = 0) -> None:
    checkpoint = TorchAsyncCheckpoint(socket=socket_path)
    try:
        checkpoint.async_save({"w": torch.full((1024, 64), float(seed)), "step": seed}, path)
        checkpoint.finalize_async_save(blocking=True)
    finally:
        checkpoint.close()


@pytest.fixture
def daemon_with_history(daemon):
    """A daemon that made one save durable and failed one (a file where a directory must be)."""
    root = daemon.roots[0]
    save(daemon.socket, os.path.join(root, "good", "model.pt"))
    with open(os.path.join(root, "not-a-dir"), "w") as f:
        f.write("a file, so nothing can be written below it\n")
    with pytest.raises(CheckpointException):
        save(daemon.socket, os.path.join(root, "not-a-dir", "model.pt"))
    return daemon


# ------------------------------------------------------------------ exit codes

def test_running_daemon_exits_0_with_the_table(daemon_with_history):
    result = run_status("--socket", daemon_with_history.socket)
    assert result.returncode == 0, result.stderr
    for heading in ("RANKS", "REQUESTS", "RECENT ERRORS", f"pid {daemon_with_history.pid}"):
        assert heading in result.stdout


def test_missing_socket_exits_3(tmp_path):
    path = str(tmp_path / "nothing-here.sock")
    result = run_status("--socket", path)
    assert result.returncode == 3
    assert "does not exist" in result.stderr and path in result.stderr


def test_stale_socket_file_exits_3(tmp_path):
    path = str(tmp_path / "stale.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)  # the file exists, but nobody ever listens: like a daemon killed -9
    sock.close()
    assert os.path.exists(path)
    result = run_status("--socket", path)
    assert result.returncode == 3
    assert "stale socket" in result.stderr


def test_socket_that_never_answers_exits_4(tmp_path):
    path = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)  # accepts connections (the kernel completes them) and never speaks
    try:
        result = run_status("--socket", path, "--timeout", "1")
    finally:
        listener.close()
    assert result.returncode == 4
    assert "sent no status" in result.stderr


def test_json_when_not_running_says_why_on_stdout(tmp_path):
    result = run_status("--socket", str(tmp_path / "none.sock"), "--json")
    assert result.returncode == 3
    document = json.loads(result.stdout)
    assert document["running"] is False and document["exit_code"] == 3
    assert "does not exist" in document["reason"]


# ------------------------------------------------------------------ --json schema

_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
          "list": (list,), "object": (dict,), "map": (dict,), "null": (type(None),)}
#: Lists the fixture fills, so their entries' documented keys are checked for real.
_POPULATED = {"ranks", "requests", "writers", "recent_errors"}


def documented_schema() -> dict:
    """Key path -> (allowed Python types, is a map), from the table in docs/operations.md."""
    with open(OPERATIONS_DOC) as f:
        text = f.read()
    block = re.search(r"<!-- status-schema:start -->(.*?)<!-- status-schema:end -->", text, re.S)
    assert block, f"{OPERATIONS_DOC} has no status-schema table"
    schema = {}
    for key, kinds in re.findall(r"^\|\s*`([^`]+)`\s*\|\s*([a-z ]+?)\s*\|", block.group(1), re.M):
        schema[key] = (tuple(t for kind in kinds.split(" or ") for t in _TYPES[kind]),
                       "map" in kinds.split(" or "))
    assert len(schema) > 30, "the schema table looks truncated"
    return schema


def values_at(document, path: str) -> list:
    """Every value at a dotted key path; ``name[]`` steps into each element of a list.

    A documented object that is null here (``object or null``) has no values below it.
    """
    values = [document]
    for part in path.split("."):
        is_list = part.endswith("[]")
        key = part[:-2] if is_list else part
        next_values = []
        for value in values:
            if value is None:
                continue
            assert key in value, f"status --json lacks documented key {path!r} ({key!r})"
            next_values.extend(value[key] if is_list else [value[key]])
        values = next_values
    return values


def test_json_matches_the_documented_schema(daemon_with_history):
    # A rank stays registered while we ask, so the ranks list is not empty either.
    checkpoint = TorchAsyncCheckpoint(socket=daemon_with_history.socket)
    checkpoint.async_save({"x": torch.ones(8)}, os.path.join(daemon_with_history.roots[0], "x.pt"))
    checkpoint.finalize_async_save(blocking=True)
    try:
        result = run_status("--socket", daemon_with_history.socket, "--json")
    finally:
        checkpoint.close()
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    schema = documented_schema()
    for name in _POPULATED:
        assert document[name], f"{name} is empty: the fixture should populate it"
    for path, (allowed, _) in schema.items():
        for found in values_at(document, path.removesuffix("[]")):
            assert isinstance(found, allowed), f"{path}: {found!r} is not {allowed}"
    # Every key the daemon sends is documented (nested objects and list entries included).
    documented = {p.replace("[]", "") for p in schema}
    maps = {p.replace("[]", "") for p, (_, is_map) in schema.items() if is_map}

    def undocumented(value, prefix=""):
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{prefix}{key}"
                if path not in documented:
                    yield path
                if path not in maps:
                    yield from undocumented(item, path + ".")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                yield from undocumented(item, prefix)

    assert sorted(set(undocumented(document))) == []
    assert document["schema"] == 1 and document["pid"] == daemon_with_history.pid
    assert document["totals"]["saves_done"] == 2 and document["totals"]["saves_failed"] == 1
    # The root just written says how (O_DIRECT where its filesystem takes it).
    mode = document["write_modes"][daemon_with_history.roots[0]]
    assert mode == "direct" or mode.startswith("buffered: "), mode


# ------------------------------------------------------------------ health, errors, watch

def test_health_is_one_line_with_the_last_error(daemon_with_history):
    result = run_status("--socket", daemon_with_history.socket, "--health")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    assert re.match(rf"ckptd serving pid={daemon_with_history.pid} ranks=\d+ in_flight=0 stuck=0 "
                    r"pool=0% done=1 failed=1 last_error=\"", lines[0]), lines[0]
    assert "not-a-dir" in lines[0]


def test_recent_errors_carry_rank_path_and_reason(daemon_with_history):
    code, document, _ = query_status(daemon_with_history.socket, timeout=10)
    assert code == 0
    [error] = document["recent_errors"]
    assert error["rank"] == 0 and error["path"].endswith("not-a-dir/model.pt")
    assert "rank 0" in error["error"] and "not-a-dir" in error["error"]
    assert re.search(r"errno \d+|Errno|directory", error["error"]), error["error"]
    table = run_status("--socket", daemon_with_history.socket).stdout
    errors_section = table.split("RECENT ERRORS", 1)[1]
    assert f"request {error['request']}" in errors_section and error["error"] in errors_section


def test_watch_refreshes_and_reports_throughput(daemon):
    result = run_status("--socket", daemon.socket, "--watch", "--count", "2",
                        "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    progress = [l for l in result.stdout.splitlines() if l.startswith("progress")]
    assert len(progress) == 2
    assert "throughput after the next refresh" in progress[0]
    assert re.search(r"write [\d.]+ \S+/s, stage [\d.]+ \S+/s", progress[1]), progress[1]


def test_progress_between_two_samples_shows_the_bytes_written(daemon):
    _, before, _ = query_status(daemon.socket, timeout=10)
    save(daemon.socket, os.path.join(daemon.roots[0], "p.pt"))  # 256 KiB of tensor data
    _, after, _ = query_status(daemon.socket, timeout=10)
    line = progress_line(before, after)
    rates = re.search(r"written ([\d.]+) KiB since start; write ([\d.]+) (\S+)/s", line)
    assert rates, line
    assert float(rates.group(1)) >= 256 and float(rates.group(2)) > 0
    assert progress_line(after, after).endswith("throughput after the next refresh")


def test_watch_keeps_reporting_a_daemon_that_went_away(daemon):
    daemon.stop()
    result = run_status("--socket", daemon.socket, "--watch", "--count", "2", "--interval", "0.1")
    assert result.returncode == 3
    assert result.stderr.count("does not exist") == 2


# ------------------------------------------------------------------ start-up cost

def imported_modules(*python_args: str) -> set:
    """Modules a Python command imports, from ``-X importtime`` (stderr)."""
    result = subprocess.run([sys.executable, "-X", "importtime", *python_args],
                            capture_output=True, text=True, timeout=CLI_TIMEOUT)
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_status_does_not_import_torch(daemon):
    modules = imported_modules("-m", "ckptd", "status", "--socket", daemon.socket)
    assert "ckptd.status" in modules and "zmq" in modules, "the probe saw no status import"
    heavy = sorted(m for m in modules if m == "torch" or m.startswith(("torch.", "numpy")))
    assert heavy == [], f"ckptd status imported {heavy[:5]}"
    # The probe itself can fail: it does see torch where torch is imported.
    assert "torch" in imported_modules("-c", "import torch")
