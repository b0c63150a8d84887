"""One save of this rank as the daemon sees it: staged, then written, then forgotten.

:class:`DaemonSave` is the handle every front-end (torch format, DCP, local checkpoints)
gets back from staging: it waits for staging to end, asks the daemon for the request's
phase (``poll``: a request of a daemon that died or was restarted reads as failed,
"lost", never as somebody else's result), and forgets or aborts the request there.
Once a call on its connection went unanswered (the connection's "not answering" mark,
:attr:`~ckpt_client.transport.connection.DaemonConnection.not_answering`), one save still
waiting for its outcome asks once more with a short wait (a daemon that was only slow
answers, which clears the mark; if a late answer clears it meanwhile, the recheck waits
on like any call), and the others give up at once, unless a late answer cleared the mark
by then, instead of waiting a call timeout each; what a given-up save leaves for the
daemon (abort, forget) is sent without waiting for a reply.
:class:`RefusedSave` stands in for a save the daemon refused, so that the refusal reaches
every rank through the queue's agreement. :func:`wait_until_finished` is the client's one
loop that polls the daemon until saves end.

A caller that blocks on a save's outcome asks with ``poll(hold=True)``, a POLL the daemon
holds until the save moves on (:mod:`ckpt_client.transport.phase_poll`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ckptd.protocol import Abort, ErrorCode, Forget, MessageType, Phase, RequestState, Staged
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport import waits
from ckpt_client.transport.phase_poll import POLL_INTERVAL, ask_phase, poll_hold
from ckpt_client.transport.silent_daemon import (gave_up_message, leave_dropped, not_waited_for,
                                                 tell_quietly)

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
        Bytes this rank copied via shared memory (``shm``), the daemon via CUDA IPC (``cuda``).
    copy_began : threading.Event
        Set once this process's copy into the extent started, or staging ended without.
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
    copy_began: threading.Event = field(default_factory=threading.Event, repr=False)
    _staging_error: str | None = None
    _cancelled: bool = False
    _copy_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _copying: bool = False           # this process is copying into the request's extent
    _dropped_mid_copy: bool = False  # abort() told the daemon a copy was running
    drop_reason: str | None = None   # why abort() dropped it, as the daemon logs it
    accepted_at: float | None = None  # monotonic time of the STAGE reply: finalize's clock
    staged_reply: int | None = None  # a STAGED sent without waiting: its reply's id
    gave_up: bool = False  # its daemon did not answer: the wait for its outcome ended

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
        self.copy_began.set()

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

        Without ``timeout`` the wait still ends: after both staging exchanges' waits
        (:func:`ckpt_client.transport.waits.staging`, longer than the daemon's own staging
        deadlines), with a :class:`CheckpointException` that says what to check.
        """
        if timeout is None:
            limit = waits.staging(self.connection.deadlines)
            if not self._staged.wait(limit):
                raise CheckpointException("staging a checkpoint failed", {self.rank: (
                    f"rank {self.rank}: the save of {self.path} was not staged within "
                    f"{waits.as_text(limit)}, longer than the daemon's staging deadlines: the daemon "
                    f"is silent or this process's copy hangs; check ckptd status --socket "
                    f"{self.connection.socket_path} and the daemon's log, then save again")})
        elif not self._staged.wait(timeout):
            raise TimeoutError(f"rank {self.rank}: the save of {self.path} was not staged "
                               f"within {timeout:.1f}s")
        if self._staging_error is not None:
            raise CheckpointException("staging a checkpoint failed",
                                      {self.rank: self._staging_error})

    def start_copy(self) -> bool:
        """This process starts its copy into the request's extent; ``False`` (nothing to
        copy) if the save was dropped already."""
        with self._copy_lock:
            if self._cancelled:
                return False
            self._copying = True
            self.copy_began.set()
            return True

    def end_copy(self) -> None:
        """The copy into the extent is over (done or failed). If the save was dropped
        while it ran, the daemon still holds the extent for it: tell it the copy is over
        (a STAGED, which the daemon refuses for a dropped save and then frees the space)."""
        with self._copy_lock:
            self._copying = False
            tell, self._dropped_mid_copy = self._dropped_mid_copy, False
        if tell and self.connection.not_answering is not None:  # nobody waits for a refusal
            tell_quietly(self.connection, MessageType.STAGED, Staged(request_id=self.request_id))
        elif tell:
            try:
                self.connection.call(MessageType.STAGED, Staged(request_id=self.request_id),
                                     timeout=waits.staged_reply(self.connection.deadlines))
            except (DaemonUnavailableError, DaemonRequestError):
                pass  # refused (the save was dropped), or the daemon is gone: nothing held

    # ------------------------------------------------------------------ outcome
    def poll(self, hold: bool = False) -> RequestState:
        """Ask the daemon for this request's phase.

        The request belongs to the daemon incarnation that accepted it (the connection
        names it in every call): if that daemon died or was restarted, or does not know
        the request, the save reads as failed ("lost"), never as somebody else's result.
        ``hold``: block until it moves on (:func:`~ckpt_client.transport.phase_poll.ask_phase`).
        """
        if hold and self.last.phase not in Phase.FINISHED and not self._staged.is_set():
            self._staged.wait(poll_hold(self.connection) or POLL_INTERVAL)  # in background
        if self.last.phase in Phase.FINISHED:  # (staging may have failed meanwhile)
            return self.last
        if not self._staged.is_set():
            return RequestState(phase=PENDING)
        limit = waits.save_outcome(self.connection.deadlines, self.connection.tiered)
        if self.accepted_at is not None and time.monotonic() - self.accepted_at > limit:
            return self._give_up(DaemonUnavailableError(
                self.connection.socket_path, f"the ckptd daemon (pid {self.connection.daemon_pid})"
                f" gave no outcome within {waits.as_text(limit)} of accepting the save, longer than its "
                f"own deadline for a save (CKPTD_SAVE_DEADLINE)"))
        if (claim := self.connection.claim_recheck()) == "silent":  # another save rechecked
            self._drop_staged_reply()
            return self._give_up(not_waited_for(self.connection))
        try:
            state = ask_phase(self.connection, self.request_id, self.last.phase, hold,
                              recheck=bool(claim))
            self._read_staged_reply()
            self.last = state
            _warn_if_stale(self.rank, self.path, state)
        except (DaemonUnavailableError, DaemonRequestError) as exc:
            self._drop_staged_reply()
            if isinstance(exc, DaemonRequestError) and exc.code != ErrorCode.DAEMON_RESTARTED:
                raise
            if isinstance(exc, DaemonUnavailableError):  # a recheck says what marked it
                marked = claim and self.connection.not_answering is not None
                return self._give_up(not_waited_for(self.connection) if marked else exc)
            self.last = RequestState(phase="unknown", error=str(exc))
        if self.last.phase == "unknown":
            self.last = RequestState(phase=Phase.FAILED, error=(
                f"rank {self.rank}: save of {self.path} lost: the ckptd daemon that "
                f"accepted it (pid {self.connection.daemon_pid}) no longer has it: "
                f"{self.last.error}; save again"))
        return self.last

    def _read_staged_reply(self) -> None:
        """Read the reply to a STAGED sent without waiting, once a later POLL was answered
        (it came first: no wait). A refusal needs nothing here: the daemon refuses STAGED
        only for a request that failed or it does not know, as the POLL reports."""
        msg_id, self.staged_reply = self.staged_reply, None
        if msg_id is None:
            return
        try:
            self.connection.reply_to(msg_id, MessageType.STAGED,
                                     timeout=waits.staged_reply(self.connection.deadlines))
        except DaemonRequestError as exc:
            log.debug("rank %d: STAGED of %s refused: %s", self.rank, self.path, exc)

    def _drop_staged_reply(self) -> None:
        """Nobody will read the STAGED reply any more (the save is forgotten)."""
        msg_id, self.staged_reply = self.staged_reply, None
        if msg_id is not None:
            self.connection.channel.drop(msg_id)

    def _give_up(self, exc: DaemonUnavailableError, reason: str = "the trainer gave up "
                 "waiting: the daemon did not answer", copying: bool = False) -> RequestState:
        """The daemon did not answer (dead, or stopped: SIGSTOP, a hung node): this rank's
        wait ends here, and an abort and a forget that deletes the files are left queued
        for a daemon that resumes (:func:`~ckpt_client.transport.silent_daemon.leave_dropped`)."""
        self._leave_dropped(reason, copying)
        self.last = RequestState(phase=Phase.FAILED, error=gave_up_message(
            self.rank, self.path, self.last.phase, exc, self.connection.socket_path))
        return self.last

    def _leave_dropped(self, reason: str, copying: bool = False) -> None:
        self.gave_up = True  # ask that daemon nothing more about this save
        leave_dropped(self.connection, self.request_id, reason, copying)

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
        self._drop_staged_reply()
        if self.request_id is None or self.gave_up:  # giving up queued its FORGET(delete)
            return
        if self.connection.not_answering is not None:  # nobody waits for its word now
            return tell_quietly(self.connection, MessageType.FORGET,
                                Forget(request_ids=[self.request_id], delete_files=delete_files))
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
        file; a copy of this process into the extent that is still running (a zero-stall
        save dropped from another thread) keeps the extent held at the daemon until the
        copy is over; a later save of the same path is written only after that (the writer pool
        keeps one job per path in flight), so it can never be overwritten or removed.
        A zero-stall save still queued here never reaches the daemon. On a connection
        whose daemon does not answer, nothing waits for a reply (nothing is sent again
        for a save given up on: giving up queued its abort and forget).
        """
        with self._copy_lock:  # a copy starts either before this (and is told) or never
            self._cancelled = True
            self.drop_reason = self.drop_reason or reason
            copying = self._dropped_mid_copy = self._copying
        if self.gave_up:
            return
        if self.request_id is not None and self.connection.not_answering is not None:
            self._drop_staged_reply()  # and it reads as failed: nothing is sent for it again
            self._give_up(not_waited_for(self.connection), reason, copying)
            return
        if self.request_id is not None:
            try:
                self.connection.call(MessageType.ABORT, Abort(request_ids=[self.request_id],
                                                              reason=reason[:1000],
                                                              copying=copying),
                                     timeout=5.0)
            except (DaemonUnavailableError, DaemonRequestError):
                pass
        self.forget(delete_files=True)


def abort_held(saves, release: threading.Event, reason: str) -> None:
    """Abort ``saves``, staged with ``hold=release`` (their copied bytes held back from
    the writers), and release them: their staging jobs end unwritten.

    Every save is marked dropped before the daemon is told of any, and ``release`` is set
    whatever happens meanwhile (an interrupt, an error): a job left held would keep the
    connection's background stager, and the save's extent, until its wait runs out.
    """
    for save in saves:  # as abort() starts: a job stops before the daemon hears of it,
        with save._copy_lock:  # or, held after its copy, once released
            save._cancelled = True
            save.drop_reason = save.drop_reason or reason
    try:
        for save in saves:
            save.abort(reason)
    finally:
        release.set()


def _warn_if_stale(rank: int, path: str, state: RequestState) -> None:
    if state.stale_of:
        log.warning("rank %d: the save of %s has the very bytes of the previous save %s "
                    "(every file's checksum repeats although the path moved on): are the "
                    "tensors being saved stale (a cache never refreshed, the wrong "
                    "buffers)?", rank, path, state.stale_of)


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

    def poll(self, hold: bool = False) -> RequestState:
        """The refusal, as a failed save (there is nothing to ask)."""
        return self.last

    def wait_staged(self, timeout: float | None = None) -> None:
        """The refusal, as a staging failure."""
        raise CheckpointException("staging a checkpoint failed", {self.rank: self.error})

    def forget(self, delete_files: bool) -> None:
        """Nothing was staged: nothing to forget."""

    def abort(self, reason: str) -> None:
        """Nothing was staged: nothing to abort."""


def wait_until_finished(saves) -> None:
    """Block until the daemon is done with every save of ``saves`` (successfully or not).

    Cannot hang: a dead or restarted daemon makes a save read as failed. Each ask is
    held by the daemon until the save moves on (:meth:`DaemonSave.poll`).
    """
    for save in saves:
        while save.poll(hold=True).phase not in Phase.FINISHED:
            pass
