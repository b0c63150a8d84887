"""Draw a ``ckptd trace`` file as a PNG timeline (the picture in docs/operations.md).

Usage: ``python docs/tools/trace_png.py trace.json out.png``. Needs matplotlib, which is
not a dependency of ckptd: install it wherever you run this (the JSON itself opens in
Perfetto or chrome://tracing without it). Rows and colours follow the trace: one row per
thread of each process, complete events as bars, instant events as ticks.
"""

from __future__ import annotations

import json
import sys

COLOURS = {"staging": "#4c72b0", "write": "#55a868", "fsync": "#c44e52",
           "replication": "#8172b2", "finalize": "#ccb974", "trainer": "#64b5cd",
           "save": "#dddddd"}


def rows_of(events: list[dict]) -> tuple[list, dict]:
    """Row keys in display order (daemon's saves row first, then ranks, then writers and
    peers) and their labels."""
    process = {e["pid"]: e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i")}
    daemon = next(pid for pid, name in process.items() if name.startswith("ckptd"))
    keys = sorted(used, key=lambda k: (k[0] == daemon and k[1] != 0, process.get(k[0], ""), k[1]))
    labels = {k: f"{process.get(k[0], k[0])}: {thread.get(k, k[1])}" for k in keys}
    return keys, labels


def main(source: str, target: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.load(open(source))["traceEvents"]
    keys, labels = rows_of(events)
    start = min(e["ts"] for e in events if e["ph"] in ("X", "i"))
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(keys) + 1.4))
    row = {k: i for i, k in enumerate(keys)}
    complete = [e for e in events if e["ph"] == "X"]
    # longest first, so a span nested in another (planning in the blocked call) is drawn
    # on top of it, thinner
    for event in sorted(events, key=lambda e: -e.get("dur", 0)):
        key = (event.get("pid"), event.get("tid"))
        if key not in row or event["ph"] not in ("X", "i"):
            continue
        y, x = row[key], (event["ts"] - start) / 1000
        if event["ph"] == "X":
            width = event["dur"] / 1000
            nested = any(o is not event and (o["pid"], o["tid"]) == key and o["dur"] > event["dur"]
                         and o["ts"] <= event["ts"]
                         and event["ts"] + event["dur"] <= o["ts"] + o["dur"] for o in complete)
            ax.barh(y + (0.12 if nested else 0), width, left=x, height=0.3 if nested else 0.6,
                    color=COLOURS.get(event["cat"], "#999999"), edgecolor="black",
                    linewidth=0.4)
            text = event["name"].replace(".distcp", "").replace("__", "").split(" in ")[0]
            if event["cat"] == "save":
                text = event["name"]
            if width > 25 or (event["cat"] == "trainer" and width > 10):
                ax.text(x + width / 2, y + (0.12 if nested else -0.12 if event["cat"] == "trainer" else 0), text, ha="center", va="center", fontsize=7,
                        clip_on=True)
        elif event["ph"] == "i":
            ax.plot([x, x], [y - 0.4, y + 0.4], color="black", linewidth=1.5)
            ax.text(x + 2, y + 0.35, event["name"], fontsize=7, va="bottom")
    ax.set_yticks(range(len(keys)), [labels[k] for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the save began (wall clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, COLOURS.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.2),
              fontsize=7, ncol=len(COLOURS), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
