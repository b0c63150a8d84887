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
    return query_daemon(socket_path, protocol.MessageType.STATUS, None, timeout)


def query_daemon(socket_path: str, message_type: str, body: dict | None,
                 timeout: float = 3.0) -> tuple[int, dict | None, str]:
    """Send one request to the daemon at ``socket_path`` (``status``, ``trace``).

    Returns
    -------
    (exit code, reply body or None, explanation)
    """
    what = message_type
    if not os.path.exists(socket_path):
        return EXIT_NOT_RUNNING, None, f"no daemon: {socket_path} does not exist"
    if not protocol.socket_is_live(socket_path):
        return EXIT_NOT_RUNNING, None, f"no daemon: {socket_path} is a stale socket (nobody listens)"
    channel = protocol.Channel(protocol.endpoint_for(socket_path))
    try:
        reply = channel.call(message_type, body, timeout=timeout)
    except protocol.ReplyTimeout:
        return EXIT_UNKNOWN, None, (f"{socket_path} accepts connections but sent no {what} "
                                    f"in {timeout:.0f}s")
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
    """One line for scripts: state, ranks, in-flight saves, pool use, failures.

    When saves failed recently, the line ends with ``last_error="..."`` (the reason of the
    newest failure, JSON-quoted so it stays one line).
    """
    active = in_flight_requests(doc)
    pool = doc["pool"]
    stuck = sum(1 for save in doc.get("saves", []) if save["stuck"])
    line = (f"ckptd {doc['state']} pid={doc['pid']} ranks={len(doc['ranks'])} "
            f"in_flight={len(active)} stuck={stuck} pool={pool['used_bytes'] * 100 // max(pool['size_bytes'], 1)}% "
            f"done={doc['totals']['saves_done']} failed={doc['totals']['saves_failed']}")
    if doc["recent_errors"]:
        line += f" last_error={json.dumps(doc['recent_errors'][-1]['error'])}"
    return line


def in_flight_requests(doc: dict) -> list[dict]:
    """The status document's requests that have not finished."""
    return [r for r in doc["requests"] if r["phase"] not in protocol.Phase.FINISHED]


def daemon_time(doc: dict) -> float:
    """The daemon's clock when it built ``doc`` (unix seconds)."""
    return doc["started_at"] + doc["uptime_s"]


def bytes_written_so_far(doc: dict) -> int:
    """Bytes made durable since the daemon started, in-flight saves' progress included."""
    in_flight = in_flight_requests(doc)
    return doc["totals"]["bytes_written"] + sum(r["bytes_written"] for r in in_flight)


def progress_line(previous: dict | None, doc: dict) -> str:
    """Live progress for ``--watch``: bytes staged and written, and throughput.

    Parameters
    ----------
    previous : dict or None
        The status document of the previous refresh; throughput needs two samples, so
        without one the rates are shown as pending.
    doc : dict
        The current status document.

    Returns
    -------
    str
        One line, e.g. ``progress  2 in flight: 1.0 GiB staged, 0 B waiting to stage;
        written 3.0 GiB since start; write 812.0 MiB/s, stage 1.1 GiB/s``.
    """
    in_flight = in_flight_requests(doc)
    staged = sum(r["bytes_total"] for r in in_flight if r["staged_at"] is not None)
    waiting = sum(r["bytes_total"] for r in in_flight if r["staged_at"] is None)
    line = (f"progress  {len(in_flight)} in flight: {_size(staged)} staged, "
            f"{_size(waiting)} waiting to stage; written {_size(bytes_written_so_far(doc))} "
            f"since start")
    if doc.get("peers"):
        line += f", replicated {_size(bytes_replicated_so_far(doc))}"
    elapsed = daemon_time(doc) - daemon_time(previous) if previous else 0.0
    if previous is None or previous["pid"] != doc["pid"] or elapsed <= 0:
        return line + "; throughput after the next refresh"
    written = max(bytes_written_so_far(doc) - bytes_written_so_far(previous), 0)
    since = daemon_time(previous)
    staged_between = sum(r["bytes_total"] for r in doc["requests"]
                         if r["staged_at"] is not None and r["staged_at"] > since)
    line += f"; write {_size(written / elapsed)}/s, stage {_size(staged_between / elapsed)}/s"
    if doc.get("peers"):
        replicated = max(bytes_replicated_so_far(doc) - bytes_replicated_so_far(previous), 0)
        line += f", replicate {_size(replicated / elapsed)}/s"
    return line


def bytes_replicated_so_far(doc: dict) -> int:
    """Bytes this daemon streamed to its peers since it started (0 without replication)."""
    return sum(int(p.get("bytes_sent", 0)) for p in doc.get("peers", []))


def _pool_pages_line(pool: dict) -> list[str]:
    """Where the pool is and how much of it is on huge pages (none from an older daemon)."""
    if "directory" not in pool:
        return []
    mount = pool["filesystem"] if pool["filesystem"] == "hugetlbfs" else f"tmpfs huge={pool['huge']}"
    pages = (f"{_size(pool['huge_page_bytes'])} on huge pages" if pool["huge_page_bytes"]
             else "4 KiB pages (see --pool-dir in docs/operations.md)")
    return [f"        in {pool['directory']} ({mount}): {pages}"]


def _numa(nodes: list | None) -> str:
    return f"  (NUMA nodes {','.join(map(str, nodes))})" if nodes else ""


def _root_and_mode(root: str, doc: dict) -> str:
    """A root and how its files are written ("not written yet" before the first file)."""
    return f"{root} ({doc.get('write_modes', {}).get(root, 'not written yet')})"


def render(doc: dict) -> str:
    """The human-readable status table."""
    pool = doc["pool"]
    lines = [
        f"ckptd {doc['version']} on {doc['host']}  pid {doc['pid']}  {doc['state']}  "
        f"up {doc['uptime_s']:.0f}s",
        f"socket  {doc['socket']}",
        f"roots   {', '.join(_root_and_mode(r, doc) for r in doc['roots'])}",
        f"pool    {_size(pool['used_bytes'])} used of {_size(pool['size_bytes'])}"
        f"{'  (pinned)' if pool['pinned'] else ''}"
        f"{_numa(pool.get('numa_nodes'))}  {pool['waiting_requests']} waiting",
        *_pool_pages_line(pool),
        f"writers {sum(w['alive'] for w in doc['writers'])}/{len(doc['writers'])} alive, "
        f"{sum(w['jobs'] for w in doc['writers'])} job(s) in flight",
        *_held_polls_line(doc),
        *_deadlines_line(doc),
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
    lines += _render_tier(doc)
    lines += _render_saves(doc)
    lines += _render_local(doc)
    if doc["recent_errors"]:
        lines += ["", "RECENT ERRORS"]
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['time'] or 0))} "
                  f"request {e['request']}: {e['error']}" for e in doc["recent_errors"]]
    return "\n".join(lines)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[#######.............]  35%`` (a save of no bytes is full)."""
    fraction = min(done / total, 1.0) if total > 0 else 1.0
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {fraction * 100:3.0f}%"


def _render_saves(doc: dict) -> list[str]:
    """SAVES IN FLIGHT: per save its ranks' phases, a progress bar, the slowest file."""
    saves = doc.get("saves")  # absent from older daemons
    if not saves:
        return []
    lines = ["", "SAVES IN FLIGHT"]
    for save in saves:
        phases = " ".join(f"r{rank}:{phase}" for rank, phase in sorted(
            save["phases"].items(), key=lambda item: int(item[0])))
        where = save["path"] or f"local iteration {save['iteration']}"
        lines.append(f"  {'STUCK ' if save['stuck'] else ''}{where}  {phases}")
        lines.append(f"    {progress_bar(save['bytes_done'], save['bytes_total'])}  "
                     f"{_size(save['bytes_done'])}/{_size(save['bytes_total'])}  "
                     f"no progress for {save['stalled_s']:.0f}s")
        slowest = save.get("slowest_file")
        if slowest:
            lines.append(f"    slowest: rank {slowest['rank']} {slowest['path']} "
                         f"({slowest['phase']}, {_size(slowest['bytes_done'])}, "
                         f"last progress {slowest['age_s']:.0f}s ago)")
    return lines


def _held_polls_line(doc: dict) -> list[str]:
    held = doc.get("held_polls")  # absent from older daemons
    if held is None:
        return []
    return [f"polls   {held['held']} held until their save moves on, for "
            f"{held['connections']} trainer connection(s)"]


def _deadlines_line(doc: dict) -> list[str]:
    deadlines = doc.get("deadlines")  # absent from older daemons
    if not deadlines:
        return []
    return [f"limits  a write or fsync fails after {deadlines['stall_timeout_s']:g}s without "
            f"progress; a save is flagged stuck after {deadlines['stuck_after_s']:g}s"]


def _render_tier(doc: dict) -> list[str]:
    """The TIER section: the stage directory and every flush in flight (with ``--stage-dir``)."""
    tier = doc.get("tier")
    if not tier:
        return []
    lines = ["", f"TIER    stage {tier['stage_dir']}: {_size(tier['used_bytes'])} of "
                 f"{_size(tier['budget_bytes'])} (policy {tier['policy']}, "
                 f"{tier['waiting_saves']} waiting); {tier['retries']} retries, "
                 f"{tier['stalls']} stalls, {len(tier['commits_pending'])} commit(s) pending"]
    now = daemon_time(doc)
    flushing = [r for r in doc["requests"] if r.get("flush")]
    if flushing:
        lines += _table(["id", "rank", "attempt", "flushed", "next retry", "target", "last error"],
                        [[r["id"], r["rank"], r["flush"]["attempt"],
                          f"{_size(r['flush']['bytes_done'])}/{_size(r['flush']['bytes_total'])}",
                          "copying" if r["flush"]["next_retry_at"] is None
                          else f"in {max(r['flush']['next_retry_at'] - now, 0):.0f}s",
                          r["flush"]["target"], r["flush"].get("last_error") or ""]
                         for r in flushing])
    return lines


def _render_local(doc: dict) -> list[str]:
    """PEERS, REPLICATION and LOCAL CHECKPOINTS sections (only when there is something)."""
    lines: list[str] = []
    replication = doc.get("replication") or {}
    if doc.get("peers") or replication.get("address"):
        lines += ["", f"PEERS   (this daemon: {replication.get('address')})"]
        lines += _table(["address", "health", "heard", "sent", "received", "ok", "failed",
                         "last error"],
                        [[p["address"], p["health"],
                          "-" if p["last_heard_s"] is None else f"{p['last_heard_s']:.1f}s ago",
                          _size(p["bytes_sent"]), _size(p["bytes_received"]), p["streams_ok"],
                          p["streams_failed"], p["last_error"] or ""]
                         for p in doc.get("peers", [])]) if doc.get("peers") else ["  (none yet)"]
    if replication.get("streams"):
        lines += ["", "REPLICATION IN FLIGHT"]
        lines += _table(["dir", "kind", "peer", "owner", "iteration", "done"],
                        [[s["direction"], s["kind"], s["peer"], s["owner"], s["iteration"],
                          f"{_size(s['bytes_done'])}/{_size(max(s['size'], 0))}"]
                         for s in replication["streams"]])
    if doc.get("local_checkpoints"):
        tier = doc.get("memory_tier") or {}
        lines += ["", f"LOCAL CHECKPOINTS   (in memory: {tier.get('parts', 0)} part(s), "
                      f"{_size(tier.get('bytes', 0))} of the pool)"]
        lines += _table(["session", "iteration", "owner", "kind", "size", "verified", "committed",
                         "in memory"],
                        [[p["session"] or "-", p["iteration"], p["owner"], p["kind"],
                          _size(p["size"]), {True: "yes", False: "NO", None: "?"}[p["verified"]],
                          "yes" if p["committed"] else "no", "yes" if p.get("resident") else ""]
                         for p in doc["local_checkpoints"]])
    if doc.get("redundancy"):
        lines += ["", "REDUNDANCY   (latest part of each local rank: where its copies are)"]
        lines += _table(["session", "owner", "iteration", "copies", "wanted", "where",
                         "failed"],
                        [[p["session"] or "-", p["owner"], p["iteration"],
                          f"{p['reachable']}{' REDUCED' if p['reduced'] else ''}", p["wanted"],
                          ", ".join(p["copies"]),
                          "; ".join(f"{a}: {e}" for a, e in p["failed"].items())]
                         for p in doc["redundancy"]])
    return lines


def to_json(doc: dict) -> str:
    """The ``--json`` output: the status document, keys sorted."""
    return json.dumps(doc, sort_keys=True, indent=2)
