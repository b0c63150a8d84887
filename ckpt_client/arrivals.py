"""Which ranks reached a save's completion check: a mark per rank in the group's store.

When a rank dies between staging a save and finalizing it (SIGKILL, OOM killer, a node
lost), the other ranks learn it from the completion collective, as gloo's "Connection
closed by peer [10.0.0.7]:41235": an address, no rank, no save. The store that set the
process group up outlives a dead peer (it lives on rank 0's host, or in a file), so each
rank leaves its mark there as it enters a save's completion check; when the collective
breaks, the ranks whose mark is missing are the ones that never got that far, and the
failure names them and the phase they were lost in.

Owns the marks (one key per rank, overwritten: the store does not grow with the number
of saves) and the count of completions this process entered, which is the same on every
rank because completions are decided by a collective. One store write per save, not per
poll. Best effort: without a reachable store (no process group, rank 0's store gone) the
failure is still raised, naming the collective's own error instead.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_KEY = "ckpt_client/completion/{rank}"


class CompletionMarks:
    """This process's marks; one per process (module-level :data:`MARKS`)."""

    def __init__(self) -> None:
        self.completion = 0       # completions every rank agreed were done (same on all)
        self._marked = -1         # the completion this rank last marked

    def entering(self, rank: int) -> None:
        """This rank enters the current completion's check (marks it once per save)."""
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

    def missing(self, world_size: int) -> list[int] | None:
        """Ranks that never entered the current completion's check (``None``: unknown)."""
        store = _store()
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


#: The marks of this process.
MARKS = CompletionMarks()


def lost_ranks_failure(error: Exception, rank: int, world_size: int) -> dict[int, str]:
    """The failures to report when the completion collective itself failed with ``error``.

    Returns
    -------
    dict of int to str
        Each rank that never reached this save's completion check -> why it is named; when
        none can be named, this rank -> the collective's error.
    """
    missing = MARKS.missing(world_size)
    if missing:
        # The same text on every rank that reports it: no address, no reporter.
        log.error("the completion check failed on rank %d (%s); ranks %s never reached it",
                  rank, error, missing)
        return {r: (f"rank {r} was lost between staging this save and finalizing it: it "
                    f"never reached the save's completion check (phase 'finalize'), and the "
                    f"check's collective failed without it; see whether rank {r}'s process "
                    f"exited or hangs, then restart the job from the last committed "
                    f"checkpoint") for r in missing}
    return {rank: (f"the completion check of this save failed ({error}) and no rank is known "
                   f"to have missed it{'' if missing is not None else ' (the store is unreachable)'}"
                   f": a rank was probably lost during the finalize; see which process exited, "
                   f"then restart the job from the last committed checkpoint")}
