"""CUDA paths: IPC staging by the daemon, the pinned pool, snapshot semantics on the GPU.

Skipped on machines without CUDA (CI has none); run them on an accelerator machine.
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from ckpt_client import AsyncCallsQueue, async_torch_save, connect, dcp  # noqa: E402


def cuda_state(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"w": torch.randn(1024, 1024, device="cuda", generator=g),
            "b": torch.randn(1024, device="cuda", generator=g).half(),
            "step": seed}


def test_daemon_stages_cuda_tensors_from_ipc_handles_into_a_pinned_pool(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    assert connect().has_cuda, "the daemon should have found the GPU"
    assert daemon.status()["pool"]["pinned"]
    path = os.path.join(daemon.roots[0], "cuda.pt")
    state = cuda_state(1)
    expected = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    queue = AsyncCallsQueue()
    queue.schedule_async_request(async_torch_save(state, path))
    state["w"].mul_(0)  # after STAGED: the checkpoint must keep the old values
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])


def test_repeated_saves_and_reallocated_tensors_stay_correct(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    queue = AsyncCallsQueue()
    for i in range(3):
        state = cuda_state(10 + i)  # new allocations each time: cached mappings must not be reused wrongly
        path = os.path.join(daemon.roots[0], f"r{i}.pt")
        queue.schedule_async_request(async_torch_save(state, path))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"].cpu())


def test_dcp_async_save_of_cuda_tensors(daemon, monkeypatch):
    import torch.distributed.checkpoint as DCP
    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    state = cuda_state(5)
    directory = os.path.join(daemon.roots[0], "dcp")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(state, directory))
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = {"w": torch.zeros(1024, 1024), "b": torch.zeros(1024).half(), "step": 0}
    DCP.load(loaded, storage_reader=FileSystemReader(directory))
    assert torch.equal(loaded["w"], state["w"].cpu()) and loaded["step"] == 5
