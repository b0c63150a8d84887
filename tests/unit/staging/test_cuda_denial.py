"""A kernel that denies the daemon a trainer's CUDA memory: told apart from other failures.

Expandable segments are opened with ``pidfd_getfd``; when the kernel refuses it (Yama,
seccomp, an old kernel) the save is not lost: the daemon answers ``ipc_denied`` and the
trainer stages through shared memory (the end-to-end check runs in ``tests/gpu``, under a
real seccomp denial, whose injector is checked here).
"""

from __future__ import annotations

import errno
import subprocess
import sys

from ckptd.protocol import ErrorCode
from ckptd.staging.cuda import denied_by_the_kernel, staging_failure

import seccomp

# torch's own texts (c10/cuda/CUDACachingAllocator.cpp) when the import is refused.
DENIED = RuntimeError("pidfd_getfd: Operation not permitted\nException raised from fromShared")
NO_SYSCALL = RuntimeError("The kernel on this machine does not support the pidfd_getfd "
                          "syscall needed to use IPC for CUDA tensors when "
                          "expandable_segments:True is set.")


def test_a_denied_import_is_ipc_denied_with_cause_and_remedy():
    for exc in (DENIED, NO_SYSCALL):
        message, code = staging_failure(exc, pid=4242)
        assert code == ErrorCode.IPC_DENIED and denied_by_the_kernel(exc)
        assert "trainer pid 4242" in message and "pidfd_getfd" in message
        assert "shared memory" in message and "ptrace_scope" in message
        assert "Exception raised from" not in message, "one line, not torch's backtrace"


def test_other_copy_failures_keep_the_generic_failure():
    message, code = staging_failure(RuntimeError("CUDA error: an illegal memory access"), 1)
    assert code is None and "illegal memory access" in message
    assert not denied_by_the_kernel(ValueError("IPC tensor of 8 bytes does not match"))
    assert not denied_by_the_kernel(RuntimeError("pidfd_open:No such process")), \
        "the trainer exited: nobody is there to retry through shared memory"


PROBE = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
         "pidfd = libc.syscall(434, os.getpid(), 0); "
         "print(libc.syscall(%d, pidfd, 0, 0), ctypes.get_errno())" % seccomp.PIDFD_GETFD)


def test_the_injected_seccomp_filter_really_denies_pidfd_getfd():
    free = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=True).stdout.split()
    assert int(free[0]) >= 0, f"pidfd_getfd on ourselves should work unfiltered: {free}"
    denied = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            check=True, preexec_fn=seccomp.deny()).stdout.split()
    assert [int(v) for v in denied] == [-1, errno.EPERM]
