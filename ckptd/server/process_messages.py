"""The process-level messages: trainers arriving and leaving, ping, status and trace.

Owns the answers to ``hello`` (register a trainer process), ``goodbye`` (it leaves: the
space reserved for copies that will never come is freed), ``ping`` and ``status``, the
status document ``ckptd status --json`` prints, ``trace`` (the recent saves' timeline,
``ckptd trace``) and ``trace_spans`` (a trainer's own spans of a save), and what happens to the saves of a trainer
that is gone. It must not start or stop components: :class:`ckptd.server.daemon.Daemon`,
the composition root, does that and routes these messages here.
"""

from __future__ import annotations

import logging
import os
import time

from ckptd import __version__, knobs
from ckptd.protocol import (Empty, Hello, HelloReply, MessageType, PingReply, Trace, TraceSpans,
                            TraceSpansReply)
from ckptd.server.endpoint import Call
from ckptd.server.ranks import RankInfo
from ckptd.server.requests import host_name

log = logging.getLogger(__name__)


class ProcessMessages:
    """Answers the process-level messages of one daemon.

    Parameters
    ----------
    daemon : Daemon
        Its components (ranks, request table, pool, writers, CUDA stager, local service).
    """

    def __init__(self, daemon) -> None:
        self.daemon = daemon

    def routes(self) -> dict:
        """Message type -> ``(body type, handler)`` for the daemon's handler table."""
        return {MessageType.HELLO: (Hello, self.on_hello),
                MessageType.GOODBYE: (Empty, self.on_goodbye),
                MessageType.PING: (Empty, self.on_ping),
                MessageType.STATUS: (Empty, self.on_status),
                MessageType.TRACE: (Trace, self.on_trace),
                MessageType.TRACE_SPANS: (TraceSpans, self.on_trace_spans)}

    def on_hello(self, call: Call, body: Hello) -> HelloReply:
        """Register a trainer process."""
        daemon = self.daemon
        rank = daemon.ranks.register(call.routing_id, body)
        log.info("rank %d registered (pid %d)", rank.rank, rank.pid)
        return HelloReply(daemon_pid=os.getpid(), incarnation=daemon.incarnation,
                          version=__version__, pool_path=daemon.pool.path,
                          pool_size=daemon.pool.size, writers=daemon.config.writers,
                          host=host_name(), cuda=daemon.cuda is not None,
                          cuda_devices=sorted(daemon.cuda.devices) if daemon.cuda is not None
                          else [], tiered=daemon.tier is not None,
                          deadlines=daemon.deadlines.enforced(),
                          poll_hold_s=max(0.0, knobs.POLL_HOLD_MAX.get()))

    def on_goodbye(self, call: Call, body: Empty) -> Empty:
        """A trainer disconnects: space reserved for copies that will never come is freed;
        writes already under way finish."""
        rank = self.daemon.ranks.remove(call.routing_id)
        if rank is not None:
            log.info("rank %d said goodbye", rank.rank)
            self._abandon(rank, "the trainer disconnected before staging finished",
                          only_unstaged=True)
        # A thread of this trainer may still wait on a held poll: it hears first.
        self.daemon.saves.polls.held.release_connection(call.routing_id)
        return Empty()

    def drop_gone_trainers(self) -> None:
        """Forget trainer processes that exited, and abort their in-flight saves."""
        for rank in self.daemon.ranks.gone():
            log.warning("rank %d (pid %d) is gone; aborting its in-flight saves", rank.rank,
                        rank.pid)
            self.daemon.ranks.remove(rank.routing_id)
            self._abandon(rank, f"trainer process {rank.pid} exited during the save")
            self.daemon.saves.polls.held.drop_connection(rank.routing_id)  # nobody reads them

    def _abandon(self, rank: RankInfo, reason: str, only_unstaged: bool = False) -> None:
        """Abort a forgotten trainer's saves (``only_unstaged``: those still waiting for
        its copies) and drop what the CUDA stager holds open for it."""
        daemon = self.daemon
        daemon.saves.abort_connection(rank.routing_id, reason, only_unstaged=only_unstaged)
        if daemon.cuda is not None:
            daemon.cuda.forget_process(rank.pid)

    def on_ping(self, call: Call, body: Empty) -> PingReply:
        """Liveness."""
        return PingReply(pid=os.getpid())

    def on_status(self, call: Call, body: Empty) -> dict:
        """The status document (a map: its schema is its own, documented for operators)."""
        return self.status()

    def on_trace(self, call: Call, body: Trace) -> dict:
        """The last saves' spans, as a Chrome trace-event document (a map: its schema is
        Chrome's, not a reply body)."""
        return {"traceEvents": self.daemon.table.timeline.trace_events(body.last),
                "displayTimeUnit": "ms"}

    def on_trace_spans(self, call: Call, body: TraceSpans) -> TraceSpansReply:
        """A trainer's own spans of a save it made through this daemon."""
        rank = self.daemon.ranks.of(call.routing_id)
        kept = self.daemon.table.timeline.add_trainer_spans(body.request_ids, rank.rank,
                                                            rank.pid, body.spans)
        return TraceSpansReply(kept=kept)

    def status(self) -> dict:
        """The status document ``ckptd status --json`` prints."""
        daemon = self.daemon
        pool, table = daemon.pool, daemon.table
        return table.snapshot(
            daemon.ranks.describe(lambda routing_id: len(table.of_connection(routing_id))),
            version=__version__, pid=os.getpid(), incarnation=daemon.incarnation,
            host=host_name(), socket=daemon.socket_path,
            started_at=daemon.started_at, uptime_s=time.time() - daemon.started_at,
            state="draining" if daemon.stopping_since is not None else "serving",
            roots=list(daemon.roots.roots),
            write_modes=dict(daemon.saves.writes.write_modes),
            pool=pool.describe(),
            writers=daemon.writers.describe(),
            deadlines={**daemon.deadlines.enforced().to_wire(),
                       "stuck_after_s": knobs.STUCK_AFTER.get()},
            stuck_writers=daemon.writers.stuck.describe(),
            held_polls=daemon.saves.polls.held.describe(),
            **daemon.local.status_sections(),
            tier=daemon.tier.describe() if daemon.tier is not None else None,
        )
