"""Where this rank's local-checkpoint part comes from when it loads, in order of cost.

:class:`PartLoader` gets the part of a :class:`~ckpt_client.local.latest.Latest`: from
the daemon's staging pool (the memory tier), from this node's disk, or fetched by the
daemon from a holder (a corrupted copy here is set aside first). Every byte is read once
and checked against the part's checksum in the same pass
(:mod:`ckpt_client.local.part_file`): a byte that rotted on disk since the daemon last
verified the file is caught too. It fills the load report users read as
``LocalCheckpointManager.last_load_report``: ``source``, ``holder``, ``bytes``, and what
the fetch tried.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ckpt_client.transport import waits
from ckptd.checksum import ChecksumMismatchError
from ckptd.protocol import HeldPart, LocalFetch, MessageType
from ckpt_client.errors import DaemonUnavailableError
from ckpt_client.local.latest import NO_PEER_SOCKET, Latest
from ckpt_client.local.part_file import read_part, read_resident

log = logging.getLogger(__name__)


class PartLoader:
    """Loads this rank's part of a :class:`Latest` (see the module docstring).

    Parameters
    ----------
    session_id : str
        The local-checkpoint session.
    connect : callable
        Returns the connection to this node's daemon.
    own_address : str or None
        This node's daemon's peer address (never fetched from).
    """

    def __init__(self, session_id: str, connect: Callable, own_address: str | None) -> None:
        self.session_id = session_id
        self._connect = connect
        self._own_address = own_address

    def load(self, rank: int, latest: Latest, report: dict) -> tuple[dict, dict, str | None]:
        """``(state_dict, header, path)``; ``report`` gets ``source``, ``holder``, ``bytes``
        and the fetch's ``tried`` and ``moved_aside`` (``path`` is None from memory)."""
        part = latest.own_parts.get(rank)
        loaded = self._from_memory(rank, part)
        if loaded is not None:
            report.update(source="daemon_memory", bytes=int(part.resident["size"]))
            return (*loaded, None)
        path, damage = part.path if part is not None else None, None
        if path is not None:
            try:
                loaded = read_part(path)
            except ChecksumMismatchError as exc:  # corrupted since find_latest: heal it
                damage = exc
                log.warning("rank %d: own part of iteration %d is corrupted (%s); fetching a "
                            "verified copy from a peer", rank, latest.iteration, exc)
        if loaded is None:
            path = self._fetch(rank, latest, report, damage)
            try:
                loaded = read_part(path)
            except ChecksumMismatchError as exc:
                raise ChecksumMismatchError(f"rank {rank}, iteration {latest.iteration}: "
                                            f"{exc}") from None
        report["bytes"] = os.path.getsize(path)
        return (*loaded, path)

    def _from_memory(self, rank: int, part: HeldPart | None) -> tuple | None:
        """This rank's part copied out of the daemon's staging pool, or None (not there, or
        the memory changed since: the copy failed its checksum)."""
        if part is None or not part.resident:
            return None
        try:
            return read_resident(self._connect().pool, part.resident,
                                 f"rank {rank}'s part in the daemon's memory")
        except (ChecksumMismatchError, ValueError, DaemonUnavailableError, OSError) as exc:
            log.warning("rank %d: loading from the daemon's memory failed (%s); reading the "
                        "part from disk", rank, exc)
            return None

    def _fetch(self, rank: int, latest: Latest, report: dict,
               damage: ChecksumMismatchError | None) -> str:
        """Have the daemon fetch this rank's part from a holder (a corrupted copy here is
        set aside first); returns where it now is."""
        iteration = latest.iteration
        holders = [h for h in latest.holders.get(rank, [])
                   if h != self._own_address and not h.startswith(NO_PEER_SOCKET)]
        if damage is not None and not holders:
            raise ChecksumMismatchError(f"rank {rank}, iteration {iteration}: {damage} (and no "
                                        "other node holds a replica)")
        log.info("rank %d: part of iteration %d %s here; fetching from %s", rank, iteration,
                 "corrupted" if damage else "missing", holders)
        connection = self._connect()
        reply = connection.call(
            MessageType.LOCAL_FETCH, LocalFetch(session=self.session_id, iteration=iteration,
                                                owner=rank, holders=holders),
            timeout=waits.local_load(connection.deadlines))
        if reply.moved_aside:
            log.warning("rank %d: the corrupted part was moved aside to %s (kept for "
                        "inspection, never loaded)", rank, reply.moved_aside)
        report.update(source="peer", holder=reply.holder, tried=reply.tried,
                      moved_aside=reply.moved_aside)
        return reply.path
