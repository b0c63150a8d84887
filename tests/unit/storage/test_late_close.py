"""Removing a file's name at once and freeing its data on a background thread
(ckptd.storage.late_close): the directory is clean when the call returns, the data goes
with the background close, names that are not regular files are removed without being
followed or opened, and on a FUSE mount (which would hide an open unlinked file under a
``.fuse_hidden`` name) the name goes the plain way."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ckptd.storage.late_close import unlink_freeing_later, wait_for_closes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import mounts  # noqa: E402
from faultfs import FaultFS, fuse_unavailable  # noqa: E402

mounted = mounts.mounted  # the fixture, under its name here
needs_fuse = pytest.mark.skipif(bool(fuse_unavailable()), reason=str(fuse_unavailable()))


def open_deleted(path: str) -> list:
    """This process's descriptors on the (deleted) file once at ``path``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == f"{path} (deleted)":
            found.append(fd)
    return found


def write(path, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))


def test_the_name_goes_at_once_and_the_file_is_closed_by_the_closer(tmp_path):
    path = str(tmp_path / "old.pt")
    write(path, 1 << 20)
    before = wait_for_closes()
    assert unlink_freeing_later(path)
    assert not os.path.lexists(path)
    assert wait_for_closes() == before + 1  # its last descriptor went through the closer
    assert open_deleted(path) == []


def test_the_space_comes_back_once_the_closes_are_done(mounted):
    mount = mounted("tmpfs", "size=16m")
    for round_ in range(3):  # an overwrite loop on a filesystem that fits one file
        write(os.path.join(mount, "ckpt.pt"), 12 << 20)
        assert unlink_freeing_later(os.path.join(mount, "ckpt.pt")), round_
        wait_for_closes()
        stats = os.statvfs(mount)
        assert stats.f_bfree * stats.f_frsize >= 15 << 20, round_


def test_a_missing_name_is_no_error(tmp_path):
    assert not unlink_freeing_later(str(tmp_path / "never"))


def test_a_link_is_removed_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    link = tmp_path / "planted"
    link.symlink_to(target)
    before = wait_for_closes()
    assert unlink_freeing_later(str(link))
    assert not os.path.lexists(link) and target.read_bytes() == b"keep me"
    assert wait_for_closes() == before


def test_a_planted_fifo_is_removed_without_blocking(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    worker = threading.Thread(target=unlink_freeing_later, args=(fifo,), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "opening the FIFO blocked"
    assert not os.path.lexists(fifo)


@needs_fuse
def test_on_a_fuse_mount_the_name_goes_the_plain_way(tmp_path):
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:
        path = os.path.join(fs.mount, "old.pt")
        write(path, 1 << 16)
        before = wait_for_closes()
        assert unlink_freeing_later(path)
        assert wait_for_closes() == before  # nothing held open there
        assert os.listdir(fs.mount) == []  # no .fuse_hidden name left behind


def test_a_forked_child_frees_its_own(tmp_path):
    warm = str(tmp_path / "warm")
    write(warm, 4096)
    unlink_freeing_later(warm)  # the parent has its closer thread running
    path = str(tmp_path / "child.pt")
    write(path, 4096)
    pid = os.fork()
    if pid == 0:  # the child: its own thread closes what it hands over
        try:
            ok = unlink_freeing_later(path)
            closed = wait_for_closes()
            os._exit(0 if ok and closed == 1 and not open_deleted(path) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not os.path.lexists(path)
