"""The metric families of a status document, in Prometheus text exposition.

Owns :func:`families_of` (the one mapping from the status document ``ckptd status
--json`` prints to metric names, labels and help texts) and :func:`render`, which
``prometheus_client`` turns into text. Pure: it must not read the daemon's state or
write anything; it gets the document and the :class:`SaveStats`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ckptd.metrics.save_stats import SaveStats
from ckptd.protocol.names import Phase
from ckptd.tiers.metrics import tier_families

__all__ = ["RESERVED_LABELS", "LatestFamilies", "families_of", "render"]

#: In-flight phases always exported (0 when empty), so alert expressions find the series.
_IN_FLIGHT_PHASES = (Phase.WAITING_FOR_POOL, Phase.STAGING, Phase.WRITING, Phase.REPLICATING,
                     Phase.FLUSHING)
#: Label names our own series use; a ``--metrics-label`` may not reuse them.
RESERVED_LABELS = frozenset({"le", "quantile", "outcome", "state", "phase", "peer", "kind",
                             "version", "host", "socket", "session", "owner"})


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

    def labelled_histograms(self, name: str, help_text: str, labels: tuple,
                            series: list) -> None:
        """A histogram family with one series per ``(label values, buckets, sum)``."""
        family = HistogramMetricFamily(name, help_text, labels=tuple(self.const) + labels)
        for values, buckets, total in series:
            family.add_metric([str(v) for v in self.const.values()] + list(values), buckets,
                              total)
        self.families.append(family)


class LatestFamilies:
    """A collector that yields the families the last render built (HTTP thread side)."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return list(self.families)


def _text(families: list) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LatestFamilies(families))
    return generate_latest(registry).decode()


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
        tier_families(out, doc)
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
    out.family("ckptd_stale_saves", "counter", "Successful saves whose every file has the "
               "bytes of the same rank's previous save at another path (stale tensors?).")
    out.sample(int(totals.get("stale_saves", 0)))
    buckets = [(_bound(b), c) for b, c in zip(stats.buckets, stats.bucket_counts)]
    out.histogram("ckptd_save_duration_seconds",
                  "Seconds from a save request to its files being durable (successful saves).",
                  buckets + [("+Inf", stats.count)], float(stats.sum))
    if stats.last_success is not None:
        out.family("ckptd_last_success_timestamp_seconds", "gauge",
                   "Unix time the last successful save became durable.")
        out.sample(float(stats.last_success))
    _phase_durations(out, doc.get("phase_durations"))
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
    out.family("ckptd_stuck_saves", "gauge", "Saves in flight without progress for "
               "CKPTD_STUCK_AFTER seconds (status: saves[].stuck).")
    out.sample(sum(1 for save in doc.get("saves", []) if save["stuck"]))
    out.family("ckptd_recent_errors", "gauge", "Failures kept in the status document.")
    out.sample(len(doc["recent_errors"]))


def _phase_durations(out: _Families, durations: dict | None) -> None:
    # Additive in the status document: a daemon from before it exports an empty family.
    bounds = [_bound(b) for b in (durations or {}).get("buckets", [])] + ["+Inf"]
    series = []
    for entry in (durations or {}).get("series", []):
        cumulative, running = [], 0
        for bound, count in zip(bounds, entry["counts"]):
            running += count
            cumulative.append((bound, running))
        series.append(((entry["phase"], entry["peer"] or ""), cumulative, float(entry["sum"])))
    out.labelled_histograms(
        "ckptd_phase_duration_seconds",
        "Seconds each phase of a save took: staging, write and fsync of each file, "
        "replication to each peer (peer label), a tiered flush, a checkpoint's commit file.",
        ("phase", "peer"), series)


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
    out.family("ckptd_staging_pool_huge_page_bytes", "gauge",
               "Staging pool bytes on huge pages (0: 4 KiB pages; see --pool-dir).")
    out.sample(int(pool.get("huge_page_bytes", 0)))


def _ranks_and_writers(out: _Families, doc: dict) -> None:
    out.family("ckptd_ranks_registered", "gauge", "Trainer processes registered.")
    out.sample(len(doc["ranks"]))
    writers = doc["writers"]
    out.family("ckptd_writers", "gauge", "Writer processes by state.", ("state",))
    out.sample(sum(1 for w in writers if w["alive"]), state="alive")
    out.sample(sum(1 for w in writers if not w["alive"]), state="dead")
    out.family("ckptd_stuck_writers", "gauge", "Writer processes given up on after a stalled "
               "write or fsync, until they exit (their staging bytes stay held).")
    out.sample(len(doc.get("stuck_writers", [])))
    out.family("ckptd_held_polls", "gauge", "POLLs the daemon holds until the save they ask "
               "about changes phase (trainer threads blocked on a save).")
    out.sample(int((doc.get("held_polls") or {}).get("held", 0)))


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
