"""Planning a DCP save through the daemon, with the shortcuts that keep it cheap.

Plans with the default planner take :mod:`ckpt_client.dcp.fast_plan`'s short route (the
same plans, without DCP's per-item overhead); other planners plan their own way. Owns
the caches that make a save of an unchanged structure cheap: with ``enable_cache``
the local plan is reused (:mod:`ckpt_client.dcp.plan_reuse`) and the global plan and
metadata of the previous save are reused once one small all-reduce confirms every rank's
local plan is unchanged (no gather, no scatter). :class:`EarlyStaging` starts the copy
right after the local plan, overlapping the plan collectives, when the final plan is
predictable from it.
"""

from __future__ import annotations

import dataclasses
import threading

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptd import knobs
from ckpt_client.collectives import Group
import ckpt_client.dcp.fast_plan as fast_plan
import ckpt_client.dcp.plan_wire as plan_wire
from ckpt_client.dcp.plan_reuse import ReusablePlan, planner_allows_reuse, structure_of
from ckpt_client.dcp.writer import DaemonStorageWriter
from ckpt_client.errors import CheckpointException
from ckpt_client.transport.daemon_save import abort_held


@dataclasses.dataclass
class _CachedPlan:
    local_plan: SavePlan
    central_plan: SavePlan
    metadata: Metadata | None


_plan_cache: dict = {}
#: Per cache key, the last local plan and how to resolve its items without planning.
_reusable_plans: dict = {}
#: Cache keys whose last global plan took items away from a rank (replicated tensors
#: deduplicated): staging before the global plan would copy bytes nobody writes.
_plans_that_moved_items: set = set()


def _cache_key(group: Group, planner: SavePlanner) -> tuple:
    return (id(group.group), group.size, type(planner).__name__)


def local_plan_of(state_dict, writer: DaemonStorageWriter, planner: SavePlanner,
                group: Group) -> SavePlan:
    storage_meta = writer.storage_meta()
    plan = None
    if fast_plan.plans_locally(planner):
        plan = fast_plan.local_plan(planner, state_dict, group.is_coordinator)
    if plan is None:
        planner.set_up_planner(state_dict=state_dict, storage_meta=storage_meta,
                               is_coordinator=group.is_coordinator)
    writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
    return writer.prepare_local_plan(plan if plan is not None else planner.create_local_plan())


def plan_or_reuse(state_dict, writer: DaemonStorageWriter, planner: SavePlanner,
                   group: Group, enable_cache: bool) -> tuple[SavePlan, ReusablePlan | None]:
    """The local plan; with the :class:`ReusablePlan` that resolves its items when the
    previous save's plan was reused (the planner was then not set up), else ``None``."""
    if not (enable_cache and planner_allows_reuse(planner)):
        return local_plan_of(state_dict, writer, planner, group), None
    key = _cache_key(group, planner)
    signature = structure_of(state_dict)
    known = _reusable_plans.get(key)
    if signature is not None and known is not None and known.signature == signature:
        writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
        return known.local_plan, known
    local_plan = local_plan_of(state_dict, writer, planner, group)
    if signature is None:
        _reusable_plans.pop(key, None)
    else:
        _reusable_plans[key] = ReusablePlan(signature, local_plan, state_dict, planner.mappings)
    return local_plan, None


def global_plan(local_plan: SavePlan, writer: DaemonStorageWriter, planner: SavePlanner,
                 group: Group, enable_cache: bool) -> tuple[SavePlan, Metadata | None]:
    cache_key = _cache_key(group, planner)
    cached = _plan_cache.get(cache_key) if enable_cache else None
    if enable_cache:
        # One int all-reduce replaces gathering and scattering whole plans.
        if group.all_true(cached is not None and cached.local_plan == local_plan):
            return cached.central_plan, cached.metadata
    # The default planner's plain plans travel packed (plan_wire), equal on arrival; a
    # rank unpacks whatever form came, so ranks with other planners still agree.
    packs = group.distributed and fast_plan.plans_globally(planner)
    gathered = group.gather_to_coordinator(plan_wire.pack_local(local_plan) if packs
                                           else local_plan)
    metadata = None
    plans = None
    if group.is_coordinator:
        received = [plan_wire.unpack_local(p) for p in gathered]
        if packs:  # its own plan, not rebuilt: equal, and its items' final forms are known
            received[group.rank] = local_plan
        plans, metadata = fast_plan.create_global_plan(planner, received)
        plans = writer.prepare_global_plan(plans)
        if packs:
            plans = [plan_wire.pack_final(*each) for each in zip(received, plans, gathered)]
    central_plan = plan_wire.unpack_final(group.scatter_from_coordinator(plans), local_plan)
    if enable_cache:
        _plan_cache[cache_key] = _CachedPlan(local_plan, central_plan, metadata)
    return central_plan, metadata


class EarlyStaging:
    """Staging this rank's items while the global plan is still being made.

    The global plan of DCP's default planner only assigns the rank's file prefix and may
    drop replicated items another rank writes; the items themselves come from the local
    plan. So the copy (on the background stager, with the GIL released) can start right
    after the local plan and overlap the plan collectives. The copied bytes are held back
    from the writers (no STAGED yet) until the final plan is known: they are released
    when it has exactly the staged items under the same prefix; otherwise they are
    aborted unwritten and the final plan is staged (and the next save of that group
    stages after planning). A replicated model is so written once on the first save
    too, not once per rank.
    """

    def __init__(self, local_plan: SavePlan, writer: DaemonStorageWriter,
                 planner: SavePlanner, group: Group) -> None:
        self.plan = dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{group.rank}_"))
        self.key = _cache_key(group, planner)
        self.release = threading.Event()
        self.saves = writer.stage(self.plan, planner, zero_stall=True, hold=self.release)

    @staticmethod
    def worthwhile(planner: SavePlanner, group: Group) -> bool:
        """Whether this planner's final plan is predictable from the local one, and
        there are plan collectives to overlap: a single process's global plan takes a
        millisecond or two on the short route, less than staging from a background
        thread costs (the handoff, and a STAGED that waits for its reply); DCP's own
        planning (the short route switched off) is slow enough to overlap."""
        return ((group.distributed or not knobs.DCP_FAST_PLAN.get())
                and type(planner) is DefaultSavePlanner
                and not getattr(planner, "_enable_plan_caching", False)
                and _cache_key(group, planner) not in _plans_that_moved_items)

    def adopt(self, final_plan: SavePlan, zero_stall: bool) -> tuple | None:
        """The early saves, if they stage exactly ``final_plan``; else ``None`` (aborted)."""
        if (final_plan.storage_data != self.plan.storage_data
                or [i.index for i in final_plan.items] != [i.index for i in self.plan.items]):
            _plans_that_moved_items.add(self.key)
            return self._abort("early staging dropped: the global plan differs from the "
                               "local one (items deduplicated or moved to another rank); "
                               "the final plan is staged instead")
        self.release.set()
        if not zero_stall:
            try:
                for save in self.saves:
                    save.wait_staged()
            except CheckpointException as exc:
                # staged again, to fail exactly as a direct save does
                return self._abort(f"early staging failed ({exc}); the final plan is "
                                   "staged again to report the failure as a direct save does")
        return self.saves

    def _abort(self, reason: str) -> None:
        abort_held(self.saves, self.release, reason)
        return None

    def drop(self, exc: BaseException) -> None:
        """Planning failed: the held saves must never be written."""
        self._abort(f"early staging dropped: planning the save failed "
                    f"({type(exc).__name__}: {exc})")
