"""Writers start while the trainer still copies: a COPIED report starts the jobs sent ahead,
which write what is copied, wait for the rest, and rename nothing before STAGED.

The trainer here speaks the protocol itself (STAGE, the copy of the first tensor, COPIED,
then the rest or not), so a save can be held with its writer waiting for the copy for as
long as a check needs; `ckptd status` shows that writer's job in its ``staging`` phase,
which is what each test waits for before it goes on or stops the save by real means (an
abort, the trainer killed -9, the writer killed -9). A stopped save leaves no file and no
temporary, and its writers go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import wait_for
from test_write_ahead import a_plain_save_still_works, phase_of, temporaries

from ckpt_client import TorchAsyncCheckpoint, connect
from ckptd import protocol
from ckptd.protocol import Abort, Copied, MessageType, SaveFormat, Stage, Staged

FIRST = torch.arange(1024, dtype=torch.float32)
SECOND = torch.full((262144,), 3.5)
BUFFERS = [["float32", [1024], FIRST.nbytes], ["float32", [262144], SECOND.nbytes]]
OFFSETS = protocol.layout_extent([b[2] for b in BUFFERS])[0]
SKELETON = protocol.pack_value({"first": protocol.TensorRef(0), "second": protocol.TensorRef(1)})


def put(pool, base: int, index: int, tensor: torch.Tensor) -> None:
    start = base + OFFSETS[index]
    pool[start:start + tensor.nbytes].copy_(tensor.view(torch.uint8))


def first_half_copied(conn, path: str):
    """STAGE the two-tensor save, copy the first tensor, report it; returns the reply."""
    reply = conn.call(MessageType.STAGE, Stage(format=SaveFormat.TORCH, path=path,
                                               buffers=BUFFERS, skeleton=SKELETON), timeout=30)
    put(conn.pool, reply.offset, 0, FIRST)
    conn.tell(MessageType.COPIED, Copied(request_id=reply.request_id,
                                         through=OFFSETS[0] + FIRST.nbytes))
    return reply


def writing_early(daemon) -> int:
    """The pid of the writer whose job waits for the trainer's copy (waited for)."""
    def waiting():
        return next((w["pid"] for w in daemon.status()["writers"]
                     if "staging" in w.get("phases", [])), None)
    return wait_for(waiting, 30, "a writer to write the copied tensor and wait for the rest")


#: A trainer that copies the first tensor, reports it and copies nothing more, until killed.
TRAINER = """
import sys, time
import torch
from ckpt_client import connect
from ckptd import protocol
from ckptd.protocol import Copied, MessageType, SaveFormat, Stage
first = torch.arange(1024, dtype=torch.float32)
conn = connect(sys.argv[1])
reply = conn.call(MessageType.STAGE, Stage(
    format=SaveFormat.TORCH, path=sys.argv[2],
    buffers=[["float32", [1024], 4096], ["float32", [262144], 1048576]],
    skeleton=protocol.pack_value({"first": protocol.TensorRef(0),
                                  "second": protocol.TensorRef(1)})), timeout=30)
conn.pool[reply.offset:reply.offset + 4096].copy_(first.view(torch.uint8))
conn.tell(MessageType.COPIED, Copied(request_id=reply.request_id, through=4096))
print(reply.request_id, flush=True)
time.sleep(600)
"""


def test_a_save_reported_half_copied_is_written_with_the_bytes_copied_after(daemon):
    root = daemon.roots[0]
    path = os.path.join(root, "early.pt")
    conn = connect(daemon.socket)
    reply = first_half_copied(conn, path)
    writing_early(daemon)
    assert phase_of(daemon, reply.request_id) == "staging" and not os.path.exists(path)
    put(conn.pool, reply.offset, 1, SECOND)  # the rest of the copy, only now
    conn.call(MessageType.STAGED, Staged(request_id=reply.request_id, copied_at=time.time()),
              timeout=30)
    wait_for(lambda: phase_of(daemon, reply.request_id) == "done", 30, "the save to be done")
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["first"], FIRST) and torch.equal(loaded["second"], SECOND)
    assert sorted(os.listdir(root)) == ["early.pt", "early.pt.ckptd-sum"]


@pytest.mark.parametrize("stop", ["abort", "trainer killed", "writer killed"])
def test_a_save_stopped_while_its_writer_waits_for_the_copy_leaves_nothing(
        daemon, monkeypatch, stop):
    """The writer, already writing, is told to drop the job (abort, trainer gone) or dies
    with it: the path never appears, no temporary stays, the next save is written."""
    root = daemon.roots[0]
    path = os.path.join(root, "stopped.pt")
    trainer = None
    if stop == "trainer killed":
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, daemon.socket, path],
                                   stdout=subprocess.PIPE, text=True)
        request_id = int(trainer.stdout.readline())
    else:
        conn = connect(daemon.socket)
        request_id = first_half_copied(conn, path).request_id
    try:
        writer = writing_early(daemon)
        if stop == "abort":
            conn.call(MessageType.ABORT, Abort(request_ids=[request_id], reason="test abort"),
                      timeout=30)
        elif stop == "writer killed":
            os.kill(writer, signal.SIGKILL)
    finally:
        if trainer is not None:
            trainer.kill()
            trainer.wait()
    wait_for(lambda: phase_of(daemon, request_id) in ("aborted", "failed", None), 30,
             "the daemon to stop the save")
    wait_for(lambda: not temporaries(root), 30, "the temporary to be removed")
    assert not os.path.exists(path)
    if stop == "writer killed":  # the trainer hears it: its STAGED is refused
        with pytest.raises(Exception, match="writer process died"):
            conn.call(MessageType.STAGED, Staged(request_id=request_id), timeout=30)
    a_plain_save_still_works(daemon, monkeypatch, root)
    assert sorted(os.listdir(root)) == ["after.pt", "after.pt.ckptd-sum"]


def test_a_zero_stall_save_is_written_early_by_the_client_s_reports(daemon, monkeypatch):
    """End to end: with a report every 4 MiB, a 64 MiB zero-stall save (its copy made in
    the background, which reports by default on a node with CPUs to spare: asked for
    here) has its writers started while it was copied, and the file is the state dict's."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    monkeypatch.setenv("CKPTD_COPY_REPORT_BYTES", str(4 << 20))
    monkeypatch.setenv("CKPTD_COPY_REPORTS", "background")
    state = {f"w{i}": torch.randn(1 << 20) for i in range(16)}
    path = os.path.join(daemon.roots[0], "large.pt")
    checkpoint = TorchAsyncCheckpoint()
    try:
        checkpoint.async_save(state, path, zero_stall=True)
        checkpoint.finalize_async_save(blocking=True)
    finally:
        checkpoint.close()
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    (entry,) = [r for r in daemon.status()["requests"] if r["path"] == path]
    assert entry["phase"] == "done" and entry["written_early"] is True


def test_a_save_into_a_directory_not_made_yet_is_not_written_before_it_is_staged(daemon):
    """Its writers would create the directory: an aborted save must leave none."""
    root = daemon.roots[0]
    step = os.path.join(root, "step_7")
    conn = connect(daemon.socket)
    reply = conn.call(MessageType.STAGE, Stage(
        format=SaveFormat.DCP, path=step, buffers=BUFFERS,
        files=[["__0_0.distcp", [0]], ["__0_1.distcp", [1]]]), timeout=30)
    put(conn.pool, reply.offset, 0, FIRST)
    conn.call(MessageType.COPIED, Copied(request_id=reply.request_id,
                                         through=OFFSETS[0] + FIRST.nbytes), timeout=30)
    conn.call(MessageType.ABORT, Abort(request_ids=[reply.request_id], reason="test abort"),
              timeout=30)
    wait_for(lambda: not any(w["jobs"] for w in daemon.status()["writers"]), 30,
             "the writers to answer every job of the aborted save")
    assert not os.path.exists(step)
    (entry,) = [r for r in daemon.status()["requests"] if r["id"] == reply.request_id]
    assert entry["phase"] == "aborted" and entry["written_early"] is False


def test_a_job_started_early_behind_a_stuck_writer_is_started_early_again(start_daemon):
    """The writer holding a job started while its trainer copies hangs on another save's
    file and is replaced: the fresh writer takes the job as started early, so it still
    writes only what is copied and renames nothing before STAGED."""
    daemon = start_daemon(writers=1, extra_args=["--stall-timeout", "4"])
    root = daemon.roots[0]
    conn = connect(daemon.socket)
    path = os.path.join(root, "early.pt")
    early = conn.call(MessageType.STAGE, Stage(format=SaveFormat.TORCH, path=path,
                                               buffers=BUFFERS, skeleton=SKELETON), timeout=30)
    wait_for(lambda: temporaries(root), 30, "the file to be made ready ahead")
    (hung,) = [w["pid"] for w in daemon.status()["writers"]]
    os.kill(hung, signal.SIGSTOP)  # as a write stuck in a hung target would hold it
    other = conn.call(MessageType.STAGE, Stage(
        format=SaveFormat.TORCH, path=os.path.join(root, "other.pt"), buffers=BUFFERS,
        skeleton=SKELETON), timeout=30)
    put(conn.pool, other.offset, 0, FIRST)
    put(conn.pool, other.offset, 1, SECOND)
    conn.call(MessageType.STAGED, Staged(request_id=other.request_id), timeout=30)
    put(conn.pool, early.offset, 0, FIRST)
    conn.call(MessageType.COPIED, Copied(request_id=early.request_id,
                                         through=OFFSETS[0] + FIRST.nbytes), timeout=30)
    (entry,) = [r for r in daemon.status()["requests"] if r["id"] == early.request_id]
    if phase_of(daemon, other.request_id) == "failed":
        pytest.skip("the stall check replaced the writer before the report came (a very "
                    "loaded machine): the job was not started early at the stuck writer")
    assert entry["written_early"]  # started at the stuck writer, before it was given up on
    wait_for(lambda: phase_of(daemon, other.request_id) == "failed", 30,
             "the stuck writer to be given up on")
    fresh = writing_early(daemon)
    assert fresh != hung and not os.path.exists(path)
    assert phase_of(daemon, early.request_id) == "staging"
    final = torch.full((262144,), -1.25)
    put(conn.pool, early.offset, 1, final)  # the rest of the copy, only now
    conn.call(MessageType.STAGED, Staged(request_id=early.request_id), timeout=30)
    wait_for(lambda: phase_of(daemon, early.request_id) == "done", 30, "the save to be done")
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["first"], FIRST) and torch.equal(loaded["second"], final)


def test_a_writer_that_reads_no_channel_for_a_while_misses_no_report(daemon):
    """Reports come faster than a busy writer reads its channel (here: stopped while they
    come): none may be dropped, the last ("all staged") least of all."""
    root = daemon.roots[0]
    path = os.path.join(root, "many.pt")
    conn = connect(daemon.socket)
    reply = first_half_copied(conn, path)
    writer = writing_early(daemon)
    os.kill(writer, signal.SIGSTOP)
    try:
        put(conn.pool, reply.offset, 1, SECOND)
        for through in range(OFFSETS[1] + 1, OFFSETS[1] + 1 + 3000):  # more than a send queue
            conn.tell(MessageType.COPIED, Copied(request_id=reply.request_id, through=through))
        conn.call(MessageType.STAGED, Staged(request_id=reply.request_id), timeout=30)
    finally:
        os.kill(writer, signal.SIGCONT)
    wait_for(lambda: phase_of(daemon, reply.request_id) == "done", 60, "the save to be done")
    assert torch.equal(torch.load(path, weights_only=True)["second"], SECOND)
