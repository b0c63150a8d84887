"""``ckptd trace``: a real daemon's recent saves as Chrome trace-event JSON.

The file must be what Perfetto and chrome://tracing read (the object form, every event
with the keys and types its ``ph`` needs, microseconds), and its spans must tell how a
real save ran: staging before the writes, each file's write before its fsync, one writer
doing one file at a time, everything inside the save, and the durations the daemon
logged for the same request.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from ckpt_client import AsyncCallsQueue, TorchAsyncCheckpoint, dcp

#: What each ``ph`` needs besides ``name``, ``ph``, ``pid`` and ``tid``.
REQUIRED = {"X": {"ts": (int, float), "dur": (int, float)},
            "i": {"ts": (int, float), "s": str},
            "M": {"args": dict}}


def run_trace(socket: str, out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "trace", "--socket", socket,
                           "--out", str(out), *extra], capture_output=True, text=True)


def check_format(doc: dict) -> list[dict]:
    """Every event is well-formed trace-event JSON; returns the events."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    for event in doc["traceEvents"]:
        assert isinstance(event["name"], str) and event["ph"] in REQUIRED, event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        for key, kind in REQUIRED[event["ph"]].items():
            assert isinstance(event[key], kind), (key, event)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] > 1.5e15, event  # wall-clock µs
        if event["ph"] == "i":
            assert event["s"] in ("g", "p", "t"), event
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name"), event
            assert isinstance(event["args"]["name"], str), event
    return doc["traceEvents"]


def within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner.get("dur", 0) <= \
        outer["ts"] + outer["dur"]


def test_a_real_save_traced_as_it_ran(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    # Staging, then writing: a save that reports its copy as it goes is written from
    # before its staging ends (test_early_writes traces that order).
    monkeypatch.setenv("CKPTD_COPY_REPORT_BYTES", "0")
    state = {f"layer{i}": torch.randn(1 << 18) for i in range(8)}  # 8 MiB, two writers
    queue = AsyncCallsQueue()
    step = os.path.join(daemon.roots[0], "step_1")
    queue.schedule_async_request(dcp.async_save(state, step))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    checkpoint = TorchAsyncCheckpoint()
    torch_file = os.path.join(daemon.roots[0], "model.pt")
    checkpoint.async_save(state, torch_file)
    checkpoint.finalize_async_save(blocking=True)

    out = tmp_path / "trace.json"
    run = run_trace(daemon.socket, out)
    assert run.returncode == 0, run.stderr
    events = check_format(json.load(open(out)))
    saves = [e for e in events if e.get("cat") == "save"]
    assert [s["args"]["path"] for s in saves] == [step, torch_file]

    # The DCP save: every span of it inside it, in the order the daemon ran them.
    save = saves[0]
    mine = [e for e in events if e["ph"] != "M" and e.get("args", {}).get("path", "")
            .startswith(step)]
    assert all(within(e, save) for e in mine)
    (staging,) = [e for e in mine if e["name"].startswith("staging (")]
    writes = [e for e in mine if e["cat"] == "write"]
    syncs = {e["name"].removeprefix("fsync "): e for e in mine if e["cat"] == "fsync"}
    assert len(writes) == 2 and {e["tid"] for e in writes} == {100, 101}, writes
    (done,) = [e for e in mine if e["ph"] == "i"]
    for write in writes:
        name = write["name"].removeprefix("write ")
        assert staging["ts"] + staging["dur"] <= write["ts"]
        assert write["ts"] + write["dur"] == syncs[name]["ts"]  # durable once all is written
        assert syncs[name]["ts"] + syncs[name]["dur"] <= done["ts"]
        assert syncs[name]["tid"] == write["tid"] and syncs[name]["pid"] == daemon.pid
    metadata = [e for e in mine if e["cat"] == "finalize"]
    assert [e["name"] for e in metadata] == ["write .metadata", "fsync .metadata"]
    assert all(e["ts"] >= done["ts"] for e in metadata), "the finalize follows the writes"
    for row in (events_on(events, e) for e in writes + metadata):
        for a, b in zip(row, row[1:]):
            assert a["ts"] + a["dur"] <= b["ts"], ("one writer, one file at a time", a, b)

    # The same request as the daemon logged it (milliseconds, rounded).
    request = staging["args"]["request"]
    log = daemon.log()
    staged_in = float(re.search(rf"request {request} \(rank 0\) staged in ([\d.]+)s", log)[1])
    durable_in = float(re.search(rf"request {request} \(rank 0\) durable: \d+ bytes in "
                                 rf"([\d.]+)s after staging", log)[1])
    assert abs(staging["dur"] / 1e6 - staged_in) <= 0.0015, (staging, staged_in)
    assert abs((done["ts"] - staging["ts"] - staging["dur"]) / 1e6 - durable_in) <= 0.0015
    # The trainer's own spans: blocked through planning and staging, then its finalize,
    # which ran after the writes and holds the coordinator's .metadata commit.
    trainer = {e["name"]: e for e in events if e.get("cat") == "trainer"
               and within(e, save) and e["pid"] == staging["pid"]}
    blocked, planning, finalize = (trainer["blocked in dcp.async_save"], trainer["planning"],
                                   trainer["finalize"])
    assert within(planning, blocked) and within(staging, blocked)
    assert planning["ts"] < staging["ts"] + staging["dur"]  # staging may overlap the plan
    assert finalize["ts"] >= done["ts"] and all(within(e, finalize) for e in metadata)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names[(daemon.pid, 100)] == "writer 0" and names[(daemon.pid, 0)] == "saves"
    assert names[(staging["pid"], 0)] == f"rank 0 (pid {os.getpid()})"


def events_on(events: list[dict], event: dict) -> list[dict]:
    """The complete events of ``event``'s row, in time order."""
    return sorted((e for e in events if e["ph"] == "X" and e["cat"] != "save"
                   and (e["pid"], e["tid"]) == (event["pid"], event["tid"])),
                  key=lambda e: e["ts"])


def test_last_counts_saves_and_no_daemon_exits_3(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    checkpoint = TorchAsyncCheckpoint()
    paths = [os.path.join(daemon.roots[0], f"m{i}.pt") for i in range(3)]
    for path in paths:
        checkpoint.async_save({"w": torch.ones(16)}, path)
        checkpoint.finalize_async_save(blocking=True)
    run = run_trace(daemon.socket, tmp_path / "t.json", "--last", "2")
    assert run.returncode == 0, run.stderr
    events = check_format(json.load(open(tmp_path / "t.json")))
    assert [e["args"]["path"] for e in events if e.get("cat") == "save"] == paths[1:]
    missing = run_trace(str(tmp_path / "nobody" / "ckptd.sock"), tmp_path / "none.json")
    assert missing.returncode == 3 and "no daemon" in missing.stderr
    assert not (tmp_path / "none.json").exists()
