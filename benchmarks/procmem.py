"""Process memory as Linux reports it in ``/proc``, for the save benchmarks.

Two measures, because neither alone is honest:

- **Per-process peak** (``VmHWM``), exact, reset before each measured save by writing
  ``5`` to ``/proc/<pid>/clear_refs`` (Linux >= 4.0). It counts shared-memory pages in
  every process that maps them, so the same staging pool shows up in the trainer, the
  daemon and its writers.
- **PSS of a group of processes, shared memory counted once**, sampled by
  :class:`MemWatch` in a separate small process (so the sampling does not run on the
  trainer's interpreter): the sum of each process's proportional anonymous and file
  memory (``Pss_Anon + Pss_File`` from ``smaps_rollup``: libraries mapped by several
  processes are split between them) plus the largest ``RssShmem`` of any of them (shared
  segments counted once: an approximation that holds when the processes map the same
  segments, as ckptd's pool and DCP's shared staging do). Reading ``smaps_rollup`` walks
  page tables, so this sample is taken every 0.25 s, not every 20 ms.

The sampler watches the whole job (the trainer and its descendants) and, separately,
one sub-tree (``track PID``: ckptd's daemon and its writers).

Run as a script, this module is the sampler: ``python procmem.py ROOT_PID...`` reads
commands on stdin (``reset``, ``read``, ``track PID``, ``quit``) and answers JSON lines
on stdout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def machine_cpu() -> dict[str, float]:
    """Machine-wide CPU seconds so far (``/proc/stat``, all cores): in processes (user +
    nice + system), in interrupts (irq + softirq: where the kernel's network stack runs)
    and stolen by the hypervisor."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]] + [0] * 8
    return {"processes": (fields[0] + fields[1] + fields[2]) / CLK_TCK,
            "interrupts": (fields[5] + fields[6]) / CLK_TCK, "steal": fields[7] / CLK_TCK}


def process_cpu() -> dict[int, tuple[str, float, int]]:
    """pid -> (command line, CPU seconds so far, parent pid) for every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        name = command or stat[stat.index("(") + 1:stat.rindex(")")]
        out[int(entry)] = (name[:100], (int(fields[11]) + int(fields[12])) / CLK_TCK,
                           int(fields[1]))
    return out


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_used(before: dict, after: dict, pid: int) -> float:
    """CPU seconds ``pid`` used between two :func:`process_cpu` snapshots."""
    cmd, cpu, _ = after[pid]
    return cpu - before.get(pid, (cmd, 0.0, 0))[1]


def top_cpu_users(before: dict, after: dict, skip, limit: int = 6,
                  least: float = 0.5) -> list[tuple[str, float]]:
    """The processes not ``skip(pid, cmd)`` that used the most CPU between two
    :func:`process_cpu` snapshots (at least ``least`` seconds each)."""
    used = [(cmd, round(cpu_used(before, after, pid), 1))
            for pid, (cmd, _, _) in after.items() if not skip(pid, cmd)]
    return sorted((u for u in used if u[1] >= least), key=lambda x: -x[1])[:limit]


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


def read_pss(pid: int) -> int:
    """``Pss_Anon + Pss_File`` of ``pid`` in bytes (0 if the process is gone)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss_Anon", "Pss_File"):
                    total += int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def unique_resident(pids: list[int]) -> int:
    """PSS of ``pids`` with shared memory counted once (bytes), see the module docstring."""
    shmem = max((read_status(p).get("RssShmem", 0) for p in pids), default=0)
    return sum(read_pss(p) for p in pids) + shmem


def tree(root: int, parents: dict[int, int] | None = None) -> list[int]:
    """``root`` and its live descendants."""
    parents = parent_map() if parents is None else parents
    return ([root] if root in parents else []) + descendants(root, parents)


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

    def __init__(self, roots: list[int], interval: float = 0.25) -> None:
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
        """Peaks of the window since the last reset.

        ``{"peak", "current", "sub_peak", "sub_current", "pids"}``: the whole job and the
        tracked sub-tree (0 until :meth:`track`).
        """
        return self._ask("read")

    def track(self, root: int) -> dict:
        """Also report the sub-tree under ``root`` (e.g. the daemon and its writers)."""
        return self._ask(f"track {root}")

    def close(self) -> None:
        """Stop the sampler."""
        try:
            self._ask("quit")
        except (OSError, ValueError):
            pass
        self.proc.wait(timeout=5)


def _sampler(roots: list[int], interval: float) -> None:
    pids: list[int] = []
    sub_root = 0
    sub: list[int] = []
    rescanned = 0.0
    peak = current = sub_peak = sub_current = 0
    while True:
        now = time.monotonic()
        if now - rescanned > 0.5:
            parents = parent_map()
            pids = [p for root in roots for p in tree(root, parents) if p != os.getpid()]
            sub = tree(sub_root, parents) if sub_root else []
            rescanned = now
        current = unique_resident(pids)
        sub_current = unique_resident(sub) if sub else 0
        peak, sub_peak = max(peak, current), max(sub_peak, sub_current)
        ready, _, _ = select.select([sys.stdin], [], [], interval)
        if not ready:
            continue
        command = sys.stdin.readline().strip()
        answer = {"peak": peak, "current": current, "sub_peak": sub_peak,
                  "sub_current": sub_current, "pids": pids}
        if command in ("quit", ""):
            print(json.dumps(answer), flush=True)
            return
        if command.startswith("track "):
            sub_root, rescanned = int(command.split()[1]), 0.0
        if command in ("reset",) or command.startswith("track "):
            peak, sub_peak = current, sub_current
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--interval=")]
    every = next((float(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--interval=")),
                 0.25)
    _sampler([int(a) for a in args], every)
