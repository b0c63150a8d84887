"""Zero-stall saves: the call returns at once, and the snapshot is still exact.

A zero-stall save queues its staging and returns; ``guard_optimizer`` makes the next
``optimizer.step()`` wait until the bytes are in the daemon's pool. To make the window
real (not a race the test hopes to win), staging is held by real back-pressure: the
daemon's writers are paused while an earlier save fills the staging pool, so the zero-
stall save cannot get its extent until the test lets the writers go. Meanwhile the
optimizer step must be blocked, and afterwards the checkpoint must equal the parameters
*before* the step, bit for bit.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from conftest import wait_for
from faults import writers_paused
from multirank import collect, start_ranks, values

from ckpt_client import (AsyncCallsQueue, CheckpointException, TorchAsyncCheckpoint, dcp,
                         guard_optimizer)

POOL = "12M"  # one 8 MiB model state fits, two do not


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optimizer)  # Adam state exists from here on
    return model, optimizer


def step(model, optimizer) -> None:
    loss = model(torch.randn(8, 1024)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def phases(daemon) -> list[str]:
    return [r["phase"] for r in daemon.status()["requests"]]


def second_save_held_by_back_pressure(daemon, checkpoint, model, first, second) -> None:
    """Fill the pool with ``first`` (writers paused), then start ``second``: it must wait."""
    checkpoint.async_save(model.state_dict(), first, zero_stall=True)
    checkpoint.wait_for_staging(timeout=60)  # the pool is now full until writers run
    checkpoint.async_save(model.state_dict(), second, zero_stall=True)  # returns at once
    wait_for(lambda: phases(daemon)[-1:] == ["waiting_for_pool"], 30, "back-pressure")


@pytest.fixture
def guarded(start_daemon, monkeypatch):
    """A daemon with a small pool, a model, its guarded optimizer and a checkpointer."""
    daemon = start_daemon(pool_size=POOL)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model, optimizer = model_and_optimizer()
    checkpoint = TorchAsyncCheckpoint()
    handle = guard_optimizer(optimizer, checkpoint)
    return daemon, model, optimizer, checkpoint, handle


def test_a_guarded_step_waits_for_staging_and_the_file_holds_the_pre_step_weights(guarded):
    daemon, model, optimizer, checkpoint, handle = guarded
    first, second = (os.path.join(daemon.roots[0], n) for n in ("first.pt", "second.pt"))
    before = snapshot(model)
    with writers_paused(daemon):
        second_save_held_by_back_pressure(daemon, checkpoint, model, first, second)
        with pytest.raises(TimeoutError):
            checkpoint.wait_for_staging(timeout=0.2)
        stepped = threading.Event()
        worker = threading.Thread(target=lambda: (step(model, optimizer), stepped.set()))
        worker.start()
        assert not stepped.wait(1.0), "the optimizer stepped before the snapshot was staged"
    worker.join(60)  # writers run: the first save frees the pool, the second stages
    assert stepped.is_set()
    checkpoint.finalize_async_save(blocking=True)
    saved = torch.load(second, weights_only=True)
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not all(torch.equal(model.state_dict()[k], before[k]) for k in before), \
        "the step after the save must have changed the weights (else the test proves nothing)"
    handle.remove()
    assert not optimizer._optimizer_step_pre_hooks


def test_saves_reach_the_daemon_in_the_order_they_were_made(start_daemon, monkeypatch):
    """An ordinary save made while zero-stall saves are still queued here is sent after
    them (a CUDA export may only be re-sent on the daemon's word about the save before)."""
    from ckpt_client import async_torch_save

    daemon = start_daemon(pool_size=POOL)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model, _ = model_and_optimizer()
    state = model.state_dict()
    paths = {n: os.path.join(daemon.roots[0], f"{n}.pt") for n in ("x", "y", "z", "inline")}
    queue = AsyncCallsQueue()
    with writers_paused(daemon):
        queue.schedule_async_request(async_torch_save(state, paths["x"], zero_stall=True))
        queue.wait_for_staging(timeout=60)  # x fills the pool
        for name in ("y", "z"):  # y waits for space at the daemon; z waits here behind it
            queue.schedule_async_request(async_torch_save(state, paths[name], zero_stall=True))
        wait_for(lambda: phases(daemon)[-1:] == ["waiting_for_pool"], 30, "y held by back-pressure")
        inline: list = []
        worker = threading.Thread(target=lambda: inline.append(
            async_torch_save({"step": torch.tensor(1)}, paths["inline"])))
        worker.start()
        worker.join(1.0)  # time to overtake z, if it could
        assert worker.is_alive(), "the ordinary save finished while the pool was still full"
    worker.join(60)
    assert inline, "the ordinary save never returned"
    queue.schedule_async_request(inline[0])
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    ids = {r["path"]: r["id"] for r in daemon.status()["requests"]}
    order = sorted(paths, key=lambda n: ids[paths[n]])
    assert order == ["x", "y", "z", "inline"], f"the daemon got them in the order {order}"


def test_the_guard_does_not_wait_when_staging_is_done(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model, optimizer = model_and_optimizer()
    queue = AsyncCallsQueue()
    guard_optimizer(optimizer, queue)
    queue.schedule_async_request(dcp.async_save(model.state_dict(),
                                                os.path.join(daemon.roots[0], "s"),
                                                zero_stall=True))
    queue.wait_for_staging(timeout=60)
    queue.wait_for_staging(timeout=0)  # already staged: returns at once, no TimeoutError
    step(model, optimizer)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert os.path.exists(os.path.join(daemon.roots[0], "s", ".metadata"))


def test_a_daemon_that_dies_during_staging_fails_the_guarded_step_instead_of_hanging(guarded):
    daemon, model, optimizer, checkpoint, _ = guarded
    with writers_paused(daemon) as writers:
        second_save_held_by_back_pressure(daemon, checkpoint, model,
                                          *(os.path.join(daemon.roots[0], n) for n in ("a.pt", "b.pt")))
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.process.wait()
        with pytest.raises(CheckpointException, match="died"):
            step(model, optimizer)
        for pid in writers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def zero_stall_dcp_rank(rank, world_size, root, signals):
    """Two zero-stall DCP saves; the second waits for pool space while writers are paused."""
    import time

    model, optimizer = model_and_optimizer(seed=rank)
    # Per-rank keys: DCP would let only one rank write a tensor every rank has.
    mine = lambda: {f"rank{rank}.{k}": v for k, v in model.state_dict().items()}
    queue = AsyncCallsQueue()
    guard_optimizer(optimizer, queue)
    queue.schedule_async_request(dcp.async_save(mine(), os.path.join(root, "one"),
                                                zero_stall=True))
    step(model, optimizer)  # waits (guard) until "one" is staged
    before = {k: v.detach().clone() for k, v in mine().items()}
    started = time.monotonic()
    queue.schedule_async_request(dcp.async_save(mine(), os.path.join(root, "two"),
                                                zero_stall=True))
    returned_after = time.monotonic() - started
    open(os.path.join(signals, f"queued{rank}"), "w").close()
    step(model, optimizer)  # must wait until "two" is staged
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = {k: torch.zeros_like(v) for k, v in before.items()}
    DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, "two")))
    changed = not all(torch.equal(mine()[k], before[k]) for k in before)
    return all(torch.equal(loaded[k], before[k]) for k in before), changed, returned_after


def test_zero_stall_dcp_on_two_ranks_keeps_the_pre_step_snapshot(start_daemon, tmp_path):
    daemon = start_daemon(pool_size="20M")  # both ranks' first saves fit, no more
    signals = tmp_path / "signals"
    signals.mkdir()
    with writers_paused(daemon):
        processes, results = start_ranks(zero_stall_dcp_rank, 2, daemon.socket, tmp_path,
                                         args=(daemon.roots[0], str(signals)))
        wait_for(lambda: all((signals / f"queued{r}").exists() for r in range(2)), 120,
                 "both ranks to queue their second save")
        wait_for(lambda: phases(daemon).count("waiting_for_pool") >= 1, 30, "back-pressure")
    outcomes = values(collect(processes, results, timeout=240))
    for exact, changed, returned_after in outcomes:
        assert exact, "the checkpoint must hold the weights from before the guarded step"
        assert changed


@pytest.mark.parametrize("zero_stall", [True, False], ids=["zero_stall", "default"])
@pytest.mark.parametrize("format_", ["torch", "dcp"])
def test_a_finished_save_keeps_no_reference_to_the_tensors_it_saved(
        daemon, monkeypatch, format_, zero_stall):
    """Once a save is finalized nothing of ckpt_client holds its tensors' memory (on a GPU
    that is device memory, and a temporary saved once must not outlive its save), and
    reference counting alone frees it: the cyclic collector is off here, so a reference
    cycle holding the tensors fails the test as it held GPU memory on a device (the state
    dict walk's recursive closure did, until the collector's next pass). The background
    stager used to keep its last job, and with it every source, until the next save."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)  # where ckpt_client.dcp saves go
    tensor = torch.ones(1 << 16)
    storage = StorageWeakRef(tensor.untyped_storage())
    state = {"w": tensor, "nested": {"t": [tensor * 2]}, "step": 3}
    gc.collect()
    gc.disable()
    try:
        if format_ == "torch":
            checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
            try:
                checkpoint.async_save(state, os.path.join(daemon.roots[0], "z.pt"),
                                      zero_stall=zero_stall)
                checkpoint.finalize_async_save(blocking=True)
            finally:
                checkpoint.close()
        else:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(dcp.async_save(
                state, os.path.join(daemon.roots[0], "z"), zero_stall=zero_stall))
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            queue.close()
        temporary = StorageWeakRef(state["nested"]["t"][0].untyped_storage())
        del tensor, state
        assert storage.expired(), "the saved tensor's memory is still referenced"
        assert temporary.expired(), "a temporary saved once is still referenced"
    finally:
        gc.enable()


@pytest.mark.parametrize("zero_stall", [True, False], ids=["zero_stall", "default"])
def test_stock_dcp_async_save_through_a_stager_keeps_no_reference_to_its_tensors(
        daemon, monkeypatch, zero_stall):
    """Stock ``dcp.async_save`` with ckptd's ``Stager``: once the save is durable,
    reference counting alone frees its tensors although the stager lives on and keeps
    its last ticket until its next save (the collector is off: a ticket that still held
    the state dict fails this; on a GPU it held device memory until the next save)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stager = dcp.Stager(zero_stall=zero_stall)
    state = {"w": torch.ones(1 << 16), "nested": {"t": [torch.ones(1 << 10) * 2]}}
    storages = [StorageWeakRef(state["w"].untyped_storage()),
                StorageWeakRef(state["nested"]["t"][0].untyped_storage())]
    gc.collect()
    gc.disable()
    try:
        response = DCP.async_save(
            state, storage_writer=dcp.StorageWriter(os.path.join(daemon.roots[0], "stock")),
            async_stager=stager)
        (response.upload_completion if zero_stall else response).result(timeout=120)
        del state, response
        assert all(s.expired() for s in storages), \
            "the save's tensors are still referenced after it was durable"
    finally:
        gc.enable()
        stager.close()


@pytest.mark.parametrize("format_", ["torch", "dcp"])
def test_a_zero_stall_save_keeps_the_values_of_parameters_rebound_before_their_copy(
        start_daemon, monkeypatch, format_):
    """A state dict of the Parameters themselves (``keep_vars=True``, as sharded trainers
    build them), saved zero-stall while back-pressure holds its copy; then the module is
    converted (``half()`` rebinds every ``param.data`` to a new tensor, nothing in place,
    so the optimizer guard has nothing to wait for). The checkpoint must hold the values
    and dtype of the call, not what the Parameters point to when the copy runs."""
    daemon = start_daemon(pool_size=POOL)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)  # where ckpt_client.dcp saves go
    model, _ = model_and_optimizer()
    before = snapshot(model)
    root = daemon.roots[0]
    first, second = (os.path.join(root, name) for name in ("first", "second"))
    queue = AsyncCallsQueue()
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)

    def save(state, path):
        if format_ == "torch":
            checkpoint.async_save(state, path, zero_stall=True)
        else:
            queue.schedule_async_request(dcp.async_save(state, path, zero_stall=True))

    with writers_paused(daemon):
        save(model.state_dict(), first)
        (checkpoint if format_ == "torch" else queue).wait_for_staging(timeout=60)
        save(model.state_dict(keep_vars=True), second)
        wait_for(lambda: "waiting_for_pool" in phases(daemon), 30, "the second save to wait")
        model.half()
    if format_ == "torch":
        checkpoint.finalize_async_save(blocking=True)
        saved = torch.load(second, weights_only=True)
    else:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        saved = {k: torch.zeros_like(v) for k, v in before.items()}
        DCP.load(saved, storage_reader=FileSystemReader(second))
    checkpoint.close()
    queue.close()
    changed = [k for k in before if saved[k].dtype != before[k].dtype
               or not torch.equal(saved[k], before[k])]
    assert not changed, f"saved values differ from those at the save call: {changed}"
