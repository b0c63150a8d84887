"""The serve loop: one ROUTER socket, one dispatch table, every request gets a reply.

Owns the daemon's life (start, readiness, SIGTERM drain, clean exit) and the lifecycle of
each save request: reserve staging space (or queue for it), learn that the client
copied its tensors in, hand files to the writer pool, collect results, release space.
A tick every :data:`TICK_SECONDS` checks that registered trainers and writer processes
are alive, aborting what belongs to the dead.

Pattern: ipyparallel's hub: ``msg_type -> handler``; a handler returns a reply body,
or :data:`DEFERRED` when the reply comes later (waiting for pool space, for a file to be
durable); any exception becomes a structured error reply and the loop keeps serving.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from ckptd import __version__, protocol
from ckptd.ledger import Ledger, RankInfo, SaveRequest, host_name
from ckptd.local_service import LocalCheckpoints
from ckptd.metrics import MetricsExporter
from ckptd.pool import PoolTooSmallError, StagingPool, pool_path_for_this_daemon, remove_stale_pools
from ckptd.protocol import ErrorCode, MessageType, Phase, SaveFormat
from ckptd.readiness import announce_ready, announce_stopping
from ckptd.roots import AllowedRoots, PathRefusedError
from ckptd.writers import WRITE_BYTES, WRITE_DCP, WRITE_TORCH, WriteJob, WriterPool, remove_written

log = logging.getLogger(__name__)

TICK_SECONDS = 0.25
DEFERRED = object()
#: Finished requests nobody asked about are dropped after this long.
UNCLAIMED_RESULT_SECONDS = 3600.0


class RequestError(Exception):
    """A request the daemon refuses; becomes an error reply."""

    def __init__(self, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.hint = code, message, hint


@dataclass
class DaemonConfig:
    """Everything ``ckptd serve`` can be told."""

    socket_path: str
    roots: list
    pool_size: int = 1 << 30
    writers: int = 2
    local_dir: str | None = None
    peer_listen: str | None = None
    log_level: str = "INFO"
    exit_when_idle: float | None = None
    drain_timeout: float = 60.0
    ready_file: str | None = None
    metrics_textfile: str | None = None  # node-exporter textfile, rewritten atomically
    metrics_listen: tuple | None = None  # (host, port), checked by metrics.parse_listen_address
    metrics_labels: dict = field(default_factory=dict)  # added to every metric sample
    writer_start_timeout: float = 120.0


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
        self.ledger = Ledger()
        self.started_at = time.time()
        self.stopping_since: float | None = None
        self.idle_since = time.monotonic()
        self.local = LocalCheckpoints(self)
        self.handlers: dict[str, Callable] = {
            MessageType.HELLO: self.on_hello,
            MessageType.GOODBYE: self.on_goodbye,
            MessageType.STAGE: self.on_stage,
            MessageType.STAGED: self.on_staged,
            MessageType.POLL: self.on_poll,
            MessageType.FORGET: self.on_forget,
            MessageType.ABORT: self.on_abort,
            MessageType.COMMIT_FILE: self.on_commit_file,
            MessageType.STATUS: self.on_status,
            MessageType.PING: self.on_ping,
            MessageType.PEER_INFO: self.local.on_peer_info,
            MessageType.LOCAL_SESSION: self.local.on_local_session,
            MessageType.LOCAL_INVENTORY: self.local.on_local_inventory,
            MessageType.LOCAL_FETCH: self.local.on_local_fetch,
            MessageType.LOCAL_COMMIT: self.local.on_local_commit,
        }
        self.context: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.pool: StagingPool | None = None
        self.writers: WriterPool | None = None
        self.cuda = None
        self.metrics: MetricsExporter | None = None

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
        remove_stale_pools()
        pool_path = pool_path_for_this_daemon()
        self.pool = StagingPool(pool_path, self.config.pool_size)
        self.context = zmq.Context()
        self.writers = WriterPool(self.config.writers, self.context, self.runtime_dir,
                                  pool_path, self.pool.size, self.config.log_level)
        self.writers.wait_ready(self.config.writer_start_timeout)
        self.cuda = self._start_cuda_stager()
        self.local.start()  # node-local store; peer socket and replicator with --peer-listen
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(endpoint)
        os.chmod(self.socket_path, 0o600)
        if self.config.metrics_textfile or self.config.metrics_listen:
            self.metrics = MetricsExporter(self.config.metrics_textfile, self.config.metrics_listen,
                                           self.config.metrics_labels)
            self.metrics.start()
        announce_ready(self.socket_path, self.ready_file,
                       {"pid": os.getpid(), "version": __version__, "pool": pool_path,
                        "pool_size": self.pool.size, "writers": self.config.writers})
        log.info("serving %s: pool %d MiB at %s, %d writers, roots %s", self.socket_path,
                 self.pool.size >> 20, pool_path, self.config.writers, ", ".join(self.roots.roots))

    def _start_cuda_stager(self):
        try:
            from ckptd.cuda_staging import CudaStager
        except ImportError:
            return None
        return CudaStager.create_if_available(self.pool)

    def request_stop(self, *_: object) -> None:
        """Begin a graceful stop: refuse new saves, drain in-flight ones."""
        if self.stopping_since is None:
            log.info("stop requested: draining %d in-flight request(s), at most %.0fs",
                     len(self.ledger.in_flight()), self.config.drain_timeout)
            self.stopping_since = time.monotonic()

    def serve_forever(self) -> None:
        """Run until stopped by SIGTERM/SIGINT or the idle timeout."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        for sock in self.writers.sockets:
            poller.register(sock, zmq.POLLIN)
        if self.cuda is not None:
            poller.register(self.cuda.wake_socket, zmq.POLLIN)
        if self.local.wake_socket is not None:
            poller.register(self.local.wake_socket, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._finished_stopping():
                for sock, _ in poller.poll(int(TICK_SECONDS * 1000)):
                    self._keep_serving(self._handle_ready_socket, sock)
                if time.monotonic() >= next_tick:
                    self._keep_serving(self._tick)
                    next_tick = time.monotonic() + TICK_SECONDS
        finally:
            self.shutdown()

    def _handle_ready_socket(self, sock: zmq.Socket) -> None:
        if sock is self.router:
            self._serve_one()
        elif self.cuda is not None and sock is self.cuda.wake_socket:
            self.cuda.drain(self._on_cuda_staged)
        elif sock is self.local.wake_socket:
            self.local.drain()
        else:
            self.writers.handle(sock)

    @staticmethod
    def _keep_serving(step: Callable, *args) -> None:
        """Run one step of the loop; a bug in it is logged, and the daemon keeps serving."""
        try:
            step(*args)
        except Exception:
            log.exception("internal error in %s; the daemon keeps serving", step.__name__)

    def _finished_stopping(self) -> bool:
        if self.stopping_since is None:
            return False
        # Aborted or failed requests may still have a writer job that renames a file:
        # wait for those answers too, so their outputs are removed, not left behind.
        if not self.ledger.in_flight() and not self.writers.jobs_in_flight:
            return True
        if time.monotonic() - self.stopping_since > self.config.drain_timeout:
            self._abandon_in_flight()
            return True
        return False

    def _abandon_in_flight(self) -> None:
        for request in self.ledger.in_flight():
            log.warning("request %d (rank %d, %s) abandoned at shutdown in phase %s",
                        request.id, request.rank, request.path, request.phase)
            self._fail(request, "ckptd shut down before this save finished")

    def shutdown(self) -> None:
        """Stop writers, close sockets, unlink the pool and the socket file."""
        announce_stopping(self.ready_file)
        if self.metrics is not None:
            self.metrics.close()  # publishes ckptd_up 0
        if self.writers is not None:
            self.writers.stop()
        for request in list(self.ledger.requests.values()):
            if request.phase in (Phase.FAILED, Phase.ABORTED):
                self._remove_outputs(request)
        if self.cuda is not None:
            self.cuda.close()
        self.local.stop()
        if self.router is not None:
            self.router.close()
        if self.context is not None:
            self.context.term()
        if self.pool is not None:
            self.pool.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        log.info("stopped")

    # ------------------------------------------------------------------ messaging
    def _serve_one(self) -> None:
        frames = self.router.recv_multipart(copy=False)
        identity, payload = frames[0].bytes, frames[1:]
        msg_id = -1
        try:
            message = protocol.decode([f.buffer for f in payload])
            msg_id = message.id
            handler = self.handlers.get(message.type)
            if handler is None:
                raise RequestError(ErrorCode.UNKNOWN_TYPE,
                                   f"unknown message type {message.type!r}",
                                   f"known types: {', '.join(sorted(self.handlers))}")
            reply = handler(identity, message)
        except (protocol.ProtocolError, RequestError) as exc:
            log.warning("refused a message from %s: %s", identity.hex(), exc.message)
            self._send(identity, MessageType.ERROR, msg_id,
                       protocol.error_body(exc.code, exc.message, exc.hint))
            return
        except Exception as exc:  # keep serving whatever one handler did
            log.exception("handler failed for message %d", msg_id)
            self._send(identity, MessageType.ERROR, msg_id,
                       protocol.error_body(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",
                                           "this is a ckptd bug; the daemon keeps serving"))
            return
        if reply is not DEFERRED:
            self._send(identity, MessageType.REPLY, msg_id, reply)

    def _send(self, identity: bytes, msg_type: str, msg_id: int, body: dict) -> None:
        try:
            self.router.send_multipart([identity, *protocol.encode(msg_type, msg_id, body)])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that client is gone
            log.info("could not reply to %s (message %d): %s", identity.hex(), msg_id, exc)

    def _reply_later(self, request: SaveRequest, body: dict, error: bool = False) -> None:
        if request.reply_to is None:
            return
        identity, msg_id = request.reply_to
        request.reply_to = None
        self._send(identity, MessageType.ERROR if error else MessageType.REPLY, msg_id, body)

    # ------------------------------------------------------------------ handlers
    def _rank_of(self, identity: bytes) -> RankInfo:
        rank = self.ledger.ranks.get(identity)
        if rank is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, "this connection has not said hello",
                               "call ckpt_client.connect() before saving")
        return rank

    def _own_request(self, identity: bytes, request_id) -> SaveRequest:
        request = self.ledger.requests.get(request_id)
        if request is None or request.identity != identity:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST,
                               f"no request {request_id!r} of this connection is known",
                               "was the daemon restarted? save again")
        return request

    def on_hello(self, identity: bytes, msg: protocol.Message) -> dict:
        body = msg.body
        try:
            rank = RankInfo(identity, int(body["rank"]), int(body["pid"]),
                            int(body.get("world_size", 1)))
        except (KeyError, TypeError, ValueError):
            raise RequestError(ErrorCode.BAD_REQUEST, "hello needs integer 'rank' and 'pid'")
        self.ledger.ranks[identity] = rank
        log.info("rank %d registered (pid %d)", rank.rank, rank.pid)
        return {"daemon_pid": os.getpid(), "version": __version__, "pool_path": self.pool.path,
                "pool_size": self.pool.size, "writers": self.config.writers,
                "host": host_name(), "cuda": self.cuda is not None}

    def on_goodbye(self, identity: bytes, msg: protocol.Message) -> dict:
        rank = self.ledger.ranks.pop(identity, None)
        if rank is not None:
            log.info("rank %d said goodbye", rank.rank)
            for request in self.ledger.in_flight():
                # Writes already under way finish; space reserved for a copy that will
                # never come is given back.
                if request.identity == identity and request.phase in (Phase.STAGING,
                                                                      Phase.WAITING_FOR_POOL):
                    self._abort(request, "the trainer disconnected before staging finished")
            if self.cuda is not None:
                self.cuda.forget_process(rank.pid)
        return {}

    def on_ping(self, identity: bytes, msg: protocol.Message) -> dict:
        return {"pid": os.getpid()}

    def on_status(self, identity: bytes, msg: protocol.Message) -> dict:
        return self.status()

    def on_stage(self, identity: bytes, msg: protocol.Message):
        rank = self._rank_of(identity)
        if self.stopping_since is not None:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "ckptd is shutting down",
                               "the save was not started; retry once a daemon is running")
        request = self._new_request(rank, msg.body)
        try:
            extent = self.pool.try_allocate(request.extent_length)
        except PoolTooSmallError as exc:
            raise RequestError(ErrorCode.POOL_TOO_SMALL, f"rank {rank.rank}: {exc}",
                               "or save fewer bytes per rank at once") from None
        self.ledger.requests[request.id] = request
        self.idle_since = None
        if request.transport == "cuda":
            return self._stage_cuda(request, msg, extent)
        if extent is None:
            request.phase = Phase.WAITING_FOR_POOL
            request.reply_to = (identity, msg.id)
            self.pool.wait_for(request.extent_length, request)
            log.info("request %d (rank %d) waits for %d bytes of staging space",
                     request.id, rank.rank, request.extent_length)
            return DEFERRED
        request.extent = extent
        log.info("request %d (rank %d) staging %d bytes for %s", request.id, rank.rank,
                 request.bytes_total, request.path)
        return self._extent_reply(request)

    def _extent_reply(self, request: SaveRequest) -> dict:
        return {"request_id": request.id, "offset": request.extent.offset,
                "length": request.extent.length, "phase": request.phase}

    def _new_request(self, rank: RankInfo, body: dict) -> SaveRequest:
        fmt = body.get("format")
        if fmt not in (SaveFormat.TORCH, SaveFormat.DCP, SaveFormat.LOCAL):
            raise RequestError(ErrorCode.BAD_REQUEST, f"unknown save format {fmt!r}")
        local = None
        try:
            if fmt == SaveFormat.LOCAL:  # the store names the part: session, iteration, rank
                path, local = self.local.part_path_for(rank.rank, body)
            else:
                path = self.roots.check(body.get("path"))
        except PathRefusedError as exc:
            raise RequestError(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
        buffers = _validated_buffers(body.get("buffers"))
        files = _validated_files(body.get("files", []), len(buffers)) if fmt == SaveFormat.DCP else []
        skeleton = body.get("skeleton", b"")
        if fmt == SaveFormat.TORCH and not isinstance(skeleton, bytes):
            raise RequestError(ErrorCode.BAD_REQUEST, "torch saves need a 'skeleton' (bytes)")
        offsets, length = protocol.layout_extent([b[2] for b in buffers])
        return SaveRequest(
            id=self.ledger.new_request_id(), rank=rank.rank, identity=rank.identity,
            format=fmt, path=path, buffers=buffers, offsets=offsets, extent_length=length,
            skeleton=skeleton, files=files, transport=body.get("transport", "shm"), local=local,
            stock_files=fmt == SaveFormat.DCP and bool(body.get(protocol.STOCK_FILES)))

    def on_staged(self, identity: bytes, msg: protocol.Message) -> dict:
        request = self._own_request(identity, msg.body.get("request_id"))
        if request.phase != Phase.STAGING:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"request {request.id} is {request.phase}, not staging")
        self._start_writing(request)
        return {"request_id": request.id, "phase": request.phase}

    def on_poll(self, identity: bytes, msg: protocol.Message) -> dict:
        ids = msg.body.get("request_ids", [])
        if not isinstance(ids, list):
            raise RequestError(ErrorCode.BAD_REQUEST, "'request_ids' must be a list")
        return {"requests": {rid: self._poll_entry(rid) for rid in ids}}

    def _poll_entry(self, request_id) -> dict:
        request = self.ledger.requests.get(request_id)
        if request is None:
            return {"phase": "unknown", "error": f"ckptd (pid {os.getpid()}) has no request "
                    f"{request_id}; the daemon that took it is gone"}
        entry = {"phase": request.phase, "bytes_total": request.bytes_total,
                 "bytes_written": request.bytes_written, "error": request.error,
                 "errors": request.errors,
                 # nothing of it runs any more: writes answered, outputs of a failed or
                 # aborted save removed, staging space freed
                 "settled": request.extent is None}
        if request.phase == Phase.DONE:
            entry["written"] = request.written
        if request.replication is not None:
            entry["replication"] = request.replication
        return entry

    def on_forget(self, identity: bytes, msg: protocol.Message) -> dict:
        forgotten = []
        for request_id in msg.body.get("request_ids", []):
            request = self.ledger.requests.get(request_id)
            if request is None or request.identity != identity or request.phase not in Phase.FINISHED:
                continue
            if msg.body.get("delete_files"):
                self._remove_outputs(request)
            self.ledger.forget(request_id)
            forgotten.append(request_id)
        return {"forgotten": forgotten}

    def on_abort(self, identity: bytes, msg: protocol.Message) -> dict:
        self._rank_of(identity)
        ids = msg.body.get("request_ids")
        aborted = []
        for request in list(self.ledger.in_flight()):
            if request.identity == identity and (ids is None or request.id in ids):
                self._abort(request, "aborted by the trainer (close(abort=True))")
                aborted.append(request.id)
        return {"aborted": aborted}

    def on_commit_file(self, identity: bytes, msg: protocol.Message):
        rank = self._rank_of(identity)
        try:
            path = self.roots.check(msg.body.get("path"))
        except PathRefusedError as exc:
            raise RequestError(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
        if len(msg.frames) != 1:
            raise RequestError(ErrorCode.BAD_REQUEST, "commit_file needs exactly one payload frame")

        def reply_when_durable(job: WriteJob, result: dict) -> None:
            if result.get("ok"):
                log.info("committed %s for rank %d", path, rank.rank)
                self._send(identity, MessageType.REPLY, msg.id, {"path": path, "size": result["size"]})
            else:
                self._send(identity, MessageType.ERROR, msg.id, protocol.error_body(
                    ErrorCode.WRITE_FAILED, f"could not write {path}: {result['error']}",
                    "check free space and permissions of the checkpoint directory",
                    errno=result.get("errno"), path=path))

        stock = bool(msg.body.get(protocol.STOCK_FILES))
        self.writers.submit(WriteJob(WRITE_BYTES, {"path": path, "stock": stock}, reply_when_durable,
                                     frames=[bytes(msg.frames[0])]))
        return DEFERRED

    # ------------------------------------------------------------------ save life cycle
    def _stage_cuda(self, request: SaveRequest, msg: protocol.Message, extent):
        specs = msg.body.get("cuda")
        refusal = None
        if self.cuda is None:
            refusal = RequestError(ErrorCode.BAD_REQUEST, "this daemon has no CUDA device",
                                   "send CPU copies through the staging pool instead")
        elif extent is None:
            refusal = RequestError(ErrorCode.POOL_TOO_SMALL,
                                   "staging pool is full; CUDA staging does not queue",
                                   "finalize earlier saves first or raise --pool-size")
        elif not isinstance(specs, list) or len(specs) != len(request.buffers):
            refusal = RequestError(ErrorCode.BAD_REQUEST, "'cuda' must describe every buffer, in order")
        if refusal is not None:
            self.ledger.requests.pop(request.id, None)
            if extent is not None:
                self._release(extent)
            raise refusal
        request.extent = extent
        request.reply_to = (request.identity, msg.id)
        request.device_copy_pending = True
        self.cuda.submit(request, specs, self.ledger.ranks[request.identity].pid)
        return DEFERRED

    def _on_cuda_staged(self, request: SaveRequest, error: str | None) -> None:
        request.device_copy_pending = False
        if request.phase != Phase.STAGING:
            # Aborted or failed while the copy ran: only now is the extent free to reuse.
            self.ledger.record_outcome(request)
            self._release_extent_of(request)
            self._reply_later(request, protocol.error_body(
                ErrorCode.INTERNAL, request.error or f"request {request.id} was {request.phase}"),
                error=True)
            return
        if error:
            self._fail(request, error)
            self._reply_later(request, protocol.error_body(ErrorCode.INTERNAL, error), error=True)
            return
        self._start_writing(request)
        self._reply_later(request, {"request_id": request.id, "phase": request.phase})

    def _start_writing(self, request: SaveRequest) -> None:
        request.staged_at = time.time()
        request.phase = Phase.WRITING
        jobs = list(self._jobs_for(request))
        request.jobs_pending = len(jobs)
        self.local.start_replication(request)  # local parts: stream to peers while writing
        log.info("request %d (rank %d) staged in %.3fs; writing %d file(s)", request.id,
                 request.rank, request.staged_at - request.created_at, len(jobs))
        for job in jobs:
            self.writers.submit(job)
        if not jobs:
            self._settle(request)

    def _jobs_for(self, request: SaveRequest):
        base = request.extent.offset

        def spec(index: int) -> list:
            dtype, shape, nbytes = request.buffers[index]
            return [base + request.offsets[index], nbytes, dtype, shape]

        on_done = self._job_done(request)
        if request.format == SaveFormat.LOCAL:  # a part is its buffers back to back, raw
            yield WriteJob(WRITE_DCP, {"path": request.path, "name": os.path.basename(request.path),
                                       "items": [[base + request.offsets[i], b[2], "bytes", [b[2]]]
                                                 for i, b in enumerate(request.buffers)],
                                       "bytes": request.bytes_total}, on_done)
            return
        if request.format == SaveFormat.TORCH:
            yield WriteJob(WRITE_TORCH, {"path": request.path, "skeleton": request.skeleton,
                                         "tensors": [spec(i) for i in range(len(request.buffers))],
                                         "bytes": request.bytes_total}, on_done)
            return
        for name, indices in request.files:
            yield WriteJob(WRITE_DCP, {"path": os.path.join(request.path, name), "name": name,
                                       "items": [spec(i) for i in indices],
                                       "stock": request.stock_files,
                                       "bytes": sum(request.buffers[i][2] for i in indices)},
                           on_done)

    def _job_done(self, request: SaveRequest):
        def on_done(job: WriteJob, result: dict) -> None:
            request.jobs_pending -= 1
            if result.get("ok"):
                request.bytes_written += job.body["bytes"]
                request.written.append({"name": job.body.get("name"), "path": result["path"],
                                        "size": result["size"], "crc32": result["crc32"],
                                        "items": result.get("items"),
                                        "file_id": result.get("file_id")})
            else:
                errno_text = f" errno {result['errno']}" if result.get("errno") else ""
                request.errors.append({
                    "rank": request.rank, "path": result.get("path"), "errno": result.get("errno"),
                    "message": f"rank {request.rank}: writing {result.get('path')} failed:"
                               f"{errno_text} {result.get('error')}"})
            if request.jobs_pending == 0:
                self._settle(request)
        return on_done

    def _settle(self, request: SaveRequest) -> None:
        """All writes of ``request`` returned: decide its outcome and free its space."""
        if self.local.holds_back_settle(request):
            return  # replicas still streaming from the extent; settles when they answer
        if request.phase == Phase.ABORTED:
            self._remove_outputs(request)
        elif request.errors:
            self._remove_outputs(request)  # nothing from a failed save stays
            request.finish(Phase.FAILED)
            log.error("request %d (rank %d) failed: %s", request.id, request.rank, request.error)
        else:
            request.finish(Phase.DONE)
            log.info("request %d (rank %d) durable: %d bytes in %.3fs after staging",
                     request.id, request.rank, request.bytes_written,
                     request.finished_at - request.staged_at)
        self.ledger.record_outcome(request)
        self._release_extent_of(request)

    def _release_extent_of(self, request: SaveRequest) -> None:
        if request.extent is not None:
            extent, request.extent = request.extent, None
            self._release(extent)

    def _release(self, extent) -> None:
        self._hand_out(self.pool.release(extent))

    def _hand_out(self, grants) -> None:
        for waiter, granted in grants:
            waiter.extent = granted
            waiter.phase = Phase.STAGING
            log.info("request %d (rank %d) got its staging space", waiter.id, waiter.rank)
            self._reply_later(waiter, self._extent_reply(waiter))

    def _fail(self, request: SaveRequest, reason: str) -> None:
        request.errors.append({"rank": request.rank, "path": request.path, "errno": None,
                               "message": f"rank {request.rank}: {reason}"})
        self._stop_request(request, Phase.FAILED)

    def _abort(self, request: SaveRequest, reason: str) -> None:
        log.info("request %d (rank %d) aborted: %s", request.id, request.rank, reason)
        request.errors.append({"rank": request.rank, "path": request.path, "errno": None,
                               "message": f"rank {request.rank}: {reason}"})
        self._stop_request(request, Phase.ABORTED)

    def _stop_request(self, request: SaveRequest, phase: str) -> None:
        previous = request.phase
        request.finish(phase)
        if previous == Phase.WAITING_FOR_POOL:
            self._hand_out(self.pool.cancel_wait(request))
        if previous in (Phase.WRITING, Phase.REPLICATING) and self.local.cancel_replication(request):
            return  # the replicator answers the cancel; _settle then frees the extent
        if previous == Phase.WRITING and request.jobs_pending:
            return  # _settle cleans up and frees the extent when the writers answer
        if request.device_copy_pending:
            return  # _on_cuda_staged frees the extent once the device copy has stopped
        self._remove_outputs(request)
        self.ledger.record_outcome(request)
        self._release_extent_of(request)

    def _remove_outputs(self, request: SaveRequest) -> None:
        for entry in request.written:
            remove_written(entry["path"], entry.get("file_id"))
        request.written = []

    # ------------------------------------------------------------------ housekeeping
    def _tick(self) -> None:
        if self.stopping_since is None:
            self.writers.reap_dead()
        for identity, rank in list(self.ledger.ranks.items()):
            if not rank.is_alive():
                self._rank_gone(identity, rank)
        now = time.time()
        for request in list(self.ledger.requests.values()):
            if request.finished_at and now - request.finished_at > UNCLAIMED_RESULT_SECONDS:
                self.ledger.forget(request.id)
        self._check_idle()
        if self.metrics is not None:
            self.metrics.tick([r.describe() for r in (*self.ledger.requests.values(),
                                                      *self.ledger.recent)], self.status)

    def _rank_gone(self, identity: bytes, rank: RankInfo) -> None:
        log.warning("rank %d (pid %d) is gone; aborting its in-flight saves", rank.rank, rank.pid)
        del self.ledger.ranks[identity]
        for request in self.ledger.in_flight():
            if request.identity == identity:
                self._abort(request, f"trainer process {rank.pid} exited during the save")
        if self.cuda is not None:
            self.cuda.forget_process(rank.pid)

    def _check_idle(self) -> None:
        if self.config.exit_when_idle is None:
            return
        busy = self.ledger.ranks or self.ledger.in_flight()
        if busy:
            self.idle_since = None
            return
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since > self.config.exit_when_idle:
            log.info("no trainers for %.0fs; exiting", self.config.exit_when_idle)
            self.request_stop()

    def status(self) -> dict:
        """The status document ``ckptd status --json`` prints."""
        return self.ledger.snapshot(
            version=__version__, pid=os.getpid(), host=host_name(), socket=self.socket_path,
            started_at=self.started_at, uptime_s=time.time() - self.started_at,
            state="draining" if self.stopping_since is not None else "serving",
            roots=list(self.roots.roots),
            pool={"path": self.pool.path, "size_bytes": self.pool.size,
                  "used_bytes": self.pool.used_bytes, "free_bytes": self.pool.free_bytes,
                  "waiting_requests": self.pool.waiting, "pinned": self.pool.registered_with_cuda},
            writers=self.writers.describe(),
            peers=self.local.peers_status(), local_checkpoints=self.local.checkpoints_status(),
            replication=self.local.replication_status(),
        )


def _validated_buffers(buffers) -> list:
    if not isinstance(buffers, list):
        raise RequestError(ErrorCode.BAD_REQUEST, "'buffers' must be a list of [dtype, shape, nbytes]")
    for entry in buffers:
        if (not isinstance(entry, list) or len(entry) != 3 or entry[0] not in protocol.BUFFER_DTYPES
                or not isinstance(entry[1], list) or not all(isinstance(d, int) and d >= 0 for d in entry[1])
                or not isinstance(entry[2], int) or entry[2] < 0):
            raise RequestError(ErrorCode.BAD_REQUEST, f"bad buffer description {entry!r}",
                               "each buffer is [dtype name, shape list, byte count]")
    return buffers


def _validated_files(files, buffer_count: int) -> list:
    if not isinstance(files, list):
        raise RequestError(ErrorCode.BAD_REQUEST, "'files' must be a list of [name, [indices]]")
    for entry in files:
        ok = (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
              and entry[0] and "/" not in entry[0] and entry[0] not in (".", "..")
              and not entry[0].startswith(".") and isinstance(entry[1], list)
              and all(isinstance(i, int) and 0 <= i < buffer_count for i in entry[1]))
        if not ok:
            raise RequestError(ErrorCode.BAD_REQUEST, f"bad file entry {entry!r}",
                               "file names are plain names inside the checkpoint directory")
    return files
