"""Prometheus metrics for one daemon: text exposition, textfile export, loopback endpoint.

Owns three things and nothing else:

- :func:`render` turns a status document (the one ``ckptd status --json`` prints) into
  Prometheus text exposition format 0.0.4;
- :class:`SaveStats` keeps what the status document cannot: a cumulative histogram of
  save durations and a count of aborted saves, fed from the requests the daemon sees
  finish;
- :class:`MetricsExporter`, called from the serve loop's tick, renders every
  :data:`EXPORT_INTERVAL` seconds, writes a node-exporter textfile atomically (temp file
  + rename in the same directory) and serves the same text from a small HTTP server on a
  loopback address.

Pattern: the serve loop is single-threaded and owns the ledger, so the HTTP thread never
touches daemon state: it serves the last text the tick rendered. Nothing here imports
torch (``ckptd status`` shares the import path).
"""

from __future__ import annotations

import http.server
import ipaddress
import logging
import math
import os
import socket
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)

#: Seconds between two renders (textfile write and HTTP refresh).
EXPORT_INTERVAL = 2.0
#: Upper bounds of the save-duration histogram buckets, in seconds.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_FINISHED = ("done", "failed", "aborted")
#: In-flight phases always exported (0 when empty), so alert expressions find the series.
_IN_FLIGHT_PHASES = ("waiting_for_pool", "staging", "writing", "replicating")
#: Label names our own series use; a ``--metrics-label`` may not reuse them.
RESERVED_LABELS = frozenset({"le", "quantile", "outcome", "state", "phase", "peer", "kind",
                             "version", "host", "socket"})


class MetricsAddressError(ValueError):
    """A ``--metrics-listen`` address that is malformed or not allowed."""


# --------------------------------------------------------------------- exposition text

def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Exposition:
    """Accumulates metric families, each announced once with HELP and TYPE."""

    def __init__(self, const_labels: dict) -> None:
        self.const_labels = dict(const_labels)
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        self.lines.append(f"{name}{_labels({**self.const_labels, **labels})} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# --------------------------------------------------------------------- save statistics

class SaveStats:
    """Cumulative save durations and aborted count, from requests seen finishing.

    The status document keeps only recent requests, so the daemon offers every request
    it still holds on each tick; each finished one is counted exactly once.

    Parameters
    ----------
    buckets : tuple of float
        Histogram upper bounds in seconds (``+Inf`` is added).
    """

    def __init__(self, buckets: tuple = DURATION_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self.bucket_counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0
        self.aborted = 0
        self.last_success: float | None = None
        self._seen: set[int] = set()

    def observe(self, requests: Iterable[dict]) -> None:
        """Count the finished requests among ``requests`` not counted before.

        Parameters
        ----------
        requests : iterable of dict
            Request entries as in the status document (``id``, ``phase``,
            ``created_at``, ``finished_at``).
        """
        present = set()
        for request in requests:
            present.add(request["id"])
            if request["phase"] not in _FINISHED or request["id"] in self._seen:
                continue
            self._seen.add(request["id"])
            if request["phase"] == "aborted":
                self.aborted += 1
            elif request["phase"] == "done" and request.get("finished_at"):
                self._add_duration(request["finished_at"] - request["created_at"])
                self.last_success = max(self.last_success or 0.0, request["finished_at"])
        self._seen &= present  # a request the daemon dropped will not come back

    def _add_duration(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.count += 1
        self.sum += seconds
        for index, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.bucket_counts[index] += 1


# --------------------------------------------------------------------- rendering

def render(doc: dict | None, stats: SaveStats | None = None,
           const_labels: dict | None = None) -> str:
    """Render a status document as Prometheus text exposition.

    Parameters
    ----------
    doc : dict or None
        The status document; ``None`` means the daemon is not serving (only
        ``ckptd_up 0`` is written).
    stats : SaveStats, optional
        Duration histogram and aborted count (omitted: histogram empty, aborted 0).
    const_labels : dict, optional
        Labels added to every sample (e.g. ``{"slurm_job_id": "42"}``), so daemons of
        several jobs on one node do not collide in one node-exporter.

    Returns
    -------
    str
        Text in the Prometheus 0.0.4 exposition format, ending with a newline.
    """
    out = _Exposition(const_labels or {})
    out.family("ckptd_up", "gauge", "Whether the daemon is serving (1) or stopped (0).")
    out.sample("ckptd_up", 0 if doc is None else 1)
    if doc is None:
        return out.text()
    stats = stats or SaveStats()
    _render_daemon(out, doc)
    _render_saves(out, doc, stats)
    _render_pool(out, doc["pool"])
    _render_ranks_and_writers(out, doc)
    _render_replication(out, doc)
    return out.text()


def _render_daemon(out: _Exposition, doc: dict) -> None:
    out.family("ckptd_info", "gauge", "Constant 1, labelled with version, host and socket.")
    out.sample("ckptd_info", 1, version=doc["version"], host=doc["host"], socket=doc["socket"])
    out.family("ckptd_start_time_seconds", "gauge", "Unix time the daemon started.")
    out.sample("ckptd_start_time_seconds", float(doc["started_at"]))
    out.family("ckptd_draining", "gauge", "1 while the daemon drains after SIGTERM.")
    out.sample("ckptd_draining", 1 if doc["state"] == "draining" else 0)


def _render_saves(out: _Exposition, doc: dict, stats: SaveStats) -> None:
    totals = doc["totals"]
    out.family("ckptd_bytes_written_total", "counter",
               "Bytes made durable by successful saves.")
    out.sample("ckptd_bytes_written_total", int(totals["bytes_written"]))
    out.family("ckptd_saves_total", "counter", "Finished save requests (one per rank and save).")
    out.sample("ckptd_saves_total", int(totals["saves_done"]), outcome="done")
    out.sample("ckptd_saves_total", int(totals["saves_failed"]), outcome="failed")
    out.sample("ckptd_saves_total", stats.aborted, outcome="aborted")
    out.family("ckptd_save_duration_seconds", "histogram",
               "Seconds from a save request to its files being durable (successful saves).")
    for bound, count in zip(stats.buckets, stats.bucket_counts):
        out.sample("ckptd_save_duration_seconds_bucket", count, le=_number(float(bound)))
    out.sample("ckptd_save_duration_seconds_bucket", stats.count, le="+Inf")
    out.sample("ckptd_save_duration_seconds_sum", float(stats.sum))
    out.sample("ckptd_save_duration_seconds_count", stats.count)
    if stats.last_success is not None:
        out.family("ckptd_last_success_timestamp_seconds", "gauge",
                   "Unix time the last successful save became durable.")
        out.sample("ckptd_last_success_timestamp_seconds", float(stats.last_success))
    in_flight = [r for r in doc["requests"] if r["phase"] not in _FINISHED]
    out.family("ckptd_requests_in_flight", "gauge", "Save requests not finished, by phase.")
    phases = list(_IN_FLIGHT_PHASES) + sorted({r["phase"] for r in in_flight} - set(_IN_FLIGHT_PHASES))
    for phase in phases:
        out.sample("ckptd_requests_in_flight", sum(r["phase"] == phase for r in in_flight),
                   phase=phase)
    out.family("ckptd_in_flight_bytes", "gauge",
               "Bytes of unfinished saves: total staged, and written so far.")
    out.sample("ckptd_in_flight_bytes", sum(r["bytes_total"] for r in in_flight), state="staged")
    out.sample("ckptd_in_flight_bytes", sum(r["bytes_written"] for r in in_flight),
               state="written")
    out.family("ckptd_recent_errors", "gauge", "Failures kept in the status document.")
    out.sample("ckptd_recent_errors", len(doc["recent_errors"]))


def _render_pool(out: _Exposition, pool: dict) -> None:
    out.family("ckptd_staging_pool_size_bytes", "gauge", "Size of the staging pool.")
    out.sample("ckptd_staging_pool_size_bytes", int(pool["size_bytes"]))
    out.family("ckptd_staging_pool_bytes", "gauge", "Staging pool bytes by state.")
    out.sample("ckptd_staging_pool_bytes", int(pool["used_bytes"]), state="used")
    out.sample("ckptd_staging_pool_bytes", int(pool["free_bytes"]), state="free")
    out.family("ckptd_staging_pool_waiting_requests", "gauge",
               "Save requests waiting for staging space (back-pressure).")
    out.sample("ckptd_staging_pool_waiting_requests", int(pool["waiting_requests"]))


def _render_ranks_and_writers(out: _Exposition, doc: dict) -> None:
    out.family("ckptd_ranks_registered", "gauge", "Trainer processes registered.")
    out.sample("ckptd_ranks_registered", len(doc["ranks"]))
    writers = doc["writers"]
    out.family("ckptd_writers", "gauge", "Writer processes by state.")
    out.sample("ckptd_writers", sum(1 for w in writers if w["alive"]), state="alive")
    out.sample("ckptd_writers", sum(1 for w in writers if not w["alive"]), state="dead")


def _render_replication(out: _Exposition, doc: dict) -> None:
    # Without replication the peers list is empty and the lag is 0. Each peer reports
    # "lag_s", the age of the oldest part still streaming to it.
    peers = doc.get("peers", [])
    lags = [float(p["lag_s"]) for p in peers if p.get("lag_s") is not None]
    out.family("ckptd_replication_lag_seconds", "gauge",
               "Age of the oldest local part still streaming to a peer (0: none).")
    out.sample("ckptd_replication_lag_seconds", max(lags, default=0.0))
    out.family("ckptd_peers", "gauge", "Peer daemons known to this daemon.")
    out.sample("ckptd_peers", len(peers))
    if peers:
        _render_peers(out, peers)
    parts = doc.get("local_checkpoints", [])
    out.family("ckptd_local_checkpoint_parts", "gauge",
               "Local checkpoint parts held on this node, own and replicas of peers.")
    for kind in sorted({"own", "replica"} | {p.get("kind", "unknown") for p in parts}):
        out.sample("ckptd_local_checkpoint_parts", sum(p.get("kind") == kind for p in parts),
                   kind=kind)
    out.family("ckptd_local_checkpoint_bytes", "gauge", "Bytes of local checkpoint parts held.")
    out.sample("ckptd_local_checkpoint_bytes", sum(int(p.get("size", 0)) for p in parts))


def _render_peers(out: _Exposition, peers: list) -> None:
    out.family("ckptd_peer_up", "gauge", "1 when the peer daemon answers its heartbeats.")
    for p in peers:
        out.sample("ckptd_peer_up", 1 if p.get("health") == "up" else 0, peer=p["address"])
    out.family("ckptd_replication_bytes_sent_total", "counter",
               "Bytes of local checkpoint parts streamed to a peer.")
    for p in peers:
        out.sample("ckptd_replication_bytes_sent_total", int(p.get("bytes_sent", 0)),
                   peer=p["address"])
    out.family("ckptd_replication_bytes_received_total", "counter",
               "Bytes of replicas (or fetched parts) received from a peer.")
    for p in peers:
        out.sample("ckptd_replication_bytes_received_total", int(p.get("bytes_received", 0)),
                   peer=p["address"])
    out.family("ckptd_replication_streams_total", "counter", "Part streams to or from a peer.")
    for p in peers:
        out.sample("ckptd_replication_streams_total", int(p.get("streams_ok", 0)),
                   peer=p["address"], outcome="ok")
        out.sample("ckptd_replication_streams_total", int(p.get("streams_failed", 0)),
                   peer=p["address"], outcome="failed")


# --------------------------------------------------------------------- export targets

def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temp file in the same directory + rename).

    node-exporter's textfile collector may read at any moment; it must never see a
    half-written file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # node-exporter runs as another user
    os.replace(tmp, path)


def parse_listen_address(text: str, allow_remote: bool = False) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[::1]:PORT`` for IPv6) for the metrics endpoint.

    Parameters
    ----------
    text : str
        The ``--metrics-listen`` value.
    allow_remote : bool
        Accept addresses other than loopback (``--metrics-allow-remote``).

    Returns
    -------
    (host, port)

    Raises
    ------
    MetricsAddressError
        If the address is malformed, or not loopback and ``allow_remote`` is false.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddressError(
            f"metrics address {text!r} is not HOST:PORT; use e.g. 127.0.0.1:9464")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise MetricsAddressError(
            f"metrics host {host!r} is not an IP address; give 127.0.0.1 or ::1") from None
    if not address.is_loopback and not allow_remote:
        raise MetricsAddressError(
            f"refusing to serve metrics on {text}: not a loopback address, and the endpoint "
            "has no authentication; use 127.0.0.1:PORT (scrape through node-exporter's "
            "textfile or a local agent), or pass --metrics-allow-remote to expose it anyway")
    return host, int(port_text)


class _MetricsServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], text: Callable[[], str]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.current_text = text
        super().__init__(address, _MetricsHandler)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    server: _MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        body = self.server.current_text().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # scrapes are not news
        log.debug("metrics %s: " + format, self.client_address[0], *args)


class MetricsExporter:
    """Periodic metrics export for a daemon, driven by its serve-loop tick.

    Parameters
    ----------
    textfile : str, optional
        node-exporter textfile to keep up to date (``--metrics-textfile``).
    listen : (host, port), optional
        Address for the HTTP endpoint (``--metrics-listen``), already checked by
        :func:`parse_listen_address`.
    const_labels : dict, optional
        Labels on every sample (``--metrics-label``).
    interval : float
        Seconds between renders.
    """

    def __init__(self, textfile: str | None = None, listen: tuple[str, int] | None = None,
                 const_labels: dict | None = None, interval: float = EXPORT_INTERVAL) -> None:
        self.textfile = textfile
        self.listen = listen
        self.const_labels = dict(const_labels or {})
        self.interval = interval
        self.stats = SaveStats()
        self.text = render(None, const_labels=self.const_labels)
        self._next_render = 0.0
        self._server: _MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._last_failure: str | None = None

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """The HTTP endpoint's (host, port), once started."""
        return self._server.server_address[:2] if self._server else None

    def start(self) -> None:
        """Bind the HTTP endpoint (if configured).

        Raises
        ------
        OSError
            If the address cannot be bound (in use, not local).
        """
        if self.listen is None:
            return
        try:
            self._server = _MetricsServer(self.listen, lambda: self.text)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {self.listen[0]}:{self.listen[1]}: "
                          f"{exc.strerror}; choose another --metrics-listen port") from None
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ckptd-metrics", daemon=True)
        self._thread.start()
        host, port = self.bound_address
        log.info("metrics served at http://%s:%d/metrics", host if ":" not in host
                 else f"[{host}]", port)

    def tick(self, requests: Iterable[dict], status: Callable[[], dict]) -> None:
        """Count finished requests; every ``interval`` render and export.

        Never raises: a metrics failure is logged (once per distinct reason) and the
        daemon keeps serving.

        Parameters
        ----------
        requests : iterable of dict
            Every request the daemon still holds, as status entries.
        status : callable
            Builds the current status document.
        """
        try:
            self.stats.observe(requests)
            now = time.monotonic()
            if now < self._next_render:
                return
            self._next_render = now + self.interval
            self.export(status())
        except Exception as exc:  # metrics must never stop the daemon
            self._report_failure(exc)

    def export(self, doc: dict | None) -> None:
        """Render ``doc`` and publish it to the endpoint and the textfile.

        Raises
        ------
        OSError
            If the textfile cannot be written.
        """
        self.text = render(doc, self.stats, self.const_labels)
        if self.textfile:
            write_textfile(self.textfile, self.text)
        self._last_failure = None

    def close(self) -> None:
        """Publish ``ckptd_up 0`` and stop the HTTP endpoint."""
        try:
            self.export(None)
        except Exception as exc:
            self._report_failure(exc)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _report_failure(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if reason != self._last_failure:
            log.warning("metrics export failed (%s); the daemon keeps serving. Check that "
                        "the --metrics-textfile directory exists and is writable", reason)
            self._last_failure = reason
