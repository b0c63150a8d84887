"""What earlier daemons that died left behind: their staging pools and writers' temporaries.

A SIGKILLed daemon cannot unlink its staging pool (in the pool directory), and its writers may leave hidden
temporaries. Its successor sweeps both at start. A predecessor killed a moment before the
restart may still be exiting then (unmapping a large pool takes a while; a writer in the
middle of an fsync dies only when the call returns), and a leftover is only removed once
its owner is provably gone, so whatever was still owned at start is swept again every
few seconds until nothing of a dead predecessor is left. Without the second look, two
kills close together, or a kill during start-up, left RAM the node never got back until
the job's epilog.

Owns the sweeping schedule; what counts as dead and how to remove it safely belongs to
:func:`ckptd.staging.pool.remove_stale_pools` and
:meth:`ckptd.storage.leftovers.WrittenDirectories.sweep_predecessors`.
"""

from __future__ import annotations

import logging
import os
import time

from ckptd import knobs
from ckptd.staging.pool import remove_stale_pools
from ckptd.storage.leftovers import WrittenDirectories

log = logging.getLogger(__name__)


class PredecessorSweeper:
    """Sweeps dead predecessors' pools and temporaries now, and again while any wait.

    Parameters
    ----------
    runtime_dir : str
        The daemon's runtime directory (where predecessors' journals are).
    pool_dir : str
        The directory staging pools are made in (``--pool-dir``).
    """

    def __init__(self, runtime_dir: str, pool_dir: str) -> None:
        self.runtime_dir, self.pool_dir = runtime_dir, pool_dir
        self.waiting_pools: list[int] = []     # pids of other daemons whose pool stays
        self.waiting_journals: list[int] = []  # predecessors (or their writers) still running
        self._next_at = 0.0

    @property
    def pending(self) -> bool:
        """Whether a later sweep may still find something to remove."""
        return bool(self.waiting_pools or self.waiting_journals)

    def sweep(self) -> None:
        """Remove every leftover whose owner is gone; note the ones to look at again."""
        self.waiting_pools = []
        for directory in self._pool_directories():
            self.waiting_pools += remove_stale_pools(directory)[1]
        _, waiting = WrittenDirectories.sweep_predecessors(self.runtime_dir)
        if waiting and waiting != self.waiting_journals:
            log.info("earlier ckptd(s) at this socket (pid %s) or their writers still run; "
                     "their temporaries are swept once they are gone",
                     ", ".join(map(str, waiting)))
        self.waiting_journals = waiting
        self._next_at = time.monotonic() + knobs.LEFTOVER_SWEEP_INTERVAL.get()

    def _pool_directories(self) -> list[str]:
        """The pool directory, and the default one where a daemon from before a change of
        ``--pool-dir`` left its pool (no daemon would ever sweep it otherwise)."""
        default = knobs.POOL_DIR.default
        same = os.path.realpath(default) == os.path.realpath(self.pool_dir)
        return [self.pool_dir] if same or not os.path.isdir(default) else [self.pool_dir, default]

    def tick(self) -> None:
        """Housekeeping: sweep again when something waited and the interval passed."""
        if self.pending and time.monotonic() >= self._next_at:
            self.sweep()
