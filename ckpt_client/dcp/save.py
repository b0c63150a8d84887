"""``ckpt_client.dcp.async_save``: a DCP save whose files the daemon writes while training
goes on.

Plans like ``dcp.save`` (:mod:`ckpt_client.dcp.planning`), stages this rank's items
with the daemon, and returns an :class:`~ckpt_client.AsyncRequest` whose finalize step
gathers every rank's write results and has the coordinator commit ``.metadata`` last
(:mod:`ckpt_client.dcp.commit`). Files are DCP's own ``.distcp`` layout (each tensor
``torch.save``-d at a recorded offset), so stock ``dcp.load(...,
storage_reader=FileSystemReader(path))`` reads them, resharding included.
"""

from __future__ import annotations

import dataclasses
import os
import time
from functools import partial

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptd import knobs
from ckpt_client.collectives import Group
from ckpt_client.dcp.commit import commit_on_coordinator
from ckpt_client.dcp.commit_handover import hand_over
from ckpt_client.dcp.files import METADATA_NAME, resolve_items
from ckpt_client.dcp.guessed_plan import GuessedCopy, kept_descriptions
from ckpt_client.dcp.guessed_plan import remember as remember_plan
from ckpt_client.dcp.planning import EarlyStaging, global_plan, plan_or_reuse
from ckpt_client.dcp.stager import state_dicts_of
from ckpt_client.dcp.writer import DaemonStorageWriter
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.queue import spans
from ckpt_client.queue.gcpause import collector_paused
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.transport.daemon_save import RefusedSave


def _finalize(writer: DaemonStorageWriter, saves: tuple, plan: SavePlan,
              metadata: Metadata | None, group: Group) -> None:
    """Every rank's files are durable: the coordinator commits ``.metadata``."""
    path = os.path.join(writer.path, METADATA_NAME)
    _, causes = commit_on_coordinator(
        group, writer.write_results(saves, plan),
        lambda gathered: writer.finish(dataclasses.replace(metadata), gathered),
        cause=lambda rank, exc: f"committing {path} failed: {exc}")
    if causes:
        raise CheckpointException("checkpoint was written but not committed", causes)


@collector_paused
def async_save(state_dict, checkpoint_id: str | os.PathLike, *, process_group=None,
               planner: SavePlanner | None = None, enable_cache: bool = False,
               zero_stall: bool = False) -> AsyncRequest:
    """Save ``state_dict`` as a DCP checkpoint through the daemon, asynchronously.

    Call on all ranks of ``process_group``. Blocks through planning and staging (or, with
    ``zero_stall``, through planning only); the daemon then writes while training goes
    on. Schedule the returned request on an :class:`~ckpt_client.AsyncCallsQueue`: its
    finalize step commits ``.metadata`` (by the coordinator, after every rank's files
    are durable).

    Parameters
    ----------
    state_dict : dict
        As for ``torch.distributed.checkpoint.save``: a top-level ``Stateful`` value is
        saved as its ``state_dict()``.
    checkpoint_id : str or PathLike
        Checkpoint directory (must lie under one of the daemon's ``--root``).
    process_group : ProcessGroup, optional
        Group to save over (default: the default group, or none).
    planner : SavePlanner, optional
        Default: ``DefaultSavePlanner()``.
    enable_cache : bool
        Reuse the plan and global metadata of the previous save with the same structure:
        with the default planner the local plan is not made again (each item is fetched
        by the path recorded when it was planned), and the plan gather/scatter is
        skipped (one small all-reduce confirms every rank hit).
    zero_stall : bool
        Return once the save is planned and queued; the bytes are staged in the
        background, and the state must not change until ``wait_staged`` /
        ``AsyncCallsQueue.wait_for_staging`` returns (``guard_optimizer`` does that).

    Returns
    -------
    AsyncRequest
    """
    started = time.time()
    if isinstance(state_dict, dict):  # as stock DCP: a Stateful value saves its state
        state_dict = state_dicts_of(state_dict)
    planner = planner or DefaultSavePlanner()
    writer = DaemonStorageWriter(checkpoint_id)
    group = Group(process_group)
    # A blocking save copies with the previous save's plan while it plans (adopted only
    # if the plan comes out the same): the planning overlaps the copy. A cached save's
    # plan is the cached one unless its structure changed: its copy starts before the
    # structure check (and the STAGE's round trip overlaps that check).
    guess = None if zero_stall or (enable_cache and not knobs.DCP_GUESS_CACHED.get()) \
        else GuessedCopy.start(state_dict, writer, planner, group)
    early = None
    try:
        local_plan, reuse = plan_or_reuse(state_dict, writer, planner, group, enable_cache)
        if guess is None and reuse is None and EarlyStaging.worthwhile(planner, group):
            try:
                early = EarlyStaging(local_plan, writer, planner, group)
            except (DaemonRequestError, DaemonUnavailableError):
                early = None  # the direct staging below meets (and reports) the same refusal
        central_plan, metadata = global_plan(local_plan, writer, planner, group, enable_cache)
        final_plan = planner.finish_plan(central_plan)
    except BaseException as exc:
        if early is not None:
            early.drop(exc)
        if guess is not None:
            guess.drop(f"planning the save failed ({type(exc).__name__}: {exc})")
        raise
    planned, refused = time.time(), False
    try:
        saves = early.adopt(final_plan, zero_stall) if early is not None else None
        sources = None if guess is None else guess.sources_for(final_plan, reuse)
        if saves is None and sources is None:
            sources = reuse.sources(final_plan, state_dict, planner) if reuse is not None \
                else resolve_items(final_plan, planner)
        if guess is not None:
            saves = guess.adopt(final_plan, sources)
        if saves is None:
            # The previous save's descriptions, when the plan is the same: the staging
            # then finds its file grouping, layout and pool views by identity.
            buffers = reuse.buffers(final_plan, sources) if reuse is not None else \
                kept_descriptions(group, planner, state_dict, final_plan, sources)
            saves = writer.stage(final_plan, planner, zero_stall=zero_stall,
                                 sources=sources, buffers=buffers)
    except (DaemonRequestError, DaemonUnavailableError) as exc:
        if guess is not None:  # its copy is dropped already (adopt met the refusal first)
            guess.disarm()
        if not group.distributed:
            raise
        # The other ranks are about to wait in the completion collective: report the
        # refusal there, as a failure every rank raises, instead of raising alone.
        saves, refused = (RefusedSave(group.rank, str(exc)),), True
    except BaseException as exc:
        if guess is not None:
            guess.drop(f"{type(exc).__name__}: {exc}")
        raise
    if not refused:  # a save whose staging failed must not arm the guess
        remember_plan(group, planner, state_dict, final_plan, reuse)
    if writer.connection.tiered and not zero_stall:
        hand_over(writer, saves, final_plan, metadata, group)
    spans.note(saves, "planning", started, planned)
    spans.note(saves, "blocked in dcp.async_save", started, time.time())
    return AsyncRequest(daemon_saves=saves,
                        finalize_fns=[partial(_finalize, writer, saves, final_plan, metadata, group)])
