"""TorchAsyncCheckpoint as the reference's users drive it: async next to sync, abort, resume."""

import io
import os

import pytest
import torch

from ckpt_client import CheckpointException, TorchAsyncCheckpoint, abort_nvrx_checkpoint
from ckpt_client.compat.checkpointing.async_ckpt.torch_ckpt import \
    TorchAsyncCheckpoint as CompatTorchAsyncCheckpoint


def model_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.rand(256, 128, generator=g) for i in range(4)}


def assert_loads_as(path, expected: dict) -> None:
    loaded = torch.load(path, map_location="cpu")
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key


@pytest.fixture
def in_root(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    return lambda *parts: os.path.join(daemon.roots[0], *parts)


def test_async_save_and_save_write_the_same_checkpoint(in_root):
    assert CompatTorchAsyncCheckpoint is TorchAsyncCheckpoint
    state = model_state(1)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(state, in_root("async", "model.pt"))
    checkpoint.save(state, in_root("sync", "model.pt"))  # durable when it returns
    assert_loads_as(in_root("sync", "model.pt"), state)
    checkpoint.finalize_async_save(blocking=True)
    assert_loads_as(in_root("async", "model.pt"), state)
    assert_loads_as(in_root("async", "model.pt"), torch.load(in_root("sync", "model.pt")))
    checkpoint.close()


def test_save_to_a_file_object_is_torch_save(in_root):
    buffer = io.BytesIO()
    state = {**model_state(2), "note": object.__name__}
    TorchAsyncCheckpoint().save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer)["note"] == "object"


def test_save_to_a_path_outside_the_roots_is_refused_loudly(daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    from ckpt_client import DaemonRequestError

    with pytest.raises(DaemonRequestError, match="outside the allowed roots"):
        TorchAsyncCheckpoint().save(model_state(3), str(tmp_path / "elsewhere.pt"))


def test_abort_during_an_unfinalized_save_then_resume(in_root):
    checkpoint = TorchAsyncCheckpoint(persistent_queue=True)
    first, second = model_state(4), model_state(5)
    checkpoint.save(first, in_root("reference.pt"))
    checkpoint.async_save(first, in_root("resumed.pt"))
    abort_nvrx_checkpoint()  # as an in-process restart would, before finalizing
    checkpoint.finalize_async_save(blocking=True)  # nothing left to finalize
    checkpoint.async_save(second, in_root("resumed.pt"))
    checkpoint.finalize_async_save(blocking=True)
    assert_loads_as(in_root("resumed.pt"), second)
    assert_loads_as(in_root("reference.pt"), first)
    checkpoint.close()


def test_failures_raise_torchs_checkpoint_exception(in_root):
    blocker = in_root("not-a-directory")
    with open(blocker, "w") as f:
        f.write("a file where the save expects a directory")
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(model_state(6), os.path.join(blocker, "model.pt"))
    with pytest.raises(torch.distributed.checkpoint.CheckpointException) as info:
        checkpoint.finalize_async_save(blocking=True)
    assert isinstance(info.value, CheckpointException)
    assert info.value.failing_ranks == [0] and "not-a-directory" in str(info.value)
