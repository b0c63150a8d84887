"""Which ranks reached a save's completion check, and which are known to be gone.

When a rank dies between staging a save and finalizing it (SIGKILL, OOM killer, a node
lost), the other ranks learn it from the completion collective, as gloo's "Connection
closed by peer [10.0.0.7]:41235": an address, no rank, no save. The store that set the
process group up outlives a dead peer (it lives on rank 0's host, or in a file), so each
rank leaves its mark there as it enters a save's completion check, and says once which
process it is (its pid, where that pid means something). When the collective breaks, a
rank whose mark is missing is named lost only on evidence: its process is gone (checked
on its own node, by a rank there, which leaves that finding in the store for the ranks
of other nodes). A rank that is merely late (stopped for a while, slow) is waited for,
``CKPTD_LATE_RANK_GRACE`` (or the process group's timeout, if shorter); one that neither
arrives nor is known dead by then is named as such (a node lost whole leaves nobody to
find its processes gone, so this bound is what names it).

Owns the marks (one key per rank, overwritten: the store does not grow with the number
of saves), the identities, the findings, and the count of completions this process
entered, which is the same on every rank because completions are decided by a
collective. One store write per save, not per poll. Best effort: without a reachable
store (no process group, rank 0's store gone) the failure is still raised, naming the
collective's own error instead.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

from ckptd import knobs
from ckptd.protocol import process_alive

log = logging.getLogger(__name__)

_KEY = "ckpt_client/completion/{rank}"
_WHO = "ckpt_client/process/{rank}"   # "<node> <pid> <start time>"
_GONE = "ckpt_client/gone/{rank}"     # why a rank's own node found its process gone

#: Seconds between two looks at the store while a late rank's mark is awaited. Fixed, not
#: a knob: the marks come from other processes through the store, which has no way to
#: notify, and 50 ms keeps the store's load negligible next to a wait measured in seconds
#: (the wait's length is the knob, ``CKPTD_LATE_RANK_GRACE``).
_POLL = 0.05

#: torch's default process-group timeout (``torch.distributed.constants.default_pg_timeout``,
#: 30 min): what a collective waits for a late rank when the store does not say its own.
_TORCH_DEFAULT_GROUP_TIMEOUT = 1800.0


def _node() -> str:
    """Where a pid means one process: this boot of this machine, this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"unknown:{os.getpid()}"  # matches no other process: never judged here


def _started(pid: int) -> str:
    """The process's start time (clock ticks after boot): a reused pid has another."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "gone"


class CompletionMarks:
    """This process's marks; one per process (module-level :data:`MARKS`)."""

    def __init__(self) -> None:
        self.completion = 0       # completions every rank agreed were done (same on all)
        self._marked = -1         # the completion this rank last marked
        self._introduced = False  # this process said which process it is

    def introduce(self, rank: int) -> None:
        """Say once which process this rank is (before its first save's completion)."""
        if self._introduced:
            return
        store = _store()
        if store is None:
            return
        try:
            pid = os.getpid()
            store.set(_WHO.format(rank=rank), f"{_node()} {pid} {_started(pid)}")
            self._introduced = True
        except Exception as exc:  # noqa: BLE001 (a store that fails marks nothing)
            log.debug("rank %d could not say which process it is: %s", rank, exc)

    def entering(self, rank: int) -> None:
        """This rank enters the current completion's check (marks it once per save)."""
        self.introduce(rank)
        if self._marked == self.completion:
            return
        store = _store()
        if store is None:
            return
        try:
            store.set(_KEY.format(rank=rank), str(self.completion))
            self._marked = self.completion
        except Exception as exc:  # noqa: BLE001 (a store that fails marks nothing)
            log.debug("completion mark of rank %d not set: %s", rank, exc)

    def agreed_done(self) -> None:
        """Every rank agreed the current save is done: the next check is a new one."""
        self.completion += 1

    def missing(self, world_size: int, store=None) -> list[int] | None:
        """Ranks that never entered the current completion's check (``None``: unknown)."""
        store = store or _store()
        if store is None:
            return None
        missing = []
        try:
            for rank in range(world_size):
                key = _KEY.format(rank=rank)
                # check() does not block; get() on a missing key would wait out the timeout
                if not store.check([key]) or int(store.get(key)) != self.completion:
                    missing.append(rank)
        except Exception as exc:  # noqa: BLE001
            log.debug("completion marks unreadable: %s", exc)
            return None
        return missing


def gone(store, rank: int) -> str | None:
    """Why ``rank``'s process is known to be gone, or ``None`` (alive, or not known here).

    Known on the rank's own node (its pid no longer names it: exited, a zombie, or the pid
    reused); that finding is left in the store for ranks on other nodes.
    """
    key = _GONE.format(rank=rank)
    if store.check([key]):
        return store.get(key).decode()
    if not store.check([_WHO.format(rank=rank)]):
        return None
    node, pid, started = store.get(_WHO.format(rank=rank)).decode().split()
    if node != _node() or (process_alive(int(pid)) and _started(int(pid)) == started):
        return None
    why = f"its process (pid {pid}) exited"
    store.set(key, why)
    return why


def _store():
    """The default process group's store, or ``None``."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 (a torch without it: no marks)
        return None


def _late_limit(store) -> float:
    """How long a rank not known to be dead is awaited: the grace, or the process group's
    own timeout (how long any collective waits for a late rank) where that is shorter."""
    timeout = getattr(store, "timeout", None)
    group = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else _TORCH_DEFAULT_GROUP_TIMEOUT
    return min(group, knobs.LATE_RANK_GRACE.get())


#: The marks of this process.
MARKS = CompletionMarks()


def lost_ranks_failure(error: Exception, rank: int, world_size: int,
                       store=None) -> dict[int, str]:
    """The failures to report when the completion collective itself failed with ``error``.

    Ranks that have not reached this save's completion check are named lost once their
    process is known to be gone; the others are waited for (``CKPTD_LATE_RANK_GRACE``, at
    most the process group's timeout) and dropped from suspicion when their mark arrives.
    ``store`` is the process group's store (default: the default group's).

    Returns
    -------
    dict of int to str
        Each rank named lost -> why; when none can be named, this rank -> the
        collective's error.
    """
    store = _store() if store is None else store
    waiting, lost = MARKS.missing(world_size, store), {}
    if waiting:
        limit = _late_limit(store)
        deadline = time.monotonic() + limit
        logged = False
        while waiting:
            try:
                waiting = [r for r in MARKS.missing(world_size, store) or [] if r not in lost]
                found = {r: why for r in waiting if (why := gone(store, r)) is not None}
                if found:  # one that arrived and then ended (its save over) was not lost
                    arrived = set(waiting) - set(MARKS.missing(world_size, store) or [])
                    found = {r: why for r, why in found.items() if r not in arrived}
                lost.update(found)
                waiting = [r for r in waiting if r not in found]
            except Exception as exc:  # noqa: BLE001 (the store went too: judge on what is known)
                log.debug("completion marks unreadable: %s", exc)
                break
            if waiting and time.monotonic() > deadline:
                lost.update({r: f"it did not reach the check within {limit:.0f}s "
                                f"(CKPTD_LATE_RANK_GRACE) and is not known to be alive: "
                                f"its node may be lost, or the process hangs"
                             for r in waiting})
                break
            if waiting and not logged:
                log.warning("rank %d: the completion check failed (%s); ranks %s are not "
                            "known to be gone: waiting up to %.0fs for them to arrive",
                            rank, error, waiting, limit)
                logged = True
            if waiting:
                time.sleep(_POLL)  # marks arrive from other processes; no event crosses
    if lost:
        # The same text on every rank that reports it: no address, no reporter.
        log.error("the completion check failed on rank %d (%s); ranks %s were lost",
                  rank, error, sorted(lost))
        return {r: (f"rank {r} was lost between staging this save and finalizing it: it "
                    f"never reached the save's completion check (phase 'finalize'), and the "
                    f"check's collective failed without it ({why}); see whether rank {r}'s "
                    f"process exited or hangs, then restart the job from the last committed "
                    f"checkpoint") for r, why in sorted(lost.items())}
    return {rank: (f"the completion check of this save failed ({error}) and no rank is known "
                   f"to have missed it{'' if waiting is not None else ' (the store is unreachable)'}"
                   f": a rank was probably lost during the finalize; see which process exited, "
                   f"then restart the job from the last committed checkpoint")}
