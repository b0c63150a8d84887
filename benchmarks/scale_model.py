"""Project the per-daemon cost and the risk of a lost clique past the bed: 1k and 10k nodes.

Reads the constants ``bench_scale.py`` measured (``benchmarks/RESULTS_SCALE.json``) and
prints the Markdown tables of ``docs/scaling.md``; every assumption is a parameter here
and is named beside the number it drives. Pure arithmetic, nothing is run.

Usage::

    python benchmarks/scale_model.py benchmarks/RESULTS_SCALE.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

#: Assumptions (not measured here); each is printed with the table.
ASSUME = {
    "node_failures_per_hour": 1 / 6000,   # one unplanned loss per node every ~8 months
    "intervals_min": (30, 120),           # checkpoint intervals compared
    "run_days": 30,
    "part_gib": 16,                       # one node's part (all its ranks)
    "link_gbit": (25, 100),               # a node's link rate for the restore
    "detect_s": 3.0,                      # heartbeat miss budget x interval (defaults)
    "hop_latency_s": 10e-6,               # one small message between two nodes
}
SIZES = (1_000, 10_000)


def constants(report: dict) -> dict:
    """The per-link and fixed costs of a daemon, from the largest bed of each mode."""
    biggest = max(s["nodes"] for s in report["summary"])
    mesh = next(s for s in report["summary"] if s["nodes"] == biggest and s["mode"] == "all")
    clique = next(s for s in report["summary"]
                  if s["nodes"] == biggest and s["mode"] == "clique")
    extra_links = mesh["links"] - clique["links"]
    per_link = {key: max(0.0, (mesh[key] - clique[key]) / extra_links)
                for key in ("sockets", "rss_mib", "idle_bytes_per_s", "idle_packets_per_s")}
    sizes = sorted({s["nodes"] for s in report["summary"]})
    collective = {n: statistics.median(s["collective_s"] for s in report["summary"]
                                       if s["nodes"] == n) for n in sizes}
    # a + b N, least squares over the bed's sizes (every rank of the bed shares 2 cores)
    xs = [float(n) for n in sizes]
    ys = [collective[n] for n in sizes]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
             / max(sum((x - mx) ** 2 for x in xs), 1e-12))
    return {"nodes": biggest, "mesh": mesh, "clique": clique, "per_link": per_link,
            "collective": collective, "collective_fit": (my - slope * mx, slope),
            "link_setup_s": report["link_setup"]["median_s"]}


def clique_loss(nodes: int, factor: int, interval_h: float, rate: float, days: float) -> float:
    """P(some clique loses all its nodes within one checkpoint interval, at least once in
    ``days``): failures independent, a lost replica restored by the next save."""
    per_clique = (1 - math.exp(-rate * interval_h)) ** factor
    per_interval = 1 - (1 - per_clique) ** (nodes / factor)
    intervals = days * 24 / interval_h
    return 1 - math.exp(intervals * math.log1p(-per_interval))


def tables(c: dict) -> str:
    pl, clique = c["per_link"], c["clique"]
    a, b = c["collective_fit"]
    rows = ["| figure | mesh, 1k | mesh, 10k | clique, 1k | clique, 10k | rests on |",
            "| --- | --- | --- | --- | --- | --- |"]

    def mesh_at(key, n):
        return clique[key] + pl[key] * ((n - 1) - clique["links"])

    for key, name, fmt in (("links", "peer links per daemon", "{:.0f}"),
                           ("sockets", "sockets per daemon", "{:.0f}"),
                           ("rss_mib", "daemon RSS, MiB", "{:.0f}"),
                           ("idle_bytes_per_s", "idle traffic per daemon, bytes/s", "{:.0f}"),
                           ("idle_packets_per_s", "idle packets per daemon, /s", "{:.0f}")):
        mesh = [(n - 1) if key == "links" else mesh_at(key, n) for n in SIZES]
        flat = clique[key]
        rows.append(f"| {name} | " + " | ".join(fmt.format(v) for v in mesh) + " | "
                    + " | ".join(fmt.format(flat) for _ in SIZES)
                    + (" | mesh: every other daemon; clique: factor - 1 |" if key == "links"
                       else f" | clique: the {c['nodes']}-node bed's value (flat from 2 nodes); "
                            f"mesh: that plus {pl[key]:.3g} per extra link, measured as "
                            f"(mesh - clique) / (31 - 1) links at {c['nodes']} nodes |"))
    rows.append("| job-wide heartbeats, /s | "
                + " | ".join(f"{n * (n - 1) / 1.0:.3g}" for n in SIZES) + " | "
                + " | ".join(f"{n * clique['links']:.3g}" for n in SIZES)
                + " | one ping per link per second, answered; both ends of a pair dial |")
    hop = ASSUME["hop_latency_s"]
    ring = [2 * (n - 1) * hop * 1000 for n in SIZES]
    rows.append("| finalize all-reduce, ms | " + " | ".join(f"{v:.0f}" for v in ring * 2)
                + f" | the same collective either way: a ring of 2(N-1) hops of "
                  f"{hop * 1e6:.0f} us (assumed); on the bed it grew {b * 1000:.2f} ms per "
                  "rank, all ranks sharing 2 cores |")
    out = ["### Per daemon and per job", "", *rows, ""]

    out += ["### From a node loss to its part restored", "",
            "| link | part | detect | dial | transfer | total |", "| --- | --- | --- | --- | --- | --- |"]
    for gbit in ASSUME["link_gbit"]:
        transfer = ASSUME["part_gib"] * 2**30 * 8 / (gbit * 1e9)
        total = ASSUME["detect_s"] + c["link_setup_s"] + transfer
        out.append(f"| {gbit} Gbit/s | {ASSUME['part_gib']} GiB | {ASSUME['detect_s']:.0f} s | "
                   f"{c['link_setup_s'] * 1000:.0f} ms | {transfer:.1f} s | {total:.1f} s |")
    out += ["", "### Probability a whole clique is lost", "",
            "| nodes | factor | interval | per interval | in a "
            f"{ASSUME['run_days']}-day run |", "| --- | --- | --- | --- | --- |"]
    rate = ASSUME["node_failures_per_hour"]
    for n in SIZES:
        for factor in (2, 3):
            for minutes in ASSUME["intervals_min"]:
                hours = minutes / 60
                per = clique_loss(n, factor, hours, rate, hours / 24)
                run = clique_loss(n, factor, hours, rate, ASSUME["run_days"])
                out.append(f"| {n:,} | {factor} | {minutes} min | {per:.2g} | {run:.2g} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        c = constants(json.load(f))
    print(json.dumps({k: v for k, v in c.items() if k not in ("mesh", "clique")}, indent=1,
                     default=str))
    print(tables(c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
