"""The ``AsyncStager`` that lets stock ``torch.distributed.checkpoint.async_save`` stage
through the daemon.

Stock ``async_save`` calls ``stager.stage(state_dict)`` on the trainer's thread, then runs
``dcp.save`` on what it returned in an executor (a thread, or DCP's helper process) with
the ``StorageWriter``. The daemon can only stage once it knows which bytes go to which
file of which directory, and that plan is made inside the executor. So this stager does
not copy anything itself on the thread path: ``stage`` hands back the state dict carrying
a *ticket*; the ckptd ``StorageWriter``, planning in the executor thread, copies the
plan's items straight into the daemon's staging pool (CUDA tensors: the daemon copies
them from IPC handles) and punches the ticket. The trainer is released at that moment:
by ``synchronize_staging`` (the blocking form, inside ``async_save``) or by the staging
future (the zero-stall form, torch's ``AsyncSaveResponse.staging_completion``).

With the ``PROCESS`` executor the state dict is pickled into DCP's helper process, and
pickling a live tensor would move it into shared memory under the trainer's feet. When a
ticketed state dict is pickled, the stager instead copies its tensors into shared-memory
buffers it owns (allocated once, reused while the structure is unchanged) and punches the
ticket; the helper process's ``StorageWriter`` hands those buffers to the daemon.

Owns: the ticket (one per save), the thread-local hand-over of the ticket from the
executor's ``dcp.save`` to ``write_data``, and the shared-memory buffers of the process
path. Does not plan or talk to the daemon: the writer does.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from torch.distributed.checkpoint.stateful import Stateful

from ckpt_client.transport import waits
from ckpt_client.dcp.stage_ahead import PlanMemory, StagedAhead
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError

log = logging.getLogger(__name__)

#: Exact types that are never ``Stateful`` (a protocol check costs µs per value).
_NOT_STATEFUL = frozenset({torch.Tensor, torch.nn.Parameter, dict, list, tuple, int, float,
                           str, bytes, bool, type(None)})


def state_dicts_of(state_dict: dict) -> dict:
    """``state_dict`` as DCP saves it: a shallow copy with each top-level ``Stateful``
    value (an app state, a model, an optimizer wrapper) replaced by its ``state_dict()``."""
    return {key: value.state_dict()
            if type(value) not in _NOT_STATEFUL and isinstance(value, Stateful) else value
            for key, value in state_dict.items()}

_current = threading.local()


class StagingTicket:
    """One save's staging, from ``Stager.stage`` until its bytes are safe from training.

    Punched once: by the writer when the daemon holds every byte, or by the pickling of
    the process path when the shared-memory copy is done, or with an error.
    """

    def __init__(self, plans: PlanMemory | None = None) -> None:
        self._done = threading.Event()
        #: Why staging failed, as text: the exception itself would keep its traceback's
        #: frames, and with them the save's planner and tensors, as long as this ticket.
        self._error: str | None = None
        self._consumer: threading.Thread | None = None
        self._created = time.monotonic()
        self._plans = plans
        #: The state dict as DCP plans it (``Stateful`` values turned into their state),
        #: set when the executor takes the save up.
        self.state_dict: dict | None = None
        #: The save's early staging with the remembered plan, if it had one.
        self.ahead: StagedAhead | None = None

    def claim(self) -> None:
        """The calling thread is the one that will stage (or pickle) this save."""
        if self._consumer is None:
            self._consumer = threading.current_thread()

    def punch(self, error: BaseException | None = None) -> None:
        """Staging ended: the trainer may change its tensors (or learn ``error``)."""
        if not self._done.is_set():
            self._error = None if error is None else f"{type(error).__name__}: {error}"
            self._done.set()

    def done_with_state(self) -> None:
        """The writer is done with this save's state dict (staged, plan remembered, or
        failed): drop it, so that a stager's last ticket, kept until its next save, does
        not keep the tensors (on a GPU, device memory and temporaries) alive."""
        self.state_dict = None
        self.ahead = None

    def stage_ahead(self, writer) -> None:
        """DCP's first call into ckptd's writer for this save (before planning): stage it
        now, with the plan the stager remembered, if the structure is unchanged
        (:mod:`ckpt_client.dcp.stage_ahead`), and release the trainer."""
        if self._plans is None or self.ahead is not None or self.punched \
                or self.state_dict is None:
            return
        reusable = self._plans.matching(self.state_dict)
        if reusable is None:
            return
        try:
            self.ahead = StagedAhead(writer, reusable, self.state_dict,
                                     when_abandoned=self.done_with_state)
        except (DaemonRequestError, DaemonUnavailableError, CheckpointException):
            return  # write_data's own staging meets (and reports) the same refusal
        self.punch()

    def remember(self, plan, planner) -> None:
        """This save was staged with ``plan`` (its final plan): the next may reuse it."""
        if self._plans is not None and self.ahead is None and self.state_dict is not None:
            self._plans.remember(plan, self.state_dict, planner)

    @property
    def punched(self) -> bool:
        """Whether staging ended."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Return once staged.

        Raises
        ------
        CheckpointException
            If staging failed, or the thread running the save ended without staging (its
            planning failed, or the writer was not ckptd's), or nothing took the save up
            within ``timeout`` (default: the trainer's wait for a STAGE reply, which outlasts
            the daemon's ``CKPTD_STAGE_TIMEOUT``).
        """
        # No connection is known before a save thread takes the ticket up: this
        # process's own reading of the daemon's deadlines is all there is.
        limit = waits.stage_reply(None) if timeout is None else timeout
        while not self._done.wait(0.05):
            consumer = self._consumer
            if consumer is not None and not consumer.is_alive():
                self.done_with_state()  # never written: the stager keeps this ticket
                self.punch(RuntimeError(
                    f"the DCP save thread {consumer.name!r} ended before staging: its "
                    f"planning failed (the upload future holds the error), or the "
                    f"storage_writer is not ckpt_client.dcp.StorageWriter, which is the "
                    f"only writer that stages a Stager's ticket"))
            elif consumer is None and time.monotonic() - self._created > limit:
                self.punch(TimeoutError(
                    f"no DCP executor took the save up within {limit:.0f}s "
                    f"(CKPTD_STAGE_TIMEOUT)"))
        if self._error is not None:
            raise CheckpointException("staging a checkpoint through ckptd failed",
                                      {_rank(): self._error})


def current_ticket() -> StagingTicket | None:
    """The ticket of the state dict this thread's ``dcp.save`` is writing, if any (kept)."""
    return getattr(_current, "ticket", None)


def take_ticket() -> StagingTicket | None:
    """The ticket of the state dict this thread's ``dcp.save`` is writing (once), if any.

    Called by the ckptd ``StorageWriter.write_data``: it stages the plan, then punches it.
    """
    ticket = getattr(_current, "ticket", None)
    _current.ticket = None
    return ticket


class TicketedStateDict(dict):
    """The state dict ``Stager.stage`` returns: the caller's values, plus the ticket.

    Stock ``dcp.save`` iterates it (``_stateful_to_state_dict``) on the thread that will
    call ``write_data``: that is where the ticket is handed to the writer. Pickled (the
    process executor), it becomes a plain dict of shared-memory copies.
    """

    def __init__(self, values: dict, ticket: StagingTicket, stager: "Stager") -> None:
        super().__init__(values)
        self.ticket = ticket
        self._stager = stager

    def items(self):  # noqa: D102 - dict's own
        self.ticket.claim()
        _current.ticket = self.ticket
        if self.ticket.state_dict is None:  # what DCP's _stateful_to_state_dict would make
            self.ticket.state_dict = state_dicts_of(dict(super().items()))
        return self.ticket.state_dict.items()

    def __reduce__(self):
        self.ticket.claim()
        try:
            copied = self._stager.copy_to_shared_memory(dict(super().items()))
        except BaseException as exc:
            self.ticket.punch(exc)
            raise
        self.ticket.punch()
        return (dict, (copied,))


class _PlanFirstFuture(Future):
    """The zero-stall form's future: *done* when staged, but its value is known at once.

    Stock ``async_save`` makes ``staging_completion`` from this future's completion, and
    its executor asks for the value (``result()``) before it plans: the value is the
    ticketed state dict itself, the staging happens while it is written. So ``result()``
    answers at once while staging is still under way; completion waits for the ticket.
    """

    def __init__(self, state_dict: TicketedStateDict) -> None:
        super().__init__()
        self._state_dict = state_dict

    def result(self, timeout: float | None = None):  # noqa: D102 - see class docstring
        if self.done():
            return super().result(timeout)
        return self._state_dict


class Stager:
    """A DCP ``AsyncStager`` whose staging is done by the node's ckptd.

    Use it with :class:`ckpt_client.dcp.StorageWriter`::

        dcp.async_save(state_dict, storage_writer=ckpt_client.dcp.StorageWriter(path),
                       async_stager=ckpt_client.dcp.Stager())

    Both ``AsyncCheckpointerType.THREAD`` (the default: no extra copy, the items go
    straight from the tensors into the daemon's pool) and ``PROCESS`` (one copy into
    shared memory the stager owns and reuses, then the helper process hands it to the
    daemon) work.

    Parameters
    ----------
    zero_stall : bool
        ``False`` (default): ``async_save`` returns once staged and returns the upload
        future. ``True``: ``async_save`` returns at once with an ``AsyncSaveResponse``;
        wait on its ``staging_completion`` before changing the state (before
        ``optimizer.step()``).
    """

    def __init__(self, zero_stall: bool = False) -> None:
        self.zero_stall = zero_stall
        self._tickets: list[StagingTicket] = []
        self._shared: dict | None = None
        self._shared_signature = None
        self._closed = False
        self._plans = PlanMemory()

    # AsyncStager's protocol -------------------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        """Whether ``async_save`` waits for staging before returning (blocking form)."""
        return not self.zero_stall

    def stage(self, state_dict: dict, **_: Any) -> dict | Future:
        """Ticket ``state_dict`` for staging by the writer (see the module docstring).

        Returns
        -------
        dict or Future
            The ticketed state dict (blocking form), or a future done when staged.
        """
        if self._closed:
            raise RuntimeError("this ckpt_client.dcp.Stager was closed; make a new one")
        ticket = StagingTicket(self._plans)
        self._tickets = [t for t in self._tickets if not t.punched] + [ticket]
        ticketed = TicketedStateDict(state_dict, ticket, self)
        if not self.zero_stall:
            return ticketed
        future = _PlanFirstFuture(ticketed)
        threading.Thread(target=_complete_when_staged, args=(ticket, future),
                         name="ckptd-stager-wait", daemon=True).start()
        return future

    def synchronize_staging(self) -> None:
        """Wait until every save this stager ticketed is staged.

        Raises
        ------
        CheckpointException
            If staging failed (the daemon refused the path, died, ...).
        """
        pending, self._tickets = self._tickets, []
        for ticket in pending:
            ticket.wait()

    def close(self) -> None:
        """Release the shared-memory buffers of the process path."""
        self._closed = True
        self._shared = None
        self._plans.forget()

    # The process executor's copy ---------------------------------------------------
    def copy_to_shared_memory(self, state_dict: dict) -> dict:
        """Copy ``state_dict``'s tensors into this stager's shared-memory buffers."""
        signature = _signature(state_dict)
        if self._shared is None or signature != self._shared_signature:
            self._shared = _create_cpu_state_dict(state_dict, share_memory=True)
            self._shared_signature = signature
        return _copy_state_dict(state_dict, self._shared)


def _complete_when_staged(ticket: StagingTicket, future: Future) -> None:
    try:
        ticket.wait()
    except BaseException as exc:
        future.set_exception(exc)
        # The exception's traceback keeps this frame: without its locals, no cycle
        # (future -> exception -> frame -> future) holds the save until a GC pass.
        ticket = future = None
        return
    future.set_result(None)


def _signature(value) -> Any:
    """The structure, shapes and dtypes of a state dict (when buffers can be reused)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, type(value).__name__)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return type(value).__name__


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
