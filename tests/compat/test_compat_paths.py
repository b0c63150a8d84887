"""The reference's module paths under ckpt_client.compat, and its state-dict helpers."""

import gc
import importlib

import pytest
import torch

import ckpt_client
from ckpt_client.compat.checkpointing.utils import diff, preload_tensors, wrap_for_async

#: Reference module (after ``nvidia_resiliency_ext.``) -> names users import from it.
REFERENCE_PATHS = {
    "checkpointing.async_ckpt": ["TorchAsyncCheckpoint", "AsyncCallsQueue", "AsyncRequest"],
    "checkpointing.async_ckpt.core": ["AsyncCallsQueue", "AsyncRequest", "abort_nvrx_checkpoint"],
    "checkpointing.async_ckpt.torch_ckpt": ["TorchAsyncCheckpoint"],
    "checkpointing.async_ckpt.filesystem_async": ["FileSystemWriterAsync"],
    "checkpointing.async_ckpt.state_dict_saver": [
        "save_state_dict_async_plan", "save_state_dict_async_finalize",
        "CheckpointMetadataCache", "init_checkpoint_metadata_cache"],
    "checkpointing.utils": ["diff", "preload_tensors", "wrap_for_async"],
    "checkpointing.local.base_state_dict": ["TensorAwareStateDict"],
    "checkpointing.local.basic_state_dict": ["BasicTensorAwareStateDict"],
    "checkpointing.local.ckpt_managers.local_manager": ["LocalCheckpointManager"],
    "checkpointing.local.replication.strategies": ["CliqueReplicationStrategy"],
}


@pytest.mark.parametrize("module", sorted(REFERENCE_PATHS))
def test_reference_paths_serve_ckpt_clients_own_objects(module):
    compat = importlib.import_module(f"ckpt_client.compat.{module}")
    for name in REFERENCE_PATHS[module]:
        own = getattr(ckpt_client, name, None) or getattr(ckpt_client.state_dicts, name)
        assert getattr(compat, name) is own, f"{module}.{name}"


def test_every_reference_name_is_importable_from_ckpt_client():
    names = {n for names in REFERENCE_PATHS.values() for n in names} - {"diff"}
    assert names <= set(ckpt_client.__all__)
    assert ckpt_client.state_dicts.diff is diff


def test_diff_reports_missing_extra_and_different_entries():
    left = {"a": torch.ones(3), "b": [1, 2, 3], "c": {"x": "same", "y": 1.0}, "only_left": 0}
    right = {"a": torch.tensor([1.0, 1.0, 2.0]), "b": [1, 2], "c": {"x": "same", "y": 2.0},
             "only_right": None}
    only_left, only_right, mismatch = diff(left, right)
    assert only_left == [("only_left",), ("b", 2)]
    assert only_right == [("only_right",)]
    assert sorted(m[0] for m in mismatch) == [("a",), ("c", "y")]
    assert diff(left, left) == ([], [], [])
    assert diff({"t": torch.ones(2)}, {"t": torch.ones(3)})[2] == [(("t",), torch.Tensor,
                                                                     torch.Tensor)]


def test_preload_tensors_copies_the_structure_with_host_tensors():
    state = {"w": torch.ones(2, requires_grad=True), "list": [torch.zeros(1), "k"], "n": 3}
    preloaded = preload_tensors(state, non_blocking=False)
    assert preloaded is not state and preloaded["list"] is not state["list"]
    assert not preloaded["w"].requires_grad and preloaded["w"].device.type == "cpu"
    assert preloaded["list"][1] == "k" and preloaded["n"] == 3


def test_wrap_for_async_runs_without_the_garbage_collector():
    seen = []
    wrapped = wrap_for_async(lambda state, out: out.append((gc.isenabled(), state)))
    enabled_before = gc.isenabled()
    wrapped({"s": 1}, seen)
    assert seen == [(False, {"s": 1})] and gc.isenabled() == enabled_before
