"""Lightning with ``CkptdCheckpointIO``: real Trainer, real daemon, SIGKILL mid-save, resume.

A trainer saves every 2 steps (``ModelCheckpoint(save_top_k=2, save_last=True)``); while
the daemon is writing the save of step 6 (its writers paused) the trainer is SIGKILLed.
The save of step 6 must never look complete, ``last.ckpt`` must still be step 4's, the
``save_top_k`` rotation must have deleted only durable files, and
``Trainer.fit(ckpt_path="last")`` must restore exactly the model, optimizer and scheduler
state saved at step 4.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

from frameworks_common import KilledRun, assert_same, files_under  # noqa: E402


def test_killed_mid_save_resumes_from_last_exactly(daemon, tmp_path):
    ckpt = os.path.join(daemon.roots[0], "lightning")
    run = KilledRun(daemon, tmp_path, "lightning_run.py", ckpt)
    run.kill_mid_save(12)

    # step 6 never appeared; rotating step 2 out waited for step 6, so it is still there
    names = [n for n in files_under(ckpt) if not n.endswith(".ckptd-sum")]
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], names
    last = torch.load(os.path.join(ckpt, "last.ckpt"), weights_only=True)  # stock torch.load
    assert last["global_step"] == 4

    run.resume(8)
    assert_same(run.reference("resumed"), run.reference("step-4"))
    # the resumed run went on saving, and the top-2 rotation removed durable files only
    names = [n for n in files_under(ckpt) if not n.endswith(".ckptd-sum")]
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], names


def test_plugin_contract(daemon, tmp_path, monkeypatch):
    """Lightning's CheckpointIO expectations (its TorchCheckpointIO tests): save, load
    the same values, storage_options refused, remove; plus a clear refusal outside the
    daemon's roots."""
    from ckpt_client import DaemonRequestError
    from ckpt_client.integrations.lightning import CkptdCheckpointIO

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    io = CkptdCheckpointIO()
    path = os.path.join(daemon.roots[0], "sub", "model.ckpt")
    weights = torch.randn(64, 64)
    io.save_checkpoint({"w": weights, "epoch": 3, "name": "x"}, path)
    expected = weights.clone()
    weights.add_(1.0)  # after save_checkpoint returns, the checkpoint no longer aliases it
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["w"], expected) and loaded["epoch"] == 3
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": weights}, path, storage_options={"x": 1})
    io.remove_checkpoint(path)
    assert not os.path.exists(path) and not os.path.exists(path + ".ckptd-sum")
    with pytest.raises(DaemonRequestError, match="outside the allowed roots"):
        io.save_checkpoint({"w": weights}, str(tmp_path / "elsewhere" / "m.ckpt"))
    io.teardown()
