"""The daemon's and its writers' CPU per save, thread by thread, to the nanosecond.

A real ``python -m ckptd serve`` (2 writers, pool in ``/dev/shm``) takes ``--saves``
saves of the realistic ``training`` state dict through ``TorchAsyncCheckpoint`` and
cached ``dcp.async_save`` (each after two warm-up saves); for every save, the on-CPU time
of each thread of the daemon and its writers (``/proc/<pid>/task/<tid>/schedstat``:
nanoseconds, where ``/proc/<pid>/stat`` counts 10 ms ticks, too coarse for one save's
few tens of milliseconds a process) is split four ways: the daemon's main thread (the
serve loop: every message, every request's bookkeeping), its other threads (ZeroMQ's
I/O thread), the writers' main threads (serializing, bounce copies, allocation, the
commit) and the writers' I/O threads (CRC32C and the direct writes).

Before/after comparisons run it once per tree (``PYTHONPATH`` names the code measured),
taking turns, under the machine-wide lock::

    PYTHONPATH=$PWD python benchmarks/bench_daemon_cpu.py --saves 8

With ``--py-spy PREFIX`` every process is sampled (``py-spy record --format raw``) over the
timed saves, one file per method and process. Measures only; no bound (the CPU a save
costs has none): compare trees in one run, as medians with their spread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import methods as m  # noqa: E402
import workload  # noqa: E402
from bench_save import Daemon, init_single_process_group  # noqa: E402
from procmem import descendants  # noqa: E402

GROUPS = ("daemon main thread", "daemon other threads", "writers' main threads",
          "writers' I/O threads")


def thread_seconds(daemon_pid: int) -> dict:
    """``(pid, tid) -> on-CPU seconds`` of every thread of the daemon and its writers."""
    seconds = {}
    for pid in [daemon_pid, *descendants(daemon_pid)]:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    seconds[(pid, int(tid))] = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                pass
    return seconds


def group_of(pid: int, tid: int, daemon_pid: int) -> str:
    """Which of :data:`GROUPS` a thread is in."""
    if pid == daemon_pid:
        return GROUPS[0] if tid == pid else GROUPS[1]
    return GROUPS[2] if tid == pid else GROUPS[3]


def measure(method: m.Method, daemon: Daemon, outdir: str, saves: int, nbytes: int,
            spy_prefix: str) -> tuple[list[float], dict]:
    """CPU-s per GB of each timed save, and each group's seconds per save."""
    path = os.path.join(outdir, "ckpt")
    method.prepare()
    for _ in range(2):  # warm-up: connection, templates, writer threads
        method.start(path)
        method.wait_durable()
        m.remove_tree(path)
    spies = []
    if spy_prefix:
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        for pid in [daemon.pid, *descendants(daemon.pid)]:
            spies.append(subprocess.Popen(
                [spy, "record", "-p", str(pid), "-r", "250", "-f", "raw", "--nonblocking",
                 "-o", f"{spy_prefix}.{method.name.split()[1]}.{pid}.txt"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # attached before the first timed save
    per_gb, groups = [], {g: [] for g in GROUPS}
    for _ in range(saves):
        before = thread_seconds(daemon.pid)
        method.start(path)
        method.wait_durable()
        after = thread_seconds(daemon.pid)
        spent = dict.fromkeys(GROUPS, 0.0)
        for (pid, tid), seconds in after.items():
            spent[group_of(pid, tid, daemon.pid)] += seconds - before.get((pid, tid), 0.0)
        per_gb.append(sum(spent.values()) / (nbytes / 1e9))
        for group, seconds in spent.items():
            groups[group].append(seconds)
        m.remove_tree(path)
    for spy in spies:
        spy.send_signal(signal.SIGINT)
        spy.wait()
    method.close()
    return per_gb, groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--py-spy", default="", metavar="PREFIX",
                        help="also sample every process with py-spy into PREFIX.*.txt")
    args = parser.parse_args(argv)
    state, _ = workload.build("training", int(args.size_gib * (1 << 30)))
    tensors = workload.tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    outdir = tempfile.mkdtemp(prefix="ckpt-daemoncpu-", dir=args.workdir)
    init_single_process_group(tempfile.mkdtemp(prefix="ckpt-daemoncpu-pg-"))
    daemon = Daemon(outdir, int(nbytes * 1.05) + (64 << 20), 2)
    med = statistics.median
    print(f"code: {os.environ.get('PYTHONPATH', '?')}; {nbytes / (1 << 30):.3f} GiB in "
          f"{len(tensors)} tensors, {args.saves} saves a method\n")
    print("| method | CPU-s per GB durable, median (min–max) | "
          + " | ".join(f"{g}, ms a save (min–max)" for g in GROUPS) + " |")
    print("|---" * (2 + len(GROUPS)) + "|")
    try:
        for method in (m.CkptdTorch(state), m.CkptdDcp(state, enable_cache=True)):
            per_gb, groups = measure(method, daemon, outdir, args.saves, nbytes, args.py_spy)
            cells = [f"{1000 * med(v):.1f} ({1000 * min(v):.1f}–{1000 * max(v):.1f})"
                     for v in groups.values()]
            print(f"| {method.name} | {med(per_gb):.3f} ({min(per_gb):.3f}–{max(per_gb):.3f}) | "
                  + " | ".join(cells) + " |", flush=True)
    finally:
        daemon.stop()
        m.remove_tree(outdir)
    print(f"\nload average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
