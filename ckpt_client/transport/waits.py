"""How long a trainer waits for its daemon: the daemon's own deadline, plus a margin.

The daemon is the judge of a save's deadlines (staging space, staging, the whole save, a
tiered flush, a commit, a fetch): when one passes, it fails the save and every rank hears
why. A trainer's wait must therefore outlast the daemon's deadline for the same thing, or
a rank could report a save failed that the daemon goes on to commit. Each wait here is
the daemon's deadline plus :func:`margin` (one unanswered call, two housekeeping ticks of
the daemon, and ``CKPTD_WAIT_MARGIN``). The daemon's deadline is the longer of two
readings of it: the knobs in this process's environment, and what the daemon said in its
hello reply (:class:`ckptd.protocol.DaemonDeadlines`: its command line, such as
``--stall-timeout``, and its own environment, neither of which the trainer sees). A daemon
that predates that field (``None``) leaves the environment's reading alone. So the order
holds whatever an operator sets, and where; ``tests/unit/test_wait_ordering.py`` checks it.
A wait that runs out here means the daemon itself is silent (stopped, hung) or dead.

Every function takes the connection's ``deadlines`` (the hello's) first. Pure arithmetic
over :mod:`ckptd.knobs` (read when asked, never cached) and that body: no I/O.
:func:`as_text` is how a message says a wait, so every give-up message says it alike.
"""

from __future__ import annotations

from ckptd import knobs
from ckptd.protocol import DaemonDeadlines

__all__ = ["as_text", "margin", "stage_reply", "staged_reply", "staging", "background_staging",
           "save_outcome", "local_load", "daemon_deadline_of_save", "daemon_deadline_of_commit",
           "commit_file"]


def as_text(seconds: float) -> str:
    """A wait as a message says it: what was waited, to a hundredth of a second ("1.5s",
    "60s", "0.25s"); rounded to whole seconds, a 1.5 s wait would read as 2 s and send the
    reader after a setting nobody made."""
    if seconds >= 1:
        return f"{seconds:.2f}".rstrip("0").rstrip(".") + "s"
    return f"{seconds:.2g}s"


def _longer(knob: knobs.Knob, daemon: DaemonDeadlines | None, said: str) -> float:
    """The daemon's deadline for one thing: the longer of this process's knob and the
    daemon's own word (its field ``said``), when it gave one."""
    own = float(knob.get())
    return own if daemon is None else max(own, float(getattr(daemon, said)))


def margin(daemon: DaemonDeadlines | None) -> float:
    """Seconds every trainer wait adds to the daemon's deadline: a poll that went out just
    before the daemon decided (one call timeout), the daemon's check granularity (two
    serve ticks), and ``CKPTD_WAIT_MARGIN``."""
    extra = max(0.0, knobs.WAIT_MARGIN.get())  # a negative setting must not break the order
    return knobs.CALL_TIMEOUT.get() + 2 * _longer(knobs.SERVE_TICK, daemon, "serve_tick_s") \
        + extra


def stage_reply(daemon: DaemonDeadlines | None) -> float:
    """The STAGE reply: the daemon leases space, or refuses the save once it waited
    ``CKPTD_STAGE_TIMEOUT`` for it (pool and stage budget, from the STAGE's arrival)."""
    return _longer(knobs.STAGE_TIMEOUT, daemon, "stage_timeout_s") + margin(daemon)


def staged_reply(daemon: DaemonDeadlines | None) -> float:
    """The STAGED reply: the daemon fails staging ``CKPTD_STAGING_DEADLINE`` after it
    granted the space (it answers STAGED once the daemon's own device copy is in too)."""
    return _longer(knobs.STAGING_DEADLINE, daemon, "staging_deadline_s") + margin(daemon)


def staging(daemon: DaemonDeadlines | None) -> float:
    """``wait_staged()`` without a timeout: both exchanges of one save's staging (the
    trainer's copy runs under the daemon's staging deadline, between them)."""
    return stage_reply(daemon) + staged_reply(daemon) + margin(daemon)


def background_staging(daemon: DaemonDeadlines | None, saves: int) -> float:
    """Waiting for a connection's background thread to stage the ``saves`` zero-stall
    saves queued on it: they are staged one after another, each within :func:`staging`."""
    return max(1, saves) * staging(daemon)


def daemon_deadline_of_save(daemon: DaemonDeadlines | None, tiered: bool) -> float:
    """The longest a daemon lets a save run, request to outcome: the whole-save deadline,
    and for a tiered save also its flush's deadline (counted from the local copy)."""
    deadline = _longer(knobs.SAVE_DEADLINE, daemon, "save_deadline_s")
    if not tiered:
        return deadline
    return deadline + _longer(knobs.FLUSH_DEADLINE, daemon, "flush_deadline_s")


def save_outcome(daemon: DaemonDeadlines | None, tiered: bool) -> float:
    """Finalize: from the STAGE request to the daemon's word on the save's outcome."""
    return daemon_deadline_of_save(daemon, tiered) + margin(daemon)


def daemon_deadline_of_commit(daemon: DaemonDeadlines | None) -> float:
    """The longest a daemon without a stage dir takes to answer a ``commit_file``: it
    fails a commit not durable within the whole-save deadline of its arrival, waiting for
    a free writer included and however slowly the write progresses (a stall fails it
    sooner)."""
    return _longer(knobs.SAVE_DEADLINE, daemon, "save_deadline_s")


def commit_file(daemon: DaemonDeadlines | None, tiered: bool) -> float:
    """``commit_file`` (a DCP ``.metadata``, a completion marker): a tiered daemon answers
    once every file the commit names is durable at the target (the save's outcome);
    otherwise once its writer has the file durable (:func:`daemon_deadline_of_commit`)."""
    if tiered:
        return save_outcome(daemon, tiered=True)
    return daemon_deadline_of_commit(daemon) + margin(daemon)


def local_load(daemon: DaemonDeadlines | None) -> float:
    """``find_latest()``'s inventory and ``load()``'s fetch: the daemon ends a fetch at
    ``CKPTD_LOCAL_LOAD_TIMEOUT`` (an inventory only reads this node's disk)."""
    return _longer(knobs.LOCAL_LOAD_TIMEOUT, daemon, "local_load_timeout_s") + margin(daemon)
