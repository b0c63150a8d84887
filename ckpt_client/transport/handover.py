"""Handing a rank's buffers to the daemon: reserve, copy (or export CUDA handles), confirm.

A save is one request: ``STAGE`` reserves an extent of the daemon's shared staging pool
(waiting while earlier saves hold it: back-pressure), this process copies its CPU buffers
(and CUDA tensors the daemon cannot open) into the extent, the daemon copies the CUDA
tensors it can open from their IPC handles at the same time (mixed transport), and
``STAGED`` is answered once every byte is in the pool. From then on the caller may change
its tensors: nothing aliases a live tensor.

Two modes:

- default: :func:`stage` returns at the STAGED point;
- zero-stall: :func:`stage` returns once the work is queued (a few ms); a background
  thread of the connection does the exchange above while training goes on, and
  :meth:`DaemonSave.wait_staged` (or ``guard_optimizer``) waits for it before the
  parameters change. ``copy_`` releases the GIL, so the copy overlaps the forward and
  backward passes.

Copies into the pool reuse destination views while the layout is unchanged and run as
one ``torch._foreach_copy_`` call, so many small tensors cost little more than one.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import queue
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ckptd import knobs, protocol
from ckptd.protocol import (Abort, ErrorCode, Forget, MessageType, Phase, Poll, RequestState,
                            Stage, Staged)
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.transport.flatten import describe

log = logging.getLogger(__name__)

#: Phase of a zero-stall save whose staging has not finished yet.
PENDING = "pending"


@dataclass
class DaemonSave:
    """One save of this rank, from its staging to its durable files.

    Attributes
    ----------
    request_id : int or None
        The daemon's id for it (``None`` until a zero-stall save reached the daemon).
    path : str
    transport_bytes : dict
        Bytes this rank copied through shared memory (``shm``) and bytes the daemon
        copied from CUDA IPC handles (``cuda``).
    """

    connection: DaemonConnection
    request_id: int | None
    path: str
    files: list = field(default_factory=list)
    last: RequestState = field(default_factory=lambda: RequestState(phase=PENDING))
    transport_bytes: dict = field(default_factory=dict)
    items: list | None = None  # DCP chunks: the plan item of each staged buffer
    spans: list = field(default_factory=list)  # the trainer's own [name, start, end] spans
    placements: dict | None = None  # tiered DCP: {file: [[start, length]]}, from the daemon
    _staged: threading.Event = field(default_factory=threading.Event, repr=False)
    _staging_error: str | None = None
    _cancelled: bool = False

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.connection.rank

    # ------------------------------------------------------------------ staging
    def mark_staged(self, error: str | None = None) -> None:
        """Every byte is in the pool (or staging failed with ``error``)."""
        if error is not None:
            self._staging_error = error if error.startswith(f"rank {self.rank}: ") \
                else f"rank {self.rank}: staging {self.path} failed: {error}"
            self.last = RequestState(phase=Phase.FAILED, error=self._staging_error)
        self._staged.set()

    @property
    def staged(self) -> bool:
        """Whether staging ended (successfully or not)."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once every byte of this save is in the daemon's pool.

        Raises
        ------
        CheckpointException
            If staging failed (daemon refused, died, or the copy failed).
        TimeoutError
            If ``timeout`` seconds passed first (staging goes on).
        """
        if not self._staged.wait(timeout):
            raise TimeoutError(f"rank {self.rank}: the save of {self.path} was not staged "
                               f"within {timeout:.1f}s")
        if self._staging_error is not None:
            raise CheckpointException("staging a checkpoint failed",
                                      {self.rank: self._staging_error})

    # ------------------------------------------------------------------ outcome
    def poll(self) -> RequestState:
        """Ask the daemon for this request's phase.

        The request belongs to the daemon incarnation that accepted it (the connection
        names it in every call): if that daemon died or was restarted, or does not know
        the request, the save reads as failed ("lost"), never as somebody else's result.
        """
        if self.last.phase in Phase.FINISHED:
            return self.last
        if not self._staged.is_set():
            return RequestState(phase=PENDING)
        try:
            reply = self.connection.call(MessageType.POLL, Poll(request_ids=[self.request_id]))
            self.last = reply.requests[self.request_id]
            if self.last.stale_of:
                log.warning("rank %d: the save of %s has the very bytes of the previous save "
                            "%s (every file's checksum repeats although the path moved on): "
                            "are the tensors being saved stale (a cache never refreshed, the "
                            "wrong buffers)?", self.rank, self.path, self.last.stale_of)
        except (DaemonUnavailableError, DaemonRequestError) as exc:
            if isinstance(exc, DaemonRequestError) and exc.code != ErrorCode.DAEMON_RESTARTED:
                raise
            if isinstance(exc, DaemonUnavailableError):
                return self._give_up(exc)
            self.last = RequestState(phase="unknown", error=str(exc))
        if self.last.phase == "unknown":
            self.last = RequestState(phase=Phase.FAILED, error=(
                f"rank {self.rank}: save of {self.path} lost: the ckptd daemon that "
                f"accepted it (pid {self.connection.daemon_pid}) no longer has it: "
                f"{self.last.error}; save again"))
        return self.last

    def _give_up(self, exc: DaemonUnavailableError) -> RequestState:
        """The daemon did not answer (dead, or stopped: SIGSTOP, a hung node): this rank's
        wait ends here. An abort is left queued on the connection, so a daemon that resumes
        drops the save instead of committing what this rank reports as failed."""
        try:
            abort = Abort(request_ids=[self.request_id],
                          reason="the trainer gave up waiting: the daemon did not answer")
            self.connection.channel.send(MessageType.ABORT, {
                **abort.to_wire(), "incarnation": self.connection.incarnation})
        except Exception:  # noqa: BLE001 - the transport is gone: nothing can commit it
            pass
        seen = self.last.phase
        self.last = RequestState(phase=Phase.FAILED, error=(
            f"rank {self.rank}: gave up on the save of {self.path} (last seen in phase "
            f"{seen!r}): {exc}. The daemon is "
            f"dead or stopped (check: ckptd status --socket {self.connection.socket_path}); "
            f"the save is abandoned and the previous checkpoint is intact; save again once "
            f"a daemon answers"))
        return self.last

    @property
    def finished(self) -> bool:
        """Whether the daemon is done with it (successfully or not)."""
        return self.poll().phase in Phase.FINISHED

    @property
    def error(self) -> str | None:
        """Why it failed, or ``None`` if it succeeded (only meaningful when finished)."""
        state = self.last
        if state.phase == Phase.DONE:
            return None
        return state.error or f"save of {self.path} ended {state.phase}"

    def forget(self, delete_files: bool) -> None:
        """Tell the daemon the outcome was consumed (and drop files of a failed save)."""
        if self.request_id is None:
            return
        try:
            self.connection.call(MessageType.FORGET, Forget(request_ids=[self.request_id],
                                                            delete_files=delete_files),
                                 timeout=5.0)
        except (DaemonUnavailableError, DaemonRequestError):
            pass  # a daemon that is gone keeps nothing to forget

    def abort(self, reason: str) -> None:
        """Drop the request at the daemon (in-flight writes are discarded).

        ``reason`` (what made the trainer drop it) is what the daemon logs.

        Returns at once: a write already under way finishes, and the daemon removes its
        file; a later save of the same path is written only after that (the writer pool
        keeps one job per path in flight), so it can never be overwritten or removed.
        A zero-stall save still queued here never reaches the daemon.
        """
        self._cancelled = True
        if self.request_id is not None:
            try:
                self.connection.call(MessageType.ABORT, Abort(request_ids=[self.request_id],
                                                              reason=reason[:1000]),
                                     timeout=5.0)
            except (DaemonUnavailableError, DaemonRequestError):
                pass
        self.forget(delete_files=True)


class RefusedSave:
    """Stands in for a save the daemon refused (or could not take), so the refusal reaches
    every rank through the queue's agreement: raising on one rank alone would leave the
    others waiting in the completion collective."""

    finished = True
    staged = True
    transport_bytes: dict = {}

    def __init__(self, rank: int, error: str) -> None:
        self.error = error if error.startswith(f"rank {rank}: ") else f"rank {rank}: {error}"
        self.rank = rank
        self.last = RequestState(phase=Phase.FAILED, error=self.error)

    def wait_staged(self, timeout: float | None = None) -> None:
        """The refusal, as a staging failure."""
        raise CheckpointException("staging a checkpoint failed", {self.rank: self.error})

    def forget(self, delete_files: bool) -> None:
        """Nothing was staged: nothing to forget."""

    def abort(self, reason: str) -> None:
        """Nothing was staged: nothing to abort."""


# ---------------------------------------------------------------------- copies

class PoolCopier:
    """Copies a save's buffers into the connection's mapped pool.

    Destination views are cached per (extent offset, layout): a training job saves the
    same structure into the same place again and again, and building thousands of views
    per save would cost more than copying small tensors.
    """

    _CACHED_LAYOUTS = 4

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self._views: OrderedDict = OrderedDict()

    def _destinations(self, base: int, offsets: list, buffers: list, chosen: list) -> list:
        key = (base, tuple(chosen), tuple((b[0], tuple(b[1])) for b in buffers))
        views = self._views.get(key)
        if views is None:
            views = []
            for index in chosen:
                dtype, shape, nbytes = buffers[index]
                start = base + offsets[index]
                raw = self.pool[start:start + nbytes]
                views.append(raw if dtype == "bytes" else raw.view(getattr(torch, dtype)).view(shape))
            self._views[key] = views
            while len(self._views) > self._CACHED_LAYOUTS:
                self._views.popitem(last=False)
        self._views.move_to_end(key)
        return views

    def copy(self, base: int, offsets: list, buffers: list, sources: list, chosen: list) -> None:
        """Copy ``sources[i]`` for ``i`` in ``chosen`` to ``base + offsets[i]``."""
        chosen = [i for i in chosen if buffers[i][2]]
        destinations = self._destinations(base, offsets, buffers, chosen)
        host_dst, host_src, device = [], [], False
        for index, destination in zip(chosen, destinations):
            source = sources[index]
            if isinstance(source, torch.Tensor):
                if source.is_cuda:
                    destination.copy_(source, non_blocking=True)
                    device = True
                else:
                    host_dst.append(destination)
                    host_src.append(source)
            else:
                data = source.getbuffer() if isinstance(source, io.BytesIO) else memoryview(source)
                with warnings.catch_warnings():
                    # torch warns that read-only buffers (bytes) could be written through
                    # the tensor; this one is only read, as the source of the copy.
                    warnings.simplefilter("ignore", UserWarning)
                    destination.copy_(torch.frombuffer(data, dtype=torch.uint8))
        if host_dst:
            torch._foreach_copy_(host_dst, host_src)  # one call for every CPU tensor
        if device:
            torch.cuda.synchronize()


# ---------------------------------------------------------------------- one save

@dataclass
class _StagingJob:
    """The exchange that stages one save (run inline, or on the background thread)."""

    save: DaemonSave
    body: Stage
    sources: list
    plan: object | None   # ckpt_client.transport.cuda_exports.IpcPlan, or None: every buffer via shm
    events: list = field(default_factory=list)  # producer events, alive until staged
    hold: threading.Event | None = None  # set: the copied bytes may go to the writers

    @property
    def specs(self) -> list | None:
        """Per buffer: the IPC description the daemon copies, or None (we copy it)."""
        return self.plan.specs if self.plan is not None else None

    def run(self) -> None:
        """STAGE, copy this rank's share, STAGED (answered once the daemon's share is in).

        The IPC plan hears how it ended in every case, so the export cache never
        re-sends an export the daemon no longer holds.

        Raises
        ------
        DaemonRequestError, DaemonUnavailableError
            When the daemon refuses or is gone (the request, if created, is aborted).
        """
        plan, kept = self.plan, None
        try:
            kept = self._exchange()
        finally:
            if plan is not None:
                plan.settle(kept)  # no-op after a withdraw

    def _exchange(self) -> list | None:
        connection, save = self.save.connection, self.save
        if save._cancelled:  # never reaches the daemon: nobody will open our exports
            if self.plan is not None:
                self.plan.withdraw()
            return None
        reply = connection.call(MessageType.STAGE, self.body, timeout=knobs.STAGE_TIMEOUT.get())
        save.request_id = reply.request_id
        save.placements = reply.placements
        buffers = self.body.buffers
        ours = [i for i in range(len(buffers)) if self.specs is None or self.specs[i] is None]
        try:
            if save._cancelled:
                raise InterruptedError("the save was aborted while it was staged")
            offsets, _ = protocol.layout_extent([b[2] for b in buffers])
            _copier(connection).copy(reply.offset, offsets, buffers, self.sources, ours)
        except BaseException as exc:
            save.abort(f"the trainer's copy into the staging pool failed: "
                       f"{type(exc).__name__}: {exc}")
            raise
        self._wait_for_release()
        try:
            staged = connection.call(MessageType.STAGED, Staged(request_id=save.request_id),
                                     timeout=knobs.STAGE_TIMEOUT.get())
        except DaemonRequestError as exc:
            if exc.code != ErrorCode.IPC_DENIED or self.specs is None:
                raise
            self._again_through_shm(exc)
            return None
        save.transport_bytes = _transport_bytes(buffers, self.specs)
        return staged.ipc_kept

    def _wait_for_release(self) -> None:
        """Keep the copied bytes from the writers until the caller releases them: STAGED
        is what starts the writes, so a save dropped before it costs no disk I/O."""
        if self.hold is None:
            return
        self.hold.wait()
        if self.save._cancelled:  # abort() told the daemon: request_id was set by now
            raise InterruptedError("the save was dropped before its bytes were released "
                                   "to the writers")

    def _again_through_shm(self, denial: DaemonRequestError) -> None:
        """The kernel refused the daemon our CUDA memory: stage this save (and, through
        the connection, every later one) by copying here into shared memory. The failed
        request wrote nothing; it is forgotten before the new one is made."""
        connection = self.save.connection
        connection.ipc_denied = reason = denial.body.get("message") or str(denial)
        log.warning("%s; staging CUDA tensors through shared memory from now on", reason)
        warnings.warn(f"ckptd: {reason} (this save and every later one of this process)",
                      RuntimeWarning, stacklevel=2)
        self.save.forget(delete_files=True)
        self.save.request_id = None
        self.plan.settle(None)
        self.plan, self.events = None, []
        self.body = dataclasses.replace(self.body, cuda=None)
        self._exchange()


def _transport_bytes(buffers: list, specs: list | None) -> dict:
    cuda = sum(b[2] for i, b in enumerate(buffers) if specs is not None and specs[i] is not None)
    return {"shm": sum(b[2] for b in buffers) - cuda, "cuda": cuda}


_copiers: "weakref.WeakKeyDictionary[DaemonConnection, PoolCopier]" = weakref.WeakKeyDictionary()
_stagers: "weakref.WeakKeyDictionary[DaemonConnection, BackgroundStager]" = \
    weakref.WeakKeyDictionary()
_planning_locks: "weakref.WeakKeyDictionary[DaemonConnection, threading.Lock]" = \
    weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def _copier(connection: DaemonConnection) -> PoolCopier:
    with _registry_lock:
        if connection not in _copiers:
            _copiers[connection] = PoolCopier(connection.pool)
        return _copiers[connection]


def _planning_lock(connection: DaemonConnection) -> threading.Lock:
    with _registry_lock:
        if connection not in _planning_locks:
            _planning_locks[connection] = threading.Lock()
        return _planning_locks[connection]


def _background_stager(connection: DaemonConnection) -> "BackgroundStager":
    with _registry_lock:
        if connection not in _stagers:
            _stagers[connection] = BackgroundStager()
        return _stagers[connection]


class BackgroundStager:
    """The thread that stages a connection's zero-stall saves, one after another."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckpt-client-stager", daemon=True)
        self._thread.start()

    def submit(self, job: _StagingJob) -> None:
        """Queue a job; its save's ``wait_staged`` returns (or raises) when it is done."""
        self._jobs.put(job)

    def wait_idle(self) -> None:
        """Return once every queued job has run."""
        self._jobs.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                job.run()
            except BaseException as exc:  # reported through the save, never lost
                job.save.mark_staged(_reason(exc))
            else:
                job.save.mark_staged()
            finally:
                self._jobs.task_done()

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        self._jobs.put(None)
        self._thread.join(timeout=knobs.STAGE_TIMEOUT.get())


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (DaemonRequestError, DaemonUnavailableError)) \
        else f"{type(exc).__name__}: {exc}"


def stage(connection: DaemonConnection, fmt: str, path: str, sources: list,
          skeleton: bytes = b"", files: list | None = None, extra: dict | None = None,
          allow_cuda_ipc: bool = True, zero_stall: bool = False,
          hold: threading.Event | None = None) -> DaemonSave:
    """Hand ``sources`` to the daemon: staged on return, or (``zero_stall``) queued.

    Parameters
    ----------
    fmt : str
        :class:`ckptd.protocol.SaveFormat` value.
    path : str
        Destination (file for torch saves, directory for DCP).
    sources : list
        Tensors (CPU or CUDA) and byte buffers, in the order the daemon lays them out.
    skeleton, files
        Format-specific: the torch state-dict skeleton; DCP ``[name, [indices]]``.
    extra : dict, optional
        More format-specific :class:`ckptd.protocol.Stage` fields (local checkpoints:
        session, iteration).
    allow_cuda_ipc : bool
        ``False``: copy CUDA tensors into the pool here even when the daemon could open
        CUDA IPC handles (the reference's CPU shared-memory mode).
    zero_stall : bool
        Return once the work is queued; the bytes are staged in the background (see
        :meth:`DaemonSave.wait_staged`). The sources must not change until then.
    hold : threading.Event, optional
        Zero-stall only: the bytes are copied into the pool at once, but the daemon is
        told they are staged (and starts writing them) only once ``hold`` is set; a save
        aborted before that is dropped without a byte written.

    Raises
    ------
    DaemonRequestError
        If the daemon refuses (path outside the roots, pool too small, ...); zero-stall
        saves report it through the save instead.
    DaemonUnavailableError
        If the daemon is gone (likewise).
    """
    from ckpt_client.transport.cuda_exports import plan_ipc

    if hold is not None and not zero_stall:
        raise ValueError("stage(hold=...) needs zero_stall=True: the caller sets hold later")
    buffers = [describe(s) for s in sources]
    # Saves reach the daemon in the order they were planned: a CUDA export may be re-sent
    # only on the daemon's word after the save before it (see cuda_export.ExportCache).
    with _planning_lock(connection):
        if not zero_stall and connection in _stagers:
            _stagers[connection].wait_idle()
        plan, events = plan_ipc(connection, sources) if allow_cuda_ipc else (None, [])
        body = Stage(format=fmt, path=os.path.abspath(path), buffers=buffers,
                     skeleton=skeleton, files=files or [],
                     cuda=plan.specs if plan is not None else None, **(extra or {}))
        save = DaemonSave(connection, None, body.path, body.files)
        job = _StagingJob(save, body, sources, plan, events, hold)
        if zero_stall:
            _background_stager(connection).submit(job)
            return save
        try:
            job.run()
        except BaseException as exc:
            save.mark_staged(_reason(exc))
            raise
    save.mark_staged()
    return save
