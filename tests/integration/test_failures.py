"""SPEC §5 failure semantics, each injected by real means against the real daemon."""

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as DCP
import zmq
from torch.distributed.checkpoint import FileSystemReader

from conftest import wait_for
from faults import small_tmpfs, writers_paused
from multirank import collect, run_ranks, start_ranks, values
from ckpt_client import (AsyncCallsQueue, CheckpointException, DaemonUnavailableError,
                         TorchAsyncCheckpoint, async_torch_save, connect, dcp)
from ckpt_client.errors import DaemonRequestError
from ckptd import protocol

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def phases(daemon) -> list[str]:
    return [r["phase"] for r in daemon.status()["requests"]]


# ----------------------------------------------------------------- write errors

def dcp_save_failing_on_rank_1(rank, world_size, root):
    queue = AsyncCallsQueue()
    old = os.path.join(root, "old")
    queue.schedule_async_request(dcp.async_save({f"r{rank}": torch.full((16,), float(rank))}, old))
    queue.maybe_finalize_async_calls(blocking=True)
    big = torch.ones(1 << 20) if rank == 1 else torch.ones(16)  # 4 MiB does not fit in 1 MiB
    queue.schedule_async_request(dcp.async_save({f"r{rank}": big}, os.path.join(root, "new")))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        outcome = None
    except CheckpointException as exc:
        outcome = (exc.failing_ranks, exc.failures)
    # Training goes on, and the queue still works.
    queue.schedule_async_request(dcp.async_save({f"r{rank}": torch.ones(4)}, os.path.join(root, "after")))
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = {f"r{rank}": torch.zeros(16)}
    DCP.load(loaded, storage_reader=FileSystemReader(old))
    assert torch.equal(loaded[f"r{rank}"], torch.full((16,), float(rank)))
    return outcome


@needs_root
def test_write_error_on_one_rank_fails_every_rank_and_commits_nothing(start_daemon, tmp_path):
    with small_tmpfs(tmp_path / "ckpt" / "full", "1m") as root:
        daemon = start_daemon()
        outcomes = values(run_ranks(dcp_save_failing_on_rank_1, 2, daemon.socket, tmp_path, args=(root,)))
        for failing_ranks, failures in outcomes:
            # Rank 1 overflows the filesystem; rank 0 may run into the same full disk.
            assert 1 in failing_ranks
            assert "errno 28" in failures[1] and "new/__1_" in failures[1]
            assert all(f"rank {r}: writing" in failures[r] and "errno 28" in failures[r]
                       for r in failing_ranks)
        assert outcomes[0] == outcomes[1], "every rank must see the same failure"
        assert os.listdir(os.path.join(root, "new")) == [], "nothing from the failed save may remain"
        assert ".metadata" in os.listdir(os.path.join(root, "after"))


@needs_root
def test_torch_save_write_error_names_rank_file_and_errno(start_daemon, tmp_path, monkeypatch):
    with small_tmpfs(tmp_path / "ckpt" / "full", "1m") as root:
        daemon = start_daemon()
        monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
        path = os.path.join(root, "model.pt")
        checkpoint = TorchAsyncCheckpoint()
        checkpoint.async_save({"w": torch.ones(1 << 20)}, path)
        with pytest.raises(CheckpointException) as info:
            checkpoint.finalize_async_save(blocking=True)
        message = str(info.value)
        assert "rank 0" in message and path in message and f"errno {errno.ENOSPC}" in message
        assert os.listdir(root) == []
        assert daemon.status()["recent_errors"][0]["path"] == path


# ----------------------------------------------------------------- daemon killed

def save_while_daemon_dies(rank, world_size, root, signals):
    queue = AsyncCallsQueue()
    # Per-rank keys: DCP would let only one rank write a replicated tensor.
    queue.schedule_async_request(dcp.async_save({f"w{rank}": torch.full((64,), 1.0)}, os.path.join(root, "A")))
    queue.maybe_finalize_async_calls(blocking=True)
    open(os.path.join(signals, f"a{rank}"), "w").close()
    go = os.path.join(signals, "go")
    deadline = time.monotonic() + 120
    while not os.path.exists(go):  # waiting for the test to pause the writers
        assert time.monotonic() < deadline, "test never said go"
        time.sleep(0.02)
    queue.schedule_async_request(dcp.async_save({f"w{rank}": torch.full((64,), 2.0)}, os.path.join(root, "B")))
    open(os.path.join(signals, f"b{rank}"), "w").close()
    started = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        raised = None
    except CheckpointException as exc:
        raised = exc.failing_ranks
    elapsed = time.monotonic() - started
    torch.mm(torch.ones(8, 8), torch.ones(8, 8))  # training can go on
    loaded = {f"w{rank}": torch.zeros(64)}
    DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, "A")))
    return raised, elapsed, float(loaded[f"w{rank}"][0])


def test_daemon_killed_mid_save_makes_every_rank_raise_and_the_previous_checkpoint_loads(daemon, tmp_path):
    signals = tmp_path / "signals"
    signals.mkdir()
    processes, results = start_ranks(save_while_daemon_dies, 2, daemon.socket, tmp_path,
                                     args=(daemon.roots[0], str(signals)))
    wait_for(lambda: all((signals / f"a{r}").exists() for r in range(2)), 180, "checkpoint A")
    with writers_paused(daemon) as writers:
        (signals / "go").touch()
        wait_for(lambda: all((signals / f"b{r}").exists() for r in range(2)), 60, "B staged")
        os.kill(daemon.pid, signal.SIGKILL)
        outcomes = values(collect(processes, results, timeout=120))
        for pid in writers:  # they die with their daemon; make sure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for raised, elapsed, value in outcomes:
        assert raised == [0, 1]
        assert elapsed < 30, f"ranks took {elapsed:.1f}s to notice the dead daemon"
        assert value == 1.0
    assert not os.path.exists(os.path.join(daemon.roots[0], "B", ".metadata"))


# ----------------------------------------------------------------- trainer killed

TRAINER = """
import os, sys, torch
from ckpt_client import async_torch_save
request = async_torch_save({"w": torch.ones(1 << 18)}, sys.argv[1])
print("staged", flush=True)
sys.stdin.read()
"""


def test_trainer_killed_mid_save_is_aborted_and_its_slot_freed(daemon, tmp_path):
    path = os.path.join(daemon.roots[0], "orphan.pt")
    with writers_paused(daemon):
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, path], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env={**os.environ, "CKPTD_SOCKET": daemon.socket})
        assert trainer.stdout.readline().strip() == b"staged"
        trainer.kill()
        trainer.wait()
        wait_for(lambda: phases(daemon) == ["aborted"], 30, "the daemon to abort the orphaned save")
        assert daemon.status()["ranks"] == []
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "the slot to be freed")
    assert os.listdir(daemon.roots[0]) == [], "partial files must not remain"


def test_trainer_gone_before_staged_frees_its_reservation(daemon):
    stand_in = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    channel = protocol.Channel(protocol.endpoint_for(daemon.socket))
    try:
        channel.call("hello", {"rank": 3, "pid": stand_in.pid})
        channel.call("stage", {"format": "torch", "path": os.path.join(daemon.roots[0], "x.pt"),
                               "buffers": [["float32", [1024], 4096]], "skeleton": protocol.pack_value({})})
        assert daemon.status()["pool"]["used_bytes"] > 0
        stand_in.kill()
        stand_in.wait()
        wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "the reservation to be freed")
        assert phases(daemon) == ["aborted"]
    finally:
        channel.close()


# ----------------------------------------------------------------- bad messages

def raw_exchange(socket_path, frames, timeout=10):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(protocol.endpoint_for(socket_path))
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout * 1000), "the daemon did not answer"
        return protocol.decode(sock.recv_multipart())
    finally:
        sock.close()


def header(msg_type="ping", version=protocol.SCHEMA_VERSION, **body):
    return protocol.pack_value({"v": version, "type": msg_type, "id": 5, "body": body})


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1garbage"], "malformed"),
    ([header(version=99)], "bad_version"),
    ([b"\x81" + b"\x00" * (protocol.MAX_HEADER_BYTES + 10)], "too_large"),
    ([header()] + [b"x"] * protocol.MAX_FRAMES, "too_large"),
    ([header("explode")], "unknown_type"),
    ([header("stage", format="torch", path="/x", buffers=[])], "not_registered"),
])
def test_bad_messages_get_an_error_reply_and_the_daemon_keeps_serving(shared_daemon, monkeypatch,
                                                                     frames, code):
    daemon = shared_daemon
    reply = raw_exchange(daemon.socket, frames)
    assert reply.type == "error" and reply.body["code"] == code, reply.body
    assert reply.body["message"]
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "still.pt")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(async_torch_save({"w": torch.ones(3)}, path))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))


@pytest.mark.parametrize("body", [
    {"format": "pickle", "path": "/x", "buffers": []},
    {"format": "torch", "path": None, "buffers": []},
    {"format": "torch", "buffers": [["object", [1], 8]]},
    {"format": "torch", "buffers": [["float32", [-1], 8]]},
    {"format": "dcp", "buffers": [["float32", [2], 8]], "files": [["../escape", [0]]]},
    {"format": "dcp", "buffers": [["float32", [2], 8]], "files": [["ok.distcp", [5]]]},
])
def test_invalid_stage_requests_are_refused(shared_daemon, body):
    daemon = shared_daemon
    channel = protocol.Channel(protocol.endpoint_for(daemon.socket))
    try:
        channel.call("hello", {"rank": 0, "pid": os.getpid()})
        body = {"path": os.path.join(daemon.roots[0], "d"), "skeleton": b"", **body}
        with pytest.raises(protocol.ErrorReply) as info:
            channel.call("stage", body)
        assert info.value.code in ("bad_request", "path_refused")
        assert daemon.status()["pool"]["used_bytes"] == 0
    finally:
        channel.close()


# ----------------------------------------------------------------- paths

@pytest.mark.parametrize("make_path", [
    lambda root, tmp: str(tmp / "outside.pt"),
    lambda root, tmp: os.path.join(root, "..", "dotdot.pt"),
    lambda root, tmp: os.path.join(root, tmp.name, "escape.pt"),
])
def test_paths_outside_the_allowed_roots_are_refused(shared_daemon, tmp_path, monkeypatch, make_path):
    daemon = shared_daemon
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", os.path.join(daemon.roots[0], tmp_path.name))
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = make_path(daemon.roots[0], tmp_path)
    with pytest.raises(DaemonRequestError) as info:
        async_torch_save({"w": torch.ones(2)}, path)
    assert info.value.code == "path_refused" and "root" in str(info.value)
    with pytest.raises(DaemonRequestError, match="outside the allowed roots"):
        dcp.async_save({"w": torch.ones(2)}, str(tmp_path / "dcp-outside"))
    assert os.listdir(tmp_path / "elsewhere") == [] and not (tmp_path / "outside.pt").exists()


# ----------------------------------------------------------------- abort, back-pressure

def test_close_with_abort_drops_in_flight_saves_and_the_queue_works_again(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "dropped.pt")
    checkpoint = TorchAsyncCheckpoint()
    with writers_paused(daemon):
        checkpoint.async_save({"w": torch.ones(1 << 16)}, path)
        checkpoint.close(abort=True)
        assert checkpoint.get_num_unfinalized_calls() == 0
    assert "dropped by the trainer: the trainer called AsyncCallsQueue.close(abort=True)" \
        in daemon.log()
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "the aborted save's slot")
    assert not os.path.exists(path) and os.listdir(daemon.roots[0]) == []
    checkpoint.async_save({"w": torch.ones(4)}, path)
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(4))


def test_a_full_pool_makes_the_next_save_wait_instead_of_overwriting(start_daemon, monkeypatch):
    daemon = start_daemon(pool_size="8M")
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    first, second = torch.full((6 << 18,), 1.0), torch.full((6 << 18,), 2.0)  # 6 MiB each
    paths = [os.path.join(daemon.roots[0], f"{n}.pt") for n in ("first", "second")]
    queue = AsyncCallsQueue()
    with writers_paused(daemon):
        queue.schedule_async_request(async_torch_save({"w": first}, paths[0]))
        waiter = threading.Thread(target=lambda: queue.schedule_async_request(
            async_torch_save({"w": second}, paths[1])))
        waiter.start()
        wait_for(lambda: "waiting_for_pool" in phases(daemon), 30, "the second save to queue for space")
        assert waiter.is_alive(), "the second save must block while the pool is full"
    waiter.join(60)
    assert not waiter.is_alive()
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    for path, tensor in zip(paths, (first, second)):
        assert torch.equal(torch.load(path, weights_only=True)["w"], tensor)


# ----------------------------------------------------------------- no daemon

def test_no_daemon_gives_a_clear_error_naming_socket_and_fix(tmp_path):
    socket_path = str(tmp_path / "none" / "ckptd.sock")
    with pytest.raises(DaemonUnavailableError) as info:
        connect(socket_path, auto_start=False)
    assert info.value.socket_path == socket_path
    assert socket_path in str(info.value) and "ckptd serve" in str(info.value)


def connect_and_report(rank, world_size):
    return connect().daemon_pid


def test_auto_start_starts_exactly_one_daemon_for_the_node(tmp_path, monkeypatch):
    socket_path = str(tmp_path / "auto" / "ckptd.sock")
    monkeypatch.setenv("CKPTD_AUTO_START", "1")
    monkeypatch.setenv("CKPTD_ROOTS", str(tmp_path))
    monkeypatch.setenv("CKPTD_POOL_SIZE", "64M")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as a launcher sets it per rank
    pids = values(run_ranks(connect_and_report, 2, socket_path, tmp_path))
    try:
        assert pids[0] == pids[1]
        code, doc, _ = __import__("ckptd.status", fromlist=["x"]).query_status(socket_path)
        assert code == 0 and doc["pid"] == pids[0] and doc["roots"] == [str(tmp_path)]
        with open(f"/proc/{pids[0]}/environ", "rb") as environ:
            names = [entry.split(b"=", 1)[0] for entry in environ.read().split(b"\0")]
        assert b"CKPTD_ROOTS" in names and b"CUDA_VISIBLE_DEVICES" not in names, (
            "the node's daemon must see every GPU, not the starting rank's")
    finally:
        os.kill(pids[0], signal.SIGTERM)
        wait_for(lambda: not os.path.exists(socket_path), 60, "the auto-started daemon to stop")


# ----------------------------------------------------------------- graceful stop

def test_sigterm_lets_in_flight_writes_finish_then_cleans_up(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "drained.pt")
    with writers_paused(daemon):
        async_torch_save({"w": torch.arange(1000)}, path)
        pool_path = daemon.status()["pool"]["path"]
        daemon.process.send_signal(signal.SIGTERM)
        wait_for(lambda: daemon.status()["state"] == "draining", 30, "the daemon to start draining")
    assert daemon.process.wait(60) == 0
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(1000))
    run_dir = os.path.dirname(daemon.socket)
    assert not os.path.exists(daemon.socket) and "ckptd.ready" not in os.listdir(run_dir)
    assert not os.path.exists(pool_path)


# ----------------------------------------------------------------- staging pool directory

@pytest.mark.parametrize("how", ["disk directory by --pool-dir", "disk directory by CKPTD_POOL_DIR",
                                 "missing directory"])
def test_a_pool_directory_that_is_not_tmpfs_is_refused_naming_it_and_the_fix(tmp_path, how):
    from ckptd.staging.pool_directory import mount_of

    directory = tmp_path / "pools"
    if how != "missing directory":
        directory.mkdir()
        if mount_of(str(directory))[0] in ("tmpfs", "hugetlbfs"):
            pytest.skip(f"{tmp_path} is a memory filesystem here; the test needs a disk directory")
    socket_path = tmp_path / "run" / "ckptd.sock"
    command = [sys.executable, "-m", "ckptd", "serve", "--socket", str(socket_path),
               "--root", str(tmp_path), "--pool-size", "16M"]
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_POOL_DIR"}
    if how.endswith("CKPTD_POOL_DIR"):
        env["CKPTD_POOL_DIR"] = str(directory)
    else:
        command += ["--pool-dir", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0, done.stderr
    why = "does not exist" if how == "missing directory" else "not tmpfs"
    assert f"staging pool directory {directory}" in done.stderr and why in done.stderr, done.stderr
    assert "--pool-dir" in done.stderr and "CKPTD_POOL_DIR" in done.stderr, done.stderr
    assert not socket_path.exists(), "a refused daemon must not serve"
    assert not directory.exists() or os.listdir(directory) == [], "no pool made on disk"
