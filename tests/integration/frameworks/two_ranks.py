"""Two training ranks that live and die as one: a process group the test can SIGKILL.

Trainer side: a script started by the test calls :func:`lead_process_group` first (it
becomes the leader of a new process group; the ranks it or its framework launches join
that group), and, when it launches the second rank itself, :func:`start_second_rank` /
:func:`join_second_rank`. A rank whose launcher dies is killed by the kernel
(``PR_SET_PDEATHSIG``), so a failed test never leaves a rank hanging in a collective.

The test side is :mod:`two_rank_run`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

WORLD_SIZE = 2
_PR_SET_PDEATHSIG = 1


def lead_process_group() -> None:
    """In the process the test started: lead a new process group (its ranks join it).

    In a rank launched by another (``LOCAL_RANK`` set): die when the launcher dies.
    """
    if "LOCAL_RANK" in os.environ and os.environ["LOCAL_RANK"] != "0":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before the line above
            os._exit(1)
    elif os.getpgid(0) != os.getpid():
        os.setsid()


def start_second_rank() -> tuple[int, subprocess.Popen | None]:
    """torchrun's environment for two ranks on this machine: in the first process, set
    it up and start this same script as rank 1; returns ``(rank, rank 1's process or None)``."""
    lead_process_group()
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), None
    with socket.socket() as s:  # a free loopback port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), RANK="0", LOCAL_RANK="0")
    child = subprocess.Popen([sys.executable, *sys.argv],
                             env={**os.environ, "RANK": "1", "LOCAL_RANK": "1"})
    return 0, child


def join_second_rank(child: subprocess.Popen | None) -> None:
    """In rank 0, at the end: wait for rank 1 and fail as it failed."""
    if child is not None and child.wait(240) != 0:
        raise SystemExit(f"rank 1 exited {child.returncode}")
