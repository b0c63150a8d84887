"""A process-wide guard that holds every optimizer's update until staging is done.

Zero-stall saves hand the daemon live tensors and copy them in the background; the
trainer must not change them before that copy is done. Where a framework gives the
checkpoint writer no handle on its optimizers (a Lightning ``CheckpointIO`` sees only
the checkpoint dict), :class:`StepGuard` finds them itself through torch's global
optimizer step pre-hook, which runs for every ``torch.optim.Optimizer``:

- a ``step(closure)`` gets its closure wrapped, so the wait comes after the closure's
  forward and backward (the staging overlaps them) and before the first parameter
  update (Lightning's automatic optimization calls ``step(closure=...)``);
- a ``step()`` with no closure (manual optimization, AMP's ``scaler.step``) waits at
  once: forward and backward ran before it.

Each optimizer the hook sees is remembered (weakly), so the guard can tell which tensors
only an optimizer step changes: the parameters and state tensors of those optimizers.
Anything else in a checkpoint (buffers a forward pass updates, such as batch norm's
running statistics; a callback's tensors) may change before the next step, so the caller
copies those at save time. Owns the hook's lifetime and the set of optimizers seen; it
does not know how the waiting is done (``wait`` is given).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["StepGuard"]


class StepGuard:
    """Calls ``wait`` before any optimizer in this process changes its parameters.

    Parameters
    ----------
    wait : callable
        Blocks until the tensors handed over are staged (raises if staging failed: the
        optimizer step then does not run).
    pending : callable
        True while a save may still be staging (the hook is a no-op otherwise).
    """

    def __init__(self, wait: Callable[[], None], pending: Callable[[], bool]) -> None:
        self._wait, self._pending = wait, pending
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._handle = None

    def install(self) -> None:
        """Register the global hook (again after :meth:`remove`); idempotent."""
        if self._handle is None:
            # A weak reference: a guard its owner forgot to remove must not keep it alive;
            # its hook then does nothing.
            self._handle = register_optimizer_step_pre_hook(_hook(weakref.ref(self)))

    def remove(self) -> None:
        """Take the hook off (the optimizers seen are still remembered)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def only_steps_change(self) -> set[int]:
        """Storage addresses of the tensors only an optimizer step changes: the
        parameters and state of every optimizer seen stepping."""
        storages = set()
        for optimizer in list(self._optimizers):
            for group in optimizer.param_groups:
                storages.update(p.untyped_storage().data_ptr() for p in group["params"])
            for state in optimizer.state.values():
                storages.update(v.untyped_storage().data_ptr() for v in state.values()
                                if isinstance(v, torch.Tensor))
        return storages

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict):
        self._optimizers.add(optimizer)
        if not self._pending():
            return None
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": self._waiting_after(kwargs["closure"])}
        if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer itself
            return (args[0], self._waiting_after(args[1]), *args[2:]), kwargs
        self._wait()
        return None

    def _waiting_after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def closure_then_wait():
            loss = closure()
            self._wait()  # optimizers that call the closure again find nothing to wait for
            return loss
        return closure_then_wait


def _hook(guard_ref: weakref.ref):
    def before_step(optimizer, args, kwargs):
        guard = guard_ref()
        return None if guard is None else guard._before_step(optimizer, args, kwargs)
    return before_step
