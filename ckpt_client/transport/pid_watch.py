"""Whether the daemon process is still alive, asked cheaply enough for every connect().

:func:`ckpt_client.connect` checks that its cached connection's daemon still runs on
every call (a DCP save calls it twice), so that a dead daemon is noticed by the next
call. :func:`ckptd.protocol.process_alive` reads ``/proc/<pid>/stat``: an open, a read
and a close, each letting go of the GIL, which a save's background copy thread then
holds: a few hundred µs a check on a busy node, milliseconds at times. A pidfd (Linux
5.3+) polls readable once its process has exited (a zombie counts as gone, as for
``process_alive``; from the first check on, a reaped process's reused pid cannot fool
it): one system call.

This module owns one pidfd per daemon pid this process checked, opened on the first
check and closed once the process is found gone or its connection is closed. Where none
can be opened (an older kernel, a seccomp policy, no free descriptor) it asks
``process_alive``, as before.
Must not: keep a pidfd in a forked child (closed there), close there a file that took a
pidfd's number after it was closed behind this module's back, or answer for a pid it did
not open a pidfd for while that pid's process ran.
"""

from __future__ import annotations

import os
import select
import threading

from ckptd.protocol import process_alive

#: pid -> that process's pidfd.
_pidfds: dict[int, int] = {}
#: Held from looking a pidfd up to closing it: a descriptor closed by one thread while
#: another polls it could be reopened by a third as anything (a socket), and then be
#: polled, or closed, in its place.
_lock = threading.Lock()


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (``process_alive``'s answer)."""
    with _lock:
        fd = _pidfds.get(pid)
        if fd is None:
            try:
                fd = _pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except (AttributeError, OSError):  # no pidfds here (or none free): /proc, as before
                return process_alive(pid)
        poller = select.poll()  # one per check: a poll object refuses concurrent polls
        poller.register(fd, select.POLLIN)
        events = poller.poll(0)
        if not events:
            return True
        if events[0][1] & select.POLLNVAL:
            # Closed behind our back (a close-all-descriptors helper): the number may be
            # another file's now, so it is dropped, not closed, and /proc answers.
            del _pidfds[pid]
            return process_alive(pid)
        _close(pid)
        return False


def forget(pid: int) -> None:
    """Close the pidfd kept for ``pid``, if any (its connection was closed)."""
    with _lock:
        _close(pid)


def _close(pid: int) -> None:
    fd = _pidfds.pop(pid, None)
    if fd is not None:
        os.close(fd)


def _forget_the_parents_pidfds() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    fds = list(_pidfds.values())
    _pidfds.clear()
    for fd in fds:
        # A number closed behind the parent's back (a close-all-descriptors helper) may be
        # closed already, or be another file's now: only a pidfd still is ours to close,
        # and one failed close must not keep the others open in this child.
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":  # pidfs too
                os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_forget_the_parents_pidfds)
