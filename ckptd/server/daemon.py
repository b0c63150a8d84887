"""The daemon process: wiring the components, readiness, housekeeping, a clean stop.

Owns the process's life: it creates the socket directory, the staging pool, the writer
processes, the CUDA stager (when there is a GPU), the local-checkpoint service (and its
replicator), binds the client endpoint, announces readiness, serves until SIGTERM (or the
idle timeout), drains in-flight saves for at most ``--drain-timeout``, and cleans up.
It routes every client message to the service that answers it (process-level messages:
:mod:`ckptd.server.process_messages`; saves; local checkpoints) and runs the housekeeping
tick: dead writers are replaced, the saves of trainers that died are aborted, unclaimed
results are dropped, metrics are exported.

Pattern: composition root. Everything that runs is registered on one
:class:`~ckptd.server.loop.EventLoop`; the components own their state.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import time

import zmq

from ckptd import __version__, knobs, protocol
from ckptd.metrics import MetricsExporter
from ckptd.protocol import Empty, MessageType
from ckptd.readiness import announce_ready, announce_stopping
from ckptd.server.config import DaemonConfig
from ckptd.server.deadlines import SaveDeadlines
from ckptd.server.endpoint import ClientEndpoint
from ckptd.server.local import LocalService
from ckptd.server.loop import EventLoop
from ckptd.server.predecessors import PredecessorSweeper
from ckptd.server.process_messages import ProcessMessages
from ckptd.server.ranks import RankRegistry
from ckptd.server.requests import RequestTable
from ckptd.server.saves import SaveService
from ckptd.staging import numa
from ckptd.staging.pool import StagingPool, pool_path_for_this_daemon
from ckptd.staging.pool_directory import check_pool_directory
from ckptd.storage.leftovers import WrittenDirectories
from ckptd.storage.roots import AllowedRoots
from ckptd.storage.writer_pool import WriterPool

log = logging.getLogger(__name__)


class AlreadyRunningError(RuntimeError):
    """Another daemon already answers on the configured socket."""


class Daemon:
    """A ckptd daemon for one node and job.

    Parameters
    ----------
    config : DaemonConfig
        Socket, roots, pool size, writers, and the rest of ``ckptd serve``'s options.
    """

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.socket_path = config.socket_path
        self.runtime_dir = os.path.dirname(self.socket_path)
        self.ready_file = config.ready_file or protocol.ready_file_for(self.socket_path)
        self.roots = AllowedRoots.of(config.roots)
        self.table = RequestTable()
        self.ranks = RankRegistry()
        self.started_at = time.time()
        #: Random per start: requests made for an earlier daemon at this socket are refused.
        self.incarnation = secrets.token_hex(8)
        self.stopping_since: float | None = None
        self.idle_since: float | None = time.monotonic()
        self.process = ProcessMessages(self)
        self.saves = SaveService(self)
        self.local = LocalService(self)
        self.loop = EventLoop()
        self.context: zmq.Context | None = None
        self.endpoint: ClientEndpoint | None = None
        self.pool: StagingPool | None = None
        self.writers: WriterPool | None = None
        self.journal: WrittenDirectories | None = None
        self.predecessors: PredecessorSweeper | None = None
        self.cuda = None
        self.placement = numa.Placement([0])  # one node until start() reads the machine
        self.metrics: MetricsExporter | None = None
        self.tier = None  # ckptd.tiers.service.TierService with --stage-dir
        self.deadlines: SaveDeadlines | None = None

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested (new saves are refused)."""
        return self.stopping_since is not None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Create the socket directory, pool and writers; bind; announce readiness.

        Raises
        ------
        AlreadyRunningError
            If a live daemon already serves the socket path.
        """
        protocol.ensure_private_dir(self.runtime_dir)
        endpoint = protocol.endpoint_for(self.socket_path)
        if os.path.exists(self.socket_path):
            if protocol.socket_is_live(self.socket_path):
                raise AlreadyRunningError(
                    f"another ckptd already serves {self.socket_path}; stop it first "
                    f"(ckptd status --socket {self.socket_path}) or choose another --socket")
            os.unlink(self.socket_path)  # stale, from a daemon that was killed
        pool_dir = check_pool_directory(self.config.pool_dir).path  # before sweeping it
        self.predecessors = PredecessorSweeper(self.runtime_dir, pool_dir)
        self.predecessors.sweep()
        self.journal = WrittenDirectories(self.runtime_dir)
        self.pool = StagingPool(pool_path_for_this_daemon(pool_dir), self.config.pool_size,
                                nodes=numa.online_nodes() if knobs.NUMA_PLACEMENT.get() else None)
        self.context = zmq.Context()
        self.writers = WriterPool(self.config.writers, self.context, self.runtime_dir,
                                  self.pool.path, self.pool.size, self.config.log_level,
                                  self.journal)
        self.writers.wait_ready(self.config.writer_start_timeout)
        self.cuda = self._start_cuda_stager()
        self.placement = numa.Placement([r.node for r in self.pool.regions] or [0],
                                        self.cuda.device_nodes if self.cuda else {})
        self.saves.start()
        self._start_tier()
        self.deadlines = SaveDeadlines(self.table, self.saves.lifecycle, self.writers,
                                       self.config.stall_timeout, self.tier, self.local)
        self.local.start()  # node-local store; peer socket and replicator with --peer-listen
        self._wire_endpoint()
        self.endpoint.bind(endpoint)
        os.chmod(self.socket_path, 0o600)
        self._register_with_loop()
        if self.config.metrics_textfile or self.config.metrics_listen:
            self.metrics = MetricsExporter(self.config.metrics_textfile, self.config.metrics_listen,
                                           self.config.metrics_labels)
            self.metrics.start()
        # What exists now lives as long as the daemon: kept out of the collector's full
        # passes, which otherwise walk these ~34,000 objects again every few saves (about
        # 12 ms each here) to find nothing.
        gc.freeze()
        announce_ready(self.socket_path, self.ready_file,
                       {"pid": os.getpid(), "incarnation": self.incarnation,
                        "version": __version__, "pool": self.pool.path,
                        "pool_size": self.pool.size, "writers": self.config.writers})
        log.info("serving %s: pool %d MiB at %s, %d writers, roots %s", self.socket_path,
                 self.pool.size >> 20, self.pool.path, self.config.writers,
                 ", ".join(self.roots.roots))

    def _start_tier(self) -> None:
        if not self.config.stage_dir:
            return
        from ckptd.tiers.service import TierService
        from ckptd.tiers.stage import StageDir

        stage = StageDir(self.config.stage_dir, self.config.stage_budget)
        self.tier = TierService(self, stage, self.config.stage_policy, self.config.keep_last)
        self.tier.start(self.context)
        log.info("tiered saves: stage directory %s, budget %d MiB, policy %s", stage.path,
                 stage.budget >> 20, self.config.stage_policy)

    def _start_cuda_stager(self):
        try:
            from ckptd.staging.cuda import CudaStager
        except ImportError:
            return None
        return CudaStager.create_if_available(self.pool)

    def _wire_endpoint(self) -> None:
        self.endpoint = ClientEndpoint(self.context, self.incarnation)
        for message_type, (body_type, handler) in self.process.routes().items():
            self.endpoint.route(body_type, handler, message_type)
        self.endpoint.route(Empty, self.local.on_peer_info, MessageType.PEER_INFO)
        for routes in (self.saves.routes(), self.local.routes()):
            for body_type, handler in routes.items():
                self.endpoint.route(body_type, handler)

    def _register_with_loop(self) -> None:
        self.loop.watch(self.endpoint.socket, self.endpoint.serve_one)
        self.writers.attach(lambda sock: self.loop.watch(sock, lambda: self.writers.handle(sock)),
                            self.loop.unwatch)
        if self.cuda is not None:
            self.loop.watch(self.cuda.results.doorbell,
                            lambda: self.cuda.results.drain(self.saves.device.on_copied))
        if self.local.replicator is not None:
            events = self.local.replicator.events
            self.loop.watch(events.doorbell, lambda: events.drain(self.local.on_event))
        if self.tier is not None:
            results = self.tier.flusher.results
            self.loop.watch(results.doorbell, lambda: results.drain(self.tier.flusher.on_result))
        self.loop.every(knobs.SERVE_TICK.get, self._tick)
        self.loop.when_due(self.saves.polls.held.next_due, self.saves.polls.held.expire)
        self.loop.after_round(self.saves.polls.held.answer_changed)

    def request_stop(self, *_: object) -> None:
        """Begin a graceful stop: refuse new saves, drain in-flight ones."""
        if self.stopping_since is None:
            log.info("stop requested: draining %d in-flight request(s), at most %.0fs",
                     len(self.table.in_flight()), self.config.drain_timeout)
            self.stopping_since = time.monotonic()
            self.local.release_resident()  # parts kept in memory must not hold the drain up

    def serve_forever(self) -> None:
        """Run until stopped by SIGTERM/SIGINT or the idle timeout."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        try:
            self.loop.run(self._finished_stopping)
        finally:
            self.shutdown()

    def _finished_stopping(self) -> bool:
        if self.stopping_since is None:
            return False
        # Aborted or failed requests may still have a device copy, a writer job or a push
        # on their extent: wait for those answers too, so outputs are removed, not left.
        if not self.table.in_flight() and not self.table.holding_space() \
                and not self.writers.jobs_in_flight:
            return True
        if time.monotonic() - self.stopping_since > self.config.drain_timeout:
            self.saves.abandon_all("ckptd shut down before this save finished")
            return True
        return False

    def shutdown(self) -> None:
        """Stop writers, close sockets, unlink the pool and the socket file."""
        announce_stopping(self.ready_file)
        if self.metrics is not None:
            self.metrics.close()  # publishes ckptd_up 0
        if self.tier is not None:
            self.tier.close()
        if self.writers is not None:
            self.writers.stop()
        for request in list(self.table.requests.values()):
            if request.finished and request.phase != protocol.Phase.DONE:
                self.saves.remove_outputs(request)
        if self.cuda is not None:
            self.cuda.close()
        self.local.stop()
        if self.endpoint is not None:
            self.saves.polls.held.close()  # every held poll answered before the socket goes
            self.endpoint.close(linger=knobs.STOP_LINGER.get())
        if self.context is not None:
            self.context.term()
        if self.pool is not None:
            self.pool.close()
        if self.journal is not None:
            self.journal.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        log.info("stopped")

    def note_busy(self) -> None:
        """A save arrived: the idle timer restarts."""
        self.idle_since = None

    # ------------------------------------------------------------------ housekeeping
    def _tick(self) -> None:
        if self.stopping_since is None:
            self.writers.reap_dead()
            self.predecessors.tick()
        self.deadlines.check()
        self.local.note_push_progress()
        self.process.drop_gone_trainers()
        self.table.forget_unclaimed(time.time())
        if self.tier is not None:
            self.tier.flusher.tick()
        self._check_idle()
        if self.metrics is not None:
            self.metrics.tick([r.describe() for r in (*self.table.requests.values(),
                                                      *self.table.recent)],
                              self.process.status)

    def _check_idle(self) -> None:
        if self.config.exit_when_idle is None:
            return
        if len(self.ranks) or self.table.in_flight():
            self.idle_since = None
            return
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since > self.config.exit_when_idle:
            log.info("no trainers for %.0fs; exiting", self.config.exit_when_idle)
            self.request_stop()
