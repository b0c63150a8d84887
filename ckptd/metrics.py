"""Prometheus metrics for one daemon: rendering, textfile export, loopback endpoint.

Owns three things and nothing else:

- :func:`render` turns a status document (the one ``ckptd status --json`` prints) into
  metric families, rendered by ``prometheus_client`` in the text exposition format;
- :class:`SaveStats` keeps what the status document cannot: a cumulative histogram of
  save durations and a count of aborted saves, fed from the requests the daemon sees
  finish;
- :class:`MetricsExporter`, called from the serve loop's tick, renders every
  :data:`ckptd.knobs.METRICS_INTERVAL` seconds, replaces a node-exporter textfile
  atomically, and serves the same families over HTTP on a loopback address
  (``prometheus_client``'s WSGI app, restricted to ``/metrics``).

Pattern: the serve loop is single-threaded and owns the daemon's state, so the HTTP
thread never touches it: it serves the families the last tick built. Nothing here imports
torch (``ckptd status`` shares the import path).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Callable, Iterable
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_wsgi_app

from ckptd import knobs
from ckptd.protocol import Phase
from ckptd.storage.durable import write_small_file

log = logging.getLogger(__name__)

#: Upper bounds of the save-duration histogram buckets, in seconds.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: In-flight phases always exported (0 when empty), so alert expressions find the series.
_IN_FLIGHT_PHASES = (Phase.WAITING_FOR_POOL, Phase.STAGING, Phase.WRITING, Phase.REPLICATING)
#: Label names our own series use; a ``--metrics-label`` may not reuse them.
RESERVED_LABELS = frozenset({"le", "quantile", "outcome", "state", "phase", "peer", "kind",
                             "version", "host", "socket", "session", "owner"})


class MetricsAddressError(ValueError):
    """A ``--metrics-listen`` address that is malformed or not allowed."""


# --------------------------------------------------------------------- families

class _Families:
    """Builds metric families, each carrying the daemon's constant labels."""

    _KINDS = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}

    def __init__(self, const_labels: dict) -> None:
        self.const = dict(const_labels)
        self.families: list = []
        self._current = None

    def family(self, name: str, kind: str, help_text: str, labels: tuple = ()) -> None:
        """Start a family; its samples follow with :meth:`sample`."""
        self._labels = tuple(self.const) + tuple(labels)
        self._current = self._KINDS[kind](name, help_text, labels=self._labels)
        self.families.append(self._current)

    def sample(self, value: float, **labels: str) -> None:
        """One sample of the current family."""
        values = {**self.const, **labels}
        self._current.add_metric([str(values[k]) for k in self._labels], float(value))

    def histogram(self, name: str, help_text: str, buckets: list, total: float) -> None:
        """A whole histogram family (``buckets``: cumulative ``(le, count)`` pairs)."""
        family = HistogramMetricFamily(name, help_text, labels=tuple(self.const))
        family.add_metric([str(v) for v in self.const.values()], buckets, total)
        self.families.append(family)


class _Latest:
    """A collector that yields the families the last render built (HTTP thread side)."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return list(self.families)


def _text(families: list) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Latest(families))
    return generate_latest(registry).decode()


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
            if request["phase"] not in Phase.FINISHED or request["id"] in self._seen:
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

def families_of(doc: dict | None, stats: SaveStats | None = None,
                const_labels: dict | None = None) -> list:
    """The metric families of a status document.

    Parameters
    ----------
    doc : dict or None
        The status document; ``None`` means the daemon is not serving (only
        ``ckptd_up 0`` is exported).
    stats : SaveStats, optional
        Duration histogram and aborted count (omitted: histogram empty, aborted 0).
    const_labels : dict, optional
        Labels added to every sample (e.g. ``{"slurm_job_id": "42"}``), so daemons of
        several jobs on one node do not collide in one node-exporter.
    """
    out = _Families(const_labels or {})
    out.family("ckptd_up", "gauge", "Whether the daemon is serving (1) or stopped (0).")
    out.sample(0 if doc is None else 1)
    if doc is not None:
        _daemon(out, doc)
        _saves(out, doc, stats or SaveStats())
        _pool(out, doc["pool"])
        _ranks_and_writers(out, doc)
        _replication(out, doc)
    return out.families


def render(doc: dict | None, stats: SaveStats | None = None,
           const_labels: dict | None = None) -> str:
    """Render a status document as Prometheus text exposition (format 0.0.4).

    Returns
    -------
    str
        The text, as ``prometheus_client`` renders it (see :func:`families_of`).
    """
    return _text(families_of(doc, stats, const_labels))


def _daemon(out: _Families, doc: dict) -> None:
    out.family("ckptd_info", "gauge", "Constant 1, labelled with version, host and socket.",
               ("version", "host", "socket"))
    out.sample(1, version=doc["version"], host=doc["host"], socket=doc["socket"])
    out.family("ckptd_start_time_seconds", "gauge", "Unix time the daemon started.")
    out.sample(float(doc["started_at"]))
    out.family("ckptd_draining", "gauge", "1 while the daemon drains after SIGTERM.")
    out.sample(1 if doc["state"] == "draining" else 0)


def _saves(out: _Families, doc: dict, stats: SaveStats) -> None:
    totals = doc["totals"]
    out.family("ckptd_bytes_written", "counter", "Bytes made durable by successful saves.")
    out.sample(int(totals["bytes_written"]))
    out.family("ckptd_saves", "counter", "Finished save requests (one per rank and save).",
               ("outcome",))
    out.sample(int(totals["saves_done"]), outcome="done")
    out.sample(int(totals["saves_failed"]), outcome="failed")
    out.sample(stats.aborted, outcome="aborted")
    buckets = [(_bound(b), c) for b, c in zip(stats.buckets, stats.bucket_counts)]
    out.histogram("ckptd_save_duration_seconds",
                  "Seconds from a save request to its files being durable (successful saves).",
                  buckets + [("+Inf", stats.count)], float(stats.sum))
    if stats.last_success is not None:
        out.family("ckptd_last_success_timestamp_seconds", "gauge",
                   "Unix time the last successful save became durable.")
        out.sample(float(stats.last_success))
    in_flight = [r for r in doc["requests"] if r["phase"] not in Phase.FINISHED]
    out.family("ckptd_requests_in_flight", "gauge", "Save requests not finished, by phase.",
               ("phase",))
    phases = list(_IN_FLIGHT_PHASES) + sorted({r["phase"] for r in in_flight} - set(_IN_FLIGHT_PHASES))
    for phase in phases:
        out.sample(sum(r["phase"] == phase for r in in_flight), phase=phase)
    out.family("ckptd_in_flight_bytes", "gauge",
               "Bytes of unfinished saves: total staged, and written so far.", ("state",))
    out.sample(sum(r["bytes_total"] for r in in_flight), state="staged")
    out.sample(sum(r["bytes_written"] for r in in_flight), state="written")
    out.family("ckptd_recent_errors", "gauge", "Failures kept in the status document.")
    out.sample(len(doc["recent_errors"]))


def _bound(seconds: float) -> str:
    return repr(float(seconds))


def _pool(out: _Families, pool: dict) -> None:
    out.family("ckptd_staging_pool_size_bytes", "gauge", "Size of the staging pool.")
    out.sample(int(pool["size_bytes"]))
    out.family("ckptd_staging_pool_bytes", "gauge", "Staging pool bytes by state.", ("state",))
    out.sample(int(pool["used_bytes"]), state="used")
    out.sample(int(pool["free_bytes"]), state="free")
    out.family("ckptd_staging_pool_waiting_requests", "gauge",
               "Save requests waiting for staging space (back-pressure).")
    out.sample(int(pool["waiting_requests"]))


def _ranks_and_writers(out: _Families, doc: dict) -> None:
    out.family("ckptd_ranks_registered", "gauge", "Trainer processes registered.")
    out.sample(len(doc["ranks"]))
    writers = doc["writers"]
    out.family("ckptd_writers", "gauge", "Writer processes by state.", ("state",))
    out.sample(sum(1 for w in writers if w["alive"]), state="alive")
    out.sample(sum(1 for w in writers if not w["alive"]), state="dead")


def _replication(out: _Families, doc: dict) -> None:
    # Without replication the peers list is empty and the lag is 0. Each peer reports
    # "lag_s", the age of the oldest part still streaming to it.
    peers = doc.get("peers", [])
    lags = [float(p["lag_s"]) for p in peers if p.get("lag_s") is not None]
    out.family("ckptd_replication_lag_seconds", "gauge",
               "Age of the oldest local part still streaming to a peer (0: none).")
    out.sample(max(lags, default=0.0))
    out.family("ckptd_peers", "gauge", "Peer daemons known to this daemon.")
    out.sample(len(peers))
    if peers:
        _peers(out, peers)
    parts = doc.get("local_checkpoints", [])
    out.family("ckptd_local_checkpoint_parts", "gauge",
               "Local checkpoint parts held on this node, own and replicas of peers.", ("kind",))
    for kind in sorted({"own", "replica"} | {p.get("kind", "unknown") for p in parts}):
        out.sample(sum(p.get("kind") == kind for p in parts), kind=kind)
    out.family("ckptd_local_checkpoint_bytes", "gauge", "Bytes of local checkpoint parts held.")
    out.sample(sum(int(p.get("size", 0)) for p in parts))
    _redundancy(out, doc)


def _redundancy(out: _Families, doc: dict) -> None:
    # Per local rank of this node; the job's redundancy is the min over every node's series.
    parts = doc.get("redundancy", [])
    out.family("ckptd_local_part_copies", "gauge",
               "Reachable durable copies of the latest part of each local rank (own + peers "
               "not down).", ("session", "owner"))
    for p in parts:
        out.sample(int(p["reachable"]), session=p["session"], owner=str(p["owner"]))
    out.family("ckptd_local_parts_reduced_redundancy", "gauge",
               "Local ranks whose latest part has fewer reachable copies than the clique asks.")
    out.sample(sum(1 for p in parts if p["reduced"]))
    tier = doc.get("memory_tier") or {}
    out.family("ckptd_memory_tier_bytes", "gauge",
               "Staging pool bytes keeping the latest committed local parts in memory.")
    out.sample(int(tier.get("bytes", 0)))


def _peers(out: _Families, peers: list) -> None:
    out.family("ckptd_peer_up", "gauge", "1 when the peer daemon answers its heartbeats.",
               ("peer",))
    for p in peers:
        out.sample(1 if p.get("health") == "up" else 0, peer=p["address"])
    for name, key, help_text in (
            ("ckptd_replication_bytes_sent", "bytes_sent",
             "Bytes of local checkpoint parts streamed to a peer."),
            ("ckptd_replication_bytes_received", "bytes_received",
             "Bytes of replicas (or fetched parts) received from a peer.")):
        out.family(name, "counter", help_text, ("peer",))
        for p in peers:
            out.sample(int(p.get(key, 0)), peer=p["address"])
    out.family("ckptd_replication_streams", "counter", "Part streams to or from a peer.",
               ("peer", "outcome"))
    for p in peers:
        out.sample(int(p.get("streams_ok", 0)), peer=p["address"], outcome="ok")
        out.sample(int(p.get("streams_failed", 0)), peer=p["address"], outcome="failed")


# --------------------------------------------------------------------- export targets

def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, readable by node-exporter's user.

    node-exporter's textfile collector may read at any moment; it must never see a
    half-written file. Not fsynced: a textfile from before a crash is worthless.
    """
    write_small_file(path, text.encode(), mode=0o644, fsync=False, operator_path=True)


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


def _metrics_only(app):
    """Serve ``app`` (prometheus_client's) at ``/metrics`` and ``/``; 404 elsewhere."""
    def restricted(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics is served here\n"]
        return app(environ, start_response)
    return restricted


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
    interval : float, optional
        Seconds between renders (default :data:`ckptd.knobs.METRICS_INTERVAL`).
    """

    def __init__(self, textfile: str | None = None, listen: tuple[str, int] | None = None,
                 const_labels: dict | None = None, interval: float | None = None) -> None:
        self.textfile = textfile
        self.listen = listen
        self.const_labels = dict(const_labels or {})
        self.interval = knobs.METRICS_INTERVAL.get() if interval is None else interval
        self.stats = SaveStats()
        self._latest = _Latest(families_of(None, const_labels=self.const_labels))
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._latest)
        self._next_render = 0.0
        self._server = None
        self._last_failure: str | None = None

    @property
    def text(self) -> str:
        """The exposition text of the last render (what the endpoint serves)."""
        return generate_latest(self._registry).decode()

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
        host, port = self.listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
        try:
            self._server = make_server(host, port, _metrics_only(make_wsgi_app(self._registry)),
                                       server_class, handler_class=_SilentHandler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: "
                          f"{exc.strerror}; choose another --metrics-listen port") from None
        threading.Thread(target=self._server.serve_forever, name="ckptd-metrics",
                         daemon=True).start()
        bound_host, bound_port = self.bound_address
        log.info("metrics served at http://%s:%d/metrics",
                 bound_host if ":" not in bound_host else f"[{bound_host}]", bound_port)

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
        """Build the families of ``doc``; publish them to the endpoint and the textfile.

        Raises
        ------
        OSError
            If the textfile cannot be written.
        """
        self._latest.families = families_of(doc, self.stats, self.const_labels)
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

