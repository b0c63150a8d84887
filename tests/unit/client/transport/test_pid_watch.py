"""connect()'s liveness check: a kept pidfd, answering as ``process_alive`` does.

Real processes only: a running child, the same child exited but not reaped (a zombie,
gone for both checks), reaped, and a pid that never ran; with pidfds refused it asks
``/proc`` as before; a forked child keeps none of its parent's pidfds.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from ckptd import protocol
from ckpt_client.transport import pid_watch
from conftest import wait_for


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        pid_watch.forget(process.pid)


def test_a_running_then_exited_then_reaped_process_reads_as_process_alive_says(child):
    assert pid_watch.alive(child.pid) and protocol.process_alive(child.pid)
    assert child.pid in pid_watch._pidfds, "the pidfd is kept for the next check"
    assert pid_watch.alive(child.pid)
    child.stdin.close()
    wait_for(lambda: _state(child.pid) == "Z", 60, "the child to exit (a zombie until reaped)")
    assert not pid_watch.alive(child.pid) and not protocol.process_alive(child.pid)
    assert child.pid not in pid_watch._pidfds, "a gone process's pidfd is closed"
    child.wait()
    assert not pid_watch.alive(child.pid)
    assert child.pid not in pid_watch._pidfds


def test_a_process_that_exited_before_its_first_check_is_gone(child):
    child.kill()
    child.wait()
    assert not pid_watch.alive(child.pid)
    assert child.pid not in pid_watch._pidfds


@pytest.mark.parametrize("refusal", [OSError(errno.ENOSYS, "no pidfd_open"),
                                     PermissionError(errno.EPERM, "seccomp")],
                         ids=["old_kernel", "seccomp"])
def test_without_pidfds_it_reads_proc_as_before(child, monkeypatch, refusal):
    def refused(pid, flags=0):
        raise refusal

    monkeypatch.setattr(os, "pidfd_open", refused)
    asked = []
    monkeypatch.setattr(pid_watch, "process_alive",
                        lambda pid: asked.append(pid) or protocol.process_alive(pid))
    assert pid_watch.alive(child.pid) and asked == [child.pid]
    child.kill()
    child.wait()
    assert not pid_watch.alive(child.pid) and asked == [child.pid, child.pid]
    assert child.pid not in pid_watch._pidfds


def test_a_forked_child_keeps_none_of_its_parents_pidfds(child):
    assert pid_watch.alive(child.pid)
    fd = pid_watch._pidfds[child.pid]
    forked = os.fork()
    if forked == 0:  # the child: report through the exit status only
        os._exit(0 if not pid_watch._pidfds and not _is_open(fd) else 1)
    _, status = os.waitpid(forked, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pid_watch._pidfds[child.pid] == fd and _is_open(fd)


@pytest.fixture
def own_pidfd():
    """A pidfd kept for this very process (alive throughout), checked before any other
    this test keeps; dropped from the table afterwards without closing its number, which
    the test closed or gave to another file."""
    pid_watch.forget(os.getpid())
    assert pid_watch.alive(os.getpid())
    try:
        yield pid_watch._pidfds[os.getpid()]
    finally:
        pid_watch._pidfds.pop(os.getpid(), None)


def _forks_to_find(check) -> int:
    """Fork; ``check()`` in the child gives its exit code (whatever it raises reads 99)."""
    forked = os.fork()
    if forked == 0:  # the child: report through the exit status only
        try:
            code = check()
        except BaseException:
            code = 99
        os._exit(code)
    _, status = os.waitpid(forked, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_closes_every_pidfd_when_one_was_closed_behind_its_back(
        own_pidfd, child):
    """The first pidfd kept was closed behind the module's back in the parent: closing it
    fails in the child, and every later one must still be closed there."""
    assert pid_watch.alive(child.pid)
    later = pid_watch._pidfds[child.pid]
    os.close(own_pidfd)
    assert _forks_to_find(lambda: 0 if not pid_watch._pidfds and not _is_open(later)
                          else 1) == 0
    assert _is_open(later)


def test_a_forked_child_leaves_the_file_that_took_a_closed_pidfds_number(own_pidfd):
    """The pidfd's number was closed behind the module's back and given to another file
    (a pipe): the child must not close that file, only forget the entry."""
    read_end, write_end = os.pipe()
    try:
        os.dup2(read_end, own_pidfd)
        code = _forks_to_find(lambda: 0 if not pid_watch._pidfds and _is_open(own_pidfd)
                              else 1)
        assert code == 0
    finally:
        os.close(read_end)
        os.close(write_end)
        os.close(own_pidfd)  # the pipe's copy now (the fixture forgets the entry)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_pidfd_closed_behind_its_back_is_dropped_and_proc_answers(child):
    """Some code closed the kept descriptor (a close-all-descriptors helper): the poll says
    so, the entry is dropped without closing the number again (another file may get it),
    and /proc answers; the next check opens a new pidfd."""
    assert pid_watch.alive(child.pid)
    os.close(pid_watch._pidfds[child.pid])
    assert pid_watch.alive(child.pid)
    assert child.pid not in pid_watch._pidfds
    assert pid_watch.alive(child.pid) and child.pid in pid_watch._pidfds


def test_closing_a_connection_closes_its_daemons_pidfd(daemon):
    from ckpt_client.transport.connection import connect

    connection = connect(daemon.socket)
    assert connect(daemon.socket) is connection  # the second call checks the daemon
    assert daemon.pid in pid_watch._pidfds
    connection.close()
    assert daemon.pid not in pid_watch._pidfds
