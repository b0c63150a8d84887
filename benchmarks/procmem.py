"""Process memory as Linux reports it in ``/proc``, for the save benchmarks.

Two measures, because neither alone is honest:

- **Per-process peak** (``VmHWM``), exact, reset before each measured save by writing
  ``5`` to ``/proc/<pid>/clear_refs`` (Linux >= 4.0). It counts shared-memory pages in
  every process that maps them, so the same staging pool shows up in the trainer, the
  daemon and its writers.
- **Unique resident memory** of a group of processes, sampled by :class:`MemWatch` in a
  separate small process (so the sampling does not run on the trainer's interpreter):
  the sum of each process's private anonymous memory (``RssAnon``) plus the largest
  ``RssShmem`` of any of them (shared segments counted once: an approximation that holds
  when the processes map the same segments, as ckptd's pool and DCP's shared staging do).

Run as a script, this module is the sampler: ``python procmem.py ROOT_PID...`` reads
commands on stdin (``reset``, ``read``, ``quit``) and answers JSON lines on stdout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def read_status(pid: int) -> dict[str, int]:
    """Memory fields of ``/proc/<pid>/status`` in bytes (empty if the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def reset_peak(pid: int) -> bool:
    """Reset ``VmHWM`` of ``pid`` to its current RSS; False where the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def parent_map() -> dict[int, int]:
    """pid -> parent pid for every process visible in ``/proc``."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def descendants(root: int, parents: dict[int, int] | None = None) -> list[int]:
    """``root``'s live descendants (children, grandchildren, ...), not ``root`` itself."""
    parents = parent_map() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def peak_of(pids: list[int]) -> int:
    """Sum of ``VmHWM`` over ``pids`` (bytes)."""
    return sum(read_status(p).get("VmHWM", 0) for p in pids)


def unique_resident(pids: list[int]) -> int:
    """Sum of ``RssAnon`` plus the largest ``RssShmem`` over ``pids`` (bytes)."""
    stats = [read_status(p) for p in pids]
    return (sum(s.get("RssAnon", 0) for s in stats)
            + max((s.get("RssShmem", 0) for s in stats), default=0))


class MemWatch:
    """Samples the unique resident memory of process trees from a helper process.

    Parameters
    ----------
    roots : list of int
        Process trees to watch (each root with all its descendants, found again every
        half second so helpers started later are included).
    interval : float
        Seconds between samples.
    """

    def __init__(self, roots: list[int], interval: float = 0.01) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), f"--interval={interval}",
             *map(str, roots)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._ask("read")

    def _ask(self, command: str) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def reset(self) -> dict:
        """Start a new window; returns the current sample."""
        return self._ask("reset")

    def read(self) -> dict:
        """Peak of the window since the last reset: ``{"peak", "current", "pids"}``."""
        return self._ask("read")

    def close(self) -> None:
        """Stop the sampler."""
        try:
            self._ask("quit")
        except (OSError, ValueError):
            pass
        self.proc.wait(timeout=5)


def _sampler(roots: list[int], interval: float) -> None:
    pids: list[int] = []
    rescanned = 0.0
    peak = 0
    current = 0
    while True:
        now = time.monotonic()
        if now - rescanned > 0.5:
            parents = parent_map()
            pids = [r for r in roots if r in parents]
            for root in roots:
                pids += descendants(root, parents)
            pids = [p for p in pids if p != os.getpid()]
            rescanned = now
        current = unique_resident(pids)
        peak = max(peak, current)
        ready, _, _ = select.select([sys.stdin], [], [], interval)
        if not ready:
            continue
        command = sys.stdin.readline().strip()
        if command in ("quit", ""):
            print(json.dumps({"peak": peak, "current": current}), flush=True)
            return
        answer = {"peak": peak, "current": current, "pids": pids}
        if command == "reset":
            peak = current
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--interval=")]
    every = next((float(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--interval=")),
                 0.01)
    _sampler([int(a) for a in args], every)
