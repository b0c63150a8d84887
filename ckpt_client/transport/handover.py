"""Handing a rank's buffers to the daemon: reserve, copy (or export CUDA handles), confirm.

A save is one request: ``stage`` reserves an extent of the daemon's shared staging pool
(waiting while earlier saves hold it: back-pressure), this process copies its CPU buffers
(and CUDA tensors the daemon cannot open) into the extent
(:mod:`ckpt_client.transport.pool_copy`), the daemon copies the CUDA tensors it can open
from their IPC handles at the same time (mixed transport,
:mod:`ckpt_client.transport.cuda_exports`), and ``staged`` is answered once every byte is
in the pool. From then on the caller may change its tensors: nothing aliases a live
tensor.

By default :func:`stage` returns at the staged point; zero-stall, once the work is queued
(a few ms): a background thread of the connection does the exchange above while training
goes on (``copy_`` releases the GIL), and :meth:`DaemonSave.wait_staged` (or
``guard_optimizer``) waits for it before the parameters change.

Per connection, one :class:`Handover` owns the copier, the background thread
(:mod:`ckpt_client.transport.background`) and the lock that keeps saves in planning order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ckptd import protocol
from ckpt_client.transport import waits
from ckptd.protocol import ErrorCode, MessageType, SaveFormat, Stage, Staged
from ckpt_client.errors import DaemonRequestError
from ckpt_client.transport.background import BackgroundStager, failure_reason
from ckpt_client.transport.connection import DaemonConnection, closed_error
from ckpt_client.transport.copy_reports import copy_reports
from ckpt_client.transport.cuda_exports import IpcPlan, plan_ipc
from ckpt_client.transport.daemon_save import DaemonSave
from ckpt_client.transport.flatten import describe
from ckpt_client.transport.pool_copy import PoolCopier
from ckpt_client.transport.sent_ahead import SentAhead, dropped_on_error, remember_layout
from ckpt_client.transport.silent_daemon import not_waited_for, stage_reply

log = logging.getLogger(__name__)


@dataclass
class StagingJob:
    """The exchange that stages one save (run inline, or on the background thread)."""

    save: DaemonSave
    body: Stage
    sources: list
    plan: IpcPlan | None  # None: every buffer goes through shared memory
    events: list = field(default_factory=list)  # producer events, alive until staged
    hold: threading.Event | None = None  # set: the copied bytes may go to the writers
    #: Wait for STAGED's reply here. A default save that the trainer copied whole need
    #: not: every byte is in the pool once its copy returned, so the reply (an error only
    #: if the daemon failed the save meanwhile, which its POLL says as well) is read by
    #: the save's first poll, and the call returns one round trip sooner. The daemon
    #: still judges the staging deadline and answers the STAGED.
    confirm: bool = True
    #: This save's STAGE, sent ahead of the walk (:mod:`ckpt_client.transport.sent_ahead`):
    #: a torch save's skeleton goes with STAGED. Dropped if the job ends before reading it.
    ahead: SentAhead | None = None
    #: Every source is a CPU tensor (the caller knows it from its own walk): the copy is
    #: one call, with no check of each source.
    on_cpu: bool = False
    #: Monotonic time it was queued for the background thread (``None``: run inline).
    queued_at: float | None = None
    background: bool = False  # no call waits for its copy (zero-stall, caller returned)

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

    def _never_staged(self) -> None:
        """The save was dropped before a request of it was made: none ever is, and nobody
        will open our exports."""
        if self.plan is not None:
            self.plan.withdraw()
        if self.ahead is not None:
            self.ahead.drop(self.save.drop_reason or "the save was dropped before it was staged")
        return None

    def _exchange(self) -> list | None:
        connection, save = self.save.connection, self.save
        if save._cancelled:
            return self._never_staged()
        silence = connection.not_answering
        if silence is not None and self.queued_at is not None and self.queued_at <= silence.since:
            # Queued before a call went unanswered: one of the saves outstanding on this
            # silent daemon, failed at once rather than after a staging wait of its own.
            if self.plan is not None:
                self.plan.withdraw()
            if self.ahead is not None:  # left for the daemon: it answers no one now
                self.ahead.drop("the daemon did not answer")
            raise not_waited_for(connection)
        if self.ahead is not None:
            try:
                reply = stage_reply(connection, self.ahead.msg_id)
            except DaemonRequestError as exc:
                if exc.code != ErrorCode.LAYOUT_UNKNOWN:
                    raise
                # The daemon no longer keeps the layout the STAGE sent ahead named: no
                # request was made; this one carries the buffers and the skeleton, unless
                # the save was dropped meanwhile (the daemon would admit it to abort it).
                self.ahead = None
                if save._cancelled:
                    return self._never_staged()
                reply = stage_reply(connection, connection.send(MessageType.STAGE, self.body))
        else:
            reply = stage_reply(connection, connection.send(MessageType.STAGE, self.body))
        # Only a torch save has a skeleton; one sent ahead sends it now.
        skeleton = self.body.skeleton if self.ahead is not None and \
            self.body.format == SaveFormat.TORCH else None
        save.request_id = reply.request_id
        save.accepted_at = time.monotonic()
        save.placements = reply.placements
        buffers, specs = self.body.buffers, self.specs
        handover = handover_for(connection)
        ours = handover.every_buffer(len(buffers)) if specs is None else \
            [i for i, spec in enumerate(specs) if spec is None]
        # Writers may start on what is copied unless the bytes wait for a release, or the
        # daemon copies part of the request itself.
        reports = copy_reports(connection, save.request_id, skeleton, handover.total_bytes(
            buffers), self.background) if self.hold is None and specs is None else None
        try:
            if not save.start_copy():
                raise InterruptedError("the save was aborted while it was staged")
            try:
                handover.copier.copy(reply.offset, handover.offsets(buffers), buffers,
                                     self.sources, ours, on_cpu=self.on_cpu, reports=reports)
            finally:
                save.end_copy()
            if save._cancelled:
                raise InterruptedError("the save was aborted while this process copied it")
        except BaseException as exc:
            # Dropped by the caller: the daemon hears the caller's reason (again, if the
            # first ABORT went out before the request existed there).
            save.abort(save.drop_reason or f"the trainer's copy into the staging pool "
                                           f"failed: {type(exc).__name__}: {exc}")
            raise
        self._wait_for_release()
        done = Staged(request_id=save.request_id, skeleton=skeleton, copied_at=time.time())
        if not self.confirm and specs is None:
            save.staged_reply = connection.send(MessageType.STAGED, done)
            save.transport_bytes = {"shm": handover.total_bytes(buffers), "cuda": 0}
            return None
        try:
            staged = connection.call(MessageType.STAGED, done,
                                     timeout=waits.staged_reply(connection.deadlines))
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
        limit = waits.staged_reply(self.save.connection.deadlines)  # the daemon gave up by then
        if not self.hold.wait(limit):  # not for ever: this thread stages later saves too
            self.save.abort(reason := f"the copy was not released to the writers within "
                            f"{waits.as_text(limit)} (the saving call hung or was interrupted)")
            raise InterruptedError(reason)
        if self.save._cancelled:  # abort() told the daemon: request_id was set by now
            raise InterruptedError("the save was dropped before its bytes went to the writers")

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


class Handover:
    """What one connection stages with: its pool copier, its background stager, and the
    lock that keeps its saves in planning order."""

    def __init__(self, connection: DaemonConnection) -> None:
        self.connection = connection
        self.planning = threading.Lock()
        self._copier: PoolCopier | None = None
        self._stager: BackgroundStager | None = None
        self._starting = threading.Lock()  # a stager made after close() is stopped too
        self._closed = False
        self._layout: tuple | None = None  # (buffers, offsets, total bytes) of the last save
        self._every: list = []  # [0, 1, ...]: the indices of a save's every buffer

    @property
    def copier(self) -> PoolCopier:
        """The copier into this connection's mapped pool (made on first use)."""
        if self._copier is None:
            self._copier = PoolCopier(self.connection.pool)
        return self._copier

    def offsets(self, buffers: list) -> list:
        """Where each of ``buffers`` starts in its extent (kept for the last list: a save
        sent ahead repeats the very list of the save before)."""
        return self._layout_of(buffers)[1]

    def total_bytes(self, buffers: list) -> int:
        """The bytes ``buffers`` describe (kept as :meth:`offsets` is)."""
        return self._layout_of(buffers)[2]

    def _layout_of(self, buffers: list) -> tuple:
        if self._layout is None or self._layout[0] is not buffers:
            sizes = [b[2] for b in buffers]
            self._layout = (buffers, protocol.layout_extent(sizes)[0], sum(sizes))
        return self._layout

    def every_buffer(self, count: int) -> list:
        """``[0, ..., count - 1]``, the same list while ``count`` is (the copier then
        recognises the last save's choice of buffers without comparing it)."""
        if len(self._every) != count:
            self._every = list(range(count))
        return self._every

    def stager(self) -> BackgroundStager:
        """The background thread of zero-stall saves (started on first use)."""
        with self._starting:
            if self._stager is None:
                self._stager = BackgroundStager(self.connection)
                if self._closed:  # closed meanwhile: its jobs fail at once, no thread waits on
                    self._stager.stop()
            return self._stager

    def idle(self) -> bool:
        """Whether no zero-stall save of this connection is still on its way."""
        return self._stager is None or self._stager.idle()

    def close(self) -> None:
        """Its connection closed: end the background thread (it holds the connection)."""
        with self._starting:
            self._closed = True
            stager = self._stager
        if stager is not None:
            stager.stop()

    def wait_for_background(self) -> None:
        """Return once the zero-stall saves queued so far reached the daemon."""
        if self._stager is not None:
            self._stager.wait_idle()


_handovers: "weakref.WeakKeyDictionary[DaemonConnection, Handover]" = weakref.WeakKeyDictionary()
_handovers_lock = threading.Lock()


def handover_for(connection: DaemonConnection) -> Handover:
    """The :class:`Handover` of ``connection`` (one per connection, dropped when it closes:
    a handover holds its connection, so the weak key alone would never let either go, nor
    the copier's views of the pool)."""
    if connection.closed:  # before the lookup: a forked child's copy of its parent's
        handover = Handover(connection)  # connection is marked closed without running hooks
        handover.close()
        return handover
    with _handovers_lock:
        handover = _handovers.get(connection)
        if handover is not None:
            return handover
        handover = _handovers[connection] = Handover(connection)
    connection.when_closed(_drop_handover)  # unlocked: on a connection closed since, it runs now
    return handover


def _drop_handover(connection: DaemonConnection) -> None:
    with _handovers_lock:
        handover = _handovers.pop(connection, None)
    if handover is not None:
        handover.close()


def stage(connection: DaemonConnection, fmt: str, path: str, sources: list, *,
          skeleton: bytes = b"", files: list | None = None, session: str | None = None,
          iteration: int | None = None, stock_files: bool = False,
          allow_cuda_ipc: bool = True, zero_stall: bool = False,
          hold: threading.Event | None = None, ahead: SentAhead | None = None,
          buffers: list | None = None, on_cpu: bool = False,
          remember: tuple | None = None, caller_waits: bool = False) -> DaemonSave:
    """Hand ``sources`` to the daemon: staged on return, or (``zero_stall``) queued.

    Parameters
    ----------
    fmt : str
        :class:`ckptd.protocol.SaveFormat` value.
    path : str
        Destination (file for torch saves, directory for DCP and local checkpoints).
    sources : list
        Tensors (CPU or CUDA) and byte buffers, in the order the daemon lays them out.
    skeleton, files
        Format-specific: the torch state-dict skeleton; DCP ``[name, [indices]]``.
    session, iteration
        Local checkpoints: the session and the iteration of the part.
    stock_files : bool
        DCP: write the files exactly as torch's ``FileSystemWriter`` would.
    allow_cuda_ipc : bool
        ``False``: copy CUDA tensors into the pool here even when the daemon could open
        CUDA IPC handles (the reference's CPU shared-memory mode).
    zero_stall : bool
        Return once the work is queued; the bytes are staged in the background (see
        :meth:`DaemonSave.wait_staged`). The sources must not change until then.
    hold : threading.Event, optional
        Zero-stall only: the bytes are copied into the pool at once, but the writers may
        read them only once ``hold`` is set; a save aborted before is never written.
    ahead : SentAhead, optional
        This save's STAGE, sent before ``sources`` were known: used if it asked for what
        this save needs (and the save is not zero-stall, or ``caller_waits``), else
        dropped.
    buffers : list, optional
        The ``[dtype, shape, nbytes]`` description of each source, when the caller has
        it already (else each source is described here).
    on_cpu : bool
        The caller knows every source is a CPU tensor: no CUDA export is planned and the
        copy checks no source.
    remember : tuple, optional
        A torch save's ``(kind, layout)`` (:func:`~ckpt_client.transport.sent_ahead.kind_of`,
        ``Flattened.layout``): remembered for the next save of that kind to go ahead with.
    caller_waits : bool
        Zero-stall only: the caller itself waits for staging to end before it returns
        (the copy only overlaps the caller's own work): the tensors are not detached, and
        STAGED's reply is left to the save's first poll, as for a default save.

    Raises
    ------
    DaemonRequestError
        If the daemon refuses (path outside the roots, pool too small, ...); zero-stall
        saves report it through the save instead.
    DaemonUnavailableError
        If the daemon is gone (likewise).
    """
    if hold is not None and not zero_stall:
        raise ValueError("stage(hold=...) needs zero_stall=True: the caller sets hold later")
    if connection.closed:  # now: a zero-stall save's stager would wait on it forever
        with dropped_on_error(ahead):
            raise closed_error(connection)
    if zero_stall and not caller_waits:
        # The copy runs after this call returns: take each tensor's storage as it is now.
        # A Parameter's ``.data`` may be rebound meanwhile (``module.half()``, ``.to()``,
        # ZeRO partitions) and the copy must not follow it to the new storage.
        # (A source that is not a tensor, a DCP bytes item, is a buffer of the planner's.)
        sources = [source.detach() if isinstance(source, torch.Tensor) else source
                   for source in sources]
    handover = handover_for(connection)
    # Until the job takes it over, a failure drops the STAGE sent ahead.
    if buffers is None:
        with dropped_on_error(ahead):
            buffers = [describe(s) for s in sources]
    # Saves reach the daemon in the order they were planned: a CUDA export may be re-sent
    # only on the daemon's word after the save before it (see cuda_exports.ExportCache).
    with handover.planning:
        with dropped_on_error(ahead):
            if not zero_stall:
                handover.wait_for_background()
            plan, events = plan_ipc(connection, sources) if allow_cuda_ipc and not on_cpu \
                else (None, [])
            body = Stage(format=fmt, path=os.path.abspath(path), buffers=buffers,
                         skeleton=skeleton, files=files or [],
                         cuda=plan.specs if plan is not None else None, session=session,
                         iteration=iteration, stock_files=stock_files)
            save = DaemonSave(connection, None, body.path, body.files)
            # A zero-stall save returns before its STAGE: it never goes ahead of it,
            # unless the caller itself waits for the staging (a DCP guessed copy).
            if ahead is not None and ((zero_stall and not caller_waits) or plan is not None
                                      or not ahead.matches(connection, body)):
                ahead.drop("the save sent ahead had another layout than the state dict's")
                ahead = None
            elif ahead is not None:  # the very list of the save before: layouts kept by it
                buffers = ahead.body.buffers
                body = dataclasses.replace(body, buffers=buffers)
        # A tiered daemon finishes a save whose every rank's call returned, trainers or
        # not: that call may return only once the daemon has the STAGED in hand.
        job = StagingJob(save, body, sources, plan, events, hold,
                         confirm=(zero_stall and not caller_waits) or connection.tiered,
                         ahead=ahead, on_cpu=on_cpu,
                         background=zero_stall and not caller_waits)
        if zero_stall:
            handover.stager().submit(job)
            return save
        try:
            job.run()
        except BaseException as exc:
            save.mark_staged(failure_reason(exc))
            raise
        if remember is not None and plan is None:
            remember_layout(connection, *remember, buffers, save.request_id)
    save.mark_staged()
    return save
