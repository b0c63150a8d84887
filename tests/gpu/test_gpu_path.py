"""The GPU path, made correct by construction (issue 10): each test can fail on a GPU.

Skipped without CUDA (CI has none); run with ``pytest -m gpu`` on an accelerator machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from conftest import wait_for  # noqa: E402

from ckpt_client import (AsyncCallsQueue, TorchAsyncCheckpoint, async_torch_save,  # noqa: E402
                         connect, dcp)

SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time: long enough to lose a race without ordering


def save_and_load(state, path, **kwargs):
    queue = AsyncCallsQueue()
    request = async_torch_save(state, path, **kwargs)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    return torch.load(path, weights_only=True), request


@pytest.mark.parametrize("mapping", ["miss", "hit"])
def test_the_copy_is_ordered_after_the_producers_kernels(daemon, monkeypatch, mapping):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    x = torch.zeros(1 << 20, device="cuda")
    if mapping == "hit":  # the daemon maps x's storage twice in a row: cached afterwards
        for i in range(2):
            save_and_load({"x": x}, os.path.join(daemon.roots[0], f"warm{i}.pt"))
    torch.cuda._sleep(SLEEP_CYCLES)  # queue a long kernel, then the write the save must see
    x.fill_(7.0)
    loaded, _ = save_and_load({"x": x}, os.path.join(daemon.roots[0], "ordered.pt"))
    assert torch.all(loaded["x"] == 7.0), "the daemon copied before the producer's kernels ran"


def test_views_the_daemon_keeps_between_saves_copy_each_saves_values(daemon, monkeypatch):
    # The daemon reuses a trainer's copy views while its descriptions repeat: every save
    # must still hold its own values, also as entries around them change (a temporary, a
    # storage seen through another view, a reordered or shorter state).
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    weight = torch.randn(256, 128, device="cuda")
    bias = torch.randn(128, device="cuda")
    steps = [lambda: {"w": weight, "b": bias, "tmp": weight[:4] * 2},
             lambda: {"w": weight, "b": bias, "tmp": weight[:4] * 3},
             lambda: {"w": weight.t(), "b": bias, "tmp": bias[:8] + 1},
             lambda: {"b": bias, "w": weight},
             lambda: {"w": weight, "b": bias, "tmp": weight[:4] * 2}]
    for n, make in enumerate(steps * 2):
        state = make()
        expected = {k: v.cpu() for k, v in state.items()}
        loaded, _ = save_and_load(state, os.path.join(daemon.roots[0], f"reuse{n}.pt"))
        assert list(loaded) == list(expected)
        for key in expected:
            assert torch.equal(loaded[key], expected[key]), (n, key)
        weight.add_(1)  # the optimizer step
        bias.mul_(2)


def test_mutating_right_after_the_save_returns_does_not_change_it(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    x = torch.full((1 << 20,), 3.0, device="cuda")
    path = os.path.join(daemon.roots[0], "m.pt")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(async_torch_save({"x": x}, path))
    x.mul_(0)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert torch.all(torch.load(path, weights_only=True)["x"] == 3.0)


def test_odd_tensors_and_the_transport_each_took(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    base = torch.arange(64, dtype=torch.float32, device="cuda").view(8, 8)
    state = {"empty": torch.empty(0, 3, device="cuda"), "strided": base.t(),
             "flags": base > 10, "fp8a": base.to(torch.float8_e4m3fn),
             "fp8b": base.to(torch.float8_e5m2), "dense": base.clone(),
             "step": torch.tensor(5.0)}  # a CPU tensor in the same save: mixed transport
    loaded, request = save_and_load(state, os.path.join(daemon.roots[0], "odd.pt"))
    for key, value in state.items():  # as bytes (fp8 has no equality); reshape: 0-dim too
        assert torch.equal(loaded[key].reshape(-1).view(torch.uint8),
                           value.cpu().reshape(-1).view(torch.uint8)), key
    moved = request.daemon_saves[0].transport_bytes
    assert moved["cuda"] > 0 and moved["shm"] >= 4, moved  # dense/fp8 by IPC, the rest by shm


def shm_torch_files() -> int:
    return sum(1 for n in os.listdir("/dev/shm") if n.startswith("torch_"))


def test_gpu_memory_and_shared_files_stay_flat_over_50_saves(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model = torch.nn.Linear(1024, 1024).cuda()
    checkpoint = TorchAsyncCheckpoint()
    for i in range(5):  # warm-up: mappings cached, allocator settled
        checkpoint.async_save(model.state_dict(), os.path.join(daemon.roots[0], "w.pt"))
        checkpoint.finalize_async_save(blocking=True)
    torch.cuda.ipc_collect()
    memory, files = torch.cuda.memory_reserved(), shm_torch_files()
    for i in range(50):
        temporary = model.weight * 2  # a temporary saved once: must not stay pinned
        checkpoint.async_save({"w": model.weight, "t": temporary},
                              os.path.join(daemon.roots[0], "w.pt"))
        checkpoint.finalize_async_save(blocking=True)
        del temporary
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_reserved() <= memory + (8 << 20)
    assert shm_torch_files() <= files + 2


#: torch maps its counter files with a RefcountedMapAllocator, which keeps its own count
#: of the processes mapping the file in the first 64 bytes; the int64 counters follow.
COUNTER_FILE_HEADER = 64


def ipc_counter(export: tuple) -> int:
    """The value of an export's reference counter, read from torch's counter file."""
    handle, offset = export
    name = handle.decode() if isinstance(handle, bytes) else handle
    with open("/dev/shm/" + name.lstrip("/"), "rb") as f:
        f.seek(COUNTER_FILE_HEADER + 8 * offset)
        return int.from_bytes(f.read(8), "little", signed=True)


def in_expandable_segment(tensor: torch.Tensor) -> bool:
    """Whether the allocator put ``tensor`` in an expandable segment (shared through
    ``pidfd_getfd``, unlike ordinary segments)."""
    return any(s.get("is_expandable") and s["address"] <= tensor.data_ptr()
               < s["address"] + s["total_size"] for s in torch.cuda.memory_snapshot())


def set_allocator(settings: str) -> None:
    """Change the CUDA allocator's settings at run time (the accelerator-neutral call
    where this torch has it; the CUDA one is deprecated there)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


def test_each_storage_is_exported_twice_and_its_counter_paid_once(daemon, monkeypatch):
    from ckpt_client.transport.cuda_exports import export_cache

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    held = []
    for i in range(6):  # state_dict() makes new tensor objects every time
        loaded, _ = save_and_load(model.state_dict(), os.path.join(daemon.roots[0], f"c{i}.pt"))
        held.append(export_cache(connect()).held_exports)
    parameters = len(list(model.parameters()))
    assert held[0] == set(), "nothing is kept open after a storage's first save"
    assert len(held[1]) == parameters and held[1] == held[2] == held[5], \
        "from the second save on, each parameter's export is held and re-sent, not re-made"
    assert [ipc_counter(e) for e in held[5]] == [1] * parameters, "one release owed, not paid"
    torch.cuda.ipc_collect()
    before = torch.cuda.memory_allocated()
    temporary = torch.randn(1 << 20, device="cuda")
    loaded, _ = save_and_load({"only": model[0].weight, "tmp": temporary},
                              os.path.join(daemon.roots[0], "c.pt"))
    assert all(ipc_counter(e) == 0 for e in held[5] - export_cache(connect()).held_exports), \
        "an export the daemon dropped is paid exactly once (never negative, never left at 1)"
    del temporary
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == before, \
        "the temporary's block stays in limbo: the daemon did not pay its release after its save"


def test_refused_and_failed_saves_leak_nothing(daemon, monkeypatch, tmp_path):
    from ckpt_client.errors import DaemonRequestError

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    torch.cuda.ipc_collect()
    before = torch.cuda.memory_allocated()
    for i in range(10):
        x = torch.ones(1 << 20, device="cuda")
        with pytest.raises(DaemonRequestError, match="outside the allowed roots"):
            async_torch_save({"x": x}, str(tmp_path / "outside.pt"))
        del x
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() <= before
    assert daemon.status()["pool"]["used_bytes"] == 0


TRAINER = """
import os, sys, torch
from ckpt_client import async_torch_save
x = torch.ones(256 << 20, device="cuda")
request = async_torch_save({"x": x}, sys.argv[1], zero_stall=True)
print("queued", flush=True)
sys.stdin.read()
"""


def test_a_trainer_killed_mid_copy_leaves_the_daemon_usable(daemon, monkeypatch):
    env = {**os.environ, "CKPTD_SOCKET": daemon.socket}
    victim = subprocess.Popen([sys.executable, "-c", TRAINER,
                               os.path.join(daemon.roots[0], "victim.pt")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert victim.stdout.readline().strip() == b"queued"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 60, "the victim's space")
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    loaded, _ = save_and_load({"y": torch.full((16,), 2.0, device="cuda")},
                              os.path.join(daemon.roots[0], "after.pt"))
    assert torch.all(loaded["y"] == 2.0)


SAVER = """
import os, sys, torch
from ckpt_client import AsyncCallsQueue, async_torch_save
torch.manual_seed(int(sys.argv[2]))
x = torch.randn(4 << 20, device="cuda")
q = AsyncCallsQueue()
for i in range(5):
    q.schedule_async_request(async_torch_save({"x": x}, sys.argv[1] + f".{i}"))
q.maybe_finalize_async_calls(blocking=True, no_dist=True)
torch.save(x.cpu(), sys.argv[1] + ".expected")
"""


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"],
                         ids=["default-allocator", "expandable-segments"])
def test_several_trainers_at_once_and_expandable_segments(daemon, alloc_conf):
    env = {**os.environ, "CKPTD_SOCKET": daemon.socket, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    paths = [os.path.join(daemon.roots[0], f"t{i}") for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, p, str(i)], env=env)
             for i, p in enumerate(paths)]
    assert [p.wait(600) for p in procs] == [0, 0, 0]
    for path in paths:
        expected = torch.load(path + ".expected", weights_only=True)
        for i in range(5):
            assert torch.equal(torch.load(f"{path}.{i}", weights_only=True)["x"], expected)


def test_expandable_segments_switched_on_at_run_time(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    set_allocator("expandable_segments:True")
    torch.cuda.empty_cache()  # else x reuses a cached block of an ordinary segment
    try:
        x = torch.full((1 << 20,), 4.0, device="cuda")
        assert in_expandable_segment(x), "the test needs x in an expandable segment"
        # Either IPC works, or the fallback warns (naming the cause) and copies via shm.
        loaded, _ = save_and_load({"x": x}, os.path.join(daemon.roots[0], "exp.pt"))
        assert torch.all(loaded["x"] == 4.0)
    finally:
        x = None  # its segment can be released only once nothing holds it
        set_allocator("expandable_segments:False")
        torch.cuda.empty_cache()  # later tests get ordinary segments again


def test_a_daemon_the_kernel_denies_our_memory_gets_it_through_shm(start_daemon, monkeypatch):
    import warnings

    import seccomp
    from ckpt_client.transport.cuda_routing import ipc_blocked_reason

    daemon = start_daemon(preexec_fn=seccomp.deny(seccomp.PIDFD_GETFD))
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    set_allocator("expandable_segments:True")
    torch.cuda.empty_cache()  # else x reuses a cached block of an ordinary segment
    try:
        if ipc_blocked_reason(daemon.process.pid) is not None:
            pytest.skip("this machine's Yama scope routes expandable segments through shm "
                        "before any handle is sent")
        x = torch.full((1 << 20,), 6.0, device="cuda")
        assert in_expandable_segment(x), "the test needs x in an expandable segment"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded, request = save_and_load({"x": x}, os.path.join(daemon.roots[0], "den.pt"))
        assert torch.all(loaded["x"] == 6.0)
        moved = request.daemon_saves[0].transport_bytes
        assert moved["cuda"] == 0 and moved["shm"] >= x.nbytes, moved
        said = [str(w.message) for w in caught if "pidfd_getfd" in str(w.message)]
        assert said and "shared memory" in said[0], [str(w.message) for w in caught]
        assert connect().ipc_denied, "later saves must not try IPC again"
        x.fill_(8.0)
        loaded, request = save_and_load({"x": x}, os.path.join(daemon.roots[0], "den2.pt"))
        assert torch.all(loaded["x"] == 8.0) and request.daemon_saves[0].transport_bytes["cuda"] == 0
        assert "denied ckptd" in daemon.log()
    finally:
        x = None  # its segment can be released only once nothing holds it
        set_allocator("expandable_segments:False")
        torch.cuda.empty_cache()  # later tests get ordinary segments again


def test_a_daemon_that_sees_other_gpus_gets_tensors_through_shm(start_daemon, monkeypatch):
    daemon = start_daemon(env={"CUDA_VISIBLE_DEVICES": ""})  # the daemon sees no GPU at all
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    assert not connect().cuda_devices
    x = torch.full((1 << 16,), 9.0, device="cuda")
    loaded, request = save_and_load({"x": x}, os.path.join(daemon.roots[0], "blind.pt"))
    assert torch.all(loaded["x"] == 9.0)
    assert request.daemon_saves[0].transport_bytes["cuda"] == 0


def test_zero_stall_on_the_gpu_returns_before_the_copy_and_keeps_the_snapshot(daemon,
                                                                               monkeypatch):
    from ckpt_client import guard_optimizer

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model = torch.nn.Linear(2048, 2048).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    checkpoint = TorchAsyncCheckpoint()
    guard_optimizer(optimizer, checkpoint)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    path = os.path.join(daemon.roots[0], "zs.pt")
    checkpoint.async_save(model.state_dict(), path, zero_stall=True)
    model(torch.randn(64, 2048, device="cuda")).sum().backward()
    optimizer.step()  # waits for staging
    checkpoint.finalize_async_save(blocking=True)
    saved = torch.load(path, weights_only=True)
    assert all(torch.equal(saved[k], before[k]) for k in before)


def test_dcp_async_save_of_a_mixed_state(daemon, monkeypatch):
    import torch.distributed.checkpoint as DCP
    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    state = {"w": torch.randn(512, 512, device="cuda"), "step": torch.tensor(3.0)}
    directory = os.path.join(daemon.roots[0], "dcp-mixed")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(state, directory))
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = {"w": torch.zeros(512, 512), "step": torch.tensor(0.0)}
    DCP.load(loaded, storage_reader=FileSystemReader(directory))
    assert torch.equal(loaded["w"], state["w"].cpu()) and loaded["step"] == 3.0
