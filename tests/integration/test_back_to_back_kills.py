"""A daemon killed in its start-up and restarted while it is still dying: nothing may leak.

In SIGKILL campaigns with the daemon restarted right after each kill (as a SLURM node
would), a killed daemon's ``/dev/shm`` pool was once never swept: killed in its start-up
(pool made, socket not bound yet, so the successor may start at once), it had not
finished exiting when the successor swept (a SIGKILLed process lives on until its threads
leave the kernel, and unmapping a large pool takes a while); the successor saw it alive,
left its pool alone and never looked again.

That window is made wide and certain by real means: strace holds the dying daemon's main
thread at a system call's entry (a SIGKILLed tracee stays until its tracer lets it run).
The successor starts meanwhile, must leave the pool of a live process alone, and must
remove it once that process is gone, without another restart.

test_crash_cleanup.py's back-to-back test cannot catch this: every predecessor there is
reaped before the successor starts (its held writer dies with its daemon at once, a
multi-threaded tracee does not stay held), so it passes with a successor that sweeps only
at start. This one fails with such a successor: on its journal always, and on the pool
unless another daemon of this user happens to start meanwhile (every daemon removes the
pools of dead daemons, whatever their socket).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from conftest import _remove_pool_of, start_daemon_process, wait_for
from test_crash_cleanup import HeldFsync, attach_strace, needs_strace

from ckptd.protocol import process_alive, socket_is_live

#: The successor looks again every 0.2 s while something of a predecessor is still owned.
ENV = {"CKPTD_LEFTOVER_SWEEP_INTERVAL": "0.2"}


class HeldAtNextSyscall(HeldFsync):
    """strace holding a thread at its next system call (a kill then waits for release)."""

    def __init__(self, pids, seconds: int = 120) -> None:
        self.process = attach_strace(pids, "-e", "trace=all", "-e",
                                     f"inject=all:delay_enter={seconds * 1_000_000}",
                                     "-o", "/dev/null")


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def pools_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptd-{os.getuid()}-{pid}-")]


def journals(run_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(run_dir) if n.endswith(".dirs"))


@needs_strace
def test_a_daemon_killed_in_start_up_and_still_dying_at_the_restart_is_swept(tmp_path):
    socket_path = str(tmp_path / "run-same" / "ckptd.sock")
    root = tmp_path / "ckpt"
    root.mkdir()
    held = first = None
    started = []
    try:
        first = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--socket", socket_path,
             "--root", str(root), "--pool-size", "64M", "--writers", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env={**{k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}, **ENV})
        wait_for(lambda: pools_of(first.pid), 60, "the first daemon's pool to be made")
        held = HeldAtNextSyscall([first.pid])
        # Held only at a system call's entry: a kill inside a blocking call would end it.
        wait_for(lambda: state_of(first.pid) == "t", 60, "its main thread to be held")
        assert not socket_is_live(socket_path), "it must be held before it serves"
        os.kill(first.pid, signal.SIGKILL)
        assert process_alive(first.pid), "strace must keep the killed daemon from exiting"
        successor = start_daemon_process(tmp_path, name="same", env=ENV)
        started.append(successor)
        assert pools_of(first.pid), "the pool of a live process must be left alone"
        held.release()
        first.wait(30)
        wait_for(lambda: not pools_of(first.pid), 30,
                 "the successor to remove the pool once its owner is gone")
        run_dir = os.path.dirname(successor.socket)
        wait_for(lambda: journals(run_dir) == [f"ckptd.{successor.pid}.dirs"], 30,
                 "the dead daemon's journal consumed")
        assert successor.status()["pid"] == successor.pid
    finally:
        if held is not None:
            held.release()
        if first is not None:
            if first.poll() is None:
                first.kill()
                first.wait(30)
            for name in pools_of(first.pid):
                os.unlink(os.path.join("/dev/shm", name))
        for daemon in started:
            daemon.stop(signal.SIGKILL, 30)
            _remove_pool_of(daemon)
