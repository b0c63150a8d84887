"""The memory tier: local parts kept in the staging pool after their save is done.

Owns which finished ``local`` saves keep their staging extent, through one more named hold
on its lease (:data:`ckptd.server.lifecycle.RESIDENT`), so that a trainer restarted on
this node while its daemon lives loads its part from shared memory instead of disk:

- a save that is done keeps its extent (``keep``), unless the tier is off
  (:data:`ckptd.knobs.MEMORY_TIER`) or saves are already waiting for space;
- when every rank committed an iteration, the older ones of that session let go
  (``committed``): only the latest committed checkpoint stays;
- a save that does not fit takes the space back (``reclaim``, oldest iteration first),
  and a stopping daemon lets go of everything (``release_all``): resident bytes never
  cost a save its space;
- ``lookup`` says where a committed part's bytes are in the pool, with the crc32 its
  writer recorded, which the loading trainer checks on its copy.

Every hold taken here is dropped exactly once, here (the lease gives the extent back when
its last hold drops). Runs on the serve loop; no I/O.
"""

from __future__ import annotations

import logging

from ckptd import knobs
from ckptd.protocol import Phase, SaveFormat
from ckptd.server.lifecycle import RESIDENT
from ckptd.server.requests import SaveRequest
from ckptd.staging.pool import StagingPool

log = logging.getLogger(__name__)


class ResidentParts:
    """Finished local parts whose bytes stay in the staging pool (see the module docstring).

    Parameters
    ----------
    pool : StagingPool
        The pool the extents belong to (for its queue of waiting saves).
    """

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self._parts: dict[tuple, SaveRequest] = {}  # (session, owner, iteration) -> request

    def keep(self, request: SaveRequest) -> None:
        """A save is done: keep its part in memory if it is a local part and space allows.

        Called while some other hold still keeps the extent (the lifecycle's ``on_done``).
        """
        if (request.format != SaveFormat.LOCAL or request.lease is None
                or request.lease.released or not knobs.MEMORY_TIER.get() or self.pool.waiting):
            return
        key = (request.session, request.rank, request.iteration)
        previous = self._parts.pop(key, None)
        if previous is not None:  # the same iteration saved again
            self._let_go(previous)
        request.lease.hold(RESIDENT)
        self._parts[key] = request

    def committed(self, session: str, iteration: int) -> None:
        """Every rank committed ``iteration``: older parts of the session let go."""
        for key in [k for k in self._parts if k[0] == session and k[2] < iteration]:
            self._let_go(self._parts.pop(key))

    def reclaim(self, length: int) -> bool:
        """Give back the oldest resident extent; False when none is left."""
        if not self._parts:
            return False
        key = min(self._parts, key=lambda k: (k[2], self._parts[k].id))
        log.info("memory tier: giving back rank %d's part of iteration %d (%d bytes) for a "
                 "save that needs %d bytes", key[1], key[2], self._parts[key].extent_length,
                 length)
        self._let_go(self._parts.pop(key))
        return True

    def release_all(self) -> None:
        """Let go of every resident part (the daemon is stopping)."""
        while self._parts:
            self._let_go(self._parts.pop(next(iter(self._parts))))

    def lookup(self, session: str, owner: int, iteration: int) -> dict | None:
        """Where ``owner``'s part of ``iteration`` is in the pool, or None.

        Returns
        -------
        dict or None
            ``items`` (``[pool offset, nbytes]`` of the header and each tensor, in part
            order), ``crc`` and ``size`` of the part as its writer recorded them.
        """
        request = self._parts.get((session, owner, iteration))
        if request is None or request.phase != Phase.DONE or request.extent is None \
                or len(request.written) != 1:
            return None
        base = request.extent.offset
        return {"items": [[base + offset, buffer[2]]
                          for offset, buffer in zip(request.offsets, request.buffers)],
                "crc": request.written[0]["crc32"], "size": request.written[0]["size"],
                "algorithm": request.written[0].get("algorithm", "crc32")}

    def describe(self) -> dict:
        """Resident parts and their bytes, for the status document."""
        return {"parts": len(self._parts),
                "bytes": sum(r.extent_length for r in self._parts.values())}

    @staticmethod
    def _let_go(request: SaveRequest) -> None:
        if request.lease is not None:
            request.lease.drop(RESIDENT)
