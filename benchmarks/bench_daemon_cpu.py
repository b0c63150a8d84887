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

Before/after in one run: ``--before REV`` runs the daemon and its writers of commit REV
(exported by :mod:`before_tree`; the trainer's side stays this tree's), taking turns with
this tree's daemon for ``--rounds`` rounds, each a fresh daemon; ``--polling`` adds this
tree with the trainer asking every 10 ms (``CKPTD_POLL_HOLD=0``: the cadence before
held POLLs, on the same daemon code). The ratios after/before are of the medians over
all rounds, each median shown with its spread; the trainer's wall time from the save's
start to its durable return and the POLLs it sent a save are in the same table::

    PYTHONPATH=$PWD /work/bin/texcl python benchmarks/bench_daemon_cpu.py --size-gib 0.5 \
        --saves 4 --rounds 2 --before REV --polling

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
from before_tree import code_of, exported  # noqa: E402
from bench_save import Daemon, init_single_process_group  # noqa: E402
from procmem import descendants  # noqa: E402

from ckptd.protocol import MessageType  # noqa: E402
from ckpt_client.transport.connection import DaemonConnection, _connections  # noqa: E402

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


class PollCount:
    """The POLLs this process sends (counted at the connection, whatever asks)."""

    sent = 0

    @classmethod
    def install(cls) -> None:
        send = DaemonConnection.send

        def counting(self, msg_type, body=None, frames=()):
            cls.sent += msg_type == MessageType.POLL
            return send(self, msg_type, body, frames)

        DaemonConnection.send = counting


def measure(method: m.Method, daemon: Daemon, outdir: str, saves: int, nbytes: int,
            spy_prefix: str) -> tuple[list[float], dict]:
    """CPU-s per GB of each timed save, each group's seconds per save, and (as groups
    ``wall`` and ``polls``) the trainer's seconds from start to durable and its POLLs."""
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
    per_gb, groups = [], {g: [] for g in (*GROUPS, "wall", "polls")}
    for _ in range(saves):
        before, polls = thread_seconds(daemon.pid), PollCount.sent
        started = time.perf_counter()
        method.start(path)
        method.wait_durable()
        groups["wall"].append(time.perf_counter() - started)
        groups["polls"].append(PollCount.sent - polls)
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
    parser.add_argument("--saves", type=int, default=8, help="timed saves a method and round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--before", default="", metavar="REV",
                        help="also the daemon and writers of commit REV, taking turns")
    parser.add_argument("--polling", action="store_true",
                        help="also this tree with the trainer asking every 10 ms")
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--py-spy", default="", metavar="PREFIX",
                        help="also sample every process with py-spy into PREFIX.*.txt")
    args = parser.parse_args(argv)
    state, _ = workload.build("training", int(args.size_gib * (1 << 30)))
    tensors = workload.tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    outdir = tempfile.mkdtemp(prefix="ckpt-daemoncpu-", dir=args.workdir)
    init_single_process_group(tempfile.mkdtemp(prefix="ckpt-daemoncpu-pg-"))
    PollCount.install()
    print(f"code: {os.environ.get('PYTHONPATH', '?')}; {nbytes / (1 << 30):.3f} GiB in "
          f"{len(tensors)} tensors, {args.saves} saves a method and round, {args.rounds} "
          f"round(s)\n")
    with exported(args.before) as before:
        configurations = [(f"before ({args.before})", before, {})] if before else []
        configurations += [("this tree", None, {})]
        if args.polling:
            configurations += [("this tree, CKPTD_POLL_HOLD=0", None, {"CKPTD_POLL_HOLD": "0"})]
        results: dict = {}
        try:
            for _ in range(args.rounds):
                for label, tree, env in configurations:
                    run_configuration(label, tree, env, state, outdir, nbytes, args, results)
        finally:
            m.remove_tree(outdir)
    print_results(results, configurations)
    print(f"\nload average {os.getloadavg()}")
    return 0


def run_configuration(label: str, tree: str | None, env: dict, state: dict, outdir: str,
                      nbytes: int, args, results: dict) -> None:
    """One round of one configuration: a fresh daemon, both methods; adds to ``results``
    (``(method, label) -> (per-GB list, groups)``)."""
    os.environ.update(env)
    try:
        with code_of(tree):
            daemon = Daemon(outdir, int(nbytes * 1.05) + (64 << 20), 2)
        try:
            for method in (m.CkptdTorch(state), m.CkptdDcp(state, enable_cache=True)):
                per_gb, groups = measure(method, daemon, outdir, args.saves, nbytes, args.py_spy)
                kept = results.setdefault((method.name, label), ([], {}))
                kept[0].extend(per_gb)
                for group, values in groups.items():
                    kept[1].setdefault(group, []).extend(values)
        finally:
            leftover = _connections.get(daemon.socket)
            if leftover is not None:  # its mapping of the pool would outlive the daemon
                leftover.close()
            daemon.stop()
    finally:
        for key in env:
            os.environ.pop(key, None)


def _cell(values: list, scale: float = 1.0, digits: int = 1) -> str:
    med = statistics.median(values)
    return (f"{scale * med:.{digits}f} ({scale * min(values):.{digits}f}–"
            f"{scale * max(values):.{digits}f})")


def print_results(results: dict, configurations: list) -> None:
    """The table (medians with their spread), then each configuration's ratios of the
    medians against the first one."""
    print("| method | code | CPU-s per GB durable | "
          + " | ".join(f"{g}, ms a save" for g in GROUPS)
          + " | start to durable, s | POLLs a save |")
    print("|---" * (5 + len(GROUPS)) + "|")
    for (name, label), (per_gb, groups) in results.items():
        print(f"| {name} | {label} | {_cell(per_gb, digits=3)} | "
              + " | ".join(_cell(groups[g], 1000) for g in GROUPS)
              + f" | {_cell(groups['wall'], digits=3)} | {_cell(groups['polls'], digits=0)} |")
    reference = configurations[0][0]
    med = statistics.median
    for (name, label), (per_gb, groups) in results.items():
        base = results.get((name, reference))
        if label == reference or base is None:
            continue
        print(f"\n{name}, {label} / {reference} (ratio of medians): CPU-s per GB "
              f"{med(per_gb) / med(base[0]):.2f}, daemon main thread "
              f"{med(groups[GROUPS[0]]) / med(base[1][GROUPS[0]]):.2f}, daemon other threads "
              f"{med(groups[GROUPS[1]]) / med(base[1][GROUPS[1]]):.2f}, start to durable "
              f"{med(groups['wall']) / med(base[1]['wall']):.2f}")


if __name__ == "__main__":
    sys.exit(main())
