"""The ``LOCAL_FETCH`` calls waiting on the replicator: who asked, and their answers.

Owns the table of fetches in flight (fetch id -> the call, its request, and where a
corrupted copy was set aside): it numbers each new fetch, answers the call when the
replicator's :class:`FetchDone` comes, and fails the ones past their deadline. It never
talks to the network: :class:`ckptd.server.local.LocalService` sends the ``Fetch`` commands.
"""

from __future__ import annotations

import logging

from ckptd.protocol import ErrorCode, LocalFetch, LocalFetchReply
from ckptd.replication.commands import FetchDone
from ckptd.server.endpoint import Call

log = logging.getLogger(__name__)


class PendingFetches:
    """Fetches asked for and not yet answered, each answered exactly once."""

    def __init__(self) -> None:
        self._fetches: dict[int, tuple[Call, LocalFetch, str | None]] = {}
        self._next = 1

    def add(self, call: Call, body: LocalFetch, moved_aside: str | None) -> int:
        """Note a fetch about to be sent; returns its id for the ``Fetch`` command."""
        fetch_id, self._next = self._next, self._next + 1
        self._fetches[fetch_id] = (call, body, moved_aside)
        return fetch_id

    def expire(self, now: float, limit: float) -> None:
        """Fail the fetches still unanswered ``limit`` seconds after they were asked for:
        the daemon ends the wait (a holder that trickles bytes never trips the per-stream
        no-progress limit), so the trainer's own, longer wait never has to."""
        for fetch_id, (call, body, moved_aside) in list(self._fetches.items()):
            waited = now - call.received_at
            if waited <= limit:
                continue
            del self._fetches[fetch_id]  # a late FetchDone finds nothing to answer
            message = (f"fetching rank {body.owner}'s part of iteration {body.iteration} "
                       f"(session {body.session!r}) from {', '.join(body.holders) or 'no holder'} "
                       f"did not finish within {limit:g}s (CKPTD_LOCAL_LOAD_TIMEOUT)")
            log.error("%s", message)
            call.fail(ErrorCode.PART_UNAVAILABLE, message,
                      "check the peers' links and daemons (ckptd status on each node), then "
                      "load again, or load an older iteration or a persistent checkpoint",
                      rank=body.owner, iteration=body.iteration, holders_tried=[],
                      moved_aside=moved_aside)

    def done(self, event: FetchDone, store) -> None:
        """Answer the fetch ``event`` ends (``store`` gives the fetched file's identity)."""
        pending = self._fetches.pop(event.fetch_id, None)
        if pending is None:
            return
        call, body, moved_aside = pending
        if event.ok:
            log.info("got rank %d's part of iteration %d from %s", body.owner, body.iteration,
                     event.holder)
            call.reply(LocalFetchReply(path=event.path, holder=event.holder, tried=event.tried,
                                       moved_aside=moved_aside,
                                       identity=store.verified_file_identity(event.path)))
            return
        tried = "; ".join(f"{t['holder']}: {t['error']}" for t in event.tried) or "none"
        message = (f"rank {body.owner}'s part of iteration {body.iteration} (session "
                   f"{body.session!r}) is not available from any holder; holders tried: {tried}")
        log.error("%s", message)
        call.fail(ErrorCode.PART_UNAVAILABLE, message,
                  "no node holds a verified copy any more; load an older iteration or a "
                  "persistent checkpoint", rank=body.owner, iteration=body.iteration,
                  holders_tried=event.tried, moved_aside=moved_aside)
