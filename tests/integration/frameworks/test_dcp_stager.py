"""Stock ``torch.distributed.checkpoint.async_save`` with ckptd's writer and stager.

Two real ranks in a gloo group, a real daemon; every executor type stock DCP offers
(thread, process) in both stager forms (blocking, and zero-stall returning torch's
``AsyncSaveResponse``). After staging is reported the ranks change their parameters at
once: the checkpoint must still hold the values from before, bit for bit, and load with
stock ``dcp.load``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from multirank import run_ranks, values

from ckpt_client import CheckpointException, DaemonUnavailableError, dcp

VARIANTS = [(kind, zero_stall) for kind in ("thread", "process") for zero_stall in (False, True)]


def _model():
    torch.manual_seed(0)  # replicated, as under DDP: DCP spreads the items over the ranks
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _save_every_variant(rank, world_size, root):
    warnings.simplefilter("ignore", FutureWarning)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's helper process joins its own group
    group = dist.new_group(backend="gloo")   # saves must not share the training group
    model, optimizer = _model()
    results = {}
    for kind, zero_stall in VARIANTS:
        path = os.path.join(root, f"{kind}-{zero_stall}")
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_exp_avg = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"].clone()
        response = DCP.async_save(
            {"model": model.state_dict(), "optim": optimizer.state_dict()},
            storage_writer=dcp.StorageWriter(path), async_stager=dcp.Stager(zero_stall=zero_stall),
            process_group=group, async_checkpointer_type=AsyncCheckpointerType(kind))
        if zero_stall:
            assert isinstance(response, AsyncSaveResponse), type(response)
            response.staging_completion.result(timeout=120)
            upload = response.upload_completion
        else:
            assert not isinstance(response, AsyncSaveResponse)
            upload = response
        with torch.no_grad():  # the trainer goes on at once: the checkpoint must not see it
            for p in model.parameters():
                p.add_(1.0)
        optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"].add_(1.0)
        upload.result(timeout=180)
        dist.barrier(group)
        loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
        DCP.load(loaded, storage_reader=FileSystemReader(path), process_group=group)
        same_model = all(torch.equal(loaded["model"][k], expected[k]) for k in expected)
        optim_sd = {"optim": optimizer.state_dict()}
        DCP.load(optim_sd, storage_reader=FileSystemReader(path), process_group=group)
        state0 = optim_sd["optim"]["state"][0]["exp_avg"]
        results[f"{kind}-{zero_stall}"] = (same_model, torch.equal(state0, expected_exp_avg))
    return results


def test_stock_async_save_every_executor_and_form(daemon, tmp_path):
    """Thread and process executors, blocking and zero-stall: exact, loadable checkpoints."""
    root = os.path.join(daemon.roots[0], "stock")
    outcomes = values(run_ranks(_save_every_variant, 2, daemon.socket, tmp_path, args=(root,),
                                daemon=False, timeout=280))
    expected = {f"{kind}-{zs}": (True, True) for kind, zs in VARIANTS}
    assert outcomes == [expected, expected]
    for kind, zero_stall in VARIANTS:
        names = os.listdir(os.path.join(root, f"{kind}-{zero_stall}"))
        assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) >= 2


def test_path_outside_roots_fails_the_staging_with_the_path(daemon, tmp_path, monkeypatch):
    """A directory the daemon does not allow: staging fails naming it, nothing written."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    outside = str(tmp_path / "not-a-root")
    response = DCP.async_save({"w": torch.ones(8)}, storage_writer=dcp.StorageWriter(outside),
                              async_stager=dcp.Stager(zero_stall=True), no_dist=True)
    with pytest.raises(CheckpointException) as caught:
        response.staging_completion.result(timeout=60)
    assert outside in str(caught.value)
    # torch's CheckpointException derives from BaseException
    with pytest.raises(BaseException, match="outside the allowed roots"):
        response.upload_completion.result(timeout=60)
    assert not os.path.exists(os.path.join(outside, ".metadata"))
    # The blocking form raises from async_save itself.
    with pytest.raises(CheckpointException, match="not-a-root"):
        DCP.async_save({"w": torch.ones(8)}, storage_writer=dcp.StorageWriter(outside),
                       async_stager=dcp.Stager(), no_dist=True)


def test_no_daemon_names_the_socket(tmp_path, monkeypatch):
    """No daemon answering (and no auto-start): the error names the socket and the fix."""
    socket = str(tmp_path / "nobody" / "ckptd.sock")
    monkeypatch.setenv("CKPTD_SOCKET", socket)
    monkeypatch.setenv("CKPTD_AUTO_START", "0")
    with pytest.raises(CheckpointException) as caught:
        DCP.async_save({"w": torch.ones(8)}, storage_writer=dcp.StorageWriter(tmp_path / "x"),
                       async_stager=dcp.Stager(), no_dist=True)
    assert socket in str(caught.value) and DaemonUnavailableError.__name__ in str(caught.value)


def test_stager_with_a_stock_writer_is_refused_clearly(daemon, tmp_path, monkeypatch):
    """Only ckptd's writer stages a ticket: a stock writer gets an error saying so."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    with pytest.raises(CheckpointException, match="ckpt_client.dcp.StorageWriter"):
        DCP.async_save({"w": torch.ones(8)}, storage_writer=FileSystemWriter(tmp_path / "stock"),
                       async_stager=dcp.Stager(), no_dist=True)
