"""FileSystemWriterAsync in the reference's flow, on real gloo ranks and the real daemon.

plan (``save_state_dict_async_plan``) -> ``get_save_function_and_args`` -> ``AsyncRequest``
on an ``AsyncCallsQueue`` -> ``save_state_dict_async_finalize`` in the finalize function;
the result is compared file by file with stock ``FileSystemWriter`` and loaded with stock
``dcp.load``.
"""

import filecmp
import os
import pickle
import zlib
from copy import deepcopy
from dataclasses import fields

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter

from ckpt_client.compat.checkpointing.async_ckpt.core import (AsyncCallsQueue, AsyncRequest,
                                                              abort_nvrx_checkpoint)
from ckpt_client.compat.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from ckpt_client.compat.checkpointing.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize, save_state_dict_async_plan)
from ckpt_client.compat.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from ckpt_client.compat.checkpointing.utils import diff
from multirank import run_ranks, values


# ---------------------------------------------------------------- helpers (ranks use them)

def training_state(rank: int, seed: int) -> dict:
    """Tensors replicated on every rank (DCP dedups them), one per rank, plain values."""
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed * 100 + rank)
    return {**{f"layer{i}.weight": torch.rand(96, 64, generator=shared) for i in range(3)},
            "optimizer.exp_avg": torch.rand(64, 64, generator=shared),
            f"rank{rank}.rng": torch.rand(16, generator=own),
            "step": seed, "schedule": {"lr": 0.1 * seed, "warmup": [1, 2]}}


def zeros_like_state(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else deepcopy(v)
            for k, v in state.items()}


def load(directory, template: dict) -> dict:
    loaded = deepcopy(template)
    torch_dcp.load(loaded, storage_reader=FileSystemReader(directory))
    return loaded


def assert_same(loaded: dict, expected: dict) -> None:
    only_left, only_right, mismatch = diff(loaded, expected)
    assert not (only_left or only_right or mismatch), (only_left, only_right, mismatch)


def schedule_save(directory, state, queue, *, planner=None, enable_cache=False,
                  **writer_options) -> FileSystemWriterAsync:
    """The reference's flow, as Megatron writes it."""
    writer = FileSystemWriterAsync(directory, **writer_options)
    planned = save_state_dict_async_plan(state, writer, None, 0, planner=planner,
                                         enable_cache=enable_cache)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    request = AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*planned)],
                           preload_fn=preload_fn, async_fn_kwargs={})
    queue.schedule_async_request(request)
    return writer


def failing_open(path, mode="rb"):
    raise OSError("disk controller reset while opening")


def recording_open(path, mode="rb"):
    with open(os.path.join(os.path.dirname(path), "..", "opened.log"), "a") as log:
        log.write(os.path.basename(path) + "\n")
    return open(path, mode)


def barrier():
    import torch.distributed as dist

    dist.barrier()


# ---------------------------------------------------------------- same files as stock DCP

def save_next_to_stock(rank, world_size, root, is_daemon, is_multiproc_io, open_file=None):
    state = training_state(rank, 3)
    queue = AsyncCallsQueue(is_daemon=is_daemon)
    extra = {"open_file": open_file} if open_file else {}
    async_dir, stock_dir = os.path.join(root, "async"), os.path.join(root, "stock")
    schedule_save(async_dir, state, queue, is_multiproc_io=is_multiproc_io, **extra)
    state["layer0.weight"].add_(1)  # staged already: must not reach the async checkpoint
    torch_dcp.save(training_state(rank, 3), storage_writer=FileSystemWriter(stock_dir))
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=False) == [0]
    queue.close()
    expected = training_state(rank, 3)
    assert_same(load(async_dir, zeros_like_state(expected)), expected)
    assert_same(load(stock_dir, zeros_like_state(expected)), expected)
    barrier()
    return True


@pytest.mark.parametrize(("is_daemon", "is_multiproc_io"), [(True, False), (False, True),
                                                            (False, False)])
def test_writes_exactly_the_files_stock_dcp_writes(daemon, tmp_path, is_daemon, is_multiproc_io):
    root = daemon.roots[0]
    assert values(run_ranks(save_next_to_stock, 2, daemon.socket, tmp_path,
                            args=(root, is_daemon, is_multiproc_io))) == [True, True]
    async_dir, stock_dir = os.path.join(root, "async"), os.path.join(root, "stock")
    comparison = filecmp.dircmp(async_dir, stock_dir)
    assert comparison.left_only == [] and comparison.right_only == []
    assert sorted(comparison.common) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert filecmp.cmpfiles(async_dir, stock_dir, ["__0_0.distcp", "__1_0.distcp"],
                            shallow=False)[0] == ["__0_0.distcp", "__1_0.distcp"]
    with open(os.path.join(async_dir, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    for name, (crc, size) in metadata.ckptd_checksums.items():  # what ckptd computed
        with open(os.path.join(async_dir, name), "rb") as f:
            data = f.read()
        assert (zlib.crc32(data), len(data)) == (crc, size), name


def test_a_custom_open_file_is_used_by_the_trainer(daemon, tmp_path):
    root = daemon.roots[0]
    assert values(run_ranks(save_next_to_stock, 2, daemon.socket, tmp_path,
                            args=(root, False, False, recording_open), daemon=False)) == [True, True]
    with open(os.path.join(root, "opened.log")) as log:
        assert sorted(log.read().split()) == ["__0_0.distcp", "__1_0.distcp"]
    comparison = filecmp.dircmp(os.path.join(root, "async"), os.path.join(root, "stock"))
    assert comparison.left_only == [] and comparison.right_only == []
    assert comparison.diff_files in ([], [".metadata"])


# ---------------------------------------------------------------- failures

def save_and_expect_failure(rank, world_size, directory, is_daemon, is_multiproc_io,
                            fail_on_last_rank):
    state = training_state(rank, 4)
    queue = AsyncCallsQueue(is_daemon=is_daemon)
    opener = failing_open if fail_on_last_rank and rank == world_size - 1 else None
    schedule_save(directory, state, queue, is_multiproc_io=is_multiproc_io,
                  **({"open_file": opener} if opener else {}))
    try:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    except torch_dcp.CheckpointException as exc:
        outcome = (type(exc).__name__, exc.failing_ranks, str(exc))
    else:
        outcome = None
    queue.close()
    barrier()
    return outcome


def test_refuses_multiproc_io_in_a_daemonic_queue_as_the_reference(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "invalid")
    outcomes = values(run_ranks(save_and_expect_failure, 2, daemon.socket, tmp_path,
                                args=(directory, True, True, False)))
    for kind, failing_ranks, text in outcomes:
        assert kind == "CheckpointException" and failing_ranks == [0, 1]
    assert "Invalid Setup!" in outcomes[0][2]
    assert not os.path.exists(os.path.join(directory, ".metadata"))


@pytest.mark.parametrize(("is_daemon", "is_multiproc_io"), [(True, False), (False, True)])
def test_a_write_error_on_one_rank_raises_on_every_rank(daemon, tmp_path, is_daemon,
                                                         is_multiproc_io):
    directory = os.path.join(daemon.roots[0], "errors")
    outcomes = values(run_ranks(save_and_expect_failure, 2, daemon.socket, tmp_path,
                                args=(directory, is_daemon, is_multiproc_io, True), daemon=False))
    for kind, failing_ranks, text in outcomes:
        assert kind == "CheckpointException" and failing_ranks == [1]
        assert "disk controller reset while opening" in text and "rank 1" in text
    # As in the reference, the coordinator carries the worker's full error...
    assert "Worker failure" in outcomes[0][2]
    # ...and the other ranks the failing ranks and the cause.
    assert "Worker failure" not in outcomes[1][2]
    assert not os.path.exists(os.path.join(directory, ".metadata"))


# ---------------------------------------------------------------- metadata cache

def cached_and_uncached(rank, world_size, root):
    state = training_state(rank, 5)
    queue = AsyncCallsQueue()
    schedule_save(os.path.join(root, "uncached"), state, queue, planner=DefaultSavePlanner())
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    planner = DefaultSavePlanner()
    for i in range(3):  # the second and third reuse the cached plan and metadata
        schedule_save(os.path.join(root, f"cached{i}"), deepcopy(state), queue, planner=planner,
                      enable_cache=True)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    template = zeros_like_state(state)
    assert_same(load(os.path.join(root, "cached2"), template), state)
    assert_same(load(os.path.join(root, "uncached"), template), state)
    barrier()
    return True


def test_cached_metadata_writes_the_same_metadata(daemon, tmp_path):
    root = daemon.roots[0]
    assert values(run_ranks(cached_and_uncached, 2, daemon.socket, tmp_path, args=(root,)))
    metadata = []
    for name in ("uncached", "cached2"):
        with open(os.path.join(root, name, ".metadata"), "rb") as f:
            metadata.append(pickle.load(f))
    for field in fields(metadata[0]):
        if field.name not in ("storage_data", "storage_meta"):
            assert diff(getattr(metadata[0], field.name), getattr(metadata[1], field.name)) \
                == ([], [], []), field.name


# ---------------------------------------------------------------- abort and resume

def abort_then_resume(rank, world_size, root):
    dist_queue = AsyncCallsQueue(persistent=True)
    torch_checkpoint = TorchAsyncCheckpoint(persistent_queue=True)
    state = training_state(rank, 6)
    dist_dir, single_dir = os.path.join(root, "dist"), os.path.join(root, "single")
    schedule_save(dist_dir, state, dist_queue)
    if rank == 0:
        torch_checkpoint.async_save(state, os.path.join(single_dir, "model.pt"))
    abort_nvrx_checkpoint()  # an in-process restart, before anything was finalized
    assert dist_queue.get_num_unfinalized_calls() == 0
    barrier()
    aborted_left_no_metadata = not os.path.exists(os.path.join(dist_dir, ".metadata"))
    # The queues are usable again: save once more, into the same places.
    schedule_save(dist_dir, state, dist_queue)
    if rank == 0:
        torch_checkpoint.async_save(state, os.path.join(single_dir, "model.pt"))
    dist_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    torch_checkpoint.finalize_async_save(blocking=True, no_dist=True)
    assert_same(load(dist_dir, zeros_like_state(state)), state)
    if rank == 0:
        assert_same(torch.load(os.path.join(single_dir, "model.pt")), state)
    dist_queue.close()
    torch_checkpoint.close()
    dist_queue.__del__()  # what the interpreter does at exit: nothing left to do
    barrier()
    return aborted_left_no_metadata


def test_abort_then_resume_with_two_queues(daemon, tmp_path):
    assert values(run_ranks(abort_then_resume, 2, daemon.socket, tmp_path,
                            args=(daemon.roots[0],))) == [True, True]


# ---------------------------------------------------------------- writer options

def save_with_options(rank, world_size, directory, options):
    state = training_state(rank, 7)
    queue = AsyncCallsQueue()
    schedule_save(directory, state, queue, **options)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    assert_same(load(directory, zeros_like_state(state)), state)
    barrier()
    return sorted(n for n in os.listdir(directory) if n.endswith(".distcp") and f"__{rank}_" in n)


def test_thread_count_and_separation_hint_name_the_files(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "hinted")
    files = values(run_ranks(save_with_options, 2, daemon.socket, tmp_path,
                             args=(directory, {"thread_count": 4, "separation_hint": "optimizer",
                                               "use_cached_data_structure": True,
                                               "use_cpu_shm_for_gpu_tensors": True})))
    for rank, names in enumerate(files):
        plain = [n for n in names if n.startswith("__")]
        hinted = [n for n in names if n.startswith("optimizer__")]
        assert plain and set(names) == set(plain + hinted)
        assert all(n.startswith(f"__{rank}_") or n.startswith(f"optimizer__{rank}_") for n in names)
    assert any(n.startswith("optimizer__") for names in files for n in names)


def test_use_msc_with_a_filesystem_path_writes_through_the_daemon(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "msc")
    files = values(run_ranks(save_with_options, 2, daemon.socket, tmp_path,
                             args=(directory, {"use_msc": True})))
    assert files == [["__0_0.distcp"], ["__1_0.distcp"]]


def test_msc_urls_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="Multi-Storage Client URL"):
        FileSystemWriterAsync("msc://bucket/ckpt", use_msc=True)


def stock_save_with_async_writer(rank, world_size, directory):
    state = training_state(rank, 8)
    torch_dcp.save(state, storage_writer=FileSystemWriterAsync(directory))
    assert_same(load(directory, zeros_like_state(state)), state)
    barrier()
    return True


def test_stock_dcp_save_works_with_the_async_writer(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "stock-save")
    assert values(run_ranks(stock_save_with_async_writer, 2, daemon.socket, tmp_path,
                            args=(directory,))) == [True, True]


def only_replicated(rank, world_size, directory):
    """One replicated tensor: DCP gives it to one rank; the other has nothing to write."""
    state = {"shared": torch.arange(12.0)}
    queue = AsyncCallsQueue()
    writer = schedule_save(directory, state, queue)
    nothing = writer.get_save_function_and_args() == (None, None, [])
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    assert_same(load(directory, {"shared": torch.zeros(12)}), state)
    barrier()
    return nothing


def test_a_rank_with_nothing_to_write_still_finalizes(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "replicated")
    assert sorted(values(run_ranks(only_replicated, 2, daemon.socket, tmp_path,
                                   args=(directory,)))) == [False, True]
