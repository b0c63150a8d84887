"""The Megatron-style flow on 2 real gloo ranks, and the collectives its planning runs.

Megatron's async DCP save, unchanged apart from imports: ``save_state_dict_async_plan``
-> ``storage_writer.get_save_function_and_args()`` -> ``AsyncRequest(save_fn, save_args,
[finalize_fn], preload_fn=preload_fn)`` on an ``AsyncCallsQueue`` ->
``save_state_dict_async_finalize`` in the finalize function. Every checkpoint is loaded
with stock ``dcp.load``.

The planning collectives are counted by wrapping torch.distributed's object collectives
inside the rank process while ``save_state_dict_async_plan`` runs (instrumentation: the
real collectives still run).
"""

import os
import pickle
from collections import Counter
from functools import partial

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader

from ckpt_client.compat.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ckpt_client.compat.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from ckpt_client.compat.checkpointing.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache, get_metadata_caching_status, init_checkpoint_metadata_cache,
    save_state_dict_async_finalize, save_state_dict_async_plan)
from multirank import run_ranks, values

PLANNING_COLLECTIVES = ("gather_object", "scatter_object_list", "all_gather_object",
                        "broadcast_object_list")


def model_state(rank: int, step: int, extra_layer: bool = False) -> dict:
    shared = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 * step + rank)
    state = {"embedding": torch.rand(128, 32, generator=shared),
             "decoder.weight": torch.rand(32, 32, generator=shared),
             f"optimizer.rank{rank}.exp_avg": torch.rand(32, 32, generator=own),
             "iteration": step}
    if extra_layer:
        state["decoder.extra"] = torch.rand(8, generator=shared)
    return state


def load_into_zeros(directory: str, like: dict) -> dict:
    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
              for k, v in like.items()}
    torch_dcp.load(loaded, storage_reader=FileSystemReader(directory))
    return loaded


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in b)


def plan_counting_collectives(plan_call) -> tuple:
    """Run ``plan_call()``, counting the object collectives it makes on this rank."""
    import torch.distributed as dist

    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in PLANNING_COLLECTIVES}

    def counted(name):
        def collective(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return collective

    try:
        for name in PLANNING_COLLECTIVES:
            setattr(dist, name, counted(name))
        planned = plan_call()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return planned, sum(counts.values())


def schedule_megatron_style(queue, state, directory, planner, **plan_options) -> int:
    """One save as Megatron's async DCP strategy does it; returns its planning collectives."""
    writer = FileSystemWriterAsync(directory, thread_count=2)
    planned, collectives = plan_counting_collectives(partial(
        save_state_dict_async_plan, state, writer, None, 0, planner=planner, **plan_options))
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn():
        save_state_dict_async_finalize(*planned)

    queue.schedule_async_request(AsyncRequest(save_fn, save_args, [finalize_fn],
                                              preload_fn=preload_fn))
    return collectives


def cached_saves(rank, world_size, root):
    queue = AsyncCallsQueue()
    collectives, statuses = [], []
    for step in range(4):
        state = model_state(rank, step)
        collectives.append(schedule_megatron_style(queue, state, os.path.join(root, f"s{step}"),
                                                   DefaultSavePlanner(), enable_cache=True))
        statuses.append(get_metadata_caching_status())
        state["embedding"].zero_()  # training goes on: the save was staged already
        queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
    # The structure changes: the cache must not be used.
    changed = model_state(rank, 4, extra_layer=True)
    collectives.append(schedule_megatron_style(queue, changed, os.path.join(root, "s4"),
                                               DefaultSavePlanner(), enable_cache=True))
    statuses.append(get_metadata_caching_status())
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    queue.close()
    for step in range(4):
        expected = model_state(rank, step)
        assert same(load_into_zeros(os.path.join(root, f"s{step}"), expected), expected), step
    assert same(load_into_zeros(os.path.join(root, "s4"), changed), changed)
    return collectives, statuses


def test_second_and_later_cached_saves_run_no_planning_collective(daemon, tmp_path):
    outcomes = values(run_ranks(cached_saves, 2, daemon.socket, tmp_path,
                                args=(daemon.roots[0],)))
    for collectives, statuses in outcomes:
        first, cached, changed = collectives[0], collectives[1:4], collectives[4]
        assert first > 0, "the first save plans globally (gather, scatter)"
        assert cached == [0, 0, 0], f"cached saves ran planning collectives: {collectives}"
        assert changed > 0, "a changed structure must be planned again"
        assert [reused for reused, _ in statuses] == [False, True, True, True, False]


class DecentralizedPlanner(DefaultSavePlanner):
    """Each rank's part of the global plan is its local plan (no state is replicated
    across ranks here), so ranks can plan without asking each other."""

    can_run_decentralized_global_plan = True

    def create_decentralized_global_plan(self, local_plan):
        return local_plan


def own_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {f"rank{rank}.weight": torch.rand(64, 16, generator=g),
            f"rank{rank}.bias": torch.rand(16, generator=g)}


def resume_with_loaded_metadata(rank, world_size, root):
    queue = AsyncCallsQueue()
    first = schedule_megatron_style(queue, own_state(rank, 1), os.path.join(root, "d1"),
                                    DecentralizedPlanner(), enable_cache=True,
                                    metadata_cache=CheckpointMetadataCache())
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    # A restarted job: seed the cache with the metadata of the checkpoint it resumes from.
    with open(os.path.join(root, "d1", ".metadata"), "rb") as f:
        init_checkpoint_metadata_cache(pickle.load(f))
    resumed = schedule_megatron_style(queue, own_state(rank, 2), os.path.join(root, "d2"),
                                      DecentralizedPlanner(), enable_cache=True)
    status = get_metadata_caching_status()
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    for step in (1, 2):
        expected = own_state(rank, step)
        assert same(load_into_zeros(os.path.join(root, f"d{step}"), expected), expected)
    return first, resumed, status


def test_metadata_of_the_resumed_checkpoint_replaces_the_gather(daemon, tmp_path):
    outcomes = values(run_ranks(resume_with_loaded_metadata, 2, daemon.socket, tmp_path,
                                args=(daemon.roots[0],)))
    for first, resumed, status in outcomes:
        assert first == 1, "decentralized planning gathers the local plans once, for metadata"
        assert resumed == 0 and status == (False, True)
