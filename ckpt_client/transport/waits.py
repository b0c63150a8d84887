"""How long a trainer waits for its daemon: the daemon's own deadline, plus a margin.

The daemon is the judge of a save's deadlines (staging space, staging, the whole save, a
tiered flush, a fetch): when one passes, it fails the save and every rank hears why. A
trainer's wait must therefore outlast the daemon's deadline for the same thing, or a rank
could report a save failed that the daemon goes on to commit. Each wait here is derived
from the very knobs the daemon enforces, plus :func:`margin` (one unanswered call, two
housekeeping ticks of the daemon, and ``CKPTD_WAIT_MARGIN``), so the order holds whatever
an operator sets; ``tests/unit/test_wait_ordering.py`` checks it. A wait that runs out
here means the daemon itself is silent (stopped, hung) or dead.

Pure arithmetic over :mod:`ckptd.knobs`, read when asked (never cached): no I/O.
"""

from __future__ import annotations

from ckptd import knobs

__all__ = ["margin", "stage_reply", "staged_reply", "staging", "save_outcome", "local_load",
           "daemon_deadline_of_save", "daemon_deadline_of_commit", "commit_file"]


def margin() -> float:
    """Seconds every trainer wait adds to the daemon's deadline: a poll that went out just
    before the daemon decided (one call timeout), the daemon's check granularity (two
    serve ticks), and ``CKPTD_WAIT_MARGIN``."""
    extra = max(0.0, knobs.WAIT_MARGIN.get())  # a negative setting must not break the order
    return knobs.CALL_TIMEOUT.get() + 2 * knobs.SERVE_TICK.get() + extra


def stage_reply() -> float:
    """The STAGE reply: the daemon leases space, or refuses the save once it waited
    ``CKPTD_STAGE_TIMEOUT`` for it (pool and stage budget, from the STAGE's arrival)."""
    return knobs.STAGE_TIMEOUT.get() + margin()


def staged_reply() -> float:
    """The STAGED reply: the daemon fails staging ``CKPTD_STAGING_DEADLINE`` after it
    granted the space (it answers STAGED once the daemon's own device copy is in too)."""
    return knobs.STAGING_DEADLINE.get() + margin()


def staging() -> float:
    """``wait_staged()`` without a timeout: both exchanges of one save's staging (the
    trainer's copy runs under the daemon's staging deadline, between them)."""
    return stage_reply() + staged_reply() + margin()


def daemon_deadline_of_save(tiered: bool) -> float:
    """The longest a daemon lets a save run, request to outcome: the whole-save deadline,
    and for a tiered save also its flush's deadline (counted from the local copy)."""
    deadline = knobs.SAVE_DEADLINE.get()
    return deadline + knobs.FLUSH_DEADLINE.get() if tiered else deadline


def save_outcome(tiered: bool) -> float:
    """Finalize: from the STAGE request to the daemon's word on the save's outcome."""
    return daemon_deadline_of_save(tiered) + margin()


def daemon_deadline_of_commit() -> float:
    """The longest a daemon without a stage dir takes to answer a ``commit_file``: its
    writer may sit behind a job on a writer that stalls (the daemon replaces that writer
    after ``--stall-timeout`` without progress and hands the commit to a fresh one), and
    the commit's own write and fsync may then stall as long before the daemon fails it."""
    return 2 * knobs.STALL_TIMEOUT.get()


def commit_file(tiered: bool) -> float:
    """``commit_file`` (a DCP ``.metadata``, a completion marker): a tiered daemon answers
    once every file the commit names is durable at the target (the save's outcome);
    otherwise once its writer has the file durable (:func:`daemon_deadline_of_commit`)."""
    if tiered:
        return save_outcome(tiered=True)
    return daemon_deadline_of_commit() + margin()


def local_load() -> float:
    """``find_latest()``'s inventory and ``load()``'s fetch: the daemon ends a fetch at
    ``CKPTD_LOCAL_LOAD_TIMEOUT`` (an inventory only reads this node's disk)."""
    return knobs.LOCAL_LOAD_TIMEOUT.get() + margin()
