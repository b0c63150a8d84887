"""Replication in a 4-node bed, factor 2: time to durable against the link bound, and the
CPU-seconds per GB it costs the sending and the receiving daemon, on rate-limited and on
unlimited links, in one run (the write path's cost where replication runs).

The bed is ``tests/netbed.py`` (a network namespace and a tmpfs per node, veth links
through a bridge) with a real ``ckptd serve`` per node and one trainer rank per node
(``tests/bednodes.py``, gloo across the bed). Factor 2 with jump 1 makes two cliques,
nodes {0, 1} and {2, 3}: every node sends its part to its peer and receives the peer's,
both pairs at once. For each link setting (``--rates``; ``unlimited`` removes the tbf),
the links are set on the same bed and daemons, then:

1. **The bound**: plain Python tcp moving one part's bytes along the same pairs, both
   directions of both pairs at once (connected first, then started together), slowest
   sender; ``--repeats`` times before the saves and as many after, so the bound sees the
   same contention the saves do and its spread is shown. Beside it, for a tbf rate, the
   nominal part / rate.
2. **Saves** through ``LocalCheckpointManager`` (``save(..., is_async=True)`` then
   ``maybe_finalize_async_calls(blocking=True)``, slowest rank), four sessions in turn,
   round after round (the first :data:`WARMUP_ROUNDS` are not counted: with one
   warm-up round, the first counted one still took up to four times as long): ``f1``
   (factor 1, every rank a part of ``--part-mib``: the local write alone), ``f2`` (factor 2, every rank a part),
   ``half`` (factor 2; ranks 0 and 2 a part, ranks 1 and 3 1 MiB: nodes 0 and 2 only send,
   nodes 1 and 3 only receive) and ``tiny`` (factor 2, every rank 1 MiB: a save's fixed
   cost). Rank 0 reads each daemon's CPU (user + system of the daemon and its writers,
   every thread, ``/proc``) right before and after each save.

Reported: f2's durable time against max(f1's, the bound) as the ratio of the medians,
with the bound's spread; CPU-seconds per GB of a part: **sender** = (half - tiny) on
nodes 0 and 2 (staging, local write and sending, as ``bench_write_path.py
--replication`` defines it), of which **sending** = (half - f1) on nodes 0 and 2,
**receiver** = (half - tiny) on nodes 1 and 3 (receiving, checking, writing the replica),
and per node in the symmetric f2 save, (f2 - f1) (sending one part and receiving one).

Usage (as root, for namespaces; under ``/work/bin/texcl`` on the shared machine)::

    python benchmarks/bench_replication.py --part-mib 256 --repeats 3 \\
        --rates 2gbit,unlimited --out benchmarks/RESULTS_REPLICATION.md

``--label`` names the code measured (e.g. a commit), for before/after runs of the same
script on two trees: each run replaces its label's section of ``--out`` (and its entry in
the ``.json`` beside), the rest of the file is kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from bench_local import (_RAW_RECEIVER, _exit_on_signal, cpu_snapshot,  # noqa: E402
                         other_cpu, wait_until_quiet, write_section)
from procmem import loadavg, parent_map, tree  # noqa: E402

MiB = 1 << 20
GB = 1e9
NODES = 4
TINY = MiB
#: name -> (factor, ranks that save a whole part; the others save TINY bytes)
SESSIONS = {"f1": (1, (0, 1, 2, 3)), "f2": (2, (0, 1, 2, 3)), "half": (2, (0, 2)),
            "tiny": (2, ())}
SENDERS, RECEIVERS = (0, 2), (1, 3)
_TICK = os.sysconf("SC_CLK_TCK")
#: Rounds of saves not counted.
WARMUP_ROUNDS = 2


# ================================================================ rank functions

def daemon_cpu(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each daemon and its live descendants (its writers)."""
    parents = parent_map()
    out = []
    for pid in pids:
        total = 0
        for member in tree(pid, parents):
            try:
                with open(f"/proc/{member}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError):
                pass  # a process that ended between the listing and the read
        out.append(total / _TICK)
    return out


def save_rounds(rank: int, world: int, roots: list, label: str, part_bytes: int,
                repeats: int, daemon_pids: list[int]) -> dict:
    """Every session of :data:`SESSIONS` in turn, ``repeats`` + :data:`WARMUP_ROUNDS`
    rounds; rank 0 returns each save's slowest durable time and each daemon's CPU."""
    import torch
    import torch.distributed as dist

    import workload
    from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict,
                             CliqueReplicationStrategy, LocalCheckpointManager)

    states = {size: workload.build_state_dict(size, seed=rank) for size in (part_bytes, TINY)}
    managers = {}
    for name, (factor, _) in SESSIONS.items():
        strategy = (CliqueReplicationStrategy.from_replication_params(1, factor)
                    if factor > 1 else None)
        managers[name] = LocalCheckpointManager(roots[rank], session_id=f"{name}-{label}",
                                                repl_strategy=strategy)
    queue = AsyncCallsQueue()
    runs: dict = {name: [] for name in SESSIONS}
    sizes: dict = {}
    for iteration in range(repeats + WARMUP_ROUNDS):
        for name, manager in managers.items():
            state, mix = states[part_bytes if rank in SESSIONS[name][1] else TINY]
            dist.barrier()
            before = daemon_cpu(daemon_pids) if rank == 0 else []
            dist.barrier()
            t0 = time.perf_counter()
            request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            seconds = time.perf_counter() - t0
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rank == 0:
                cpu = [a - b for a, b in zip(daemon_cpu(daemon_pids), before)]
            nbytes = torch.tensor([mix.total_bytes], dtype=torch.float64)
            gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(gathered, nbytes)
            sizes[name] = [int(t.item()) for t in gathered]
            if iteration >= WARMUP_ROUNDS and rank == 0:
                runs[name].append({"durable_s": float(slowest.item()), "cpu_s": cpu,
                                   "report": manager.last_save_report})
    queue.close()
    return {"runs": runs, "bytes": sizes}


# ================================================================ the bound

# bench_local's sender, except that it connects first and starts when told (the four at once)
_RAW_SENDER = r"""
import socket, sys, time
total, chunk = int(sys.argv[3]), memoryview(bytearray(4 << 20))
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
sys.stdin.readline()
t0, sent = time.perf_counter(), 0
while sent < total:
    conn.sendall(chunk[:min(len(chunk), total - sent)])
    sent += min(len(chunk), total - sent)
conn.recv(1)
print(time.perf_counter() - t0, flush=True)
"""


def pair_tcp(bed, nbytes: int) -> float:
    """Seconds plain tcp takes to move ``nbytes`` along every clique pair, both ways at
    once (the slowest of the four senders)."""
    peers = {0: 1, 1: 0, 2: 3, 3: 2}
    receivers, senders = [], []
    try:
        for node, peer in peers.items():  # node receives from peer
            port = bed.free_port(node)
            proc = bed.popen(node, [sys.executable, "-c", _RAW_RECEIVER, bed.nodes[node].ip,
                                    str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"raw tcp receiver on node {node} did not start")
            receivers.append(proc)
            senders.append(bed.popen(peer, [sys.executable, "-c", _RAW_SENDER,
                                            bed.nodes[node].ip, str(port), str(nbytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for sender in senders:
            if sender.stdout.readline().strip() != "connected":
                raise RuntimeError("raw tcp sender did not connect")
        for sender in senders:
            sender.stdin.write("go\n")
            sender.stdin.flush()
        measured = max(float(sender.stdout.readline()) for sender in senders)
    except BaseException:  # senders may wait for "go" forever: end them at once
        for proc in senders + receivers:
            proc.kill()
        raise
    finally:
        for proc in senders + receivers:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return measured


# ================================================================ one link setting

def measure_rate(nodes, rate: str | None, label: str, part_bytes: int, repeats: int) -> dict:
    """Set every link to ``rate`` (None: unlimited), then the bound and the saves."""
    from bednodes import values

    import bench_replication as this  # the ranks import this module by that name

    bed = nodes.bed
    for i in range(NODES):
        bed.set_rate(i, rate)
    name = rate or "unlimited"
    print(f"{name}: bound ...", flush=True)
    bound = [pair_tcp(bed, part_bytes) for _ in range(repeats)]
    print(f"{name}: saves ...", flush=True)
    roots = [nodes.root(i) for i in range(NODES)]
    pids = [proc.pid for proc in nodes.procs]
    saved = values(nodes.run_ranks(this.save_rounds, list(range(NODES)), timeout=1800,
                                   name=f"save-{name}",
                                   args=(roots, f"{label}-{name}", part_bytes, repeats, pids)))
    print(f"{name}: bound again ...", flush=True)
    bound += [pair_tcp(bed, part_bytes) for _ in range(repeats)]
    return {"rate": rate, "bound_s": bound, "daemon_pids": pids, **saved[0]}


# ================================================================ report

def _spread(values: list[float], digits: int = 3) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}–{max(values):.{digits}f})")


def summarize(result: dict, link_bytes_per_s: float | None) -> dict:
    """The ratios and CPU per GB of one link setting, from its raw figures."""
    med = statistics.median
    runs, sizes = result["runs"], result["bytes"]
    durable = {name: [r["durable_s"] for r in runs[name]] for name in SESSIONS}
    bound = med(result["bound_s"])
    local = med(durable["f1"])
    part = sizes["f2"][0]
    out = {"durable": durable, "bound_s": bound, "local_s": local,
           "ratio_bound": med(durable["f2"]) / max(local, bound),
           "ratio_local": med(durable["f2"]) / local}
    if link_bytes_per_s:
        nominal = part / link_bytes_per_s
        out["nominal_s"] = nominal
        out["ratio_nominal"] = med(durable["f2"]) / max(local, nominal)

    def per_gb(session: str, minus: str, who: tuple) -> list[float]:
        values = []
        for run, base in zip(runs[session], runs[minus]):
            for node in who:
                extra = sizes[session][node] - sizes[minus][node]
                values.append((run["cpu_s"][node] - base["cpu_s"][node]) / (extra / GB))
        return values

    def peer(node: int) -> int:
        return node ^ 1  # the clique peer whose part a node receives

    out["sender"] = per_gb("half", "tiny", SENDERS)
    out["sending"] = [(run["cpu_s"][n] - base["cpu_s"][n]) / (sizes["half"][n] / GB)
                      for run, base in zip(runs["half"], runs["f1"]) for n in SENDERS]
    out["receiver"] = [(run["cpu_s"][n] - base["cpu_s"][n])
                       / ((sizes["half"][peer(n)] - sizes["tiny"][peer(n)]) / GB)
                       for run, base in zip(runs["half"], runs["tiny"]) for n in RECEIVERS]
    out["both"] = [(run["cpu_s"][n] - base["cpu_s"][n]) / (sizes["f2"][n] / GB)
                   for run, base in zip(runs["f2"], runs["f1"]) for n in range(NODES)]
    out["fixed"] = [c for run in runs["tiny"] for c in run["cpu_s"]]
    return out


def render(report: dict) -> str:
    from netbed import parse_rate

    cpu = report["cpu"]
    part = report["part_bytes"]
    lines = [
        f"### {report['label']}: {report['date']}", "",
        f"`{report['command']}` (code: {report['label']}). Bed: `tests/netbed.py`, "
        f"{NODES} network namespaces ({report['bed_mode']}), each its own tmpfs, veth links "
        f"through a bridge, `tc tbf` (burst 4 ms, latency 50 ms) on both ends of every link "
        f"where a rate is given; one `ckptd serve` per node (2 writers, bulk protection "
        f"{report['protection']}, {report['streams']} bulk connections per peer), one rank "
        f"per node; factor 2, jump 1 (cliques {{0, 1}} and {{2, 3}}). Part "
        f"{part / MiB:.0f} MiB per rank (the `workload.py` mix); medians of "
        f"{report['repeats']} rounds, min–max in brackets. Machine: {os.cpu_count()} cores "
        f"shared by every node; load average at start {report['load_start']}, at end "
        f"{report['load_end']}; during the {cpu['seconds']:.0f} s of the run this benchmark "
        f"used {cpu['this_benchmark_cpu_s']:.0f} CPU s, other processes "
        f"{cpu['others_cpu_s']:.0f} ({', '.join(f'`{c[:60]}` {t} s' for c, t in cpu['top_others'][:3]) or 'none'}).",
        "",
        "| links | bound: raw tcp, both pairs both ways at once, s | part / rate s | "
        "f1 durable s (local write) | f2 durable s | **f2 ÷ max(f1, bound)** | "
        "f2 ÷ max(f1, part / rate) |",
        "|---|---|---|---|---|---|---|"]
    summaries = {}
    for result in report["rates"]:
        rate = result["rate"]
        s = summaries[rate or "unlimited"] = summarize(
            result, parse_rate(rate) / 8 if rate else None)
        nominal = f"{s['nominal_s']:.3f}" if rate else "–"
        ratio_nominal = f"{s['ratio_nominal']:.2f}×" if rate else "–"
        lines.append(f"| {rate or 'unlimited'} | {_spread(result['bound_s'])} | {nominal} | "
                     f"{_spread(s['durable']['f1'])} | {_spread(s['durable']['f2'])} | "
                     f"**{s['ratio_bound']:.2f}×** | {ratio_nominal} |")
    lines += ["", "| links | sender CPU-s per GB (stage, local write, send) | of which sending "
              "| receiver CPU-s per GB (receive, check, write) | per node in the f2 save "
              "(send one part, receive one) | CPU-s of a 1 MiB save, per daemon |",
              "|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        lines.append(f"| {name} | {_spread(s['sender'])} | {_spread(s['sending'])} | "
                     f"{_spread(s['receiver'])} | {_spread(s['both'])} | "
                     f"{_spread(s['fixed'], 2)} |")
    durations = {name: {k: [round(v, 3) for v in vals] for k, vals in s["durable"].items()}
                 for name, s in summaries.items()}
    bounds = {(r["rate"] or "unlimited"): [round(b, 3) for b in r["bound_s"]]
              for r in report["rates"]}
    reports = {(r["rate"] or "unlimited"): r["runs"]["f2"][-1]["report"] for r in report["rates"]}
    lines += ["", f"Durable s per session: {json.dumps(durations)}. Bounds s (before the "
                  f"saves, then after): {json.dumps(bounds)}. Last f2 save reports: "
                  f"{json.dumps(reports)}.", ""]
    report["summary"] = summaries
    return "\n".join(lines)


# ================================================================ main

def main(argv: list[str] | None = None) -> int:
    # SystemExit on SIGTERM/SIGINT unwinds through the with block that tears the bed down
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="2gbit,unlimited",
                   help="link settings in turn: tc rates, or 'unlimited'")
    p.add_argument("--part-mib", type=int, default=256, help="part size per rank (MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--label", default="this tree", help="names the code measured")
    p.add_argument("--wait-quiet", type=float, default=120.0,
                   help="seconds to wait at most for other tests/benchmarks to finish")
    p.add_argument("--out", default=None,
                   help="Markdown report: this run's section (named by --label) is replaced "
                        "or appended, the rest kept; its figures go under the label in the "
                        ".json beside")
    args = p.parse_args(argv)
    from bednodes import BedNodes
    from netbed import NetBed

    from ckptd import knobs

    waited = wait_until_quiet(args.wait_quiet)
    part = args.part_mib * MiB
    report: dict = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
        "label": args.label, "load_start": loadavg(), "waited_for": waited,
        "repeats": args.repeats, "part_bytes": part, "rates": [],
        "protection": knobs.PEER_ENCRYPTION.get(), "streams": knobs.PEER_STREAMS.get()}
    before = cpu_snapshot()
    rates = [None if r == "unlimited" else r for r in args.rates.split(",")]
    session = re.sub(r"[^A-Za-z0-9]+", "-", args.label).strip("-") or "run"
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as workdir, \
            NetBed(NODES, None, f"{12 * args.part_mib + 512}m", mode="netns") as bed:
        report["bed_mode"] = bed.mode
        nodes = BedNodes(bed, workdir, pool_size=f"{3 * args.part_mib + 64}M",
                         env={"CKPTD_PEER_TIMEOUT": "60"})
        try:
            for rate in rates:
                report["rates"].append(measure_rate(nodes, rate, session, part, args.repeats))
        finally:
            nodes.stop_all()
    report["cpu"] = other_cpu(before, cpu_snapshot())
    report["load_end"] = loadavg()
    text = render(report)
    print(text)
    if args.out:
        write_section(args.out, text, session)
        figures = os.path.splitext(args.out)[0] + ".json"
        runs = json.load(open(figures)) if os.path.exists(figures) else {}
        runs[args.label] = report
        with open(figures, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
