"""The deadlines of a save, checked on every housekeeping tick: nothing waits forever.

- **A file's write or fsync** that makes no progress for ``--stall-timeout`` seconds: the
  writer pool gives up on its writer (:meth:`ckptd.storage.writer_pool.WriterPool.check_stalls`),
  the file's save fails naming rank, file, phase and storage target.
- **A checkpoint's commit file** (DCP ``.metadata``) not durable
  :data:`knobs.SAVE_DEADLINE` seconds after its ``commit_file`` arrived, slow progress or
  none: it is failed and its writer replaced (:meth:`WriterPool.check_deadlines`).
- **Waiting for space**: a STAGE that got no staging space (the pool, and on a tiered
  daemon the stage budget) within :data:`knobs.STAGE_TIMEOUT` seconds of its arrival.
- **Staging** (the trainer's copy into shared memory, or the daemon's CUDA copy) that has
  not finished :data:`knobs.STAGING_DEADLINE` seconds after the space was granted.
- **The whole save**, request to durable, past :data:`knobs.SAVE_DEADLINE` (a tiered
  save's flush has the flusher's own deadline, :data:`knobs.FLUSH_DEADLINE`, and retries
  rather than fails meanwhile).
- **A local part's fetch** from a peer, past :data:`knobs.LOCAL_LOAD_TIMEOUT`.

Replication has its own per-peer limit in the replicator (a stream without progress for
:data:`knobs.PEER_TIMEOUT` fails, and the save completes with reduced redundancy).

The daemon is the judge of a save's deadlines: a client waits longer than these (its own
limits, :mod:`ckpt_client.transport.waits`, derive from the same knobs and cover a dead or
silent daemon), so a rank is never told a save failed while the daemon may still commit it. Owns nothing but the clock checks: failing a request is the
lifecycle's, giving up on a writer is the writer pool's.
"""

from __future__ import annotations

import logging
import time

from ckptd import knobs
from ckptd.protocol import DaemonDeadlines, Phase
from ckptd.server.lifecycle import CLIENT_COPY, DEVICE_COPY, SaveLifecycle
from ckptd.server.requests import RequestTable, SaveRequest

log = logging.getLogger(__name__)

_COPIERS = {CLIENT_COPY: "the trainer's copy into shared memory",
            DEVICE_COPY: "the daemon's copy from the GPU (CUDA IPC)"}


class SaveDeadlines:
    """Fails what overstays its deadline (see the module docstring).

    Parameters
    ----------
    table : RequestTable
        The requests in flight.
    lifecycle : SaveLifecycle
        Ends a request that overstayed.
    writers : WriterPool
        Gives up on writers stuck in the kernel.
    stall_timeout : float
        ``--stall-timeout``.
    tier : ckptd.tiers.service.TierService, optional
        Refuses saves that waited too long for the stage budget.
    local : ckptd.server.local.LocalService, optional
        Fails fetches of local parts that took too long.
    """

    def __init__(self, table: RequestTable, lifecycle: SaveLifecycle, writers,
                 stall_timeout: float, tier=None, local=None) -> None:
        self.table, self.lifecycle, self.writers = table, lifecycle, writers
        self.stall_timeout = stall_timeout
        self.tier, self.local = tier, local

    def enforced(self) -> DaemonDeadlines:
        """The deadlines this daemon enforces, as a trainer's hello reply tells them: the
        trainer's environment may not name what this daemon's command line set."""
        return DaemonDeadlines(
            stall_timeout_s=self.stall_timeout, stage_timeout_s=knobs.STAGE_TIMEOUT.get(),
            staging_deadline_s=knobs.STAGING_DEADLINE.get(),
            save_deadline_s=knobs.SAVE_DEADLINE.get(),
            flush_deadline_s=knobs.FLUSH_DEADLINE.get(),
            local_load_timeout_s=knobs.LOCAL_LOAD_TIMEOUT.get(),
            serve_tick_s=knobs.SERVE_TICK.get())

    def check(self) -> None:
        """One round of checks (every serve tick)."""
        self.writers.check_stalls(self.stall_timeout)
        self.writers.check_deadlines()  # a commit file's whole write
        now = time.time()
        if self.tier is not None:
            self.tier.admission.expire(now, knobs.STAGE_TIMEOUT.get())
        if self.local is not None:
            self.local.expire_fetches(now, knobs.LOCAL_LOAD_TIMEOUT.get())
        for request in self.table.in_flight():
            reason = self._overdue(request, now)
            if reason is not None:
                log.error("request %d (rank %d, %s): %s", request.id, request.rank,
                          request.path, reason)
                # A trainer past a deadline is silent, not gone: its copy may still land.
                self.lifecycle.fail(request, reason, trainer_may_copy=True)

    @staticmethod
    def _overdue(request: SaveRequest, now: float) -> str | None:
        if request.phase == Phase.WAITING_FOR_POOL:
            space_limit = knobs.STAGE_TIMEOUT.get()
            if now - request.created_at <= space_limit:
                return None
            return (f"no staging space within {space_limit:g}s (CKPTD_STAGE_TIMEOUT): "
                    f"{request.extent_length} bytes waited {now - request.created_at:.0f}s "
                    f"behind earlier saves that hold the pool; start ckptd with a larger "
                    f"--pool-size or save less often, then save again")
        save_limit = knobs.SAVE_DEADLINE.get()
        if request.phase != Phase.FLUSHING and now - request.created_at > save_limit:
            slowest = request.progress()["slowest_file"]
            where = (f"; its slowest file is {slowest['path']} (phase {slowest['phase']!r}, "
                     f"no progress for {slowest['age_s']:.0f}s)" if slowest else "")
            return (f"the save did not finish within {save_limit:g}s (CKPTD_SAVE_DEADLINE): "
                    f"phase {request.phase!r} after {now - request.created_at:.0f}s{where}; "
                    f"check the storage and the daemon's log, then save again")
        staging_limit = knobs.STAGING_DEADLINE.get()
        if request.phase == Phase.STAGING and request.lease is not None \
                and now - request.staging_since > staging_limit:
            waiting = [_COPIERS.get(c, c) for c in request.copiers if request.lease.has(c)]
            return (f"staging did not finish within {staging_limit:g}s "
                    f"(CKPTD_STAGING_DEADLINE): phase 'staging', still waiting for "
                    f"{' and '.join(waiting) or 'the copies'} after "
                    f"{now - request.staging_since:.0f}s; is the trainer process alive and "
                    f"not stopped? then save again")
        return None
