"""The write path: what a save costs the node while it becomes durable, buffered against direct.

On the realistic ``training`` state dict, in one run, for ckptd with its writers on the
page-cache path (``CKPTD_WRITE_MODE=buffered``, zlib crc32 records: the path before O_DIRECT)
and on the direct path (O_DIRECT from the staging pool, crc32c records), and for stock DCP
``async_save`` (shared-memory stager) and torchtitan's pattern beside them:

- daemon CPU: user + system seconds of the daemon and its writers (their threads included)
  per GB made durable (DCP: of its checkpoint process);
- time to durable against a raw O_DIRECT write + fsync of the same bytes, measured right
  before each run (the bound: one thread, 32 MiB writes, from private anonymous memory on
  huge pages, so that every disk request is full-size whatever the machine's free memory
  looks like), as the ratio of the medians, with the bound's spread: from
  the save call (the trainer's view: staging included), and from "staged" (every byte in
  the pool, as the daemon logs it: what the writers themselves take, which the bound is
  comparable to); and from staged against the same raw write from shared memory, from
  an *unfolded* file in ``/dev/shm`` (4 KiB tmpfs pages) and from one in a tmpfs mounted
  with ``huge=within_size`` (2 MiB pages). The ``/dev/shm`` bound changed meaning at
  5285bc7: ckptd now folds its pool there into 2 MiB pages, and this bound's file is not
  folded, so it measures memory like the pool's before that change, not the pool's now;
- the mean disk write request during the save (from the device's ``stat``: scattered
  4 KiB pages cut requests short);
- page-cache growth during the save (``Cached - Shmem`` of /proc/meminfo after the save
  minus before, caches dropped first) as a share of the checkpoint;
- the training step started right after the save returns against the same step with
  nothing in flight, measured right before (ratio of medians).

ckptd runs twice: with its staging pool in ``/dev/shm`` (folded into 2 MiB pages where
the kernel can; its status says how much) and with ``--pool-dir`` in a tmpfs
with huge pages that the benchmark mounts itself (root; it says so and leaves those rows
out where the mount fails), both with the direct path; ``--buffered`` adds the page-cache
path (``CKPTD_WRITE_MODE=buffered``, zlib crc32 records: the path before O_DIRECT) for the
``/dev/shm`` pool; ``--before REV`` adds, for each pool and before the current code's rows,
ckptd with its daemon and writers run from commit REV (exported with ``git archive``; the
trainer's side stays this tree's, so REV must speak the same protocol): a change to the
daemon or the writers, before and after in one run (``--rounds R``: the configurations
take turns R times, so a drift of the disk's speed falls on both). A note after the table times the
trainer's part, a memcpy of the state into a pre-faulted buffer in each kind of memory.

With ``--replication MIB``, instead: the CPU replication costs, in a two-node
network-namespace bed (``tests/netbed.py``, ``tests/bednodes.py``: a real daemon per node,
real ranks, unlimited links): rank 0 saves a part of MIB MiB through
``LocalCheckpointManager`` with factor 2, rank 1 a tiny one; user + system seconds of the
sender's daemon and writers (staging, its local write, sending) and of the receiver's
(receiving, checking and writing the replica), per GB of rank 0's part. The bed's nodes
keep their data on tmpfs; ``--replication-disk DIR`` adds a row with the receiver's local
directory on DIR's filesystem instead (a fresh directory there bind-mounted over node 1's
tmpfs while the row runs), where writing the replica through the page cache or not shows.

Run as root (it drops the page cache and mounts the huge-page tmpfs), under the
machine-wide lock: ``python benchmarks/bench_write_path.py --size-gib 1 --repeats 3``.
Measures only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import methods as m  # noqa: E402
from before_tree import code_of, exported  # noqa: E402
import workload  # noqa: E402
from bench_save import Daemon, drop_caches, init_single_process_group  # noqa: E402
from procmem import descendants  # noqa: E402

GB = 1e9
_AFTER_STAGING = re.compile(r"durable: \d+ bytes in ([0-9.]+)s after staging")
_STAGED = re.compile(r"staged in ([0-9.]+)s; writing")
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


def disk_of(path: str) -> str | None:
    """``/sys/dev/block/M:m/stat`` of the block device ``path`` is on (a partition has one
    too), or None where it is on none (tmpfs, overlay, btrfs's anonymous device, NFS)."""
    device = os.stat(path).st_dev
    stat_path = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat"
    return stat_path if os.path.exists(stat_path) else None


def disk_writes(stat_path: str | None) -> tuple[int, int] | None:
    """Write requests completed and 512-byte sectors written so far on that device (None
    without a device)."""
    if stat_path is None:
        return None
    with open(stat_path) as f:
        fields = f.read().split()
    return int(fields[4]), int(fields[6])


def mean_request_kib(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The mean write request between two ``disk_writes`` readings, in KiB (None without a
    device)."""
    if before is None or after is None:
        return None
    return (after[1] - before[1]) / 2 / max(after[0] - before[0], 1)


def staged_to_durable(log: str) -> float | None:
    """The slowest request's time from staged to durable in a piece of ckptd's log."""
    times = [float(t) for t in _AFTER_STAGING.findall(log)]
    return max(times) if times else None


def staging_seconds(log: str) -> float | None:
    """The slowest request's time from its request to staged in a piece of ckptd's log."""
    times = [float(t) for t in _STAGED.findall(log)]
    return max(times) if times else None


@contextmanager
def huge_page_tmpfs(size: int):
    """A tmpfs mounted with ``huge=within_size`` for the run (``None`` where mounting fails)."""
    path = tempfile.mkdtemp(prefix="hugepool-bench-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={size >> 20}m",
                           "hugepool-bench", path], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"no huge-page tmpfs (mount: {done.stderr.strip() or done.returncode}; needs "
              "root): its rows and bound are left out", flush=True)
        os.rmdir(path)
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def pool_pages(daemon: Daemon) -> str:
    """Where the daemon's pool is and how much of it is on huge pages (from its status)."""
    done = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", daemon.socket,
                           "--json"], capture_output=True, text=True, timeout=60)
    pool = json.loads(done.stdout)["pool"]
    return (f"pool in {pool['directory']}: {pool['huge_page_bytes'] >> 20} of "
            f"{pool['size_bytes'] >> 20} MiB on huge pages")


def timed_bound(raw: m.RawWrite, outdir: str) -> float:
    """One run of a raw-write bound, page cache dropped first."""
    drop_caches()
    started = time.perf_counter()
    raw.start(os.path.join(outdir, "raw"))
    seconds = time.perf_counter() - started
    m.remove_tree(os.path.join(outdir, "raw"))
    return seconds


def measure(method: m.Method, bounds: dict, step: workload.TrainingStep, outdir: str,
            repeats: int, nbytes: int, daemon: Daemon | None = None) -> dict:
    """Every figure of one method, ``repeats`` times each (after one warm-up save).

    ``bounds`` maps each bound's name to its raw write (``"anon"`` first: the issue's).
    """
    path = os.path.join(outdir, "ckpt")
    method.prepare()
    method.start(path)
    method.wait_durable()
    m.remove_tree(path)
    runs = {"durable": [], "staged_durable": [], "staging": [], "cpu_per_gb": [],
            "cache_growth": [], "step": [], "normal_step": [], "request_kib": [],
            **{f"bound_{name}": [] for name in bounds}}
    order = list(bounds)
    for repeat in range(repeats):
        # each bound takes its turn first: the first write after a save ran slower here
        for name in order[repeat % len(order):] + order[:repeat % len(order)]:
            runs[f"bound_{name}"].append(timed_bound(bounds[name], outdir))
        drop_caches()
        helpers = method.helper_pids()
        cache, cpu = page_cache_bytes(), cpu_seconds(helpers)
        log_at = daemon.log_offset() if daemon is not None else 0
        disk = disk_of(outdir)
        written = disk_writes(disk)
        started = time.perf_counter()
        method.start(path)
        method.wait_durable()
        runs["durable"].append(time.perf_counter() - started)
        request_kib = mean_request_kib(written, disk_writes(disk))
        if request_kib is not None:
            runs["request_kib"].append(request_kib)
        if daemon is not None:
            log = daemon.log_since(log_at)
            after_staging, staging = staged_to_durable(log), staging_seconds(log)
            if after_staging is not None:
                runs["staged_durable"].append(after_staging)
            if staging is not None:
                runs["staging"].append(staging)
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


#: The bounds, in the table's order: name -> what its raw write reads from.
BOUNDS = {"anon": "private anonymous memory (huge pages)",
          "shm": "an unfolded /dev/shm file (4 KiB pages)",
          "huge": "a huge=within_size tmpfs (2 MiB pages)"}


def _spread(values: list[float]) -> str:
    med = statistics.median
    return f"{med(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def summary(name: str, runs: dict) -> str:
    """One table row: ratios are of the medians; each bound's min–max in brackets."""
    med = statistics.median
    bound = runs["bound_anon"]
    staged = runs["staged_durable"]
    cells = [name, f"{med(runs['cpu_per_gb']):.3f}", _spread(bound),
             f"{med(runs['durable']):.3f}", f"{med(runs['durable']) / med(bound):.2f}×",
             f"{med(runs['staging']):.3f}" if runs["staging"] else "–",
             f"{med(staged):.3f}" if staged else "–"]
    for key in BOUNDS:
        other = runs.get(f"bound_{key}")
        if key != "anon":
            cells.append(_spread(other) if other else "–")
        cells.append(f"{med(staged) / med(other):.2f}×" if other and staged else "–")
    request = f"{med(runs['request_kib']):.0f}" if runs["request_kib"] else "–"
    cells += [request, f"{100 * med(runs['cache_growth']):.1f}%",
              f"{med(runs['step']) / med(runs['normal_step']):.2f}× "
              f"({med(runs['step']):.3f} / {med(runs['normal_step']):.3f})"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| method | helpers' CPU-s per GB durable | raw O_DIRECT write + fsync from private "
          "anonymous memory (huge pages) s (min–max) | save call → durable s | ÷ raw | save "
          "call → staged s | staged → durable s | ÷ raw from anonymous memory | the raw write "
          "from an unfolded /dev/shm file (4 KiB pages) s (min–max) | staged → durable ÷ it "
          "| the raw write from the huge-page tmpfs s (min–max) | staged → durable ÷ it | disk "
          "write request KiB (mean) "
          "| page-cache growth ÷ checkpoint | step overlapping the write ÷ normal step "
          "(s / s) |\n" + "|---" * 15 + "|")


def bound_pages(raw: m.RawWrite) -> str:
    """How much of the anonymous bound's buffer the kernel gave huge pages (its mapping's
    ``AnonHugePages`` in smaps)."""
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(raw._aligned))
    huge, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                huge += int(line.split()[1]) << 10
    return (f"the bound's private anonymous buffer: {huge >> 20} of {raw.source.size >> 20} "
            "MiB on huge pages")


def bound_requests(bounds: dict, workdir: str) -> str:
    """The disk's mean write request of one more run of each bound (scattered 4 KiB pages
    cut requests short of the disk's limit)."""
    stat_path = disk_of(workdir)
    outdir = tempfile.mkdtemp(prefix="ckpt-writepath-req-", dir=workdir)
    sizes = []
    for name, raw in bounds.items():
        before = disk_writes(stat_path)
        timed_bound(raw, outdir)
        kib = mean_request_kib(before, disk_writes(stat_path))
        sizes.append(f"{BOUNDS[name]} {'–' if kib is None else f'{kib:.0f}'}")
    m.remove_tree(outdir)
    return "disk write request KiB (mean) of one more run of each bound: " + "; ".join(sizes)


def memcpy_note(copies: dict, repeats: int) -> str:
    """The trainer's part: one memcpy of the state into each pre-faulted buffer, timed."""
    times = {name: [] for name in copies}
    for _ in range(2 * repeats):
        for name, copy in copies.items():
            started = time.perf_counter()
            copy.start("")
            times[name].append(time.perf_counter() - started)
    return "; ".join(f"memcpy of the state into {BOUNDS[name]}: {_spread(t)} s"
                     for name, t in times.items())


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


@contextmanager
def receiver_directory_on(bed, disk: str | None):
    """Node 1's local directory on ``disk``'s filesystem (a fresh directory bind-mounted
    over its tmpfs, before its daemon starts, so the node's processes see it), or left
    on tmpfs for None; the mount goes before the bed unmounts its tmpfs."""
    if disk is None:
        yield "tmpfs"
        return
    local = bed.nodes[1].local_dir
    backing = tempfile.mkdtemp(prefix="ckpt-writepath-repl-disk-", dir=disk)
    subprocess.run(["mount", "--bind", backing, local], check=True)
    try:
        # the last line is the mount on top (the tmpfs below is listed too)
        kind = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", local],
                              capture_output=True, text=True, check=True).stdout.split()[-1]
        yield f"{kind} ({disk})"
    finally:
        subprocess.run(["umount", "-l", local], check=False)
        m.remove_tree(backing)


def replication_cpu(big_mib: int, repeats: int, disk: str | None = None) -> str:
    """CPU-s per GB replicated, sender and receiver (see the module's docstring): each
    timed save of a ``big_mib`` part is paired with one of a 1 MiB part, and the row is
    the difference per GB of the difference in bytes (what a byte costs, not what a save
    costs whatever its size: connecting, agreeing, committing). ``disk``: the receiver's
    local directory on that directory's filesystem instead of its tmpfs."""
    from bednodes import BedNodes, values
    from netbed import NetBed

    import bench_write_path  # the ranks import the function by its module's name, not __main__

    workdir = tempfile.mkdtemp(prefix="ckpt-writepath-repl-")
    runs: dict = {"sender": [], "receiver": [], "fixed": []}
    with NetBed(2, None, f"{4 * big_mib + 256}m", mode="netns") as bed, \
            receiver_directory_on(bed, disk) as receiver_fs:
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
    return (f"| {big_mib} MiB part, factor 2, replica on {receiver_fs} | "
            f"{med(runs['sender']):.3f} "
            f"({min(runs['sender']):.3f}–{max(runs['sender']):.3f}) | "
            f"{med(runs['receiver']):.3f} "
            f"({min(runs['receiver']):.3f}–{max(runs['receiver']):.3f}) | "
            f"{med(runs['fixed']):.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="ckptd's configurations take turns this many times (repeats each)")
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--only", default="", help="comma-separated substrings of method names")
    parser.add_argument("--pools", default="shm,huge",
                        help="where ckptd's pool is: shm (/dev/shm), huge (the huge-page tmpfs)")
    parser.add_argument("--zero-stall", action="store_true",
                        help="ckptd's saves zero-stall (their copy in the background)")
    parser.add_argument("--variant", action="append", default=[], metavar="CKPTD_KNOB=VALUE",
                        help="also ckptd with this knob set (repeatable: one variant), for each pool")
    parser.add_argument("--before", default="", metavar="REV",
                        help="also ckptd's daemon and writers from git commit REV, for each pool")
    parser.add_argument("--buffered", action="store_true",
                        help="also the page-cache path (the path before O_DIRECT), pool in /dev/shm")
    parser.add_argument("--replication", type=int, default=0, metavar="MIB",
                        help="measure replication's CPU instead, with a part of MIB MiB")
    parser.add_argument("--replication-disk", default=None, metavar="DIR",
                        help="with --replication: a second row with the receiver's local "
                             "directory on DIR's filesystem")
    args = parser.parse_args(argv)
    if args.replication:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "tests"))
        rows = [replication_cpu(args.replication, args.repeats)]
        if args.replication_disk:
            rows.append(replication_cpu(args.replication, args.repeats, args.replication_disk))
        print("| save | sender CPU-s per GB (min–max) | receiver CPU-s per GB (min–max) | "
              "both daemons' CPU-s for a 1 MiB save |")
        print("|---|---|---|---|")
        print("\n".join(rows))
        return 0
    nbytes = int(args.size_gib * (1 << 30))
    state, _ = workload.build("training", nbytes)
    tensors = workload.tensors_of(state)
    total = sum(t.numel() * t.element_size() for t in tensors)
    pool_size = int(total * 1.05) + (64 << 20)
    # room for each daemon's pool: the benchmark process keeps an earlier daemon's mapped
    pools_there = 2 if args.variant or args.before else 1
    with huge_page_tmpfs(pools_there * pool_size + total + (256 << 20)) as huge_dir:
        copies = {"shm": m.PreallocatedCopy(tensors, one_call=True)}
        if huge_dir:
            copies["huge"] = m.PreallocatedCopy(tensors, shm_dir=huge_dir, one_call=True)
        for copy in copies.values():
            copy.prepare()
            copy.start("")  # the state's own bytes, not zeros, go to the disk
        bounds = {"anon": m.RawWrite(copies["shm"], direct=True),
                  **{name: m.RawWrite(copy, direct=True, from_shared=True)
                     for name, copy in copies.items()}}
        bounds["anon"].prepare()
        notes = [bound_pages(bounds["anon"])]
        try:
            rows, more = run_methods(args, state, tensors, total, pool_size, bounds, huge_dir)
            notes += more + [memcpy_note(copies, args.repeats), bound_requests(bounds, args.workdir)]
        finally:
            bounds["anon"].close()
            for copy in copies.values():
                copy.close()  # a tmpfs file each: nearly 1 GiB of memory until unlinked
    print(f"\n{total / (1 << 30):.3f} GiB in {len(tensors)} tensors, medians of {args.repeats}; "
          f"load average {os.getloadavg()}\n")
    print("\n".join(f"- {note}" for note in notes) + "\n")
    print(HEADER)
    print("\n".join(rows))
    return 0


def run_methods(args, state: dict, tensors: list, total: int, pool_size: int, bounds: dict,
                huge_dir: str | None) -> tuple[list[str], list[str]]:
    """Every configured method's row (and a note per ckptd daemon: its pool's pages)."""
    step = workload.TrainingStep(state)
    outdir = tempfile.mkdtemp(prefix="ckpt-writepath-", dir=args.workdir)
    rundir = tempfile.mkdtemp(prefix="ckpt-writepath-pg-")
    init_single_process_group(rundir)
    wanted = [w for w in args.only.split(",") if w]
    pools = args.pools.split(",")
    variant = dict(item.split("=", 1) for item in args.variant)
    with exported(args.before) as before:
        configurations = [("buffered", "crc32", "/dev/shm", {}, None)] if args.buffered else []
        for key, where in (("shm", "/dev/shm"), ("huge", huge_dir)):
            if where and key in pools:
                configurations += [("direct", "crc32c", where, {}, before)] if before else []
                configurations += [("direct", "crc32c", where, {}, None)]
                configurations += [("direct", "crc32c", where, variant, None)] if variant else []
        rows, notes = run_ckptd(args, configurations, state, bounds, step, outdir, total,
                                pool_size, huge_dir)
    for method in (m.DcpAsyncSave(state, stager="shared"), m.DcpAsyncSave(state, stager="async")):
        if not wanted or any(w in method.name for w in wanted):
            rows.append(summary(method.name, measure(method, bounds, step, outdir, args.repeats,
                                                     total)))
            print(rows[-1], flush=True)
    m.stop_dcp_checkpoint_process()
    m.remove_tree(outdir)
    return rows, notes


def forget_connection(socket: str) -> None:
    """Close this process's connection to a stopped daemon: it maps that daemon's pool, and
    a tmpfs holds an unlinked file's pages for as long as one mapping stays (a second round
    of turns ran the huge-page tmpfs out of space)."""
    from ckpt_client.transport.connection import _connections

    connection = _connections.get(socket)
    if connection is not None:
        connection.close()


def run_ckptd(args, configurations: list, state: dict, bounds: dict, step, outdir: str,
              total: int, pool_size: int, huge_dir: str | None) -> tuple[list[str], list[str]]:
    """The rows of ckptd in each configuration ``(mode, checksum, pool directory, knobs,
    tree of the code before or None)``; with ``--rounds R`` the configurations take turns
    R times (a fresh daemon each turn) and each row is over all its turns' saves, so a
    drift of the disk's speed during the run falls on before and after alike."""
    wanted = [w for w in args.only.split(",") if w]
    notes: list[str] = []
    runs: dict[str, dict] = {}

    def keep(name: str) -> bool:
        return not wanted or any(w in name for w in wanted)

    for mode, checksum, pool_dir, extra, tree in configurations * args.rounds:
        os.environ["CKPTD_WRITE_MODE"], os.environ["CKPTD_CHECKSUM"] = mode, checksum
        os.environ["CKPTD_POOL_DIR"] = pool_dir
        os.environ.update(extra)
        pages = "huge-page tmpfs" if pool_dir == huge_dir else pool_dir
        pages += "".join(f", {key}={value}" for key, value in extra.items())
        pages += f", before: {args.before}" if tree else ""
        made = (m.CkptdTorch(state, zero_stall=args.zero_stall),
                m.CkptdDcp(state, enable_cache=True, zero_stall=args.zero_stall))
        names = [f"{method.name} [{mode}, {checksum}, pool in {pages}]" for method in made]
        if not any(keep(name) for name in names):
            continue
        with code_of(tree):
            daemon = Daemon(outdir, pool_size, 2)
        try:
            notes.append(f"[{mode}, {checksum}, pool in {pages}]: {pool_pages(daemon)}")
            for name, method in zip(names, made):
                if keep(name):
                    measured = measure(method, bounds, step, outdir, args.repeats, total, daemon)
                    mine = runs.setdefault(name, {key: [] for key in measured})
                    for key, values in measured.items():
                        mine[key] += values
                    print(summary(name, measured), flush=True)
        finally:
            forget_connection(daemon.socket)
            daemon.stop()
            for key in ("CKPTD_POOL_DIR", *extra):
                os.environ.pop(key, None)
    return [summary(name, measured) for name, measured in runs.items()], list(dict.fromkeys(notes))


if __name__ == "__main__":
    sys.exit(main())
