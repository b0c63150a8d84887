"""Local checkpoints with a user's own TensorAwareStateDict, as the reference's users write them.

Two real gloo ranks on one node (one daemon with ``--local-dir``): save (blocking, or
async and run with ``execute_sync``), find the latest, load after a "restart" (a new
manager), lose a part, save again; plus the interface of ``BasicTensorAwareStateDict``.
"""

import os

import pytest
import torch

from ckpt_client import BasicTensorAwareStateDict, TensorAwareStateDict
from ckpt_client.compat.checkpointing.local.base_state_dict import \
    TensorAwareStateDict as CompatTensorAwareStateDict
from ckpt_client.compat.checkpointing.local.ckpt_managers.local_manager import \
    LocalCheckpointManager
from multirank import run_ranks, values


class IterationState(TensorAwareStateDict):
    """A training state of the user's own making: some tensors and an iteration number.

    Only what local checkpointing needs from it is implemented, as in user code that
    relies on the manager pickling the object.
    """

    def __init__(self, iteration: int, rank: int, count: int = 20) -> None:
        g = torch.Generator().manual_seed(iteration * 10 + rank)
        self.tensors_list = [torch.rand(32, 32, generator=g) for _ in range(count)]
        self.iteration = iteration
        self.restored = 0

    def pop_tensors(self):
        raise NotImplementedError

    @property
    def tensors(self):
        raise NotImplementedError

    @property
    def is_hollow(self):
        raise NotImplementedError

    def insert_tensors(self, tensor_data):
        raise NotImplementedError

    def init_tensors(self):
        raise NotImplementedError

    def copy_tensors_to_cpu(self, non_blocking=False):
        self.tensors_list = [t.to("cpu") for t in self.tensors_list]

    def restore_tensor_device(self, non_blocking=True):
        self.restored += 1

    def __eq__(self, other):
        return (self.iteration == other.iteration
                and len(self.tensors_list) == len(other.tensors_list)
                and all(torch.equal(a, b) for a, b in zip(self.tensors_list, other.tensors_list)))


def part_path(manager, iteration: int, rank: int) -> str:
    return os.path.join(manager.local_ckpt_dir, f"iter_{iteration:07d}", f"rank_{rank}.part")


def save(manager, state, iteration, is_async):
    request = manager.save(state, iteration, is_async)
    if is_async:
        request.execute_sync()
    else:
        assert request is None


def save_restart_lose_resave(rank, world_size, root, is_async):
    import torch.distributed as dist

    root = os.path.join(root, "missing", "subdir")  # directories that do not exist yet
    manager = LocalCheckpointManager(root)
    state = IterationState(1, rank)
    save(manager, state, 1, is_async)
    assert manager.find_latest() == 1
    loaded, ckpt_id = manager.load()
    assert loaded == state and loaded.restored == 1 and ckpt_id == (1, rank, "")
    assert os.path.exists(part_path(manager, 1, rank))

    restarted = LocalCheckpointManager(root)  # a new process would do the same
    assert restarted.find_latest() == 1
    assert restarted.load()[0] == state

    dist.barrier()
    if rank == 0:  # rank 0 loses its part; without replication nobody else has it
        os.remove(part_path(restarted, 1, 0))
    dist.barrier()
    after_loss = LocalCheckpointManager(root)
    assert after_loss.find_latest() == -1

    save(after_loss, IterationState(1, rank), 1, is_async)
    first = part_path(after_loss, 1, rank)
    assert os.path.exists(first)
    save(after_loss, IterationState(2, rank), 2, is_async)
    assert not os.path.exists(first), "an older iteration is dropped once a newer one is saved"
    assert os.path.exists(part_path(after_loss, 2, rank))
    assert after_loss.find_latest() == 2 and after_loss.load()[0] == IterationState(2, rank)
    return True


@pytest.fixture
def local_daemon(start_daemon, tmp_path):
    local_dir = tmp_path / "local"
    local_dir.mkdir()
    return start_daemon(extra_args=["--local-dir", str(local_dir)]), str(local_dir)


@pytest.mark.parametrize("is_async", [True, False])
def test_a_users_tensor_aware_state_dict_saves_and_loads(local_daemon, tmp_path, is_async):
    daemon, local_dir = local_daemon
    assert CompatTensorAwareStateDict is TensorAwareStateDict
    assert values(run_ranks(save_restart_lose_resave, 2, daemon.socket, tmp_path,
                            args=(local_dir, is_async))) == [True, True]


def basic_state_under_session(rank, world_size, root):
    manager = LocalCheckpointManager(root, session_id="run7")
    state = {"w": torch.full((4,), float(rank)), "nested": [torch.arange(3), ("x", 2)]}
    manager.save(BasicTensorAwareStateDict(state), 5)
    assert manager.find_latest() == 5
    loaded, _ = manager.load()
    assert isinstance(loaded, BasicTensorAwareStateDict)
    assert torch.equal(loaded.state_dict["w"], state["w"])
    return str(manager.local_ckpt_dir), sorted(os.listdir(manager.local_ckpt_dir))


def test_local_ckpt_dir_is_where_the_session_parts_are(local_daemon, tmp_path):
    daemon, local_dir = local_daemon
    outcomes = values(run_ranks(basic_state_under_session, 2, daemon.socket, tmp_path,
                                args=(local_dir,)))
    for directory, listing in outcomes:
        assert directory == os.path.join(local_dir, "run7") and "iter_0000005" in listing
    parts = set(os.listdir(os.path.join(local_dir, "run7", "iter_0000005")))
    assert {"rank_0.part", "rank_1.part"} <= parts


def test_basic_tensor_aware_state_dict_implements_the_interface():
    state = {"a": torch.ones(2, 3), "list": [torch.zeros(4), 7], "pair": (torch.arange(2), "s")}
    ta = BasicTensorAwareStateDict(state)
    assert isinstance(ta, TensorAwareStateDict) and not ta.is_hollow
    originals = list(ta.tensors)
    assert len(originals) == 3

    popped = ta.pop_tensors()
    assert ta.is_hollow and [t.shape for t in popped] == [t.shape for t in originals]
    with pytest.raises(RuntimeError, match="hollow"):
        list(ta.tensors)
    ta.insert_tensors(popped)
    assert not ta.is_hollow and all(a is b for a, b in zip(ta.tensors, originals))

    ta.pop_tensors()
    ta.init_tensors()
    assert [(t.shape, t.dtype) for t in ta.tensors] == [(t.shape, t.dtype) for t in originals]

    fresh = BasicTensorAwareStateDict({"x": torch.ones(3)})
    fresh.copy_tensors_to_cpu()
    fresh.restore_tensor_device()
    assert fresh.state_dict["x"].device.type == "cpu" and torch.equal(fresh.state_dict["x"],
                                                                       torch.ones(3))
