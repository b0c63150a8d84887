"""Tiered saves (``ckptd serve --stage-dir``) against real targets with real faults.

The target is a second filesystem the daemon reaches through the kernel: a FUSE
passthrough (``tests/faultfs.py``) that stalls or fails on command, a small tmpfs that
fills, a tmpfs remounted read-only. Every test checks that nothing torn or partial is
visible at the target, that the previous checkpoint still loads with stock ``torch.load``
/ ``dcp.load``, and that the error names what happened.
"""

from __future__ import annotations

import errno
import glob
import os
import signal
import subprocess
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_client import AsyncCallsQueue, CheckpointException, TorchAsyncCheckpoint
from ckpt_client import dcp as ckpt_dcp
from ckpt_client.errors import DaemonRequestError
from conftest import wait_for
from faultfs import FaultFS, fuse_unavailable
from multirank import collect, start_ranks

needs_fuse = pytest.mark.skipif(bool(fuse_unavailable()), reason=fuse_unavailable() or "-")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs target needs root")

# Short knobs: a copy without progress for 1 s is stuck, retries start after 0.2 s.
FAST = {"CKPTD_STALL_TIMEOUT": "1", "CKPTD_FLUSH_RETRY_START": "0.2",
        "CKPTD_FLUSH_RETRY_CAP": "1", "CKPTD_FLUSH_COMMIT_POLL": "0.2",
        "CKPTD_FLUSH_CHUNK_BYTES": str(256 << 10)}


def state(seed: int, mib: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib << 18, generator=g), "step": torch.tensor(seed)}


def tiered(start_daemon, tmp_path, root, *args, env=None, stage=None):
    stage = stage or str(tmp_path / "stage")
    return start_daemon(roots=[root], extra_args=["--stage-dir", stage, *args],
                        env={**FAST, **(env or {})})


def torch_save(path: str, st: dict) -> TorchAsyncCheckpoint:
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(st, path)
    return checkpoint


def request_of(daemon, path: str) -> dict | None:
    found = [r for r in daemon.status()["requests"] if r["path"] == path]
    return found[-1] if found else None


def visible(directory: str) -> list[str]:
    """Names at the target that a loader could mistake for a checkpoint (no temporaries)."""
    return sorted(n for n in os.listdir(directory) if not n.endswith(".ckptd-tmp"))


def assert_nothing_partial(directory: str) -> None:
    for name in os.listdir(directory):
        assert ".ckptd-tmp" not in name or name.startswith("."), name


@pytest.fixture
def fault_target(tmp_path):
    with FaultFS(tmp_path / "backing", tmp_path / "target") as fs:
        yield fs


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs-target"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m",
                           f"tiered-{uuid.uuid4().hex[:8]}", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs target: {done.stderr.decode().strip()}")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# ---------------------------------------------------------------------- the plain path
def test_saves_reach_the_target_whole_and_the_stage_empties(start_daemon, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    daemon = tiered(start_daemon, tmp_path, root)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    # A DCP save of the same kind earlier in this process (another test's) would make this
    # one guess its plan, miss, and leave a dropped request in the status checked below.
    monkeypatch.setenv("CKPTD_DCP_GUESS_PLAN", "0")
    path = os.path.join(root, "a", "model.pt")
    checkpoint = torch_save(path, state(1))
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(1)["w"])
    queue = AsyncCallsQueue()
    directory = os.path.join(root, "dcp")
    queue.schedule_async_request(ckpt_dcp.async_save(state(2), directory))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    loaded = {"w": torch.zeros_like(state(2)["w"]), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory))
    assert torch.equal(loaded["w"], state(2)["w"])
    doc = daemon.status()
    assert doc["tier"]["commits_done"] == 1 and doc["tier"]["used_bytes"] == 0
    assert all(r["phase"] == "done" and r["flush"] is None for r in doc["requests"])
    assert os.listdir(tmp_path / "stage" / "saves") == []
    assert os.listdir(tmp_path / "stage" / "journal") == []
    checkpoint.close()


# ---------------------------------------------------------------------- stalls
@needs_fuse
def test_a_stalled_target_is_retried_and_status_stays_responsive(start_daemon, tmp_path,
                                                                  fault_target, monkeypatch):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(fault_target.mount, "model.pt")
    torch_save(path, state(1)).finalize_async_save(blocking=True)

    fault_target.set(stall=True, ops=["write"], match="model.pt")
    checkpoint = torch_save(path, state(2))
    # The stuck copy is abandoned after the stall timeout and tried again; meanwhile
    # `ckptd status` answers and shows where the save is.
    entry = wait_for(lambda: (r := request_of(daemon, path)) and r["phase"] == "flushing"
                     and r["flush"]["attempt"] >= 2 and r, 60, "a retried flush")
    flush = entry["flush"]
    assert flush["target"] == path and flush["bytes_total"] > flush["bytes_done"] >= 0
    assert daemon.status()["tier"]["stalls"] >= 1
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(1)["w"])  # the old one

    fault_target.set(stall=False)
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(2)["w"])
    assert request_of(daemon, path)["flush"] is None
    checkpoint.close()


# ---------------------------------------------------------------------- fail fast
@needs_root
@pytest.mark.parametrize("fault", ["ENOSPC", "EROFS"])
def test_a_full_or_read_only_target_fails_fast(start_daemon, tmp_path, small_tmpfs, fault,
                                               monkeypatch):
    daemon = tiered(start_daemon, tmp_path, small_tmpfs, env={"CKPTD_FLUSH_RETRY_START": "30"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(small_tmpfs, "model.pt")
    torch_save(path, state(1)).finalize_async_save(blocking=True)  # 1 MiB: fits
    if fault == "EROFS":
        subprocess.run(["mount", "-o", "remount,ro", small_tmpfs], check=True)
        size = 1
    else:
        size = 2  # 2 MiB more do not fit the 3 MiB target beside the first
    checkpoint = torch_save(path, state(2, size))
    with pytest.raises(CheckpointException) as raised:
        checkpoint.finalize_async_save(blocking=True)  # no retry: retries start after 30 s
    message = str(raised.value)
    assert fault in message and small_tmpfs in message and "model.pt" in message
    assert f"errno {getattr(errno, fault)}" in message
    assert daemon.status()["tier"]["retries"] == 0
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(1)["w"])
    assert visible(small_tmpfs) == ["model.pt", "model.pt.ckptd-sum"]
    assert os.listdir(tmp_path / "stage" / "saves") == []  # the failed save's local copy went
    checkpoint.close()


# ---------------------------------------------------------------------- a damaged local copy
@needs_fuse
def test_a_byte_flipped_in_the_local_copy_is_never_committed(start_daemon, tmp_path,
                                                             fault_target, monkeypatch):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount, env={"CKPTD_STALL_TIMEOUT": "600"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    directory = os.path.join(fault_target.mount, "ckpt")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(ckpt_dcp.async_save(state(1), directory))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

    fault_target.set(stall=True, ops=["create"], match=".distcp")  # before a byte is read
    queue.schedule_async_request(ckpt_dcp.async_save(state(2), directory))
    wait_for(lambda: fault_target.state()["blocked"] > 0, 60, "a flush held at the target")
    local = sorted(glob.glob(str(tmp_path / "stage" / "saves" / "*" / "*.distcp")))
    assert local
    with open(local[0], "r+b") as f:
        f.seek(os.path.getsize(local[0]) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    fault_target.set(stall=False)
    with pytest.raises(CheckpointException) as raised:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert "corrupt" in str(raised.value) and os.path.basename(local[0]) in str(raised.value)
    loaded = {"w": torch.zeros_like(state(1)["w"]), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory))
    assert torch.equal(loaded["w"], state(1)["w"])  # .metadata is still the first save's
    queue.close()


# ---------------------------------------------------------------------- the trainers die
def _save_and_hang(rank: int, world_size: int, directory: str, marker: str):
    queue = AsyncCallsQueue()
    queue.schedule_async_request(ckpt_dcp.async_save(
        {f"r{rank}": state(10 + rank)["w"]}, directory))
    open(f"{marker}.{rank}", "w").close()  # staged and handed over
    time.sleep(600)  # killed by the test long before


@needs_fuse
def test_every_rank_killed_mid_flush_the_daemon_finishes_and_commits(start_daemon, tmp_path,
                                                                     fault_target):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount)
    directory = os.path.join(fault_target.mount, "ckpt")
    fault_target.set(stall=True, ops=["write"], match=".distcp")
    marker = str(tmp_path / "staged")
    processes, _ = start_ranks(_save_and_hang, 2, daemon.socket, tmp_path,
                               args=(directory, marker))
    try:
        wait_for(lambda: all(os.path.exists(f"{marker}.{r}") for r in range(2)), 120,
                 "both ranks staged")
        wait_for(lambda: len([r for r in daemon.status()["requests"]
                              if r["phase"] == "flushing"]) == 2, 60, "two flushing requests")
        for p in processes:
            os.kill(p.pid, signal.SIGKILL)
        for p in processes:
            p.join(30)
        assert not os.path.exists(os.path.join(directory, ".metadata"))
    finally:
        fault_target.set(stall=False)
    wait_for(lambda: os.path.exists(os.path.join(directory, ".metadata")), 60,
             "the daemon to commit the checkpoint")
    loaded = {f"r{r}": torch.zeros_like(state(10 + r)["w"]) for r in range(2)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory))
    for r in range(2):
        assert torch.equal(loaded[f"r{r}"], state(10 + r)["w"])


# ---------------------------------------------------------------------- the daemon dies
@needs_fuse
def test_a_daemon_killed_mid_flush_resumes_from_the_journal(start_daemon, tmp_path,
                                                            fault_target, monkeypatch):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    directory = os.path.join(fault_target.mount, "ckpt")
    path = os.path.join(fault_target.mount, "model.pt")
    fault_target.set(stall=True, ops=["write"], match="")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(ckpt_dcp.async_save(state(3), directory))
    torch_save(path, state(4))
    wait_for(lambda: len([r for r in daemon.status()["requests"]
                          if r["phase"] == "flushing"]) == 2, 60, "two flushing requests")
    os.kill(daemon.pid, signal.SIGKILL)
    fault_target.set(stall=False)  # a writer killed while stalled exits once answered
    daemon.process.wait(30)
    assert not os.path.exists(os.path.join(directory, ".metadata"))

    restarted = tiered(start_daemon, tmp_path, fault_target.mount)
    wait_for(lambda: os.path.exists(os.path.join(directory, ".metadata"))
             and os.path.exists(path), 60, "the restarted daemon to finish both flushes")
    loaded = {"w": torch.zeros_like(state(3)["w"]), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory))
    assert torch.equal(loaded["w"], state(3)["w"])
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(4)["w"])
    wait_for(lambda: os.listdir(tmp_path / "stage" / "journal") == [], 30, "an empty journal")
    assert "resuming the flush" in restarted.log()


# ---------------------------------------------------------------------- back-pressure
@needs_fuse
def test_a_full_stage_budget_refuses_or_waits_by_policy(start_daemon, tmp_path, fault_target,
                                                       monkeypatch):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount, "--stage-budget", "3M",
                    "--stage-policy", "refuse", env={"CKPTD_STALL_TIMEOUT": "600"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    fault_target.set(stall=True, ops=["write"], match="")
    first = torch_save(os.path.join(fault_target.mount, "one.pt"), state(1, 2))
    with pytest.raises(DaemonRequestError) as raised:  # 2 + 2 MiB do not fit 3 MiB
        torch_save(os.path.join(fault_target.mount, "two.pt"), state(2, 2))
    assert raised.value.code == "stage_full" and "stage directory" in str(raised.value)
    assert daemon.status()["tier"]["used_bytes"] <= 3 << 20
    fault_target.set(stall=False)
    first.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(os.path.join(fault_target.mount, "one.pt"),
                                  weights_only=True)["w"], state(1, 2)["w"])
    first.close()


@needs_fuse
def test_a_save_waits_for_the_stage_budget_by_default(start_daemon, tmp_path, fault_target,
                                                      monkeypatch):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount, "--stage-budget", "3M",
                    env={"CKPTD_STALL_TIMEOUT": "600"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    fault_target.set(stall=True, ops=["write"], match="one.pt")
    first = torch_save(os.path.join(fault_target.mount, "one.pt"), state(1, 2))
    wait_for(lambda: (r := request_of(daemon, os.path.join(fault_target.mount, "one.pt")))
             and r["phase"] == "flushing", 60, "the first save flushing")
    second = TorchAsyncCheckpoint()
    import threading
    waiting = threading.Thread(target=second.async_save,
                               args=(state(2, 2), os.path.join(fault_target.mount, "two.pt")))
    waiting.start()  # blocks: 2 + 2 MiB do not fit the 3 MiB budget until one is flushed
    wait_for(lambda: daemon.status()["tier"]["waiting_saves"] == 1, 30, "a save waiting")
    assert daemon.status()["tier"]["used_bytes"] <= 3 << 20
    fault_target.set(stall=False)
    waiting.join(60)
    assert not waiting.is_alive()
    first.finalize_async_save(blocking=True)
    second.finalize_async_save(blocking=True)
    for name, seed in (("one.pt", 1), ("two.pt", 2)):
        assert torch.equal(torch.load(os.path.join(fault_target.mount, name),
                                      weights_only=True)["w"], state(seed, 2)["w"])
    first.close()
    second.close()


# ---------------------------------------------------------------------- EIO until the deadline
@needs_fuse
def test_eio_is_retried_until_the_flush_deadline_then_fails_naming_it(start_daemon, tmp_path,
                                                                      fault_target, monkeypatch):
    daemon = tiered(start_daemon, tmp_path, fault_target.mount,
                    env={"CKPTD_FLUSH_DEADLINE": "3"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(fault_target.mount, "model.pt")
    torch_save(path, state(1)).finalize_async_save(blocking=True)
    fault_target.set(error="EIO", ops=["write"], match="model.pt")
    checkpoint = torch_save(path, state(2))
    with pytest.raises(CheckpointException) as raised:
        checkpoint.finalize_async_save(blocking=True)
    message = str(raised.value)
    assert "deadline" in message and "EIO" in message and path in message
    assert daemon.status()["tier"]["retries"] >= 2
    fault_target.clear()
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(1)["w"])
    assert visible(fault_target.mount) == ["model.pt", "model.pt.ckptd-sum"]
    checkpoint.close()



def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@needs_fuse
@pytest.mark.parametrize("ending", ["abort", "deadline"])
def test_an_overwrite_ended_while_its_rename_is_held_keeps_the_previous_file(
        start_daemon, tmp_path, fault_target, monkeypatch, ending):
    """The target holds the copy's rename (its checksum record's first: the copy thread is
    inside the rename, the directory locked), and the save ends meanwhile: the trainer
    aborts it, or the flush deadline passes. The held rename lands when the target
    answers; the target must then hold the previous file and record, bit for bit."""
    daemon = tiered(start_daemon, tmp_path, fault_target.mount,
                    env={"CKPTD_FLUSH_DEADLINE": "3"} if ending == "deadline" else {})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(fault_target.mount, "model.pt")
    torch_save(path, state(1)).finalize_async_save(blocking=True)
    backing = tmp_path / "backing"
    old = {name: read(backing / name) for name in ("model.pt", "model.pt.ckptd-sum")}
    fault_target.set(stall=True, ops=["rename"], match="/model.pt")
    checkpoint = torch_save(path, state(2))
    wait_for(lambda: fault_target.state()["blocked"] > 0, 60, "the copy's rename held")
    if ending == "abort":
        checkpoint.close(abort=True)
        wait_for(lambda: request_of(daemon, path)["phase"] == "aborted", 30, "the abort")
    else:
        with pytest.raises(CheckpointException, match="deadline"):
            checkpoint.finalize_async_save(blocking=True)
        checkpoint.close()
    fault_target.clear()  # the held rename lands now
    wait_for(lambda: sorted(os.listdir(backing)) == sorted(old), 30,
             "only the checkpoint and its record at the target")
    assert {name: read(backing / name) for name in old} == old
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(1)["w"])
    torch_save(path, state(3)).finalize_async_save(blocking=True)  # the next one replaces it
    assert torch.equal(torch.load(path, weights_only=True)["w"], state(3)["w"])




def contents(directory) -> dict:
    """Every name in ``directory`` and its bytes (None: it went while being read)."""
    found = {}
    for name in os.listdir(directory):
        try:
            found[name] = read(os.path.join(directory, name))
        except FileNotFoundError:
            found[name] = None
    return found

@needs_fuse
def test_a_commit_given_up_while_its_metadata_rename_is_held_keeps_the_previous_one(
        start_daemon, tmp_path, fault_target, monkeypatch):
    """A checkpoint saved again into its directory: the new ``.metadata`` is held in its
    rename (its record's first) until the flush deadline gives the commit up. When the
    held rename lands, the directory must hold the previous ``.metadata`` and record, bit
    for bit, and the previous checkpoint load."""
    daemon = tiered(start_daemon, tmp_path, fault_target.mount,
                    env={"CKPTD_FLUSH_DEADLINE": "3"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    directory = os.path.join(fault_target.mount, "ckpt")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(ckpt_dcp.async_save(state(40), directory))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    backing = tmp_path / "backing" / "ckpt"
    metadata = {n: v for n, v in contents(backing).items() if "metadata" in n}
    assert sorted(metadata) == [".metadata", ".metadata.ckptd-sum"]
    fault_target.set(stall=True, ops=["rename"], match="/ckpt/.metadata")
    queue.schedule_async_request(ckpt_dcp.async_save(state(41), directory))
    with pytest.raises(CheckpointException) as raised:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert "deadline" in str(raised.value)
    fault_target.clear()  # the held rename lands now
    wait_for(lambda: {n: v for n, v in contents(backing).items() if "metadata" in n}
             == metadata, 30, "the previous .metadata and record, only")
    loaded = {"w": torch.zeros_like(state(40)["w"]), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory))
    assert torch.equal(loaded["w"], state(40)["w"])


# ---------------------------------------------------------------------- retention
def test_keep_last_deletes_only_older_checkpoints_once_newer_are_durable(start_daemon, tmp_path,
                                                                         monkeypatch):
    root = tmp_path / "ckpt"
    daemon = tiered(start_daemon, tmp_path, root, "--keep-last", "2")
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    (root / "runs").mkdir(parents=True)
    (root / "runs" / "notes.txt").write_text("not a checkpoint")
    queue = AsyncCallsQueue()
    for step_number in range(4):
        queue.schedule_async_request(ckpt_dcp.async_save(
            state(step_number), os.path.join(root, "runs", f"step{step_number}")))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    wait_for(lambda: sorted(os.listdir(root / "runs")) == ["notes.txt", "step2", "step3"], 30,
             "the two oldest checkpoints deleted")
    for step_number in (2, 3):
        loaded = {"w": torch.zeros_like(state(step_number)["w"]), "step": torch.tensor(0)}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(
            os.path.join(root, "runs", f"step{step_number}")))
        assert torch.equal(loaded["w"], state(step_number)["w"])
    queue.close()
