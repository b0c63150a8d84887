"""Prometheus families of tiered saves, from the status document's ``tier`` section.

Called by :func:`ckptd.metrics.families_of` (only when the daemon has ``--stage-dir``);
what an alert on a target outage needs: the stage directory filling up, flushes retrying
or stalling, saves waiting for the budget, bytes that reached their targets.
"""

from __future__ import annotations


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
    out.family("ckptd_stage_waiting_saves", "gauge",
               "Saves waiting for stage budget (the target is slower than the save cadence).")
    out.sample(int(tier["waiting_saves"]))
    out.family("ckptd_flushes_in_flight", "gauge", "Saves and commits still flushing to targets.")
    out.sample(int(tier["flushes"]))
    out.family("ckptd_flush_retries", "counter", "Flush copies started again after a failure.")
    out.sample(int(tier["retries"]))
    out.family("ckptd_flush_stalls", "counter",
               "Flush copies abandoned for making no progress (a stalled target).")
    out.sample(int(tier["stalls"]))
    out.family("ckptd_flushed_bytes", "counter", "Bytes made durable at their targets.")
    out.sample(int(tier["bytes_flushed"]))
    out.family("ckptd_flush_commits", "counter", "DCP checkpoints committed at their targets.")
    out.sample(int(tier["commits_done"]))
    out.family("ckptd_flush_pending_bytes", "gauge", "Bytes of flushing saves not yet at target.")
    out.sample(sum(max(r["flush"]["bytes_total"] - r["flush"]["bytes_done"], 0)
                   for r in doc["requests"] if r.get("flush")))
