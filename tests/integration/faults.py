"""Real fault injection helpers: pausing writer processes, small filesystems."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import contextmanager


def writer_pids(daemon) -> list[int]:
    return [w["pid"] for w in daemon.status()["writers"]]


@contextmanager
def writers_paused(daemon):
    """SIGSTOP the daemon's writer processes: saves stay in the writing phase."""
    pids = writer_pids(daemon)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@contextmanager
def small_tmpfs(path, size: str):
    """Mount a tmpfs of ``size`` at ``path`` (root only): a real ENOSPC source."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
