"""What one daemon costs as the job grows: 2 to 32 network-namespace nodes, the former
all-to-all mesh (``CKPTD_PEER_LINKS=all``) against clique links (the default), in one run.

Nodes are the namespaces of ``tests/netbed.py`` (own tmpfs, ``tc tbf`` at ``--rate`` on
every link), each with a real ``ckptd serve`` (32 MiB pool, one writer) and one small rank
(``tests/scalebed.py``: factor 2, jump 1, parts of about 1 MiB). For each size and mode:

1. every rank runs find_latest and one asynchronous save, finalized (reported without a
   target: call to staged, call to finalized, i.e. durable, replicated and committed on
   every rank; and the median one-integer gloo all-reduce, the agreement's collective);
2. once the ranks are gone and each daemon's links are up, an idle window of
   ``--idle`` seconds: per daemon, sockets, threads, RSS and PSS (``/proc``), the number of
   peer links (its status), and the packets and bytes its node's interface moved (only the
   daemon runs in the node then: that is its background traffic, heartbeats included);
3. with clique links, node 1's daemon is SIGKILLed and its tmpfs wiped, started again,
   and every rank loads: the restore time is the slowest load of a rank of node 1 (its
   part comes from a clique mate, as it does with the mesh).

Also, once: the time to open a CURVE control link to a daemon and get a heartbeat answer
(dial, CURVE handshake, ZAP check, one round trip), from another node, median of 20.

The counts (sockets, threads, links, packets) mean the same on 2 shared cores as on a
cluster; the timings do not (every process of the bed shares them), so they carry no
target. Run it alone (``/work/bin/texcl``), as root::

    python benchmarks/bench_scale.py --sizes 2,4,8,16,32 --out benchmarks/RESULTS_SCALE.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path[:0] = [HERE, TESTS, os.path.join(TESTS, "integration")]

from report import write_report  # noqa: E402

FACTOR, JUMP = 2, 1
MODES = ("all", "clique")
LOST = 1

# Inside a node: dial a daemon's control socket with a key its table names, time the
# first heartbeat answer (connect, CURVE handshake, ZAP, one round trip).
LINK_PROBE = r"""
import json, sys, time, statistics, zmq
sys.path.insert(0, sys.argv[1])
from ckptd import protocol
from ckptd.replication.wire import PeerPing
info, public, secret, repeats = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
context = zmq.Context()
times = []
for _ in range(repeats):
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_serverkey = info["public_key"].encode()
    sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
    start = time.monotonic()
    sock.connect(info["address"])
    sock.send_multipart(protocol.encode(PeerPing.message_type, 0, PeerPing(1.0).to_wire()))
    if not sock.poll(10000):
        raise SystemExit("no answer within 10 s")
    sock.recv_multipart()
    times.append(time.monotonic() - start)
    sock.close()
print(json.dumps({"median_s": statistics.median(times), "min_s": min(times),
                  "max_s": max(times)}))
"""


def interface_counters(bed, i: int) -> dict:
    """rx/tx bytes and packets of node ``i``'s interface (read inside its namespace)."""
    node = bed.nodes[i]
    names = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")
    out = bed.run(i, ["cat", *[f"/sys/class/net/{node.ifname}/statistics/{n}" for n in names]])
    return dict(zip(names, map(int, out.stdout.split())))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def run_mode(bed, count: int, mode: str, workdir: str, idle: float) -> dict:
    from bednodes import BedNodes, values
    from scalebed import SMALL, clique_nodes, daemon_cost, layout, load_timed, save_timed

    env = {"CKPTD_PEER_LINKS": mode, "CKPTD_PEER_TIMEOUT": "30"}
    nodes = BedNodes(bed, workdir, env=env, pool_size="32M", writers=1)
    try:
        placement = layout(count, FACTOR, JUMP)
        roots = [nodes.root(n) for n in placement]
        before = [interface_counters(bed, i) for i in range(count)]
        saved = values(nodes.run_ranks(save_timed, placement,
                                       args=(roots, JUMP, FACTOR, 1, SMALL), name="save",
                                       timeout=900))
        after_save = [interface_counters(bed, i) for i in range(count)]
        mates = clique_nodes(placement, FACTOR, JUMP)
        want = [count - 1 if mode == "all" else len(mates[i]) for i in range(count)]
        for i in range(count):
            wait_for(lambda: sum(p["health"] == "up" for p in nodes.status(i)["peers"])
                     == want[i], 120, f"node {i}'s {want[i]} links up")
        start = [interface_counters(bed, i) for i in range(count)]
        t0 = time.monotonic()
        time.sleep(idle)  # the measurement window itself, not a wait for a condition
        elapsed = time.monotonic() - t0
        end = [interface_counters(bed, i) for i in range(count)]
        costs = [daemon_cost(nodes.procs[i].pid) for i in range(count)]
        links = [len(nodes.status(i)["peers"]) for i in range(count)]
        per_daemon = []
        for i in range(count):
            moved = {k: end[i][k] - start[i][k] for k in end[i]}
            save_moved = {k: after_save[i][k] - before[i][k] for k in before[i]}
            per_daemon.append({
                **costs[i], "links": links[i],
                "idle_bytes_per_s": (moved["rx_bytes"] + moved["tx_bytes"]) / elapsed,
                "idle_packets_per_s": (moved["rx_packets"] + moved["tx_packets"]) / elapsed,
                "save_tx_bytes": save_moved["tx_bytes"],
                "save_tx_packets": save_moved["tx_packets"]})
        restore = None
        if mode == "clique":  # which links stay open does not change a fetch from a mate
            nodes.restart(LOST, wipe=True)
            loaded = values(nodes.run_ranks(load_timed, placement,
                                            args=(roots, JUMP, FACTOR, SMALL), name="load",
                                            timeout=900))
            restore = max(o["seconds"] for r, o in enumerate(loaded) if placement[r] == LOST)
            assert all(o["report"]["source"] == "peer" for r, o in enumerate(loaded)
                       if placement[r] == LOST)
        return {"nodes": count, "mode": mode, "ranks": len(placement),
                "per_daemon": per_daemon, "idle_seconds": elapsed,
                "staged_s": max(o["staged_s"] for o in saved),
                "finalize_s": max(o["finalize_s"] for o in saved),
                "collective_s": statistics.median(o["collective_s"] for o in saved),
                "rank_rss": statistics.median(o["rss"] for o in saved),
                "part_bytes": saved[0]["report"].get("bytes"),
                "reduced": sum(o["report"]["reduced_redundancy"] for o in saved),
                "restore_s": restore}
    finally:
        nodes.stop_all()


def link_setup(bed, workdir: str, repeats: int = 20) -> dict:
    """Time to a first heartbeat answer on a fresh CURVE link from node 0 to node 1."""
    import peerclient
    from bednodes import BedNodes

    nodes = BedNodes(bed, workdir, pool_size="32M", writers=1)
    try:
        probe = peerclient.keypair()
        info = peerclient.register_session(nodes.socket(1), "probe", nodes.root(1),
                                           [["tcp://10.0.0.1:1", probe[0], "10.0.0.1:1"]])
        out = bed.run(0, [sys.executable, "-c", LINK_PROBE, os.path.dirname(TESTS),
                          json.dumps(info), probe[0], probe[1], str(repeats)],
                      env={"PYTHONPATH": os.path.dirname(TESTS)}, timeout=300)
        return json.loads(out.stdout)
    finally:
        nodes.stop_all()


def summarize(run: dict) -> dict:
    """Per-daemon medians (and the max) of a size and mode."""
    rows = run["per_daemon"]

    def med(key):
        return statistics.median(r[key] for r in rows)

    return {"nodes": run["nodes"], "mode": run["mode"], "ranks": run["ranks"],
            "links": med("links"), "links_max": max(r["links"] for r in rows),
            "sockets": med("sockets"), "sockets_max": max(r["sockets"] for r in rows),
            "threads": med("threads"), "rss_mib": med("rss") / 2**20,
            "pss_mib": med("pss") / 2**20, "idle_packets_per_s": med("idle_packets_per_s"),
            "idle_bytes_per_s": med("idle_bytes_per_s"),
            "save_tx_kib": med("save_tx_bytes") / 1024,
            "save_tx_packets": med("save_tx_packets"),
            "staged_s": run["staged_s"], "finalize_s": run["finalize_s"],
            "collective_s": run["collective_s"], "restore_s": run["restore_s"],
            "rank_rss_mib": run["rank_rss"] / 2**20, "reduced": run["reduced"]}


def render(report: dict) -> str:
    lines = [
        "# Per-daemon cost from 2 to 32 nodes: all-to-all mesh vs clique links",
        "",
        f"Run {report['date']} on {report['host']} ({os.cpu_count()} cores, shared by every "
        f"daemon and rank of the bed), `benchmarks/bench_scale.py`, links `tc tbf` "
        f"{report['rate']}, factor {FACTOR}, jump {JUMP}, one rank per node, parts of about "
        f"1 MiB, heartbeat every {report['ping_interval']} s, idle window "
        f"{report['idle']:.0f} s. `mesh` is `CKPTD_PEER_LINKS=all` (the behaviour before "
        "clique links), `clique` the default. Per-daemon figures are medians over the "
        "bed's daemons (max in brackets where it differs). Sockets are every socket fd of "
        "the daemon process (peer links, bulk connections, its trainer socket, internal "
        "pipes); RSS and PSS the daemon process alone (its writer is a child); idle "
        "packets and bytes are what the node's interface moved while only the daemon ran "
        "there (heartbeats and their TCP acknowledgements).",
        "",
        "| nodes | links | daemon sockets | threads | RSS MiB | PSS MiB | idle packets/s "
        "| idle bytes/s | save tx KiB | staged s | finalize s | all-reduce ms | restore s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in report["summary"]:
        name = "mesh" if s["mode"] == "all" else "clique"
        links = f"{s['links']:.0f}" + (f" ({s['links_max']})" if s["links_max"] != s["links"]
                                       else "")
        sockets = f"{s['sockets']:.0f}" + (f" ({s['sockets_max']})"
                                           if s["sockets_max"] != s["sockets"] else "")
        lines.append(
            f"| {s['nodes']} {name} | {links} | {sockets} | {s['threads']:.0f} | "
            f"{s['rss_mib']:.1f} | {s['pss_mib']:.1f} | {s['idle_packets_per_s']:.1f} | "
            f"{s['idle_bytes_per_s']:.0f} | {s['save_tx_kib']:.0f} | {s['staged_s']:.2f} | "
            f"{s['finalize_s']:.2f} | {s['collective_s'] * 1000:.1f} | "
            + ("-" if s["restore_s"] is None else f"{s['restore_s']:.2f}") + " |")
    setup = report.get("link_setup")
    if setup:
        lines += ["", f"A fresh CURVE control link from node 0 to node 1's daemon, to its "
                      f"first heartbeat answer: median {setup['median_s'] * 1000:.1f} ms "
                      f"(min {setup['min_s'] * 1000:.1f}, max {setup['max_s'] * 1000:.1f}; "
                      "20 dials)."]
    ranks = [s["rank_rss_mib"] for s in report["summary"]]
    if ranks:
        lines += ["", f"Each rank process (torch, gloo, ckpt_client) had an RSS of "
                      f"{statistics.median(ranks):.0f} MiB (median); most of it is torch's "
                      "shared libraries, which the ranks share in the page cache."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from netbed import NetBed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,8,16,32")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    report = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "host": os.uname().nodename, "rate": args.rate, "idle": args.idle,
              "ping_interval": float(os.environ.get("CKPTD_PEER_PING_INTERVAL", "1.0")),
              "runs": [], "summary": []}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as workdir:
        with NetBed(2, args.rate, "128m", mode="netns") as pair:
            os.makedirs(os.path.join(workdir, "probe"))
            report["link_setup"] = link_setup(pair, os.path.join(workdir, "probe"))
        for count in sizes:
            with NetBed(count, args.rate, "128m", mode="netns") as bed:
                for mode in args.modes.split(","):
                    where = os.path.join(workdir, f"{count}-{mode}")
                    os.makedirs(where)
                    started = time.monotonic()
                    run = run_mode(bed, count, mode, where, args.idle)
                    run["wall_s"] = time.monotonic() - started
                    report["runs"].append(run)
                    report["summary"].append(summarize(run))
                    print(json.dumps(report["summary"][-1]), flush=True)
                    write_report(args.out, render(report), report)  # what a crash leaves
    text = render(report)
    print(text)
    write_report(args.out, text, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
