"""A writer given up as stuck while it replaces a file never costs the previous file.

The stall deadline gives up on a writer that stops answering: the save fails on its
ranks, the writer is SIGKILLed and replaced, and the file the save was replacing must be
the previous checkpoint again, bit for bit with its checksum record, once the stuck call
returns. The stuck call here is a ``rename`` that puts the writer's file, or its checksum
record (renamed first), into place, held by a FUSE target (tests/faultfs.py): a kill cannot
stop a rename that is in the kernel already; it holds the directory's lock and lands when
the target answers. (A
SIGSTOPped writer cannot stand in for it: the give-up's SIGKILL ends a stopped process
before it runs again, so it never renames late.)
"""

import os

import pytest
import torch

from conftest import wait_for
from faultfs import FaultFS, fuse_unavailable
from ckpt_client import CheckpointException, TorchAsyncCheckpoint
from ckptd.checksum import verify_file

needs_fuse = pytest.mark.skipif(bool(fuse_unavailable()), reason=fuse_unavailable() or "-")


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def settled(daemon) -> bool:
    status = daemon.status()
    return (not status["stuck_writers"] and status["pool"]["used_bytes"] == 0
            and all(w["jobs"] == 0 for w in status["writers"]))


@needs_fuse
@pytest.mark.parametrize("held", ["file", "record"])
def test_a_writer_given_up_in_its_rename_leaves_the_previous_file_and_record(
        start_daemon, tmp_path, held):
    backing = tmp_path / "backing"
    with FaultFS(backing, tmp_path / "mnt") as fs:
        daemon = start_daemon(roots=[fs.mount], writers=1, extra_args=["--stall-timeout", "2"])
        path = os.path.join(fs.mount, "last.pt")
        old, new = torch.arange(1 << 14, dtype=torch.float32), torch.full((1 << 14,), -1.0)
        checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
        try:
            checkpoint.async_save({"w": old}, path)
            checkpoint.finalize_async_save(blocking=True)
            old_file, old_record = read(path), read(path + ".ckptd-sum")
            [writer] = daemon.status()["writers"]
            # The file's temporary is .last.pt.<writer pid>.*, its record's .last.pt.ckptd-sum.*
            fs.set(stall=True, ops=["rename"],
                   match=f"/.last.pt.{writer['pid']}." if held == "file" else "/last.pt.ckptd-sum")
            checkpoint.async_save({"w": new}, path)
            wait_for(lambda: fs.state()["blocked"] > 0, 30, "the overwrite's rename held")
            # The daemon gives up on the writer and keeps answering meanwhile.
            wait_for(lambda: daemon.status()["stuck_writers"], 30, "the writer given up on")
            with pytest.raises(CheckpointException) as raised:
                checkpoint.finalize_async_save(blocking=True)
            assert "stalled in phase 'commit'" in str(raised.value)
            assert read(backing / "last.pt") == old_file
            fs.clear()  # the held rename lands now; then the killed writer exits
            wait_for(lambda: settled(daemon), 30, "the given-up writer to exit")
            assert read(path) == old_file and read(path + ".ckptd-sum") == old_record
            assert torch.equal(torch.load(path, weights_only=True)["w"], old)
            verify_file(path)
            assert sorted(os.listdir(backing)) == ["last.pt", "last.pt.ckptd-sum"]
            checkpoint.async_save({"w": new}, path)  # the next save replaces it as usual
            checkpoint.finalize_async_save(blocking=True)
        finally:
            checkpoint.close()
        assert torch.equal(torch.load(path, weights_only=True)["w"], new)
        verify_file(path)


@needs_fuse
@pytest.mark.parametrize("before", [b"the previous commit", None])
def test_a_commit_failed_at_its_deadline_that_lands_late_is_undone(start_daemon, tmp_path,
                                                                   before):
    # A .metadata commit overstays the whole-save deadline with its rename held by the
    # target: the daemon fails it and replaces the writer, but the rename lands when the
    # target answers. Once that writer has exited, the path holds what it held before.
    from ckpt_client import connect
    from ckpt_client.errors import DaemonRequestError
    from ckpt_client.transport import waits
    from ckptd.protocol import CommitFile, MessageType

    backing = tmp_path / "backing"
    with FaultFS(backing, tmp_path / "mnt") as fs:
        daemon = start_daemon(roots=[fs.mount], writers=1, env={"CKPTD_SAVE_DEADLINE": "2"})
        path = os.path.join(fs.mount, ".metadata")
        connection = connect(daemon.socket, auto_start=False)
        try:
            if before is not None:
                connection.call(MessageType.COMMIT_FILE, CommitFile(path=path), frames=[before],
                                timeout=waits.commit_file(connection.deadlines, tiered=False))
            [writer] = daemon.status()["writers"]
            fs.set(stall=True, ops=["rename"], match=f"/..metadata.{writer['pid']}.")
            with pytest.raises(DaemonRequestError) as raised:
                connection.call(MessageType.COMMIT_FILE, CommitFile(path=path),
                                frames=[b"the failed commit"], timeout=60)
            assert "CKPTD_SAVE_DEADLINE" in str(raised.value)
            assert fs.state()["blocked"] > 0, "the commit failed before its rename was held"
            fs.clear()  # the held rename lands now; then the killed writer exits
            wait_for(lambda: settled(daemon), 30, "the given-up writer to exit")
            if before is None:
                assert not os.path.exists(path), "a commit the daemon failed landed afterwards"
            else:
                assert read(path) == before, "the failed commit replaced the previous one"
                verify_file(path)
            assert not [n for n in os.listdir(backing) if n.endswith(".ckptd-tmp")]
            connection.call(MessageType.COMMIT_FILE, CommitFile(path=path), frames=[b"next"],
                            timeout=waits.commit_file(connection.deadlines, tiered=False))
            assert read(path) == b"next"
        finally:
            connection.close()
