"""A daemon killed in its start-up and restarted while it is still dying: nothing may leak.

In SIGKILL campaigns with the daemon restarted right after each kill (as a SLURM node
would), a killed daemon's ``/dev/shm`` pool was once never swept: killed in its start-up
(pool made, socket not bound yet, so the successor may start at once), it had not
finished exiting when the successor swept (a SIGKILLed process lives on until its threads
leave the kernel, and unmapping a large pool takes a while); the successor saw it alive,
left its pool alone and never looked again.

That window is made wide and certain by real means: the first daemon runs under strace,
which holds it at the entry of its first thread creation (its pool is made by then, its
socket not bound, and it is still single-threaded: a SIGKILLed tracee stays until its
tracer lets it run, but only while no untraced thread of it is left to end the process).
Holding it at "the next system call" after seeing its pool was not enough: on a loaded
machine strace attached after zmq had started its threads, and the killed daemon was
gone before the successor swept.
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
from test_crash_cleanup import needs_strace

from ckptd.protocol import process_alive, socket_is_live

#: The successor looks again every 0.2 s while something of a predecessor is still owned.
ENV = {"CKPTD_LEFTOVER_SWEEP_INTERVAL": "0.2"}


#: x86_64 and aarch64 numbers of clone and clone3 (a new thread is one or the other).
THREAD_SYSCALLS = {56, 435} if os.uname().machine == "x86_64" else {220, 435}


def held_at_first_thread(command: list[str], env: dict) -> subprocess.Popen:
    """strace running ``command``, holding it for two minutes at its first clone/clone3
    (``-I1``: a strace that runs its tracee blocks SIGTERM unless told otherwise)."""
    return subprocess.Popen(
        ["strace", "-qq", "-I1", "-o", "/dev/null", "-e", "trace=clone,clone3",
         "-e", "inject=clone,clone3:delay_enter=120000000", *command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True)  # its own group: the test's end kills whatever is left of it


def let_go(tracer: subprocess.Popen) -> None:
    """End strace: it detaches, and its tracee goes on (or ends, if it was killed)."""
    if tracer.poll() is None:
        tracer.terminate()
    tracer.wait(30)


def python_child_of(pid: int) -> int | None:
    """The child of ``pid`` that runs Python (strace also forks short-lived children of
    its own at start, to probe the kernel's ptrace features)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for child in children:
        try:
            if os.readlink(f"/proc/{child}/exe") == os.path.realpath(sys.executable):
                return child
        except FileNotFoundError:  # one of strace's probes, gone already
            continue
    return None


def syscall_of(pid: int) -> int | None:
    with open(f"/proc/{pid}/syscall") as f:
        first = f.read().split()[0]
    return int(first) if first.lstrip("-").isdigit() else None


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
    tracer = first = None
    started = []
    try:
        tracer = held_at_first_thread(
            [sys.executable, "-m", "ckptd", "serve", "--socket", socket_path,
             "--root", str(root), "--pool-size", "64M", "--writers", "2"],
            {**{k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}, **ENV})
        first = wait_for(lambda: python_child_of(tracer.pid), 30, "strace to start the daemon")
        # Held where it makes its first thread: stopped in clone/clone3 (a stop at any
        # other call is strace passing it on), its pool made, still one thread.
        wait_for(lambda: state_of(first) == "t" and syscall_of(first) in THREAD_SYSCALLS,
                 60, "the daemon to be held at its first thread creation")
        assert pools_of(first), "its pool is made before its first thread"
        assert os.listdir(f"/proc/{first}/task") == [str(first)], "held single-threaded"
        assert not socket_is_live(socket_path), "it must be held before it serves"
        os.kill(first, signal.SIGKILL)
        assert process_alive(first), "strace must keep the killed daemon from exiting"
        successor = start_daemon_process(tmp_path, name="same", env=ENV)
        started.append(successor)
        assert pools_of(first), "the pool of a live process must be left alone"
        let_go(tracer)
        wait_for(lambda: not process_alive(first), 30, "the killed daemon to end once let go")
        wait_for(lambda: not pools_of(first), 30,
                 "the successor to remove the pool once its owner is gone")
        run_dir = os.path.dirname(successor.socket)
        wait_for(lambda: journals(run_dir) == [f"ckptd.{successor.pid}.dirs"], 30,
                 "the dead daemon's journal consumed")
        assert successor.status()["pid"] == successor.pid
    finally:
        if tracer is not None:
            # strace and the daemon it runs share a process group; a test that failed
            # before finding the daemon (or before letting it go) must not leave either.
            try:
                os.killpg(tracer.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            tracer.wait(30)
        for daemon in started:
            daemon.stop(signal.SIGKILL, 30)
            _remove_pool_of(daemon)
        if first is not None:
            wait_for(lambda: not process_alive(first), 30, "the first daemon to end")
            for name in pools_of(first):
                os.unlink(os.path.join("/dev/shm", name))
