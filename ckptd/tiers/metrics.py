"""Prometheus families of tiered saves, from the status document's ``tier`` section.

Called by :func:`ckptd.metrics.families_of` (only when the daemon has ``--stage-dir``);
what an alert on a target outage needs: the stage directory filling up, flushes retrying
or stalling, saves waiting for the budget, bytes that reached their targets.
"""

from __future__ import annotations

# Families with one unlabelled sample, each read from one key of the ``tier`` section.
_ONE_SAMPLE = (
    ("ckptd_stage_waiting_saves", "gauge",
     "Saves waiting for stage budget (the target is slower than the save cadence).",
     "waiting_saves"),
    ("ckptd_flushes_in_flight", "gauge", "Saves and commits still flushing to targets.", "flushes"),
    ("ckptd_flush_retries", "counter", "Flush copies started again after a failure.", "retries"),
    ("ckptd_flush_stalls", "counter",
     "Flush copies abandoned for making no progress (a stalled target).", "stalls"),
    ("ckptd_flushed_bytes", "counter", "Bytes made durable at their targets.", "bytes_flushed"),
    ("ckptd_flush_commits", "counter", "DCP checkpoints committed at their targets.",
     "commits_done"),
)


def tier_families(out, doc: dict) -> None:
    """Add the tier families to ``out`` (a ``ckptd.metrics._Families``)."""
    tier = doc.get("tier")
    if not tier:
        return
    out.family("ckptd_stage_bytes", "gauge",
               "Stage directory: bytes reserved by saves not yet flushed, and the budget.",
               ("state",))
    out.sample(int(tier["used_bytes"]), state="used")
    out.sample(int(tier["budget_bytes"]), state="budget")
    for name, kind, help_text, key in _ONE_SAMPLE:
        out.family(name, kind, help_text)
        out.sample(int(tier[key]))
    out.family("ckptd_flush_pending_bytes", "gauge", "Bytes of flushing saves not yet at target.")
    out.sample(sum(max(r["flush"]["bytes_total"] - r["flush"]["bytes_done"], 0)
                   for r in doc["requests"] if r.get("flush")))
