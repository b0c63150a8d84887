"""The trainer's own spans of a save, reported to the daemon for ``ckptd trace``.

The daemon sees staging, writes, replication and commits; only the trainer knows how long
it was blocked in the save call, how long planning took and how long finalize ran. Each
:class:`~ckpt_client.transport.handover.DaemonSave` collects ``[name, start, end]`` spans
(wall-clock seconds: the clock the daemon stamps its own spans with); when a call is
finalized, the queue sends them in one small ``trace_spans`` message per daemon. Best
effort: a daemon that is gone or refuses costs a log line at DEBUG, never the save.
"""

from __future__ import annotations

import logging

from ckptd.protocol import MessageType, TraceSpans
from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError

log = logging.getLogger(__name__)

#: Seconds to wait for the daemon's acknowledgement of a span report.
REPORT_TIMEOUT = 5.0


def note(saves, name: str, start: float, end: float) -> None:
    """Add the span ``name`` to every save of ``saves`` that reaches a daemon."""
    for save in saves:
        spans = getattr(save, "spans", None)
        if spans is not None and len(spans) < 100:
            spans.append([name, start, max(start, end)])


def report(saves) -> None:
    """Send the spans of ``saves`` to their daemons (one message per daemon)."""
    by_connection: dict = {}
    for save in saves:
        if getattr(save, "gave_up", False):  # its daemon did not answer: do not wait again
            continue
        if getattr(save, "spans", None) and getattr(save, "request_id", None) is not None:
            ids, spans = by_connection.setdefault(id(save.connection), (save.connection, [], []))[1:]
            ids.append(save.request_id)
            spans.extend(s for s in save.spans if s not in spans)
    for connection, ids, spans in by_connection.values():
        if getattr(connection, "not_answering", None) is not None:
            log.debug("spans of requests %s not reported: the daemon does not answer", ids)
            continue
        try:
            connection.call(MessageType.TRACE_SPANS, TraceSpans(request_ids=ids, spans=spans),
                            timeout=REPORT_TIMEOUT)
        except (DaemonRequestError, DaemonUnavailableError) as exc:
            log.debug("spans of requests %s not reported: %s", ids, exc)
