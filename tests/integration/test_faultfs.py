"""The FUSE fault bed itself (tests/faultfs.py): a healthy passthrough, a stall that holds
a real ``write()`` until lifted, errors on command, and a stop that names what still
holds the mount instead of waiting on it in silence.

Other fault tests build on these guarantees, so they are checked on their own here.
"""

import errno
import os
import re
import subprocess
import sys
import threading

import pytest

from conftest import wait_for
from faultfs import FaultFS, fuse_unavailable

pytestmark = pytest.mark.skipif(bool(fuse_unavailable()), reason=fuse_unavailable() or "-")


@pytest.fixture
def faultfs(tmp_path):
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:
        yield fs


def test_passthrough_keeps_bytes_and_directory_fsync(faultfs, tmp_path):
    os.makedirs(os.path.join(faultfs.mount, "d"))
    path = os.path.join(faultfs.mount, "d", "f")
    with open(path, "wb") as f:
        f.write(b"x" * 300_000)
        os.fsync(f.fileno())
    fd = os.open(os.path.join(faultfs.mount, "d"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(path, path + ".final")
    with open(tmp_path / "backing" / "d" / "f.final", "rb") as f:
        assert f.read() == b"x" * 300_000


def test_stall_holds_a_write_until_lifted(faultfs):
    path = os.path.join(faultfs.mount, "held.bin")
    finished = threading.Event()

    def write() -> None:
        with open(path, "wb") as f:
            f.write(b"y" * 4096)
            f.flush()
            os.fsync(f.fileno())
        finished.set()

    faultfs.set(stall=True, ops=["fsync"], match="held")
    writer = threading.Thread(target=write)
    writer.start()
    wait_for(lambda: faultfs.state()["blocked"] == 1, 30, "the fsync to be held by the stall")
    assert not finished.is_set() and faultfs.state()["blocked_paths"] == ["/held.bin"]
    os.listdir(faultfs.mount)  # other operations go on while one is held
    faultfs.set(stall=False)
    assert finished.wait(30), "the held fsync did not return after the stall was lifted"
    writer.join()
    assert faultfs.state()["blocked"] == 0


def test_errors_on_command_and_only_where_matched(faultfs):
    faultfs.set(error="ENOSPC", ops=["write"], match="full")
    with pytest.raises(OSError) as raised:
        with open(os.path.join(faultfs.mount, "full.bin"), "wb") as f:
            f.write(b"z" * 4096)
            f.flush()
    assert raised.value.errno == errno.ENOSPC
    with open(os.path.join(faultfs.mount, "fine.bin"), "wb") as f:  # not matched: written
        f.write(b"z" * 4096)
    faultfs.clear()
    with open(os.path.join(faultfs.mount, "full.bin"), "wb") as f:
        f.write(b"z" * 4096)
    with pytest.raises(ValueError, match="not an errno name"):
        faultfs.set(error="ENOTANERRNO")


def test_stopping_a_mount_a_process_still_holds_names_it_and_leaves_nothing_mounted(tmp_path):
    """A process the test left with a file open on the mount (and its working directory
    in it): stopping says which process holds what (before, it waited 10 s for the server,
    which cannot exit while the mount is held, then killed it without a word). The mount
    is gone afterwards, and the holder's next operation on it fails instead of hanging."""
    fs = FaultFS(tmp_path / "backing", tmp_path / "mnt")
    fs.start()
    held = os.path.join(fs.mount, "held")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nf = open('held', 'wb')\nprint('open', flush=True)"
                               "\nsys.stdin.read()\nf.write(b'x')\nf.flush()"],
        cwd=fs.mount, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"open\n"
        with pytest.raises(RuntimeError) as caught:
            fs.stop()
        message = str(caught.value)
        assert f"{fs.mount} was still in use" in message, message
        assert f"pid {holder.pid} (" in message, message
        assert re.search(rf"fd \d+ -> {re.escape(held)}", message), message
        assert f"cwd -> {fs.mount}" in message, message
        assert not os.path.ismount(fs.mount)
        assert fs.process.poll() is not None, "the server must be stopped"
        _, errors = holder.communicate(b"", timeout=60)  # writes to the mount, gone now
        assert holder.returncode != 0 and b"Transport endpoint is not connected" in errors, \
            errors
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
