"""``ckptd status``: ask a daemon for its status document and show it.

Exit codes are part of the contract: 0 running, 3 not running, 4 unknown (a socket that
exists but nobody answers sensibly). Must start fast: no torch import on this path.
"""

from __future__ import annotations

import json
import os
import time

from ckptd import protocol

EXIT_RUNNING = 0
EXIT_NOT_RUNNING = 3
EXIT_UNKNOWN = 4


def query_status(socket_path: str, timeout: float = 3.0) -> tuple[int, dict | None, str]:
    """Ask the daemon at ``socket_path`` for its status.

    Returns
    -------
    (exit code, status document or None, explanation)
    """
    if not os.path.exists(socket_path):
        return EXIT_NOT_RUNNING, None, f"no daemon: {socket_path} does not exist"
    if not protocol.socket_is_live(socket_path):
        return EXIT_NOT_RUNNING, None, f"no daemon: {socket_path} is a stale socket (nobody listens)"
    channel = protocol.Channel(protocol.endpoint_for(socket_path))
    try:
        reply = channel.call(protocol.MessageType.STATUS, timeout=timeout)
    except protocol.ReplyTimeout:
        return EXIT_UNKNOWN, None, f"{socket_path} accepts connections but sent no status in {timeout:.0f}s"
    except (protocol.ErrorReply, protocol.ProtocolError) as exc:
        return EXIT_UNKNOWN, None, f"{socket_path} answered with an error: {exc}"
    finally:
        channel.close()
    return EXIT_RUNNING, reply.body, "running"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    return [line(headers)] + [line(r) for r in cells]


def health_line(doc: dict) -> str:
    """One line for scripts: state, ranks, in-flight saves, pool use, failures."""
    active = [r for r in doc["requests"] if r["phase"] not in protocol.Phase.FINISHED]
    pool = doc["pool"]
    return (f"ckptd {doc['state']} pid={doc['pid']} ranks={len(doc['ranks'])} "
            f"in_flight={len(active)} pool={pool['used_bytes'] * 100 // max(pool['size_bytes'], 1)}% "
            f"done={doc['totals']['saves_done']} failed={doc['totals']['saves_failed']}")


def render(doc: dict) -> str:
    """The human-readable status table."""
    pool = doc["pool"]
    lines = [
        f"ckptd {doc['version']} on {doc['host']}  pid {doc['pid']}  {doc['state']}  "
        f"up {doc['uptime_s']:.0f}s",
        f"socket  {doc['socket']}",
        f"roots   {', '.join(doc['roots'])}",
        f"pool    {_size(pool['used_bytes'])} used of {_size(pool['size_bytes'])}"
        f"{'  (pinned)' if pool['pinned'] else ''}  {pool['waiting_requests']} waiting",
        f"writers {sum(w['alive'] for w in doc['writers'])}/{len(doc['writers'])} alive, "
        f"{sum(w['jobs'] for w in doc['writers'])} job(s) in flight",
        f"totals  {doc['totals']['saves_done']} saves done, {doc['totals']['saves_failed']} failed, "
        f"{_size(doc['totals']['bytes_written'])} written",
        "",
        "RANKS",
    ]
    lines += _table(["rank", "pid", "alive", "in-flight"],
                    [[r["rank"], r["pid"], "yes" if r["alive"] else "NO", r["requests_in_flight"]]
                     for r in doc["ranks"]]) if doc["ranks"] else ["  (none registered)"]
    lines += ["", "REQUESTS"]
    lines += _table(["id", "rank", "format", "phase", "written", "path"],
                    [[r["id"], r["rank"], r["format"], r["phase"],
                      f"{_size(r['bytes_written'])}/{_size(r['bytes_total'])}", r["path"]]
                     for r in doc["requests"]]) if doc["requests"] else ["  (none)"]
    if doc["recent_errors"]:
        lines += ["", "RECENT ERRORS"]
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['time'] or 0))} "
                  f"request {e['request']}: {e['error']}" for e in doc["recent_errors"]]
    return "\n".join(lines)


def to_json(doc: dict) -> str:
    """The ``--json`` output: the status document, keys sorted."""
    return json.dumps(doc, sort_keys=True, indent=2)
