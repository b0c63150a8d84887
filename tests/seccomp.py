"""Real fault injection for the GPU path: a process the kernel denies a system call.

A seccomp filter installed in a child between ``fork`` and ``exec`` (``preexec_fn``) makes
the kernel answer the chosen system calls with an errno, as a hardened container's policy
does. The daemon started this way is refused ``pidfd_getfd``, which is how torch opens a
trainer's expandable segments.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

#: ``pidfd_getfd`` has the same number on every architecture (the unified table).
PIDFD_GETFD = 438

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x00000000
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # in struct seccomp_data


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _program(syscall: int, error: int) -> bytes:
    arch = _AUDIT_ARCH.get(platform.machine())
    if arch is None:
        raise RuntimeError(f"no seccomp audit arch known for {platform.machine()}")
    return b"".join([
        _insn(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        _insn(_JEQ_K, 1, 0, arch),           # another ABI: refuse to run at all
        _insn(_RET_K, 0, 0, _RET_KILL),
        _insn(_LD_W_ABS, 0, 0, _NR_OFFSET),
        _insn(_JEQ_K, 0, 1, syscall),
        _insn(_RET_K, 0, 0, _RET_ERRNO | error),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
    ])


def deny(syscall: int = PIDFD_GETFD, error: int = errno.EPERM):
    """A ``preexec_fn`` that makes ``syscall`` fail with ``error`` in the child (and in
    everything it starts)."""
    # Everything is built before the fork: the child of a threaded parent only calls prctl.
    program = _program(syscall, error)
    libc = ctypes.CDLL(None, use_errno=True)
    filters = ctypes.create_string_buffer(program, len(program))
    fprog = ctypes.create_string_buffer(
        struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(filters)))
    prctl = libc.prctl

    def install() -> None:
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or prctl(
                _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "installing the seccomp filter failed")

    install.keep = (filters, fprog)  # alive as long as the hook
    return install
