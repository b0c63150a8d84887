"""The life of a save request: the only code that sets a request's phase or frees its space.

Two owners, one per piece of state:

- :class:`ExtentLease` owns a request's staging extent and the named *holds* on it:
  ``client-copy`` (the trainer copies in), ``device-copy`` (the CUDA stager copies in),
  ``writers`` (writer jobs read it), ``replica:<address>`` (a push streams it),
  ``resident`` (a finished local part kept in memory, see :mod:`ckptd.server.resident`).
  The extent goes back to the pool exactly once, when the last hold drops, whatever order
  the holders finish in, so staged bytes are never overwritten while someone reads them.
- :class:`SaveLifecycle` owns ``request.phase``::

      waiting_for_pool -> staging -> writing -> [replicating | flushing] -> done
                  \\__________\\__________\\______________________\\________-> failed | aborted

  (``flushing``: a tiered save, durable in the stage directory, its extent given back,
  copying to its target.)

  It reacts to events (space granted, bytes staged, a writer's result, a replica's
  outcome, a failure or an abort), decides the outcome, and asks its
  :class:`SaveEffects` to do the work that goes with each step (answer the client,
  submit writer jobs, start or cancel pushes, remove outputs of a failed save). Every
  phase is set in one place, :meth:`SaveLifecycle._enter`, which also tells the effects
  (``phase_changed``: a trainer's held POLL is waiting for exactly that).

No sockets, files or threads here: the effects do I/O, so the whole state machine is
testable on its own (``tests/unit/server/test_lifecycle.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Protocol

from ckptd.protocol import Phase
from ckptd.server.requests import RequestTable, SaveRequest
from ckptd.staging.pool import Extent, StagingPool

log = logging.getLogger(__name__)

CLIENT_COPY = "client-copy"
DEVICE_COPY = "device-copy"
WRITERS = "writers"
RESIDENT = "resident"


def replica_hold(holder: str) -> str:
    """The hold a push to ``holder`` keeps on the extent it streams from."""
    return f"replica:{holder}"


class ExtentLease:
    """A staging extent and the named holds on it; given back when the last hold drops.

    Parameters
    ----------
    extent : Extent
        The bytes leased.
    give_back : callable
        Called exactly once with the extent when the last hold drops.
    holds : iterable of str
        The holds the lease starts with (a lease without holds would be free already).
    """

    def __init__(self, extent: Extent, give_back: Callable[[Extent], None],
                 holds: Iterable[str]) -> None:
        self.extent = extent
        self._give_back = give_back
        self._holds = set(holds)
        if not self._holds:
            raise ValueError("a lease starts with at least one hold")
        self.released = False

    @property
    def holds(self) -> frozenset:
        """The holds still on the extent."""
        return frozenset(self._holds)

    def has(self, name: str) -> bool:
        """Whether ``name`` still holds the extent."""
        return name in self._holds

    def hold(self, name: str) -> None:
        """Add a hold (only while some other hold keeps the extent)."""
        if self.released:
            raise RuntimeError(f"extent {self.extent} was already given back; cannot hold it "
                               f"for {name}")
        self._holds.add(name)

    def drop(self, name: str) -> None:
        """Remove a hold; the last one gives the extent back. Unknown names are ignored."""
        if name not in self._holds:
            return
        self._holds.discard(name)
        if not self._holds and not self.released:
            self.released = True
            self._give_back(self.extent)


class SaveEffects(Protocol):
    """The work that goes with each step of a save (done by the save service)."""

    def space_granted(self, request: SaveRequest) -> None:
        """A queued request got its extent: answer its STAGE, start its device copy."""

    def staged(self, request: SaveRequest) -> None:
        """Every byte of the request is in its extent (writing has begun)."""

    def write(self, request: SaveRequest) -> int:
        """Submit the writer jobs of a staged request; returns how many."""

    def replicate(self, request: SaveRequest) -> list[str]:
        """Start pushing a staged local part; returns the holders streamed to."""

    def cancel_replication(self, request: SaveRequest) -> None:
        """Stop a request's pushes (each still reports its outcome)."""

    def cancel_device_copy(self, request: SaveRequest) -> None:
        """The request stopped before (or while) its device copy ran: open nothing more,
        and give back what the trainer exported for it."""

    def remove_outputs(self, request: SaveRequest) -> None:
        """Delete what a failed or aborted save wrote."""

    def cancel_writes(self, request: SaveRequest) -> None:
        """A save stopped while its writer jobs run or wait: tell their writers to drop
        them (each still answers)."""

    def flush(self, request: SaveRequest) -> None:
        """A tiered save is durable locally: copy it to its target (reports
        :meth:`SaveLifecycle.flush_done`)."""

    def phase_changed(self, request: SaveRequest) -> None:
        """``request.phase`` changed (the step that changed it may still be under way:
        act on it once the step is over)."""


class SaveLifecycle:
    """Moves save requests through their phases (see the module docstring).

    Parameters
    ----------
    pool : StagingPool
        Where extents come from and go back to.
    table : RequestTable
        Where outcomes are counted.
    effects : SaveEffects
        Does the I/O that goes with each step.
    """

    def __init__(self, pool: StagingPool, table: RequestTable, effects: SaveEffects) -> None:
        self.pool, self.table, self.effects = pool, table, effects
        #: Optional hooks of the memory tier: ``on_done(request)`` runs when a save is done,
        #: while its extent is still held (it may add a :data:`RESIDENT` hold);
        #: ``reclaim(length) -> bool`` gives back one resident extent, if any, so that a
        #: save that does not fit can have the space.
        self.on_done: Callable[[SaveRequest], None] | None = None
        self.reclaim: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ space
    def admit(self, request: SaveRequest, copiers: tuple[str, ...] = (CLIENT_COPY,)) -> bool:
        """Give ``request`` staging space now (True: phase ``staging``), or queue it
        (back-pressure, FIFO; False: phase ``waiting_for_pool``). ``copiers``: who fills
        the extent (:data:`CLIENT_COPY`, :data:`DEVICE_COPY`, or both for a mixed-transport
        save); each holds it until it reports with :meth:`copied`.

        Raises
        ------
        ckptd.staging.pool.PoolTooSmallError
            If the request can never fit.
        """
        extent = self.pool.try_allocate(request.extent_length, request.near)
        while extent is None and self.reclaim is not None and self.reclaim(request.extent_length):
            extent = self.pool.try_allocate(request.extent_length, request.near)
        request.copiers = copiers
        self.table.add(request)
        if extent is not None:
            self._lease(request, extent)
            return True
        self._enter(request, Phase.WAITING_FOR_POOL)
        self.pool.wait_for(request.extent_length, request, request.near)
        log.info("request %d (rank %d) waits for %d bytes of staging space", request.id,
                 request.rank, request.extent_length)
        return False

    def _lease(self, request: SaveRequest, extent: Extent) -> None:
        request.lease = ExtentLease(extent, lambda e: self._give_back(request, e),
                                    request.copiers)
        self._enter(request, Phase.STAGING)
        request.staging_since = time.time()
        request.moved()

    def _give_back(self, request: SaveRequest, extent: Extent) -> None:
        self.table.space_released(request)
        for waiter, granted in self.pool.release(extent):
            self._granted(waiter, granted)

    def _granted(self, request: SaveRequest, extent: Extent) -> None:
        self._lease(request, extent)
        request.granted_at = time.time()
        log.info("request %d (rank %d) got its staging space", request.id, request.rank)
        self.effects.space_granted(request)

    # ------------------------------------------------------------------ progress
    def copied(self, request: SaveRequest, copier: str, error: str | None = None,
               code: str | None = None, ended_at: float | None = None) -> None:
        """``copier`` finished filling the extent (at ``ended_at``, default now) or failed:
        ``error``, with the protocol error ``code`` the trainer's STAGED gets, if specific.
        When the last copier is done, the request starts writing (and replicating)."""
        lease = request.lease
        request.moved()
        if request.finished or error is not None:
            if not request.finished:
                self._stop(request, Phase.FAILED, error, code)
            lease.drop(copier)  # only now may a stopped request's extent be reused
            return
        if any(lease.has(c) for c in request.copiers if c != copier):
            lease.drop(copier)
            return
        request.staged_at = time.time() if ended_at is None else ended_at
        self._enter(request, Phase.WRITING)
        lease.hold(WRITERS)
        lease.drop(copier)
        request.jobs_pending = self.effects.write(request)
        for holder in self.effects.replicate(request):
            lease.hold(replica_hold(holder))
        log.info("request %d (rank %d) staged in %.3fs; writing %d file(s)", request.id,
                 request.rank, request.staged_at - request.created_at, request.jobs_pending)
        self.effects.staged(request)
        if request.jobs_pending == 0:
            self._writers_finished(request)

    def writing_early(self, request: SaveRequest, jobs: int) -> None:
        """Writers began ``jobs`` files of ``request`` while it is copied (renaming none
        before it is staged): from now they hold its extent and are its pending jobs."""
        request.lease.hold(WRITERS)
        request.jobs_pending = jobs

    def job_done(self, request: SaveRequest, path: str, ok: bool, written: dict | None,
                 nbytes: int, error: str | None = None, errno: int | None = None) -> None:
        """One writer job of ``request`` finished."""
        request.jobs_pending -= 1
        request.moved()
        if ok:
            request.bytes_written += nbytes
            request.written.append(written)
        else:
            errno_text = f" errno {errno}" if errno else ""
            request.add_error(f"writing {path} failed:{errno_text} {error}", path, errno)
        if request.jobs_pending == 0:
            self._writers_finished(request)

    def replica_done(self, request: SaveRequest, holder: str, ok: bool, error: str | None,
                     nbytes: int) -> None:
        """The push to ``holder`` ended."""
        request.moved()
        request.replicas.finished(holder, ok, error, nbytes)
        if not request.replicas.sending:
            failures = request.replicas.failures
            if failures:
                log.warning("request %d (rank %d) has reduced redundancy: %s", request.id,
                            request.rank, "; ".join(f"{a}: {e}" for a, e in failures.items()))
            else:
                log.info("request %d (rank %d) replicated to %s", request.id, request.rank,
                         ", ".join(request.replicas.holders))
        if not (request.finished or request.replicas.sending or request.lease.has(WRITERS)):
            self._settle(request)
        request.lease.drop(replica_hold(holder))  # after settling: a done save may stay resident

    def writer_stuck(self, request: SaveRequest, pid: int) -> Callable[[], None]:
        """A writer of ``request`` is stuck in the kernel and was given up on: the bytes it
        reads stay held until it really exits; the returned function lets them go."""
        name = f"stuck-writer:{pid}"
        request.lease.hold(name)
        return lambda: request.lease.drop(name)

    def _writers_finished(self, request: SaveRequest) -> None:
        if request.finished:  # stopped while writing: only now is every file renamed
            self.effects.remove_outputs(request)
        elif request.tiered and not request.errors:
            self._enter(request, Phase.FLUSHING)
            request.local_durable_at = time.time()
            self.effects.flush(request)
        elif request.replicas is not None and request.replicas.sending:
            self._enter(request, Phase.REPLICATING)
            log.info("request %d (rank %d) written locally; replicating to %s", request.id,
                     request.rank, ", ".join(request.replicas.holders))
        else:
            self._settle(request)
        request.lease.drop(WRITERS)
        if request.forget_when_written:
            # Only now: forgotten earlier, it left status while its files were still
            # being renamed into place, as if nothing of it were left to remove.
            self.table.forget(request.id)

    def _settle(self, request: SaveRequest) -> None:
        """Writes and replicas all answered: decide the outcome."""
        if request.errors:
            self.effects.remove_outputs(request)  # nothing from a failed save stays
            self._finish(request, Phase.FAILED)
            log.error("request %d (rank %d) failed: %s", request.id, request.rank, request.error)
        else:
            self._finish(request, Phase.DONE)
            log.info("request %d (rank %d) durable: %d bytes in %.3fs after staging",
                     request.id, request.rank, request.bytes_written,
                     request.finished_at - request.staged_at)

    def flush_done(self, request: SaveRequest, failure) -> None:
        """A tiered save's flush ended: every file durable at its target, or ``failure``
        (a :class:`ckptd.tiers.flusher.FlushFailure`: message, path, errno)."""
        if request.finished:
            return
        if failure is None:
            self._finish(request, Phase.DONE)
            log.info("request %d (rank %d) durable at its target %s: %d bytes in %.3fs after "
                     "staging", request.id, request.rank, request.path, request.bytes_total,
                     request.finished_at - (request.staged_at or request.created_at))
            return
        request.add_error(failure.message, failure.path, failure.errno)
        self.effects.remove_outputs(request)
        self._finish(request, Phase.FAILED)
        log.error("request %d (rank %d) failed: %s", request.id, request.rank, request.error)

    # ------------------------------------------------------------------ endings
    def fail(self, request: SaveRequest, reason: str, trainer_may_copy: bool = False,
             code: str | None = None) -> None:
        """End ``request`` as failed (shutdown, a deadline, ...) with error ``code`` (or INTERNAL).

        ``trainer_may_copy``: the trainer is alive but has not confirmed its copy (a
        staging deadline: it may be stopped mid-copy); its hold on the extent stays until
        it does (STAGED) or its process is gone, so a resumed trainer can never write into
        space another save was given meanwhile."""
        self._stop(request, Phase.FAILED, reason, code=code, keep_copy_hold=trainer_may_copy)

    def trainer_gone(self, request: SaveRequest) -> None:
        """``request``'s trainer disconnected or exited: it copies nothing any more."""
        if request.lease is not None:
            request.lease.drop(CLIENT_COPY)

    def abort(self, request: SaveRequest, reason: str, trainer_may_copy: bool = False) -> None:
        """End ``request`` as aborted (the trainer asked, or went away); for
        ``trainer_may_copy`` (dropped mid-copy) see :meth:`fail`."""
        if not request.finished:  # a repeated abort is no news
            log.info("request %d (rank %d) aborted: %s", request.id, request.rank, reason)
        self._stop(request, Phase.ABORTED, reason, keep_copy_hold=trainer_may_copy)

    def _stop(self, request: SaveRequest, phase: str, reason: str,
              code: str | None = None, keep_copy_hold: bool = False) -> None:
        if request.finished:
            return
        previous = request.phase
        request.add_error(reason, code=code)
        self._finish(request, phase)
        if previous == Phase.WAITING_FOR_POOL:
            for waiter, granted in self.pool.cancel_wait(request):
                self._granted(waiter, granted)
        lease = request.lease
        if DEVICE_COPY in request.copiers and (lease is None or lease.has(DEVICE_COPY)):
            self.effects.cancel_device_copy(request)
        if lease is not None and any(h.startswith("replica:") for h in lease.holds):
            self.effects.cancel_replication(request)  # each push answers; its hold drops then
        writing = lease is not None and lease.has(WRITERS)  # files go when they answer; told
        # now, no writer renames one meanwhile (the stopped save would show at its path)
        (self.effects.cancel_writes if writing else self.effects.remove_outputs)(request)
        if lease is not None and not keep_copy_hold:
            # A trainer's copy ends with the save (its later STAGED is refused); a device
            # copy and writer jobs still run and drop their holds when they answer.
            lease.drop(CLIENT_COPY)

    def _enter(self, request: SaveRequest, phase: str) -> None:  # the one phase setter
        request.phase = phase
        self.effects.phase_changed(request)

    def _finish(self, request: SaveRequest, phase: str) -> None:
        self._enter(request, phase)
        request.finished_at = time.time()
        self.table.record_outcome(request)
        if phase == Phase.DONE and self.on_done is not None:
            self.on_done(request)
        call, request.pending_reply = request.pending_reply, None
        if call is not None and phase != Phase.DONE:
            call.fail(request.failure_code,
                      request.error or f"request {request.id} was {phase}",
                      "the save did not happen; save again")
