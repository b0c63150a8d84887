"""Writers yield to trainers: niceness, CPU policy and I/O class, applied for real."""

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from ckptd.storage import priority

_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283}


def test_io_classes_parse_and_bad_ones_are_refused_by_knob_name():
    assert priority.parse_io_class("best-effort:7") == (2, 7)
    assert priority.parse_io_class("idle") == (3, 0)
    assert priority.parse_io_class("none") is None
    with pytest.raises(ValueError, match="CKPTD_WRITER_IO_CLASS='best-effort:9'.*outside 0-7"):
        priority.check("batch", "best-effort:9")
    with pytest.raises(ValueError, match="CKPTD_WRITER_IO_CLASS='fast'"):
        priority.check("batch", "fast")
    with pytest.raises(ValueError, match=r"CKPTD_WRITER_SCHED='eager' is not one of \['batch'"):
        priority.check("eager", "none")


@pytest.mark.skipif(platform.machine() not in _IOPRIO_GET, reason="no ioprio_get number known "
                    f"for {platform.machine()}")
@pytest.mark.parametrize("policy,io_class,expected", [
    ("batch", "best-effort:7", ("SCHED_BATCH", (2 << 13) | 7)),
    ("idle", "idle", ("SCHED_IDLE", 3 << 13)),
])
def test_a_process_takes_the_policy_and_io_class_it_is_given(policy, io_class, expected):
    # A separate process, so this test's own priority is untouched.
    code = ("import os; from ckptd.storage.priority import yield_to_trainers; "
            f"yield_to_trainers(3, {policy!r}, {io_class!r}); print(os.getpid(), flush=True); "
            "import sys; sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        libc = ctypes.CDLL(None, use_errno=True)
        ioprio = libc.syscall(_IOPRIO_GET[platform.machine()], 1, pid)
        assert (os.sched_getscheduler(pid), ioprio) == (getattr(os, expected[0]), expected[1])
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 3
    finally:
        child.communicate("", timeout=30)
