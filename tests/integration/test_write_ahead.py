"""Writer jobs sent ahead: a save's file is made ready (temporary created, space allocated)
while the trainer still copies, and written once the save is staged.

The trainer here is this test speaking the protocol itself (a STAGE, then the copy into
the pool and STAGED, or not), so a save can be held in staging for as long as a check
needs: the temporary its writer made ready shows in the directory, which is what each
test waits for before it stops the save by real means (an abort, the trainer killed -9,
the writer killed -9, the daemon killed -9). None may leave a file, a temporary or a
writer that stops answering.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import _remove_pool_of, start_daemon_process, wait_for

from ckpt_client import TorchAsyncCheckpoint, connect
from ckptd import protocol
from ckptd.checksum import TMP_MARKER
from ckptd.protocol import Abort, MessageType, SaveFormat, Stage, Staged

TENSOR = torch.arange(1024, dtype=torch.float32)


def stage_ahead(socket: str, path: str):
    """STAGE a one-tensor torch save; returns (connection, reply). Nothing is copied yet."""
    conn = connect(socket)
    reply = conn.call(MessageType.STAGE, Stage(
        format=SaveFormat.TORCH, path=path, buffers=[["float32", [1024], 4096]],
        skeleton=protocol.pack_value({"w": protocol.TensorRef(0)})), timeout=30)
    return conn, reply


#: A trainer that stages a save and then copies nothing, until it is killed.
TRAINER = """
import sys, time
from ckpt_client import connect
from ckptd import protocol
from ckptd.protocol import MessageType, SaveFormat, Stage
reply = connect(sys.argv[1]).call(MessageType.STAGE, Stage(
    format=SaveFormat.TORCH, path=sys.argv[2], buffers=[["float32", [1024], 4096]],
    skeleton=protocol.pack_value({"w": protocol.TensorRef(0)})), timeout=30)
print(reply.request_id, flush=True)
time.sleep(600)
"""


def temporaries(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(TMP_MARKER)]


def made_ready(directory) -> str:
    """The temporary a writer made ready ahead of the bytes (waited for)."""
    wait_for(lambda: temporaries(directory), 30, "the writer to make the file ready ahead")
    return temporaries(directory)[0]


def phase_of(daemon, request_id: int) -> str | None:
    return next((r["phase"] for r in daemon.status()["requests"] if r["id"] == request_id), None)


def copy_and_finish(daemon, conn, reply, path: str) -> None:
    """The trainer's part of a save staged with :func:`stage_ahead`: its copy and STAGED;
    the file it makes loads whole."""
    conn.pool[reply.offset:reply.offset + 4096].copy_(TENSOR.view(torch.uint8))
    conn.call(MessageType.STAGED, Staged(request_id=reply.request_id, copied_at=time.time()),
              timeout=30)
    wait_for(lambda: phase_of(daemon, reply.request_id) == "done", 30, "the save to be done")
    assert torch.equal(torch.load(path, weights_only=True)["w"], TENSOR)


def a_plain_save_still_works(daemon, monkeypatch, root) -> None:
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"after": TENSOR * 2}, os.path.join(root, "after.pt"))
    checkpoint.finalize_async_save(blocking=True)
    checkpoint.close()
    assert torch.equal(torch.load(os.path.join(root, "after.pt"), weights_only=True)["after"],
                       TENSOR * 2)


def test_a_save_staged_after_its_file_was_made_ready_is_written_whole(daemon):
    root = daemon.roots[0]
    path = os.path.join(root, "ahead.pt")
    conn, reply = stage_ahead(daemon.socket, path)
    made_ready(root)
    assert not os.path.exists(path)
    copy_and_finish(daemon, conn, reply, path)
    assert sorted(os.listdir(root)) == ["ahead.pt", "ahead.pt.ckptd-sum"]


@pytest.mark.parametrize("stop", ["abort", "trainer killed"])
def test_a_save_stopped_while_staging_leaves_no_file_of_its_job_sent_ahead(
        daemon, monkeypatch, stop):
    """Its writer removes the temporary it made ready; the path never appears; the writers
    go on writing other saves."""
    root = daemon.roots[0]
    path = os.path.join(root, "stopped.pt")
    if stop == "abort":
        conn, reply = stage_ahead(daemon.socket, path)
        request_id = reply.request_id
        made_ready(root)
        conn.call(MessageType.ABORT, Abort(request_ids=[request_id], reason="test abort"),
                  timeout=30)
    else:  # a trainer process that staged nothing, killed with its save in staging
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, daemon.socket, path],
                                   stdout=subprocess.PIPE, text=True)
        try:
            request_id = int(trainer.stdout.readline())
            made_ready(root)
        finally:
            trainer.kill()
            trainer.wait()
    wait_for(lambda: phase_of(daemon, request_id) in ("aborted", "failed", None), 30,
             "the daemon to stop the save")
    wait_for(lambda: not temporaries(root), 30, "the temporary made ahead to be removed")
    assert not os.path.exists(path)
    a_plain_save_still_works(daemon, monkeypatch, root)
    assert sorted(os.listdir(root)) == ["after.pt", "after.pt.ckptd-sum"]


def test_a_save_whose_writer_died_while_its_job_waited_is_written_afresh(daemon):
    """The writer holding the job sent ahead is killed -9: its temporary is swept when it
    is reaped, and once staged the save's file is written by a fresh job, whole."""
    root = daemon.roots[0]
    path = os.path.join(root, "orphan.pt")
    conn, reply = stage_ahead(daemon.socket, path)
    name = made_ready(root)
    writer_pid = int(name.split(".")[-3])  # .<file>.<pid>.<token>.ckptd-tmp
    assert writer_pid in [w["pid"] for w in daemon.status()["writers"]]
    os.kill(writer_pid, signal.SIGKILL)
    wait_for(lambda: not temporaries(root), 30, "the dead writer's temporary to be swept")
    copy_and_finish(daemon, conn, reply, path)
    assert sorted(os.listdir(root)) == ["orphan.pt", "orphan.pt.ckptd-sum"]


def test_a_daemon_killed_with_a_job_sent_ahead_leaves_nothing_after_the_next_start(
        tmp_path, monkeypatch):
    daemon = start_daemon_process(tmp_path, name="first")
    root = daemon.roots[0]
    try:
        stage_ahead(daemon.socket, os.path.join(root, "never.pt"))
        made_ready(root)
        daemon.stop(signal.SIGKILL, 30)
    finally:
        _remove_pool_of(daemon)
    successor = start_daemon_process(tmp_path, name="first")  # the same socket and roots
    try:
        wait_for(lambda: not temporaries(root), 30, "the successor to sweep the temporary")
        assert os.listdir(root) == []
        a_plain_save_still_works(successor, monkeypatch, root)
    finally:
        successor.stop(signal.SIGTERM, 30)
        _remove_pool_of(successor)


def test_a_save_whose_jobs_could_not_be_sent_ahead_is_written_once_staged(
        tmp_path, monkeypatch):
    """Sending the jobs ahead notes their directory in the daemon's journal; with the
    journal's filesystem full that fails after the STAGE was answered. The save must not
    wait for jobs that never reached a writer: it is written once staged."""
    from faults import small_tmpfs

    with small_tmpfs(tmp_path / "run-full", "512k") as run_dir:
        daemon = start_daemon_process(tmp_path, name="full")
        try:
            # The journal's last page full (as after many directories), then the filesystem:
            # the next directory noted needs a page there is no room for.
            (journal,) = [n for n in os.listdir(run_dir) if n.endswith(".dirs")]
            with open(os.path.join(run_dir, journal), "a") as f:
                room = -f.tell() % 4096  # a line of no kind the journal's reader keeps
                f.write(("#" * (room - 1) + "\n") if room else "")
            with open(os.path.join(run_dir, "filler"), "wb") as filler:
                try:
                    while True:
                        filler.write(b"\0" * 65536)
                        filler.flush()
                except OSError:
                    pass
            monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
            path = os.path.join(daemon.roots[0], "new_dir", "model.pt")
            os.makedirs(os.path.dirname(path))
            checkpoint = TorchAsyncCheckpoint()
            checkpoint.async_save({"w": TENSOR}, path)
            checkpoint.finalize_async_save(blocking=True)
            checkpoint.close()
            assert torch.equal(torch.load(path, weights_only=True)["w"], TENSOR)
            assert "could not be sent ahead" in daemon.log()
        finally:
            daemon.stop(signal.SIGTERM, 30)
            _remove_pool_of(daemon)
