"""Whether the process at the other end is alive."""

import os
import subprocess
import sys

from ckptd import protocol
from conftest import wait_for


def test_process_alive_sees_this_process_and_not_a_reaped_one():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert protocol.process_alive(os.getpid()) and not protocol.process_alive(child.pid)


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_an_exited_process_nobody_reaped_yet_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: state_of(child.pid) == "Z", 60, "the child to exit (a zombie until reaped)")
        assert not protocol.process_alive(child.pid)
    finally:
        child.wait()
