"""What a failed save does to training: stop it (``"raise"``) or be recorded (``"warn"``).

Owns the failure policy of :class:`ckpt_client.AsyncCallsQueue` (and of the classes that
hold one: ``TorchAsyncCheckpoint``, ``LocalCheckpointManager``) and the record of calls
that failed under ``"warn"``. A week-long run may rather skip one checkpoint than die of
it: with ``"warn"`` the failure is logged on every rank with the detail the exception
carries (which ranks, which file, which errno), kept in ``failed_calls``, its finalize
functions do not run (nothing of it is committed) and the next saves go on.
"""

from __future__ import annotations

import logging

from ckpt_client.errors import CheckpointException

log = logging.getLogger(__name__)

POLICIES = ("raise", "warn")


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`POLICIES`.

    Raises
    ------
    ValueError
        Naming the valid choices.
    """
    if policy not in POLICIES:
        raise ValueError(f"failure_policy={policy!r} is not one of {', '.join(map(repr, POLICIES))}: "
                         "'raise' stops training on a failed save, 'warn' logs it and goes on")
    return policy


class FailedCalls:
    """The failure policy of one queue and the calls that failed under ``"warn"``.

    Parameters
    ----------
    policy : str
        ``"raise"`` or ``"warn"``.
    """

    def __init__(self, policy: str) -> None:
        self.policy = check_policy(policy)
        self.calls: list[tuple[int, CheckpointException]] = []

    def failed(self, call_idx: int, error: CheckpointException) -> None:
        """Call ``call_idx`` failed (on every rank alike): raise ``error``, or log and keep it."""
        if self.policy == "raise":
            raise error
        self.calls.append((call_idx, error))
        log.error("checkpoint call %d failed and is skipped (failure_policy='warn'; nothing "
                  "of it is committed, training goes on): %s", call_idx, error)

    def staging_failed(self, error: CheckpointException) -> None:
        """Staging a scheduled save failed: raise ``error``, or log it (the save's failure
        reaches :attr:`calls` when its call is finalized)."""
        if self.policy == "raise":
            raise error
        log.error("staging a checkpoint failed (failure_policy='warn': the save will be "
                  "skipped when it is finalized): %s", error)
