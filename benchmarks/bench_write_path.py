"""The write path: what a save costs the node while it becomes durable, buffered against direct.

On the realistic ``training`` state dict, in one run, for ckptd with its writers on the
page-cache path (``CKPTD_WRITE_MODE=buffered``, zlib crc32 records: the path before O_DIRECT)
and on the direct path (O_DIRECT from the staging pool, crc32c records), and for stock DCP
``async_save`` (shared-memory stager) and torchtitan's pattern beside them:

- daemon CPU: user + system seconds of the daemon and its writers (their threads included)
  per GB made durable (DCP: of its checkpoint process);
- time to durable against a raw O_DIRECT write + fsync of the same bytes, measured right
  before each run (the bound), as the ratio of the medians, with the bound's spread: from
  the save call (the trainer's view: staging included), and from "staged" (every byte in
  the pool, as the daemon logs it: what the writers themselves take, which the bound is
  comparable to); and from staged against the same raw write from shared memory (tmpfs
  pages, the kind of memory ckptd's staging pool is; on these machines a direct write
  from it is slower than from private anonymous memory);
- page-cache growth during the save (``Cached - Shmem`` of /proc/meminfo after the save
  minus before, caches dropped first) as a share of the checkpoint;
- the training step started right after the save returns against the same step with
  nothing in flight, measured right before (ratio of medians).

With ``--replication MIB``, instead: the CPU replication costs, in a two-node
network-namespace bed (``tests/netbed.py``, ``tests/bednodes.py``: a real daemon per node,
real ranks, unlimited links): rank 0 saves a part of MIB MiB through
``LocalCheckpointManager`` with factor 2, rank 1 a tiny one; user + system seconds of the
sender's daemon and writers (staging, its local write, sending) and of the receiver's
(receiving, checking and writing the replica), per GB of rank 0's part.

Run as root (it drops the page cache), under the machine-wide lock:
``python benchmarks/bench_write_path.py --size-gib 1 --repeats 3``. Measures only.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import methods as m  # noqa: E402
import workload  # noqa: E402
from bench_save import Daemon, drop_caches, init_single_process_group  # noqa: E402
from procmem import descendants  # noqa: E402

GB = 1e9
_AFTER_STAGING = re.compile(r"durable: \d+ bytes in ([0-9.]+)s after staging")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (each process with all its threads)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total / _TICK


def page_cache_bytes() -> int:
    """File pages in the page cache, not counting shared memory (the staging pool)."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            values[key] = int(value.split()[0]) * 1024
    return values["Cached"] - values["Shmem"]


def staged_to_durable(log: str) -> float | None:
    """The slowest request's time from staged to durable in a piece of ckptd's log."""
    times = [float(t) for t in _AFTER_STAGING.findall(log)]
    return max(times) if times else None


def timed_bound(raw: m.RawWrite, outdir: str) -> float:
    """One run of a raw-write bound, page cache dropped first."""
    drop_caches()
    started = time.perf_counter()
    raw.start(os.path.join(outdir, "raw"))
    seconds = time.perf_counter() - started
    m.remove_tree(os.path.join(outdir, "raw"))
    return seconds


def measure(method: m.Method, raw: m.RawWrite, step: workload.TrainingStep, outdir: str,
            repeats: int, nbytes: int, daemon: Daemon | None = None,
            raw_shared: m.RawWrite | None = None) -> dict:
    """Every figure of one method, ``repeats`` times each (after one warm-up save)."""
    path = os.path.join(outdir, "ckpt")
    method.prepare()
    method.start(path)
    method.wait_durable()
    m.remove_tree(path)
    runs = {"durable": [], "staged_durable": [], "bound": [], "bound_shared": [],
            "cpu_per_gb": [], "cache_growth": [], "step": [], "normal_step": []}
    for _ in range(repeats):
        runs["bound"].append(timed_bound(raw, outdir))
        if raw_shared is not None:
            runs["bound_shared"].append(timed_bound(raw_shared, outdir))
        drop_caches()
        helpers = method.helper_pids()
        cache, cpu = page_cache_bytes(), cpu_seconds(helpers)
        log_at = daemon.log_offset() if daemon is not None else 0
        started = time.perf_counter()
        method.start(path)
        method.wait_durable()
        runs["durable"].append(time.perf_counter() - started)
        if daemon is not None:
            after_staging = staged_to_durable(daemon.log_since(log_at))
            if after_staging is not None:
                runs["staged_durable"].append(after_staging)
        runs["cpu_per_gb"].append((cpu_seconds(helpers) - cpu) / (nbytes / GB))
        runs["cache_growth"].append((page_cache_bytes() - cache) / nbytes)
        m.remove_tree(path)
        runs["normal_step"].append(step.run())
        method.start(path)
        runs["step"].append(step.run(before_update=method.before_update))
        method.wait_durable()
        m.remove_tree(path)
    method.close()
    return runs


def summary(name: str, runs: dict) -> str:
    med = statistics.median
    bound = runs["bound"]
    staged = runs["staged_durable"]
    from_staged = (f"{med(staged):.3f} | {med(staged) / med(bound):.2f}×" if staged
                   else "– | –")
    shared = runs["bound_shared"]
    from_shared = (f"{med(shared):.3f} ({min(shared):.3f}–{max(shared):.3f}) | "
                   f"{med(staged) / med(shared):.2f}×" if shared and staged else "– | –")
    return (f"| {name} | {med(runs['cpu_per_gb']):.3f} | "
            f"{med(bound):.3f} ({min(bound):.3f}–{max(bound):.3f}) | "
            f"{med(runs['durable']):.3f} | {med(runs['durable']) / med(bound):.2f}× | "
            f"{from_staged} | {from_shared} | "
            f"{100 * med(runs['cache_growth']):.1f}% | "
            f"{med(runs['step']) / med(runs['normal_step']):.2f}× "
            f"({med(runs['step']):.3f} / {med(runs['normal_step']):.3f}) |")


def save_replicated(rank: int, world: int, roots: list, big_mib: int, iteration: int) -> int:
    """In a bed node: one local save with factor 2, finalized; rank 0's part is big."""
    import torch
    from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict,
                             CliqueReplicationStrategy, LocalCheckpointManager)

    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    manager = LocalCheckpointManager(roots[rank], session_id="cpu", repl_strategy=strategy)
    manager.find_latest()
    numel = (big_mib << 20) // 4 if rank == 0 else 16
    state = {"w": torch.full((numel,), float(iteration + rank)), "step": iteration}
    queue = AsyncCallsQueue()
    queue.schedule_async_request(manager.save(BasicTensorAwareStateDict(state), iteration,
                                              is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return numel * 4


def replication_cpu(big_mib: int, repeats: int) -> str:
    """CPU-s per GB replicated, sender and receiver (see the module's docstring): each
    timed save of a ``big_mib`` part is paired with one of a 1 MiB part, and the row is
    the difference per GB of the difference in bytes (what a byte costs, not what a save
    costs whatever its size: connecting, agreeing, committing)."""
    from bednodes import BedNodes, values
    from netbed import NetBed

    import bench_write_path  # the ranks import the function by its module's name, not __main__

    workdir = tempfile.mkdtemp(prefix="ckpt-writepath-repl-")
    runs: dict = {"sender": [], "receiver": [], "fixed": []}
    with NetBed(2, None, f"{4 * big_mib + 256}m", mode="netns") as bed:
        nodes = BedNodes(bed, workdir, env={"CKPTD_PEER_TIMEOUT": "30"},
                         pool_size=f"{2 * big_mib + 64}M")
        try:
            roots = [nodes.root(0), nodes.root(1)]
            iteration = 0

            def save(mib: int) -> tuple[int, list[float]]:
                nonlocal iteration
                iteration += 1
                trees = [[p.pid] + list(descendants(p.pid)) for p in nodes.procs]
                before = [cpu_seconds(tree) for tree in trees]
                nbytes = values(nodes.run_ranks(bench_write_path.save_replicated, [0, 1],
                                                args=(roots, mib, iteration),
                                                name=f"save{iteration}"))[0]
                return nbytes, [cpu_seconds(tree) - b for tree, b in zip(trees, before)]

            save(big_mib)  # warm-up
            for _ in range(repeats):
                big, big_cpu = save(big_mib)
                small, small_cpu = save(1)
                gb = (big - small) / GB
                runs["sender"].append((big_cpu[0] - small_cpu[0]) / gb)
                runs["receiver"].append((big_cpu[1] - small_cpu[1]) / gb)
                runs["fixed"].append(small_cpu[0] + small_cpu[1])
        finally:
            nodes.stop_all()
    m.remove_tree(workdir)
    med = statistics.median
    return (f"| {big_mib} MiB part, factor 2 | {med(runs['sender']):.3f} "
            f"({min(runs['sender']):.3f}–{max(runs['sender']):.3f}) | "
            f"{med(runs['receiver']):.3f} "
            f"({min(runs['receiver']):.3f}–{max(runs['receiver']):.3f}) | "
            f"{med(runs['fixed']):.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--only", default="", help="comma-separated substrings of method names")
    parser.add_argument("--replication", type=int, default=0, metavar="MIB",
                        help="measure replication's CPU instead, with a part of MIB MiB")
    args = parser.parse_args(argv)
    if args.replication:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "tests"))
        row = replication_cpu(args.replication, args.repeats)
        print("| save | sender CPU-s per GB (min–max) | receiver CPU-s per GB (min–max) | "
              "both daemons' CPU-s for a 1 MiB save |")
        print("|---|---|---|---|")
        print(row)
        return 0
    nbytes = int(args.size_gib * (1 << 30))
    state, _ = workload.build("training", nbytes)
    tensors = workload.tensors_of(state)
    total = sum(t.numel() * t.element_size() for t in tensors)
    copy = m.PreallocatedCopy(tensors)
    copy.prepare()
    raw = m.RawWrite(copy, direct=True)
    raw.prepare()
    raw_shared = m.RawWrite(copy, direct=True, from_shared=True)
    step = workload.TrainingStep(state)
    outdir = tempfile.mkdtemp(prefix="ckpt-writepath-", dir=args.workdir)
    rundir = tempfile.mkdtemp(prefix="ckpt-writepath-pg-")
    init_single_process_group(rundir)
    wanted = [w for w in args.only.split(",") if w]
    rows = []

    def keep(name: str) -> bool:
        return not wanted or any(w in name for w in wanted)

    for mode, checksum in (("buffered", "crc32"), ("direct", "crc32c")):
        os.environ["CKPTD_WRITE_MODE"], os.environ["CKPTD_CHECKSUM"] = mode, checksum
        daemon = Daemon(outdir, int(total * 1.05) + (64 << 20), 2)
        try:
            for method in (m.CkptdTorch(state), m.CkptdDcp(state, enable_cache=True)):
                name = f"{method.name} [{mode}, {checksum}]"
                if keep(name):
                    rows.append(summary(name, measure(method, raw, step, outdir, args.repeats,
                                                      total, daemon, raw_shared)))
                    print(rows[-1], flush=True)
        finally:
            daemon.stop()
    for method in (m.DcpAsyncSave(state, stager="shared"), m.DcpAsyncSave(state, stager="async")):
        if keep(method.name):
            rows.append(summary(method.name, measure(method, raw, step, outdir, args.repeats,
                                                     total)))
            print(rows[-1], flush=True)
    m.stop_dcp_checkpoint_process()
    print(f"\n{total / (1 << 30):.3f} GiB in {len(tensors)} tensors, medians of {args.repeats}; "
          f"load average {os.getloadavg()}\n")
    print("| method | helpers' CPU-s per GB durable | raw O_DIRECT write + fsync s (min–max) | "
          "save call → durable s | ÷ raw | staged → durable s | ÷ raw | the same raw write "
          "from shared memory s (min–max) | staged → durable ÷ it | page-cache growth ÷ "
          "checkpoint | step overlapping the write ÷ normal step (s / s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    m.remove_tree(outdir)
    copy.close()  # its buffer is a /dev/shm file: nearly 1 GiB of memory until unlinked
    return 0


if __name__ == "__main__":
    sys.exit(main())
