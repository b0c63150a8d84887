"""The reference's split DCP save: plan now, write in the background, finalize later.

:func:`save_state_dict_async_plan` plans like ``torch.distributed.checkpoint.save`` and
has the storage writer resolve its data; the caller runs the writer's save function (on
an :class:`~ckpt_client.AsyncCallsQueue`) and calls :func:`save_state_dict_async_finalize`
in the request's finalize function, which gathers every rank's write results, has the
coordinator commit ``.metadata`` and raises :class:`~ckpt_client.CheckpointException` on
every rank if any rank's write failed (the coordinator's message carries each failing
rank's full error, the others' the failing ranks and the cause).

Planning collectives, and when :class:`CheckpointMetadataCache` skips them:

- full planning: the local plans are gathered to the coordinator (``gather_object``),
  which makes the global plan and metadata, and each rank gets its part back
  (``scatter_object_list``);
- with ``enable_cache=True``, once a save has been planned: every rank compares its new
  local plan with the cached one and one small all-reduce (an int tensor) confirms that
  all are unchanged; then the cached global plan and metadata are reused and nothing is
  gathered or scattered. A changed structure on any rank falls back to full planning;
- with a planner and writer that can plan decentrally
  (``can_run_decentralized_global_plan``), each rank makes its own part of the global
  plan; only the metadata needs the gathered local plans, and a metadata loaded from the
  previous checkpoint (:func:`init_checkpoint_metadata_cache`) whose recorded plans match
  every rank's (one all-reduce) replaces even that gather.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import fields

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckpt_client.collectives import Group
from ckpt_client.dcp.commit import commit_on_coordinator
from ckpt_client.errors import CheckpointException
from ckpt_client.megatron.results import WorkerFailure, is_wrapped_failure
from ckpt_client.megatron.writer import FileSystemWriterAsync
from ckpt_client.queue.gcpause import collector_paused

log = logging.getLogger(__name__)


class SaveGroup(Group):
    """The process group a save plans and finalizes over, and its coordinator.

    The third element of :func:`save_state_dict_async_plan`'s result (the reference's
    ``dist_wrapper``).

    Parameters
    ----------
    process_group : ProcessGroup, optional
        Default: the default group (or none, single process).
    coordinator_rank : int
        Rank, within the group, that makes the global plan and commits ``.metadata``.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 coordinator_rank: int = 0) -> None:
        super().__init__(process_group)
        if not 0 <= coordinator_rank < self.size:
            raise ValueError(f"coordinator_rank {coordinator_rank} is not a rank of the "
                             f"{self.size}-rank process group")
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = self.rank == coordinator_rank
        if self.distributed:
            self.coordinator_global = self.global_rank(coordinator_rank)

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of ``group_rank``."""
        if not self.distributed or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def get_world_size(self) -> int:
        """Number of ranks in the group."""
        return self.size


class CheckpointMetadataCache:
    """Plans and global metadata kept between saves of the same structure.

    Attributes
    ----------
    cached_local_plan, cached_central_plan : SavePlan or None
        This rank's local plan and its part of the global plan, from the last planned save.
    cached_global_metadata : Metadata or None
        The global metadata (the coordinator's; or one loaded from a checkpoint).
    validated_cache_reuse : bool
        Whether the last save reused the cached plans.
    validated_loaded_metadata_reuse : bool
        Whether the last save reused the loaded checkpoint's metadata.
    loaded_all_plans : list of SavePlan or None
        The local plans recorded in the loaded metadata (``all_local_plans``).
    """

    def __init__(self) -> None:
        self.cached_local_plan: SavePlan | None = None
        self.cached_central_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: list | None = None

    def set_cached_global_metadata(self, cached_global_metadata: Metadata | None) -> None:
        """Start from the metadata of a checkpoint (e.g. the one training resumed from).

        It is reused only by planners that plan decentrally, and only if the local plans
        it records (``all_local_plans``) match every rank's current one.
        """
        self.cached_global_metadata = cached_global_metadata
        self.loaded_all_plans = getattr(cached_global_metadata, "all_local_plans", None)
        if cached_global_metadata is not None and self.loaded_all_plans is None:
            log.debug("the given metadata records no all_local_plans: it cannot be reused")

    def get_cache_metadata(self) -> tuple:
        """``(cached_central_plan, cached_local_plan, validated_cache_reuse,
        loaded_all_plans)``, as the reference returns them."""
        return (self.cached_central_plan, self.cached_local_plan, self.validated_cache_reuse,
                self.loaded_all_plans)

    def get_metadata_caching_status(self) -> tuple[bool, bool]:
        """``(validated_cache_reuse, validated_loaded_metadata_reuse)`` of the last save."""
        return self.validated_cache_reuse, self.validated_loaded_metadata_reuse

    def remember(self, local_plan: SavePlan, central_plan: SavePlan,
                 global_metadata: Metadata | None) -> None:
        """Keep a freshly planned save for the next ones."""
        self.cached_local_plan = local_plan
        self.cached_central_plan = central_plan
        if global_metadata is not None:
            self.cached_global_metadata = global_metadata


_checkpoint_metadata_cache: CheckpointMetadataCache | None = None


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata | None = None) -> None:
    """Create the process-wide metadata cache (if needed) and seed it with a checkpoint's
    metadata (see :meth:`CheckpointMetadataCache.set_cached_global_metadata`)."""
    global _checkpoint_metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    _checkpoint_metadata_cache.set_cached_global_metadata(cached_global_metadata)


def get_metadata_caching_status() -> tuple[bool, bool] | None:
    """The process-wide cache's status (``None`` before it exists)."""
    if _checkpoint_metadata_cache is None:
        return None
    return _checkpoint_metadata_cache.get_metadata_caching_status()


def _cache_for(enable_cache: bool, metadata_cache: CheckpointMetadataCache | None):
    global _checkpoint_metadata_cache
    if not enable_cache:
        return None
    if metadata_cache is not None:
        return metadata_cache
    if _checkpoint_metadata_cache is None:  # the reference needs init first; we create it
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    return _checkpoint_metadata_cache


@collector_paused
def save_state_dict_async_plan(state_dict: dict, storage_writer: FileSystemWriterAsync,
                               process_group: dist.ProcessGroup | None = None,
                               coordinator_rank: int = 0, planner: SavePlanner | None = None,
                               enable_cache: bool = False,
                               metadata_cache: CheckpointMetadataCache | None = None) -> tuple:
    """Plan a DCP save and have ``storage_writer`` resolve its data (call on all ranks).

    Parameters
    ----------
    state_dict : dict
        As for ``torch.distributed.checkpoint.save``.
    storage_writer : FileSystemWriterAsync
        A writer with ``prepare_write_data`` (one per save).
    process_group : ProcessGroup, optional
        Group to plan over (default: the default group).
    coordinator_rank : int
        Group rank that makes the global plan and commits ``.metadata``.
    planner : SavePlanner, optional
        Default: ``DefaultSavePlanner()``.
    enable_cache : bool
        Reuse plans and metadata of the previous save of the same structure (see the
        module docstring). Unlike the reference, the process-wide cache is created on
        first use; :func:`init_checkpoint_metadata_cache` is not required.
    metadata_cache : CheckpointMetadataCache, optional
        Cache to use instead of the process-wide one.

    Returns
    -------
    (storage_writer, global_metadata, SaveGroup)
        Pass them to :func:`save_state_dict_async_finalize`; ``global_metadata`` is
        ``None`` except on the coordinator.
    """
    planner = planner if planner is not None else DefaultSavePlanner()
    group = SaveGroup(process_group, coordinator_rank)
    cache = _cache_for(enable_cache, metadata_cache)
    planner.set_up_planner(state_dict, storage_meta=storage_writer.storage_meta(),
                           is_coordinator=group.is_coordinator)
    storage_writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
    local_plan = storage_writer.prepare_local_plan(planner.create_local_plan())
    central_plan, global_metadata = _plan(local_plan, planner, storage_writer, group, cache)
    central_plan = planner.finish_plan(central_plan)
    storage_writer.prepare_write_data(central_plan, planner)
    return storage_writer, global_metadata, group


def _plan(local_plan: SavePlan, planner, writer, group: SaveGroup,
          cache: CheckpointMetadataCache | None) -> tuple[SavePlan, Metadata | None]:
    if cache is not None and cache.cached_local_plan is not None:
        # One int all-reduce replaces gathering and scattering whole plans.
        cache.validated_cache_reuse = group.all_true(local_plan == cache.cached_local_plan)
        if cache.validated_cache_reuse:
            metadata = cache.cached_global_metadata if group.is_coordinator else None
            return cache.cached_central_plan, metadata
    if (getattr(planner, "can_run_decentralized_global_plan", False)
            and getattr(writer, "can_run_decentralized_global_plan", False)):
        central_plan, metadata = _plan_decentrally(local_plan, planner, writer, group, cache)
    else:
        gathered = group.gather_to_coordinator(local_plan)
        plans, metadata = None, None
        if group.is_coordinator:
            plans, metadata = planner.create_global_plan(gathered)
            plans = writer.prepare_global_plan(plans)
        central_plan = group.scatter_from_coordinator(plans)
    if cache is not None:
        cache.remember(local_plan, central_plan, metadata)
    return central_plan, metadata


def _same_plan_apart_from_storage(plan: SavePlan, other: SavePlan) -> bool:
    return all(getattr(plan, f.name) == getattr(other, f.name) for f in fields(plan)
               if f.name != "storage_data")


def _plan_decentrally(local_plan: SavePlan, planner, writer, group: SaveGroup,
                      cache: CheckpointMetadataCache | None) -> tuple[SavePlan, Metadata | None]:
    loaded = cache.loaded_all_plans if cache is not None else None
    reuse_loaded = False
    if loaded and len(loaded) == group.size:
        reuse_loaded = group.all_true(_same_plan_apart_from_storage(local_plan, loaded[group.rank]))
    if cache is not None:
        cache.validated_loaded_metadata_reuse = reuse_loaded
    metadata = None
    if reuse_loaded:
        metadata = cache.cached_global_metadata if group.is_coordinator else None
    else:
        gathered = group.gather_to_coordinator(local_plan)
        if group.is_coordinator:
            _, metadata = planner.create_global_plan(gathered)
            metadata.all_local_plans = gathered  # lets a resumed job reuse this metadata
    central_plan = writer.prepare_decentralized_global_plan(
        planner.create_decentralized_global_plan(local_plan))
    return central_plan, metadata


def save_state_dict_async_finalize(storage_writer: FileSystemWriterAsync,
                                   global_metadata: Metadata | None,
                                   dist_wrapper: SaveGroup) -> None:
    """Finish a save planned by :func:`save_state_dict_async_plan` (call on all ranks,
    after the writer's save function ran on every rank).

    Raises
    ------
    CheckpointException
        On every rank, if any rank's write (or the commit of ``.metadata``) failed. The
        coordinator's names each failing rank's full error (``Worker failure: ...``);
        the other ranks' name the failing ranks and the cause.
    """
    group = dist_wrapper

    def failed_ranks(gathered: list) -> dict:
        return {group.global_rank(rank): outcome[0] for rank, outcome in enumerate(gathered)
                if is_wrapped_failure(outcome)}

    def commit(gathered: list) -> None:
        if global_metadata is None:
            raise RuntimeError("the coordinator has no global metadata; pass what "
                               "save_state_dict_async_plan returned unchanged")
        storage_writer.finish(copy.copy(global_metadata), gathered)

    errors, causes = commit_on_coordinator(group, storage_writer.retrieve_write_results(),
                                           commit, cause=_cause, rank_failures=failed_ranks)
    if not causes:
        return
    if group.is_coordinator:
        raise CheckpointException("checkpoint write failed", {
            rank: f"Worker failure: {causes[rank]}" if isinstance(exc, WorkerFailure)
            else causes[rank] for rank, exc in errors.items()})
    raise CheckpointException(f"checkpoint write failed (the coordinator, rank "
                              f"{group.coordinator_global}, reports the full errors)", causes)


def _cause(rank: int, exc: BaseException) -> str:
    text = exc.reason if isinstance(exc, WorkerFailure) else f"{type(exc).__name__}: {exc}"
    return text.removeprefix(f"rank {rank}: ")
