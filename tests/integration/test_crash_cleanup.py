"""What a crash leaves behind, and what the next daemon must clean: real kills, real traces.

- Writers die with their daemon, also when it is killed while they are still starting
  (they import torch for seconds).
- A writer killed in the middle of a file leaves its temporary; it is swept when the
  writer is reaped, and a daemon killed with its writers has its temporaries swept by the
  next daemon at the same socket.
- A save into new directories makes each new directory durable in its parent (traced
  with strace on the daemon and its writers), and ``ckptd verify`` passes on every kind
  of checkpoint the daemon writes.

A writer is held in the middle of a file by strace's fault injection: its fsync of the
temporary is delayed, so the temporary exists for as long as the test needs, by real means.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import _remove_pool_of, start_daemon_process, wait_for

from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict, CheckpointException,
                         LocalCheckpointManager, TorchAsyncCheckpoint, dcp)
from ckptd.checksum import TMP_MARKER
from ckptd.protocol import process_alive

needs_strace = pytest.mark.skipif(shutil.which("strace") is None or os.geteuid() != 0,
                                  reason="needs strace and root to trace / hold writers")


def writer_pids(daemon) -> list[int]:
    return [w["pid"] for w in daemon.status()["writers"]]


def writers_of(daemon_pid: int) -> list[int]:
    """Writer processes started by ``daemon_pid`` (from /proc, also before it is ready)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"ckptd.storage.writer_process" in argv and str(daemon_pid).encode() in argv:
            found.append(int(entry))
    return found


def temporaries(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(TMP_MARKER)]


def tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("TracerPid:")))


def attach_strace(pids, *options) -> subprocess.Popen:
    """strace attached to every process of ``pids`` (returns once it traces them all)."""
    command = ["strace", "-qq", *options]
    for pid in pids:
        command += ["-p", str(pid)]
    tracer = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    wait_for(lambda: all(tracer_of(pid) == tracer.pid for pid in pids), 30, "strace to attach")
    return tracer


class HeldFsync:
    """strace attached to processes, delaying their fsync calls by ``seconds``."""

    def __init__(self, pids, seconds: int = 120) -> None:
        self.process = attach_strace(pids, "-e", "trace=fsync", "-e",
                                     f"inject=fsync:delay_enter={seconds * 1_000_000}",
                                     "-o", "/dev/null")

    def release(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(30)


# ---------------------------------------------------------------- writers die with the daemon

def test_writers_die_with_a_sigkilled_daemon(start_daemon):
    daemon = start_daemon()
    writers = writer_pids(daemon)
    assert writers and all(process_alive(pid) for pid in writers)
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.process.wait()
    wait_for(lambda: not any(process_alive(pid) for pid in writers), 10,
             "the writers to die with their daemon")


def test_writers_die_when_the_daemon_is_killed_while_they_start(tmp_path):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "ckptd.log", "wb")
    root = tmp_path / "ckpt"
    root.mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--socket",
                               str(run_dir / "ckptd.sock"), "--root", str(root),
                               "--pool-size", "64M", "--writers", "2"],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        writers = wait_for(lambda: writers_of(daemon.pid) if len(writers_of(daemon.pid)) == 2
                           else None, 60, "both writer processes to exist")
        assert not (run_dir / "ckptd.ready").exists(), "the test must kill during start-up"
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait()
        wait_for(lambda: not any(process_alive(pid) for pid in writers), 10,
                 "starting writers to die with their daemon")
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptd-{os.getuid()}-{daemon.pid}-"):
                os.unlink(os.path.join("/dev/shm", name))


# ---------------------------------------------------------------- temporaries of dead writers

def start_held_save(daemon, path, monkeypatch):
    """A torch save whose writer stops in the fsync of its temporary; returns (hold, queue)."""
    hold = HeldFsync(writer_pids(daemon))
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"w": torch.ones(1 << 18)}, path)
    wait_for(lambda: temporaries(os.path.dirname(path)), 60, "the writer's temporary")
    return hold, checkpoint


@needs_strace
def test_a_killed_writers_temporary_is_swept_when_it_is_reaped(start_daemon, monkeypatch):
    daemon = start_daemon()
    path = os.path.join(daemon.roots[0], "model.pt")
    hold, checkpoint = start_held_save(daemon, path, monkeypatch)
    try:
        (leftover,) = temporaries(daemon.roots[0])
        writer = int(leftover.split(".")[3])  # .model.pt.<pid>.<token>.ckptd-tmp
        os.kill(writer, signal.SIGKILL)
        hold.release()  # a traced writer dies of the pending kill only once it runs again
        with pytest.raises(CheckpointException, match="writer process died"):
            checkpoint.finalize_async_save(blocking=True)
        assert temporaries(daemon.roots[0]) == [] and not os.path.exists(path)
    finally:
        hold.release()


@needs_strace
def test_a_crashed_daemons_temporaries_are_swept_by_the_next_one(tmp_path, monkeypatch):
    daemon = start_daemon_process(tmp_path, name="same")
    step = os.path.join(daemon.roots[0], "step_1")
    os.makedirs(step)
    hold = None
    try:
        hold, _ = start_held_save(daemon, os.path.join(step, "model.pt"), monkeypatch)
        writers = writer_pids(daemon)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.process.wait()
        hold.release()  # a traced writer dies of the pending kill only once it runs again
        wait_for(lambda: not any(process_alive(pid) for pid in writers), 10, "the writers to die")
        assert temporaries(step), "the crash must leave the temporary behind"
        _remove_pool_of(daemon)
        daemon = start_daemon_process(tmp_path, name="same")  # same socket, as systemd does
        assert temporaries(step) == []
        assert [n for n in os.listdir(os.path.dirname(daemon.socket)) if n.endswith(".dirs")] \
            == [f"ckptd.{daemon.pid}.dirs"], "the predecessor's journal is consumed"
    finally:
        if hold is not None:
            hold.release()
        daemon.stop(signal.SIGKILL, 30)
        _remove_pool_of(daemon)


# ---------------------------------------------------------------- durable directories

@needs_strace
def test_new_directories_are_made_durable_before_the_save_completes(start_daemon, tmp_path,
                                                                    monkeypatch):
    local_dir = tmp_path / "ckpt" / "local"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    trace = tmp_path / "trace"
    tracer = attach_strace([daemon.pid, *writer_pids(daemon)], "-f", "-y", "-e",
                           "trace=mkdir,mkdirat,fsync,rename,renameat,renameat2", "-o", str(trace))
    try:
        monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
        step = os.path.join(daemon.roots[0], "deep", "er", "step_1")
        queue = AsyncCallsQueue()
        queue.schedule_async_request(dcp.async_save({"w": torch.ones(16)}, step))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        manager = LocalCheckpointManager(local_dir / "ckpt", session_id="s", socket=daemon.socket)
        manager.save(BasicTensorAwareStateDict({"w": torch.ones(4)}), 7)
    finally:
        tracer.terminate()
        tracer.wait(30)
    calls = open(trace).read().splitlines()
    made = [(m.group(1), m.group(2)) for line in calls
            if (m := re.search(r'mkdirat\(\d+<([^>]*)>, "([^"]+)"', line)) and line.endswith("= 0")]
    expected = {os.path.join(daemon.roots[0], "deep"), step, local_dir / "ckpt" / "s",
                local_dir / "ckpt" / "s" / "iter_0000007"}
    assert {str(d) for d in expected} <= {os.path.join(p, n) for p, n in made}, made
    for parent, name in made:
        index = next(i for i, line in enumerate(calls) if f'<{parent}>, "{name}"' in line)
        assert any(re.search(rf"fsync\(\d+<{re.escape(parent)}>\) += 0", later)
                   for later in calls[index:]), f"{parent} not fsynced after creating {name}"


def test_ckptd_verify_passes_on_every_kind_of_checkpoint(start_daemon, tmp_path, monkeypatch):
    local_dir = tmp_path / "ckpt" / "local"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    torch_file = os.path.join(daemon.roots[0], "model.pt")
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"w": torch.ones(8)}, torch_file)
    checkpoint.finalize_async_save(blocking=True)
    step = os.path.join(daemon.roots[0], "step_3")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save({"w": torch.ones(8)}, step))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    manager = LocalCheckpointManager(local_dir / "ckpt", socket=daemon.socket)
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(8)}), 3)
    for target, files in ((torch_file, 1), (step, 2), (local_dir / "ckpt" / "iter_0000003", 2)):
        run = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(target)],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith(f"{files} file(s) verified"), run.stdout
    assert json.load(open(os.path.join(os.path.dirname(daemon.socket), "ckptd.ready")))[
        "incarnation"]
