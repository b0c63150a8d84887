"""Local checkpoints across separate nodes: replication, restore and the memory tier, in a
network-namespace bed, against the limits of the link and of memory (issue 12).

Nodes are the namespaces of ``tests/netbed.py`` (each its own tmpfs; veth links through a
bridge, ``tc tbf`` at ``--rate`` on both ends of every link); each node runs a real
``ckptd serve`` (``--peer-listen tcp://0.0.0.0:PORT``) and one trainer rank inside the
node (gloo over the node's veth), through ``tests/bednodes.py``. Every rank saves a part
of ``--part-mib`` MiB (the mix of ``workload.py``) with ``LocalCheckpointManager``.

1. **Time to durable** (``save(..., is_async=True)`` to ``maybe_finalize_async_calls
   (blocking=True)``: local part durable, replicas durable, iteration committed; slowest
   rank), replication factors 1 and 2 in a 2-node bed and 1 and 3 in a 3-node bed,
   alternating so drift hits all alike. Ratio to max(local write, bytes / link rate):
   the local write is the factor-1 time of the same bed, the bytes are what each node
   must send over its link ((factor - 1) parts), the link rate the tbf rate.
2. **Restore of a lost part**: node 1's daemon SIGKILLed, its tmpfs wiped, the daemon
   started again; rank 1's ``load()`` (the daemon fetches the part from node 0 over the
   bulk path, checks and writes it once, the rank reads it once). Ratio to part / link rate.
3. **Load from the daemon's memory**: a restarted trainer whose daemon lived on; ratio of
   memcpy's time for the same bytes (into a fresh buffer, as any load must; and into a
   preallocated one) to the load's. And **load from local disk** after a daemon restart,
   against a raw read of the same file into a fresh buffer. Ranks load one at a time
   (each then has the machine's cores, as a rank on a real node has its own).
4. **Bulk protection on loopback**: plain tcp against the bulk channel with
   ``aes-256-gcm`` and with ``none`` (GMAC only), 1 and 4 connections, sender and receiver
   in separate processes.

The run waits until no other pytest or benchmark runs (polling every 30 s), and records
the CPU that other processes used while it ran.

Usage (as root, for namespaces)::

    python benchmarks/bench_local.py --part-mib 256 --repeats 3 --rate 2gbit \\
        --out benchmarks/RESULTS_LOCAL.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from procmem import (cpu_used, descendants, loadavg, machine_cpu, process_cpu,  # noqa: E402
                     top_cpu_users)
from report import write_report  # noqa: E402

MiB = 1 << 20
CHUNK = 4 * MiB


# ================================================================ rank functions

def _slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _manager(root: str, session: str, factor: int):
    from ckpt_client import CliqueReplicationStrategy, LocalCheckpointManager

    strategy = (CliqueReplicationStrategy.from_replication_params(1, factor)
                if factor > 1 else None)
    return LocalCheckpointManager(root, session_id=session, repl_strategy=strategy)


def save_phase(rank: int, world: int, roots: list, sessions: dict, part_bytes: int,
               repeats: int) -> dict:
    """Alternate saves of each session (name -> factor); the first round warms up."""
    import torch.distributed as dist

    import workload
    from ckpt_client import AsyncCallsQueue, BasicTensorAwareStateDict

    state, mix = workload.build_state_dict(part_bytes, seed=rank)
    managers = {name: _manager(roots[rank], name, factor) for name, factor in sessions.items()}
    queue = AsyncCallsQueue()
    runs: dict = {name: [] for name in sessions}
    reports: dict = {}
    for iteration in range(repeats + 1):
        for name, manager in managers.items():
            dist.barrier()
            t0 = time.perf_counter()
            request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
            t1 = time.perf_counter()
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            t2 = time.perf_counter()
            blocking, durable = _slowest(t1 - t0), _slowest(t2 - t0)
            if iteration > 0:
                runs[name].append((blocking, durable))
                reports[name] = manager.last_save_report
    queue.close()
    return {"part_bytes": mix.total_bytes, "runs": runs, "reports": reports}


def _fresh_copy_seconds(nbytes: int) -> tuple[float, float]:
    """memcpy of ``nbytes``: into a fresh buffer (median of 3), into a preallocated one."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    fresh, prealloc = [], []
    target = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    for _ in range(3):
        t0 = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8).copy_(source)
        fresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        target.copy_(source)
        prealloc.append(time.perf_counter() - t0)
    return statistics.median(fresh), statistics.median(prealloc)


def _raw_read_seconds(path: str) -> float:
    """Read ``path`` into a fresh buffer with plain reads (median of 3)."""
    import torch

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        size = os.path.getsize(path)
        buffer = torch.empty(size, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        with open(path, "rb", buffering=0) as f:
            while done < size:
                done += f.readinto(view[done:])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def load_phase(rank: int, world: int, roots: list, session: str, factor: int) -> dict:
    """find_latest, then each rank's timed load in turn (so that one load has the
    machine's cores, as a rank on a real node has its own); beside it, the baseline of
    where its bytes came from."""
    import torch.distributed as dist

    manager = _manager(roots[rank], session, factor)
    latest = manager.find_latest()
    out: dict = {}
    for turn in range(world):
        dist.barrier()
        if turn != rank:
            continue
        t0 = time.perf_counter()
        manager.load()
        seconds = time.perf_counter() - t0
        report = dict(manager.last_load_report)
        out = {"latest": latest, "seconds": seconds, "report": report}
        if report["source"] == "daemon_memory":
            out["memcpy_fresh_s"], out["memcpy_prealloc_s"] = _fresh_copy_seconds(report["bytes"])
        elif report["source"] == "local_disk":
            out["raw_read_s"] = _raw_read_seconds(manager._found.own_parts[rank].path)
    dist.barrier()
    return out


# ================================================================ the bed

def raw_tcp(bed, nbytes: int) -> float:
    """Seconds plain Python tcp takes to move ``nbytes`` from node 0 to node 1."""
    port = bed.free_port(1)
    receiver = bed.popen(1, [sys.executable, "-c", _RAW_RECEIVER, bed.nodes[1].ip, str(port),
                             str(nbytes)], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "ready"
    sender = bed.run(0, [sys.executable, "-c", _RAW_SENDER, bed.nodes[1].ip, str(port),
                         str(nbytes)], timeout=600)
    receiver.wait(60)
    return float(sender.stdout.strip())


_RAW_RECEIVER = r"""
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = server.accept()
buf, got, total = memoryview(bytearray(4 << 20)), 0, int(sys.argv[3])
while got < total:
    n = conn.recv_into(buf)
    if not n:
        sys.exit("raw tcp receiver: the sender closed after %d of %d bytes" % (got, total))
    got += n
conn.sendall(b"k")
"""
_RAW_SENDER = r"""
import socket, sys, time
total, chunk = int(sys.argv[3]), memoryview(bytearray(4 << 20))
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0, sent = time.perf_counter(), 0
while sent < total:
    conn.sendall(chunk[:min(len(chunk), total - sent)])
    sent += min(len(chunk), total - sent)
conn.recv(1)
print(time.perf_counter() - t0)
"""


def with_nodes(count: int, rate: str | None, workdir: str, pool: int, tmpfs: str, run):
    """Run ``run(nodes)`` on a fresh bed of ``count`` nodes, tearing it down afterwards."""
    from bednodes import BedNodes
    from netbed import NetBed

    with NetBed(count, rate, tmpfs, mode="netns") as bed:  # the ratios need the tbf links
        nodes = BedNodes(bed, workdir, pool_size=str(pool),
                         env={"CKPTD_PEER_TIMEOUT": "60"})
        try:
            return bed.mode, bed.mode_reason, run(nodes)
        finally:
            nodes.stop_all()


def bed_two(nodes, opts: dict) -> dict:
    """Factors 1 and 2, restores, loads from memory and from disk (2 nodes)."""
    from bednodes import values

    import bench_local as this  # the ranks import this module by that name

    roots = [nodes.root(0), nodes.root(1)]
    out = {"raw_tcp_s": [raw_tcp(nodes.bed, opts["part_bytes"]) for _ in range(opts["repeats"])]}
    print("bed of 2: saves ...", flush=True)
    saved = values(nodes.run_ranks(this.save_phase, [0, 1], timeout=1800, name="save",
                                   args=(roots, {"f1": 1, "f2": 2}, opts["part_bytes"],
                                         opts["repeats"])))
    out["part_bytes"] = saved[0]["part_bytes"]
    out["runs"], out["reports"] = saved[0]["runs"], saved[0]["reports"]
    out["restore"], out["memory"], out["disk"] = [], [], []
    for i in range(opts["repeats"]):  # restarted trainers, daemons alive: their memory
        print(f"bed of 2: load from memory {i} ...", flush=True)
        out["memory"].append(values(nodes.run_ranks(this.load_phase, [0, 1],
                                                    args=(roots, "f2", 2), name=f"memory{i}"))[0])
    nodes.restart(0)  # node 0's daemon restarts, its disk kept: its memory is gone
    for i in range(opts["repeats"]):
        print(f"bed of 2: load from disk {i} ...", flush=True)
        out["disk"].append(values(nodes.run_ranks(this.load_phase, [0, 1],
                                                  args=(roots, "f2", 2), name=f"disk{i}"))[0])
    for i in range(opts["repeats"]):
        print(f"bed of 2: restore {i} ...", flush=True)
        nodes.restart(1, wipe=True)  # node 1 lost its daemon and its disk
        out["restore"].append(values(nodes.run_ranks(this.load_phase, [0, 1],
                                                     args=(roots, "f2", 2),
                                                     name=f"restore{i}"))[1])
    return out


def bed_three(nodes, opts: dict) -> dict:
    """Factors 1 and 3 (3 nodes, one clique)."""
    from bednodes import values

    import bench_local as this

    roots = [nodes.root(i) for i in range(3)]
    print("bed of 3: saves ...", flush=True)
    saved = values(nodes.run_ranks(this.save_phase, [0, 1, 2], timeout=1800, name="save",
                                   args=(roots, {"f1": 1, "f3": 3}, opts["part_bytes"],
                                         opts["repeats"])))
    return {"part_bytes": saved[0]["part_bytes"], "runs": saved[0]["runs"],
            "reports": saved[0]["reports"]}


# ================================================================ loopback protection

def _loopback_receive(port: int, protection: str, streams: int, per_stream: int,
                      keys: list) -> None:
    """Receiver process: accept ``streams`` connections, read until the end, answer."""
    from zmq.utils import z85

    from ckptd.replication.bulk_connection import BulkConnection, Kind

    server = socket.create_server(("127.0.0.1", port), backlog=streams)
    print("ready", flush=True)
    own_public, own_secret, client_public = (z85.decode(k.encode()) for k in keys)

    def serve(sock):
        if protection == "tcp":
            buf, got = memoryview(bytearray(CHUNK)), 0
            while got < per_stream:
                got += sock.recv_into(buf)
            sock.sendall(b"k")
            return
        channel = BulkConnection.accept(sock, own_secret, own_public, lambda k: k == client_public,
                                 protection, 30.0)
        while (frame := channel.receive()).kind != Kind.END:
            pass
        channel.send(Kind.DONE, frame.xfer, payload={"ok": True})

    threads = []
    for _ in range(streams):
        sock, _ = server.accept()
        threads.append(threading.Thread(target=serve, args=(sock,)))
        threads[-1].start()
    for thread in threads:
        thread.join()


def loopback(protection: str, streams: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` over ``streams`` loopback connections (``tcp``: plain)."""
    import zmq
    from zmq.utils import z85

    from ckptd.replication.bulk_connection import BulkConnection, Kind

    server_keys, client_keys = zmq.curve_keypair(), zmq.curve_keypair()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    receiver = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--loopback-receiver", str(port), protection,
         str(streams), str(nbytes // streams), server_keys[0].decode(), server_keys[1].decode(),
         client_keys[0].decode()], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    assert receiver.stdout.readline().strip() == "ready"
    payload = memoryview(bytearray(os.urandom(MiB) * (CHUNK // MiB)))
    per_stream = nbytes // streams
    connections = []
    for _ in range(streams):
        if protection == "tcp":
            connections.append(socket.create_connection(("127.0.0.1", port)))
        else:
            connections.append(BulkConnection.dial(("127.0.0.1", port), z85.decode(client_keys[1]),
                                            z85.decode(client_keys[0]),
                                            z85.decode(server_keys[0]), protection, 30.0))

    def send(connection):
        for offset in range(0, per_stream, CHUNK):
            chunk = payload[:min(CHUNK, per_stream - offset)]
            if protection == "tcp":
                connection.sendall(chunk)
            else:
                connection.send(Kind.CHUNK, 1, offset=offset, payload=chunk)
        if protection == "tcp":
            connection.recv(1)
        else:
            connection.send(Kind.END, 1)
            connection.receive()

    threads = [threading.Thread(target=send, args=(c,)) for c in connections]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t0
    receiver.wait(120)
    for connection in connections:
        connection.close()
    return elapsed


# ================================================================ the machine

def others_running() -> list[str]:
    """Other pytest or benchmark processes (not this one, nor its children)."""
    found = subprocess.run(["pgrep", "-af", "pytest|bench_"], capture_output=True,
                           text=True).stdout.splitlines()
    mine = {str(os.getpid()), str(os.getppid())}
    return [line for line in found if line.split()[0] not in mine and "pgrep" not in line]


def wait_until_quiet(max_wait: float) -> list[str]:
    """Poll every 30 s until no other pytest or benchmark runs (at most ``max_wait`` s)."""
    waited: list[str] = []
    deadline = time.monotonic() + max_wait
    while (running := others_running()) and time.monotonic() < deadline:
        waited += [line for line in running if line not in waited]
        print(f"waiting for a quiet machine: {len(running)} other test/benchmark process(es)",
              flush=True)
        time.sleep(30)  # polling other engineers' runs, not synchronizing with them
    return waited


def cpu_snapshot() -> dict:
    """Machine CPU seconds in processes / interrupts / steal, this process tree's, per pid."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"t": time.monotonic(), **machine_cpu(),
            "mine": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
            "pids": process_cpu()}


def other_cpu(before: dict, after: dict) -> dict:
    """What other processes used between two snapshots, and the largest of them."""
    parents = {pid: ppid for pid, (_, _, ppid) in after["pids"].items()}
    mine = set(descendants(os.getpid(), parents))  # this process is in rusage already
    live_mine = sum(cpu_used(before["pids"], after["pids"], pid) for pid in mine
                    if pid in after["pids"])
    top = top_cpu_users(before["pids"], after["pids"],
                        lambda pid, cmd: pid in mine or pid == os.getpid(), least=0.5)
    total = after["processes"] - before["processes"]
    ours = after["mine"] - before["mine"] + live_mine
    return {"seconds": round(after["t"] - before["t"], 1), "all_processes_cpu_s": round(total, 1),
            "this_benchmark_cpu_s": round(ours, 1),
            "others_cpu_s": round(max(total - ours, 0.0), 1),
            "interrupts_s": round(after["interrupts"] - before["interrupts"], 1),
            "steal_s": round(after["steal"] - before["steal"], 1),
            "top_others": top}


# ================================================================ report

def _med(values) -> float:
    return statistics.median(values)


def _durable(runs: dict, name: str) -> float:
    return _med([d for _, d in runs[name]])


def summarize(report: dict) -> dict:
    """The ratios the issue asks for, from the raw figures."""
    link = report["link_bytes_per_s"]
    part = report["two"]["part_bytes"]
    s: dict = {}
    for bed, factors in (("two", (1, 2)), ("three", (1, 3))):
        runs = report[bed]["runs"]
        local = _durable(runs, "f1")
        for factor in factors:
            bound = max(local, (factor - 1) * part / link)
            s[f"f{factor}_{bed}"] = {"durable_s": _durable(runs, f"f{factor}"),
                                     "bound_s": bound,
                                     "ratio": _durable(runs, f"f{factor}") / bound}
    restore = _med([r["seconds"] for r in report["two"]["restore"]])
    s["restore"] = {"seconds": restore, "link_s": part / link, "ratio": restore / (part / link),
                    "raw_tcp_s": _med(report["two"]["raw_tcp_s"]),
                    "ratio_raw_tcp": restore / _med(report["two"]["raw_tcp_s"])}
    memory = report["two"]["memory"]
    load = _med([m["seconds"] for m in memory])
    s["memory"] = {"seconds": load, "memcpy_fresh_s": _med([m["memcpy_fresh_s"] for m in memory]),
                   "memcpy_prealloc_s": _med([m["memcpy_prealloc_s"] for m in memory])}
    s["memory"]["speed_vs_fresh"] = s["memory"]["memcpy_fresh_s"] / load
    s["memory"]["speed_vs_prealloc"] = s["memory"]["memcpy_prealloc_s"] / load
    disk = report["two"]["disk"]
    s["disk"] = {"seconds": _med([d["seconds"] for d in disk]),
                 "raw_read_s": _med([d["raw_read_s"] for d in disk])}
    s["disk"]["speed_vs_raw"] = s["disk"]["raw_read_s"] / s["disk"]["seconds"]
    return s


def render(report: dict) -> str:
    s = report["summary"] = summarize(report)
    part = report["two"]["part_bytes"]
    gb = lambda nbytes, seconds: f"{nbytes / seconds / 1e9:.2f}"
    cpu = report["cpu"]
    lines = [
        "# ckptd local checkpoints across separate nodes: replication, restore, memory tier", "",
        f"Measured {report['date']} by `{report['command']}`, one run. Bed: "
        f"`tests/netbed.py` network namespaces ({report['bed_mode']}: {report['bed_reason']}), "
        f"each node its own tmpfs, veth links through a bridge with `tc tbf rate "
        f"{report['rate']}` on both ends; one `ckptd serve` per node (`--peer-listen "
        f"tcp://0.0.0.0:PORT`, 2 writers, bulk protection {report['protection']}, "
        f"{report['streams']} bulk connections per peer) and one rank per node (gloo inside the "
        f"node). Part: {part / MiB:.0f} MiB per rank (the `workload.py` mix); medians of "
        f"{report['repeats']} runs; GB/s = 10⁹ bytes/s. Link rate for the ratios: the tbf rate, "
        f"{report['link_bytes_per_s'] / 1e9:.3f} GB/s (plain Python tcp between two nodes "
        f"measured {gb(part, s['restore']['raw_tcp_s'])} GB/s).", "",
        f"Machine: {os.cpu_count()} cores shared by every node, daemon and rank. Load average "
        f"at start {report['load_start']}, at end {report['load_end']}. Before starting, the "
        f"run waited for other tests/benchmarks: {len(report['waited_for'])} seen "
        f"({'; '.join(w[:80] for w in report['waited_for'][:4]) or 'none'}). During the "
        f"{cpu['seconds']:.0f} s of the run (of {cpu['seconds'] * os.cpu_count():.0f} "
        f"core-seconds) processes used {cpu['all_processes_cpu_s']:.0f} CPU s, this benchmark "
        f"(its nodes, daemons, ranks) {cpu['this_benchmark_cpu_s']:.0f}, other processes "
        f"{cpu['others_cpu_s']:.0f}; interrupts {cpu['interrupts_s']:.0f} s, steal "
        f"{cpu['steal_s']:.0f} s. Largest other users: "
        f"{', '.join(f'`{c}` {t} s' for c, t in cpu['top_others']) or 'none'}.", "",
        "## Time to durable against the limits", "",
        "| bed | replication factor | durable s (slowest rank) | bound s = max(local write, bytes / link) | ratio | target |",
        "|---|---|---|---|---|---|"]
    for key, bed, factor, target in (("f1_two", "2 nodes", 1, ""), ("f2_two", "2 nodes", 2, "≤ 1.15"),
                                     ("f1_three", "3 nodes", 1, ""), ("f3_three", "3 nodes", 3, "")):
        row = s[key]
        ratio = "– (the local write is the bound)" if factor == 1 else f"**{row['ratio']:.2f}×**"
        lines.append(f"| {bed} | {factor} | {row['durable_s']:.3f} | {row['bound_s']:.3f} | "
                     f"{ratio} | {target} |")
    runs = {bed: {k: [(round(b, 3), round(d, 3)) for b, d in v] for k, v in report[bed]["runs"].items()}
            for bed in ("two", "three")}
    lines += ["", f"Runs (blocking s, durable s): {json.dumps(runs)}. Save reports (last): "
                  f"{json.dumps(report['two']['reports'])}; {json.dumps(report['three']['reports'])}.",
              "", "## Restore and loads", "",
              "| what | seconds (median) | GB/s | against | ratio | target |", "|---|---|---|---|---|---|",
              f"| restore of a lost part: rank 1's `load()` after node 1 lost daemon and disk "
              f"(fetch from node 0, checksummed and written once, read once) | "
              f"{s['restore']['seconds']:.3f} | {gb(part, s['restore']['seconds'])} | part / link "
              f"= {s['restore']['link_s']:.3f} s | **{s['restore']['ratio']:.2f}×** "
              f"(vs measured raw tcp {s['restore']['ratio_raw_tcp']:.2f}×) | ≤ 1.25 |",
              f"| load from the daemon's memory (restarted trainer, daemon alive; copy checked "
              f"against the writer's crc32) | {s['memory']['seconds']:.3f} | "
              f"{gb(part, s['memory']['seconds'])} | memcpy into a fresh buffer "
              f"{s['memory']['memcpy_fresh_s']:.3f} s | **{s['memory']['speed_vs_fresh']:.2f}× "
              f"memcpy speed** ({s['memory']['speed_vs_prealloc']:.2f}× of memcpy into a "
              f"preallocated buffer, {s['memory']['memcpy_prealloc_s']:.3f} s) | ≥ 0.5 |",
              f"| load from local disk (daemon restarted; the part it verified is read once, not "
              f"checksummed again) | {s['disk']['seconds']:.3f} | {gb(part, s['disk']['seconds'])} "
              f"| raw read of the same file into a fresh buffer {s['disk']['raw_read_s']:.3f} s | "
              f"**{s['disk']['speed_vs_raw']:.2f}× raw read speed** | ≥ 0.8 |", "",
              f"Load reports: restore {json.dumps([r['report'] for r in report['two']['restore']])}; "
              f"memory {json.dumps([m['report']['source'] for m in report['two']['memory']])}; "
              f"disk {json.dumps([d['report']['source'] for d in report['two']['disk']])}.", "",
              "## Bulk protection on loopback", "",
              f"{report['loopback_bytes'] / MiB:.0f} MiB in 4 MiB chunks over 127.0.0.1, sender "
              "(this process, one thread per connection) and receiver (another process) on the "
              f"same {os.cpu_count()} cores; the bulk channel as the daemons use it (handshake, sealed frames).", "",
              "| protection | connections | GB/s (median) | × plain tcp | runs (s) |", "|---|---|---|---|---|"]
    lb = report["loopback"]
    for streams in report["loopback_streams"]:
        tcp = _med(lb[f"tcp/{streams}"])
        for name in ("tcp", "aes-256-gcm", "none"):
            times = lb[f"{name}/{streams}"]
            label = {"tcp": "plain tcp (no protection)", "aes-256-gcm": "aes-256-gcm (default)",
                     "none": "none: GMAC, authenticated, not encrypted"}[name]
            lines.append(f"| {label} | {streams} | {gb(report['loopback_bytes'], _med(times))} | "
                         f"{tcp / _med(times):.2f} | {[round(t, 3) for t in times]} |")
    return "\n".join(lines) + "\n"


# ================================================================ main

def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the with blocks that tear beds down


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part-mib", type=int, default=256, help="part size per rank (MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", default="2gbit", help="tc tbf rate of every link")
    p.add_argument("--loopback-mib", type=int, default=512)
    p.add_argument("--wait-quiet", type=float, default=3600.0,
                   help="seconds to wait at most for other tests/benchmarks to finish")
    p.add_argument("--out", default=None, help="Markdown report (and .json beside)")
    args = p.parse_args(argv)
    from netbed import parse_rate

    from ckptd import knobs

    waited = wait_until_quiet(args.wait_quiet)
    part = args.part_mib * MiB
    pool = 3 * part + 64 * MiB
    report: dict = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
        "load_start": loadavg(), "waited_for": waited, "rate": args.rate,
        "link_bytes_per_s": parse_rate(args.rate) / 8, "repeats": args.repeats,
        "protection": knobs.PEER_ENCRYPTION.get(), "streams": knobs.PEER_STREAMS.get()}
    opts = {"part_bytes": part, "repeats": args.repeats}
    before = cpu_snapshot()
    with tempfile.TemporaryDirectory(prefix="bench-local-") as workdir:
        mode, reason, report["two"] = with_nodes(
            2, args.rate, os.path.join(workdir, "two"), pool, f"{2 * 4 * args.part_mib + 512}m",
            lambda nodes: bed_two(nodes, opts))
        report["bed_mode"], report["bed_reason"] = mode, reason
        _, _, report["three"] = with_nodes(
            3, args.rate, os.path.join(workdir, "three"), pool, f"{2 * 4 * args.part_mib + 512}m",
            lambda nodes: bed_three(nodes, opts))
    print("loopback ...", flush=True)
    nbytes = args.loopback_mib * MiB
    report["loopback_bytes"], report["loopback_streams"] = nbytes, [1, 4]
    report["loopback"] = {f"{name}/{streams}": [loopback(name, streams, nbytes)
                                                for _ in range(args.repeats)]
                          for streams in (1, 4) for name in ("tcp", "aes-256-gcm", "none")}
    report["cpu"] = other_cpu(before, cpu_snapshot())
    report["load_end"] = loadavg()
    text = render(report)
    print(text)
    write_report(args.out, text, report)
    return 0


def loads_main(argv: list[str]) -> int:
    """``bench_local.py loads``: the memory tier against local disk (``local_loads.py``);
    its section of ``--out`` is replaced, the rest of the file kept."""
    import local_loads

    p = argparse.ArgumentParser(prog="bench_local.py loads",
                                description=local_loads.__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="48,256,1024", help="part sizes per rank (MiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="loads of each kind per round")
    p.add_argument("--workdir", default=None, help="scratch parent (default: $TMPDIR)")
    p.add_argument("--out", default=None, help="Markdown report to put the section in")
    args = p.parse_args(argv)
    report = local_loads.run([int(s) for s in args.sizes.split(",")], args.rounds,
                             args.repeats, args.workdir)
    report["command"] = "python " + " ".join([os.path.relpath(__file__), "loads", *argv])
    text = local_loads.render(report)
    print(text)
    if args.out:
        write_section(args.out, text, "loads")
        with open(os.path.splitext(args.out)[0] + "_loads.json", "w") as f:
            json.dump(report, f, indent=1)
    return 0


def write_section(out: str, text: str, name: str) -> None:
    """Put ``text`` between this section's markers in ``out`` (appended the first time)."""
    begin, end = f"<!-- section {name} -->", f"<!-- end section {name} -->"
    old = open(out).read() if os.path.exists(out) else ""
    block = f"{begin}\n{text}{end}\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end) + 1:]
    else:
        new = old + ("\n" if old and not old.endswith("\n\n") else "") + block
    with open(out, "w") as f:
        f.write(new)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "loads":
        sys.exit(loads_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--loopback-receiver":
        port, protection, streams, per_stream, *keys = sys.argv[2:]
        _loopback_receive(int(port), protection, int(streams), int(per_stream), keys)
        sys.exit(0)
    sys.exit(main())
