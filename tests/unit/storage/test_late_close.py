"""Removing a file's name at once and freeing its data on a background thread
(ckptd.storage.late_close): the directory is clean when the call returns, nothing of the
file stays open once the closes are done, and names that are not regular files are
removed without being followed or opened."""

from __future__ import annotations

import os
import threading

from ckptd.storage.late_close import unlink_freeing_later, wait_for_closes


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


def test_the_name_goes_at_once_and_the_file_is_closed_later(tmp_path):
    path = str(tmp_path / "old.pt")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
    assert unlink_freeing_later(path)
    assert not os.path.lexists(path)
    wait_for_closes()
    assert open_deleted(path) == []


def test_a_missing_name_is_no_error(tmp_path):
    assert not unlink_freeing_later(str(tmp_path / "never"))


def test_a_link_is_removed_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    link = tmp_path / "planted"
    link.symlink_to(target)
    assert unlink_freeing_later(str(link))
    assert not os.path.lexists(link) and target.read_bytes() == b"keep me"


def test_a_planted_fifo_is_removed_without_blocking(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    worker = threading.Thread(target=unlink_freeing_later, args=(fifo,), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "opening the FIFO blocked"
    assert not os.path.lexists(fifo)


def test_a_forked_child_frees_its_own(tmp_path):
    unlink_freeing_later(str(tmp_path / "warm"))  # the parent may already have the thread
    path = str(tmp_path / "child.pt")
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    pid = os.fork()
    if pid == 0:  # the child: its own thread closes what it hands over
        try:
            ok = unlink_freeing_later(path)
            wait_for_closes()
            os._exit(0 if ok and not open_deleted(path) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not os.path.lexists(path)
