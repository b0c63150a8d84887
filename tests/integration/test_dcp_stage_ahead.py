"""A ``Stager`` that remembers the save plan stages a save before DCP plans it.

Real daemon, stock ``torch.distributed.checkpoint.async_save`` (thread executor) with
ckptd's writer and one ``Stager`` for every save. The planner is DCP's default one with
a gate in ``create_global_plan`` (a real planner that waits, not a mock): while the gate
is shut, a save whose structure is unchanged must still be staged and release the
trainer, and must hold the values from the moment of the call, loaded by stock
``dcp.load``. A save whose planning fails after it was staged ahead leaves nothing.
With the process executor (planning in DCP's helper process, gated by a file) the
trainer is released before planning too, without plan reuse.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from conftest import wait_for
from ckpt_client import dcp


class GatedPlanner(DefaultSavePlanner):
    """DCP's default planner whose global planning waits for ``gate`` (or fails)."""

    def __init__(self, gate: threading.Event, fail: bool = False) -> None:
        super().__init__()
        self.gate, self.fail, self.entered = gate, fail, threading.Event()

    def create_global_plan(self, all_plans):
        self.entered.set()
        self.gate.wait(120)
        if self.fail:
            raise RuntimeError("global planning failed (test)")
        return super().create_global_plan(all_plans)


def state(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def loaded(path, like: dict) -> dict:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    DCP.load({"model": target}, storage_reader=FileSystemReader(path))
    return target


@pytest.fixture
def trained():
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def bump(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


@pytest.mark.parametrize("zero_stall", [False, True])
def test_an_unchanged_structure_is_staged_before_dcp_plans_it(daemon, trained, zero_stall,
                                                              monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model, optimizer = trained
    stager = dcp.Stager(zero_stall=zero_stall)
    root = daemon.roots[0]

    def save(path, planner):
        response = DCP.async_save(state(model, optimizer), storage_writer=dcp.StorageWriter(path),
                                  async_stager=stager, planner=planner)
        if zero_stall:
            response.staging_completion.result(timeout=120)
            return response.upload_completion
        return response

    open_gate = threading.Event()
    open_gate.set()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    save(os.path.join(root, "first"), GatedPlanner(open_gate)).result(timeout=120)
    assert all(torch.equal(loaded(os.path.join(root, "first"), first)[k], v)
               for k, v in first.items())

    bump(model)
    second = {k: v.clone() for k, v in model.state_dict().items()}
    shut = threading.Event()
    planner = GatedPlanner(shut)
    upload = save(os.path.join(root, "second"), planner)  # returns although planning waits
    assert not upload.done()
    bump(model)  # training goes on while DCP still plans: the checkpoint must not see it
    shut.set()
    upload.result(timeout=120)
    assert planner.entered.is_set()
    got = loaded(os.path.join(root, "second"), second)
    assert all(torch.equal(got[k], v) for k, v in second.items())

    # A changed structure plans from scratch (the gate is open) and is right too.
    model.add_module("extra", torch.nn.Linear(64, 8))
    third = {k: v.clone() for k, v in model.state_dict().items()}
    save(os.path.join(root, "third"), GatedPlanner(open_gate)).result(timeout=120)
    got = loaded(os.path.join(root, "third"), third)
    assert all(torch.equal(got[k], v) for k, v in third.items())
    stager.close()


def test_a_save_whose_planning_fails_after_staging_ahead_leaves_nothing(daemon, trained,
                                                                        monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    model, optimizer = trained
    stager = dcp.Stager()
    gate = threading.Event()
    gate.set()
    root = daemon.roots[0]
    DCP.async_save(state(model, optimizer), storage_writer=dcp.StorageWriter(f"{root}/ok"),
                   async_stager=stager, planner=GatedPlanner(gate)).result(timeout=120)
    failing = os.path.join(root, "failing")
    upload = DCP.async_save(state(model, optimizer), storage_writer=dcp.StorageWriter(failing),
                            async_stager=stager, planner=GatedPlanner(gate, fail=True))
    with pytest.raises(DCPCheckpointException) as info:  # carrying the planner's error
        upload.result(timeout=120)
    assert "global planning failed" in repr(info.value.args)
    # Aborted, or (when its writes won the race) forgotten with its files deleted.
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0
             and (not os.path.exists(failing) or os.listdir(failing) == []), 60,
             "the daemon to drop the save staged ahead and its files")
    assert all(r["phase"] != "writing" for r in daemon.status()["requests"])
    stager.close()


def _three_saves_of_a_replicated_model(rank, world_size, root):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    group = dist.new_group(backend="gloo")  # saves must not share the training group
    torch.manual_seed(0)  # replicated: DCP's global plan takes items away from rank 1
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    stager, same = dcp.Stager(), []
    for step in range(3):
        path = os.path.join(root, f"step-{step}")
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        upload = DCP.async_save({"model": model.state_dict()},
                                storage_writer=dcp.StorageWriter(path), async_stager=stager,
                                process_group=group)
        bump(model)  # released: the checkpoint must hold the values of the call
        upload.result(timeout=120)
        dist.barrier(group)
        target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
        DCP.load(target, storage_reader=FileSystemReader(path), process_group=group)
        same.append(all(torch.equal(target["model"][k], v) for k, v in expected.items()))
    stager.close()
    return same


def test_two_ranks_stage_ahead_a_replicated_model_whose_items_dcp_deduplicates(daemon,
                                                                               tmp_path):
    from multirank import run_ranks, values

    root = os.path.join(daemon.roots[0], "replicated")
    assert values(run_ranks(_three_saves_of_a_replicated_model, 2, daemon.socket, tmp_path,
                            args=(root,), daemon=False, timeout=240)) == [[True] * 3] * 2


class FileGatedPlanner(DefaultSavePlanner):
    """DCP's default planner whose global planning waits for a file to appear: unlike an
    event it crosses into the process executor's helper, where planning runs. It marks
    that planning started with ``<gate>.entered``."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def create_global_plan(self, all_plans):
        open(f"{self.gate}.entered", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the test's gate file, bounded
        return super().create_global_plan(all_plans)


def _saves_across_executors(rank, world_size, root):
    """One Stager: a thread save (it remembers the plan), a process save and a thread
    save, each released while its planning waits on a shut gate; what each holds."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's helper process joins its own group
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    stager, outcome = dcp.Stager(), []
    for name, kind in (("thread-1", "thread"), ("process", "process"), ("thread-2", "thread")):
        path, gate = os.path.join(root, name), os.path.join(root, f"{name}.gate")
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        if name == "thread-1":
            open(gate, "w").close()  # the first save plans from scratch: nothing to reuse
        upload = DCP.async_save({"model": model.state_dict()},
                                storage_writer=dcp.StorageWriter(path), async_stager=stager,
                                planner=FileGatedPlanner(gate),
                                async_checkpointer_type=AsyncCheckpointerType(kind))
        # (the first save is released once planned and staged: nothing to tell)
        released_before_planning = None if name == "thread-1" else not upload.done()
        bump(model)  # released: the checkpoint must hold the values of the call
        open(gate, "w").close()
        upload.result(timeout=180)
        got = loaded(path, expected)
        outcome.append((name, released_before_planning, os.path.exists(f"{gate}.entered"),
                        all(torch.equal(got[k], v) for k, v in expected.items())))
    stager.close()
    return outcome


def test_the_process_executor_releases_the_trainer_before_planning(daemon, tmp_path):
    """With ``AsyncCheckpointerType.PROCESS`` a ``Stager`` does not reuse plans, and need
    not: the trainer is released once the state is copied into the stager's shared
    memory, before the helper process plans. A process save between two thread saves
    of one Stager neither uses nor spoils the remembered plan: each save returns while
    its planning waits, and stock ``dcp.load`` reads exactly the values of its call."""
    from multirank import run_ranks, values

    root = os.path.join(daemon.roots[0], "executors")
    os.makedirs(root)
    [outcome] = values(run_ranks(_saves_across_executors, 1, daemon.socket, tmp_path,
                                 args=(root,), daemon=False, timeout=240))
    assert outcome == [("thread-1", None, True, True), ("process", True, True, True),
                       ("thread-2", True, True, True)]


#: Names of the threads a failed stock async_save through a Stager runs: DCP's executor,
#: the watch that aborts a save staged ahead, the zero-stall form's wait for staging.
SAVE_THREADS = ("AsyncCheckpointExecutor", "ckptd-stage-ahead-watch", "ckptd-stager-wait")


@pytest.mark.parametrize("zero_stall,ahead", [(False, True), (True, True), (True, False)],
                         ids=["default", "zero_stall", "zero_stall_not_ahead"])
def test_a_save_whose_planning_fails_frees_its_tensors_and_requests_at_once(
        daemon, monkeypatch, zero_stall, ahead):
    """A save (staged ahead with the remembered plan, or not) whose DCP planning fails:
    once its upload future has failed, the daemon holds none of its requests (the
    staged-ahead saves are aborted) and its tensors are freed although the stager lives
    on and keeps its last ticket until its next save (the collector is off but for one
    pass over DCP's own cycle: a ticket that kept the state dict fails this; on a GPU it
    held device memory until the next save)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root = daemon.roots[0]
    stager = dcp.Stager(zero_stall=zero_stall)
    gate = threading.Event()
    gate.set()

    def save(state, name, fail=False):
        response = DCP.async_save(state, storage_writer=dcp.StorageWriter(f"{root}/{name}"),
                                  async_stager=stager, planner=GatedPlanner(gate, fail=fail))
        return response.upload_completion if zero_stall else response

    def fresh() -> dict:
        return {"model": {"w": torch.ones(1 << 16)}, "optim": [torch.ones(1 << 10) * 2]}

    if ahead:
        save(fresh(), "ok").result(timeout=120)  # remembered: the next save is staged ahead
    state = fresh()
    storages = [StorageWeakRef(t.untyped_storage()) for t in (state["model"]["w"],
                                                               state["optim"][0])]
    gc.collect()
    gc.disable()
    try:
        upload = save(state, "failing", fail=True)
        del state
        failed = upload.exception(timeout=120)
        assert "global planning failed" in repr(failed.args)
        del upload, failed
        # DCP's failure is a reference cycle of its own (the planner's error keeps its
        # traceback, whose frames keep the error and the state dict): once every thread
        # of the save ended, one pass of the collector frees that, and nothing of
        # ckpt_client may keep the tensors beyond it.
        wait_for(lambda: not any(t.name.startswith(SAVE_THREADS)
                                 for t in threading.enumerate()), 30,
                 "the threads of the failed save to end")
        gc.collect()
        assert all(s.expired() for s in storages), "the failed save's tensors are kept"
        wait_for(lambda: not daemon.status()["saves"]
                 and daemon.status()["pool"]["used_bytes"] == 0, 30,
                 "the daemon to drop the saves staged ahead")  # their writers answer first
    finally:
        gc.enable()
        stager.close()
