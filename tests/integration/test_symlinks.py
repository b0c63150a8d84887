"""Links planted in a (group-writable) checkpoint directory never redirect the daemon's writes.

A hostile neighbour who can write into the checkpoint directory plants symbolic links to a
victim file outside every allowed root: at the temporary names earlier releases used
(``.model.pt.<pid>.ckptd-tmp``, ``model.pt.ckptd-sum.tmp-<pid>``,
``..metadata.<pid>.ckptd-tmp``, for the daemon's and every writer's pid) and at the final
names of the checkpoint, its checksum records, ``.metadata``, a local part and its
``committed`` marker. The saves must succeed, load back bit for bit, and the victim must
stay untouched. A link at the final name of a torch file or ``.metadata`` points out of the
allowed roots, so that save is refused with a clear error instead (SPEC: symlink escape).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict, LocalCheckpointManager,
                         TorchAsyncCheckpoint, dcp)
from ckpt_client.errors import DaemonRequestError


def plant(directory, names, victim) -> None:
    os.makedirs(directory, exist_ok=True)
    for name in names:
        os.symlink(victim, os.path.join(directory, name))


def pids_of(daemon) -> list[int]:
    return [daemon.pid] + [w["pid"] for w in daemon.status()["writers"]]


def old_temporary_names(final: str, pids) -> list[str]:
    return [n for pid in pids for n in (f".{final}.{pid}.ckptd-tmp",
                                         f"{final}.ckptd-sum.tmp-{pid}")]


def test_planted_links_do_not_redirect_torch_dcp_or_local_saves(start_daemon, tmp_path,
                                                               monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious bytes outside every root")
    local_dir = tmp_path / "ckpt" / "local"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    root, pids = daemon.roots[0], pids_of(daemon)
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}

    plant(root, ["model.pt.ckptd-sum", *old_temporary_names("model.pt", pids)], victim)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(state, os.path.join(root, "model.pt"))
    checkpoint.finalize_async_save(blocking=True)
    loaded = torch.load(os.path.join(root, "model.pt"), weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7

    step = os.path.join(root, "step_1")
    plant(step, [".metadata.ckptd-sum", *old_temporary_names(".metadata", pids)], victim)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save({"w": state["w"]}, step))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    target = {"w": torch.zeros(1000)}
    DCP.load(target, storage_reader=FileSystemReader(step))
    assert torch.equal(target["w"], state["w"])

    iteration = local_dir / "ckpt" / "iter_0000003"
    plant(iteration, ["rank_0.part", "rank_0.part.ckptd-sum", "committed",
                      "committed.ckptd-sum", *old_temporary_names("rank_0.part", pids)], victim)
    manager = LocalCheckpointManager(local_dir / "ckpt", socket=daemon.socket)
    manager.save(BasicTensorAwareStateDict({"w": state["w"]}), 3)
    assert manager.find_latest() == 3
    assert torch.equal(manager.load()[0].state_dict["w"], state["w"])

    assert victim.read_bytes() == b"precious bytes outside every root"
    for final in (os.path.join(root, "model.pt"), os.path.join(step, ".metadata"),
                  iteration / "rank_0.part", iteration / "committed"):
        assert not os.path.islink(final), f"{final} is still the planted link"


def test_a_link_at_the_final_name_is_refused_as_an_escape(start_daemon, tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    daemon = start_daemon()
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    os.symlink(victim, os.path.join(daemon.roots[0], "model.pt"))
    with pytest.raises(DaemonRequestError, match="resolves to .*victim.txt.*outside the allowed"):
        TorchAsyncCheckpoint().async_save({"w": torch.ones(3)},
                                          os.path.join(daemon.roots[0], "model.pt"))
    assert victim.read_bytes() == b"precious"
