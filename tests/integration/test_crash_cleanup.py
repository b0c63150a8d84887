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
import time

import pytest
import torch

from conftest import _remove_pool_of, start_daemon_process, wait_for
from test_local_checkpoints import make_nodes  # noqa: F401  (fixture: daemons as nodes)

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
        # the file's own temporary (its checksum record's may be there too: it is written
        # while the file's fsync runs)
        (leftover,) = [n for n in temporaries(daemon.roots[0])
                       if not n.startswith(".model.pt.ckptd-sum.")]
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


@needs_strace
def test_back_to_back_kills_leave_nothing_behind(tmp_path, monkeypatch):
    # Daemon A is killed while its writer is in the fsync of a temporary (held there by
    # strace); B starts at once at the same socket and is killed during its start-up,
    # its pool made and its writers starting; C starts. A's temporary and the pools of A
    # and B must all be gone, and A's and B's journals consumed. (A predecessor or writer
    # still exiting when its successor starts is covered in tests/unit/server.)
    env = {"CKPTD_LEFTOVER_SWEEP_INTERVAL": "0.2"}
    first = start_daemon_process(tmp_path, name="same", env=env)
    step = os.path.join(first.roots[0], "step_1")
    os.makedirs(step)
    hold, started = None, [first]
    try:
        hold, _ = start_held_save(first, os.path.join(step, "model.pt"), monkeypatch)
        os.kill(first.pid, signal.SIGKILL)
        first.process.wait()
        assert temporaries(step), "the held writer keeps its temporary"
        second = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--socket", first.socket,
             "--root", first.roots[0], "--pool-size", "64M", "--writers", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env={**first.env, **env})
        wait_for(lambda: len(writers_of(second.pid)) == 2, 60, "B's writers to start")
        assert not os.path.exists(os.path.join(os.path.dirname(first.socket), "ckptd.ready")) \
            or json.load(open(os.path.join(os.path.dirname(first.socket), "ckptd.ready"))
                         ).get("pid") != second.pid, "B must be killed during start-up"
        os.kill(second.pid, signal.SIGKILL)
        second.wait()
        hold.release()
        third = start_daemon_process(tmp_path, name="same", env=env)
        started.append(third)
        wait_for(lambda: not temporaries(step), 30, "A's temporary to be swept")
        pools = lambda: [n for n in os.listdir("/dev/shm") for pid in (first.pid, second.pid)
                         if n.startswith(f"ckptd-{os.getuid()}-{pid}-")]
        wait_for(lambda: not pools(), 30, "the pools of A and B to be removed")
        run_dir = os.path.dirname(third.socket)
        wait_for(lambda: [n for n in os.listdir(run_dir) if n.endswith(".dirs")]
                 == [f"ckptd.{third.pid}.dirs"], 30, "A's and B's journals to be consumed")
        assert third.status()["pid"] == third.pid
    finally:
        if hold is not None:
            hold.release()
        for daemon in started:
            daemon.stop(signal.SIGKILL, 30)
            _remove_pool_of(daemon)
        for name in os.listdir("/dev/shm"):
            if "second" in locals() and name.startswith(f"ckptd-{os.getuid()}-{second.pid}-"):
                os.unlink(os.path.join("/dev/shm", name))


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


# ---------------------------------------------------------------- replicated local saves

def replicated_save_when_told(rank, world_size, roots, flags):
    """A local save with replication factor 2, started when the test says go (once strace
    traces this rank); when it returns, a stat of a name that cannot exist marks the moment
    in the trace."""
    from ckpt_client import (BasicTensorAwareStateDict, CliqueReplicationStrategy,
                             LocalCheckpointManager)
    from test_local_checkpoints import SESSION, state_of

    strategy = CliqueReplicationStrategy.from_replication_params(2, 2)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    manager.find_latest()
    open(f"{flags}.ready{rank}", "w").close()
    while not os.path.exists(f"{flags}.go"):  # the test attaches strace, then says go
        time.sleep(0.02)
    manager.save(BasicTensorAwareStateDict(state_of(rank, 7)), 7)
    try:
        os.stat(f"/{RETURNED_MARK}{rank}")
    except FileNotFoundError:
        pass
    return manager.last_save_report


RETURNED_MARK = "ckptd-test-save-returned-by-rank-"


def strace_events(path) -> list[tuple]:
    """(pid, call, arguments, result, completed at) of each traced call, from
    ``strace -f -ttt -T -y`` output (split ``unfinished``/``resumed`` lines joined)."""
    pending, events = {}, []
    for line in open(path).read().splitlines():
        match = re.match(r"(\d+) +([\d.]+) (.*)$", line)
        if not match:
            continue
        pid, stamp, rest = int(match.group(1)), float(match.group(2)), match.group(3)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest.removesuffix("<unfinished ...>")
            continue
        resumed = re.match(r"<\.\.\. \w+ resumed>(.*)$", rest)
        if resumed:
            rest, done_at = pending.pop(pid, "").rstrip() + resumed.group(1), stamp
        else:
            duration = re.search(r"<([\d.]+)>$", rest)
            done_at = stamp + (float(duration.group(1)) if duration else 0.0)
        call = re.match(r"(\w+)\((.*)\) += (-?\d+)", rest)
        if call:
            events.append((pid, call.group(1), call.group(2), int(call.group(3)), done_at))
    return events


@needs_strace
def test_a_replicated_local_save_returns_only_after_its_directories_are_durable(make_nodes,
                                                                              tmp_path):
    # Two nodes, two ranks each, factor 2 across nodes (cliques 0-2 and 1-3): each node
    # holds its ranks' parts, their mates' replicas and the commit marker. Every name
    # renamed into an iteration directory (parts, checksum records, replicas, 'committed'
    # and its record) must have the directory fsynced after the rename and before the
    # save returns to any rank of that node (both ranks of a node commit there).
    from multirank import collect, start_ranks, values
    from test_local_checkpoints import SESSION

    nodes = make_nodes(2)
    flags = str(tmp_path / "flag")
    processes, results = start_ranks(replicated_save_when_told, 4, nodes.sockets(2), tmp_path,
                                     args=(nodes.roots(2), flags))
    wait_for(lambda: all(os.path.exists(f"{flags}.ready{r}") for r in range(4)), 120,
             "every rank to register its session")
    daemons = [d.pid for d in nodes.daemons]
    traced = daemons + [w for d in nodes.daemons for w in writer_pids(d)] + \
        [p.pid for p in processes]
    trace = tmp_path / "trace"
    tracer = attach_strace(traced, "-f", "-ttt", "-T", "-y", "-e",
                           "trace=fsync,rename,renameat,renameat2,newfstatat,stat,statx",
                           "-o", str(trace))
    try:
        open(f"{flags}.go", "w").close()
        reports = values(collect(processes, results, timeout=120))
    finally:
        tracer.terminate()
        tracer.wait(30)
    assert all(not r["reduced_redundancy"] for r in reports), reports
    events = strace_events(trace)
    for node in range(2):
        directory = os.path.join(nodes.dirs[node], "ckpt", SESSION, "iter_0000007")
        marks = [t for _, _, arg, _, t in events for rank in (2 * node, 2 * node + 1)
                 if f"/{RETURNED_MARK}{rank}\"" in arg]
        assert len(marks) == 2, f"node {node}'s ranks' returns are not in the trace"
        returned = min(marks)
        renames = [(arg, t) for _, call, arg, result, t in events
                   if call.startswith("rename") and result == 0 and f"<{directory}>" in arg]
        names = {re.findall(r'"([^"]+)"', arg)[-1] for arg, _ in renames}
        assert {f"rank_{r}.part" for r in range(4)} | {"committed", "committed.ckptd-sum"} \
            <= names, names
        syncs = [t for _, call, arg, result, t in events
                 if call == "fsync" and result == 0 and re.fullmatch(rf"\d+<{re.escape(directory)}>", arg)]
        for arg, renamed_at in renames:
            assert any(renamed_at <= t <= returned for t in syncs), (
                f"node {node}: {arg} was not made durable (directory fsync) before a rank "
                f"of that node returned from its save at {returned:.6f}; renamed at {renamed_at:.6f}, "
                f"directory fsyncs at {syncs}")
