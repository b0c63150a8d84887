"""DCP through the daemon: stock dcp.load reads what async_save and StorageWriter wrote."""

import os
import pickle
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckpt_client import AsyncCallsQueue, dcp
from ckptd.checksum import verify_file
from ckptd.protocol import Phase
from conftest import wait_for
from multirank import run_ranks, values
from states import assert_same

ROWS, COLS = 64, 48


def full_model(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"embed": torch.randn(ROWS, COLS, generator=g), "bias": torch.randn(COLS, generator=g),
            "counts": torch.arange(ROWS, dtype=torch.int64) * step}


def sharded_state(rank: int, world_size: int, step: int) -> dict:
    """Each rank holds a row block of 'embed' (as a ShardedTensor-free chunk via DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = full_model(step)
    return {"embed": distribute_tensor(model["embed"], mesh, [Shard(0)]),
            "bias": model["bias"], "counts": distribute_tensor(model["counts"], mesh, [Shard(0)]),
            "step": step, "extra": {"note": "hello", "lr": 0.1}}


def empty_sharded_state(world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return {"embed": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
            "bias": torch.zeros(COLS),
            "counts": distribute_tensor(torch.zeros(ROWS, dtype=torch.int64), mesh, [Shard(0)]),
            "step": 0, "extra": {"note": "", "lr": 0.0}}


def check_loaded(state, step) -> None:
    expected = full_model(step)
    assert torch.equal(state["embed"].full_tensor(), expected["embed"])
    assert torch.equal(state["counts"].full_tensor(), expected["counts"])
    assert torch.equal(state["bias"], expected["bias"])
    assert state["step"] == step and state["extra"] == {"note": "hello", "lr": 0.1}


def save_async_then_load(rank, world_size, directory, step):
    state = sharded_state(rank, world_size, step)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(state, directory))
    state["bias"].add_(1)  # after staging: must not reach the checkpoint
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    load_and_check(rank, world_size, directory, step)
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_async_save_loads_with_stock_dcp(daemon, tmp_path, world_size):
    directory = os.path.join(daemon.roots[0], f"ws{world_size}")
    listings = values(run_ranks(save_async_then_load, world_size, daemon.socket, tmp_path,
                                args=(directory, 7)))
    files = listings[0]
    assert ".metadata" in files and ".metadata.ckptd-sum" in files
    for name in files:
        if not name.endswith(".ckptd-sum"):
            verify_file(os.path.join(directory, name))
    assert {n.split("_")[2] for n in files if n.endswith(".distcp")} == {str(r) for r in range(world_size)}


def load_and_check(rank, world_size, directory, step):
    """Load with stock DCP into this world size's sharding and compare with the truth."""
    loaded = empty_sharded_state(world_size)
    DCP.load(loaded, storage_reader=FileSystemReader(directory))
    check_loaded(loaded, step)
    return True


def test_saved_by_four_ranks_loads_into_two(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "reshard")
    values(run_ranks(save_async_then_load, 4, daemon.socket, tmp_path, args=(directory, 3), name="w4"))
    assert values(run_ranks(load_and_check, 2, daemon.socket, tmp_path, args=(directory, 3), name="w2")) == [True, True]


def stock_save(rank, world_size, directory, step):
    state = sharded_state(rank, world_size, step)
    DCP.save(state, storage_writer=dcp.StorageWriter(directory))
    return load_and_check(rank, world_size, directory, step)


def test_storage_writer_works_with_stock_dcp_save(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "stock")
    assert values(run_ranks(stock_save, 2, daemon.socket, tmp_path, args=(directory, 5))) == [True, True]


class CountingPlanner(DefaultSavePlanner):
    global_plans = 0

    def create_global_plan(self, all_plans):
        CountingPlanner.global_plans += 1
        return super().create_global_plan(all_plans)


def cached_saves(rank, world_size, root):
    queue = AsyncCallsQueue()
    for step in (1, 2, 3):
        state = sharded_state(rank, world_size, step)
        queue.schedule_async_request(dcp.async_save(state, os.path.join(root, f"c{step}"),
                                                    planner=CountingPlanner(), enable_cache=True))
        queue.maybe_finalize_async_calls(blocking=True)
    # Same structure every time: only the first save planned globally (on the coordinator).
    planned = CountingPlanner.global_plans
    state = sharded_state(rank, world_size, 4)
    state["new_key"] = torch.ones(3)  # structure changed: must plan again
    queue.schedule_async_request(dcp.async_save(state, os.path.join(root, "c4"),
                                                planner=CountingPlanner(), enable_cache=True))
    queue.maybe_finalize_async_calls(blocking=True)
    for step in (1, 2, 3):
        load_and_check(rank, world_size, os.path.join(root, f"c{step}"), step)
    return planned, CountingPlanner.global_plans


def test_enable_cache_reuses_the_plan_while_the_structure_is_unchanged(daemon, tmp_path):
    counts = values(run_ranks(cached_saves, 2, daemon.socket, tmp_path, args=(daemon.roots[0],)))
    assert counts[0] == (1, 2), "coordinator: one global plan for three saves, a new one on change"
    assert counts[1] == (0, 0), "non-coordinators never plan globally"


def overwrite_in_place(rank, world_size, directory):
    queue = AsyncCallsQueue()
    for step in (1, 2):
        queue.schedule_async_request(dcp.async_save(sharded_state(rank, world_size, step), directory))
        queue.maybe_finalize_async_calls(blocking=True)
    return load_and_check(rank, world_size, directory, 2)


def test_saving_again_into_the_same_directory_never_overwrites_referenced_files(daemon, tmp_path):
    directory = os.path.join(daemon.roots[0], "same")
    assert values(run_ranks(overwrite_in_place, 2, daemon.socket, tmp_path, args=(directory,))) == [True, True]


def replicated_saves(rank, world_size, root):
    """Three saves of a state whose 'bias' and plain values every rank holds alike."""
    queue = AsyncCallsQueue()
    for step in (1, 2, 3):
        queue.schedule_async_request(dcp.async_save(sharded_state(rank, world_size, step),
                                                    os.path.join(root, f"r{step}")))
        queue.maybe_finalize_async_calls(blocking=True)
    return all(load_and_check(rank, world_size, os.path.join(root, f"r{s}"), s) for s in (1, 2, 3))


def test_early_staging_is_dropped_when_the_global_plan_moves_items_and_then_not_tried(
        daemon, tmp_path):
    # Staging starts from the local plan, before the global plan. Deduplication gives the
    # replicated items to one rank, so the other rank's early staging must be dropped
    # (its copy of 'bias' written by nobody, not twice), and that rank must stage after
    # planning from then on, not drop every save. The dropped save is 'aborted' before a
    # byte of it is written (tests/integration/test_first_save.py holds it to that).
    assert values(run_ranks(replicated_saves, 2, daemon.socket, tmp_path,
                            args=(daemon.roots[0],))) == [True, True]
    wait_for(lambda: all(r["phase"] in Phase.FINISHED for r in daemon.status()["requests"]),
             10, "every request to settle")
    mine = {os.path.join(daemon.roots[0], f"r{step}") for step in (1, 2, 3)}
    saves_per_rank_and_path = Counter((r["rank"], r["path"]) for r in daemon.status()["requests"]
                                      if r["path"] in mine)
    assert sorted(saves_per_rank_and_path.values()) == [1, 1, 1, 1, 1, 2], (
        "exactly one rank's first early staging is dropped, then no more")
    # The daemon's log names the real cause of the drop, not a close() nobody called.
    log = daemon.log()
    assert "close(abort=True)" not in log, log
    if any(r["phase"] == "aborted" for r in daemon.status()["requests"]):
        assert "dropped by the trainer: early staging dropped: the global plan differs" in log
    for step in (1, 2, 3):
        directory = os.path.join(daemon.roots[0], f"r{step}")
        metadata = FileSystemReader(directory).read_metadata()
        ranges: dict = {}
        for info in metadata.storage_data.values():
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        files = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))
        assert files == sorted(ranges)
        for name in files:  # every byte written is one the metadata points to, or the
            data = open(os.path.join(directory, name), "rb").read()  # zeros that put the
            cursor = 0                                               # next item on a page
            for offset, length in sorted(ranges[name]):
                assert offset - cursor < 4096 and not any(data[cursor:offset]), (name, offset)
                cursor = offset + length
            assert cursor == len(data), name


def early_staging_single_rank(rank, world_size, root):
    queue = AsyncCallsQueue()
    for step in (1, 2):
        queue.schedule_async_request(dcp.async_save(full_model(step), os.path.join(root, f"s{step}")))
        queue.maybe_finalize_async_calls(blocking=True)
    return True


def test_early_staging_of_a_single_rank_is_adopted(daemon, tmp_path):
    values(run_ranks(early_staging_single_rank, 1, daemon.socket, tmp_path, args=(daemon.roots[0],)))
    phases = [r["phase"] for r in daemon.status()["requests"]]
    assert phases.count("done") == 2 and "aborted" not in phases
    for step in (1, 2):
        loaded = {k: torch.zeros_like(v) for k, v in full_model(step).items()}
        DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(daemon.roots[0], f"s{step}")))
        assert all(torch.equal(loaded[k], v) for k, v in full_model(step).items())


@pytest.mark.parametrize("zero_stall", [False, True], ids=["default", "zero-stall"])
def test_a_state_larger_than_the_pool_is_streamed_in_chunks(start_daemon, monkeypatch,
                                                            zero_stall):
    daemon = start_daemon(pool_size="12M")
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(6)}  # 6 x 4 MiB
    path = os.path.join(daemon.roots[0], "big")
    queue = AsyncCallsQueue()
    request = dcp.async_save(state, path, zero_stall=zero_stall)
    assert len(request.daemon_saves) >= 2, "24 MiB cannot go in one 12 MiB request"
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    DCP.load(loaded, storage_reader=FileSystemReader(path))
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert daemon.status()["pool"]["used_bytes"] == 0


def test_one_tensor_larger_than_the_pool_is_refused_with_the_fix(start_daemon, monkeypatch):
    from ckpt_client.errors import DaemonRequestError

    daemon = start_daemon(pool_size="4M")
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    with pytest.raises(DaemonRequestError, match="--pool-size"):
        dcp.async_save({"huge": torch.ones(2 << 20)}, os.path.join(daemon.roots[0], "x"))


def training_like_state(rank: int, step: int, rows: int = 8) -> dict:
    """A nested model + optimizer state: int keys, a Parameter, bf16, changing scalars.
    Replicated like data parallelism (DCP writes each shared key once) but for one key."""
    g = torch.Generator().manual_seed(step)
    weight = torch.nn.Parameter(torch.randn(rows, 4, generator=g))
    return {"model": {"weight": weight, "norm": torch.randn(4, generator=g).to(torch.bfloat16),
                      f"only_rank{rank}": torch.full((3,), float(rank + step))},
            "optim": {"state": {0: {"exp_avg": torch.randn(rows, 4, generator=g),
                                    "step": torch.tensor(float(step))}},
                      "param_groups": [{"lr": 0.1 * step, "params": [0], "name": f"g{step}"}]},
            "step": step, "shape": (rows, 4)}


def reused_plan_saves(rank, world_size, root, zero_stall):
    from ckpt_client.dcp import planning

    planned = []
    plan_locally = planning.local_plan_of

    def counting(*args, **kwargs):
        planned.append(1)
        return plan_locally(*args, **kwargs)

    planning.local_plan_of = counting
    queue = AsyncCallsQueue()
    steps = {1: 8, 2: 8, 3: 8, 4: 12}  # step 4 changes a shape: planned again
    for step, rows in steps.items():
        state = training_like_state(rank, step, rows)
        request = dcp.async_save(state, os.path.join(root, f"p{step}"), enable_cache=True,
                                 zero_stall=zero_stall)
        queue.schedule_async_request(request)
        queue.wait_for_staging()
        queue.maybe_finalize_async_calls(blocking=True)
    for step, rows in steps.items():
        expected = training_like_state(rank, step, rows)
        loaded = training_like_state(rank, 99, rows)
        DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, f"p{step}")))
        assert_same(loaded, expected)
    return len(planned)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("zero_stall", [False, True], ids=["default", "zero-stall"])
def test_enable_cache_reuses_the_local_plan_and_saves_the_current_values(daemon, tmp_path,
                                                                         world_size, zero_stall):
    # Same structure for steps 1-3: planned once, every value (tensors, int-keyed optimizer
    # state, changing scalars and strings, rank-only and deduplicated items) from its step.
    plans = values(run_ranks(reused_plan_saves, world_size, daemon.socket, tmp_path,
                             args=(daemon.roots[0], zero_stall)))
    assert plans == [2] * world_size, "one local plan for steps 1-3, one after the shape changed"


def test_the_plan_signature_sees_every_change_that_changes_the_plan():
    from ckpt_client.dcp.plan_reuse import planner_allows_reuse, structure_of

    base = training_like_state(0, 1)
    assert structure_of(base) == structure_of(training_like_state(0, 2)), "values only"
    changed = [training_like_state(0, 1, rows=9), training_like_state(1, 1)]
    retyped = training_like_state(0, 1)
    retyped["model"]["norm"] = retyped["model"]["norm"].float()
    frozen = training_like_state(0, 1)
    frozen["model"]["weight"].requires_grad_(False)
    listed = training_like_state(0, 1)
    listed["shape"] = [8, 4]
    for other in changed + [retyped, frozen, listed]:
        assert structure_of(other) != structure_of(base)

    class Subclass(torch.Tensor):
        pass

    assert structure_of({"x": torch.ones(2).as_subclass(Subclass)}) is None

    class CustomResolve(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return super().transform_object(write_item, object)

    class CountingGlobal(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            return super().create_global_plan(all_plans)

    assert planner_allows_reuse(DefaultSavePlanner()) and planner_allows_reuse(CountingGlobal())
    assert not planner_allows_reuse(CustomResolve())
    assert not planner_allows_reuse(DefaultSavePlanner(flatten_state_dict=False))


def _described(directory: str) -> tuple:
    """What a ``.metadata`` says apart from file names and offsets: the metadata of every
    key (as pickled), the planner's mappings, and which rank wrote which item (with its
    index hint)."""
    md = FileSystemReader(directory).read_metadata()
    writers = {(k.fqn, tuple(k.offset or ()), k.index): info.relative_path.split("_")[2]
               for k, info in md.storage_data.items()}
    return (pickle.dumps(md.state_dict_metadata), md.state_dict_metadata, md.planner_data,
            writers)


def uncached_and_stock_saves(rank, world_size, root):
    queue = AsyncCallsQueue()
    steps = {1: 8, 2: 8, 3: 12}  # step 2 repeats step 1's structure, step 3 changes it
    for step, rows in steps.items():
        state = training_like_state(rank, step, rows)
        DCP.save(state, storage_writer=DCP.FileSystemWriter(os.path.join(root, f"stock{step}")))
        queue.schedule_async_request(dcp.async_save(state, os.path.join(root, f"ours{step}")))
        queue.maybe_finalize_async_calls(blocking=True)
    for step, rows in steps.items():
        loaded = training_like_state(rank, 99, rows)
        DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, f"ours{step}")))
        assert_same(loaded, training_like_state(rank, step, rows))
    return [_described(os.path.join(root, f"ours{s}"))
            == _described(os.path.join(root, f"stock{s}")) for s in steps]


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_default_save_writes_the_metadata_stock_dcp_save_writes(daemon, tmp_path, world_size):
    # The default planner takes a short route (and reuses what the previous save made for
    # an unchanged key): the metadata, each key's writer after deduplication and the index
    # hints must stay stock DCP's, save after save and when the structure changes.
    same = values(run_ranks(uncached_and_stock_saves, world_size, daemon.socket, tmp_path,
                            args=(daemon.roots[0],)))
    assert same == [[True, True, True]] * world_size


class AppState:
    """The usual ``Stateful`` wrapper: DCP saves its state dict, not the object."""

    def __init__(self, step: int) -> None:
        self.weight = full_model(step)["embed"]
        self.step = step

    def state_dict(self) -> dict:
        return {"weight": self.weight, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.weight.copy_(state["weight"])
        self.step = state["step"]


def stateful_saves(rank, world_size, root, enable_cache, zero_stall):
    queue = AsyncCallsQueue()
    for step in (1, 2):
        state = {"app": AppState(step), "bias": full_model(step)["bias"]}
        queue.schedule_async_request(dcp.async_save(
            state, os.path.join(root, f"app{step}"), enable_cache=enable_cache,
            zero_stall=zero_stall))
        queue.maybe_finalize_async_calls(blocking=True)
    return True


@pytest.mark.parametrize("enable_cache", [False, True], ids=["planned", "cached"])
@pytest.mark.parametrize("zero_stall", [False, True], ids=["default", "zero-stall"])
def test_a_stateful_value_is_saved_as_its_state_dict(daemon, tmp_path, enable_cache, zero_stall):
    values(run_ranks(stateful_saves, 1, daemon.socket, tmp_path,
                     args=(daemon.roots[0], enable_cache, zero_stall)))
    for step in (1, 2):
        directory = os.path.join(daemon.roots[0], f"app{step}")
        keys = set(FileSystemReader(directory).read_metadata().state_dict_metadata)
        assert keys == {"app.weight", "app.step", "bias"}
        loaded = {"app": AppState(99), "bias": torch.zeros(COLS)}
        DCP.load(loaded, storage_reader=FileSystemReader(directory))
        assert torch.equal(loaded["app"].weight, full_model(step)["embed"])
        assert loaded["app"].step == step
        assert torch.equal(loaded["bias"], full_model(step)["bias"])
