"""How long each phase of a save took, as cumulative histograms (status and metrics).

Owns :class:`PhaseDurations`: one histogram per phase, and per peer for replication,
fed when a request's outcome is recorded (the phases of it that ran to their end) and
when a checkpoint's commit file is durable. Phases, and what each one times:

- ``staging``: staging space granted to every byte in the pool (the trainer's copy and
  the daemon's device copy);
- ``write``: a file's bytes written by its writer (from the job's start to its fsync);
- ``fsync``: the file made durable: fsync, checksum record, rename, directory fsync;
- ``replication``: one part's stream to one peer (``peer`` names it), successful ones;
- ``flush``: a tiered save's copy from the stage directory to its target;
- ``commit``: a checkpoint's commit file (DCP ``.metadata``), written and durable.

The status document carries the histograms (``phase_durations``); the metrics render
them from there, so ``ckptd status --json`` and Prometheus agree. No I/O, no clock: the
durations come from the timestamps the daemon already records.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["PHASE_BUCKETS", "PHASES", "PhaseDurations"]

#: Upper bounds of every phase histogram, in seconds: a small file's fsync takes
#: milliseconds, a large save's staging or replication minutes.
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0, 600.0, 1800.0)
PHASES = ("staging", "write", "fsync", "replication", "flush", "commit")


class _Histogram:
    """Counts per bucket (not cumulative), their total and the sum of the samples."""

    def __init__(self) -> None:
        self.counts = [0] * (len(PHASE_BUCKETS) + 1)  # the last one: above every bound
        self.count = 0
        self.sum = 0.0

    def add(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        self.counts[bisect_left(PHASE_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds


class PhaseDurations:
    """The histograms of phase durations since the daemon started."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str | None], _Histogram] = {}

    def observe(self, phase: str, seconds: float, peer: str | None = None) -> None:
        """One sample of ``phase`` (``peer``: the replication peer)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
        self._series.setdefault((phase, peer), _Histogram()).add(seconds)

    def observe_request(self, request) -> None:
        """The phases of a finished request that ran to their end."""
        if request.staged_at is not None and request.staging_since is not None:
            self.observe("staging", request.staged_at - request.staging_since)
        for written in request.written:
            timing = written.get("timing")
            if timing:
                self.observe("write", timing["synced_at"] - timing["started_at"])
                self.observe("fsync", timing["ended_at"] - timing["synced_at"])
        if request.replicas is not None:
            for address, holder in request.replicas.holders.items():
                if holder["state"] == "done" and holder.get("ended_at") is not None:
                    self.observe("replication", holder["ended_at"] - holder["started_at"],
                                 peer=address)
        if request.tiered and request.phase == "done" and request.local_durable_at is not None:
            self.observe("flush", request.finished_at - request.local_durable_at)

    def describe(self) -> dict:
        """As the status document shows it: the bucket bounds, and per series its
        per-bucket counts (the last: above every bound), count and sum."""
        return {"buckets": list(PHASE_BUCKETS),
                "series": [{"phase": phase, "peer": peer, "counts": list(h.counts),
                            "count": h.count, "sum": h.sum}
                           for (phase, peer), h in sorted(self._series.items(),
                                                          key=lambda kv: (kv[0][0], kv[0][1] or ""))]}
