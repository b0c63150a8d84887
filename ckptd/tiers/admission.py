"""Admission of tiered saves against the stage budget: reserve, park, or refuse.

Owns the queue of STAGEs waiting for room in the stage directory (``--stage-policy
wait``) and the order they get it in: first come, first admitted, so a large save is not
starved by small ones behind it. Every way out of the queue is here: admitted once the
budget frees (a flush ended, a STAGE ahead left), refused when its trainer gave up on it
(an ABORT naming the STAGE message) or went away (goodbye, exit), when it waited
``CKPTD_STAGE_TIMEOUT``, or when the daemon stops. A STAGE refused here hands back what
it brought (``refused()``: its CUDA handles, which the trainer leaves to the daemon once
a save failed); one refused by the ordinary admission after it got budget gives them
back there.

Answers its calls (every parked STAGE gets exactly one reply); reserves and releases
nothing but budget in the :class:`ckptd.tiers.stage.StageDir`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from ckptd.protocol import ErrorCode
from ckptd.server.endpoint import DEFERRED, Call, RequestError
from ckptd.tiers.stage import StageDir

log = logging.getLogger(__name__)


@dataclass
class _Parked:
    """A STAGE waiting for the budget."""

    call: Call
    body: object
    need: int
    start: Callable
    refused: Callable[[], None]


class StageAdmission:
    """The stage budget's gate (see the module docstring).

    Parameters
    ----------
    stage : StageDir
        Whose budget is reserved.
    policy : str
        ``wait`` or ``refuse``: what a save that does not fit gets.
    next_key : callable
        The stage key of the request the next admission will create.
    """

    def __init__(self, stage: StageDir, policy: str, next_key: Callable[[], str]) -> None:
        self.stage, self.policy, self._next_key = stage, policy, next_key
        self.waiting: list[_Parked] = []

    def admit(self, call: Call, body, start, refused: Callable[[], None] = lambda: None) -> object:
        """Reserve budget for a tiered STAGE, or park it (wait) or refuse it.

        ``start(call, body)`` runs the ordinary admission once the budget is reserved and
        returns the handler's answer (a reply body or DEFERRED). ``refused()`` runs when the
        STAGE is refused here, now or after it waited.
        """
        need = StageDir.need(sum(b[2] for b in body.buffers), len(body.files), len(body.buffers))
        if need > self.stage.budget:
            refused()
            raise RequestError(ErrorCode.STAGE_FULL, (
                f"a save of {need} bytes can never fit the stage budget of "
                f"{self.stage.budget} bytes in {self.stage.path}"),
                "raise --stage-budget (or free the stage filesystem), or save less per rank")
        if self.waiting or not self.stage.fits(need):
            if self.policy == "refuse":
                refused()
                raise RequestError(ErrorCode.STAGE_FULL, (
                    f"the stage directory {self.stage.path} is full: {self.stage.used_bytes} "
                    f"of {self.stage.budget} bytes wait to reach their targets"),
                    "the save was refused and training goes on; the target is slower than "
                    "the save cadence (see ckptd status), so save less often, or raise "
                    "--stage-budget")
            log.info("a save of %d bytes waits for the stage budget (%d of %d bytes used)",
                     need, self.stage.used_bytes, self.stage.budget)
            self.waiting.append(_Parked(call, body, need, start, refused))
            return DEFERRED
        return self._start(call, body, need, start)

    def _start(self, call: Call, body, need: int, start):
        key = self._next_key()
        self.stage.reserve(key, need)
        try:
            return start(call, body)
        except BaseException:
            self.stage.release(key)
            raise

    def drop(self, routing_id: bytes, messages: set) -> None:
        """Refuse the STAGE messages of ``routing_id`` an ABORT named that still wait for the
        budget: admitted later, each would hold space its trainer gave up on."""
        self._refuse([p for p in self.waiting
                      if p.call.routing_id == routing_id and p.call.msg_id in messages],
                     lambda parked: (ErrorCode.ABORTED, "the trainer gave up waiting for this "
                                     "save's room in the stage directory",
                                     "the save did not happen; save again"))

    def drop_connection(self, routing_id: bytes, reason: str) -> None:
        """Refuse every STAGE of ``routing_id`` still waiting: its trainer said goodbye or
        exited, and a STAGE nobody will copy into would hold the head of the queue (and
        every save behind it) until ``CKPTD_STAGE_TIMEOUT``."""
        self._refuse([p for p in self.waiting if p.call.routing_id == routing_id],
                     lambda parked: (ErrorCode.ABORTED, reason,
                                     "the save did not happen; save again"))

    def expire(self, now: float, limit: float) -> None:
        """Refuse the saves that waited for the budget ``limit`` seconds (counted from
        their STAGE's arrival): the daemon, not the trainer's patience, ends the wait, so
        a trainer never gives up on a STAGE the daemon may still start."""
        def why(parked: _Parked) -> tuple:
            waited = now - parked.call.received_at
            log.warning("a save of %d bytes waited %.0fs for the stage budget; refused",
                        parked.need, waited)
            return (ErrorCode.STAGE_FULL, (
                f"the save waited {waited:.0f}s (CKPTD_STAGE_TIMEOUT {limit:g}s) for room in "
                f"the stage directory {self.stage.path}: {self.stage.used_bytes} of "
                f"{self.stage.budget} bytes still wait to reach their targets"),
                "the save was not started; the target is slower than the save cadence (see "
                "ckptd status): save less often, raise --stage-budget, or check the target")
        self._refuse([p for p in self.waiting if now - p.call.received_at > limit], why)

    def close(self) -> None:
        """The daemon stops: every parked STAGE is refused."""
        self._refuse(list(self.waiting), lambda parked: (
            ErrorCode.SHUTTING_DOWN, "ckptd is shutting down",
            "the save was not started; retry once a daemon is running"), admit_next=False)

    def _refuse(self, leaving: list, why: Callable, admit_next: bool = True) -> None:
        for parked in leaving:
            self.waiting.remove(parked)
            parked.refused()
            parked.call.fail(*why(parked))
        if leaving and admit_next:
            self.budget_freed()  # first come, first admitted: those behind may fit now

    def budget_freed(self) -> None:
        """Admit the parked STAGEs at the head of the queue that fit now."""
        while self.waiting and self.stage.fits(self.waiting[0].need):
            parked = self.waiting.pop(0)
            try:
                answer = self._start(parked.call, parked.body, parked.need, parked.start)
            except RequestError as exc:
                parked.call.fail(exc.code, exc.message, exc.hint, **exc.context)
                continue
            except Exception as exc:  # a daemon bug: this STAGE still gets its answer, and
                # those behind it their turn (this runs from ABORTs and the serve loop's tick)
                log.exception("admitting a save that waited for the stage budget failed")
                parked.refused()  # the ordinary admission gave back only on its refusals
                parked.call.fail(ErrorCode.INTERNAL, f"admitting the save failed: {exc!r}",
                                 "this is a ckptd bug; the daemon keeps serving")
                continue
            if answer is not DEFERRED:
                parked.call.reply(answer)
