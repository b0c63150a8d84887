"""Keeping a zero-stall snapshot exact: the optimizer waits for staging before it steps.

A zero-stall save returns before its bytes are staged; the parameters and optimizer
state must not change until they are. The one thing that changes them in a training loop
is ``optimizer.step()``, so :func:`guard_optimizer` registers a step pre-hook that waits
for the staging of every scheduled save. When staging is already done the hook returns at
once; when it failed, or the daemon died, it raises instead of letting a half-staged
snapshot through.
"""

from __future__ import annotations

from typing import Protocol

import torch


class StagingWaiter(Protocol):
    """What the guard waits on: an ``AsyncCallsQueue`` or a ``TorchAsyncCheckpoint``."""

    def wait_for_staging(self, timeout: float | None = None) -> None:
        """Return once every scheduled save's bytes are staged."""


def guard_optimizer(optimizer: torch.optim.Optimizer, waiter: StagingWaiter):
    """Make ``optimizer.step()`` wait until ``waiter``'s saves are staged.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer whose step changes the state being saved.
    waiter : AsyncCallsQueue or TorchAsyncCheckpoint
        Where the zero-stall saves were scheduled.

    Returns
    -------
    torch.utils.hooks.RemovableHandle
        ``handle.remove()`` takes the guard off.

    Raises
    ------
    CheckpointException
        From ``optimizer.step()``, when staging a save failed (the step does not run).

    Examples
    --------
    >>> checkpoint = TorchAsyncCheckpoint()
    >>> guard = guard_optimizer(optimizer, checkpoint)
    >>> checkpoint.async_save(state, path, zero_stall=True)  # returns in milliseconds
    >>> loss.backward(); optimizer.step()                     # waits only if still staging
    """
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: waiter.wait_for_staging())
