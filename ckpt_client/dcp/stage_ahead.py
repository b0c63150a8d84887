"""Staging a stock ``dcp.async_save`` before DCP plans it, with the previous save's plan.

Stock ``async_save`` plans every save from scratch on its executor thread (flatten, local
plan, a gather and a scatter of the plans over the process group, the global plan) and
only then calls ``write_data``, which is where ckptd's writer can stage: the trainer,
waiting for staging, waits for all of that planning too. A training loop saves the same
structure again and again, though, so the plan of the previous save is the plan of this
one. While the state dict's structure (:func:`ckpt_client.dcp.plan_reuse.structure_of`)
equals the one the :class:`ckpt_client.dcp.Stager` remembered, the writer stages this
rank's items with the remembered plan as soon as DCP first calls it (``storage_meta``,
before any planning) and releases the trainer; DCP then plans in the background as
usual, and ``write_data`` *adopts* the staged saves: the final plan must be the
remembered one or a subset of it (the global plan may drop items a replicated tensor has
on another rank; their staged bytes are written but no ``.metadata`` entry points at
them). A final plan with an item that was not staged, or with another file prefix, fails
the save (the trainer has moved on, so its tensors cannot be staged again). A save whose
planning fails never adopts its early saves: once the executor thread has ended, the
save's ticket drops the state dict (the Stager keeps its last ticket until its next save)
and the saves are aborted (the daemon removes what they wrote).

Only saves run by DCP's thread executor are staged ahead or remembered. With the
``PROCESS`` executor the trainer is already released before DCP plans: the state dict is
copied into the Stager's shared memory while it is pickled for DCP's helper process, and
the helper plans afterwards. Its planning happens where the ticket (and this memory) does
not go, so a process save neither uses nor changes the remembered plan, and one Stager
may serve saves of both executors.

Owns: :class:`PlanMemory` (a Stager's remembered plan) and :class:`StagedAhead` (one
save's early staging until it is adopted or aborted). Planning is DCP's; staging is the
writer's.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckpt_client.dcp.plan_reuse import ReusablePlan, planner_allows_reuse, structure_of

log = logging.getLogger(__name__)

#: Pickles non-tensor leaves as ``DefaultSavePlanner.transform_object`` does (stateless);
#: only plans made by a planner that resolves items exactly so are remembered.
_TRANSFORM = DefaultSavePlanner()


class PlanMemory:
    """The last plan a :class:`ckpt_client.dcp.Stager`'s saves were written with."""

    def __init__(self) -> None:
        self._plan: ReusablePlan | None = None
        self._lock = threading.Lock()  # saves of one stager may overlap

    def matching(self, state_dict) -> ReusablePlan | None:
        """The remembered plan, if ``state_dict`` has the structure it was made for."""
        with self._lock:
            known = self._plan
        if known is None:
            return None
        return known if structure_of(state_dict) == known.signature else None

    def remember(self, plan: SavePlan, state_dict, planner: SavePlanner) -> None:
        """Remember ``plan`` (this rank's final plan of ``state_dict``), if ``planner``
        plans and resolves items as DCP's default planner does; else forget."""
        signature = structure_of(state_dict) if planner_allows_reuse(planner) else None
        reusable = (ReusablePlan(signature, plan, state_dict, planner.mappings)
                    if signature is not None else None)
        with self._lock:
            self._plan = reusable

    def forget(self) -> None:
        """Plan the next save from scratch."""
        with self._lock:
            self._plan = None


class StagedAhead:
    """One save staged with a remembered plan before DCP planned it.

    Parameters
    ----------
    writer : ckpt_client.dcp.DaemonStorageWriter
        Stages the items.
    reusable : ReusablePlan
        The remembered plan.
    state_dict : dict
        The save's state dict (``Stateful`` values already turned into their state).
    when_abandoned : callable, optional
        Called (before the saves are aborted) when the save's planning failed: its owner
        drops what it keeps of the save, so that nothing waits for its next save to free
        the tensors.
    """

    def __init__(self, writer, reusable: ReusablePlan, state_dict,
                 when_abandoned: Callable[[], None] | None = None) -> None:
        self.plan = reusable.local_plan
        self.adopted = False
        sources = reusable.sources(self.plan, state_dict, _TRANSFORM)
        self.saves = writer.stage(self.plan, _TRANSFORM, sources=sources,
                                  buffers=reusable.buffers(self.plan, sources))
        threading.Thread(target=self._abort_unless_adopted,
                         args=(threading.current_thread(), when_abandoned),
                         name="ckptd-stage-ahead-watch", daemon=True).start()

    def adopt(self, final_plan: SavePlan) -> tuple:
        """The staged saves, for ``final_plan`` (see the module docstring).

        Raises
        ------
        RuntimeError
            If ``final_plan`` is not the remembered plan or a subset of it (the saves are
            aborted).
        """
        staged = {item.index for item in self.plan.items}
        missing = [item.index.fqn for item in final_plan.items if item.index not in staged]
        if missing or final_plan.storage_data != self.plan.storage_data:
            self.abort("the final plan differs from the remembered one")
            raise RuntimeError(
                f"ckpt_client.dcp.Stager staged this save with the previous save's plan, but "
                f"DCP planned it differently ({len(missing)} item(s) not staged, e.g. "
                f"{missing[:3]}; file prefix {final_plan.storage_data!r} against "
                f"{self.plan.storage_data!r}); the save failed. Saves of one Stager must "
                f"keep their planner and process group while the structure stays the "
                f"same; save again (the next save plans from scratch)")
        self.adopted = True
        return self.saves

    def abort(self, reason: str) -> None:
        """Drop the staged saves (the daemon removes what they wrote)."""
        for save in self.saves:
            save.abort(reason)

    def _abort_unless_adopted(self, executor: threading.Thread,
                              when_abandoned: Callable[[], None] | None) -> None:
        executor.join()  # DCP's executor thread runs one save, then ends
        if not self.adopted:
            log.warning("a DCP save staged ahead was never written (its planning failed); "
                        "dropping its staged bytes")
            if when_abandoned is not None:
                when_abandoned()
            self.abort("the DCP save's planning failed after it was staged ahead")
